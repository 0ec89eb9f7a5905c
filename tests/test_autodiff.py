"""Differentiation of every public op on every path: ``check_grads`` (orders 1 and 2, forward and
reverse mode, see ORDERS) against finite differences, the kernel path against the pure-JAX path, the
transformations around ``grad``, what reverse mode lowers to, and quantized outputs (which raise).

Finite differences in float32: ``check_grads`` takes central differences with ``eps = 1e-3``
along random directions, so the truncation error is ``O(eps²·f''')`` (~1e-6 here) and the
roundoff ``O(ulp(f)/eps)`` ~1e-4 relative (f32 ulp ~6e-8 of values up to ~50 for the squares);
``atol = rtol = 2e-2`` leaves a wide margin over both and still catches a wrong derivative (an
error of a factor, a sign, a missing gated term is O(1)). Inputs keep 0.05 from every kink
(relu at 0, the clamps), i.e. ~10x the largest finite-difference step.
"""

from __future__ import annotations

import functools

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import te_jax
from helpers import (
    ACT_BY_ALIAS,
    SOME_ACTS,
    Act,
    dz_shape,
    make_dz,
    make_x,
    te_jax_custom_calls,
    tol,
)
from te_jax.quantize import CurrentScaleQuantizer, DelayedScaleQuantizer, MXFP8Quantizer
from test_activation import CASES, CLAMPED, CUSTOM, case_id  # the same cases

IMPLS = ["ffi", "xla"]
FD = dict(eps=1e-3, atol=2e-2, rtol=2e-2)  # see the module docstring


def _inputs(rng, act: Act, params, lead=(2, 3)):
    """x (float32, off the kinks, moderate for the squares) and dz of y's shape; two row axes
    (dbias sums over both). One shape for every test: the eager ops compiled once serve all."""
    shape = (*lead, 2, 8) if act.gated else (*lead, 8)
    x = make_x(rng, shape, jnp.float32, act, params, edges=False, kink_margin=0.05)
    if act.name in ("SRELU", "SREGLU"):
        x = np.clip(x, -3, 3)
    dz = make_dz(rng, dz_shape(shape, act), jnp.float32)
    return jnp.asarray(x), jnp.asarray(dz)


def _op(op: str, act: Act, params, impl):
    """The op as a function of its differentiable operands."""
    kw = dict(activation_type=act.names, act_params=params, implementation=impl)
    return {
        "act_lu": lambda x: te_jax.act_lu(x, **kw),
        "activation": lambda x: te_jax.activation(x, **kw),
        "dact_lu": lambda dz, x: te_jax.dact_lu(dz, x, **kw),
        "quantize_dact_dbias": lambda dz, x: te_jax.quantize_dact_dbias(dz, x, **kw),
    }[op]


def _args(op, x, dz):
    return (x,) if op in ("act_lu", "activation") else (dz, x)


# --- finite differences ---------------------------------------------------------------------------


# The highest order checked, per (op, implementation). The kernel path: act_lu and dact_lu to
# order 2 (the tangent primitive, its JVP and transpose, the dact kernel as that transpose, and
# dact_dbias's JVP rule, which is jax.jvp of the pure-JAX reference), quantize_dact_dbias to 1
# (dact_lu's primitive with is_dbias=True: its extra output is a sum of dx over the rows, the
# second-order rules are dact_lu's). The pure-JAX path to order 1: its derivatives of order 2 are
# jax's own autodiff of the same reference formulas (act_lu_tangent, dact) that the kernel
# path's second-order rules differentiate, checked there at order 2.
ORDERS = {
    ("act_lu", "ffi"): 2,
    ("act_lu", "xla"): 1,
    ("dact_lu", "ffi"): 2,
    ("dact_lu", "xla"): 1,
    ("quantize_dact_dbias", "ffi"): 1,
    ("quantize_dact_dbias", "xla"): 1,
}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("op", ["act_lu", "dact_lu", "quantize_dact_dbias"])
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_check_grads_every_activation(case, op, impl, rng):
    """Forward and reverse mode to the order in ORDERS (order 2: JVP and VJP of each other too),
    on two row axes (x ``(2, 3[, 2], 8)``); quantize_dact_dbias checks dx and dbias. Eager, on
    purpose: the ops' eager executables serve every case, where a jitted function would compile
    each transformation anew."""
    act, params = case
    x, dz = _inputs(rng, act, params)
    f = _op(op, act, params, impl)
    check_grads(f, _args(op, x, dz), order=ORDERS[op, impl], modes=("fwd", "rev"), **FD)


