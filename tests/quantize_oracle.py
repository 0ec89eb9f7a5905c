"""An independent NumPy + ml_dtypes implementation of docs/numerics.md §3-§5 quantization: the
oracle the quantization tests compare ``te_jax.quantize.reference`` (and the kernels) against.

No JAX. Float32 steps are NumPy float32 operations, which keep subnormals (IEEE), unlike XLA:CPU;
the MXFP8 exponent is found by exact float64 comparisons; layouts go through the flattened 2-D
``[M, N]`` view of docs/numerics.md §5 rather than per-axis blocking. Casts clip to ``±Q`` and
then use ml_dtypes' round-to-nearest-even conversion.

``quantize(y, mode, layout, q_dtype, n_feature_axes=1, scale=None, amax=None)`` returns a dict
with ``data``, ``scale_inv``, ``colwise_data``, ``colwise_scale_inv``, ``amax``,
``global_scale_inv`` (NumPy arrays in the quantized / scale dtypes, or ``None``); ``raw_bits``
turns any of them into unsigned integers for exact comparison.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np

E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
E5M2 = np.dtype(ml_dtypes.float8_e5m2)
E2M1 = np.dtype(ml_dtypes.float4_e2m1fn)
E8M0 = np.dtype(ml_dtypes.float8_e8m0fnu)
Q_MAX = {E4M3: 448.0, E5M2: 57344.0, E2M1: 6.0}

# ScalingMode / QuantizeLayout values (docs/numerics.md §4-§5, the FFI enums).
DELAYED, MXFP8, CURRENT, NVFP4 = 1, 2, 3, 4
ROWWISE, COLWISE, ROWWISE_COLWISE = 0, 1, 2
BLOCK = {MXFP8: 32, NVFP4: 16}

F32 = np.float32
F32_MAX = F32(np.finfo(np.float32).max)


def sat_cast(v, q_dtype) -> np.ndarray:
    """Saturating round-to-nearest-even cast of float32 ``v`` to ``q_dtype`` (NaN stays NaN)."""
    q = Q_MAX[np.dtype(q_dtype)]
    return np.clip(np.asarray(v, np.float32), -q, q).astype(q_dtype)


def raw_bits(a) -> np.ndarray | None:
    """The bit patterns of ``a`` as unsigned integers of its item size (for exact compares)."""
    if a is None:
        return None
    a = np.asarray(a)
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize])


def amax(y) -> np.float32:
    y = np.asarray(y).astype(np.float32)
    return F32(np.max(np.abs(y), initial=0.0))


def _scale_for(amax_: np.float32, numerator: float) -> np.float32:
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        s = F32(numerator) / F32(amax_)
    if amax_ == 0:
        return F32(1.0)
    if np.isinf(s):
        return F32_MAX
    return F32(s)


def current_scale(amax_, q_max) -> np.float32:
    return _scale_for(amax_, q_max)


def nvfp4_global_scale(amax_) -> np.float32:
    return _scale_for(amax_, 6.0 * 448.0)


def mxfp8_exponent(amax_b, q_max) -> np.ndarray:
    """Smallest integer ``e`` with ``amax_b <= Q · 2^e`` (= ceil(log2(amax_b / Q))), clamped to
    [-127, 127]; -127 for zero, 127 for inf, 128 (byte 0xFF) for NaN. Exact: every product
    ``Q · 2^e`` and every float32 amax is exact in float64."""
    a = np.asarray(amax_b, np.float64)
    e = np.zeros(a.shape, np.int64)
    finite = np.isfinite(a) & (a > 0)
    with np.errstate(divide="ignore", invalid="ignore"):
        guess = np.where(finite, np.ceil(np.log2(np.where(finite, a, 1.0) / q_max)), 0)
    e = guess.astype(np.int64)
    for _ in range(3):  # correct the float64 log2 guess by exact comparisons
        e = np.where(finite & (a > np.ldexp(q_max, e)), e + 1, e)
        e = np.where(finite & (a <= np.ldexp(q_max, e - 1)), e - 1, e)
    assert np.all(~finite | ((a <= np.ldexp(q_max, e)) & (a > np.ldexp(q_max, e - 1))))
    e = np.clip(e, -127, 127)
    e = np.where(a == 0, -127, e)
    e = np.where(np.isinf(a), 127, e)
    return np.where(np.isnan(a), 128, e)


def _to_2d(y, n_feature_axes):
    lead, feat = y.shape[: y.ndim - n_feature_axes], y.shape[y.ndim - n_feature_axes :]
    m, n = math.prod(lead), math.prod(feat)
    return y.reshape(m, n), lead, feat


def _mxfp8_rows(y2d, q_dtype):
    """Rowwise MXFP8 of a 2-D float32 array: (q, e) with e of shape [M, N/32]."""
    m, n = y2d.shape
    blocks = y2d.reshape(m, n // 32, 32)
    e = mxfp8_exponent(np.max(np.abs(blocks), axis=-1, initial=0.0), Q_MAX[q_dtype])
    with np.errstate(invalid="ignore"):
        scaled = np.ldexp(blocks, -e[..., None].astype(np.int32)).astype(np.float32)
    scaled = np.where(e[..., None] == 128, np.float32(np.nan), scaled)
    return sat_cast(scaled, q_dtype).reshape(m, n), e


def _nvfp4_rows(y2d, s):
    """Rowwise NVFP4 of a 2-D float32 array with global scale ``s``: (q, block_scale)."""
    m, n = y2d.shape
    blocks = y2d.reshape(m, n // 16, 16)
    amax_b = np.max(np.abs(blocks), axis=-1, initial=0.0).astype(np.float32)
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        bs = sat_cast((amax_b / F32(6.0)) * s, E4M3)
        bs32 = bs.astype(np.float32)[..., None]
        scaled = (blocks * s) / bs32
    scaled = np.where(bs32 == 0, np.float32(0.0), scaled)
    return sat_cast(scaled, E2M1).reshape(m, n), bs


def quantize(y, mode, layout, q_dtype, n_feature_axes=1, scale=None, amax_=None) -> dict:
    """docs/numerics.md §4 quantization of ``y`` (any float dtype; its float32 value is quantized).

    ``scale`` is DELAYED's scale; ``amax_`` overrides the measured amax (CURRENT, NVFP4 scale by
    it; DELAYED reports it).
    """
    q_dtype = np.dtype(q_dtype)
    y32 = np.asarray(y).astype(np.float32)
    y2d, lead, feat = _to_2d(y32, n_feature_axes)
    rowwise = layout in (ROWWISE, ROWWISE_COLWISE)
    colwise = layout in (COLWISE, ROWWISE_COLWISE)
    out = dict.fromkeys(
        ("data", "scale_inv", "colwise_data", "colwise_scale_inv", "amax", "global_scale_inv")
    )
    a = amax(y32) if amax_ is None else F32(amax_)

    if mode in (DELAYED, CURRENT):
        s = F32(scale) if mode == DELAYED else current_scale(a, Q_MAX[q_dtype])
        with np.errstate(over="ignore", invalid="ignore"):
            q2d = sat_cast(y2d * s, q_dtype)
            s_inv = F32(1.0) / s
        out["amax"] = np.asarray(a, np.float32)
        out["scale_inv"] = np.asarray(s_inv, np.float32)
        if rowwise:
            out["data"] = q2d.reshape(y32.shape)
        if colwise:
            out["colwise_data"] = q2d.T.reshape(feat + lead)
            out["colwise_scale_inv"] = out["scale_inv"]
        return out

    block = BLOCK[mode]
    if mode == NVFP4:
        s = nvfp4_global_scale(a)
        out["amax"] = np.asarray(a, np.float32)
        out["global_scale_inv"] = np.asarray(F32(1.0) / s, np.float32)
        rows = lambda v: _nvfp4_rows(v, s)
        to_scale = lambda x: x
    else:
        rows = lambda v: _mxfp8_rows(v, q_dtype)
        to_scale = lambda e: (e + 127).astype(np.uint8).view(E8M0)
    if rowwise:
        q, sc = rows(y2d)
        out["data"] = q.reshape(y32.shape)
        out["scale_inv"] = to_scale(sc).reshape(y32.shape[:-1] + (y32.shape[-1] // block,))
    if colwise:
        # Blocks of `block` consecutive rows of [M, N]: quantize the transpose rowwise.
        q_t, sc_t = rows(np.ascontiguousarray(y2d.T))
        out["colwise_data"] = q_t.T.reshape(y32.shape)
        out["colwise_scale_inv"] = to_scale(sc_t.T).reshape(lead[:-1] + (lead[-1] // block,) + feat)
    return out


def dequantize(res: dict, mode, layout, n_feature_axes=1, colwise=False) -> np.ndarray:
    """float64 ``data · scale_inv`` (NVFP4 also ``· global_scale_inv``) of an oracle result."""
    data = res["colwise_data"] if colwise else res["data"]
    s = res["colwise_scale_inv"] if colwise else res["scale_inv"]
    v = data.astype(np.float64)
    if mode in (DELAYED, CURRENT):
        v = v * np.float64(s)
        if colwise:
            nf = n_feature_axes
            v = np.moveaxis(v, tuple(range(nf)), tuple(range(v.ndim - nf, v.ndim)))
        return v
    block = BLOCK[mode]
    axis = v.ndim - n_feature_axes - 1 if colwise else v.ndim - 1
    sf = np.repeat(s.astype(np.float64), block, axis=axis)
    v = v * sf
    if mode == NVFP4:
        v = v * np.float64(res["global_scale_inv"])
    return v


def delayed_update(scale, history, amax_, q_max, margin=0, algo="max"):
    """docs/numerics.md §4 DELAYED update in NumPy float32: returns (scale, history)."""
    h = np.array(history, np.float32)
    h[0] = F32(amax_)
    a = h[0] if algo == "most_recent" else (np.nan if np.isnan(h).any() else np.max(h))
    a = F32(a)
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        new = (F32(q_max) / a) / F32(2.0**margin)
    # te_jax (docs/numerics.md §4): the old scale is also kept when the new one is not
    # finite (a subnormal a), so the scale is always finite.
    s = F32(scale) if (not np.isfinite(a) or a <= 0 or not np.isfinite(new)) else F32(new)
    h = np.roll(h, -1)
    if len(h) > 1:  # with L = 1 the one slot keeps the newest amax
        h[0] = 0
    return s, h
