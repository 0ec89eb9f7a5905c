"""Blockwise FP8 (``FP8_BLOCK_1D_SCALING``, ``FP8_BLOCK_2D_SCALING``) against ``blockwise_oracle``
(TransformerEngine's blockwise reference quantizer's math in NumPy): codes and float32 scales
bit for bit in both directions, power-of-two scales on and off, ``amax_epsilon``, shapes that
are not multiples of 128, zeros and non-finite inputs (docs/numerics.md §4-§5, §7)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import blockwise_oracle as boracle
import quantize_oracle as oracle
from te_jax.quantize import (
    Float8Block1DQuantizer,
    Float8Block2DQuantizer,
    QuantizeLayout,
    ScalingMode,
    reference,
    shapes,
)

from .cases import E4M3, E5M2, RC, assert_same_bits, make_y

BF16, F16, F32 = np.dtype(jnp.bfloat16), np.dtype(jnp.float16), np.dtype(np.float32)
QUANTIZER = {1: Float8Block1DQuantizer, 2: Float8Block2DQuantizer}


@functools.partial(jax.jit, static_argnames=("q", "nf"))
def run(ys, q, nf):
    """``reference.quantize`` over a stack of inputs, with each copy dequantized in float32."""

    def one(y):
        t = reference.quantize(y, q, n_feature_axes=nf)
        dq = {c: t.dequantize(c, jnp.float32) for c in ("rowwise", "colwise")}
        return t, dq

    return jax.vmap(one)(ys)


def check(ys, dims, q, nf, what):
    """Every element of the stack ``ys`` against the oracle: fields bitwise, and both copies'
    dequantized values bitwise the oracle's codes times its scales."""
    ts, dqs = run(jnp.asarray(ys), q, nf)
    for i, y in enumerate(ys):
        t = jax.tree.map(lambda a, i=i: a[i], ts)
        want = boracle.quantize(
            y, dims, RC, q.q_dtype, nf, power_2_scale=q.power_2_scale, eps=q.amax_epsilon
        )
        assert_same_bits(t, want, f"{what} input {i}")
        m = int(np.prod(y.shape[: y.ndim - nf]))
        n = y.size // max(m, 1)
        row = boracle.dequantize(want["data"], want["scale_inv"], dims, (m, n))
        col = boracle.dequantize(want["colwise_data"], want["colwise_scale_inv"], dims, (n, m))
        got_row, got_col = np.asarray(dqs["rowwise"][i]), np.asarray(dqs["colwise"][i])
        np.testing.assert_array_equal(oracle.raw_bits(got_row.reshape(m, n)), oracle.raw_bits(row))
        np.testing.assert_array_equal(
            oracle.raw_bits(got_col.reshape(m, n)), oracle.raw_bits(col.T), err_msg=what
        )


# (block dims, shape, n_feature_axes, input dtype, q_dtype, power_2_scale, amax_epsilon): every
# shape, dtype, format and option meets both modes, in few compilations.
CASES = [
    (1, (130, 200), 1, F32, E4M3, True, 0.0),
    (1, (257, 129), 1, BF16, E4M3, False, 0.0),
    (1, (2, 3, 130), 1, F16, E5M2, False, 2.0**-10),
    (1, (40, 2, 96), 2, BF16, E5M2, True, 2.0**-10),
    (2, (130, 200), 1, BF16, E4M3, False, 0.0),
    (2, (1, 128), 1, F32, E4M3, True, 0.0),
    (2, (300, 2, 70), 2, F32, E5M2, False, 2.0**-10),
]


