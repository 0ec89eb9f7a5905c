"""Forward-mode differentiation of the unquantized ``te_jax.dense`` / ``te_jax.fused_mlp`` and
the Flax modules: ``jax.jvp`` against the float64 pure-JAX math, ``jacfwd`` against ``jacrev``,
Hessian-vector products (``jvp`` of ``grad``); reverse mode still runs the fused backward and
nothing else; under a recipe, forward mode raises te_jax's error at trace time.

Tolerances: normwise relative error (the 2-norm of the difference over the reference's) within
a small multiple of docs/numerics.md §7's tolerance of the dtype. The tangent is
``act'(h)·(ẋ·k + x·k̇ + ḃ)`` with ``ẋ·k + x·k̇ + ḃ`` accumulated in float32 and rounded once
(like h), and ``act'(h)·ḣ`` rounded once more: a few roundings of the dtype, so 4·tol. A
Hessian-vector product is the forward-mode derivative of the backward's bf16 / float32
roundings (dact, dgrad, wgrad): 8·tol.
"""

from __future__ import annotations

import collections
import functools
import re

import flax.linen as nn
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import te_jax
import te_jax.flax as tef
from helpers import ACT_BY_ALIAS, enable_x64, te_jax_custom_calls, tol
from te_jax import nnx as tnnx
from te_jax.dispatch import environment_implementation
from te_jax.normalization import layernorm
from te_jax.recipe import CurrentScaling, DelayedScaling, MXFP8BlockScaling, QuantizerSet

ACTS = {"none": None, "gelu": ACT_BY_ALIAS["gelu"], "swiglu": ACT_BY_ALIAS["swiglu"]}
DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16}
LEAD, K, N = (2, 8), 32, 16  # x (2, 8, 32); the MLP's intermediate size N


# ---- inputs and references --------------------------------------------------------------------


def _names(act):
    return None if act is None else act.names


def _operands(rng, act, bias: bool, dtype, lead=LEAD, n=N):
    """``(x, kernel_1, bias_1, kernel_2, bias_2)`` in ``dtype`` (bias None without), with h
    spread over the activation's curved range; ``n`` the first GEMM's output size."""
    ks = (K, 2, n) if act is not None and act.gated else (K, n)
    x = rng.uniform(-1, 1, (*lead, K))
    k1 = rng.uniform(-1, 1, ks) * 3.0 / np.sqrt(K)
    k2 = rng.uniform(-1, 1, (n, K)) / np.sqrt(n)
    b1 = rng.uniform(-0.5, 0.5, ks[1:]) if bias else None
    b2 = rng.uniform(-0.5, 0.5, (K,)) if bias else None
    return tuple(None if a is None else jnp.asarray(a, dtype) for a in (x, k1, b1, k2, b2))


def _tangents(rng, primals):
    return tuple(
        None if p is None else jnp.asarray(rng.uniform(-1, 1, p.shape), p.dtype) for p in primals
    )


def _op(name: str, act):
    """The op as a function of its differentiable operands."""
    if name == "dense":
        return lambda x, k1, b1: te_jax.dense(x, k1, b1, _names(act))
    return lambda x, k1, b1, k2, b2: te_jax.fused_mlp(x, k1, k2, b1, b2, _names(act) or "gelu")


def _args(name: str, operands):
    return operands[:3] if name == "dense" else operands


def _f64(tree):
    return jax.tree.map(lambda a: jnp.asarray(np.asarray(a, np.float64)), tree)


def _rel_err(got, want) -> float:
    g = np.asarray(got, np.float64).ravel()
    w = np.asarray(want, np.float64).ravel()
    return float(np.linalg.norm(g - w) / max(np.linalg.norm(w), 1e-30))


def _assert_close(got, want, bound, what):
    for i, (g, w) in enumerate(zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)):
        err = _rel_err(g, w)
        assert err <= bound, f"{what} leaf {i}: relative error {err:.3g} > {bound:.3g}"


def _jvp64(f, primals, tangents):
    """The float64 pure-JAX path's JVP (te_jax's float64 dense is plain JAX math), jitted: one
    program, not one per eager op."""
    with enable_x64():
        return jax.jit(lambda p, t: jax.jvp(f, p, t))(_f64(primals), _f64(tangents))


