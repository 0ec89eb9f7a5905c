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
from test_activation import Failures

IMPLS = ["ffi", "xla"]


def _ops(x, dz, act, impl):
    kw = dict(activation_type=act, implementation=impl)
    y = te_jax.act_lu(x, **kw)
    dx = te_jax.dact_lu(dz, x, **kw)
    dx_db, dbias = te_jax.quantize_dact_dbias(dz, x, **kw)
    _, vjp = jax.vjp(lambda v: te_jax.activation(v, **kw), x)
    (grad,) = vjp(dz)
    return y, dx, dx_db, dbias, grad


@functools.partial(jax.jit, static_argnames="specs")
def _many_ops(xs, dzs, specs):
    """``_ops`` on ``(xs[i], dzs[i])`` with ``specs[i] = (activation, implementation)``: one
    program for all."""
    return [_ops(x, dz, act, impl) for x, dz, (act, impl) in zip(xs, dzs, specs, strict=True)]


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


def _check_nan_case(outs, x, dz, act, dtype, impl):
    y, dx, dx_db, dbias, grad = (np.asarray(o, np.float64) for o in outs)
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


def _nan_impls(k, d):
    """The implementations run for activation ``ACTS[k]`` in dtype ``DTYPES[d]``: the kernels
    always; the pure-JAX path in one dtype per activation, rotating (it computes in float32
    whatever the dtype, so its NaN handling is the formula's): every (activation, dtype),
    (activation, implementation) and (dtype, implementation) pair is covered."""
    return IMPLS if k % len(DTYPES) == d else ["ffi"]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_nan_in_nan_out(dtype):
    """Every activation, both implementations (see ``_nan_impls``), one program per dtype."""
    d = DTYPES.index(dtype)
    cases = [
        (act, impl, *_nan_case(act, dtype))
        for k, act in enumerate(ACTS)
        for impl in _nan_impls(k, d)
    ]
    outs = _many_ops(
        [jnp.asarray(x) for *_, x, _ in cases],
        [jnp.asarray(dz) for *_, dz in cases],
        tuple((act.names, impl) for act, impl, _, _ in cases),
    )
    failures = Failures()
    for (act, impl, x, dz), out in zip(cases, outs, strict=True):
        failures.check(f"{act}-{impl}", _check_nan_case, out, x, dz, act, dtype, impl)
    failures.raise_any()


def test_nan_and_overflow_examples():
    """Two cases the formulas once got wrong: ReLU passes NaN on (does not hide it), and
    QuickGELU's derivative at 3.4e38 is its limit 1 (not an overflow's NaN)."""

    @jax.jit
    def examples(nan, one, big, x):
        return {
            impl: (
                te_jax.act_lu(nan, "relu", implementation=impl),
                te_jax.dact_lu(one, nan, "relu", implementation=impl),
                te_jax.dact_lu(one, big, "quick_gelu", implementation=impl),
                te_jax.act_lu(x, "clamped_swiglu", implementation=impl),
            )
            for impl in IMPLS
        }

    # clamped SwiGLU with a NaN a: NaN, not limit·σ(α·limit)
    x = jnp.array([[jnp.nan], [1.0]])
    outs = examples(jnp.array([jnp.nan]), jnp.ones(1), jnp.array([3.4e38]), x)
    for impl in IMPLS:
        relu, drelu, dq, clamped = outs[impl]
        assert np.isnan(relu).all() and np.isnan(drelu).all(), impl
        np.testing.assert_array_equal(np.asarray(dq), [1.0], err_msg=impl)
        assert np.isnan(clamped).all(), impl


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
    """jax's float32 value and vjp (cotangent 1) at x (float32), rounded to dtype."""
    f, vjp = jax.vjp(fn, x)
    (df,) = vjp(jnp.ones_like(x))
    return [jnp.asarray(v).astype(dtype) for v in (f, df)]


@functools.partial(jax.jit, static_argnames="comp")
def _component_all(xs, comp):
    """For each dtype's edge values ``xs[i]``: te_jax's (f, f') on both implementations and
    jax's float32 formula (rounded to the dtype); one program per component."""
    fn, (act, params, half, other) = COMPONENTS[comp]
    return [
        (
            {impl: _component(x, other, act, params, half, impl) for impl in IMPLS},
            _jax_reference(fn, x.astype(jnp.float32), x.dtype),
        )
        for x in xs
    ]


@pytest.mark.parametrize("comp", list(COMPONENTS))
def test_edge_values_match_jax(comp):
    """Each dtype and implementation (one program)."""
    outs = _component_all([jnp.asarray(_edges(dtype)) for dtype in DTYPES], comp)
    failures = Failures()
    for dtype, did, (got, want) in zip(DTYPES, DTYPE_IDS, outs, strict=True):
        for impl in IMPLS:
            failures.check(f"{comp}-{did}-{impl}", _check_edges, comp, dtype, impl, got[impl], want)
    failures.raise_any()


def _check_edges(comp, dtype, impl, got, want):
    x = _edges(dtype)
    f, df = (np.asarray(v, np.float64) for v in got)
    want = [np.asarray(w, np.float64) for w in want]
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


def test_oracle_at_the_edges():
    """The float64 oracle's limits agree with te_jax at +-inf and float32's max (every
    activation, both implementations, one program)."""
    x = np.array([np.inf, -np.inf, 3.4e38, -3.4e38, np.nan], np.float32)
    xxs = [np.stack([x, np.ones_like(x)], axis=-2) if act.gated else x for act in ACTS]
    dz = np.ones(x.shape, np.float32)
    specs = tuple((a.names, impl) for impl in IMPLS for a in ACTS)
    outs = _many_ops([jnp.asarray(xx) for xx in xxs] * 2, [jnp.asarray(dz)] * len(specs), specs)
    outs = {impl: outs[i * len(ACTS) : (i + 1) * len(ACTS)] for i, impl in enumerate(IMPLS)}
    for impl in IMPLS:
        for act, xx, (y, dx, *_) in zip(ACTS, xxs, outs[impl], strict=True):
            for got, want in (
                (y, oracle.act_lu(xx, act.enum)),
                (dx, oracle.dact_lu(dz, xx, act.enum)),
            ):
                got = np.asarray(got, np.float64)
                with np.errstate(over="ignore"):  # rounded to float32, like the op's output
                    want = want.astype(np.float32).astype(np.float64)
                msg = f"{act} {impl}"
                np.testing.assert_array_equal(np.isnan(got), np.isnan(want), err_msg=msg)
                ok = ~np.isnan(want)
                np.testing.assert_allclose(got[ok], want[ok], rtol=2e-5, err_msg=msg)
