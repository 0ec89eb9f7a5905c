"""Blockwise FP8 (``FP8_BLOCK_1D_SCALING``, ``FP8_BLOCK_2D_SCALING``) in te_jax's fused kernels:
the standalone ``quantize``, ``act_lu`` and ``quantize_dact_dbias`` on the kernel path
(``implementation="ffi"``) against the pure-JAX path (``"xla"``, itself checked against
TransformerEngine's reference math in test_blockwise.py): codes, scales and their zero padding
bit for bit, dbias within float32 summation order (docs/numerics.md §2, §4-§5). Every mode meets
each layout, input dtype, format, option (power-of-two scales on and off, an amax floor), shapes
whose rows and features are not multiples of 128 or 4, gated and plain activations, a vmapped
batch and NaN / inf inputs. A gated H both a multiple of 128 and not: the CUDA kernel tiles the two
halves together; otherwise the op takes two passes (the unquantized dact, then the quantize),
checked against the one fused pass the FFI contract also takes."""

from __future__ import annotations

import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import te_jax
from helpers import ACT_BY_ALIAS, make_dz, make_x
from te_jax.primitives.quantized import ffi_calls, local
from te_jax.primitives.quantized.config import OpKind, QuantConfig
from te_jax.primitives.quantized.shapes import geometry
from te_jax.quantize import Float8Block1DQuantizer, Float8Block2DQuantizer, QuantizeLayout

from .cases import E4M3, E5M2, RC, make_y

BF16, F16, F32 = np.dtype(jnp.bfloat16), np.dtype(jnp.float16), np.dtype(np.float32)
ROW, COL = QuantizeLayout.ROWWISE, QuantizeLayout.COLWISE
QUANTIZER = {1: Float8Block1DQuantizer, 2: Float8Block2DQuantizer}
FIELDS = ("data", "colwise_data", "scale_inv", "colwise_scale_inv", "amax", "global_scale_inv")
GELU, SWIGLU = ACT_BY_ALIAS["gelu"], ACT_BY_ALIAS["swiglu"]
ROWS = (3, 70)  # two leading axes, 210 rows: neither a multiple of 4 nor of 128


def _bits(a):
    a = np.asarray(a)
    return a.view(np.uint8) if a.dtype.itemsize == 1 else a.view(f"u{a.dtype.itemsize}")


def assert_same(got, want, what):
    """Two ScaledTensors with the same fields, shapes and bits (NaN patterns included)."""
    assert (got.scaling_mode, got.q_layout, got.dq_dtype) == (
        want.scaling_mode,
        want.q_layout,
        want.dq_dtype,
    ), what
    for f in FIELDS:
        g, w = getattr(got, f), getattr(want, f)
        assert (g is None) == (w is None), (what, f)
        if g is None:
            continue
        assert (g.shape, g.dtype) == (w.shape, w.dtype), (what, f, g.shape, w.shape)
        gb, wb = _bits(g), _bits(w)
        if not np.array_equal(gb, wb):
            i = tuple(np.argwhere(gb != wb)[0])
            raise AssertionError(
                f"{what}: {f}: {int((gb != wb).sum())} of {gb.size} differ; first at {i}: "
                f"kernel {np.asarray(g)[i]!r}, pure JAX {np.asarray(w)[i]!r}"
            )