def _x64(fn, *args):
    """``jax.jit(fn)`` on ``args`` in float64: the pure-JAX path's values."""
    with enable_x64():
        return jax.jit(fn)(*_f64(args))


OPS = ["dense", "fused_mlp"]
# Where te_jax's CUDA GEMM runs (its epilogues then take GELU / ReLU out of act_lu).
KERNEL_GEMM = (
    jax.default_backend() == "gpu"
    and te_jax.ffi_available("cuda")
    and environment_implementation() != "xla"
)
# Pairwise over (op, activation, bias, dtype): every pair of values of two options meets once
# (fused_mlp always has an activation), ten cases rather than the twenty of the product.
JVP_CASES = [
    ("dense", "none", True, "f32"),
    ("dense", "none", False, "bf16"),
    ("dense", "gelu", True, "bf16"),
    ("dense", "gelu", False, "f32"),
    ("dense", "swiglu", True, "f32"),
    ("dense", "swiglu", False, "bf16"),
    ("fused_mlp", "gelu", True, "f32"),
    ("fused_mlp", "gelu", False, "bf16"),
    ("fused_mlp", "swiglu", True, "bf16"),
    ("fused_mlp", "swiglu", False, "f32"),
]
JVP_IDS = [f"{o}-{a}-{'bias' if b else 'nobias'}-{d}" for o, a, b, d in JVP_CASES]
# (op, activation, dtype) pairwise: each (op, activation) once, the dtypes alternating so that
# each op and each activation meets both.
JAC_CASES = [
    ("dense", "none", "f32"),
    ("dense", "none", "bf16"),
    ("dense", "gelu", "bf16"),
    ("dense", "swiglu", "f32"),
    ("fused_mlp", "gelu", "f32"),
    ("fused_mlp", "swiglu", "bf16"),
]
HVP_CASES = [
    ("dense", "none", "bf16"),
    ("dense", "none", "f32"),
    ("dense", "gelu", "f32"),
    ("dense", "swiglu", "bf16"),
    ("fused_mlp", "gelu", "bf16"),
    ("fused_mlp", "swiglu", "f32"),
]


# ---- jvp, jacfwd, hvp ---------------------------------------------------------------------------


def _case(op, act, bias, dtype, rng):
    """``(activation, dtype, op function, primals, random tangents)`` of one case (skipped for
    fused_mlp without an activation)."""
    if op == "fused_mlp" and act == "none":
        pytest.skip("fused_mlp always has an activation")
    a, dt = ACTS[act], DTYPES[dtype]
    f = _op(op, a)
    primals = _args(op, _operands(rng, a, bias, dt))
    return a, dt, f, primals, _tangents(rng, primals)


@pytest.mark.parametrize("op, act, bias, dtype", JVP_CASES, ids=JVP_IDS)
def test_jvp_matches_float64(op, act, bias, dtype, rng):
    """``jax.jvp`` along every operand, eagerly and under jit, and along the kernel alone (the
    other tangents zero): the primal is the op's own, the tangent the float64 math's."""
    a, dt, f, primals, tangents = _case(op, act, bias, dtype, rng)
    y, y_dot = jax.jvp(f, primals, tangents)
    assert y.dtype == y_dot.dtype == dt and y_dot.shape == y.shape
    np.testing.assert_array_equal(np.asarray(y), np.asarray(f(*primals)))

    def tangents_of(p, t):  # along every operand; along the kernel alone
        along_kernel = lambda k: f(p[0], k, *p[2:])  # noqa: E731
        return jax.jvp(f, p, t)[1], jax.jvp(along_kernel, (p[1],), (t[1],))[1]

    jit_dot, k_dot = jax.jit(tangents_of)(primals, tangents)
    want, want_k = _x64(tangents_of, primals, tangents)
    _assert_close(y_dot, want, 4 * tol(dt, a), "jvp")
    _assert_close(jit_dot, want, 4 * tol(dt, a), "jit(jvp)")
    _assert_close(k_dot, want_k, 4 * tol(dt, a), "jvp along the kernel")


