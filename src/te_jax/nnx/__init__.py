"""Flax NNX modules on te_jax's fused dense: ``Linear``, ``LayerNorm``, ``LayerNormLinear`` and
``LayerNormMLP`` (the options of the Linen modules in ``te_jax.flax``, explicit ``rngs``), plus
the FP8 state helpers.

FP8: give a module ``recipe=te_jax.recipe.DelayedScaling()`` (or ``CurrentScaling()``,
``MXFP8BlockScaling()``). Delayed scaling's state lives in ``FP8Meta`` variables (an
``nnx.Variable`` subclass, so ``nnx.Optimizer(..., wrt=nnx.Param)`` never trains it); its new
value is the gradient of the loss with respect to them: differentiate with
``nnx.DiffState(0, (nnx.Param, FP8Meta))`` and apply ``update_fp8_state(model, grads)``.
docs/flax.md shows the training loop. ``DotGeneral`` puts te_jax's GEMM (and a recipe) into
stock NNX layers: ``nnx.Linear(..., dot_general=te_jax.nnx.DotGeneral(recipe))``,
``nnx.Einsum(..., einsum_op=te_jax.nnx.EinsumOp(recipe))``.
"""

from te_jax.nnx.dot_general import DotGeneral, EinsumOp
from te_jax.nnx.fp8_state import FP8Meta, QuantizerState, merge_fp8_state, update_fp8_state
from te_jax.nnx.modules import LayerNorm, LayerNormLinear, LayerNormMLP, Linear, quantize_kernels

__all__ = [
    "Linear",
    "LayerNorm",
    "LayerNormLinear",
    "LayerNormMLP",
    "DotGeneral",
    "EinsumOp",
    "FP8Meta",
    "QuantizerState",
    "update_fp8_state",
    "merge_fp8_state",
    "quantize_kernels",
]
