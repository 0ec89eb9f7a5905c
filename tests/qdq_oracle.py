"""A float64 interval reference of an FP8 LayerNormMLP step (docs/numerics.md §4, §8): every
quantized operand is quantized and dequantized here (``quantize_oracle``) with the scale the op
uses, and every other step is exact arithmetic, so the op's result must lie in the interval.

No JAX, nothing from te_jax. A value is an ``Iv(lo, hi)``: the op's result lies in
``[lo, hi]`` element by element. Where a value is known exactly (an input, a parameter, the
op's own ``ln_out``) ``lo == hi``; where it is computed, the interval holds what the op's
float32 arithmetic can give and is then rounded to the compute dtype endpoint by endpoint
(rounding is monotone), so most of a rounded tensor's intervals are one point again. A
quantization of an interval tensor is exact where both ends give the same FP8 code, one code
step wide where they straddle a rounding midpoint, and covers every scale the tensor's amax
(or a block's) can give. The width left is float32 accumulation, the activation's float32
tolerance (§7) and the roundings of values that sit within that of a rounding midpoint: far
below FP8's own error (2^-4 of every element), which the bound does not contain.
"""

from __future__ import annotations

import itertools
import math
from typing import NamedTuple

import ml_dtypes
import numpy as np

import float64_oracle as oracle
import quantize_oracle as qo
from helpers import round_to

BF16 = np.dtype(ml_dtypes.bfloat16)
E4M3, E5M2 = qo.E4M3, qo.E5M2
F32_ACC = 2.0**-23  # per term of a float32 dot product (docs/numerics.md §8)
F32_SUM = 2.0**-24  # per row of a float32 column sum (docs/numerics.md §7)
ACT_F32_TOL = 2e-5  # a float32 activation / derivative against float64 (§7, GELU forms)
NORM_F32 = 2.0**-16  # the norm's float32 statistics and products, relative


class Iv(NamedTuple):
    lo: np.ndarray
    hi: np.ndarray

    @property
    def mid(self):
        return (self.lo + self.hi) / 2

    @property
    def rad(self):
        return (self.hi - self.lo) / 2

    @property
    def mag(self):
        return np.maximum(np.abs(self.lo), np.abs(self.hi))

    @property
    def T(self) -> Iv:  # noqa: N802 -- as ndarray.T
        return Iv(self.lo.T, self.hi.T)

    def reshape(self, *shape) -> Iv:
        return Iv(self.lo.reshape(*shape), self.hi.reshape(*shape))

    def contains(self, got) -> np.ndarray:
        g = np.asarray(got).astype(np.float64)
        return (self.lo <= g) & (g <= self.hi)


def point(a) -> Iv:
    a = np.asarray(a).astype(np.float64)
    return Iv(a, a)


def rounded(iv: Iv, dtype) -> Iv:
    """Rounded once to ``dtype``."""
    return Iv(round_to(iv.lo, dtype), round_to(iv.hi, dtype))


def maybe_rounded(iv: Iv, dtype) -> Iv:
    """Rounded to ``dtype`` or not (a result whose one rounding the docs leave open)."""
    r = rounded(iv, dtype)
    return Iv(np.minimum(iv.lo, r.lo), np.maximum(iv.hi, r.hi))


def widened(iv: Iv, rel, absolute=0.0) -> Iv:
    d = rel * iv.mag + absolute
    return Iv(iv.lo - d, iv.hi + d)


def matmul(a: Iv, b: Iv, bias: Iv | None = None) -> Iv:
    """``a (M, K) · b (K, N) (+ bias)`` accumulated in float32, before any rounding."""
    k = a.lo.shape[-1]
    c = a.mid @ b.mid
    r = np.abs(a.mid) @ b.rad + a.rad @ np.abs(b.mid) + a.rad @ b.rad
    s = a.mag @ b.mag
    if bias is not None:
        c, r, s = c + bias.mid, r + bias.rad, s + bias.mag
    e = r + max(k, 4) * F32_ACC * s
    return Iv(c - e, c + e)


