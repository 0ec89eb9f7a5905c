"""te_jax.quantize.reference against the NumPy oracle: raw bits and scales equal for every mode,
q_dtype, layout and input dtype; shapes as ``scale_shapes``; dequantized values within one ulp of
the format (docs/numerics.md §7)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import quantize_oracle as oracle
from te_jax.quantize import QuantizeLayout, reference, shapes

from .cases import (
    CONFIG_BY_MODE,
    CONFIGS,
    CURRENT,
    DELAYED,
    DTYPES,
    E2M1,
    E4M3,
    E5M2,
    FIELDS,
    MXFP8,
    NVFP4,
    RC,
    assert_same_bits,
    dq_tol,
    format_ulp,
    make_y,
    quantize_batch,
    shape_id,
    stack,
    unstack,
)

F32 = np.float32
quantize_one = jax.jit(reference.quantize, static_argnames="n_feature_axes")


@functools.partial(jax.jit, static_argnames="n_feature_axes")
def quantize_dq(y, q, n_feature_axes=1):
    """The tensor and its dequantized value: one compilation (eagerly, dequantize would
    compile op by op)."""
    t = reference.quantize(y, q, n_feature_axes=n_feature_axes)
    return t, t.dequantize()


def oracle_quantize(y, cfg, layout=RC, nf=1, scale=None, amax=None):
    return oracle.quantize(y, int(cfg.mode), int(layout), cfg.q_dtype, nf, scale=scale, amax_=amax)


def elementwise_scale(res, cfg, nf, colwise=False):
    """``c`` with ``dequantized = q · c`` elementwise (float64), from an oracle result."""
    data = res["colwise_data" if colwise else "data"]
    ones = np.ones(data.shape)
    return oracle.dequantize(
        {**res, "data": ones, "colwise_data": ones}, int(cfg.mode), 0, nf, colwise=colwise
    )


def assert_dequant_within_format(dq, y, res, cfg, nf=1, what=""):
    """docs/numerics.md §7: ``|dequantize() - y|`` within one ulp of the format at ``y``'s scaled
    magnitude (plus one rounding to the output dtype), where that is meaningful: not where
    delayed scaling saturates, and for NVFP4 only in blocks whose E4M3 scale is normal (a
    subnormal or zero block scale is coarser than the data format)."""
    y64 = np.asarray(y).astype(np.float64)
    dq64 = np.asarray(dq).astype(np.float64)
    c = elementwise_scale(res, cfg, nf)
    q = oracle.Q_MAX[cfg.q_dtype]
    with np.errstate(divide="ignore", invalid="ignore"):
        v = np.where(c > 0, y64 / c, 0.0)
    check = np.isfinite(v)
    if cfg.mode is DELAYED:
        check &= np.abs(v) <= q
    if cfg.mode is NVFP4:
        bs = np.repeat(res["scale_inv"].astype(np.float64), 16, axis=-1)
        check &= bs >= 2.0**-6
    allowed = format_ulp(np.minimum(np.abs(v), q), cfg.q_dtype) * c * (1 + 2.0**-20)
    allowed += dq_tol(dq.dtype) * np.abs(y64) + 2.0**-140
    err = np.abs(dq64 - y64)
    bad = check & ~(err <= allowed)
    assert check.mean() > 0.5, f"{what}: too few elements checked"
    if bad.any():
        i = tuple(np.argwhere(bad)[0])
        raise AssertionError(
            f"{what}: {int(bad.sum())} dequantized values beyond one format ulp; at {i}: y "
            f"{y64[i]!r}, dequantized {dq64[i]!r}, allowed error {allowed[i]!r}"
        )


# --- every mode and q_dtype, many magnitudes, the three input dtypes' values ----------------------

NUMERICS_SHAPE = (2, 32, 64)


def _variants(rng, cfg):
    """(float32 input, delayed scale, name): the three input dtypes' values with exact ties,
    zero and tiny blocks, and whole tensors scaled far down (subnormal values, scale near
    float32 max, subnormal scale_inv) and far up."""
    out = []
    for dt, factor in zip(DTYPES, (1.0, 2.0, 1.37), strict=True):  # delayed: exact, saturating
        y, u = make_y(rng, NUMERICS_SHAPE, dt, cfg.q_dtype)
        out.append((y.astype(F32), factor / u, f"values of {dt}"))
    y, u = make_y(rng, NUMERICS_SHAPE, F32, cfg.q_dtype)
    out.append(((y.astype(np.float64) * 2.0**-120).astype(F32), 2.0**120 / u, "tiny tensor"))
    y, u = make_y(rng, NUMERICS_SHAPE, F32, cfg.q_dtype)
    scaled = y.astype(np.float64) / np.abs(y.astype(np.float64)).max() * 2.0**-130
    out.append((scaled.astype(F32), float(np.finfo(F32).max), "subnormal amax"))
    y, u = make_y(rng, NUMERICS_SHAPE, F32, cfg.q_dtype)
    out.append(((y.astype(np.float64) * 2.0**100).astype(F32), 0.9 * 2.0**-100 / u, "huge"))
    return out


@pytest.mark.parametrize("cfg", CONFIGS, ids=str)
def test_quantize_matches_oracle(cfg, rng):
    variants = _variants(rng, cfg)
    ys = jnp.asarray(np.stack([v[0] for v in variants]))
    qs = stack([cfg.quantizer(RC, scale=v[1]) for v in variants])
    tensors, dqs = quantize_batch(ys, qs)
    for i, (y, scale, name) in enumerate(variants):
        want = oracle_quantize(y, cfg, scale=np.float32(scale))
        got = unstack(tensors, i)
        assert_same_bits(got, want, what=f"{cfg} {name}")
        dq = np.asarray(dqs[i])
        assert dq.dtype == F32 and dq.shape == y.shape
        # dequantize() is data · scale in float32: against the oracle's float64 product.
        dq_ref = oracle.dequantize(want, int(cfg.mode), int(RC))
        np.testing.assert_allclose(dq, dq_ref, rtol=2.0**-23, atol=2.0**-148, err_msg=name)
        if name.startswith("values"):
            assert_dequant_within_format(dq, y, want, cfg, what=f"{cfg} {name}")


@pytest.mark.parametrize(
    "mode,dtype", [(DELAYED, DTYPES[2]), (MXFP8, DTYPES[1])], ids=["delayed-f16", "mxfp8-bf16"]
)
def test_input_dtypes(mode, dtype, rng):
    """bfloat16 and float16 arrays in, their dtype back from dequantize. (What each mode does
    with those dtypes' values is in test_quantize_matches_oracle; the dtype handling, a cast
    to float32 on the way in and back on the way out, is the same code for every mode.)"""
    cfg = CONFIG_BY_MODE[mode]
    y, u = make_y(rng, (64, 32), dtype, cfg.q_dtype)
    q = cfg.quantizer(RC, scale=1.0 / u)
    got, dq = quantize_dq(jnp.asarray(y), q)
    assert got.dq_dtype == dtype
    want = oracle_quantize(y, cfg, scale=np.float32(1.0 / u))
    assert_same_bits(got, want, what=str(cfg))
    assert dq.dtype == dtype
    assert_dequant_within_format(dq, y, want, cfg)


# --- shapes and layouts ---------------------------------------------------------------------------

# (shape, n_feature_axes, layout): leading ranks 0 to 3, gated dact outputs (2 feature axes),
# each layout. A block-scaled colwise copy needs a leading axis: the 1-D case is rowwise only.
SHAPES = [
    ((64,), 1, QuantizeLayout.ROWWISE),
    ((32, 64), 1, QuantizeLayout.COLWISE),
    ((2, 1, 32, 32), 1, RC),
    ((2, 32, 2, 32), 2, QuantizeLayout.COLWISE),
    ((64, 2, 32), 2, RC),
]
LAYOUT_CASES = (
    [(CURRENT, s) for s in SHAPES[1:4]]
    + [(CURRENT, ((64,), 1, RC))]  # tensor scaling: a colwise copy of a single row
    + [(MXFP8, s) for s in SHAPES if s[0] != (32, 64)]  # colwise-only: the nf=2 case
    + [(NVFP4, SHAPES[3])]
)


@pytest.mark.parametrize(
    "mode,case",
    LAYOUT_CASES,
    ids=[f"{m.name}-{shape_id(c[:2])}-{c[2].name}" for m, c in LAYOUT_CASES],
)
def test_shapes_and_layouts(mode, case, rng):
    shape, nf, layout = case
    cfg = CONFIG_BY_MODE[mode]
    y, u = make_y(rng, shape, F32, cfg.q_dtype, nf)
    got, dq = quantize_dq(jnp.asarray(y), cfg.quantizer(layout), n_feature_axes=nf)
    want = oracle_quantize(y, cfg, layout, nf)
    assert_same_bits(got, want, what=f"{cfg} {shape}")
    assert got.shape == shape and got.n_feature_axes == nf
    specs = shapes.scale_shapes(shape, mode, layout, nf, cfg.q_dtype)
    for name in FIELDS:
        leaf = getattr(got, name)
        spec = specs[name]
        assert (leaf is None) == (spec is None), name
        if leaf is not None:
            assert (leaf.shape, leaf.dtype) == (spec.shape, spec.dtype), name
    # Dequantize reads the rowwise data, or the colwise copy (transposed back) without it.
    dq_ref = oracle.dequantize(want, int(mode), int(layout), nf, colwise=not layout.has_rowwise)
    np.testing.assert_allclose(np.asarray(dq), dq_ref, rtol=2.0**-23, atol=2.0**-148)


ABSTRACT_SHAPES = [((4, 32, 64), 1), ((2, 64, 3, 32), 2)]
MODES = [DELAYED, CURRENT, MXFP8, NVFP4]


@pytest.mark.parametrize("layout", list(QuantizeLayout), ids=lambda lay: lay.name)
@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
def test_abstract_shapes_match_scale_shapes(mode, layout):
    """``jax.eval_shape`` of ``quantize`` agrees with ``scale_shapes`` (no compilation).
    Pairwise: every (mode, layout) pair, with the shape (one feature axis, or two and a rank-4
    input) alternating so that every (mode, shape) and (layout, shape) pair meets too (each
    trace of the reference costs about a second for NVFP4). test_shapes_and_layouts checks more
    (shape, nf, layout) combinations against scale_shapes on compiled results."""
    cfg = CONFIG_BY_MODE[mode]
    shape, nf = ABSTRACT_SHAPES[(MODES.index(mode) + list(QuantizeLayout).index(layout)) % 2]
    y = jax.ShapeDtypeStruct(shape, jnp.bfloat16)
    got = jax.eval_shape(
        functools.partial(reference.quantize, n_feature_axes=nf), y, cfg.quantizer(layout)
    )
    specs = shapes.scale_shapes(shape, mode, layout, nf, cfg.q_dtype)
    for name in FIELDS:
        leaf, spec = getattr(got, name), specs[name]
        assert (leaf is None) == (spec is None), (name, shape)
        if leaf is not None:
            assert (leaf.shape, leaf.dtype) == (spec.shape, spec.dtype), (name, shape)
    assert got.dq_dtype == jnp.bfloat16 and got.shape == shape


def test_scale_shapes_examples():
    s = shapes.scale_shapes((4, 64, 96), MXFP8, RC)
    assert s["data"].shape == (4, 64, 96) and s["data"].dtype == E4M3
    assert s["scale_inv"].shape == (4, 64, 3) and s["scale_inv"].dtype == ml_dtypes.float8_e8m0fnu
    assert s["colwise_scale_inv"].shape == (4, 2, 96)
    assert s["amax"] is None and s["global_scale_inv"] is None
    s = shapes.scale_shapes((4, 32, 2, 16), NVFP4, QuantizeLayout.COLWISE, n_feature_axes=2)
    assert s["data"] is None and s["scale_inv"] is None
    assert s["colwise_data"].shape == (4, 32, 2, 16) and s["colwise_data"].dtype == E2M1
    assert s["colwise_scale_inv"].shape == (4, 2, 2, 16) and s["colwise_scale_inv"].dtype == E4M3
    assert s["global_scale_inv"].shape == () and s["amax"].shape == ()
    s = shapes.scale_shapes((3, 5, 2, 7), DELAYED, QuantizeLayout.COLWISE, 2, E5M2)
    assert s["data"] is None and s["colwise_data"].shape == (2, 7, 3, 5)
    assert s["scale_inv"].shape == () and s["colwise_scale_inv"].shape == ()


# --- the building blocks --------------------------------------------------------------------------


def _amax_cases():
    tiny = [0.0, 1e-45, 3e-42, 1e-39, 1.1754942e-38, 1.1754944e-38, 1e-30, 1e-3]
    big = [0.5, 1.0, 3.0, 448.0, 57344.0, 1e20, float(np.finfo(F32).max), np.inf, np.nan]
    return np.array(tiny + big, F32)


@pytest.mark.parametrize("q_dtype", [E4M3, E5M2], ids=str)
def test_mxfp8_exponent(q_dtype):
    q = oracle.Q_MAX[q_dtype]
    powers = (q * 2.0 ** np.arange(-140, 110)).astype(F32)
    powers = powers[(powers > 0) & np.isfinite(powers)]
    edges = [powers, np.nextafter(powers, F32(np.inf)), np.nextafter(powers, F32(0))]
    noise = np.abs(np.random.default_rng(0).standard_normal(500)).astype(F32) * np.float32(1e-20)
    a = np.concatenate([_amax_cases(), *edges, noise])
    got = np.asarray(jax.jit(reference.mxfp8_exponent, static_argnums=1)(a, q))
    want = oracle.mxfp8_exponent(a, q)
    np.testing.assert_array_equal(got, want)
    assert got[0] == -127 and got[np.isnan(a)][0] == 128 and got[np.isinf(a)][0] == 127


@pytest.mark.parametrize("fn", ["current_scale", "nvfp4_global_scale"])
def test_tensor_scales(fn):
    a = _amax_cases()
    if fn == "current_scale":
        got = [
            np.asarray(jax.jit(reference.current_scale, static_argnums=1)(a, q))
            for q in (448.0, 57344.0)
        ]
        want = [np.array([oracle.current_scale(x, q) for x in a]) for q in (448.0, 57344.0)]
    else:
        got = [np.asarray(jax.jit(reference.nvfp4_global_scale)(a))]
        want = [np.array([oracle.nvfp4_global_scale(x) for x in a])]
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(oracle.raw_bits(g), oracle.raw_bits(w.astype(F32)))
    assert got[0][0] == 1.0  # amax == 0
    assert got[0][1] == np.finfo(F32).max  # a subnormal amax overflows Q / amax


def test_amax_is_exact():
    y = np.array([[1e-45, -3e-41], [0.0, -0.0]], F32)
    assert np.asarray(jax.jit(reference.amax)(y)).view(np.uint32) == np.float32(3e-41).view(
        np.uint32
    )
    assert float(jax.jit(reference.amax)(jnp.zeros((0, 4)))) == 0.0
    yb = jnp.asarray([[-2.5, 1.0], [3.0, -7.0]], jnp.bfloat16)
    a = jax.jit(reference.amax)(yb)
    assert a.dtype == jnp.float32 and a.shape == () and float(a) == 7.0


# --- the given-amax entry point -------------------------------------------------------------------


@pytest.mark.parametrize("mode", [CURRENT, NVFP4], ids=lambda m: m.name)
def test_quantize_from_amax(mode, rng):
    cfg = CONFIG_BY_MODE[mode]
    y, u = make_y(rng, (32, 64), F32, cfg.q_dtype)
    given = np.float32(4 * oracle.amax(y))  # e.g. the max over shards
    fn = jax.jit(reference.quantize_from_amax, static_argnames="n_feature_axes")
    got = fn(jnp.asarray(y), cfg.quantizer(RC, scale=0.5 / u), jnp.asarray([given]))
    want = oracle_quantize(y, cfg, scale=np.float32(0.5 / u), amax=given)
    assert_same_bits(got, want, what=str(cfg))
    assert float(got.amax) == given


def test_quantize_with_scale_matches_quantize(rng):
    """The bare-configuration entry point builds the same computation: same shapes for every
    mode, same bits for a stateful (delayed) and a stateless one."""
    y, u = make_y(rng, (32, 64), F32, E5M2)
    for cfg in CONFIG_BY_MODE.values():
        fn = functools.partial(
            reference.quantize_with_scale, scaling_mode=cfg.mode, q_layout=RC, q_dtype=cfg.q_dtype
        )
        b = jax.eval_shape(fn, jnp.asarray(y), scale=jnp.float32(1 / u))
        a = jax.eval_shape(reference.quantize, y, cfg.quantizer(RC))
        assert jax.tree.structure(a) == jax.tree.structure(b)
        assert jax.tree.leaves(a) == jax.tree.leaves(b)
        if cfg in (CONFIG_BY_MODE[DELAYED], CONFIG_BY_MODE[MXFP8]):
            got = jax.jit(fn)(jnp.asarray(y), scale=jnp.float32(1 / u))
            want = oracle_quantize(y, cfg, scale=np.float32(1 / u))
            assert_same_bits(got, want, what=str(cfg))


# --- defined behaviour outside the tested range (no comparisons with NaN passing) -----------------


def test_mxfp8_nan_and_inf_blocks():
    y = np.ones((1, 96), F32)
    y[0, 5] = np.nan  # block 0
    y[0, 40] = np.inf  # block 1
    t = quantize_one(jnp.asarray(y), CONFIG_BY_MODE[MXFP8].quantizer(QuantizeLayout.ROWWISE))
    bits = np.asarray(t.scale_inv).view(np.uint8)[0]
    assert list(bits) == [0xFF, 127 + 127, 127 - 8]  # NaN, clamped 2^127, ceil(log2(1/448))
    data = np.asarray(t.data).astype(np.float32)[0]
    assert np.isnan(data[:32]).all()  # a NaN block is NaN throughout
    assert data[40] == 448.0 and (data[32:40] == 0).all()  # inf saturates; 1 · 2^-127 -> 0


def test_nvfp4_exact_ties():
    """Values whose ``(y · S) / block_scale`` is exactly an E2M1 tie (0.25, 0.75, ..., 5): the
    division must be rounded once (XLA would multiply by ``1/block_scale`` if let)."""
    s = 2.0**3  # global amax 2688 / 8 = 336 makes S a power of two
    # E4M3 block scales whose float32 reciprocal moves these ties by an ulp (found by search).
    bs_values = [0.029296875, 0.0546875, 0.013671875, 1.125]
    ties = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.75, -2.5, -5.0, 6.0, 0.5, 3.0])
    rows = []
    for bs in bs_values:
        row = np.zeros(16)
        row[0] = 6.0 * bs / s  # the block amax: (amax_b / 6) · S = bs exactly
        row[1 : 1 + ties.size] = ties * bs / s
        rows.append(row)
    rows.append(np.full(16, 2688.0 / s))  # a block holding the global amax
    y = np.stack(rows).astype(F32)
    cfg = CONFIG_BY_MODE[NVFP4]
    got = quantize_one(jnp.asarray(y), cfg.quantizer(QuantizeLayout.ROWWISE))
    want = oracle_quantize(y, cfg, QuantizeLayout.ROWWISE)
    assert_same_bits(got, want, what="nvfp4 ties")
    q = np.asarray(got.data).astype(np.float64)
    for row in q[:-1]:
        np.testing.assert_array_equal(row[1:8], [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0])  # to even


def test_float64_input_is_quantized_as_its_float32_value(rng):
    from helpers import enable_x64

    cfg = CONFIG_BY_MODE[CURRENT]
    y, _ = make_y(rng, (32, 32), F32, cfg.q_dtype)
    y64 = y.astype(np.float64) * (1 + 2.0**-30)  # rounds back to y in float32
    with enable_x64():
        got, dq = quantize_dq(jnp.asarray(y64), cfg.quantizer(RC))
        assert got.dq_dtype == np.float64 and dq.dtype == np.float64
    assert_same_bits(got, oracle_quantize(y, cfg), what="float64 input")