@pytest.mark.parametrize("op, act, dtype", JAC_CASES, ids=["-".join(c) for c in JAC_CASES])
def test_jacfwd_equals_jacrev(op, act, dtype, rng):
    """The full Jacobian with respect to x and the first kernel, both ways: forward mode's pure
    JAX tangent against reverse mode's backward kernels (the same math, rounded in another
    order: two roundings of the dtype apart). One program computes both."""
    a, dt = ACTS[act], DTYPES[dtype]
    f = _op(op, a)
    args = _args(op, _operands(rng, a, True, dt, lead=(1, 2)))
    fwd, rev = jax.jit(
        lambda *args: (jax.jacfwd(f, argnums=(0, 1))(*args), jax.jacrev(f, argnums=(0, 1))(*args))
    )(*args)
    for what, j_f, j_r in zip(("d/dx", "d/dkernel"), fwd, rev, strict=True):
        assert j_f.shape == j_r.shape and j_f.dtype == j_r.dtype == dt, what
        scale = float(np.max(np.abs(np.asarray(j_r, np.float64))))
        np.testing.assert_allclose(
            np.asarray(j_f, np.float64),
            np.asarray(j_r, np.float64),
            rtol=4 * tol(dt, a),
            atol=4 * tol(dt, a) * scale,
            err_msg=what,
        )


@pytest.mark.parametrize("op, act, dtype", HVP_CASES, ids=["-".join(c) for c in HVP_CASES])
def test_hessian_vector_product_matches_float64(op, act, dtype, rng):
    """``jvp(grad(loss))``, forward over reverse, with respect to every operand: the backward's
    kernels differentiated in forward mode, against the float64 math's."""
    a, dt, f, primals, tangents = _case(op, act, True, dtype, rng)
    c = jnp.asarray(rng.uniform(-1, 1, jax.eval_shape(f, *primals).shape), jnp.float32)

    def loss(*args):
        y = f(*args)
        return jnp.sum(y.astype(c.dtype) ** 2 * c)

    grad = jax.grad(loss, argnums=tuple(range(len(primals))))
    _, hvp = jax.jit(lambda p, t: jax.jvp(grad, p, t))(primals, tangents)
    _, want = _jvp64(grad, primals, tangents)
    _assert_close(hvp, want, 8 * tol(dt, a), "hvp")


# ---- reverse mode is unchanged ------------------------------------------------------------------

# Pure-JAX primitives an activation's derivative would need (none in the reverse-mode program).
_TRANSCENDENTAL = {"logistic", "exp", "exp2", "tanh", "erf", "erfc", "log", "pow"}


def _primitives(jaxpr, counts=None) -> collections.Counter:
    counts = collections.Counter() if counts is None else counts
    for eqn in jaxpr.eqns:
        counts[eqn.primitive.name] += 1
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            _primitives(sub, counts)
    return counts


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("act", list(ACTS))
@pytest.mark.parametrize("op", OPS)
def test_reverse_mode_runs_the_fused_backward(op, act, bias, rng):
    """``grad`` with respect to every operand: the forward's GEMMs and act_lu, one fused dact
    (+ dbias) kernel per activation, a dgrad and a wgrad GEMM per GEMM, and no pure-JAX
    derivative of the activation (no forward-mode tangent left in the program)."""
    if op == "fused_mlp" and act == "none":
        pytest.skip("fused_mlp always has an activation")
    a = ACTS[act]
    f = _op(op, a)
    operands = _args(op, _operands(rng, a, bias, jnp.bfloat16))
    given = [i for i, o in enumerate(operands) if o is not None]

    def loss(*args):  # the operands that are not None, in order
        full = list(operands)
        for i, v in zip(given, args, strict=True):
            full[i] = v
        return jnp.sum(f(*full).astype(jnp.float32) ** 2)

    args = tuple(operands[i] for i in given)
    grad = jax.grad(loss, argnums=tuple(range(len(args))))
    prims = _primitives(jax.make_jaxpr(grad)(*args).jaxpr)
    want = {"te_jax_gemm": 3 if op == "dense" else 6}
    if a is not None:
        want["te_jax_dact_dbias"] = 1
        # On te_jax's CUDA GEMM, GELU runs in the forward GEMM's epilogue (no act_lu).
        if not (KERNEL_GEMM and a.name == "GELU"):
            want["te_jax_act_lu"] = 1
    te = {p: n for p, n in prims.items() if p.startswith("te_jax")}
    assert te == want, te
    assert not set(prims) & _TRANSCENDENTAL, set(prims) & _TRANSCENDENTAL
    if a is not None and jax.default_backend() == "cpu" and te_jax.ffi_available("cpu"):
        calls = set(te_jax_custom_calls(jax.jit(grad).lower(*args).compile().as_text()))
        assert calls == {"te_jax_act_lu", "te_jax_dact_dbias_quantize"}, calls


