"""Flax Linen modules on te_jax's fused dense: ``DenseGeneral``, ``LayerNorm``,
``LayerNormDenseGeneral`` and ``LayerNormMLP`` (names and arguments after TransformerEngine's
JAX modules), plus the FP8 state helpers.

FP8: give a module ``recipe=te_jax.recipe.DelayedScaling()`` (or ``CurrentScaling()``,
``MXFP8BlockScaling()``). Delayed scaling's state lives in the ``"fp8_metas"`` collection
(``FP8_COLLECTION``); its new value is the gradient of the loss with respect to that collection,
which a training step takes as the next state (``update_fp8_metas``) and never hands to the
optimizer. With ``fp8_collection="_overwrite_with_gradient"`` (``OVERWRITE_WITH_GRADIENT``) the
state lives in Flax's own collection for such variables, and an unmodified
``flax.training.train_state.TrainState.apply_gradients`` advances it. docs/flax.md shows both
training loops. ``from_transformer_engine`` loads TransformerEngine-JAX's variables of the same
modules. ``DotGeneral`` and ``EinsumOp`` put te_jax's GEMM (and a recipe) into stock Flax layers:
``nn.Dense(..., dot_general_cls=te_jax.flax.DotGeneral)``.
"""

from te_jax.flax.dot_general import DotGeneral, EinsumOp
from te_jax.flax.fp8_state import (
    FP8_COLLECTION,
    OVERWRITE_WITH_GRADIENT,
    merge_fp8_metas,
    update_fp8_metas,
)
from te_jax.flax.kernel_cache import QUANTIZED_KERNELS, quantize_kernels
from te_jax.flax.modules import DenseGeneral, LayerNorm, LayerNormDenseGeneral, LayerNormMLP
from te_jax.flax.te_variables import from_transformer_engine

__all__ = [
    "DenseGeneral",
    "LayerNorm",
    "LayerNormDenseGeneral",
    "LayerNormMLP",
    "DotGeneral",
    "EinsumOp",
    "FP8_COLLECTION",
    "OVERWRITE_WITH_GRADIENT",
    "update_fp8_metas",
    "merge_fp8_metas",
    "from_transformer_engine",
    "QUANTIZED_KERNELS",
    "quantize_kernels",
]