@pytest.mark.parametrize(
    ("dims", "shape", "nf", "dtype", "q_dtype", "pow2", "eps"),
    CASES,
    ids=[f"{d}d-{'x'.join(map(str, s))}-{t}-{q}-p{int(p)}-e{e:g}" for d, s, _, t, q, p, e in CASES],
)
def test_matches_the_te_reference(dims, shape, nf, dtype, q_dtype, pow2, eps, rng):
    q = QUANTIZER[dims](q_dtype, RC, power_2_scale=pow2, amax_epsilon=eps)
    ys = [make_y(rng, shape, dtype, q_dtype, nf)[0] for _ in range(2)]
    # Tiny blocks: the epsilon floor (and, without it, a quotient that overflows float32).
    ys.append((ys[0].astype(np.float32) * 2.0**-130).astype(dtype))
    check(np.stack(ys), dims, q, nf, f"{dims}D {shape}")


@pytest.mark.parametrize("dims", [1, 2])
def test_zeros_and_nonfinite_blocks(dims):
    """A NaN or inf block (and an all-zero one) gets scale 1: its finite values keep their codes
    at scale 1, the inf saturates to ±Q, the NaN is the NaN code; other blocks are untouched."""
    y = np.full((130, 260), 3.0, np.float32)
    y[:, 128:256] = 0.0  # a zero block in every direction (both modes)
    y[5, 7] = np.nan
    y[129, 259] = np.inf
    y[0, 130] = -np.inf
    q = QUANTIZER[dims](E4M3, RC, power_2_scale=False)
    zeros = np.zeros_like(y)
    check(np.stack([y, zeros]), dims, q, 1, f"{dims}D non-finite")
    ts, _ = run(jnp.asarray(np.stack([y, zeros])), q, 1)
    s, codes = np.asarray(ts.scale_inv), np.asarray(ts.data).astype(np.float32)
    assert np.isnan(codes[0, 5, 7]) and codes[0, 129, 259] == 448.0 and codes[0, 0, 130] == -448
    nan_block = s[0, 0, 5] if dims == 1 else s[0, 0, 0]
    assert nan_block == 1.0 and codes[0, 5, 8] == 3.0  # scale 1 around the NaN
    unpadded = s[1][:, :130] if dims == 1 else s[1][:, :3]
    assert (unpadded == 1.0).all() and (codes[1] == 0).all()


@pytest.mark.parametrize("dims", [1, 2])
def test_one_copy_is_the_pair_s_copy(dims, rng):
    y, _ = make_y(rng, (70, 3, 50), np.float32, E4M3)
    layouts = (RC, QuantizeLayout.ROWWISE, QuantizeLayout.COLWISE)

    @jax.jit
    def each(y):
        return [reference.quantize(y, QUANTIZER[dims](q_layout=lay)) for lay in layouts]

    both, row, col = each(jnp.asarray(y))
    for one, names in ((row, ("data", "scale_inv")), (col, ("colwise_data", "colwise_scale_inv"))):
        for name in names:
            np.testing.assert_array_equal(np.asarray(getattr(one, name)), getattr(both, name))
        assert set(names) == set(ScalingMode(one.scaling_mode).impl.result_names(one.q_layout))


def test_scale_shapes_are_cublaslt_s():
    """1D: (ceil(C/128), round_up(R, 4)) for a copy [R, C] (R contiguous); 2D: (ceil(R/128),
    round_up(ceil(C/128), 4)); the colwise copy [N, M] stored features + leading."""
    one, two = ScalingMode.FP8_BLOCK_1D_SCALING, ScalingMode.FP8_BLOCK_2D_SCALING
    s1 = shapes.scale_shapes((2, 65, 300), one, RC)
    assert (s1["scale_inv"].shape, s1["colwise_scale_inv"].shape) == ((3, 132), (2, 300))
    assert s1["colwise_data"].shape == (300, 2, 65) and s1["scale_inv"].dtype == F32
    s2 = shapes.scale_shapes((257, 2, 300), two, RC, n_feature_axes=2)
    assert (s2["scale_inv"].shape, s2["colwise_scale_inv"].shape) == ((3, 8), (5, 4))
    assert s2["colwise_data"].shape == (2, 300, 257) and s2["amax"] is None