def _epilogues(jaxpr) -> list[str]:
    """The epilogues of the GEMMs in ``jaxpr`` and its sub-jaxprs."""
    out = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "te_jax_gemm":
            out.append(eqn.params["config"].epilogue.name)
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            out += _epilogues(sub)
    return sorted(out)


@pytest.mark.skipif(not KERNEL_GEMM, reason="the GELU epilogue is te_jax_gemm's (CUDA)")
def test_gpu_epilogues_stay_in_the_primal(rng):
    """With the GEMMs on te_jax's CUDA handler (traced only), the GELU stays in the forward
    GEMM's epilogue: GELU alone, GELU_AUX (h kept) in jvp's primal and in grad, whose backward
    GEMMs are plain."""
    a = ACTS["gelu"]
    x, k, b, _, _ = _operands(rng, a, True, jnp.bfloat16)
    f = _op("dense", a)
    grad = jax.grad(lambda *p: jnp.sum(f(*p).astype(jnp.float32)), argnums=(0, 1, 2))
    for fn, want in (
        (f, ["GELU"]),
        (lambda *p: jax.jvp(f, p, p), ["GELU_AUX"]),
        (grad, ["DEFAULT", "DEFAULT", "GELU_AUX"]),
    ):
        assert _epilogues(jax.make_jaxpr(fn)(x, k, b).jaxpr) == want


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_dgelu_epilogue_backward_in_both_modes(bias, rng):
    """fused_mlp's opt-in DGELU (+ BGRAD) backward epilogue: grad runs it (one DGELU GEMM),
    and the jvp, jacfwd == jacrev and the Hessian-vector product through it match the float64
    math."""
    a, dt = ACTS["gelu"], jnp.bfloat16

    def f(x, k1, b1, k2, b2):
        return te_jax.fused_mlp(x, k1, k2, b1, b2, _names(a), gelu_backward="dgelu_bgrad")

    primals = _operands(rng, a, True, dt)
    if not bias:
        f = (lambda g: lambda x, k1, k2: g(x, k1, None, k2, None))(f)
        primals = (primals[0], primals[1], primals[3])
    tangents = _tangents(rng, primals)

    def loss(*args):
        return jnp.sum(f(*args).astype(jnp.float32) ** 2)

    grad = jax.grad(loss, argnums=tuple(range(len(primals))))
    assert _epilogues(jax.make_jaxpr(grad)(*primals).jaxpr).count("DGELU") == 1
    bound = 8 * tol(dt, a)

    def modes(p, t):  # jvp, the Hessian-vector product; one program for the dtype's run
        return jax.jvp(f, p, t)[1], jax.jvp(grad, p, t)[1]

    (got, hvp), (want, want_hvp) = jax.jit(modes)(primals, tangents), _x64(modes, primals, tangents)
    _assert_close(got, want, bound, "jvp")
    _assert_close(hvp, want_hvp, bound, "hvp")
    xs = primals[0][:1, :1]
    j_f, j_r = jax.jit(lambda *p: (jax.jacfwd(f, argnums=1)(*p), jax.jacrev(f, argnums=1)(*p)))(
        xs, *primals[1:]
    )
    _assert_close(j_f, j_r, bound, "jacfwd vs jacrev")


# ---- the transformations around it --------------------------------------------------------------


