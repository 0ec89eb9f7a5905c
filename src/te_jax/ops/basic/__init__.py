"""te_jax's basic operations."""

from te_jax.ops.basic.activation import Activation
from te_jax.ops.basic.bias import Bias
from te_jax.ops.basic.linear import Linear
from te_jax.ops.basic.norm import LayerNorm, RMSNorm
from te_jax.ops.basic.simple import (
    AddExtraInput,
    AddInput,
    AddResidual,
    Dropout,
    Identity,
    Quantize,
)

__all__ = [
    "Linear",
    "Bias",
    "Activation",
    "LayerNorm",
    "RMSNorm",
    "Quantize",
    "Dropout",
    "AddInput",
    "AddResidual",
    "AddExtraInput",
    "Identity",
]
