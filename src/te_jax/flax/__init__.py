"""Flax Linen modules on te_jax's fused dense: ``DenseGeneral``, ``LayerNorm``,
``LayerNormDenseGeneral`` and ``LayerNormMLP`` (names and arguments after TransformerEngine's
JAX modules), plus the FP8 state helpers.

FP8: give a module ``recipe=te_jax.recipe.DelayedScaling()`` (or ``CurrentScaling()``,
``MXFP8BlockScaling()``). Delayed scaling's state lives in the ``"fp8_metas"`` collection
(``FP8_COLLECTION``); its new value is the gradient of the loss with respect to that collection,
which a training step takes as the next state (``update_fp8_metas``) and never hands to the
optimizer. docs/flax.md shows the training loop.
"""

from te_jax.flax.fp8_state import FP8_COLLECTION, merge_fp8_metas, update_fp8_metas
from te_jax.flax.modules import DenseGeneral, LayerNorm, LayerNormDenseGeneral, LayerNormMLP

__all__ = [
    "DenseGeneral",
    "LayerNorm",
    "LayerNormDenseGeneral",
    "LayerNormMLP",
    "FP8_COLLECTION",
    "update_fp8_metas",
    "merge_fp8_metas",
]