# --- the kernel path gives the pure-JAX path's derivatives ---------------------------------------


@pytest.mark.parametrize(
    "case, dtype",
    [(c, jnp.float32) for c in CASES] + [((a, None), jnp.bfloat16) for a in SOME_ACTS[:2]],
    ids=[f"{case_id(c)}-f32" for c in CASES] + [f"{a}-bf16" for a in SOME_ACTS[:2]],
)
def test_kernel_grad_and_jvp_match_xla(case, dtype, rng):
    """vjp, jvp and grad of grad of act_lu: the kernel path gives the pure-JAX path's values."""
    act, params = case
    x, dz = _inputs(rng, act, params)
    x, dz = x.astype(dtype), dz.astype(dtype)
    t = (dz if act.gated else x[::-1]).astype(dtype)  # any tangent of x's shape
    t = jnp.broadcast_to(t[..., None, :], x.shape) if act.gated else t
    got, want = {}, {}
    for impl, out in (("ffi", got), ("xla", want)):
        f = _op("act_lu", act, params, impl)
        out["vjp"] = jax.vjp(f, x)[1](dz)[0]
        out["jvp"] = jax.jvp(f, (x,), (t,))[1]
        g2 = jax.grad(lambda x, f=f: jnp.sum(jax.grad(lambda x: jnp.sum(f(x) * dz))(x) ** 2))
        out["grad2"] = g2(x.astype(jnp.float32)) if dtype == jnp.float32 else None
    bound = 2 * tol(dtype)
    for k, v in got.items():
        if v is None:
            continue
        assert v.dtype == want[k].dtype == jnp.dtype(dtype), k
        scale = max(1.0, float(jnp.max(jnp.abs(want[k].astype(jnp.float32)))))
        np.testing.assert_allclose(
            np.asarray(v, np.float64),
            np.asarray(want[k], np.float64),
            rtol=bound,
            atol=bound * scale,
            err_msg=k,
        )


def test_hessian_kernel_matches_xla(rng):
    act = ACT_BY_ALIAS["geglu"]
    x, _ = _inputs(rng, act, None, lead=(3,))

    def loss(x, impl):
        return jnp.sum(te_jax.activation(x, act.names, implementation=impl))

    @jax.jit
    def h(x):  # both paths in one program
        return [jax.hessian(functools.partial(loss, impl=impl))(x) for impl in IMPLS]

    h_ffi, h_xla = h(x)
    np.testing.assert_allclose(h_ffi, h_xla, rtol=1e-5, atol=1e-5)


# --- transformations around grad ------------------------------------------------------------------


@pytest.mark.parametrize("act", SOME_ACTS, ids=str)
def test_vmap_jit_checkpoint_of_grad(act, rng):
    params = CUSTOM if act is CLAMPED else None
    x, dz = _inputs(rng, act, params)  # vmapped over the leading 2

    def loss(impl, x, dz):
        y = te_jax.act_lu(x, act.names, act_params=params, implementation=impl)
        return jnp.sum(jnp.sin(y) * dz)

    want = jax.vmap(jax.grad(functools.partial(loss, "xla")))(x, dz)
    g = jax.grad(functools.partial(loss, "ffi"))
    for got in (
        jax.vmap(g)(x, dz),
        jax.jit(jax.vmap(g))(x, dz),
        jax.vmap(jax.jit(g))(x, dz),
        jax.vmap(jax.grad(jax.checkpoint(functools.partial(loss, "ffi"))))(x, dz),
        jax.jit(jax.vmap(jax.jacfwd(functools.partial(loss, "ffi"))))(x, dz),
    ):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


# --- what reverse mode runs -----------------------------------------------------------------------

