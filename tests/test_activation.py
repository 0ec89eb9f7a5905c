"""te_jax.act_lu / dact_lu / quantize_dact_dbias / activation against the float64 oracle
(docs/numerics.md §1, §2, §7), the FFI path against the pure-JAX path, and under jit, vmap (any
axis), grad and check_grads; the implementation switch and TE_JAX_IMPLEMENTATION."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import float64_oracle as oracle
import te_jax
from helpers import (
    ACT_BY_ALIAS,
    ACTS,
    DTYPE_IDS,
    DTYPES,
    SOME_ACTS,
    Act,
    assert_dbias_matches,
    assert_matches,
    assert_within,
    dbias_bound,
    dz_shape,
    make_dz,
    make_x,
    np_dtype,
    shape_id,
    shapes_for,
    te_jax_custom_calls,
    tol,
)

CLAMPED = ACT_BY_ALIAS["clamped_swiglu"]
# Non-default clamped SwiGLU parameters (TE's test values): inputs cross both clamps.
CUSTOM = te_jax.ActivationParams(
    clamped_swiglu=te_jax.ClampedSwiGLUParams(limit=0.75, alpha=1.5, glu_linear_offset=0.5)
)
IMPLS = ["ffi", "xla"]

# (activation, act_params): every activation with its defaults, and clamped SwiGLU with CUSTOM.
CASES = [(a, None) for a in ACTS] + [(CLAMPED, CUSTOM)]


def case_id(case) -> str:
    act, params = case
    return f"{act}-custom" if params is not None else str(act)


def params_of(act: Act):
    """The parameters the transformation tests use: CUSTOM for clamped SwiGLU."""
    return CUSTOM if act is CLAMPED else None


def oracle_all(x, dz, act: Act, params):
    x64 = np.asarray(x, np.float64)
    dz64 = np.asarray(dz, np.float64)
    return oracle.act_lu(x64, act.enum, params), oracle.dact_lu(dz64, x64, act.enum, params)


def _ops(x, dz, act, act_params, impl):
    """Every public op on one input (traced inside a jitted program)."""
    kw = dict(activation_type=act, act_params=act_params, implementation=impl)
    y = te_jax.act_lu(x, **kw)
    dx = te_jax.dact_lu(dz, x, **kw)
    dx_db, dbias = te_jax.quantize_dact_dbias(dz, x, **kw)
    dx_nodb, no_dbias = te_jax.quantize_dact_dbias(dz, x, is_dbias=False, **kw)
    assert no_dbias is None, "is_dbias=False must return dbias None"
    return y, dx, dx_db, dbias, dx_nodb


@functools.partial(jax.jit, static_argnames=("specs", "impls"))
def many_ops(xs, dzs, specs, impls=tuple(IMPLS)):
    """``_ops`` for each input ``(xs[i], dzs[i])`` with ``specs[i] = (act names, params)``, on each
    implementation: ``out[impl][i]``. One compilation for many cases (a program per case would
    cost more to compile than to run)."""
    return {
        impl: tuple(
            _ops(x, dz, act, params, impl)
            for x, dz, (act, params) in zip(xs, dzs, specs, strict=True)
        )
        for impl in impls
    }


def run_cases(inputs, impls=tuple(IMPLS)):
    """``inputs``: ``[(case, x, dz)]`` (NumPy); the outputs ``out[impl][i]`` of one program."""
    specs = tuple((case[0].names, case[1]) for case, _, _ in inputs)
    xs = [jnp.asarray(x) for _, x, _ in inputs]
    dzs = [jnp.asarray(dz) for _, _, dz in inputs]
    return many_ops(xs, dzs, specs, impls)


class Failures:
    """Collects the assertion errors of many cases checked in one test, each under a label that
    names the activation (and dtype, shape, implementation), and fails once with all of them."""

    def __init__(self):
        self.errors = []

    def check(self, label, fn, *args, **kwargs):
        try:
            fn(*args, **kwargs)
        except AssertionError as e:
            self.errors.append(f"[{label}] {e}")

    def raise_any(self):
        if self.errors:
            raise AssertionError(f"{len(self.errors)} failed:\n" + "\n".join(self.errors))


def check_all_ops(outs, x, dz, act: Act, params, dtype, label=""):
    y, dx, dx_db, dbias, dx_nodb = outs
    y64, dx64 = oracle_all(x, dz, act, params)
    assert_matches(y, y64, dtype, act, what=f"{label} act_lu")
    assert_matches(dx, dx64, dtype, act, what=f"{label} dact_lu")
    assert_matches(dx_db, dx64, dtype, act, what=f"{label} quantize_dact_dbias dx")
    assert_matches(dx_nodb, dx64, dtype, act, what=f"{label} quantize_dact_dbias(is_dbias=False)")
    assert_dbias_matches(dbias, dx64, act.gated, dtype, act, what=f"{label} dbias")


def check_ffi_matches_xla(ffi, xla, x, dz, act: Act, params, dtype):
    """The two paths agree within twice the docs/numerics.md §7 tolerance (each is within it of
    float64)."""
    t = 2 * tol(dtype, act)
    names = ("act_lu", "dact_lu", "quantize_dact_dbias dx", "dbias", "dx(is_dbias=False)")
    for name, a, b in zip(names, ffi, xla, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape, (name, a.dtype, b.dtype, a.shape, b.shape)
        if name == "dbias":
            dx64 = oracle.dact_lu(dz.astype(np.float64), x.astype(np.float64), act.enum, params)
            bound = dbias_bound(dx64, act.gated, dtype, act, scale=2.0)
            assert_within(np.asarray(a, np.float64), np.asarray(b, np.float64), bound, name)
        else:
            np.testing.assert_allclose(
                np.asarray(a, np.float64), np.asarray(b, np.float64), rtol=t, atol=t, err_msg=name
            )


def _inputs(rng, case, dtype, shape):
    act, params = case
    x = make_x(rng, shape, dtype, act, params)
    dz = make_dz(rng, dz_shape(shape, act), dtype)
    return x, dz


def _shapes_of(case, dtype_index):
    """Two of the case's six shapes for each dtype, rotated by the case's index among those of
    its gating: over the three dtypes every case meets all six shapes, and every (dtype, shape)
    pair meets several activations (each of the 6 non-gated and 9 gated cases shifts by one)."""
    act = case[0]
    shapes = shapes_for(act)
    k = [c for c in CASES if c[0].gated == act.gated].index(case)
    return [shapes[(2 * dtype_index + j + k) % len(shapes)] for j in range(2)]


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_ops_match_float64_oracle(case, rng):
    """Every op on both implementations against the float64 oracle, and the FFI path against
    the pure-JAX path, for each dtype, in one program per case.

    Coverage: every (case, dtype, implementation) combination; the shapes (odd widths,
    size-1 and empty axes, no leading axis) pairwise with the others: every (case, shape),
    (dtype, shape) and (implementation, shape) pair meets (see ``_shapes_of``). The activation's
    formula does not depend on the shape, nor the kernel's row/tail loops on the activation."""
    act, params = case
    inputs = []
    for i, dtype in enumerate(DTYPES):
        for shape in _shapes_of(case, i):
            x, dz = _inputs(rng, case, dtype, shape)
            inputs.append((dtype, shape, x, dz))
    outs = run_cases([(case, x, dz) for _, _, x, dz in inputs])
    failures = Failures()
    for i, (dtype, shape, x, dz) in enumerate(inputs):
        label = f"{case_id(case)}-{np_dtype(dtype).name}-{shape_id(shape)}"
        for impl in IMPLS:
            failures.check(
                f"{label}-{impl}", check_all_ops, outs[impl][i], x, dz, act, params, dtype, impl
            )
        failures.check(
            f"{label} ffi vs xla",
            check_ffi_matches_xla,
            outs["ffi"][i],
            outs["xla"][i],
            x,
            dz,
            act,
            params,
            dtype,
        )
    failures.raise_any()


