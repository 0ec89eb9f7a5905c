"""Float64 NumPy oracle for every activation of docs/numerics.md §1 and the dbias rule of §2.

Written straight from docs/numerics.md, independently of ``te_jax`` (it imports nothing from
it): the tests hold both the FFI kernels and ``te_jax.activation_reference`` against this file.

Activations are named by their enum value (0-13, docs/numerics.md §1). ``params`` is anything
with the attributes ``limit``, ``alpha`` and ``glu_linear_offset`` (a
``te_jax.ClampedSwiGLUParams``, an ``ActivationParams`` holding one, or the ``ClampedParams``
below), or ``None`` for the defaults.
Runtime parameters reach the kernels as float32, so ``act_lu``/``dact_lu`` round them to float32
unless ``exact_params=True`` (for a float64 computation, which keeps them as given).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

try:  # scipy is a dependency of jax, but the oracle does not insist on it.
    from scipy.special import erf as _erf
except ImportError:  # pragma: no cover
    _erf = np.vectorize(math.erf, otypes=[np.float64])

GELU_K = 0.7978845608028654  # sqrt(2 / pi), rounded to 0.7978845608 in the docs
GELU_C = 0.044715
QGELU_ALPHA = float(np.float32(1.702))  # the kernels hold 1.702 as a float32 constant


class ClampedParams(NamedTuple):
    limit: float = 7.0
    alpha: float = 1.702
    glu_linear_offset: float = 1.0


def _f32(v: float) -> float:
    return float(np.float32(v))


def clamped_params(params, exact: bool = False) -> ClampedParams:
    """``params`` (None, a ClampedSwiGLUParams-like or an ActivationParams-like) as float32
    values (as given with ``exact``). A ``ClampedParams`` is taken as already resolved."""
    if isinstance(params, ClampedParams):
        return params
    inner = getattr(params, "clamped_swiglu", params)  # accept ActivationParams too
    if inner is None:
        inner = ClampedParams()
    rnd = float if exact else _f32
    return ClampedParams(rnd(inner.limit), rnd(inner.alpha), rnd(inner.glu_linear_offset))


def sigmoid(x):
    # 0.5 * (1 + tanh(x / 2)) == 1 / (1 + exp(-x)), without overflow for large |x|.
    return 0.5 * (1.0 + np.tanh(0.5 * x))


# --- activation halves: each returns (f(x), f'(x)) in float64 ---------------------------------
#
# Non-finite inputs (docs/numerics.md §1): NaN in gives NaN out, value and derivative, for every
# half; at +-inf each half gives its limit. Finite float32 inputs never overflow a float64
# intermediate, so only +-inf needs the explicit limits of _with_limits.


def _with_limits(x, fd, pos, neg):
    """``fd = (f, df)`` evaluated on x (inf * 0 ignored), with f, df replaced by ``pos`` at +inf,
    ``neg`` at -inf, and NaN wherever x is NaN."""
    x = np.asarray(x, np.float64)
    out = []
    for v, p_, n_ in zip(fd, pos, neg, strict=True):
        v = np.where(x == np.inf, p_, np.where(x == -np.inf, n_, v))
        out.append(np.where(np.isnan(x), np.nan, v))
    return tuple(out)


def _quiet(fn):
    def wrapped(x, p=None):
        with np.errstate(invalid="ignore", over="ignore"):
            return fn(np.asarray(x, np.float64), p)

    wrapped.__name__ = fn.__name__
    wrapped.__doc__ = fn.__doc__
    return wrapped


@_quiet
def gelu(x, p=None):
    inner = GELU_K * (x + GELU_C * x**3)
    t = np.tanh(inner)
    f = 0.5 * x * (1.0 + t)
    df = 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * GELU_K * (1.0 + 3.0 * GELU_C * x * x)
    return _with_limits(x, (f, df), (np.inf, 1.0), (0.0, 0.0))


@_quiet
def gelu_exact(x, p=None):
    cdf = 0.5 * (1.0 + _erf(x / math.sqrt(2.0)))
    pdf = np.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)
    return _with_limits(x, (x * cdf, cdf + x * pdf), (np.inf, 1.0), (0.0, 0.0))


@_quiet
def sigmoid_act(x, p=None):
    s = sigmoid(x)
    return _with_limits(x, (s, s * (1.0 - s)), (1.0, 0.0), (0.0, 0.0))


@_quiet
def silu(x, p=None):
    s = sigmoid(x)
    return _with_limits(x, (x * s, s * (1.0 + x * (1.0 - s))), (np.inf, 1.0), (0.0, 0.0))


@_quiet
def quick_gelu(x, p=None):
    s = sigmoid(QGELU_ALPHA * x)
    fd = (x * s, s + QGELU_ALPHA * x * s * (1.0 - s))
    return _with_limits(x, fd, (np.inf, 1.0), (0.0, 0.0))


@_quiet
def relu(x, p=None):
    pos = x > 0
    fd = (np.where(pos, x, 0.0), np.where(pos, 1.0, 0.0))  # f'(0) = 0
    return _with_limits(x, fd, (np.inf, 1.0), (0.0, 0.0))


@_quiet
def squared_relu(x, p=None):
    pos = x > 0
    fd = (np.where(pos, x * x, 0.0), np.where(pos, 2.0 * x, 0.0))
    return _with_limits(x, fd, (np.inf, np.inf), (0.0, 0.0))


@_quiet
def clamped_silu(a, p=None):
    c = clamped_params(p)
    m = np.minimum(a, c.limit)  # clamped from above only
    s = sigmoid(c.alpha * m)
    f = m * s
    df = np.where(a <= c.limit, s + c.alpha * m * s * (1.0 - s), 0.0)
    f_limit = c.limit * sigmoid(c.alpha * c.limit)
    return _with_limits(a, (f, df), (f_limit, 0.0), (0.0, 0.0))


@_quiet
def identity(b, p=None):
    return _with_limits(b, (b, np.ones_like(b)), (np.inf, 1.0), (-np.inf, 1.0))


@_quiet
def clamped_linear(b, p=None):
    c = clamped_params(p)
    v = np.clip(b, -c.limit, c.limit) + c.glu_linear_offset
    dv = np.where((b >= -c.limit) & (b <= c.limit), 1.0, 0.0)  # inclusive bounds
    lo, hi = -c.limit + c.glu_linear_offset, c.limit + c.glu_linear_offset
    return _with_limits(b, (v, dv), (hi, 0.0), (lo, 0.0))


# enum value -> (name, activation half, linear half or None when not gated)
ACTIVATIONS = {
    0: ("GELU", gelu, None),
    1: ("GEGLU", gelu, identity),
    2: ("GLU", sigmoid_act, identity),
    3: ("SILU", silu, None),
    4: ("SWIGLU", silu, identity),
    5: ("RELU", relu, None),
    6: ("REGLU", relu, identity),
    7: ("QGELU", quick_gelu, None),
    8: ("QGEGLU", quick_gelu, identity),
    9: ("SRELU", squared_relu, None),
    10: ("SREGLU", squared_relu, identity),
    11: ("CLAMPED_SWIGLU", clamped_silu, clamped_linear),
    12: ("GELU_EXACT", gelu_exact, None),
    13: ("GEGLU_EXACT", gelu_exact, identity),
}


def is_gated(act: int) -> bool:
    return ACTIVATIONS[int(act)][2] is not None


def _f64(a):
    return np.asarray(a).astype(np.float64)


def act_lu(x, act: int, params=None, *, exact_params=False):
    """y = f(x) (non-gated, shape (..., H)) or f(x[..., 0, :]) * lin(x[..., 1, :]) (gated)."""
    _, fn, lin = ACTIVATIONS[int(act)]
    params = clamped_params(params, exact_params)
    x = _f64(x)
    if lin is None:
        return fn(x, params)[0]
    assert x.ndim >= 2 and x.shape[-2] == 2, x.shape
    f, _ = fn(x[..., 0, :], params)
    v, _ = lin(x[..., 1, :], params)
    return f * v


def dact_lu(dz, x, act: int, params=None, *, exact_params=False):
    """dx with x's shape: f'(x)·dz, or (gated) dA = f'(a)·dz·b', dB = lin'(b)·dz·f(a)."""
    _, fn, lin = ACTIVATIONS[int(act)]
    params = clamped_params(params, exact_params)
    x, dz = _f64(x), _f64(dz)
    if lin is None:
        assert dz.shape == x.shape, (dz.shape, x.shape)
        return fn(x, params)[1] * dz
    assert dz.shape == x.shape[:-2] + x.shape[-1:], (dz.shape, x.shape)
    f, df = fn(x[..., 0, :], params)
    v, dv = lin(x[..., 1, :], params)
    return np.stack([df * dz * v, dv * dz * f], axis=-2)


def dbias(dx, gated: bool):
    """The sum of dx over every axis but the trailing feature axes ((H,) or (2, H))."""
    dx = _f64(dx)
    n_feature = 2 if gated else 1
    return dx.sum(axis=tuple(range(dx.ndim - n_feature)))


def dbias_abs(dx, gated: bool):
    """The sum of |dx| over the same axes: the scale of the rounding error of a dbias sum."""
    return dbias(np.abs(_f64(dx)), gated)


def kinks(act: int, params=None) -> tuple[float, ...]:
    """Input values where f or f' is not smooth (finite differences must stay away from them)."""
    name = ACTIVATIONS[int(act)][0]
    if name in ("RELU", "REGLU", "SRELU", "SREGLU"):
        return (0.0,)
    if name == "CLAMPED_SWIGLU":
        c = clamped_params(params)
        return (c.limit, -c.limit)
    return ()
