"""Blockwise FP8 quantization (docs/numerics.md §4-§5) in NumPy: the oracle of
``FP8_BLOCK_1D_SCALING`` / ``FP8_BLOCK_2D_SCALING``, after the math of TransformerEngine's
pure-PyTorch blockwise reference quantizer (its tests' ``BlockwiseQuantizerReference``), written
again here for te_jax's layouts. No JAX; float32 steps are NumPy float32 operations (IEEE,
subnormals kept).

The math, on the flattened float32 ``[M, N]``:

* Zero-pad to whole blocks (1×128 along the rows, or 128×128 tiles), take each block's amax,
  ``a = max(amax, ε)``, ``scale = Q / a`` (float32), ``Q`` where the quotient overflows
  replaced by float32's max; with power-of-two scales ``2^(frexp exponent − 1)`` of it; 1 where
  ``a`` is 0. ``codes = clip(y · scale, ±Q)`` cast to the format; ``scale_inv = 1 / scale``.
  TransformerEngine's reference takes the input dtype's max for the overflowed quotient and
  scale 0 for an infinite amax; its CUDA quantizers (and te_jax) take float32's max and scale 1
  for an infinite or NaN amax, which this oracle follows.
* 1D: the rowwise copy blocks ``[M, N]`` along its rows; the colwise copy is ``[N, M]``, the
  transpose of y, blocked along its rows (quantized from y, not from the rowwise codes). 2D: the
  colwise copy and scales are the rowwise ones transposed.
* Scales as cuBLASLt reads them (TransformerEngine's "GEMM-ready" form): 1D scales of a copy
  ``[R, C]`` transposed to ``(ceil(C/128), R)`` and zero-padded to ``round_up(R, 4)`` columns;
  2D ``(ceil(R/128), ceil(C/128))`` zero-padded to ``round_up(·, 4)`` columns.
"""

from __future__ import annotations

import math

import numpy as np

import quantize_oracle as base

BLOCK = 128
F32 = np.float32
F32_MAX = np.finfo(np.float32).max


def block_scale(amax, q_max: float, power_2_scale: bool, eps: float) -> np.ndarray:
    """The float32 scale of each block from its amax (module doc)."""
    a = np.asarray(amax, np.float32)
    with np.errstate(invalid="ignore"):
        a = np.where(a < F32(eps), F32(eps), a)  # NaN stays NaN
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        s = (F32(q_max) / a).astype(np.float32)
    s = np.where(np.isinf(s), F32_MAX, s)
    if power_2_scale:
        _, exp = np.frexp(s)
        s = np.ldexp(F32(1.0), exp - 1).astype(np.float32)
    degenerate = (a == 0) | ~np.isfinite(a)
    return np.where(degenerate, F32(1.0), s).astype(np.float32)


def _pad(x, rows: int, cols: int) -> np.ndarray:
    return np.pad(x, ((0, rows - x.shape[0]), (0, cols - x.shape[1])))


def _round_up(a: int, b: int) -> int:
    return -(-a // b) * b


def _cast(tiles, scale, q_dtype):
    with np.errstate(invalid="ignore", over="ignore"):
        return base.sat_cast(tiles * scale, q_dtype)


def _vector_tiles(x, q_dtype, pow2, eps):
    """1×128 blocks along the rows of ``x [R, C]``: (codes [R, C], scale_inv (R, C/128))."""
    r, c = x.shape
    cp = _round_up(c, BLOCK)
    tiles = _pad(x, r, cp).reshape(r, cp // BLOCK, BLOCK)
    amax = np.max(np.abs(tiles), axis=-1, initial=F32(0)).astype(np.float32)
    scale = block_scale(amax, base.Q_MAX[q_dtype], pow2, eps)
    codes = _cast(tiles, scale[..., None], q_dtype).reshape(r, cp)[:, :c]
    return codes, (F32(1.0) / scale).astype(np.float32)


def _square_tiles(x, q_dtype, pow2, eps):
    """128×128 tiles of ``x [R, C]``: (codes [R, C], scale_inv (R/128, C/128))."""
    r, c = x.shape
    rp, cp = _round_up(r, BLOCK), _round_up(c, BLOCK)
    tiles = _pad(x, rp, cp).reshape(rp // BLOCK, BLOCK, cp // BLOCK, BLOCK)
    amax = np.max(np.abs(tiles), axis=(1, 3), initial=F32(0)).astype(np.float32)
    scale = block_scale(amax, base.Q_MAX[q_dtype], pow2, eps)
    codes = _cast(tiles, scale[:, None, :, None], q_dtype).reshape(rp, cp)[:r, :c]
    return codes, (F32(1.0) / scale).astype(np.float32)


def _gemm_ready(scale_inv, vector: bool) -> np.ndarray:
    """Per-block scales in cuBLASLt's layout (module doc)."""
    s = scale_inv.T if vector else scale_inv
    return _pad(s, s.shape[0], _round_up(s.shape[1], 4))


def quantize(y, block_dims, layout, q_dtype, n_feature_axes=1, power_2_scale=True, eps=0.0):
    """``{ScaledTensor field: NumPy array or None}`` of blockwise FP8 (module doc)."""
    q_dtype = np.dtype(q_dtype)
    y32 = np.asarray(y).astype(np.float32)
    lead, feat = y32.shape[: y32.ndim - n_feature_axes], y32.shape[y32.ndim - n_feature_axes :]
    y2 = y32.reshape(math.prod(lead), math.prod(feat))
    out = dict.fromkeys(
        ("data", "scale_inv", "colwise_data", "colwise_scale_inv", "amax", "global_scale_inv")
    )
    rowwise = layout in (base.ROWWISE, base.ROWWISE_COLWISE)
    colwise = layout in (base.COLWISE, base.ROWWISE_COLWISE)
    if block_dims == 1:
        if rowwise:
            codes, s = _vector_tiles(y2, q_dtype, power_2_scale, eps)
            out["data"], out["scale_inv"] = codes.reshape(y32.shape), _gemm_ready(s, True)
        if colwise:
            codes, s = _vector_tiles(y2.T, q_dtype, power_2_scale, eps)
            out["colwise_data"] = codes.reshape(feat + lead)
            out["colwise_scale_inv"] = _gemm_ready(s, True)
        return out
    codes, s = _square_tiles(y2, q_dtype, power_2_scale, eps)
    if rowwise:
        out["data"], out["scale_inv"] = codes.reshape(y32.shape), _gemm_ready(s, False)
    if colwise:
        out["colwise_data"] = codes.T.reshape(feat + lead)
        out["colwise_scale_inv"] = _gemm_ready(s.T, False)
    return out


def dequantize(codes, scale_inv, block_dims, shape2d) -> np.ndarray:
    """A copy ``[R, C]`` (``shape2d``) back to float32 from its codes and stored scales."""
    r, c = shape2d
    v = codes.astype(np.float32).reshape(r, c)
    if block_dims == 1:
        per = np.repeat(scale_inv[:, :r].T, BLOCK, axis=1)[:, :c]
    else:
        grid = scale_inv[:, : -(-c // BLOCK)]
        per = np.repeat(np.repeat(grid, BLOCK, axis=0), BLOCK, axis=1)[:r, :c]
    return (v * per).astype(np.float32)
