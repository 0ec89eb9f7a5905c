"""Float64 NumPy reference of ``te_jax.dense`` (docs/numerics.md §8, §1, §2,
§7), with an error bound per element derived from the arithmetic the op does.

No JAX, nothing from te_jax: the activations and their derivatives come from
``float64_oracle``, the §7 tolerances from ``helpers``.

A value is a ``Bounded(v, e)``: ``v`` the float64 result of exact arithmetic on the exact inputs,
``e >= 0`` a bound on ``|computed - v|`` for each element. Each step below takes ``Bounded``
operands and widens ``e`` by what that stage of the op may add; the tests assert
``|got - v| <= e`` (``assert_bounded``), and that two implementations agree within ``2e``.

The bounds, stage by stage (``u_d`` the unit roundoff of the compute dtype ``d``: 2^-24 float32,
2^-8 bfloat16, 2^-11 float16; ``t`` the §7 tolerance of the output dtype):

* ``gemm``: ``h = a · b (+ bias)`` accumulated in float32. Operand errors propagate as
  ``Σ e_a (|b| + e_b) + |a| e_b``. The float32 accumulation of the K products and the bias is
  within ``γ_(K+1) Σ|a||b|`` (``γ_n = n·2^-24 / (1 - n·2^-24)``, recursive summation in any
  order), and the FP8 GEMM's one or two multiplications of the accumulator by ``scale_inv``
  add ``2·2^-24`` of it: ``K·2^-23 · (Σ|a||b| + |bias|)`` covers all of it for K >= 4 (numerics §8's
  rule; K is taken as at least 4).
* ``rounded``: the float32 result rounded once to ``d`` (h, and each output). With ``|c - v| <= e``
  before, ``|RN_d(c) - RN_d(v)| <= e + u_d(|c| + |v|) <= e + u_d(2|v| + e)`` (plus the smallest
  subnormal of ``d`` near zero). ``v`` becomes ``RN_d(v)``: the reference h is the float64
  product rounded to x's dtype, as docs/numerics.md §8 prescribes.
* ``activation``: ``y = act(h)``. The kernel meets §7 on the h it is given:
  ``|y - RN_d(f(h_c))| <= t |f(h_c)| + t``. The h it is given is within ``e_h`` of the
  reference h, so ``f(h_c)`` is within ``Δ = max |f(h') - f(h)|`` over the box ``|h' - h| <= e_h``
  (each half of a gated input on its own): evaluated at the box's corners and centre, which
  catches the first-order (and, gated, the bilinear) change and the kinks of ReLU / clamps, plus
  ``max|f''|/2 · e_h^2`` for the curvature in between (``|f''| <= 2`` for every §1 activation;
  times ``|b| + 1`` for the gate's linear half). Together ``e_y = Δ + 2t(|y| + Δ) + t`` (the
  ``2t`` also holds the final rounding, ``u_d <= t``).
* ``dact``: ``dh = dact(dy, h)``, the same way: the box for ``e_h`` (third derivatives are below
  4 for every §1 activation), plus ``max |f'(h')| · e_dy`` for an inexact ``dy``.
* ``colsum`` (dbias): the float32 sum of M rows: ``Σ e + M·2^-24 Σ(|dh| + e)``, then rounded.
* ``quantized`` (FP8): E4M3 keeps 3 mantissa bits (a relative step of 2^-3), E5M2 2 (2^-2); round
  to nearest is within half a step, ``2^-4 |v|`` resp. ``2^-3 |v|`` for normal values, and within
  half the smallest subnormal (2^-10, 2^-17) times the dequantization scale below the normal
  range; ``scale_inv`` itself is one float32 rounding (2^-24, taken as 2^-23). Saturation is not
  modelled: the tests use scales no tensor exceeds (``Fp8.headroom``).
"""

from __future__ import annotations

import itertools
import math
from typing import NamedTuple

import ml_dtypes
import numpy as np

import float64_oracle as oracle
from helpers import Act, assert_within, np_dtype, round_to, tol, unit_roundoff