def test_under_vmap_scan_checkpoint(rng):
    """``jacfwd`` of a vmapped op, ``grad`` of ``vmap`` (the batched tangent transposes to the
    batched backward kernels), ``jvp`` through ``lax.scan`` over layers and ``grad`` of
    ``jax.checkpoint``: each against the float64 math."""
    a, dt = ACTS["gelu"], jnp.float32
    x, k, b, _, _ = _operands(rng, a, True, dt)
    f = _op("dense", a)
    bound = 4 * tol(dt, a)

    def per_row(x, k, b):  # vmapped over x's first axis
        return jnp.sum(jax.vmap(f, in_axes=(0, None, None))(x, k, b) ** 2)

    g = jax.grad(per_row, argnums=(0, 1, 2))
    prims = _primitives(jax.make_jaxpr(g)(x, k, b).jaxpr)
    assert prims["te_jax_dact_dbias"] == 1 and not set(prims) & _TRANSCENDENTAL

    ks = jnp.asarray(rng.uniform(-1, 1, (2, K, K)) / np.sqrt(K), dt)
    t = _tangents(rng, (x, ks))

    def layers(x, ks):
        return jax.lax.scan(lambda h, kk: (te_jax.dense(h, kk, None, "gelu"), None), x, ks)[0]

    ck = jax.grad(jax.checkpoint(lambda x, k, b: jnp.sum(f(x, k, b) ** 2)), argnums=(0, 1, 2))

    def transforms(x, k, b, ks, t):  # all four in one program (float32 and float64 runs)
        return (
            g(x, k, b),
            jax.jacfwd(per_row, argnums=1)(x, k, b),
            jax.jvp(layers, (x, ks), t)[1],
            ck(x, k, b),
        )

    got = jax.jit(transforms)(x, k, b, ks, t)
    want = _x64(transforms, x, k, b, ks, t)
    _assert_close(got[0], want[0], bound, "grad of vmap")
    _assert_close(got[1], want[0][1], bound, "jacfwd of vmap")
    _assert_close(got[2], want[2], 2 * bound, "jvp of scan")
    _assert_close(got[3], want[3], bound, "grad of checkpoint")


# ---- FP8: reverse mode only ---------------------------------------------------------------------

RECIPES = {"delayed": DelayedScaling(), "current": CurrentScaling(), "mxfp8": MXFP8BlockScaling()}
FORWARD_MODES = {
    "jvp": lambda f, x: jax.jvp(f, (x,), (x,)),
    "jit-jvp": lambda f, x: jax.jit(lambda x: jax.jvp(f, (x,), (x,))).trace(x),
    "jacfwd": lambda f, x: jax.jacfwd(lambda x: jnp.sum(f(x).astype(jnp.float32)))(x),
    "hvp": lambda f, x: jax.jvp(
        jax.grad(lambda x: jnp.sum(f(x).astype(jnp.float32) ** 2)), (x,), (x,)
    ),
}


@pytest.mark.filterwarnings("ignore::te_jax.fp8_autodiff.FP8StateNotUpdatedWarning")
@pytest.mark.parametrize("how", list(FORWARD_MODES))
@pytest.mark.parametrize("recipe", list(RECIPES))
@pytest.mark.parametrize("op", OPS)
def test_fp8_forward_mode_raises_a_clear_error(op, recipe, how, rng):
    """Forward mode through an FP8 op raises te_jax's TypeError at trace time (jit included),
    naming the op and reverse mode as the way; reverse mode works (checked with jvp's case).
    Every case traced (``jax.eval_shape``: te_jax's check of the op's output); the eager modes
    also eagerly (JAX's own error, re-raised as te_jax's) for the tensor-scaling recipes (the
    same wrapper for every recipe; MXFP8's eager forward would compile its ops one by one)."""
    a = ACTS["gelu"]
    # Multiples of 32 everywhere: MXFP8's blocks (32 tokens, K = N = 32).
    x, k1, b1, k2, b2 = _operands(rng, a, True, jnp.bfloat16, lead=(2, 16), n=32)
    q = lambda: QuantizerSet.create(RECIPES[recipe])
    if op == "dense":
        f = lambda x: te_jax.dense(x, k1, b1, "gelu", quantizer_set=q())
    else:
        f = lambda x: te_jax.fused_mlp(x, k1, k2, b1, b2, "gelu", (q(), q()))
    where = re.escape(f"te_jax.{op}")
    match = (
        f"{where}: forward-mode differentiation .* of an FP8 op is not defined: "
        "quantization has no derivative. Differentiate it in reverse mode"
    )
    with pytest.raises(TypeError, match=match):
        jax.eval_shape(lambda x: FORWARD_MODES[how](f, x), x)
    if how != "jit-jvp" and recipe != "mxfp8":
        with pytest.raises(TypeError, match=match):
            FORWARD_MODES[how](f, x)
    if how == "jvp":  # reverse mode traces (once per op and recipe; its values: test_dense.py)
        g = jax.eval_shape(jax.grad(lambda x: jnp.sum(f(x).astype(jnp.float32))), x)
        assert g.shape == x.shape and g.dtype == x.dtype


