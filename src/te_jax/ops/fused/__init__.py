"""te_jax's fusions, registered with ``te_jax.ops`` when it is imported."""

from te_jax.ops.fused.activation_bias_backward import (
    BackwardActivationBias,
    fuse_backward_activation_bias,
)
from te_jax.ops.fused.linear_bias_activation import (
    ForwardLinearBiasActivation,
    fuse_forward_linear_bias_activation,
)
from te_jax.ops.fused.linear_bias_add import ForwardLinearBiasAdd, fuse_forward_linear_bias_add
from te_jax.ops.fused.mlp import MLP, fuse_mlp

__all__ = [
    "MLP",
    "fuse_mlp",
    "ForwardLinearBiasActivation",
    "ForwardLinearBiasAdd",
    "BackwardActivationBias",
    "fuse_forward_linear_bias_activation",
    "fuse_forward_linear_bias_add",
    "fuse_backward_activation_bias",
]