def colsum(iv: Iv) -> Iv:
    """The float32 sum over the rows (axis 0), before rounding."""
    m = iv.lo.shape[0]
    e = m * F32_SUM * iv.mag.sum(0)
    return Iv(iv.lo.sum(0) - e, iv.hi.sum(0) + e)


def _halves(gated: bool, lo, hi):
    """The corners of a box: for gated ``(..., 2, N)`` each half's ends (and the activated
    half's centre) on its own."""
    mid = (lo + hi) / 2
    if not gated:
        return [lo, mid, hi]
    out = []
    for a, b in itertools.product((lo, mid, hi), (lo, hi)):
        out.append(np.stack([a[..., 0, :], b[..., 1, :]], axis=-2))
    return out


def _curvature(h: Iv, gated: bool, factor):
    """Σ|f''|/2 · rad² over the activated half (|f''| <= 2, |f'''| <= 4 for every §1
    activation), times ``factor`` (the size of what multiplies it)."""
    r2 = (h.rad[..., 0, :] if gated else h.rad) ** 2
    return 2.0 * r2 * factor


def activation(h: Iv, act_enum: int, gated: bool) -> Iv:
    """``act(h)`` in float32 (before rounding) for ``h (..., 2, N)`` gated or ``(..., N)``."""
    vals = [oracle.act_lu(c, act_enum) for c in _halves(gated, h.lo, h.hi)]
    factor = (h.mag[..., 1, :] + 1.0) if gated else 1.0
    curv = _curvature(h, gated, factor)
    iv = Iv(np.min(vals, axis=0) - curv, np.max(vals, axis=0) + curv)
    return widened(iv, ACT_F32_TOL, ACT_F32_TOL)


def dact(dy: Iv, h: Iv, act_enum: int, gated: bool) -> Iv:
    """``dact(dy, h)`` in float32 (before rounding); ``dy`` has the activation's output shape."""
    vals = [
        oracle.dact_lu(d, c, act_enum) for c in _halves(gated, h.lo, h.hi) for d in (dy.lo, dy.hi)
    ]
    factor = dy.mag * ((h.mag[..., 1, :] + 1.0) if gated else 1.0)
    curv = 2.0 * _curvature(h, gated, factor)
    if gated:
        curv = curv[..., None, :]
    iv = Iv(np.min(vals, axis=0) - curv, np.max(vals, axis=0) + curv)
    return widened(iv, ACT_F32_TOL, ACT_F32_TOL)


# ---- quantize-dequantize of an interval tensor --------------------------------------------


def _amax_range(iv: Iv, axis=None):
    """The smallest and largest max|y| the interval tensor can have (over ``axis``)."""
    straddles = (iv.lo <= 0) & (iv.hi >= 0)
    least = np.where(straddles, 0.0, np.minimum(np.abs(iv.lo), np.abs(iv.hi)))
    return least.max(axis=axis, initial=0.0), iv.mag.max(axis=axis, initial=0.0)


def _values_between(lo: float, hi: float, dtype) -> list[float]:
    """Every value of ``dtype`` in ``[lo, hi]`` (non-negative ends, both values of dtype)."""
    dt = np.dtype(dtype)
    uint = {2: np.uint16, 4: np.uint32}[dt.itemsize]
    a, b = (int(np.asarray(v, dt).view(uint)) for v in (lo, hi))
    assert b - a < 64, f"amax spans {b - a + 1} values of {dt}: the input is too uncertain"
    return [float(np.asarray(i, uint).view(dt)) for i in range(a, b + 1)]


def _tensor_qdq(y, mode, q_dtype, scale=None, amax=None):
    res = qo.quantize(y, mode, qo.ROWWISE, q_dtype, scale=scale, amax_=amax)
    return qo.dequantize(res, mode, qo.ROWWISE)