# ---- the Flax modules ---------------------------------------------------------------------------


def _reference_block(params, x, act, eps):
    """LayerNorm → dense → activation → dense in pure JAX (float32 dots at HIGHEST)."""
    ln = layernorm(x, params["scale"], params["ln_bias"], epsilon=eps)
    dot = functools.partial(jnp.tensordot, axes=1, precision=jax.lax.Precision.HIGHEST)
    h = dot(ln, params["wi_kernel"]) + params["wi_bias"]
    y = te_jax.activation_reference.activation(h, act.names)
    return dot(y, params["wo_kernel"]) + params["wo_bias"]


def _linen_block(act, x):
    m = tef.LayerNormMLP(N, activations=act.names, use_bias=True)
    params = nn.meta.unbox(jax.jit(m.init)(jax.random.key(0), x)["params"])
    return params, lambda p, x: m.apply({"params": p}, x, deterministic=True)[0], m.epsilon


def _nnx_block(act, x):
    m = tnnx.LayerNormMLP(K, N, activations=act.names, use_bias=True, rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(m, nnx.Param, ...)

    def apply(p, x):
        return nnx.merge(graphdef, p, rest)(x, deterministic=True)[0]

    return params, apply, 1e-6


@pytest.mark.parametrize("act", ["gelu", "swiglu"])
@pytest.mark.parametrize("family", ["linen", "nnx"])
def test_layernorm_mlp_module_jvp(family, act, rng):
    """``jax.jvp`` of a module's apply along its parameters and input (float32): the pure-JAX
    block's JVP on the same parameters; and ``jacfwd`` with respect to the input agrees with
    ``jacrev``."""
    a = ACTS[act]
    x = jnp.asarray(rng.uniform(-1, 1, (2, 4, K)), jnp.float32)
    params, apply, eps = (_linen_block if family == "linen" else _nnx_block)(a, x)
    params = jax.tree.map(
        lambda p: p + jnp.asarray(rng.uniform(-0.1, 0.1, p.shape), p.dtype), params
    )
    t_params, t_x = _tangents(rng, jax.tree.leaves(params)), _tangents(rng, (x,))[0]
    t_params = jax.tree.unflatten(jax.tree.structure(params), t_params)
    flat = lambda p: {k: v for k, v in nnx.to_pure_dict(p).items()} if family == "nnx" else p
    ref = lambda p, x: _reference_block(flat(p), x, a, eps)

    @jax.jit  # one program: the module's and the reference's jvp, jacfwd and jacrev
    def run(params, x, t_params, t_x):
        xs = x[:1, :1]
        return (
            jax.jvp(apply, (params, x), (t_params, t_x)),
            jax.jvp(ref, (params, x), (t_params, t_x)),
            jax.jacfwd(apply, argnums=1)(params, xs),
            jax.jacrev(apply, argnums=1)(params, xs),
        )

    # the reference's float32 dots at HIGHEST (te_jax's GEMMs do not read the setting)
    with jax.default_matmul_precision("highest"):
        (out, out_dot), (ref_out, ref_dot), j_f, j_r = run(params, x, t_params, t_x)
    _assert_close(out, ref_out, 4 * tol(jnp.float32, a), "out")
    _assert_close(out_dot, ref_dot, 4 * tol(jnp.float32, a), "jvp")
    _assert_close(j_f, j_r, 4 * tol(jnp.float32, a), "jacfwd vs jacrev")
