"""The fused quantized ops (act_lu / quantize_dact_dbias / dact_lu / quantize with a quantizer)
against the pure-JAX path, bit for bit, for every scaling mode, layout, q_dtype, activation
(gated and not) and input dtype. The pure-JAX path itself is checked against the NumPy/ml_dtypes
oracle in tests/quantize/, so the kernels meet docs/numerics.md transitively.

Both ops and a third of the activations for one (mode, q_dtype, layout, dtype) run in one
jitted function; each (mode, q_dtype) meets every layout and every dtype, each op every
(layout, dtype) pair, each activation every mode, layout and dtype (pairwise: _fused_cases).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import te_jax
from helpers import (
    ACTS,
    QUANT_MODES,
    SCALED_TENSOR_FIELDS,
    make_dz,
    make_x,
    te_jax_custom_calls,
)
from te_jax.quantize import (
    CurrentScaleQuantizer,
    DelayedScaleQuantizer,
    Float8Block1DQuantizer,
    Float8Block2DQuantizer,
    MXFP8Quantizer,
    NVFP4Quantizer,
    QuantizeLayout,
    ScalingMode,
)

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
LAYOUTS = list(QuantizeLayout)
FIELDS = SCALED_TENSOR_FIELDS


def _quantizer(mode, q_dtype, layout):
    if mode == "delayed":
        q = DelayedScaleQuantizer.create(q_dtype=q_dtype, q_layout=layout)
        return q.update(jnp.float32(3.0))  # a scale other than 1
    return {
        "current": lambda: CurrentScaleQuantizer(q_dtype, layout),
        "mxfp8": lambda: MXFP8Quantizer(q_dtype, layout),
        "nvfp4": lambda: NVFP4Quantizer(q_layout=layout),
    }[mode]()


MODES = QUANT_MODES
MODE_IDS = [f"{m}-{jnp.dtype(d).name}" for m, d in MODES]
DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16, "f16": jnp.float16}


def _bits(a):
    a = np.asarray(a.astype(jnp.float32)) if a.dtype == jnp.float4_e2m1fn else np.asarray(a)
    return a.view(np.uint8) if a.dtype.itemsize == 1 else a


def assert_same_scaled(got, want, what=""):
    assert got.scaling_mode == want.scaling_mode and got.q_layout == want.q_layout, what
    assert got.dq_dtype == want.dq_dtype and got.shape == want.shape, what
    for f in FIELDS:
        g, w = getattr(got, f), getattr(want, f)
        assert (g is None) == (w is None), (what, f)
        if g is not None:
            assert g.shape == w.shape and g.dtype == w.dtype, (what, f, g.shape, w.shape)
            np.testing.assert_array_equal(_bits(g), _bits(w), err_msg=f"{what} {f}")


def _inputs(rng, dtype, rows=(2, 32), h=64):
    """One (dz, x) pair per activation; magnitudes spread so blocks get different scales."""
    out = []
    for act in ACTS:
        shape = rows + ((2, h) if act.gated else (h,))
        x = make_x(rng, shape, dtype, act)
        x = (x * np.exp2(rng.integers(-6, 3, size=shape[:-1] + (1,)))).astype(x.dtype)
        dz = make_dz(rng, rows + (h,), dtype)
        out.append((jnp.asarray(dz), jnp.asarray(x)))
    return out


def _flat(st, m, n):
    """The raw buffers of a ScaledTensor of a [m, n] tensor, as 2-D arrays (leading axes folded
    into m, feature axes into n), so tensors quantized with different axis splits compare."""
    out = {}
    for f in FIELDS:
        a = getattr(st, f)
        if a is None or a.ndim == 0:
            out[f] = None if a is None else _bits(a)
            continue
        b = _bits(a)
        out[f] = (
            b.reshape(-1, m)
            if (f == "colwise_data" and st.scaling_mode.is_tensor_scaling)
            else b.reshape(m, -1)
            if f in ("data", "colwise_data", "scale_inv")
            else b.reshape(-1, n)
        )
    return out


def _fused_cases():
    """For each (mode, q_dtype): every layout and every input dtype once, the pairing of the two
    turning with the mode, so that each op (both run in every case) meets every (layout, dtype)
    pair too; a third of the activations in each case (those with index = g mod 3), g turning
    so that each activation meets every mode, layout and dtype."""
    for i, ((mode, q_dtype), mode_id) in enumerate(zip(MODES, MODE_IDS, strict=True)):
        for j, layout in enumerate(LAYOUTS):
            dtype = list(DTYPES)[(i + j) % len(DTYPES)]
            g = (2 * i + j) % 3
            id_ = f"{mode_id}-{layout.name}-{dtype}-acts{g}"
            yield pytest.param(mode, q_dtype, layout, dtype, g, id=id_)


OPS = ("act_lu", "quantize_dact_dbias")


@pytest.mark.parametrize("mode, q_dtype, layout, dtype, g", list(_fused_cases()))
def test_fused_equals_quantize_of_the_op(mode, q_dtype, layout, dtype, g, rng):
    """The fused kernels (act_lu, quantize_dact_dbias) equal the standalone quantize kernel
    applied to the unquantized op's output, bit for bit, for every activation: the kernels
    quantize exactly the values the unquantized op returns. (The standalone kernel equals the
    pure-JAX reference, and that the NumPy oracle: test_standalone_quantize_equals_reference,
    tests/quantize/.) Both ops and the case's activations in one program."""
    q = _quantizer(mode, q_dtype, layout)
    acts = ACTS[g::3]
    pairs = _inputs(rng, DTYPES[dtype])[g::3]

    def f(pairs):
        outs = []
        for op in OPS:
            for act, (dz, x) in zip(acts, pairs, strict=True):
                if op == "act_lu":
                    y, dbias = te_jax.act_lu(x, act.alias, implementation="ffi"), None
                    fused = te_jax.act_lu(x, act.alias, quantizer=q, implementation="ffi")
                    fused_dbias = None
                else:
                    y, dbias = te_jax.quantize_dact_dbias(dz, x, act.alias, implementation="ffi")
                    fused, fused_dbias = te_jax.quantize_dact_dbias(
                        dz, x, act.alias, is_dbias=True, quantizer=q, implementation="ffi"
                    )
                m = y.size // y.shape[-1] // (2 if op != "act_lu" and act.gated else 1)
                composite = te_jax.quantize.quantize(y.reshape(m, -1), q, implementation="ffi")
                # sum |dx| over the rows bounds the float32 summation error of dbias
                abs_sum = jnp.abs(y.astype(jnp.float32).reshape(m, -1)).sum(0)
                outs.append((fused, composite, fused_dbias, dbias, m, abs_sum))
        return outs

    tol = {"f32": 1e-5, "bf16": 2**-7, "f16": 2**-10}[dtype]
    outs = jax.jit(f)(pairs)
    cases = [(op, act) for op in OPS for act in acts]
    for (op, act), (fused, composite, fused_dbias, dbias, m, abs_sum) in zip(
        cases, outs, strict=True
    ):
        what = f"{op} {act.alias}"
        n = fused.shape and int(np.prod(fused.shape)) // m
        got, want = _flat(fused, m, n), _flat(composite, m, n)
        for k in FIELDS:
            assert (got[k] is None) == (want[k] is None), (what, k)
            if got[k] is not None:
                np.testing.assert_array_equal(got[k], want[k], err_msg=f"{what} {k}")
        if dbias is not None:
            # The two kernels sum the rows in different orders: float32 summation error
            # (64 rows: < 2^-16 of sum |dx|) plus one rounding to the output dtype.
            got_b, want_b = np.asarray(fused_dbias, np.float32), np.asarray(dbias, np.float32)
            allowed = tol * np.abs(want_b) + 2.0**-16 * np.asarray(abs_sum).reshape(want_b.shape)
            bad = np.abs(got_b - want_b) > allowed
            assert not bad.any(), (what, got_b[bad][:4], want_b[bad][:4])