LARGE = [
    ("gelu", jnp.float32, (256, 1000)),
    ("swiglu", jnp.bfloat16, (64, 2, 4096)),
    ("clamped_swiglu", jnp.float16, (1000, 2, 257)),
    ("squared_relu", jnp.bfloat16, (8, 512, 130)),
    ("geglu_exact", jnp.float32, (3, 5, 2, 1031)),
    ("glu", jnp.float16, (4097, 2, 3)),  # many rows, tiny H: a long dbias sum
    ("quick_gelu", jnp.float32, (16411,)),  # one long row
]


@pytest.mark.parametrize(
    "alias, dtype, shape", LARGE, ids=[f"{a}-{np_dtype(d).name}-{shape_id(s)}" for a, d, s in LARGE]
)
def test_larger_shapes(alias, dtype, shape, rng):
    """Both implementations (one program) on shapes past the kernels' vector and thread
    splits."""
    act = ACT_BY_ALIAS[alias]
    x, dz = _inputs(rng, (act, None), dtype, shape)
    outs = run_cases([((act, None), x, dz)])
    failures = Failures()
    for impl in IMPLS:
        failures.check(impl, check_all_ops, outs[impl][0], x, dz, act, None, dtype, impl)
    failures.raise_any()


@pytest.mark.parametrize(
    "alias, dtype, shape",
    [("swiglu", jnp.bfloat16, (4096, 2, 96)), ("gelu", jnp.float32, (3000, 70))],
    ids=["swiglu-bf16", "gelu-f32"],
)
def test_dbias_is_deterministic(alias, dtype, shape, rng):
    """docs/numerics.md §2: the same inputs give the same bits on every run."""
    act = ACT_BY_ALIAS[alias]
    x, dz = _inputs(rng, (act, None), dtype, shape)
    x, dz = jnp.asarray(x), jnp.asarray(dz)
    f = jax.jit(lambda dz, x: te_jax.quantize_dact_dbias(dz, x, activation_type=alias))
    first = [np.asarray(a) for a in f(dz, x)]
    for _ in range(3):
        again = [np.asarray(a) for a in f(dz, x)]
        for a, b in zip(first, again, strict=True):
            np.testing.assert_array_equal(
                a.view(np.uint16 if a.itemsize == 2 else np.uint32),
                b.view(np.uint16 if b.itemsize == 2 else np.uint32),
            )


