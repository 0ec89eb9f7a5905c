"""TransformerEngine-JAX's option names on te_jax's Linen modules: the ones te_jax honours, and a
clear error naming te_jax's way for the ones it does not take.

=============================  ==========================================================
TE-JAX option                  in te_jax
=============================  ==========================================================
``input_axes``                 DenseGeneral: a logical sharding constraint on the input
``layernorm_input_axes``       LayerNormDenseGeneral / LayerNormMLP: the same, on the input
``dot_input_axes``,            refused unless ``None``: the norm's output keeps the input's
``dot_1_input_axes``           sharding (constrain the input with ``layernorm_input_axes``)
``dot_2_input_axes``           refused unless ``None``: the intermediate lives inside the
                               fused MLP, split as ``kernel_axes_1``'s ``"mlp"`` name says
``intermediate_dropout_rng_``  LayerNormMLP: ``dropout_rng_name``'s TE name
``name``
``transpose_batch_sequence``   accepted, no effect: te_jax's modules treat every leading
                               axis alike (the layout of ``(batch, seq)`` never matters)
``axis``                       LayerNormMLP / LayerNormDenseGeneral: ``-1`` only (the norm's
                               axis), as in TE-JAX
``enable_low_rank_adaptation`` ``False`` only: te_jax has no LoRA
=============================  ==========================================================
"""

from __future__ import annotations

from collections.abc import Sequence

import jax

from te_jax import sharding

__all__ = ["constrain_input", "check_unsupported", "dropout_rng_name"]


def constrain_input(x: jax.Array, axes: Sequence[str | None] | None, where: str, field: str):
    """``x`` under the logical sharding constraint ``axes`` (one name per axis of x), or ``x``
    where ``axes`` is ``None``."""
    if axes is None:
        return x
    axes = tuple(axes)
    if len(axes) != x.ndim:
        raise ValueError(
            f"{where}: {field} must name one logical axis (or None) per input axis: the input "
            f"has shape {tuple(x.shape)}, got {axes}"
        )
    return sharding.logical_constraint(x, axes)


def check_unsupported(module, where: str, normed: bool = False) -> None:
    """A ValueError for each TE-JAX option ``module`` has set that te_jax does not take;
    ``normed``: a module with a norm, whose ``axis`` is the last one only."""
    for field, why in _UNSUPPORTED.items():
        value = getattr(module, field, None)
        if value is not None and value is not False:
            raise ValueError(f"{where}: {field}={value!r} is not supported: {why}")
    axis = getattr(module, "axis", -1)
    if normed and tuple(_tuple(axis)) != (-1,):
        raise ValueError(
            f"{where}: axis={axis!r} is not supported: the norm and the first GEMM contract the "
            "last axis only (as in TE-JAX); move the features last, or use "
            "te_jax.flax.DenseGeneral(axis=...) without the norm"
        )


def dropout_rng_name(module, where: str) -> str:
    """The rng stream of the intermediate dropout: ``dropout_rng_name``, or TE-JAX's
    ``intermediate_dropout_rng_name`` where that is set (the two must agree if both are)."""
    te_name = module.intermediate_dropout_rng_name
    if te_name is None:
        return module.dropout_rng_name
    if module.dropout_rng_name not in ("dropout", te_name):
        raise ValueError(
            f"{where}: intermediate_dropout_rng_name={te_name!r} and dropout_rng_name="
            f"{module.dropout_rng_name!r} name two rng streams: give one of them"
        )
    return te_name


def _tuple(axis):
    return axis if isinstance(axis, Sequence) else (axis,)


_UNSUPPORTED = {
    "dot_input_axes": (
        "the norm's output keeps its input's sharding; constrain the input with "
        "layernorm_input_axes"
    ),
    "dot_1_input_axes": (
        "the norm's output keeps its input's sharding; constrain the input with "
        "layernorm_input_axes"
    ),
    "dot_2_input_axes": (
        "the intermediate activation lives inside the fused MLP, split as the 'mlp' name of "
        "kernel_axes_1 says under the logical axis rules"
    ),
    "enable_low_rank_adaptation": "te_jax has no LoRA adapters",
}