F32_ACC = 2.0**-23  # per term of a float32 dot product (docs/numerics.md §8: K · 2^-23 · Σ|a||b|)
F32_SUM = 2.0**-24  # per row of a float32 column sum (docs/numerics.md §7's dbias rule)
# te_jax's CUDA GEMM (cuBLASLt): FP8 tensor cores accumulate each block of K in reduced
# precision before the float32 promotion (bounded here with 2^-9 Σ|a||b|; docs/numerics.md §8
# has the errors seen and why), and a 16-bit output is rounded before
# the bias epilogue adds the bias (half an ulp of the accumulator more). Set by the tests where
# the CUDA GEMM runs.
KERNEL_GEMM = False
FP8_MMA_ACC = 2.0**-9

E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
E5M2 = np.dtype(ml_dtypes.float8_e5m2)
Q_MAX = {E4M3: 448.0, E5M2: 57344.0}
# Round-to-nearest error of one FP8 encoding: (relative, absolute in units of the dequantization
# scale) = (half the relative step, half the smallest subnormal).
FP8_ERROR = {E4M3: (2.0**-4, 2.0**-10), E5M2: (2.0**-3, 2.0**-17)}


class Bounded(NamedTuple):
    v: np.ndarray  # float64 reference
    e: np.ndarray  # bound on |computed - v|, element by element

    @property
    def T(self) -> Bounded:  # noqa: N802 -- as ndarray.T
        return Bounded(self.v.T, self.e.T)

    def reshape(self, *shape) -> Bounded:
        return Bounded(self.v.reshape(*shape), self.e.reshape(*shape))

    @property
    def mag(self) -> np.ndarray:
        """The largest magnitude the computed value can have."""
        return np.abs(self.v) + self.e


def exact(a) -> Bounded:
    """An input: known exactly (its dtype's values, widened to float64)."""
    if isinstance(a, Bounded):
        return a
    v = np.asarray(a).astype(np.float64)
    return Bounded(v, np.zeros_like(v))


def _smallest_subnormal(dtype) -> float:
    return float(ml_dtypes.finfo(np_dtype(dtype)).smallest_subnormal)


def gemm(
    a: Bounded, b: Bounded, bias: Bounded | None = None, *, fp8: bool = False, dtype=None
) -> Bounded:
    """``a (M, K) · b (K, F) (+ bias (F,))`` accumulated in float32, before rounding to
    ``dtype``; ``fp8``: an FP8 GEMM (see KERNEL_GEMM)."""
    k = a.v.shape[-1]
    v = a.v @ b.v
    e = a.e @ b.mag + np.abs(a.v) @ b.e
    s = a.mag @ b.mag
    extra = _kernel_error(np.abs(v) + e, s, bias is not None, fp8, dtype)
    if bias is not None:
        v, e, s = v + bias.v, e + bias.e, s + bias.mag
    return Bounded(v, e + max(k, 4) * F32_ACC * s + extra)


def _kernel_error(acc_mag, s, bias: bool, fp8: bool, dtype):
    """What te_jax's CUDA GEMM adds to the float32 rule (KERNEL_GEMM)."""
    if not KERNEL_GEMM:
        return 0.0
    extra = FP8_MMA_ACC * s if fp8 else 0.0
    if bias and dtype is not None and np_dtype(dtype).itemsize == 2:
        extra = extra + unit_roundoff(dtype) * acc_mag
    return extra


def rounded(c: Bounded, dtype) -> Bounded:
    """A float32 result rounded once to ``dtype``; the reference becomes ``RN_d(v)``."""
    u = unit_roundoff(dtype)
    widened = c.e + u * (2 * np.abs(c.v) + c.e) + _smallest_subnormal(dtype)
    return Bounded(round_to(c.v, dtype), np.where(c.e == 0, 0.0, widened))


def quantized(c: Bounded, q_dtype, inv_scale: float) -> Bounded:
    """``c`` through an FP8 encoding with dequantization scale ``inv_scale`` (``1/scale`` for
    tensor scaling, at most the block's ``2^e`` for MXFP8), no saturation."""
    rel, absolute = FP8_ERROR[np.dtype(q_dtype)]
    return Bounded(c.v, c.e + (rel + F32_ACC) * c.mag + absolute * inv_scale)


def _corners(h: Bounded, gated: bool):
    """``h.v`` moved by each combination of ``-e, 0, +e`` (per half of a gated ``(..., 2, N)``)."""
    signs = (-1.0, 0.0, 1.0)
    if not gated:
        for s in signs:
            yield h.v + s * h.e
        return
    for sa, sb in itertools.product(signs, signs):
        yield h.v + np.array([[sa], [sb]]) * h.e


