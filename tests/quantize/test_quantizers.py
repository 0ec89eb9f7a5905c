"""Quantizers: construction and validation, the delayed-scaling state machine against the NumPy
oracle, and their pytree behaviour under jit, vmap, lax.scan and custom_vjp."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import quantize_oracle as oracle
from te_jax.quantize import (
    CurrentScaleQuantizer,
    DelayedScaleQuantizer,
    MXFP8Quantizer,
    NVFP4Quantizer,
    QuantizeLayout,
    ScaledTensor,
    ScalingMode,
    reference,
)
from te_jax.quantize.quantizers import delayed_candidate_scale

from .cases import E2M1, E4M3, E5M2, assert_same_bits, stack, unstack

RC = QuantizeLayout.ROWWISE_COLWISE

# --- construction ---------------------------------------------------------------------------------


def test_defaults_and_config():
    q = DelayedScaleQuantizer.create()
    assert q.q_dtype == E4M3 and isinstance(q.q_dtype, np.dtype)
    assert q.q_layout is QuantizeLayout.ROWWISE and q.margin == 0 and q.amax_compute_algo == "max"
    assert q.scaling_mode is ScalingMode.DELAYED_TENSOR_SCALING and q.q_max == 448.0
    assert q.scale.shape == () and q.scale.dtype == jnp.float32 and float(q.scale) == 1.0
    assert q.amax_history.shape == (1024,) and not np.asarray(q.amax_history).any()
    assert q.amax_history_len == 1024
    assert DelayedScaleQuantizer.create(amax_history_len=16).amax_history.shape == (16,)
    for cls, mode, dt, qmax in [
        (CurrentScaleQuantizer, ScalingMode.CURRENT_TENSOR_SCALING, E4M3, 448.0),
        (MXFP8Quantizer, ScalingMode.MXFP8_1D_SCALING, E4M3, 448.0),
        (NVFP4Quantizer, ScalingMode.NVFP4_1D_SCALING, E2M1, 6.0),
    ]:
        q = cls()
        assert (q.scaling_mode, q.q_dtype, q.q_layout, q.q_max) == (
            mode,
            dt,
            QuantizeLayout.ROWWISE,
            qmax,
        )


@pytest.mark.parametrize("spelling", [jnp.float8_e5m2, np.dtype(jnp.float8_e5m2), "float8_e5m2"])
def test_q_dtype_spellings(spelling):
    for q in (
        MXFP8Quantizer(spelling, RC),
        CurrentScaleQuantizer(spelling),
        DelayedScaleQuantizer.create(spelling),
    ):
        assert q.q_dtype == E5M2 and type(q.q_dtype) is type(E5M2) and q.q_max == 57344.0


def test_layout_spellings():
    assert MXFP8Quantizer(E4M3, 2).q_layout is RC
    assert MXFP8Quantizer(E4M3, "colwise").q_layout is QuantizeLayout.COLWISE
    assert MXFP8Quantizer(jnp.float8_e4m3fn, QuantizeLayout.ROWWISE_COLWISE).q_layout is RC


def test_stateless_quantizers_are_hashable_static_values():
    a, b = MXFP8Quantizer(jnp.float8_e4m3fn, RC), MXFP8Quantizer("float8_e4m3fn", 2)
    assert a == b and hash(a) == hash(b) and a != MXFP8Quantizer(E5M2, RC)
    assert jax.tree.leaves(a) == []
    calls = []

    @functools.partial(jax.jit, static_argnums=1)
    def f(x, q):
        calls.append(q)
        return x * q.q_max

    f(jnp.ones(2), a)
    f(jnp.ones(2), b)  # equal static config: no retrace
    assert len(calls) == 1


def test_quantizers_are_frozen():
    with pytest.raises(AttributeError):
        MXFP8Quantizer().q_dtype = E5M2
    with pytest.raises(AttributeError):
        DelayedScaleQuantizer.create().scale = jnp.float32(2)


# --- the delayed-scaling state machine ------------------------------------------------------------

AMAX_STEPS = [3.0, 0.5, 0.0, np.inf, np.nan, 1e-3, 7.0, 2.0, 0.25, 100.0]
update = jax.jit(lambda q, a: q.update(a))  # eagerly, update would compile op by op


@pytest.mark.parametrize(
    "q_dtype,margin,algo,length",
    [
        (E4M3, 0, "max", 4),
        (E5M2, 2, "max", 3),
        (E4M3, 1, "most_recent", 4),
        (E4M3, 0, "max", 2),
        (E4M3, 0, "max", 1),
    ],
)
def test_delayed_update_matches_oracle(q_dtype, margin, algo, length):
    q = DelayedScaleQuantizer.create(q_dtype, length, margin, amax_compute_algo=algo)
    scale, hist = np.float32(1.0), np.zeros(length, np.float32)
    for step, a in enumerate(AMAX_STEPS):
        q = update(q, jnp.float32(a) if step % 2 else jnp.asarray([a], jnp.float32))
        scale, hist = oracle.delayed_update(scale, hist, a, q.q_max, margin, algo)
        assert q.scale.dtype == jnp.float32 and q.scale.shape == ()
        assert np.asarray(q.scale).view(np.uint32) == scale.view(np.uint32), (step, a)
        np.testing.assert_array_equal(
            oracle.raw_bits(np.asarray(q.amax_history)), oracle.raw_bits(hist), err_msg=str(step)
        )


# Histories where a denormal mode could matter: subnormal amaxes beside normal ones, the
# smallest normal (Q / a overflows), the largest finite (Q / a near the smallest scale).
EDGE_HISTORIES = [
    [1e-40, 2.0**-149, 0.0, 0.0],
    [2.0**-126, 1e-40, 0.0, 3.0],
    [3.0e38, 1e-40, 2.0**-100, 0.0],
    [np.finfo(np.float32).max, 0.0, 0.0, 0.0],
    [2.0**-100, 1e-40, np.nan, 7.0],
    [np.inf, 1e-40, 0.0, 0.0],
    [0.0, 1e-45, 0.0, 0.0],
]


@pytest.mark.parametrize("exact", [True, False], ids=["exact", "native"])
@pytest.mark.parametrize("q_dtype,margin", [(E4M3, 0), (E5M2, 3)])
@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_both_scale_computations_give_the_oracle_bits(exact, q_dtype, margin, algo):
    """The update's candidate scale, with ``ieee``'s exact ops (every backend but the CPU) and
    with XLA's native ones (XLA:CPU, denormals flushed), equals the NumPy oracle's bit for bit
    on histories of subnormal, extreme and non-finite amaxes."""
    if not exact and jax.default_backend() != "cpu":
        # XLA:GPU's native float32 division is not correctly rounded (448 / 3 gives 149.33334).
        pytest.skip("only XLA:CPU takes the native computation")
    q_max = float(jnp.finfo(q_dtype).max)
    hist = np.asarray(EDGE_HISTORIES, np.float32)
    candidate = functools.partial(
        delayed_candidate_scale, q_max=q_max, margin=margin, algo=algo, exact=exact
    )
    new, keep = jax.jit(candidate)(jnp.asarray(hist))
    got = np.where(np.asarray(keep), np.float32(-1.0), np.asarray(new))
    for row, g in zip(hist, got, strict=True):
        want, _ = oracle.delayed_update(-1.0, row, row[0], q_max, margin, algo)
        assert np.float32(g).view(np.uint32) == np.float32(want).view(np.uint32), row


def test_delayed_update_worked_example():
    """The numbers in docs/quantization.md."""
    q = DelayedScaleQuantizer.create(amax_history_len=3)
    seen = []
    for a in [2.0, 8.0, 1.0, 0.5, 0.0]:
        q = update(q, jnp.float32(a))
        seen.append((float(q.scale), np.asarray(q.amax_history).tolist()))
    assert seen == [
        (224.0, [0.0, 0.0, 2.0]),
        (56.0, [0.0, 2.0, 8.0]),
        (56.0, [0.0, 8.0, 1.0]),
        (56.0, [0.0, 1.0, 0.5]),  # 8.0 is still in the window of the last 3 amaxes
        (448.0, [0.0, 0.5, 0.0]),  # now it is not: max(0.0, 1.0, 0.5)
    ]


def test_delayed_update_keeps_scale_for_zero_inf_nan():
    q = DelayedScaleQuantizer.create(amax_history_len=1)
    q = update(q, jnp.float32(4.0))
    assert float(q.scale) == 112.0
    for bad in (0.0, np.inf, np.nan, -1.0):
        assert float(update(q, jnp.float32(bad)).scale) == 112.0


def test_delayed_update_keeps_a_finite_scale_for_a_subnormal_amax():
    """A subnormal amax is > 0 and finite, but Q / a overflows: te_jax keeps the old scale
    (docs/numerics.md §4), where keeping it only for a <= 0 or a non-finite a would make the
    scale inf and every quantized zero NaN."""
    q = update(DelayedScaleQuantizer.create(amax_history_len=1), jnp.float32(1e-40))
    assert float(q.scale) == 1.0
    q = update(DelayedScaleQuantizer.create(amax_history_len=1), jnp.float32(2.0**-100))
    assert float(q.scale) == pytest.approx(448.0 * 2.0**100)


def test_update_rejects_bad_amax_shape():
    with pytest.raises(ValueError, match=r"amax must have shape \(\) or \(1,\), got \(2,\)"):
        DelayedScaleQuantizer.create().update(jnp.ones(2))


# --- pytrees --------------------------------------------------------------------------------------


def _y(rng, shape=(32, 32)):
    return jnp.asarray(rng.uniform(-3.0, 3.0, shape).astype(np.float32))


quantize = jax.jit(reference.quantize, static_argnames="n_feature_axes")


def test_delayed_quantizer_through_jit_and_vmap_stack(rng):
    """A stack of delayed quantizers (scale (B,), history (B, L)) under vmap, each scaling its
    own input; then the stack updated under vmap."""
    ys = jnp.stack([_y(rng) for _ in range(3)])
    scales = [1.0, 64.0, 0.375]
    qs = stack(
        [
            DelayedScaleQuantizer(q_layout=RC, scale=jnp.float32(s), amax_history=jnp.zeros(4))
            for s in scales
        ]
    )
    assert qs.scale.shape == (3,) and qs.amax_history.shape == (3, 4)
    out = jax.jit(jax.vmap(reference.quantize))(ys, qs)
    assert isinstance(out, ScaledTensor) and out.data.shape == (3, 32, 32)
    for i, s in enumerate(scales):
        want = oracle.quantize(np.asarray(ys[i]), 1, 2, E4M3, scale=np.float32(s))
        assert_same_bits(unstack(out, i), want, what=f"member {i}")
    new = jax.jit(jax.vmap(lambda q, a: q.update(a)))(qs, out.amax)
    assert isinstance(new, DelayedScaleQuantizer) and new.scale.shape == (3,)
    for i in range(3):
        want, _ = oracle.delayed_update(scales[i], np.zeros(4), np.asarray(out.amax[i]), 448.0)
        assert float(new.scale[i]) == want


def test_vmap_over_inputs_with_a_shared_quantizer(rng):
    ys = jnp.stack([_y(rng) for _ in range(2)])
    q = MXFP8Quantizer(E4M3, RC)
    out = jax.vmap(quantize, in_axes=(0, None))(ys, q)
    assert out.scale_inv.shape == (2, 32, 1) and out.colwise_scale_inv.shape == (2, 1, 32)
    for i in range(2):
        assert_same_bits(unstack(out, i), oracle.quantize(np.asarray(ys[i]), 2, 2, E4M3))


def test_scan_carries_a_delayed_quantizer(rng):
    """A training-loop shape: each step quantizes with the carried quantizer and updates it."""
    xs = jnp.stack([_y(rng, (16, 32)) * (2.0**k) for k in range(5)])

    def step(q, x):
        t = reference.quantize(x, q)
        return q.update(t.amax), (t.data, t.scale_inv)

    q0 = DelayedScaleQuantizer.create(amax_history_len=3)
    q_final, (data, scale_inv) = jax.jit(lambda q, xs: jax.lax.scan(step, q, xs))(q0, xs)
    scale, hist = np.float32(1.0), np.zeros(3, np.float32)
    for k in range(5):
        want = oracle.quantize(np.asarray(xs[k]), 1, 0, E4M3, scale=scale)
        np.testing.assert_array_equal(oracle.raw_bits(data[k]), oracle.raw_bits(want["data"]))
        assert float(scale_inv[k]) == float(want["scale_inv"])
        scale, hist = oracle.delayed_update(scale, hist, oracle.amax(xs[k]), 448.0)
    assert float(q_final.scale) == float(scale)
    np.testing.assert_array_equal(np.asarray(q_final.amax_history), hist)


@jax.custom_vjp
def fake_quant(x, q):
    """Quantize-dequantize; the "gradient" for the quantizer is its updated state (the pattern
    TE uses to thread FP8 metadata through a backward pass)."""
    return reference.quantize(x, q).dequantize()


def _fq_fwd(x, q):
    t = reference.quantize(x, q)
    return t.dequantize(), (q, t.amax)  # the quantizer as a residual


def _fq_bwd(res, g):
    q, amax = res
    return g, q.update(amax)


fake_quant.defvjp(_fq_fwd, _fq_bwd)


def test_custom_vjp_returns_the_updated_quantizer_as_its_gradient(rng):
    x = _y(rng, (8, 32))
    q = DelayedScaleQuantizer.create(amax_history_len=2)
    loss = lambda x, q: jnp.sum(fake_quant(x, q))
    dx, dq = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, q)
    np.testing.assert_array_equal(np.asarray(dx), np.ones((8, 32), np.float32))
    assert isinstance(dq, DelayedScaleQuantizer)
    want, hist = oracle.delayed_update(1.0, np.zeros(2), oracle.amax(x), 448.0)
    assert float(dq.scale) == want
    np.testing.assert_array_equal(np.asarray(dq.amax_history), hist)


def test_custom_vjp_with_a_stateless_quantizer(rng):
    x = _y(rng, (32, 32))

    @functools.partial(jax.custom_vjp, nondiff_argnums=())
    def f(x, q):
        return reference.quantize(x, q).dequantize()

    f.defvjp(lambda x, q: (f(x, q), q), lambda q, g: (g, q))
    q = MXFP8Quantizer()
    dx, dq = jax.jit(jax.grad(lambda x, q: jnp.sum(f(x, q)), argnums=(0, 1)))(x, q)
    assert dq == q and np.asarray(dx).sum() == x.size
