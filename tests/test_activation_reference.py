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
from test_activation import Failures

ref = te_jax.activation_reference
CLAMPED = ACT_BY_ALIAS["clamped_swiglu"]
CUSTOM = te_jax.ActivationParams(
    clamped_swiglu=te_jax.ClampedSwiGLUParams(limit=0.75, alpha=1.5, glu_linear_offset=0.5)
)
CASES = [(a, None) for a in ACTS] + [(CLAMPED, CUSTOM)]


def _ref_ops(x, dz, act, act_params):
    y = ref.act_lu(x, act, act_params=act_params)
    y_act = ref.activation(x, act, act_params=act_params)
    dx = ref.dact_lu(dz, x, act, act_params=act_params)
    dx_db, dbias = ref.quantize_dact_dbias(dz, x, act, act_params=act_params)
    _, none = ref.quantize_dact_dbias(dz, x, act, is_dbias=False, act_params=act_params)
    assert none is None
    return y, y_act, dx, dx_db, dbias


@functools.partial(jax.jit, static_argnames="specs")
def ref_ops(xs, dzs, specs):
    """``_ref_ops`` for each ``(xs[i], dzs[i])`` and ``specs[i] = (act, act_params)``: one
    program."""
    return [_ref_ops(x, dz, *spec) for x, dz, spec in zip(xs, dzs, specs, strict=True)]


def _check_ref_ops(outs, x, dz, act, params, dtype):
    y, y_act, dx, dx_db, dbias = outs
    y64 = oracle.act_lu(x, act.enum, params)
    dx64 = oracle.dact_lu(dz, x, act.enum, params)
    assert_matches(y, y64, dtype, act, what="activation_reference.act_lu")
    assert_matches(y_act, y64, dtype, act, what="activation_reference.activation")
    assert_matches(dx, dx64, dtype, act, what="activation_reference.dact_lu")
    assert_matches(dx_db, dx64, dtype, act, what="activation_reference.quantize_dact_dbias")
    assert_dbias_matches(dbias, dx64, act.gated, dtype, act)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_reference_ops_match_float64_oracle(dtype, rng):
    """The cases in this dtype, rotating (case k in ``DTYPES[k % 3]``): every case and every
    dtype here, one program per dtype. (These functions are te_jax's pure-JAX path: every
    (case, dtype) pair goes through them in test_activation.py's implementation="xla" checks.)"""
    cases = [c for k, c in enumerate(CASES) if k % len(DTYPES) == DTYPES.index(dtype)]
    inputs = []
    for act, params in cases:
        shape = (4, 3, 2, 19) if act.gated else (4, 3, 19)
        x = make_x(rng, shape, dtype, act, params)
        dz = make_dz(rng, dz_shape(shape, act), dtype)
        inputs.append((x, dz))
    outs = ref_ops(
        [jnp.asarray(x) for x, _ in inputs],
        [jnp.asarray(dz) for _, dz in inputs],
        tuple((act.names, params) for act, params in cases),
    )
    failures = Failures()
    for (act, params), (x, dz), out in zip(cases, inputs, outs, strict=True):
        label = f"{act}{'-custom' if params else ''}"
        failures.check(label, _check_ref_ops, out, x, dz, act, params, dtype)
    failures.raise_any()


def test_reference_activation_grad_is_dact(rng):
    """jax.grad of activation_reference.activation is the float64 dact, every case (one
    program)."""
    xs, ws = [], []
    for act, params in CASES:
        shape = (5, 2, 7) if act.gated else (5, 7)
        xs.append(make_x(rng, shape, jnp.float32, act, params, kink_margin=0.02))
        ws.append(make_dz(rng, dz_shape(shape, act), jnp.float32))

    def loss(x, w, act, params):
        return jnp.sum(ref.activation(x, act.names, act_params=params) * w)

    @jax.jit
    def grads(xs, ws):
        return [jax.grad(loss)(x, w, *c) for c, x, w in zip(CASES, xs, ws, strict=True)]

    gs = grads([jnp.asarray(x) for x in xs], [jnp.asarray(w) for w in ws])
    failures = Failures()
    for (act, params), x, w, g in zip(CASES, xs, ws, gs, strict=True):
        want = oracle.dact_lu(w, x, act.enum, params)
        failures.check(
            f"{act}{'-custom' if params else ''}", assert_matches, g, want, jnp.float32, act
        )
    failures.raise_any()


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