def _gate_factor(h: Bounded, gated: bool):
    """``(e_a^2, |b| + e_b + 1)``-shaped curvature factors: the error of the activated half
    squared, and (gated) the size of the linear half that multiplies its curvature."""
    if not gated:
        return h.e**2, 1.0
    return h.e[..., 0, :] ** 2, np.abs(h.v[..., 1, :]) + h.e[..., 1, :] + 1.0


def activation(h: Bounded, act: Act | None, dtype, params=None) -> Bounded:
    """``y = act(h)`` in ``dtype`` from an h within ``h.e`` (module docstring); ``h`` is
    ``(M, *features)``, ``(M, 2, N)`` for a gated activation. ``act=None``: h itself."""
    if act is None:
        return h
    f = lambda hh: oracle.act_lu(hh, act.enum, params)  # noqa: E731
    v = f(h.v)
    box = np.max([np.abs(f(c) - v) for c in _corners(h, act.gated)], axis=0)
    e2, gate = _gate_factor(h, act.gated)
    delta = box + 2.0 * e2 * gate
    t = tol(dtype, act)
    return Bounded(v, delta + 2 * t * (np.abs(v) + delta) + t)


def dact(dy: Bounded, h: Bounded, act: Act | None, dtype, params=None) -> Bounded:
    """``dh = dact(dy, h)`` in ``dtype`` (module docstring); ``dy`` has y's shape, ``dh`` h's.
    ``act=None``: dy itself."""
    if act is None:
        return dy
    g = lambda d, hh: oracle.dact_lu(d, hh, act.enum, params)  # noqa: E731
    v = g(dy.v, h.v)
    corners = list(_corners(h, act.gated))
    box = np.max([np.abs(g(dy.v, c) - v) for c in corners], axis=0)
    slope = np.max([np.abs(g(np.ones_like(dy.v), c)) for c in corners], axis=0)
    e2, gate = _gate_factor(h, act.gated)
    curv = 4.0 * e2 * gate * dy.mag
    if act.gated:
        dy_e, curv = dy.e[..., None, :], curv[..., None, :]
    else:
        dy_e = dy.e
    delta = box + slope * dy_e + curv
    t = tol(dtype, act)
    return Bounded(v, delta + 2 * t * (np.abs(v) + delta) + t)


def colsum(d: Bounded) -> Bounded:
    """The float32 sum over the rows (axis 0), before rounding: dbias."""
    m = d.v.shape[0]
    return Bounded(d.v.sum(0), d.e.sum(0) + m * F32_SUM * d.mag.sum(0))


# ---- the whole op ---------------------------------------------------------------------------


class Fp8(NamedTuple):
    """An FP8 recipe as the bounds see it: the data formats and how large the dequantization
    scale is: ``headroom · amax / Q`` (1: current scaling; 2: MXFP8's power of two, or delayed
    scaling's ``2^margin`` with margin 1), or exactly 1 (``headroom=None``: a fresh delayed
    quantizer)."""

    fwd: np.dtype
    grad: np.dtype
    headroom: float | None

    def quantize(self, c: Bounded, q_dtype) -> Bounded:
        q_dtype = np.dtype(q_dtype)
        if self.headroom is None:
            inv = 1.0
        else:
            amax = float(c.mag.max(initial=0.0))
            inv = self.headroom * amax / Q_MAX[q_dtype] * (1 + 2.0**-20)
        return quantized(c, q_dtype, inv)


class Forward(NamedTuple):
    y: Bounded  # (M, *out_features)
    x: Bounded  # (M, K): the GEMM's x (quantized under FP8)
    k: Bounded  # (K, F)
    h: Bounded  # (M, *features), rounded to dtype
    features: tuple
    act: Act | None
    dtype: object
    params: object
    fp8: Fp8 | None


