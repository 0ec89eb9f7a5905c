"""Shapes of a quantized call: its geometry and its results (docs/numerics.md §4, §5).

The op's output ``y`` has shape ``batch + lead + feat``: ``batch`` are the ``batch_dims`` leading
axes added by ``vmap`` (each batch element is its own tensor, with its own scale and amax),
``feat`` the trailing feature axes (``(2, H)`` for a gated dact, else ``(H,)``). The quantized
results, in order, are the scaling mode's (``ScalingModeImpl.result_names``), then ``dbias``
(``batch + feat``, x's dtype) for a dact with ``is_dbias``.
"""

from __future__ import annotations

from jax.core import ShapedArray

from te_jax.activation_types import ActivationType
from te_jax.primitives.quantized.config import OpKind, QuantConfig
from te_jax.quantize.geometry import Geometry

__all__ = ["geometry", "result_names", "result_avals"]


def geometry(
    kind: OpKind, act: ActivationType | None, x_shape, batch_dims: int, cfg: QuantConfig
) -> Geometry:
    """The geometry of ``y`` for ``x`` of shape ``x_shape``."""
    return Geometry.of(kind.output_shape(act, x_shape), kind.n_feature_axes(act, cfg), batch_dims)


def result_names(kind: OpKind, cfg: QuantConfig, is_dbias: bool) -> tuple[str, ...]:
    """The results of the call, in order."""
    dbias = ("dbias",) if kind is OpKind.DACT and is_dbias else ()
    return cfg.spec.result_names(cfg.layout) + dbias


def result_avals(kind: OpKind, cfg: QuantConfig, is_dbias: bool, g: Geometry, dtype) -> dict:
    """``{result name: ShapedArray}`` in order; per-tensor results are ``batch + (1,)``."""
    shapes = cfg.spec.shapes(g, cfg.layout, cfg.q_dtype, per_tensor=(1,))
    avals = {n: ShapedArray(s.shape, s.dtype) for n, s in shapes.items()}
    if "dbias" in result_names(kind, cfg, is_dbias):
        avals["dbias"] = ShapedArray(g.batch + g.feat, dtype)
    return avals