# Pure-JAX primitives an activation's derivative would need (none of them in the backward).
_TRANSCENDENTAL = {"logistic", "exp", "exp2", "tanh", "erf", "erfc", "log", "pow"}


def _primitives(jaxpr) -> set[str]:
    names = set()
    for eqn in jaxpr.eqns:
        names.add(eqn.primitive.name)
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            names |= _primitives(sub)
    return names


@pytest.mark.parametrize("op", ["act_lu", "activation"])
@pytest.mark.parametrize("name", ["gelu", "swiglu", "gelu_exact"])
def test_reverse_mode_is_the_fused_dact_kernel(name, op):
    act = ACT_BY_ALIAS[name]
    x = jnp.linspace(-2.0, 2.0, 4 * 2 * 16 if act.gated else 4 * 16, dtype=jnp.float32)
    x = x.reshape((4, 2, 16) if act.gated else (4, 16))
    f = _op(op, act, None, "ffi")
    grad = jax.grad(lambda x: jnp.sum(f(x) * f(x)))
    prims = _primitives(jax.make_jaxpr(grad)(x).jaxpr)
    assert {"te_jax_act_lu", "te_jax_dact_dbias"} <= prims
    assert not prims & _TRANSCENDENTAL, prims & _TRANSCENDENTAL
    calls = te_jax_custom_calls(jax.jit(grad).lower(x).compile().as_text())
    assert sorted(set(calls)) == ["te_jax_act_lu", "te_jax_dact_dbias_quantize"]


def test_forward_mode_keeps_the_forward_kernel():
    x = jnp.linspace(-2.0, 2.0, 64, dtype=jnp.float32).reshape(4, 16)
    f = _op("act_lu", ACT_BY_ALIAS["gelu"], None, "ffi")
    jvp = jax.jit(lambda x, t: jax.jvp(f, (x,), (t,)))
    assert "te_jax_act_lu" in te_jax_custom_calls(jvp.lower(x, x).compile().as_text())


# --- quantized outputs --------------------------------------------------------------------------

QUANTIZERS = {
    "delayed": DelayedScaleQuantizer.create(),
    "current": CurrentScaleQuantizer(),
    "mxfp8": MXFP8Quantizer(),
}


def _quantized(op, q, impl):
    kw = dict(quantizer=q, implementation=impl)
    return {
        "act_lu": lambda x: te_jax.act_lu(x, "gelu", **kw).dequantize(),
        "dact_lu": lambda x: te_jax.dact_lu(x, x, "gelu", **kw).dequantize(),
        "quantize_dact_dbias": lambda x: te_jax.quantize_dact_dbias(x, x, "gelu", **kw)[
            0
        ].dequantize(),
        "quantize": lambda x: te_jax.quantize.quantize(x, q, implementation=impl).dequantize(),
    }[op]


QUANTIZED_CASES = [("act_lu", m) for m in QUANTIZERS] + [
    ("dact_lu", "current"),
    ("quantize_dact_dbias", "mxfp8"),
    ("quantize", "delayed"),
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("op, mode", QUANTIZED_CASES, ids=[f"{o}-{m}" for o, m in QUANTIZED_CASES])
def test_quantized_outputs_raise_a_clear_error(op, mode, impl):
    """The error is raised when tracing the derivative (make_jaxpr: nothing is compiled)."""
    x = jnp.linspace(-2.0, 2.0, 64 * 32, dtype=jnp.float32).reshape(64, 32)
    f = _quantized(op, QUANTIZERS[mode], impl)
    name = "quantize.quantize" if op == "quantize" else op  # the public spelling of the op
    for diff in (
        lambda x: jax.grad(lambda x: jnp.sum(f(x)))(x),
        lambda x: jax.jvp(f, (x,), (x,)),
    ):
        with pytest.raises(
            TypeError, match=f"te_jax.{name}: a quantized output .* not differentiable"
        ):
            jax.make_jaxpr(diff)(x)
    # No tangent reaching the op: no error, the rest of the function differentiates.
    g = jax.jit(jax.grad(lambda x: jnp.sum(f(jax.lax.stop_gradient(x))) + jnp.sum(x)))(x)
    np.testing.assert_array_equal(g, np.ones(x.shape, np.float32))