@pytest.mark.parametrize("dtype", DTYPES[1:], ids=DTYPE_IDS[1:])
@pytest.mark.parametrize("alias", ["gelu", "swiglu"])
def test_dbias_accumulates_in_float32(alias, dtype, rng):
    """Thousands of same-sign terms: a sum kept in bf16/f16 stalls once its ulp exceeds a
    term (at 256 / 2048), a float32 sum does not (docs/numerics.md §2). Both implementations."""
    act = ACT_BY_ALIAS[alias]
    shape = (8192, 2, 24) if act.gated else (8192, 24)
    x = rng.uniform(0.5, 1.5, shape).astype(np_dtype(dtype))  # f' > 0, f > 0
    dz = np.ones(dz_shape(shape, act), np_dtype(dtype))
    f = jax.jit(
        lambda dz, x: [
            te_jax.quantize_dact_dbias(dz, x, activation_type=alias, implementation=impl)[1]
            for impl in IMPLS
        ]
    )
    dx64 = oracle.dact_lu(dz, x, act.enum)
    for impl, dbias in zip(IMPLS, f(jnp.asarray(dz), jnp.asarray(x)), strict=True):
        assert_dbias_matches(dbias, dx64, act.gated, dtype, act, what=f"{impl} dbias")


def _large_inputs(act: Act, dtype):
    big = 100.0 if jnp.dtype(dtype) == jnp.float16 else 1000.0  # x² must fit float16
    mags = np.array([6.0, 9.5, 20.0, 60.0, big])
    vals = np.concatenate([mags, -mags, [0.25, -0.25]])
    if act.gated:  # every (a, b) pair; b stays small enough that f(a)·b fits
        b_max = 6.0 if jnp.dtype(dtype) == jnp.float16 else 20.0
        a, b = np.meshgrid(vals, np.clip(vals, -b_max, b_max), indexing="ij")
        x = np.stack([a.ravel(), b.ravel()], axis=-2)[None]
    else:
        x = vals[None]
    x = x.astype(np_dtype(dtype))
    dz = np.linspace(-1.0, 1.0, int(np.prod(dz_shape(x.shape, act))))
    dz = dz.reshape(dz_shape(x.shape, act)).astype(x.dtype)
    return x, dz


