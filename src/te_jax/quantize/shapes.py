"""The shapes a quantization writes (its scales' per mode and layout) and the checks of a
quantize input against them (dtype, rank, block divisibility).

A tensor of shape ``leading + features`` is viewed as the flattened 2-D ``[M, N]``
(docs/numerics.md §5), ``M = prod(leading)``, ``N = prod(features)``; ``features`` is the last
``n_feature_axes`` axes: 1 for ``act_lu`` outputs and plain tensors, 2 for a gated ``dact``
output ``(..., 2, H)``. Where the blocks and the transpose fall is ``geometry``'s, the shapes
each mode's (``ScalingMode.X.impl.shapes``); this module asks them for a given input.

* Tensor scaling, colwise: the transpose ``[N, M]``, stored as ``features + leading`` (``(B, T, H)``
  -> ``(H, B, T)``; ``(B, T, 2, H)`` with 2 feature axes -> ``(2, H, B, T)``).
* Block scaling, rowwise: blocks along the last axis, which must be divisible by the block size.
* Block scaling, colwise: blocks of consecutive rows of ``[M, N]``. te_jax keeps the rank of the
  scales, so the blocks run along the innermost leading axis, which must be divisible by the
  block size (then every block is a run of consecutive flattened rows). Data keeps its shape.

Scale shapes (rank kept, unpadded): rowwise ``shape[:-1] + (shape[-1] // block,)``; colwise
``leading[:-1] + (leading[-1] // block,) + features``.

* Blockwise FP8 takes any shape (partial blocks at the ends); its colwise copy is the transpose,
  as tensor scaling's, and its float32 scales are 2-D in cuBLASLt's layout
  (``scaling_modes.Float8Block1DScaling`` / ``Float8Block2DScaling``).
"""

from __future__ import annotations

import jax
import numpy as np

from te_jax.dispatch import check_input_dtype
from te_jax.quantize import formats
from te_jax.quantize.geometry import Geometry, block_axis
from te_jax.quantize.quantize_layout import QuantizeLayout
from te_jax.quantize.quantizers import Quantizer
from te_jax.quantize.scaling_modes import ScalingMode

__all__ = [
    "scale_shapes",
    "check_geometry",
    "check_quantize_input",
]

Shape = tuple[int, ...]


def _where(op_name: str) -> str:
    """The op's public name for messages: ``quantize`` and ``te_jax.quantize`` both work."""
    return op_name if op_name.startswith("te_jax.") else f"te_jax.{op_name}"


def scale_shapes(
    shape: Shape,
    scaling_mode: ScalingMode,
    q_layout: QuantizeLayout,
    n_feature_axes: int = 1,
    q_dtype=None,
) -> dict[str, jax.ShapeDtypeStruct | None]:
    """Shapes and dtypes of every ``ScaledTensor`` field for an input of ``shape``.

    Returns a dict with keys ``data``, ``scale_inv``, ``colwise_data``, ``colwise_scale_inv``,
    ``amax``, ``global_scale_inv``: a ``jax.ShapeDtypeStruct``, or ``None`` for a field not
    produced. ``q_dtype`` defaults to the mode's default (E4M3, or E2M1 for NVFP4).

    | mode    | scale_inv / colwise_scale_inv                  | amax    | global_scale_inv |
    |---------|------------------------------------------------|---------|------------------|
    | delayed, current | float32 ``()``, one shared scale (both fields) | f32 () | None     |
    | MXFP8   | float8_e8m0fnu, block shapes (module doc)      | None    | None             |
    | NVFP4   | float8_e4m3fn, block shapes                    | f32 ()  | f32 ()           |
    | FP8 block | float32, cuBLASLt's 2-D layout (module doc)  | None    | None             |

    Tensor scaling has ``scale_inv`` even when only colwise data is produced (the scale is
    shared); block scaling has ``scale_inv`` only with rowwise data.

    Raises:
      ValueError: as ``check_geometry``.
    """
    mode = ScalingMode(scaling_mode)
    layout = QuantizeLayout(q_layout)
    shape = tuple(int(d) for d in shape)
    spec = mode.impl
    if not spec.quantizes:
        raise ValueError(f"scale_shapes: {mode.name} produces no quantized tensor")
    check_geometry(shape, mode, layout, n_feature_axes, "scale_shapes")
    q_dtype = spec.q_dtypes[0] if q_dtype is None else q_dtype
    q_dtype = formats.normalize_q_dtype(q_dtype, mode)
    shapes = spec.shapes(Geometry.of(shape, n_feature_axes), layout, q_dtype, per_tensor=())
    if spec.is_tensor_scaling and layout.has_colwise:
        shapes["colwise_scale_inv"] = shapes["scale_inv"]  # one scale for both copies
    fields = ("data", "scale_inv", "colwise_data", "colwise_scale_inv", "amax", "global_scale_inv")
    return {name: shapes.get(name) for name in fields}


