"""``te_jax.gemm`` (src/te_jax/linear/gemm.py): the GEMM op with its fused bias and epilogue.

It runs ``te_jax.linear.core`` as ``dense`` does, so it must be ``dense`` bit for bit (values
and gradients, unquantized and FP8, delayed scaling's next state included) for the activations
its epilogue takes; the GEMM against float64; a quantized lhs used as it is; FP8 shapes
cuBLASLt's FP8 GEMM cannot take through the primitive's fallback; clear errors.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import te_jax
from te_jax.quantize import QuantizeLayout
from te_jax.recipe import CurrentScaling, DelayedScaling, Float8BlockScaling, QuantizerSet

RECIPES = {"bf16": None, "delayed": DelayedScaling(), "current": CurrentScaling()}


def _operands(rng, m=32, k=64, n=48, dtype=jnp.bfloat16):
    x = jnp.asarray(rng.uniform(-2, 2, (m, k)), dtype)
    w = jnp.asarray(rng.uniform(-1, 1, (k, n)) / np.sqrt(k), jnp.float32)
    b = jnp.asarray(rng.uniform(-0.5, 0.5, (n,)), jnp.float32)
    return x, w, b


def _loss(op):
    """A sum of squares: its gradient depends on the output's every rounding."""

    def loss(x, w, b, qs):
        return jnp.sum(op(x, w, b, qs).astype(jnp.float32) ** 2)

    return jax.value_and_grad(loss, argnums=(0, 1, 2, 3))


def _cases():
    """Every (epilogue, recipe) pair, the bias on in every other one: each epilogue and each
    recipe meets both with and without a bias."""
    for e, epilogue in enumerate([None, "gelu", "relu"]):
        for r, recipe in enumerate(sorted(RECIPES)):
            bias = (e + r) % 2 == 0
            yield pytest.param(epilogue, recipe, bias, id=f"{epilogue}-{recipe}-{bias}")


@pytest.mark.parametrize("epilogue, recipe, bias", list(_cases()))
def test_gemm_is_dense_bit_for_bit(epilogue, recipe, bias, rng):
    """gemm(x, w, b, epilogue=e) == dense(x, w, b, activation_type=e): values, gradients and
    the next FP8 state, after a prior step (so delayed scaling's history is not empty). Both
    in one program."""
    x, w, b = _operands(rng)
    b = b if bias else None
    qs = QuantizerSet.create(RECIPES[recipe]) if RECIPES[recipe] else None
    gemm = _loss(lambda x, w, b, q: te_jax.gemm(x, w, b, epilogue=epilogue, quantizer_set=q))
    dense = _loss(lambda x, w, b, q: te_jax.dense(x, w, b, epilogue, q))
    both = jax.jit(lambda *a: (gemm(*a), dense(*a)))
    if qs is not None:
        qs = both(x, w, b, qs)[0][1][3]  # one step: a state with history
    got, want = both(x, w, b, qs)
    for g, e in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(e))


def test_against_float64(rng):
    """The plain float32 GEMM against the float64 product: within K float32 roundings."""
    x, w, b = _operands(rng, dtype=jnp.float32)
    got = np.asarray(te_jax.gemm(x, w, b), np.float64)
    xd, wd, bd = (np.asarray(a, np.float64) for a in (x, w, b))
    want = xd @ wd + bd
    bound = x.shape[1] * 2.0**-23 * (np.abs(xd) @ np.abs(wd) + np.abs(bd))
    assert np.all(np.abs(got - want) <= bound)


def test_several_axes(rng):
    """lhs ``(B, S, K)`` and rhs ``(K, 2, N)``: out ``(B, S, 2, N)``, the same as the GEMM of the
    folded views."""
    x = jnp.asarray(rng.uniform(-1, 1, (2, 8, 32)), jnp.float32)
    w = jnp.asarray(rng.uniform(-1, 1, (32, 2, 16)), jnp.float32)
    got = te_jax.gemm(x, w, epilogue="relu")
    want = te_jax.gemm(x.reshape(16, 32), w.reshape(32, 32), epilogue="relu")
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want).reshape(2, 8, 2, 16))