BLOCKWISE = [
    Float8Block1DQuantizer(E4M3, QuantizeLayout.ROWWISE_COLWISE),
    Float8Block2DQuantizer(E5M2, QuantizeLayout.ROWWISE_COLWISE, power_2_scale=False),
]


@pytest.mark.parametrize("q", BLOCKWISE, ids=["1d", "2d"])
def test_blockwise_ops_quantize_the_op_output(q, rng):
    """act_lu and quantize_dact_dbias with a blockwise quantizer quantize the op's output: the
    bits of quantize(op(x)) of the same implementation (the kernels where te_jax has them),
    the composite's leading axes folded; dbias the unquantized op's within float32 summation
    order. The kernel path against the pure-JAX one: tests/quantize/test_blockwise_kernels.py.
    """
    rows = (3, 70)  # 210 rows: a partial block of the colwise copy
    gelu, swiglu = (next(a for a in ACTS if a.alias == n) for n in ("gelu", "swiglu"))
    x1 = jnp.asarray(make_x(rng, rows + (150,), jnp.bfloat16, gelu))
    x2 = jnp.asarray(make_x(rng, rows + (2, 150), jnp.bfloat16, swiglu))
    dz = jnp.asarray(make_dz(rng, rows + (150,), jnp.bfloat16))

    @jax.jit
    def f(x1, x2, dz):
        quant = te_jax.quantize.quantize
        out = []
        for act, x in (("gelu", x1), ("swiglu", x2)):
            y = te_jax.act_lu(x, act)
            out.append((te_jax.act_lu(x, act, quantizer=q), quant(y.reshape(210, 150), q), None))
            dx, dbias = te_jax.quantize_dact_dbias(dz, x, act, is_dbias=act == "gelu")
            fused, fused_dbias = te_jax.quantize_dact_dbias(
                dz, x, act, is_dbias=act == "gelu", quantizer=q
            )
            want = quant(dx.reshape(210, -1), q)
            abs_sum = jnp.abs(dx.astype(jnp.float32)).reshape(210, -1).sum(0)
            out.append((fused, want, (fused_dbias, dbias, abs_sum)))
        return out

    for i, (fused, want, dbias) in enumerate(f(x1, x2, dz)):
        # The fused copies keep the op's axes, the composite's are [M, N] (and its transpose
        # [N, M]): the same buffers, element for element; the scales are 2-D in both.
        for k in FIELDS:
            g, w = getattr(fused, k), getattr(want, k)
            assert (g is None) == (w is None), (i, k)
            if g is not None:
                np.testing.assert_array_equal(_bits(g).ravel(), _bits(w).ravel(), err_msg=k)
        if dbias is not None and dbias[1] is not None:
            # Summed in float32 in another order, rounded once to bfloat16.
            got, want_b = (np.asarray(d, np.float32) for d in dbias[:2])
            bound = 2.0**-7 * np.abs(want_b) + 2.0**-16 * np.asarray(dbias[2])
            assert (np.abs(got - want_b) <= bound).all(), i