def check_geometry(
    shape: Shape,
    scaling_mode: ScalingMode,
    q_layout: QuantizeLayout,
    n_feature_axes: int,
    op_name: str = "quantize",
) -> None:
    """Checks ``n_feature_axes`` and the block divisibility rules (module doc) for ``shape``.

    Raises:
      ValueError: naming the axis, its size and the block size (or what else is wrong).
    """
    shape = tuple(shape)
    ndim = len(shape)
    where = _where(op_name)
    if (
        isinstance(n_feature_axes, bool)
        or not isinstance(n_feature_axes, (int, np.integer))
        or not 1 <= n_feature_axes <= max(ndim, 1)
    ):
        raise ValueError(
            f"{where}: n_feature_axes must be an int from 1 to the input's rank {ndim}, got "
            f"{n_feature_axes!r}"
        )
    if ndim == 0:
        raise ValueError(f"{where}: cannot quantize a scalar; the input needs a feature axis")
    block = scaling_mode.impl.block_size
    if block is None or scaling_mode.impl.partial_blocks:
        return
    mode = scaling_mode.name
    if q_layout.has_rowwise and shape[-1] % block:
        raise ValueError(
            f"{where}: {mode} rowwise quantization needs the last axis (axis {ndim - 1}, size "
            f"{shape[-1]}) divisible by the block size {block}; got shape {shape}"
        )
    if q_layout.has_colwise:
        if ndim == n_feature_axes:
            raise ValueError(
                f"{where}: {mode} colwise quantization blocks {block} consecutive rows, so it "
                f"needs a leading (row) axis before the {n_feature_axes} feature axis(es); got "
                f"shape {shape}"
            )
        axis = block_axis(ndim, n_feature_axes, colwise=True)
        if shape[axis] % block:
            raise ValueError(
                f"{where}: {mode} colwise quantization needs the innermost leading axis (axis "
                f"{axis}, size {shape[axis]}) divisible by the block size {block} (scales keep "
                f"the tensor's rank, so a block must not straddle that axis); got shape {shape} "
                f"with {n_feature_axes} feature axis(es)"
            )


def check_quantize_input(
    shape: Shape, dtype, quantizer, n_feature_axes: int = 1, op_name: str = "quantize"
) -> None:
    """Trace-time validation of a quantize input, shared by the reference and the FFI path.

    Raises:
      TypeError: ``quantizer`` is not a te_jax quantizer, or ``dtype`` is not an input dtype
        (``te_jax.dispatch.check_input_dtype``: float64 is accepted, the FFI path rejects it).
      ValueError: as ``check_geometry``.
    """
    where = _where(op_name)
    if not isinstance(quantizer, Quantizer):
        raise TypeError(
            f"{where}: quantizer must be a te_jax.quantize quantizer (DelayedScaleQuantizer, "
            f"CurrentScaleQuantizer, MXFP8Quantizer, NVFP4Quantizer, Float8Block1DQuantizer or "
            f"Float8Block2DQuantizer), got "
            f"{type(quantizer).__name__}"
        )
    check_input_dtype(where, dtype, what="the input")
    check_geometry(shape, quantizer.scaling_mode, quantizer.q_layout, n_feature_axes, op_name)
