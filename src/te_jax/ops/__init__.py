"""``te_jax.ops``: a model as a sequence of small operations, run as fused kernels.

``Sequential(op, op, ...)`` holds basic operations (``Linear``, ``Bias``, ``Activation``,
``LayerNorm``, ``RMSNorm``, ``Quantize``, ``Dropout``, ``AddResidual``, ``AddExtraInput``,
``Identity``, or a ``BasicOperation`` of your own) and runs them as their fused plan: registered
fusions replace runs of basic ops by a ``FusedOperation`` (``MLP``: the two GEMMs of the MLP as
one ``te_jax.fused_mlp``; ``ForwardLinearBiasActivation``: one
GEMM with the bias and the activation in its epilogue; ``ForwardLinearBiasAdd``: one GEMM that
adds the bias and a residual in its own pass; ``BackwardActivationBias``: dact + dbias
+ quantize in one pass). Under an FP8 recipe each tensor is quantized once, by the op that
produces it, with the quantizer of the ``Linear`` that consumes it. docs/ops.md has the model,
the fusion table and how to add an op or a fusion. ``LinenSequential`` is the same in Linen.
"""

from te_jax.ops.base import (
    BasicOperation,
    FusedOperation,
    FusibleOperation,
    Handoff,
    OpArgs,
    OpGrads,
)
from te_jax.ops.basic import (
    Activation,
    AddExtraInput,
    AddResidual,
    Bias,
    Dropout,
    Identity,
    LayerNorm,
    Linear,
    Quantize,
    RMSNorm,
)
from te_jax.ops.context import OperationContext
from te_jax.ops.fused import (
    MLP,
    BackwardActivationBias,
    ForwardLinearBiasActivation,
    ForwardLinearBiasAdd,
    fuse_backward_activation_bias,
    fuse_forward_linear_bias_activation,
    fuse_forward_linear_bias_add,
    fuse_mlp,
)
from te_jax.ops.linen import LinenSequential
from te_jax.ops.registry import (
    fuse_pattern,
    register_backward_fusion,
    register_forward_fusion,
)
from te_jax.ops.sequential import Sequential

# In order: the MLP claims its five ops first, in both directions; a [Linear, Bias] followed by
# an added input goes to ForwardLinearBiasAdd before ForwardLinearBiasActivation's [Linear, Bias].
register_forward_fusion(fuse_mlp)
register_forward_fusion(fuse_forward_linear_bias_add)
register_forward_fusion(fuse_forward_linear_bias_activation)
register_backward_fusion(fuse_mlp)
register_backward_fusion(fuse_backward_activation_bias)

__all__ = [
    "Sequential",
    "LinenSequential",
    "OperationContext",
    "FusibleOperation",
    "BasicOperation",
    "FusedOperation",
    "OpArgs",
    "OpGrads",
    "Handoff",
    "Linear",
    "Bias",
    "Activation",
    "LayerNorm",
    "RMSNorm",
    "Quantize",
    "Dropout",
    "AddResidual",
    "AddExtraInput",
    "Identity",
    "ForwardLinearBiasActivation",
    "ForwardLinearBiasAdd",
    "BackwardActivationBias",
    "MLP",
    "register_forward_fusion",
    "register_backward_fusion",
    "fuse_pattern",
]