# x (2, 3, 32, 2, 32): leading axes folded into the rows; two column blocks of MXFP8, four of
# NVFP4; the last two axes are the features of a gated kernel (K, 2, N) under n_feature_axes=2.
X5 = (2, 3, 32, 2, 32)
FLAT = (2, 3, 32, 64)


@functools.cache
def _standalone_program(mode, q_dtype):
    """One program per (mode, q_dtype): the kernel in every layout and with two feature axes, the
    pure-JAX path in ROWWISE_COLWISE (flat and with two feature axes). The pure-JAX path's
    single layouts are not compiled (NVFP4's costs seconds each): a single layout's buffers are
    ROWWISE_COLWISE's, which tests/quantize/ checks the pure-JAX path to give in every layout."""
    both = _quantizer(mode, q_dtype, QuantizeLayout.ROWWISE_COLWISE)

    def f(x5):
        flat = x5.reshape(FLAT)
        quant = te_jax.quantize.quantize
        kernel = [
            quant(flat, _quantizer(mode, q_dtype, lay), implementation="ffi") for lay in LAYOUTS
        ]
        ref = quant(flat, both, implementation="xla")
        two = [quant(x5, both, implementation=i, n_feature_axes=2) for i in ("ffi", "xla")]
        return kernel, ref, two, two[1].dequantize(), ref.dequantize()

    return jax.jit(f)


@pytest.mark.parametrize(("mode", "q_dtype"), MODES, ids=MODE_IDS)
def test_standalone_quantize_equals_reference(mode, q_dtype, rng):
    """The standalone quantize kernel in every layout equals the pure-JAX path bit for bit
    (buffers, scales, amaxes, metadata): several blocks along both axes, leading axes folded."""
    x5 = jnp.asarray(rng.standard_normal(X5) * 10, jnp.bfloat16)
    kernel, ref, _, _, _ = _standalone_program(mode, q_dtype)(x5)
    for layout, got in zip(LAYOUTS, kernel, strict=True):
        # What the pure-JAX path returns in this layout (abstractly: its fields and metadata).
        q = _quantizer(mode, q_dtype, layout)
        want = jax.eval_shape(
            lambda x, q=q: te_jax.quantize.quantize(x, q, implementation="xla"), x5.reshape(FLAT)
        )
        assert got.scaling_mode == want.scaling_mode and got.q_layout == want.q_layout, layout
        assert got.dq_dtype == want.dq_dtype and got.shape == want.shape, layout
        for f in FIELDS:
            g, w = getattr(got, f), getattr(want, f)
            assert (g is None) == (w is None), (layout.name, f)
            if g is not None:
                r = getattr(ref, f)
                assert g.shape == w.shape == r.shape and g.dtype == w.dtype, (layout.name, f)
                np.testing.assert_array_equal(_bits(g), _bits(r), err_msg=f"{layout.name} {f}")