def assert_dbias_close(got, want, dx, dtype, what):
    """dbias: the two paths sum the rows of dx in different orders (float32), then round once
    to x's dtype: within two roundings of the dtype plus 2^-16 of sum |dx| per column."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    abs_sum = np.abs(np.asarray(dx, np.float32)).reshape(-1, want.size).sum(0).reshape(want.shape)
    rounding = {F32: 2.0**-24, BF16: 2.0**-8, F16: 2.0**-11}[np.dtype(dtype)]
    bad = np.abs(got - want) > 2 * rounding * np.abs(want) + 2.0**-16 * abs_sum
    assert not bad.any(), (what, got[bad][:4], want[bad][:4])


def _spread(rng, x, nf=1):
    """x with each row of [M, N] (``nf`` feature axes) scaled by its own power of two (blocks
    with different scales), the rows of the last partial 128-row band by 2^-16: whole blocks
    and tiles with an amax below the cases' floor 2^-10."""
    lead = x.shape[: x.ndim - nf]
    rows = math.prod(lead)
    e = rng.integers(-20, 3, size=rows)
    e[rows // 128 * 128 :] = -16
    return (x.astype(np.float64) * np.exp2(e).reshape(lead + (1,) * nf)).astype(x.dtype)


def _tiny_band(y, dtype):
    """y ([M, N] viewed) with its last partial 128-row band tiny (below float32's normal range
    where the dtype has it: Q / amax overflows without an amax floor)."""
    y = y.reshape(-1, y.shape[-1]).copy()
    start = y.shape[0] // 128 * 128
    tiny = 2.0**-24 if np.dtype(dtype) == F16 else 2.0**-130
    y[start:] = (np.sign(y[start:].astype(np.float32)) * tiny).astype(dtype)
    return y


def _kernel_and_reference(q, xq, x, xg, dz, dzg):
    """Each op with ``q`` on the kernel path, and what it must equal bit for bit: the pure-JAX
    quantize (``implementation="xla"``) of the standalone input, resp. of the unquantized
    kernel's output (act_lu and dact of the same implementation: docs/numerics.md §4; a GELU or
    SiLU value may differ by an ulp between the two paths, §1). And the pure-JAX dbias and the
    unquantized dx (which bounds dbias's summation error)."""
    quantize = te_jax.quantize.quantize
    kernel = [
        quantize(xq, q, implementation="ffi"),
        te_jax.act_lu(x, "gelu", quantizer=q, implementation="ffi"),
        te_jax.act_lu(xg, "swiglu", quantizer=q, implementation="ffi"),
    ]
    ref = [quantize(xq, q, implementation="xla")]
    for xa, act in ((x, "gelu"), (xg, "swiglu")):
        y = te_jax.act_lu(xa, act, implementation="ffi")
        ref.append(quantize(y, q, implementation="xla"))
    dbias = []
    for dza, xa, act, nf in ((dz, x, "gelu", 1), (dzg, xg, "swiglu", 2)):
        fused = te_jax.quantize_dact_dbias(
            dza, xa, act, is_dbias=True, quantizer=q, implementation="ffi"
        )
        kernel.append(fused[0])
        dx = te_jax.dact_lu(dza, xa, act, implementation="ffi")
        ref.append(quantize(dx, q, implementation="xla", n_feature_axes=nf))
        _, want = te_jax.quantize_dact_dbias(dza, xa, act, implementation="xla")
        dbias.append((fused[1], want, dx))
    return kernel, ref, dbias


def _compare(out, dtype, what):
    kernel, ref, dbias = out
    names = ["quantize", "act_lu gelu", "act_lu swiglu", "dact gelu", "dact swiglu"]
    for name, k, r in zip(names, kernel, ref, strict=True):
        assert_same(k, r, f"{what} {name}")
    for name, (got, want, dx) in zip(names[3:], dbias, strict=True):
        assert_dbias_close(got, want, dx, dtype, f"{what} {name} dbias")


# (block dims, input dtype, q_dtype, power_2_scale, amax_epsilon, layout, the standalone
# quantize's shape, the gated H): each mode meets every layout, dtype and format, both options,
# and a gated H both a multiple of 128 and not.
CASES = [
    (1, F32, E4M3, True, 0.0, RC, (130, 260), 150),
    (1, BF16, E5M2, False, 2.0**-10, ROW, (257, 129), 256),
    (1, F16, E4M3, False, 0.0, COL, (2, 65, 150), 128),
    (2, BF16, E4M3, True, 0.0, RC, (130, 260), 256),
    (2, F32, E5M2, False, 2.0**-10, COL, (257, 129), 150),
    (2, F16, E5M2, True, 2.0**-10, ROW, (2, 65, 150), 200),
]


@pytest.mark.parametrize(
    ("dims", "dtype", "q_dtype", "pow2", "eps", "layout", "shape", "h"),
    CASES,
    ids=[
        f"{d}d-{t}-{q}-p{int(p)}-e{e:g}-{lay.name.lower()}-{'x'.join(map(str, s))}-h{h}"
        for d, t, q, p, e, lay, s, h in CASES
    ],
)
def test_kernels_equal_pure_jax(dims, dtype, q_dtype, pow2, eps, layout, shape, h, rng):
    q = QUANTIZER[dims](q_dtype, layout, power_2_scale=pow2, amax_epsilon=eps)
    xq = _tiny_band(make_y(rng, shape, dtype, q_dtype)[0], dtype).reshape(shape)
    x = _spread(rng, make_x(rng, ROWS + (150,), dtype, GELU))
    xg = _spread(rng, make_x(rng, ROWS + (2, h), dtype, SWIGLU), 2)
    dz, dzg = make_dz(rng, ROWS + (150,), dtype), make_dz(rng, ROWS + (h,), dtype)
    args = [jnp.asarray(a) for a in (xq, x, xg, dz, dzg)]
    _compare(jax.jit(functools.partial(_kernel_and_reference, q))(*args), dtype, f"{dims}D")


@pytest.mark.parametrize("dims", [1, 2])
def test_vmapped_ops_are_per_element(dims, rng):
    """Under vmap each batch element is its own tensor: the kernel's batch equals the pure-JAX
    quantize vmapped (scales per element, padding included)."""
    q = QUANTIZER[dims](E4M3, RC, power_2_scale=dims == 2)
    x = jnp.asarray(_spread(rng, make_x(rng, (2, 70, 150), BF16, GELU)))
    xg = jnp.asarray(_spread(rng, make_x(rng, (2, 70, 2, 130), BF16, SWIGLU), 2))
    dz = jnp.asarray(make_dz(rng, (2, 70, 150), BF16))
    ref = jax.vmap(lambda y: te_jax.quantize.quantize(y, q, implementation="xla"))

    @jax.jit
    def run(x, xg, dz):
        quantize = jax.vmap(lambda x: te_jax.quantize.quantize(x, q, implementation="ffi"))
        act = jax.vmap(lambda x: te_jax.act_lu(x, "swiglu", quantizer=q, implementation="ffi"))
        dact = jax.vmap(
            lambda dz, x: te_jax.quantize_dact_dbias(
                dz, x, "gelu", is_dbias=True, quantizer=q, implementation="ffi"
            )
        )
        dx, want_dbias = jax.vmap(
            lambda dz, x: te_jax.quantize_dact_dbias(dz, x, "gelu", implementation="xla")
        )(dz, x)
        dx_kernel = te_jax.dact_lu(dz, x, "gelu", implementation="ffi")
        y = te_jax.act_lu(xg, "swiglu", implementation="ffi")
        kernel = [quantize(x), act(xg), dact(dz, x)]
        return kernel, [ref(x), ref(y), ref(dx_kernel)], want_dbias, dx

    kernel, want, want_dbias, dx = run(x, xg, dz)
    for name, k, w in zip(
        ("quantize", "act_lu", "dact"), kernel[:2] + [kernel[2][0]], want, strict=True
    ):
        assert_same(k, w, f"vmapped {name}")
    assert kernel[2][1].shape == (2, 150)
    assert_dbias_close(kernel[2][1], want_dbias, dx, BF16, "vmapped dbias")
    assert kernel[0].scale_inv.shape == (2,) + q.scaling_mode.impl.scale_shape(70, 150)


@pytest.mark.parametrize(("dims", "h", "batch"), [(1, 150, ()), (2, 200, (2,)), (1, 256, ())])
def test_gated_dact_spanning_halves_takes_two_passes(dims, h, batch, rng):
    """A gated dact whose rowwise blocks span both halves of [M, 2H] (H % 128 != 0): the
    unquantized dact pass, then the standalone quantize (two custom calls), whose codes and
    scales equal the one fused pass's bit for bit and whose dbias is within summation order;
    with H % 128 == 0 one fused call."""
    q = QUANTIZER[dims](E4M3, RC, power_2_scale=dims == 1)
    cfg, act = QuantConfig.of(q), te_jax.ActivationType.parse("swiglu")
    shape = batch + (70, 2, h)
    x = jnp.asarray(_spread(rng, make_x(rng, shape, BF16, SWIGLU), 2))
    dz = jnp.asarray(make_dz(rng, batch + (70, h), BF16))
    one = jnp.ones(batch + (1,), jnp.float32)  # the per-tensor scale (unused by blockwise)

    def planned(dz, x):
        return local.kernel((dz, x), one, OpKind.DACT, act, None, cfg, True, len(batch))

    def fused(dz, x):
        g = geometry(OpKind.DACT, act, x.shape, len(batch), cfg)
        s = jnp.ones((g.b,), jnp.float32)
        bufs, dbias, _ = ffi_calls.quantize_pass(OpKind.DACT, act, None, cfg, True, g, (dz, x), s)
        return cfg.spec.fields_of_ffi_results(bufs), dbias

    spans = h % 128 != 0
    assert local.dact_spans_halves(OpKind.DACT, act, cfg, shape) == spans
    hlo = jax.jit(planned).lower(dz, x).as_text()
    assert hlo.count("te_jax_dact_dbias_quantize") == 1
    assert bool(re.search(r"te_jax_quantize\b", hlo)) == spans, "the quantize pass"
    got, (want, want_dbias) = jax.jit(planned)(dz, x), jax.jit(fused)(dz, x)
    for f in ("data", "colwise_data", "scale_inv", "colwise_scale_inv"):
        g, w = np.asarray(got[f]), np.asarray(want[f])
        assert np.array_equal(_bits(g).ravel(), _bits(w).ravel()), f
    dx = te_jax.dact_lu(dz, x, "swiglu", implementation="ffi")
    assert_dbias_close(got["dbias"], want_dbias.reshape(got["dbias"].shape), dx, BF16, "dbias")
    # dx is written over x's buffer where x dies there (an intermediate); an x used afterwards
    # (an argument, an intermediate returned) is copied first and left intact.
    x_before = np.asarray(x)

    @jax.jit
    def over_x(dz, x):
        h = x * 2  # used afterwards
        return planned(dz, h)["colwise_data"], h, planned(dz, x * 3)["colwise_data"]

    kept, h, dead = over_x(dz, x)
    np.testing.assert_array_equal(np.asarray(h), (x_before.astype(np.float32) * 2).astype(BF16))
    np.testing.assert_array_equal(np.asarray(x), x_before)
    for got_codes, scale in ((kept, 2), (dead, 3)):
        want_codes = jax.jit(fused)(dz, x * scale)[0]["colwise_data"]
        assert _bits(got_codes).tobytes() == _bits(want_codes).tobytes(), scale


@pytest.mark.parametrize("dims", [1, 2])
def test_nonfinite_inputs(dims, rng):
    """NaN and ±inf in the input (quantize, act_lu) and in dz (dact): the blocks holding them
    get scale 1 and the same codes as the pure-JAX quantize's."""
    q = QUANTIZER[dims](E4M3, RC, power_2_scale=False, amax_epsilon=2.0**-20)
    x = make_x(rng, (130, 260), F32, GELU)
    x[5, 7], x[129, 259], x[0, 130], x[64, 3] = np.nan, np.inf, -np.inf, -np.nan
    dz = make_dz(rng, (130, 260), F32)
    dz[3, 200], dz[100, 0] = np.inf, np.nan
    x, dz = jnp.asarray(x), jnp.asarray(dz)

    @jax.jit
    def run(x, dz):
        quantize = te_jax.quantize.quantize
        kernel = [
            quantize(x, q, implementation="ffi"),
            te_jax.act_lu(x, "gelu", quantizer=q, implementation="ffi"),
            te_jax.dact_lu(dz, x, "gelu", quantizer=q, implementation="ffi"),
        ]
        ys = [x, te_jax.act_lu(x, "gelu"), te_jax.dact_lu(dz, x, "gelu")]
        return kernel, [quantize(y, q, implementation="xla") for y in ys]

    kernel, want = run(x, dz)
    for name, k, w in zip(("quantize", "act_lu", "dact_lu"), kernel, want, strict=True):
        assert_same(k, w, f"{dims}D non-finite {name}")
    assert float(kernel[0].scale_inv[0, 5 if dims == 1 else 0]) == 1.0  # the NaN's block