def _mxfp8_qdq(y2d, e, q_dtype):
    """Rowwise MXFP8 of a 2-D array with the block exponents ``e (M, N/32)`` given."""
    m, n = y2d.shape
    blocks = y2d.reshape(m, n // 32, 32)
    scaled = np.ldexp(blocks, -e[..., None].astype(np.int32)).astype(np.float32)
    data = qo.sat_cast(scaled, q_dtype).astype(np.float64)
    return np.ldexp(data, e[..., None].astype(np.int32)).reshape(m, n)


def qdq(
    iv: Iv,
    mode: str,
    q_dtype,
    *,
    src_dtype,
    scale=None,
    colwise: bool = False,
    n_feature_axes: int = 1,
) -> Iv:
    """The dequantized value of ``iv`` quantized (``mode``: ``"delayed"`` with ``scale``,
    ``"current"``, ``"mxfp8"``; MXFP8's ``colwise`` blocks run down the rows of the 2-D view
    ``[M, N]``, N the ``n_feature_axes`` trailing axes) from a tensor of ``src_dtype``."""
    shape = iv.lo.shape
    q_dtype = np.dtype(q_dtype)
    if mode == "delayed":
        return Iv(*(_tensor_qdq(v, qo.DELAYED, q_dtype, scale=scale) for v in iv))
    if mode == "current":
        outs = []
        for a in _values_between(*_amax_range(iv), src_dtype):
            outs += [_tensor_qdq(v, qo.CURRENT, q_dtype, amax=a) for v in iv]
        return Iv(np.min(outs, axis=0), np.max(outs, axis=0))
    assert mode == "mxfp8", mode
    n = math.prod(shape[len(shape) - n_feature_axes :])
    lo2, hi2 = (v.reshape(-1, n) for v in iv)
    if colwise:
        lo2, hi2 = lo2.T, hi2.T
    m2, n2 = lo2.shape
    box = Iv(lo2.reshape(m2, n2 // 32, 32), hi2.reshape(m2, n2 // 32, 32))
    least, most = _amax_range(box, axis=-1)
    e_lo, e_hi = (qo.mxfp8_exponent(a, qo.Q_MAX[q_dtype]) for a in (least, most))
    assert (e_hi - e_lo <= 1).all(), "a block's scale spans more than two exponents"
    outs = [_mxfp8_qdq(v, e, q_dtype) for e in (e_lo, e_hi) for v in (lo2, hi2)]
    lo, hi = np.min(outs, axis=0), np.max(outs, axis=0)
    if colwise:
        lo, hi = lo.T, hi.T
    return Iv(lo.reshape(shape), hi.reshape(shape))


# ---- the norm's backward -------------------------------------------------------------------


def layernorm_backward(x, gamma, g: Iv, eps: float = 1e-6):
    """``(dx, dgamma, dbeta)`` of ``y = (x - μ)/σ · γ + β`` over the last axis for an upstream
    gradient ``g`` (intervals; the float32 values before any rounding), x ``(M, H)``."""
    x = np.asarray(x).astype(np.float64)
    gamma = np.asarray(gamma).astype(np.float64)
    h = x.shape[-1]
    xc = x - x.mean(-1, keepdims=True)
    r = 1.0 / np.sqrt((xc**2).mean(-1, keepdims=True) + eps)
    xh = xc * r
    # dx_i = r Σ_j γ_j g_j (δ_ij − 1/H − x̂_i x̂_j / H)
    jac = (np.eye(h)[None] - 1.0 / h - xh[:, :, None] * xh[:, None, :] / h) * r[:, :, None]
    gg_mid, gg_rad, gg_mag = (gamma * v for v in (g.mid, g.rad, g.mag))
    dx_mid = np.einsum("mij,mj->mi", jac, gg_mid)
    dx_e = np.einsum("mij,mj->mi", np.abs(jac), gg_rad + NORM_F32 * gg_mag)
    dgamma = Iv((g.lo * xh), (g.hi * xh))
    dgamma = Iv(np.minimum(*dgamma), np.maximum(*dgamma))
    dgamma = widened(colsum(dgamma), NORM_F32)
    return Iv(dx_mid - dx_e, dx_mid + dx_e), dgamma, colsum(g)


# ---- the block ------------------------------------------------------------------------------


class Recipe(NamedTuple):
    mode: str  # "delayed", "current", "mxfp8"
    fwd: np.dtype  # x and kernel format
    grad: np.dtype  # the gradient's format


def mlp_step(ln_out, x, gamma, wi, bi, wo, bo, out, cot, recipe: Recipe, act_enum, scales=None):
    """The intervals of a LayerNormMLP step with a LayerNorm and biases in bfloat16:
    ``out`` (forward), then with the loss ``Σ cot · out² / 2`` on the op's own ``out`` (so
    the gradient at the output, ``cot · out``, is known exactly): ``dx``, ``dscale``,
    ``dln_bias``, ``dwi_kernel``, ``dwi_bias``, ``dwo_kernel``, ``dwo_bias``; and the amax of
    each tensor quantized (``{"wi_x": Iv, ...}``: each GEMM's x, kernel, and the gradient at
    its output). ``ln_out``, x ``(M, H)``; wi ``(H, 2, I)`` / ``(H, I)``; ``scales``: delayed
    scaling's ``{"wi_x": s, ...}``."""
    scales = scales or {}
    gated = np.ndim(wi) == 3
    feat = 2 if gated else 1
    m, hidden = np.shape(ln_out)

    def q(iv, role, fmt, src, colwise=False, nf=1):
        return qdq(
            iv,
            recipe.mode,
            fmt,
            src_dtype=src,
            scale=scales.get(role),
            colwise=colwise,
            n_feature_axes=nf,
        )

    f32 = np.float32
    ln = point(ln_out)
    k1 = point(wi)
    k2 = point(wo)
    x1 = q(ln, "wi_x", recipe.fwd, BF16)
    k1_fwd = q(k1, "wi_kernel", recipe.fwd, f32, colwise=True, nf=feat).reshape(hidden, -1)
    b1 = rounded(point(bi), BF16).reshape(-1)
    h1 = rounded(matmul(x1, k1_fwd, b1), BF16).reshape(m, *np.shape(wi)[1:])
    a = rounded(activation(h1, act_enum, gated), BF16)
    x2 = q(a, "wo_x", recipe.fwd, BF16)
    k2_fwd = q(k2, "wo_kernel", recipe.fwd, f32, colwise=True)
    res = {"out": rounded(matmul(x2, k2_fwd, rounded(point(bo), BF16)), BF16)}

    out32 = np.asarray(out).astype(np.float32)
    dy = point(round_to(out32 * np.asarray(cot, np.float32), BF16))
    res["dwo_bias"] = maybe_rounded(colsum(dy), BF16)
    g2 = q(dy, "wo_grad", recipe.grad, BF16)
    k2_bwd = q(k2, "wo_kernel", recipe.fwd, f32)
    da = rounded(matmul(g2, k2_bwd.T), BF16)
    x2_col = q(a, "wo_x", recipe.fwd, BF16, colwise=True)
    g2_col = q(dy, "wo_grad", recipe.grad, BF16, colwise=True)
    res["dwo_kernel"] = maybe_rounded(matmul(x2_col.T, g2_col), BF16)

    dh32 = dact(da, h1, act_enum, gated)
    dh = rounded(dh32, BF16)
    res["dwi_bias"] = maybe_rounded(colsum(dh32.reshape(m, -1)), BF16).reshape(*np.shape(bi))
    g1 = q(dh, "wi_grad", recipe.grad, BF16, nf=feat).reshape(m, -1)
    k1_bwd = q(k1, "wi_kernel", recipe.fwd, f32, nf=feat).reshape(hidden, -1)
    dln = rounded(matmul(g1, k1_bwd.T), BF16)
    x1_col = q(ln, "wi_x", recipe.fwd, BF16, colwise=True)
    g1_col = q(dh, "wi_grad", recipe.grad, BF16, colwise=True, nf=feat).reshape(m, -1)
    res["dwi_kernel"] = maybe_rounded(matmul(x1_col.T, g1_col), BF16).reshape(np.shape(wi))

    dx, dgamma, dbeta = layernorm_backward(x, gamma, dln)
    res["dx"] = rounded(dx, BF16)
    res["dscale"], res["dln_bias"] = dgamma, dbeta
    tensors = dict(wi_x=ln, wi_kernel=k1, wi_grad=dh, wo_x=a, wo_kernel=k2, wo_grad=dy)
    amax = {k: Iv(*_amax_range(v)) for k, v in tensors.items()}
    return res, amax