@pytest.mark.parametrize(("mode", "q_dtype"), MODES, ids=MODE_IDS)
def test_quantize_with_two_feature_axes(mode, q_dtype, rng):
    """A gated kernel (..., K, 2, N) quantized with n_feature_axes=2 is the (..., K, 2N) tensor's
    quantization, its axes kept: the colwise copy of tensor scaling (2, N, ...K), the block modes'
    copies of x's shape; the kernel path and the pure-JAX one both (the program of
    test_standalone_quantize_equals_reference, which checks the flat tensor's kernel path)."""
    x5 = jnp.asarray(rng.standard_normal(X5) * 10, jnp.bfloat16)
    _, ref, two, two_dq, ref_dq = _standalone_program(mode, q_dtype)(x5)
    rows = int(np.prod(FLAT[:-1]))
    for impl, got in zip(("ffi", "xla"), two, strict=True):
        assert got.data.shape == X5 and got.n_feature_axes == 2, impl
        np.testing.assert_array_equal(_bits(got.data.reshape(FLAT)), _bits(ref.data), impl)
        if mode in ("delayed", "current"):
            assert got.colwise_data.shape == (2, 32, 2, 3, 32), impl
            np.testing.assert_array_equal(
                _bits(got.colwise_data.reshape(64, rows)),
                _bits(ref.colwise_data.reshape(64, rows)),
                impl,
            )
    # The buffers are equal: one dequantize (the pure-JAX path's) checks n_feature_axes there.
    np.testing.assert_array_equal(
        np.asarray(two_dq, np.float32).reshape(FLAT), np.asarray(ref_dq, np.float32)
    )
    q = _quantizer(mode, q_dtype, QuantizeLayout.ROWWISE_COLWISE)
    with pytest.raises(ValueError, match="n_feature_axes"):
        jax.eval_shape(  # no leading axis left
            lambda x: te_jax.quantize.quantize(x, q, n_feature_axes=3),
            jax.ShapeDtypeStruct((64, 2, 32), jnp.bfloat16),
        )


@functools.cache
def _special_program(mode, q_dtype):
    """One program per (mode, q_dtype), whatever the values: the kernel and the pure-JAX path
    on one input of each dtype (the three kinds of special input run it three times)."""
    q = _quantizer(mode, q_dtype, QuantizeLayout.ROWWISE_COLWISE)

    def f(xs):
        quant = te_jax.quantize.quantize
        return [(quant(x, q, implementation="ffi"), quant(x, q, implementation="xla")) for x in xs]

    return jax.jit(f)


def _special_input(kind, dtype):
    """A [64, 64] input whose 16-row x 16-column blocks include the special cases of the block
    scales: all-zero blocks, blocks so small beside the tensor's amax that their NVFP4 scale
    rounds to 0 (negative values too: their codes must be +0), and for kind "nan" / "inf" one
    NaN or one infinity (the whole tensor's amax, and its block's scale, follow it)."""
    x = np.linspace(-3.0, 3.0, 64 * 64).reshape(64, 64)
    x[:16, :16] = 0.0  # zero block, rowwise and colwise
    x[16:32, 16:32] = np.where(np.arange(16) % 2, 1.0, -1.0) * 1e-9  # scale -> 0 under S
    x[40, 3] = 2.0e4  # the tensor's amax: the small blocks' NVFP4 scales underflow
    if kind == "nan":
        x[50, 50] = np.nan
    elif kind == "inf":
        x[50, 50] = -np.inf
    return jnp.asarray(x, dtype)


def _same_or_both_nan(got, want, what):
    g = np.asarray(got.astype(jnp.float32) if got.dtype == jnp.float4_e2m1fn else got)
    w = np.asarray(want.astype(jnp.float32) if want.dtype == jnp.float4_e2m1fn else want)
    if g.dtype.kind == "f":  # NaN payloads are not specified: NaN-ness, then the other bits
        nan = np.isnan(g)
        np.testing.assert_array_equal(nan, np.isnan(w), err_msg=what)
        g, w = g[~nan], w[~nan]
    np.testing.assert_array_equal(_bits(g), _bits(w), err_msg=what)