def _check_bias_helpers(name, dtype, x, bias, grad, y, bgrad, dact):
    act = ACT_BY_ALIAS[name]
    h64 = x.astype(np.float64) + bias.astype(np.float64)
    t = _helper_tol(dtype, act)
    assert y.dtype == jnp.dtype(dtype) and y.shape == x.shape
    np.testing.assert_allclose(
        np.asarray(y, np.float64), oracle.act_lu(h64, act.enum), rtol=t, atol=t
    )
    dact64 = oracle.dact_lu(grad, h64, act.enum)
    assert dact.shape == x.shape and bgrad.shape == bias.shape
    assert dact.dtype == jnp.dtype(dtype)
    np.testing.assert_allclose(np.asarray(dact, np.float64), dact64, rtol=t, atol=t)
    n = int(np.prod(x.shape[:-1]))
    bound = t * np.abs(dact64.sum((0, 1))) + (t + n * 2.0**-24) * np.abs(dact64).sum((0, 1)) + t
    assert (np.abs(np.asarray(bgrad, np.float64) - dact64.sum((0, 1))) <= bound).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_bias_act_and_bgrad_dact(dtype, rng):
    """bias_<act> and bgrad_d<act> for every helper against float64, in one program per dtype;
    they are pure elementwise jnp: XLA compiles them without any custom call (te_jax's or
    other)."""
    inputs = {name: _bias_inputs(rng, ACT_BY_ALIAS[name], dtype) for name in BIAS_ACTS}

    def all_helpers(args):
        return {
            name: (
                getattr(ref, f"bias_{name}")(x, bias),
                *getattr(ref, f"bgrad_d{name}")(grad, x, bias),
            )
            for name, (x, bias, grad) in args.items()
        }

    args = jax.tree.map(jnp.asarray, inputs)
    compiled = jax.jit(all_helpers).lower(args).compile()
    text = compiled.as_text()
    assert "custom-call" not in text and "custom_call" not in text
    outs = compiled(args)
    failures = Failures()
    for name in BIAS_ACTS:
        failures.check(name, _check_bias_helpers, name, dtype, *inputs[name], *outs[name])
    failures.raise_any()


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


def _check_dropout(prob, x, bias, res, out, direct, other):
    h = x.astype(np.float64) + (0 if bias is None else bias.astype(np.float64))  # |h| >= 0.25
    out, direct, other = (np.asarray(a, np.float64) for a in (out, direct, other))
    dropped = out == res.astype(np.float64)  # dropped elements are exactly the residual
    kept_want = res + h / (1 - prob)
    kept_ok = np.isclose(out, kept_want, rtol=1e-5, atol=1e-5)
    assert (dropped | kept_ok).all(), "every element is either dropped or kept and rescaled"
    assert not (dropped & kept_ok).any()
    keep_fraction = 1 - dropped.mean()
    assert abs(keep_fraction - (1 - prob)) < 0.03, keep_fraction
    np.testing.assert_allclose(direct, out, rtol=1e-6, atol=1e-6)  # same key, same mask
    assert ((other == res) != dropped).any(), "another key should drop other elements"


@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no_bias"])
def test_bias_dropout_add_training(with_bias, rng):
    """prob 0.1 and 0.5 (one program): each element dropped (the residual) or kept and
    rescaled, at the rate asked; get_bias_dropout_add(True) (prob traced) and the direct call
    (a float prob) drop the same elements for a key, other ones for another key."""
    shape = (64, 8, 40)  # 20480 elements
    probs = (0.1, 0.5)
    x = rng.uniform(0.5, 2.0, shape) * rng.choice([-1.0, 1.0], shape)
    x = x.astype(np.float32)
    bias = rng.uniform(-0.25, 0.25, shape[-1:]).astype(np.float32) if with_bias else None
    res = rng.uniform(-2, 2, shape).astype(np.float32)
    bj = None if bias is None else jnp.asarray(bias)
    keys = [jax.random.PRNGKey(int(rng.integers(1 << 30))) for _ in probs]
    fn = ref.get_bias_dropout_add(True)

    @jax.jit
    def run(x, bias, res, keys, ps):
        return [
            (
                fn(x, bias, res, p, key),  # p traced
                ref.bias_dropout_add(x, bias, res, prob, key, True),  # the direct call
                fn(x, bias, res, p, jax.random.split(key)[0]),
            )
            for prob, p, key in zip(probs, ps, keys, strict=True)
        ]

    outs = run(jnp.asarray(x), bj, jnp.asarray(res), keys, list(probs))
    failures = Failures()
    for prob, out in zip(probs, outs, strict=True):
        failures.check(f"prob {prob}", _check_dropout, prob, x, bias, res, *out)
    failures.raise_any()
