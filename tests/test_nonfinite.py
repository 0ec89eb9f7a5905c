"""Non-finite inputs and dtype edges (docs/numerics.md §1, "Non-finite inputs"), both paths:

- NaN in x (either half of a gated x) or in dz gives NaN out: act_lu, dact_lu,
  quantize_dact_dbias (dx and dbias) and the gradient of ``activation``.
- Each component's value and derivative at +-max, +-inf, the min normal / min subnormal of
  float32, bfloat16 and float16, and where an intermediate overflows (x^2, x^3, beta*x, exp),
  against jax's float32 formula (jax.nn.* and jax.vjp), and against its limit at +-inf where that
  formula gives inf * 0 = NaN (the table below).
Small inputs: a handful of elements per case."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import float64_oracle as oracle
import te_jax
from helpers import ACTS, DTYPE_IDS, DTYPES, np_dtype, tol

IMPLS = ["ffi", "xla"]


@functools.partial(jax.jit, static_argnames=("act", "impl"))
def _ops(x, dz, act, impl):
    kw = dict(activation_type=act, implementation=impl)
    y = te_jax.act_lu(x, **kw)
    dx = te_jax.dact_lu(dz, x, **kw)
    dx_db, dbias = te_jax.quantize_dact_dbias(dz, x, **kw)
    _, vjp = jax.vjp(lambda v: te_jax.activation(v, **kw), x)
    (grad,) = vjp(dz)
    return y, dx, dx_db, dbias, grad


# --- NaN in, NaN out ---------------------------------------------------------------------------

# Columns of the test tensor: which input holds the NaN (x = a for a non-gated activation).
_COLS = ["clean", "nan_a", "nan_b", "nan_dz"]


def _nan_case(act, dtype):
    """x (2, [2,] 4) and dz (2, 4); row 0 holds the NaNs of _COLS, row 1 is clean."""
    a = np.array([[0.5, np.nan, -0.75, 1.5], [-0.5, 0.25, 2.0, -1.25]])
    b = np.array([[1.25, 0.5, np.nan, -2.0], [0.75, -1.5, 0.5, 1.0]])
    dz = np.array([[1.0, -0.5, 2.0, np.nan], [0.5, 1.5, -1.0, 0.25]])
    if not act.gated:
        a[0, 2] = 0.0  # no b: this column is clean, with x == 0 (relu'(0) = 0)
    x = np.stack([a, b], axis=-2) if act.gated else a
    return x.astype(np_dtype(dtype)), dz.astype(np_dtype(dtype))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("act", ACTS, ids=str)
def test_nan_in_nan_out(act, dtype, impl):
    x, dz = _nan_case(act, dtype)
    y, dx, dx_db, dbias, grad = (
        np.asarray(o, np.float64) for o in _ops(jnp.asarray(x), jnp.asarray(dz), act.names, impl)
    )
    nan_x = np.isnan(x.astype(np.float64))
    nan_in = nan_x.any(axis=-2) if act.gated else nan_x  # (2, 4): a or b NaN
    want_y = nan_in
    want_dx = nan_in | np.isnan(dz.astype(np.float64))
    if act.gated:
        want_dx = np.stack([want_dx, want_dx], axis=-2)  # both halves: lin'(NaN) = f'(NaN) = NaN
    np.testing.assert_array_equal(np.isnan(y), want_y, err_msg=f"{impl} act_lu NaN pattern")
    for name, got in (("dact_lu", dx), ("quantize_dact_dbias dx", dx_db), ("grad", grad)):
        np.testing.assert_array_equal(np.isnan(got), want_dx, err_msg=f"{impl} {name} NaN pattern")
    np.testing.assert_array_equal(np.isnan(dbias), want_dx.any(axis=0), err_msg=f"{impl} dbias")
    # The clean elements still match the float64 oracle.
    y64 = oracle.act_lu(x, act.enum)
    dx64 = oracle.dact_lu(dz, x, act.enum)
    np.testing.assert_array_equal(np.isnan(y64), want_y, err_msg="oracle act_lu NaN pattern")
    np.testing.assert_array_equal(np.isnan(dx64), want_dx, err_msg="oracle dact_lu NaN pattern")
    t = tol(dtype, act)
    np.testing.assert_allclose(y[~want_y], y64[~want_y], rtol=t, atol=t)
    for got in (dx, dx_db, grad):
        np.testing.assert_allclose(got[~want_dx], dx64[~want_dx], rtol=t, atol=t)


def test_nan_and_overflow_examples():
    """Two cases the formulas once got wrong: ReLU passes NaN on (does not hide it), and
    QuickGELU's derivative at 3.4e38 is its limit 1 (not an overflow's NaN)."""
    nan = jnp.array([jnp.nan])
    for impl in IMPLS:
        assert np.isnan(te_jax.act_lu(nan, "relu", implementation=impl)).all()
        assert np.isnan(te_jax.dact_lu(jnp.ones(1), nan, "relu", implementation=impl)).all()
        dq = te_jax.dact_lu(jnp.ones(1), jnp.array([3.4e38]), "quick_gelu", implementation=impl)
        np.testing.assert_array_equal(np.asarray(dq), [1.0])
        x = jnp.array([[jnp.nan], [1.0]])  # clamped SwiGLU with a NaN a: NaN, not limit·σ(α·limit)
        assert np.isnan(te_jax.act_lu(x, "clamped_swiglu", implementation=impl)).all()


# --- Edge values against jax's float32 formulas ------------------------------------------------

_LIMIT = 7.0  # clamped SwiGLU's default limit
_CLAMPED_EDGE_PARAMS = te_jax.ActivationParams(  # alpha = 200: clamped_silu(1) == 1 exactly
    clamped_swiglu=te_jax.ClampedSwiGLUParams(limit=_LIMIT, alpha=200.0, glu_linear_offset=1.0)
)


def _jax_clamped_silu(x, alpha=1.702):
    m = jnp.minimum(x, _LIMIT)
    return m * jax.nn.sigmoid(alpha * m)


# component -> (jax's float32 formula, how te_jax evaluates it alone:
#               (activation, act_params, "a" or "b", the other half's value)).
# For a linear half, the activation half's value at the other input is exactly 1.
COMPONENTS = {
    "gelu": (lambda x: jax.nn.gelu(x, approximate=True), (("gelu",), None, "a", None)),
    "gelu_exact": (lambda x: jax.nn.gelu(x, approximate=False), (("gelu_exact",), None, "a", None)),
    "sigmoid": (jax.nn.sigmoid, (("sigmoid", "linear"), None, "a", 1.0)),
    "silu": (jax.nn.silu, (("silu",), None, "a", None)),
    "quick_gelu": (lambda x: x * jax.nn.sigmoid(1.702 * x), (("quick_gelu",), None, "a", None)),
    "relu": (jax.nn.relu, (("relu",), None, "a", None)),
    "squared_relu": (lambda x: jnp.square(jax.nn.relu(x)), (("squared_relu",), None, "a", None)),
    # b = 0: lin(0) = 0 + glu_linear_offset = 1
    "clamped_silu": (_jax_clamped_silu, (("clamped_silu", "clamped_linear"), None, "a", 0.0)),
    "linear": (lambda b: b, (("relu", "linear"), None, "b", 1.0)),
    "clamped_linear": (
        lambda b: jnp.clip(b, -_LIMIT, _LIMIT) + 1.0,
        (("clamped_silu", "clamped_linear"), _CLAMPED_EDGE_PARAMS, "b", 1.0),
    ),
}

# Where jax's float32 formula gives NaN for a non-NaN x (inf * 0), te_jax gives the limit at
# +inf / -inf: (f, f') on each side (docs/numerics.md §1). The test records where it used them.
LIMITS = {
    "gelu": ((np.inf, 1.0), (0.0, 0.0)),
    "gelu_exact": ((np.inf, 1.0), (0.0, 0.0)),
    "silu": ((np.inf, 1.0), (0.0, 0.0)),
    "quick_gelu": ((np.inf, 1.0), (0.0, 0.0)),
    "clamped_silu": ((None, 0.0), (0.0, 0.0)),
}
# (component, which, x) where the limit replaces jax's NaN, x in float32 (docs/numerics.md §1).
JAX_NAN_EDGES = {
    *((c, "f", -np.inf) for c in ("gelu", "gelu_exact", "silu", "quick_gelu", "clamped_silu")),
    *((c, "df", s * np.inf) for c in ("gelu", "gelu_exact", "silu", "quick_gelu") for s in (1, -1)),
    ("clamped_silu", "df", -np.inf),
}


def _edges(dtype) -> np.ndarray:
    fi = ml_dtypes.finfo(np_dtype(dtype))
    mags = [float(fi.max), np.inf, float(fi.tiny), float(fi.smallest_subnormal)]
    if jnp.dtype(dtype) == jnp.float16:
        # exp overflows float16 at 11.09, x^3 at 40.3, x^2 at 256 (the compute is float32)
        mags += [11.125, 41.0, 256.0, 89.0]
    else:
        # exp(-x) overflows (sigmoid) at 88.7 / 104 (host exp), x^3 at 7e12 (GELU's c·x^3 at
        # 2e13), x^2 at 1.8e19, 1.702·x at 2e38
        mags += [89.0, 105.0, 2e13, 2e19, 2.5e38]
    mags = np.array(mags)
    return np.concatenate([mags, -mags, [0.0]]).astype(np_dtype(dtype))


@functools.partial(jax.jit, static_argnames=("act", "params", "half", "impl"))
def _component(x, other, act, params, half, impl):
    """(f, f') of one component at x through te_jax."""
    kw = dict(activation_type=act, act_params=params, implementation=impl)
    g = jnp.ones_like(x)
    if len(act) == 1:
        return te_jax.act_lu(x, **kw), te_jax.dact_lu(g, x, **kw)
    o = jnp.full_like(x, other)
    xx = jnp.stack([x, o] if half == "a" else [o, x], axis=-2)
    dx = te_jax.dact_lu(g, xx, **kw)
    return te_jax.act_lu(xx, **kw), dx[0] if half == "a" else dx[1]


def _jax_reference(fn, x, dtype):
    """jax's float32 value and vjp (cotangent 1) at x, rounded to dtype, as float64."""
    x32 = jnp.asarray(x.astype(np.float32))
    f, vjp = jax.vjp(fn, x32)
    (df,) = vjp(jnp.ones_like(x32))
    return [np.asarray(jnp.asarray(v).astype(dtype), np.float64) for v in (f, df)]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("comp", list(COMPONENTS))
def test_edge_values_match_jax(comp, dtype, impl):
    fn, (act, params, half, other) = COMPONENTS[comp]
    x = _edges(dtype)
    f, df = (
        np.asarray(v, np.float64)
        for v in _component(jnp.asarray(x), other, act, params, half, impl)
    )
    want = _jax_reference(fn, x, dtype)
    x64 = x.astype(np.float64)
    replaced = set()
    for which, w in zip(("f", "df"), want, strict=True):
        for i in np.flatnonzero(np.isnan(w)):
            pos, neg = LIMITS[comp]
            lim = (pos if x64[i] > 0 else neg)[0 if which == "f" else 1]
            if lim is None:  # clamped_silu(+inf) = limit·σ(α·limit): jax's value is not NaN there
                raise AssertionError(f"{comp} {which}({x64[i]}): jax NaN")
            w[i] = np.asarray(np.asarray(lim, np.float32).astype(np_dtype(dtype)), np.float64)
            replaced.add((comp, which, float(x64[i]) if np.isinf(x64[i]) else "finite"))
    t = tol(dtype, None) * (2 if comp in ("gelu", "gelu_exact") else 1)
    for which, got, w in (("f", f, want[0]), ("df", df, want[1])):
        assert not np.isnan(got).any(), f"{impl} {comp} {which}: NaN at {x64[np.isnan(got)]}"
        np.testing.assert_allclose(got, w, rtol=t, atol=t, err_msg=f"{impl} {comp} {which} x={x64}")
    # jax's formula gives NaN only at the documented edges (and GELU's derivative where x^2
    # overflows, |x| >= 2e19: the limit 1 / 0 there too).
    finite = {r for r in replaced if r[2] == "finite"}
    assert finite <= {("gelu", "df", "finite")}, finite
    assert {r for r in replaced if r[2] != "finite"} <= JAX_NAN_EDGES, replaced


@pytest.mark.parametrize("impl", IMPLS)
def test_oracle_at_the_edges(impl):
    """The float64 oracle's limits agree with te_jax at +-inf and float32's max."""
    x = np.array([np.inf, -np.inf, 3.4e38, -3.4e38, np.nan], np.float32)
    for act in ACTS:
        xx = np.stack([x, np.ones_like(x)], axis=-2) if act.gated else x
        dz = np.ones(x.shape, np.float32)
        y, dx, *_ = _ops(jnp.asarray(xx), jnp.asarray(dz), act.names, impl)
        for got, want in ((y, oracle.act_lu(xx, act.enum)), (dx, oracle.dact_lu(dz, xx, act.enum))):
            got = np.asarray(got, np.float64)
            with np.errstate(over="ignore"):  # rounded to float32, like the op's output
                want = want.astype(np.float32).astype(np.float64)
            np.testing.assert_array_equal(np.isnan(got), np.isnan(want), err_msg=str(act))
            ok = ~np.isnan(want)
            np.testing.assert_allclose(got[ok], want[ok], rtol=2e-5, err_msg=str(act))