@pytest.mark.parametrize("kind", ["finite", "nan", "inf"])  # one program for all 3
@pytest.mark.parametrize(("mode", "q_dtype"), MODES, ids=MODE_IDS)
def test_standalone_quantize_special_blocks(mode, q_dtype, kind):
    """Zero, underflowing, NaN and infinite blocks: the kernels' special cases (NVFP4's zero and
    NaN block scales, MXFP8's NaN and clamped scales, the amax of NaN) equal the pure-JAX path,
    for every input dtype."""
    xs = [_special_input(kind, dtype) for dtype in DTYPES.values()]
    for dtype, (got, want) in zip(DTYPES, _special_program(mode, q_dtype)(xs), strict=True):
        for f in FIELDS:
            g, w = getattr(got, f), getattr(want, f)
            assert (g is None) == (w is None), f
            if g is not None:
                assert g.shape == w.shape and g.dtype == w.dtype, f
                _same_or_both_nan(g, w, f"{mode} {kind} {dtype} {f}")


def test_dact_lu_with_quantizer_is_the_dx_of_quantize_dact_dbias(rng):
    q = CurrentScaleQuantizer(E4M3, QuantizeLayout.ROWWISE_COLWISE)
    (dz, x) = _inputs(rng, jnp.bfloat16)[4]  # swiglu
    a = te_jax.dact_lu(dz, x, "swiglu", quantizer=q)
    b, _ = te_jax.quantize_dact_dbias(dz, x, "swiglu", is_dbias=False, quantizer=q)
    assert_same_scaled(a, b)


@pytest.mark.parametrize("mode", ["delayed", "current", "mxfp8", "nvfp4"])
def test_vmap_gives_one_tensor_per_element(mode, rng):
    """Under vmap each element is its own tensor (its own amax / scale), as unbatched calls."""
    q = _quantizer(
        mode, E4M3 if mode != "nvfp4" else jnp.float4_e2m1fn, QuantizeLayout.ROWWISE_COLWISE
    )
    x = (
        jnp.asarray(rng.standard_normal((3, 32, 2, 64)), jnp.float32)
        * jnp.asarray([1.0, 10.0, 100.0])[:, None, None, None]
    )
    dz = jnp.asarray(rng.standard_normal((3, 32, 64)), jnp.float32)

    def act(x):
        return te_jax.act_lu(x, "geglu", quantizer=q)

    def dact(dz, x):
        return te_jax.quantize_dact_dbias(dz, x, "geglu", quantizer=q)

    @jax.jit  # one program: the batched calls and each element's own
    def f(dz, x):
        return (
            jax.vmap(act)(x),
            jax.vmap(dact)(dz, x),
            [act(x[i]) for i in range(3)],
            [dact(dz[i], x[i]) for i in range(3)],
        )

    batched, (st, dbias), ones, one_dacts = f(dz, x)
    for i in range(3):
        take = lambda a, i=i: a[i]  # noqa: E731
        assert_same_scaled(jax.tree.map(take, batched), ones[i], f"element {i}")
        one, one_dbias = one_dacts[i]
        assert_same_scaled(jax.tree.map(take, st), one, f"dact element {i}")
        np.testing.assert_allclose(dbias[i], one_dbias, rtol=1e-6, atol=1e-6)


def test_scan_over_steps_with_delayed_scaling(rng):
    """The quantizer state goes through lax.scan: each step quantizes with the previous amax."""
    xs = (
        jnp.asarray(rng.standard_normal((4, 32, 64)), jnp.float32)
        * jnp.asarray([1.0, 2.0, 4.0, 8.0])[:, None, None]
    )
    q0 = DelayedScaleQuantizer.create(amax_history_len=4)

    def step(q, x):
        out = te_jax.act_lu(x, "gelu", quantizer=q)
        return q.update(out.amax), (out.amax, out.scale_inv)

    q_final, (amaxes, scale_invs) = jax.jit(lambda q, xs: jax.lax.scan(step, q, xs))(q0, xs)
    want_amax = [float(jnp.max(jnp.abs(te_jax.act_lu(x, "gelu")))) for x in xs]
    np.testing.assert_array_equal(np.asarray(amaxes), np.asarray(want_amax, np.float32))
    assert float(scale_invs[0]) == 1.0
    np.testing.assert_allclose(
        1.0 / np.asarray(scale_invs[1:]), 448.0 / np.maximum.accumulate(want_amax)[:-1], rtol=1e-6
    )
    assert float(q_final.scale) == pytest.approx(448.0 / max(want_amax))


