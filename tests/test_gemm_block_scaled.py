"""Block-scaled FP8 GEMMs (``GemmScaleMode.BLOCK_1D`` / ``BLOCK_2D``: Float8BlockScaling's
operands) through ``bind_gemm``, against the float64 product of the block-dequantized operands:
the te_jax_gemm kernel (cuBLASLt's VEC128_32F / BLK128x128_32F) where the backend has it, the
pure-JAX lowering elsewhere and with ``implementation="xla"``; the shard-local scales of a
sharded GEMM are checked in tests/sharded.

Tolerance: the pure-JAX path accumulates the exact dequantized products in float32 (K·2⁻²³·Σ|a||b|);
the kernel adds in the Hopper tensor cores' reduced precision (docs/numerics.md §8: 2⁻⁹·Σ|a||b|);
plus half an ulp of the output dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from te_jax import _ffi
from te_jax.primitives.gemm import TARGET, GemmEpilogue, GemmScaleMode, bind_gemm
from te_jax.primitives.gemm.checks import block_scale_shape
from te_jax.primitives.gemm.config import GemmConfig
from te_jax.primitives.gemm.kernel import kernel_results
from te_jax.primitives.gemm.reference_results import reference_results

KERNEL = _ffi.target_available(TARGET, jax.default_backend())
M1, M2 = GemmScaleMode.BLOCK_1D, GemmScaleMode.BLOCK_2D
E4M3 = jnp.float8_e4m3fn
BF16 = jnp.bfloat16


def _expand(scale, mode, rows, k):
    """One scale per element of an operand stored (rows, k), from its cuBLASLt layout."""
    s = np.asarray(scale, np.float64)
    if mode == M1:
        return s[:, :rows].T.repeat(128, 1)[:, :k]
    return s[:, : -(-k // 128)].repeat(128, 0).repeat(128, 1)[:rows, :k]


def _operands(rng, m, k, n, modes):
    a = jnp.asarray(rng.normal(size=(m, k)) * 4, jnp.float32).astype(E4M3)
    b = jnp.asarray(rng.normal(size=(n, k)) * 4, jnp.float32).astype(E4M3)
    scales = [
        jnp.asarray(2.0 ** rng.integers(-8, 4, size=block_scale_shape(mode, rows, k)), jnp.float32)
        * jnp.asarray(rng.uniform(0.5, 1.0, size=block_scale_shape(mode, rows, k)), jnp.float32)
        for mode, rows in zip(modes, (m, n), strict=True)
    ]
    return a, b, scales


# Off a GPU both take the pure-JAX path: one is enough there.
@pytest.mark.parametrize("impl", [None, "xla"] if KERNEL else [None])
@pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize(
    "modes, shape",
    [
        ((M1, M2), (256, 384, 256)),  # fprop: x 1x128, the kernel 128x128
        ((M1, M1), (256, 256, 128)),  # wgrad: both 1x128
        ((M2, M1), (128, 256, 256)),  # a 2D lhs
        ((M1, M2), (70, 176, 144)),  # partial blocks: rows not a multiple of 4, K of 128
    ],
    ids=["1Dx2D", "1Dx1D", "2Dx1D", "partial"],
)
def test_block_scaled_gemm_is_the_product_of_the_dequantized_blocks(modes, shape, out_dtype, impl):
    m, k, n = shape
    rng = np.random.default_rng(sum(shape))
    a, b, (sa, sb) = _operands(rng, m, k, n, modes)
    bias = jnp.asarray(rng.normal(size=(n,)), out_dtype) if out_dtype == jnp.bfloat16 else None
    out = bind_gemm(
        a,
        b,
        bias,
        lhs_scale_inv=sa,
        rhs_scale_inv=sb,
        rhs_trans=True,
        out_dtype=out_dtype,
        lhs_scale_mode=modes[0],
        rhs_scale_mode=modes[1],
        implementation=impl,
    ).out
    da = np.asarray(a.astype(jnp.float32), np.float64) * _expand(sa, modes[0], m, k)
    db = np.asarray(b.astype(jnp.float32), np.float64) * _expand(sb, modes[1], n, k)
    want = da @ db.T + (0 if bias is None else np.asarray(bias, np.float64))
    kernel = KERNEL and impl is None
    sums = (2.0**-9 if kernel else k * 2.0**-23) * (np.abs(da) @ np.abs(db).T)
    ulp = 2.0**-8 if out_dtype == jnp.bfloat16 else 2.0**-24
    err = np.abs(np.asarray(out, np.float64) - want)
    assert out.shape == (m, n) and out.dtype == out_dtype
    assert np.all(err <= sums + ulp * np.abs(want) + 1e-30), float((err - sums).max())


@pytest.mark.parametrize("impl", [None, "xla"] if KERNEL else [None])
def test_block_scaled_gemm_with_the_gelu_epilogue(impl):
    """cuBLASLt's block-scaled GEMM has only the plain epilogue: GELU_AUX with a bias writes
    h = a·b + bias in bf16, and te_jax's GELU kernel reads it (docs/numerics.md §8):
    out = gelu(bf16(h)), aux = bf16(h)."""
    m, k, n = 256, 256, 256
    rng = np.random.default_rng(7)
    a, b, (sa, sb) = _operands(rng, m, k, n, (M1, M2))
    bias = jnp.asarray(rng.normal(size=(n,)), jnp.bfloat16)
    res = bind_gemm(
        a,
        b,
        bias,
        lhs_scale_inv=sa,
        rhs_scale_inv=sb,
        rhs_trans=True,
        out_dtype=jnp.bfloat16,
        epilogue=GemmEpilogue.GELU_AUX,
        lhs_scale_mode=M1,
        rhs_scale_mode=M2,
        implementation=impl,
    )
    da = np.asarray(a.astype(jnp.float32), np.float64) * _expand(sa, M1, m, k)
    db = np.asarray(b.astype(jnp.float32), np.float64) * _expand(sb, M2, n, k)
    h = da @ db.T + np.asarray(bias, np.float64)
    gelu = 0.5 * h * (1 + np.tanh(np.sqrt(2 / np.pi) * (h + 0.044715 * h**3)))
    sums = (2.0**-9 if KERNEL and impl is None else k * 2.0**-23) * (np.abs(da) @ np.abs(db).T)
    # |gelu'| < 1.13: the accumulator's error and h's rounding (out reads the rounded h) pass
    # through at most that much amplified
    for got, want, gain, h_rounding in ((res.aux, h, 1.0, 0), (res.out, gelu, 1.13, 2.0**-8)):
        err = np.abs(np.asarray(got, np.float64) - want)
        bound = gain * (sums + h_rounding * np.abs(h)) + (2.0**-8 + 1e-3) * np.abs(want) + 1e-30
        assert np.all(err <= bound), float((err - bound).max())


@pytest.mark.parametrize("epilogue", [GemmEpilogue.GELU_AUX, GemmEpilogue.DGELU])
def test_block_scaled_gelu_is_the_gemm_then_the_gelu_kernel(epilogue):
    """The kernel lowering of a block-scaled GELU_AUX (with a bias) or DGELU (with dbias), with a
    stand-in for te_jax_gemm (the pure-JAX product): one GEMM call with the plain epilogue (the
    bias where GELU_AUX has one), then te_jax's act_lu / dact_dbias kernel on its bf16 output.
    Equal to the pure-JAX path, which rounds the GEMM's output before the GELU too: aux bit for
    bit, out within one bf16 rounding (a GELU value may differ by an ulp between the two,
    docs/numerics.md §1), dbias within float32 summation order."""
    m, k, n = 192, 256, 160
    rng = np.random.default_rng(3)
    a, b, (sa, sb) = _operands(rng, m, k, n, (M1, M2))
    dgelu = epilogue == GemmEpilogue.DGELU
    bias = jnp.zeros((0,), jnp.bfloat16) if dgelu else jnp.asarray(rng.normal(size=(n,)), BF16)
    aux = jnp.asarray(rng.normal(size=(m, n)), BF16) if dgelu else jnp.zeros((0,), BF16)
    config = GemmConfig(
        rhs_trans=True,
        epilogue=epilogue,
        grad_bias=dgelu,
        out_dtype=BF16,
        lhs_scale_mode=M1,
        rhs_scale_mode=M2,
    )
    plain = config.replace(epilogue=GemmEpilogue.DEFAULT, grad_bias=False)
    calls = []

    def gemm(target, results, *operands, **attrs):
        assert target == TARGET and attrs == plain.ffi_attributes(), attrs
        calls.append(operands[2].shape)  # the bias
        out = reference_results(*operands, plain)[0]
        return [out] + [jnp.zeros(r.shape, r.dtype) for r in results[1:]]

    absent = jnp.zeros((0,), BF16)
    operands = (a, b, bias, aux, sa, sb, absent)
    got = kernel_results(*operands, config, ffi_call=gemm)
    want = reference_results(*operands, config)
    assert calls == [bias.shape]
    f32 = [np.asarray(x, np.float32) for x in got + want]
    out, out_want = f32[0], f32[len(got)]
    assert np.all(np.abs(out - out_want) <= 2.0**-8 * np.abs(out_want) + 1e-30)
    if dgelu:  # dbias: the float32 sum of out's unrounded values, rounded once
        tol = 2.0**-7 * np.abs(f32[-1]) + 2.0**-16 * np.abs(out_want).sum(0)
        assert np.all(np.abs(f32[1] - f32[-1]) <= tol)
    else:
        np.testing.assert_array_equal(f32[1], f32[-1])  # aux: the GEMM's bf16 output


def test_block_scaled_gemm_refuses_what_it_cannot_run():
    rng = np.random.default_rng(0)
    a, b, (sa, sb) = _operands(rng, 128, 256, 128, (M1, M2))
    kw = dict(rhs_trans=True, out_dtype=jnp.float32)
    with pytest.raises(ValueError, match=r"must be float32 \(2, 128\)"):
        bind_gemm(
            a,
            b,
            lhs_scale_inv=sa[:, :64],
            rhs_scale_inv=sb,
            lhs_scale_mode=M1,
            rhs_scale_mode=M2,
            **kw,
        )
    with pytest.raises(ValueError, match="no GEMM of two 128x128"):
        s2 = jnp.ones(block_scale_shape(M2, 128, 256), jnp.float32)
        bind_gemm(
            a, b, lhs_scale_inv=s2, rhs_scale_inv=sb, lhs_scale_mode=M2, rhs_scale_mode=M2, **kw
        )
    with pytest.raises(ValueError, match="TN layout"):
        bind_gemm(
            a,
            b.T,
            lhs_scale_inv=sa,
            rhs_scale_inv=sb,
            lhs_scale_mode=M1,
            rhs_scale_mode=M2,
            out_dtype=jnp.float32,
        )
    with pytest.raises(ValueError, match="scale FP8 operands"):
        bind_gemm(a.astype(jnp.bfloat16), b.astype(jnp.bfloat16), rhs_trans=True, lhs_scale_mode=M1)


def test_block_scaled_gemm_under_vmap_and_jit():
    """vmap maps the pure-JAX product (the kernel is unbatched): each example within float32
    accumulation of the float64 product (XLA:GPU's batched dot adds in its own order)."""
    rng = np.random.default_rng(1)
    m, k, n = 128, 256, 128
    a, b, (sa, sb) = _operands(rng, m, k, n, (M1, M2))
    kw = dict(rhs_trans=True, out_dtype=jnp.float32, lhs_scale_mode=M1, rhs_scale_mode=M2)
    f = jax.jit(jax.vmap(lambda a: bind_gemm(a, b, lhs_scale_inv=sa, rhs_scale_inv=sb, **kw).out))
    a2 = jnp.stack([a, -a])
    many = f(a2)
    db = np.asarray(b.astype(jnp.float32), np.float64) * _expand(sb, M2, n, k)
    for i in range(2):
        da = np.asarray(a2[i].astype(jnp.float32), np.float64) * _expand(sa, M1, m, k)
        bound = k * 2.0**-23 * (np.abs(da) @ np.abs(db).T) + 2.0**-24 * np.abs(da @ db.T)
        assert np.all(np.abs(np.asarray(many[i], np.float64) - da @ db.T) <= bound)