def _check_finite(outs):
    for out in outs:
        assert np.isfinite(np.asarray(out, np.float64)).all(), "inf or NaN for large inputs"


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_large_magnitude_inputs(dtype):
    """Far out on both sides (sigmoid/tanh/erf saturated): finite results that match float64.
    Every case on both implementations, in one program per dtype."""
    inputs = [(case, *_large_inputs(case[0], dtype)) for case in CASES]
    outs = run_cases(inputs)
    failures = Failures()
    for i, (case, x, dz) in enumerate(inputs):
        act, params = case
        for impl in IMPLS:
            label = f"{case_id(case)}-{impl}"
            failures.check(label, _check_finite, outs[impl][i])
            failures.check(label, check_all_ops, outs[impl][i], x, dz, act, params, dtype, impl)
    failures.raise_any()


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_eager_calls(case, rng):
    """Every op outside jit (primitive dispatch), the default implementation."""
    act, params = case
    dtype = jnp.float32
    shape = (5, 2, 9) if act.gated else (3, 7, 33)
    x, dz = _inputs(rng, case, dtype, shape)
    xj, dzj = jnp.asarray(x), jnp.asarray(dz)
    kw = dict(activation_type=act.names, act_params=params)
    y = te_jax.act_lu(xj, **kw)
    dx = te_jax.dact_lu(dzj, xj, **kw)
    dx_db, dbias = te_jax.quantize_dact_dbias(dzj, xj, **kw)
    y_act = te_jax.activation(xj, **kw)
    y64, dx64 = oracle_all(x, dz, act, params)
    assert_matches(y, y64, dtype, act, what="act_lu")
    assert_matches(y_act, y64, dtype, act, what="activation")
    assert_matches(dx, dx64, dtype, act, what="dact_lu")
    assert_matches(dx_db, dx64, dtype, act, what="quantize_dact_dbias dx")
    assert_dbias_matches(dbias, dx64, act.gated, dtype, act)


def test_default_activation_is_gelu(rng):
    act = ACT_BY_ALIAS["gelu"]
    x, dz = _inputs(rng, (act, None), jnp.float32, (4, 17))
    xj, dzj = jnp.asarray(x), jnp.asarray(dz)
    y64, dx64 = oracle_all(x, dz, act, None)
    assert_matches(te_jax.act_lu(xj), y64, jnp.float32, act)
    assert_matches(te_jax.activation(xj), y64, jnp.float32, act)
    assert_matches(te_jax.dact_lu(dzj, xj), dx64, jnp.float32, act)
    dx, dbias = te_jax.quantize_dact_dbias(dzj, xj)
    assert_matches(dx, dx64, jnp.float32, act)
    assert_dbias_matches(dbias, dx64, False, jnp.float32, act)


# --- vmap -----------------------------------------------------------------------------------------

B = 3  # batch size of the vmap tests


def _example_shape(act: Act):
    return (4, 2, 6) if act.gated else (4, 6)


def _vmap_axes():
    for act in SOME_ACTS:
        ndim = len(_example_shape(act))
        for axis in [*range(ndim + 1), -1]:
            yield pytest.param(act, axis, id=f"{act}-axis{axis}")


