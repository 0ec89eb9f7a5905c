"""te_jax.activation_reference: the pure-JAX activation ops against the float64 oracle, and
TE's jit-fused bias helpers (bias_<act>, bgrad_d<act>, bias_dropout_add, get_bias_dropout_add)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import float64_oracle as oracle
import te_jax
from helpers import (
    ACT_BY_ALIAS,
    ACTS,
    DTYPE_IDS,
    DTYPES,
    assert_dbias_matches,
    assert_matches,
    dz_shape,
    make_dz,
    make_x,
    np_dtype,
    tol,
)

ref = te_jax.activation_reference
CLAMPED = ACT_BY_ALIAS["clamped_swiglu"]
CUSTOM = te_jax.ActivationParams(
    clamped_swiglu=te_jax.ClampedSwiGLUParams(limit=0.75, alpha=1.5, glu_linear_offset=0.5)
)
CASES = [(a, None) for a in ACTS] + [(CLAMPED, CUSTOM)]


@functools.partial(jax.jit, static_argnames=("act", "act_params"))
def ref_ops(x, dz, act, act_params):
    y = ref.act_lu(x, act, act_params=act_params)
    y_act = ref.activation(x, act, act_params=act_params)
    dx = ref.dact_lu(dz, x, act, act_params=act_params)
    dx_db, dbias = ref.quantize_dact_dbias(dz, x, act, act_params=act_params)
    _, none = ref.quantize_dact_dbias(dz, x, act, is_dbias=False, act_params=act_params)
    assert none is None
    return y, y_act, dx, dx_db, dbias


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}{'-custom' if c[1] else ''}")
def test_reference_ops_match_float64_oracle(case, dtype, rng):
    act, params = case
    shape = (4, 3, 2, 19) if act.gated else (4, 3, 19)
    x = make_x(rng, shape, dtype, act, params)
    dz = make_dz(rng, dz_shape(shape, act), dtype)
    y, y_act, dx, dx_db, dbias = ref_ops(jnp.asarray(x), jnp.asarray(dz), act.names, params)
    y64 = oracle.act_lu(x, act.enum, params)
    dx64 = oracle.dact_lu(dz, x, act.enum, params)
    assert_matches(y, y64, dtype, act, what="activation_reference.act_lu")
    assert_matches(y_act, y64, dtype, act, what="activation_reference.activation")
    assert_matches(dx, dx64, dtype, act, what="activation_reference.dact_lu")
    assert_matches(dx_db, dx64, dtype, act, what="activation_reference.quantize_dact_dbias")
    assert_dbias_matches(dbias, dx64, act.gated, dtype, act)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}{'-custom' if c[1] else ''}")
def test_reference_activation_grad_is_dact(case, rng):
    act, params = case
    shape = (5, 2, 7) if act.gated else (5, 7)
    x = make_x(rng, shape, jnp.float32, act, params, kink_margin=0.02)
    w = make_dz(rng, dz_shape(shape, act), jnp.float32)
    g = jax.grad(lambda x: jnp.sum(ref.activation(x, act.names, act_params=params) * w))(
        jnp.asarray(x)
    )
    assert_matches(g, oracle.dact_lu(w, x, act.enum, params), jnp.float32, act)


# --- bias helpers ---------------------------------------------------------------------------------

BIAS_ACTS = ["gelu", "silu", "relu", "quick_gelu", "squared_relu"]


def _bias_inputs(rng, act, dtype, shape=(3, 5, 24)):
    x = make_x(rng, shape, dtype, act)
    bias = (rng.uniform(-0.5, 0.5, shape[-1:])).astype(np_dtype(dtype))
    grad = make_dz(rng, shape, dtype)
    return x, bias, grad


def _helper_tol(dtype, act):
    # f32: docs/numerics.md §7. bf16/f16: x + bias may be rounded to the dtype before the activation
    # (TE's helpers compute in the input dtype), so allow a few output ulps.
    return tol(dtype, act) if jnp.dtype(dtype) == jnp.float32 else 4 * tol(dtype, act)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("name", BIAS_ACTS)
def test_bias_act_and_bgrad_dact(name, dtype, rng):
    act = ACT_BY_ALIAS[name]
    bias_act = getattr(ref, f"bias_{name}")
    bgrad_dact = getattr(ref, f"bgrad_d{name}")
    x, bias, grad = _bias_inputs(rng, act, dtype)
    xj, bj, gj = map(jnp.asarray, (x, bias, grad))
    h64 = x.astype(np.float64) + bias.astype(np.float64)
    t = _helper_tol(dtype, act)

    y = jax.jit(bias_act)(xj, bj)
    assert y.dtype == jnp.dtype(dtype) and y.shape == x.shape
    np.testing.assert_allclose(
        np.asarray(y, np.float64), oracle.act_lu(h64, act.enum), rtol=t, atol=t
    )

    bgrad, dact = jax.jit(bgrad_dact)(gj, xj, bj)
    dact64 = oracle.dact_lu(grad, h64, act.enum)
    assert dact.shape == x.shape and bgrad.shape == bias.shape
    assert dact.dtype == jnp.dtype(dtype)
    np.testing.assert_allclose(np.asarray(dact, np.float64), dact64, rtol=t, atol=t)
    n = int(np.prod(x.shape[:-1]))
    bound = t * np.abs(dact64.sum((0, 1))) + (t + n * 2.0**-24) * np.abs(dact64).sum((0, 1)) + t
    assert (np.abs(np.asarray(bgrad, np.float64) - dact64.sum((0, 1))) <= bound).all()


@pytest.mark.parametrize("name", BIAS_ACTS)
def test_bias_helpers_fuse(name, rng):
    """Pure elementwise jnp: XLA compiles them without any custom call (te_jax's or other)."""
    act = ACT_BY_ALIAS[name]
    x, bias, grad = map(jnp.asarray, _bias_inputs(rng, act, jnp.float32))
    for fn, args in (
        (getattr(ref, f"bias_{name}"), (x, bias)),
        (getattr(ref, f"bgrad_d{name}"), (grad, x, bias)),
    ):
        text = jax.jit(fn).lower(*args).compile().as_text()
        assert "custom-call" not in text and "custom_call" not in text, fn


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no_bias"])
def test_bias_dropout_add_inference(with_bias, dtype, rng):
    """training=False, or prob=0: residual + (x + bias), no randomness."""
    shape = (4, 6, 32)
    x = rng.uniform(-2, 2, shape).astype(np_dtype(dtype))
    bias = rng.uniform(-1, 1, shape[-1:]).astype(np_dtype(dtype)) if with_bias else None
    res = rng.uniform(-2, 2, shape).astype(np_dtype(dtype))
    h = x if bias is None else (x + bias)
    want = (res + h).astype(np_dtype(dtype))  # numpy: rounded after each add, in dtype
    bj = None if bias is None else jnp.asarray(bias)
    key = jax.random.PRNGKey(0)
    outs = [
        ref.bias_dropout_add(jnp.asarray(x), bj, jnp.asarray(res), 0.3, key, False),
        ref.bias_dropout_add(jnp.asarray(x), bj, jnp.asarray(res), 0.0, key, True),
        ref.get_bias_dropout_add(False)(jnp.asarray(x), bj, jnp.asarray(res), 0.5, key),
        jax.jit(ref.get_bias_dropout_add(False))(jnp.asarray(x), bj, jnp.asarray(res), 0.5, key),
    ]
    for out in outs:
        assert out.dtype == jnp.dtype(dtype) and out.shape == shape
        if jnp.dtype(dtype) == jnp.float32:
            np.testing.assert_array_equal(np.asarray(out), want)
        else:  # XLA may keep x + bias in float32 before the second add (excess precision)
            np.testing.assert_allclose(
                np.asarray(out, np.float64), want.astype(np.float64), rtol=2**-7, atol=2**-7
            )


@pytest.mark.parametrize("prob", [0.1, 0.5])
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no_bias"])
def test_bias_dropout_add_training(with_bias, prob, rng):
    shape = (64, 8, 40)  # 20480 elements
    x = rng.uniform(0.5, 2.0, shape) * rng.choice([-1.0, 1.0], shape)
    x = x.astype(np.float32)
    bias = rng.uniform(-0.25, 0.25, shape[-1:]).astype(np.float32) if with_bias else None
    res = rng.uniform(-2, 2, shape).astype(np.float32)
    h = x.astype(np.float64) + (0 if bias is None else bias.astype(np.float64))  # |h| >= 0.25
    bj = None if bias is None else jnp.asarray(bias)
    key = jax.random.PRNGKey(int(rng.integers(1 << 30)))
    fn = jax.jit(ref.get_bias_dropout_add(True))
    out = np.asarray(fn(jnp.asarray(x), bj, jnp.asarray(res), prob, key), np.float64)
    direct = np.asarray(
        ref.bias_dropout_add(jnp.asarray(x), bj, jnp.asarray(res), prob, key, True), np.float64
    )

    dropped = out == res.astype(np.float64)  # dropped elements are exactly the residual
    kept_want = res + h / (1 - prob)
    kept_ok = np.isclose(out, kept_want, rtol=1e-5, atol=1e-5)
    assert (dropped | kept_ok).all(), "every element is either dropped or kept and rescaled"
    assert not (dropped & kept_ok).any()
    keep_fraction = 1 - dropped.mean()
    assert abs(keep_fraction - (1 - prob)) < 0.03, keep_fraction
    np.testing.assert_allclose(direct, out, rtol=1e-6, atol=1e-6)  # same key, same mask

    other = np.asarray(fn(jnp.asarray(x), bj, jnp.asarray(res), prob, jax.random.split(key)[0]))
    assert ((other == res) != dropped).any(), "another key should drop other elements"