@pytest.mark.parametrize("mode", ["current", "nvfp4"])
@pytest.mark.parametrize("op", ["act_lu", "quantize_dact_dbias"])
def test_two_pass_modes_keep_no_high_precision_intermediate(op, mode):
    """docs/numerics.md §6: the compiled program holds no temporary the size of the activation
    output."""
    q = _quantizer(mode, E4M3 if mode == "current" else jnp.float4_e2m1fn, QuantizeLayout.ROWWISE)
    x = jax.ShapeDtypeStruct((256, 2, 1024), jnp.bfloat16)
    dz = jax.ShapeDtypeStruct((256, 1024), jnp.bfloat16)
    if op == "act_lu":
        fn, args = (lambda x: te_jax.act_lu(x, "swiglu", quantizer=q)), (x,)
        y_bytes = 256 * 1024 * 2
    else:
        fn = lambda dz, x: te_jax.quantize_dact_dbias(dz, x, "swiglu", quantizer=q)  # noqa: E731
        args, y_bytes = (dz, x), 256 * 2 * 1024 * 2
    compiled = jax.jit(fn).lower(*args).compile()
    assert te_jax_custom_calls(compiled.as_text())
    temp = compiled.memory_analysis().temp_size_in_bytes
    # The largest allowed temporary is NVFP4's packed codes (y's bytes / 4 for a bfloat16 y),
    # which XLA:CPU copies when it unpacks them into float4_e2m1fn; a float32 or bfloat16 y
    # (what an unfused current-scaling / NVFP4 path keeps) is 2-4x larger than this bound.
    assert temp < y_bytes // 2, f"{temp} bytes of temporaries for a {y_bytes}-byte output"


def test_quantizer_on_integer_input_is_a_trace_time_error():
    x = jax.ShapeDtypeStruct((4, 32), jnp.int32)
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        jax.eval_shape(lambda x: te_jax.act_lu(x, "gelu", quantizer=CurrentScaleQuantizer()), x)
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        jax.eval_shape(lambda x: te_jax.quantize.quantize(x, CurrentScaleQuantizer()), x)


@pytest.mark.parametrize(
    ("quantizer", "shape", "match"),
    [
        (MXFP8Quantizer(E4M3), (4, 48), "32"),
        (MXFP8Quantizer(E4M3, QuantizeLayout.COLWISE), (48, 64), "32"),
        (NVFP4Quantizer(), (4, 40), "16"),
        (NVFP4Quantizer(q_layout=QuantizeLayout.COLWISE), (8, 64), "16"),
        (MXFP8Quantizer(E4M3, QuantizeLayout.COLWISE), (64,), "leading"),
    ],
    ids=["mx-row", "mx-col", "nv-row", "nv-col", "mx-col-1d"],
)
def test_block_shape_errors(quantizer, shape, match):
    x = jax.ShapeDtypeStruct(shape, jnp.bfloat16)
    for impl in ("ffi", "xla"):
        with pytest.raises(ValueError, match=match):
            jax.eval_shape(
                lambda x, impl=impl: te_jax.act_lu(
                    x, "gelu", quantizer=quantizer, implementation=impl
                ),
                x,
            )


def test_unsupported_q_dtype():
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        NVFP4Quantizer(jnp.float8_e4m3fn)
    with pytest.raises(ValueError, match="float4_e2m1fn"):
        CurrentScaleQuantizer(jnp.float4_e2m1fn)


def test_scaled_tensor_metadata(rng):
    x = jnp.asarray(rng.standard_normal((2, 32, 2, 64)), jnp.bfloat16)
    dz = jnp.asarray(rng.standard_normal((2, 32, 64)), jnp.bfloat16)
    st, _ = te_jax.quantize_dact_dbias(
        dz, x, "swiglu", quantizer=CurrentScaleQuantizer(E5M2, QuantizeLayout.ROWWISE_COLWISE)
    )
    assert st.scaling_mode == ScalingMode.CURRENT_TENSOR_SCALING
    assert st.shape == x.shape and st.dq_dtype == jnp.bfloat16
    assert st.colwise_data.shape == (2, 64, 2, 32)  # (2, H) + leading
    y = jax.jit(lambda st: st.dequantize())(st)  # one program, not one per eager op
    assert y.shape == x.shape and y.dtype == jnp.bfloat16