def _batched(rng, act, example_shape, axis, make):
    """A batched array with its batch axis at ``axis``, and its per-example slices."""
    if axis is None:
        a = make(example_shape)
        return a, [a] * B
    shape = list(example_shape)
    shape.insert(axis if axis >= 0 else len(shape) + 1 + axis, B)
    a = make(tuple(shape))
    return a, [np.take(a, i, axis=axis) for i in range(B)]


@pytest.mark.parametrize("act, axis", list(_vmap_axes()))
def test_vmap_act_lu_any_axis(act, axis, rng):
    params = params_of(act)
    xb, xs = _batched(
        rng, act, _example_shape(act), axis, lambda s: make_x(rng, s, jnp.float32, act, params)
    )
    f = jax.vmap(
        lambda x: te_jax.act_lu(x, activation_type=act.names, act_params=params), in_axes=axis
    )
    y = f(jnp.asarray(xb))
    want = np.stack([oracle.act_lu(x, act.enum, params) for x in xs])
    assert_matches(y, want, jnp.float32, act)
    # A real batching rule folds the batch into the rows; no sequential loop.
    jaxpr = str(jax.make_jaxpr(f)(jnp.asarray(xb)))
    assert "while" not in jaxpr and "scan" not in jaxpr, jaxpr


def _vmap_pairs():
    for act in SOME_ACTS:
        if act.gated:  # dz (4, 6) has 3 insertion points, x (4, 2, 6) has 4
            pairs = [(0, 0), (1, 1), (1, 2), (2, 3), (None, 2), (0, None)]
        else:
            pairs = [(0, 0), (1, 1), (0, 2), (None, 1), (2, None)]
        for dz_axis, x_axis in pairs:
            yield pytest.param(act, dz_axis, x_axis, id=f"{act}-dz{dz_axis}-x{x_axis}")


@pytest.mark.parametrize("act, dz_axis, x_axis", list(_vmap_pairs()))
def test_vmap_backward_any_axis(act, dz_axis, x_axis, rng):
    """dact_lu and quantize_dact_dbias under vmap: one dbias per batch element, not a sum."""
    params = params_of(act)
    x_shape = _example_shape(act)
    xb, xs = _batched(rng, act, x_shape, x_axis, lambda s: make_x(rng, s, jnp.float32, act, params))
    dzb, dzs = _batched(
        rng, act, dz_shape(x_shape, act), dz_axis, lambda s: make_dz(rng, s, jnp.float32)
    )
    kw = dict(activation_type=act.names, act_params=params)
    in_axes = (dz_axis, x_axis)
    dx = jax.vmap(lambda dz, x: te_jax.dact_lu(dz, x, **kw), in_axes=in_axes)(
        jnp.asarray(dzb), jnp.asarray(xb)
    )
    dx_db, dbias = jax.vmap(lambda dz, x: te_jax.quantize_dact_dbias(dz, x, **kw), in_axes=in_axes)(
        jnp.asarray(dzb), jnp.asarray(xb)
    )
    dx64 = [oracle.dact_lu(dz, x, act.enum, params) for dz, x in zip(dzs, xs, strict=True)]
    assert_matches(dx, np.stack(dx64), jnp.float32, act, what="vmap dact_lu")
    assert_matches(dx_db, np.stack(dx64), jnp.float32, act, what="vmap quantize_dact_dbias dx")
    feature = (2, 6) if act.gated else (6,)
    assert dbias.shape == (B, *feature), f"vmapped dbias has shape {dbias.shape}: one per example"
    for i in range(B):
        assert_dbias_matches(dbias[i], dx64[i], act.gated, jnp.float32, act, what=f"dbias[{i}]")