def forward(
    x,
    kernel,
    bias,
    act: Act | None,
    dtype,
    params=None,
    fp8: Fp8 | None = None,
    x_quantized: bool = False,
) -> Forward:
    """``y = act(x · kernel + bias)``: x ``(..., K)`` (its leading axes folded into M), kernel
    ``(K, *F)``; arrays or ``Bounded``. ``x_quantized``: x already carries its FP8 error (a
    ScaledTensor x), not quantized again."""
    x, kernel = exact(x), exact(kernel)
    k_dim, features = kernel.v.shape[0], kernel.v.shape[1:]
    x2 = x.reshape(-1, k_dim)
    k2 = kernel.reshape(k_dim, -1)
    if fp8 is not None:
        if not x_quantized:
            x2 = fp8.quantize(x2, fp8.fwd)
        k2 = fp8.quantize(k2, fp8.fwd)
    b = None if bias is None else exact(bias).reshape(-1)
    h = rounded(gemm(x2, k2, b, fp8=fp8 is not None, dtype=dtype), dtype).reshape(-1, *features)
    y = activation(h, act, dtype, params)
    return Forward(y, x2, k2, h, tuple(features), act, dtype, params, fp8)


class Grads(NamedTuple):
    dx: Bounded  # (M, K)
    dk: Bounded  # (K, *F)
    db: Bounded  # (*F,)
    dh: Bounded  # (M, *F): the gradient the grad quantizer quantizes


def backward(fwd: Forward, dy) -> Grads:
    """dx, dkernel, dbias for the upstream gradient ``dy`` (``(M, *out_features)``)."""
    m = fwd.h.v.shape[0]
    dy = exact(dy).reshape(m, *fwd.y.v.shape[1:])
    dh = dact(dy, fwd.h, fwd.act, fwd.dtype, fwd.params)
    dh2 = dh.reshape(m, math.prod(fwd.features))  # not -1: M may be 0
    db = rounded(colsum(dh2), fwd.dtype).reshape(*fwd.features)
    if fwd.fp8 is not None:
        dh2 = fwd.fp8.quantize(dh2, fwd.fp8.grad)
    fp8 = fwd.fp8 is not None
    dx = rounded(gemm(dh2, fwd.k.T, fp8=fp8), fwd.dtype)
    dk = rounded(gemm(fwd.x.T, dh2, fp8=fp8), fwd.dtype).reshape(-1, *fwd.features)
    return Grads(dx, dk, db, dh)


# ---- docs/numerics.md §8's exact-math rule ---------------------------------------------------


def ulp(v, dtype) -> np.ndarray:
    """One unit in the last place of ``dtype`` at ``|v|`` (the subnormal spacing below)."""
    fi = ml_dtypes.finfo(np_dtype(dtype))
    mag = np.maximum(np.abs(np.asarray(v, np.float64)), float(fi.smallest_normal))
    return np.exp2(np.floor(np.log2(mag)) - fi.nmant)


def dequantized_product(a, b, bias, dtype) -> Bounded:
    """Numerics §8: float64 product of the dequantized operands ``a (M, K) · b (K, N)`` (+ bias),
    within float32 accumulation error ``K·2^-23·Σ|a||b|`` (the bias counted as one more term)
    plus one ulp of the output dtype."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    k = a.shape[-1]
    v = a @ b
    s = np.abs(a) @ np.abs(b)
    extra = _kernel_error(np.abs(v), s, bias is not None, True, dtype)
    if bias is not None:
        bias = np.asarray(bias, np.float64)
        v, s = v + bias, s + np.abs(bias)
    return Bounded(v, max(k, 4) * F32_ACC * s + ulp(v, dtype) + extra)


# ---- comparisons ----------------------------------------------------------------------------


def assert_bounded(got, ref: Bounded, dtype, what=""):
    """``got`` (an array of ``dtype``, ref's shape) within ``ref.e`` of ``ref.v``."""
    got = np.asarray(got)
    assert got.dtype == np_dtype(dtype), f"{what}: dtype {got.dtype}, want {np_dtype(dtype)}"
    assert got.shape == ref.v.shape, f"{what}: shape {got.shape}, want {ref.v.shape}"
    assert not np.isnan(ref.v).any(), f"{what}: the reference has NaN (bad test input)"
    assert not np.isnan(got.astype(np.float64)).any(), f"{what}: NaN in the result"
    assert_within(got.astype(np.float64), ref.v, ref.e, what)


def assert_agree(a, b, ref: Bounded, what=""):
    """Two implementations, each within ``ref.e`` of the reference: within ``2·ref.e`` of each
    other."""
    a, b = np.asarray(a), np.asarray(b)
    assert a.dtype == b.dtype and a.shape == b.shape, (what, a.dtype, b.dtype, a.shape, b.shape)
    assert_within(a.astype(np.float64), b.astype(np.float64), 2 * ref.e, what)