def test_quantized_lhs_is_used_as_it_is(rng):
    """A ScaledTensor lhs (quantized by the set's x quantizer) gives what the array does under
    the same set: the same codes, no second quantize pass; its cotangent is the gradient of
    its dequantized value, and the x quantizer's is zero."""
    x, w, b = _operands(rng)
    qs = QuantizerSet.create(DelayedScaling())

    def loss(q, s):
        return jnp.sum(te_jax.gemm(q, w, b, quantizer_set=s).astype(jnp.float32) ** 2)

    @jax.jit  # one program, not op by op
    def run(x):
        qx = te_jax.quantize.quantize(x, qs.with_layout("x", QuantizeLayout.ROWWISE_COLWISE))
        gemm = lambda x: te_jax.gemm(x, w, b, epilogue="gelu", quantizer_set=qs)  # noqa: E731
        return qx, gemm(qx), gemm(x), jax.grad(loss, argnums=(0, 1))(qx, qs)

    qx, y_quantized, y, (dx, next_qs) = run(x)
    np.testing.assert_array_equal(np.asarray(y_quantized), np.asarray(y))
    assert dx.data.shape == qx.data.shape
    # This call measured nothing for the x quantizer (whoever quantized x updates it); the
    # kernel's state advanced.
    assert all(not np.any(np.asarray(a)) for a in jax.tree.leaves(next_qs.x))
    assert float(jnp.max(next_qs.kernel.amax_history)) == float(jnp.max(jnp.abs(w)))


def test_blockwise_quantized_lhs_is_used_as_it_is(rng):
    """Under Float8BlockScaling a ScaledTensor lhs (1×128 blocks, both copies) gives what the
    array does, bit for bit: the output and the kernel's gradient (wgrad reads its colwise
    copy); the GEMM multiplies the dequantized operands."""
    x, w, b = _operands(rng, m=40, k=200, n=72)  # partial blocks both ways
    qs = QuantizerSet.create(Float8BlockScaling())

    def loss(x, w):
        return jnp.sum(te_jax.gemm(x, w, b, epilogue="relu", quantizer_set=qs) ** 2)

    @jax.jit
    def run(x):
        qx = te_jax.quantize.quantize(x, qs.with_layout("x", QuantizeLayout.ROWWISE_COLWISE))
        return [jax.value_and_grad(loss, argnums=1)(a, w) for a in (qx, x)]

    (y_q, dw_q), (y, dw) = run(x)
    np.testing.assert_array_equal(np.asarray(y_q), np.asarray(y))
    np.testing.assert_array_equal(np.asarray(dw_q), np.asarray(dw))


@pytest.mark.parametrize("k, n", [(24, 8)], ids=["k24-n8"])
def test_fp8_shapes_the_fp8_gemm_cannot_take(k, n, rng):
    """K or N not a multiple of 16 under current scaling: the primitive's float32 fallback, the
    product of the dequantized operands rounded once (to a bf16 rounding of it)."""
    x, w, _ = _operands(rng, k=k, n=n)
    qs = QuantizerSet.create(CurrentScaling())

    @jax.jit  # one program, not op by op
    def run(x, w):
        qx = te_jax.quantize.quantize(x, qs.x)
        qw = te_jax.quantize.quantize(w, qs.with_layout("kernel", QuantizeLayout.ROWWISE))
        return (  # the kernel quantized from float32
            te_jax.gemm(x, w, quantizer_set=qs),
            qx.dequantize(dtype=jnp.float32),
            qw.dequantize(dtype=jnp.float32),
        )

    got, dqx, dqw = (np.asarray(a, np.float64) for a in run(x, w))
    want = dqx @ dqw
    np.testing.assert_allclose(got, want, rtol=2**-8, atol=2**-8 * np.abs(want).max())


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (
            dict(epilogue="silu"),
            r"te_jax.gemm: epilogue must be None, 'gelu' or 'relu', got 'silu'",
        ),
        (
            dict(contracting_dims=((0,), (0,))),
            r"te_jax.gemm: contracting_dims must be x's trailing",
        ),
        (dict(implementation="cuda"), r"te_jax.gemm: implementation must be None, 'ffi' or 'xla'"),
    ],
    ids=["epilogue", "contracting", "implementation"],
)
def test_errors_name_the_op(kwargs, match, rng):
    x, w, _ = _operands(rng)
    with pytest.raises(ValueError, match=match):
        te_jax.gemm(x, w, **kwargs)