@pytest.mark.parametrize("act", SOME_ACTS, ids=str)
def test_nested_vmap(act, rng):
    params = params_of(act)
    kw = dict(activation_type=act.names, act_params=params)
    ex = _example_shape(act)  # inner vmap over axis 2 of an example, outer over axis 0
    xb = make_x(rng, (2, *ex[:2], 3, *ex[2:]), jnp.float32, act, params)
    dzb = make_dz(rng, (2, *dz_shape(ex, act)[:1], 3, *dz_shape(ex, act)[1:]), jnp.float32)
    inner = jax.vmap(lambda dz, x: te_jax.quantize_dact_dbias(dz, x, **kw), in_axes=(1, 2))
    dx, dbias = jax.vmap(inner)(jnp.asarray(dzb), jnp.asarray(xb))
    y = jax.vmap(jax.vmap(lambda x: te_jax.act_lu(x, **kw), in_axes=2))(jnp.asarray(xb))
    for i in range(2):
        for j in range(3):
            x_ij = np.take(xb[i], j, axis=2)
            dz_ij = np.take(dzb[i], j, axis=1)
            assert_matches(y[i, j], oracle.act_lu(x_ij, act.enum, params), jnp.float32, act)
            dx64 = oracle.dact_lu(dz_ij, x_ij, act.enum, params)
            assert_matches(dx[i, j], dx64, jnp.float32, act)
            assert_dbias_matches(dbias[i, j], dx64, act.gated, jnp.float32, act)


@pytest.mark.parametrize("act, axis", list(_vmap_axes()))
def test_vmap_of_grad(act, axis, rng):
    """Per-example gradients: vmap(grad(loss)) with the batch on any axis."""
    params = params_of(act)
    ex = _example_shape(act)
    xb, xs = _batched(
        rng, act, ex, axis, lambda s: make_x(rng, s, jnp.float32, act, params, kink_margin=0.02)
    )
    out_ex = dz_shape(ex, act)
    ws = [make_dz(rng, out_ex, jnp.float32) for _ in range(B)]

    def loss(x, w):
        return jnp.sum(te_jax.activation(x, activation_type=act.names, act_params=params) * w)

    g = jax.vmap(jax.grad(loss), in_axes=(axis, 0))(jnp.asarray(xb), jnp.asarray(np.stack(ws)))
    want = np.stack([oracle.dact_lu(w, x, act.enum, params) for w, x in zip(ws, xs, strict=True)])
    assert_matches(g, want, jnp.float32, act)


# --- grad -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_grad_matches_reference_grad(case, rng):
    """jax.grad through te_jax.activation equals jax.grad through
    te_jax.activation_reference.activation and the float64 derivative (inputs kept off the
    kinks, where jax.grad of min/clip halves), in float32 and bfloat16 (one program)."""
    act, params = case
    shape = (3, 2, 11) if act.gated else (3, 11)
    dtypes = DTYPES[:2]
    xs = [make_x(rng, shape, dt, act, params, kink_margin=0.02) for dt in dtypes]
    # representable in dtype: the cotangent is exact
    ws = [make_dz(rng, dz_shape(shape, act), dt) for dt in dtypes]

    def loss(fn, x, w):
        y = fn(x, activation_type=act.names, act_params=params)
        return jnp.sum(y.astype(jnp.float32) * w.astype(jnp.float32))

    @jax.jit
    def grads(xs, ws):
        return [
            [jax.grad(functools.partial(loss, fn))(x, w) for x, w in zip(xs, ws, strict=True)]
            for fn in (te_jax.activation, te_jax.activation_reference.activation)
        ]

    g_tes, g_refs = grads([jnp.asarray(x) for x in xs], [jnp.asarray(w) for w in ws])
    failures = Failures()
    for dtype, x, w, g_te, g_ref in zip(dtypes, xs, ws, g_tes, g_refs, strict=True):

        def check(dtype=dtype, x=x, w=w, g_te=g_te, g_ref=g_ref):
            assert g_te.dtype == jnp.dtype(dtype) and g_ref.dtype == jnp.dtype(dtype)
            want = oracle.dact_lu(w, x, act.enum, params)
            assert_matches(g_te, want, dtype, act, what="te_jax grad")
            t = 2 * tol(dtype, act)
            np.testing.assert_allclose(
                np.asarray(g_te, np.float64), np.asarray(g_ref, np.float64), rtol=t, atol=t
            )

        failures.check(f"{case_id(case)}-{np_dtype(dtype).name}", check)
    failures.raise_any()


@pytest.mark.parametrize("impl", [None, "xla"], ids=["default", "xla"])
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_check_grads(case, impl, rng):
    """Reverse-mode gradients of te_jax.activation against finite differences, float32 (the
    function jitted: check_grads evaluates it many times)."""
    act, params = case
    shape = (3, 2, 5) if act.gated else (3, 5)
    x = make_x(rng, shape, jnp.float32, act, params, edges=False, kink_margin=0.05)
    if act.name in ("SRELU", "SREGLU"):
        x = np.clip(x, -3, 3)  # keep the squares (and the finite-difference roundoff) moderate
    f = functools.partial(
        te_jax.activation, activation_type=act.names, act_params=params, implementation=impl
    )
    check_grads(
        jax.jit(f), (jnp.asarray(x),), order=1, modes=["rev"], atol=1e-2, rtol=1e-2, eps=1e-3
    )


@pytest.mark.parametrize("act", SOME_ACTS, ids=str)
def test_grad_jit_compositions(act, rng):
    params = params_of(act)
    shape = (2, 3, 2, 7) if act.gated else (2, 3, 7)
    x = make_x(rng, shape, jnp.float32, act, params, kink_margin=0.02)
    w = make_dz(rng, dz_shape(shape, act), jnp.float32)

    def loss(x):
        y = te_jax.activation(x, activation_type=act.names, act_params=params)
        return jnp.sum(jnp.tanh(y) * w)

    want_y = oracle.act_lu(x, act.enum, params)
    want = oracle.dact_lu(w * (1 - np.tanh(want_y) ** 2), x, act.enum, params)
    xj = jnp.asarray(x)
    for g in (
        jax.grad(loss)(xj),
        jax.jit(jax.grad(loss))(xj),
        jax.grad(jax.jit(loss))(xj),
        jax.value_and_grad(loss)(xj)[1],
    ):
        # tanh' in float32 adds a little error on top of the activation's.
        assert_matches(g, want, jnp.float32, act, scale=2.0)


# --- implementation switch ------------------------------------------------------------------------

OPS = ["act_lu", "dact_lu", "quantize_dact_dbias", "activation", "grad_activation"]


def _op_fn(op, act, params, impl):
    kw = dict(activation_type=act.names, act_params=params, implementation=impl)
    if op == "act_lu":
        return lambda dz, x: te_jax.act_lu(x, **kw)
    if op == "dact_lu":
        return lambda dz, x: te_jax.dact_lu(dz, x, **kw)
    if op == "quantize_dact_dbias":
        return lambda dz, x: te_jax.quantize_dact_dbias(dz, x, **kw)
    if op == "activation":
        return lambda dz, x: te_jax.activation(x, **kw)
    if op == "grad_activation":
        return lambda dz, x: jax.grad(lambda x: jnp.sum(te_jax.activation(x, **kw) * dz))(x)
    raise ValueError(op)


def _all_op_fns(act, params, impl):
    """Every op of OPS in one function (one compiled program): ``{op: output}``."""
    fns = {op: _op_fn(op, act, params, impl) for op in OPS}
    return lambda dz, x: {op: fn(dz, x) for op, fn in fns.items()}


def _lowered_calls(fn, args) -> list[str]:
    """te_jax custom calls in the HLO ``fn`` lowers to (no compilation: the implementation is
    chosen when tracing, and XLA removes no custom call whose result is returned)."""
    return te_jax_custom_calls(jax.jit(fn).lower(*args).as_text(dialect="hlo"))


def _check_op_values(op, out, x, dz, act, params):
    y64, dx64 = oracle_all(x, dz, act, params)
    if op in ("act_lu", "activation"):
        assert_matches(out, y64, jnp.float32, act, what=op)
    elif op == "quantize_dact_dbias":
        assert_matches(out[0], dx64, jnp.float32, act, what=op)
        assert_dbias_matches(out[1], dx64, act.gated, jnp.float32, act)
    else:
        assert_matches(out, dx64, jnp.float32, act, what=op)


def _check_all_op_values(outs, x, dz, act, params, label):
    failures = Failures()
    for op in OPS:
        failures.check(f"{label} {op}", _check_op_values, op, outs[op], x, dz, act, params)
    failures.raise_any()


@pytest.mark.parametrize("impl", [None, "ffi", "xla"], ids=["None", "ffi", "xla"])
@pytest.mark.parametrize("act", [ACT_BY_ALIAS["silu"], CLAMPED], ids=str)
def test_implementation_switch(act, impl, rng, monkeypatch):
    """For each op of OPS: 'ffi' lowers to a te_jax custom call, 'xla' to none, None to the
    kernel where te_jax has one for the backend (checked on each op's lowered HLO, and on the
    compiled program of all of them); all three give the oracle's values."""
    monkeypatch.delenv("TE_JAX_IMPLEMENTATION", raising=False)
    params = params_of(act)
    shape = (6, 2, 10) if act.gated else (6, 10)
    x = make_x(rng, shape, jnp.float32, act, params, kink_margin=0.02)
    dz = make_dz(rng, dz_shape(shape, act), jnp.float32)
    args = (jnp.asarray(dz), jnp.asarray(x))
    uses_ffi = {"ffi": True, "xla": False, None: te_jax.ffi_available()}[impl]
    for op in OPS:
        calls = _lowered_calls(_op_fn(op, act, params, impl), args)
        if uses_ffi:
            assert calls, f"{op}: implementation={impl!r} did not lower to a te_jax kernel"
        else:
            assert not calls, f"{op}: implementation={impl!r} lowered to te_jax kernels {calls}"
    f = jax.jit(_all_op_fns(act, params, impl)).lower(*args).compile()  # checked, then run
    assert bool(te_jax_custom_calls(f.as_text())) == uses_ffi
    _check_all_op_values(f(*args), x, dz, act, params, f"{act} implementation={impl!r}")


def test_env_var_forces_xla(rng, monkeypatch):
    """TE_JAX_IMPLEMENTATION=xla, read at call (trace) time, sends implementation=None to the
    pure-JAX path, for each op of OPS, jitted and eager; unset, None is the kernel again."""
    act = ACT_BY_ALIAS["geglu"]
    x = make_x(rng, (5, 2, 12), jnp.float32, act)
    dz = make_dz(rng, (5, 12), jnp.float32)
    args = (jnp.asarray(dz), jnp.asarray(x))

    monkeypatch.setenv("TE_JAX_IMPLEMENTATION", "xla")
    for op in OPS:  # a fresh function for each op, traced now under the env var
        assert not _lowered_calls(_op_fn(op, act, None, None), args), op
    # Every op in one fresh program: the compiled program checked, then run.
    f = jax.jit(_all_op_fns(act, None, None)).lower(*args).compile()
    assert not te_jax_custom_calls(f.as_text())
    _check_all_op_values(f(*args), x, dz, act, None, "env xla, jit")
    eager = {op: _op_fn(op, act, None, None)(*args) for op in OPS}
    _check_all_op_values(eager, x, dz, act, None, "env xla, eager")

    monkeypatch.delenv("TE_JAX_IMPLEMENTATION")
    for op in OPS:
        calls = _lowered_calls(_op_fn(op, act, None, None), args)
        assert bool(calls) == te_jax.ffi_available(), (op, calls)
    f = jax.jit(_all_op_fns(act, None, None)).lower(*args).compile()
    assert bool(te_jax_custom_calls(f.as_text())) == te_jax.ffi_available()
    _check_all_op_values(f(*args), x, dz, act, None, "env unset")


def test_ffi_available():
    assert te_jax.ffi_available("cpu") is True  # the CPU extension is always built
    assert isinstance(te_jax.ffi_available(), bool)
    assert te_jax.ffi_available() == te_jax.ffi_available(jax.default_backend())
    assert te_jax.ffi_available("gpu") == te_jax.ffi_available("cuda")
    if jax.default_backend() == "cpu":
        assert te_jax.ffi_available() is True
