"""te_jax.fused_mlp: the MLP's two GEMMs as one custom_vjp. It computes what two dense calls
compute (bit for bit on the CPU, where no epilogue runs; within the epilogue's rounding on the
GPU), for every activation and recipe, with every gradient and each quantizer set's next state;
the GEMM-boundary fusions are taken where they apply (the DGELU epilogue in the bf16 GELU
backward, one act_lu quantize in the FP8 forward); the transformations work; bad input is
refused."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dense_oracle as do
import te_jax
from helpers import ACT_BY_ALIAS, ACTS, SOME_ACTS, Act
from te_jax import fused_mlp
from te_jax.primitives.gemm import GemmEpilogue
from te_jax.recipe import (
    CurrentScaling,
    DelayedScaling,
    Float8BlockScaling,
    MXFP8BlockScaling,
    QuantizerSet,
)
from test_dense import make_operands, names

RECIPES = {
    "bf16": None,
    "delayed": DelayedScaling(),
    "current": CurrentScaling(),
    "mxfp8": MXFP8BlockScaling(),
    "blockwise": Float8BlockScaling(),
}
H, INTER = 32, 64  # multiples of 16 (FP8 GEMMs) and 32 (MXFP8 blocks)


def _operands(rng, act: Act, lead=(2, 16), dtype=jnp.bfloat16, bias=True):
    x, k1, b1, _ = make_operands(rng, lead + (H,), INTER, dtype, act, bias=bias)
    k2 = (rng.uniform(-1, 1, (INTER, H)) / np.sqrt(INTER)).astype(np.float32)
    b2 = rng.uniform(-0.5, 0.5, (H,)).astype(np.float32) if bias else None
    dy = rng.uniform(-1, 1, lead + (H,)).astype(np.float32)
    return x, k1, b1, k2, b2, jnp.asarray(dy, dtype)


def _composed(x, k1, b1, k2, b2, qs, act, impl=None):
    h = te_jax.dense(x, k1, b1, act, qs[0], implementation=impl)
    return te_jax.dense(h, k2, b2, None, qs[1], implementation=impl)


def _fused(x, k1, b1, k2, b2, qs, act, impl=None):
    return fused_mlp(x, k1, k2, b1, b2, act, qs, implementation=impl)


@functools.partial(jax.jit, static_argnames=("fn", "act", "impl"))
def _value_and_grads(fn, x, k1, b1, k2, b2, qs, dy, act, impl=None):
    """``(out, (dx, dk1, db1, dk2, db2, dqs))`` of ``fn`` at ``dy``."""
    out, vjp = jax.vjp(lambda *a: fn(*a, act, impl=impl), x, k1, b1, k2, b2, qs)
    return out, vjp(dy)


@functools.partial(jax.jit, static_argnames=("acts",))
def _fused_and_composed(cases, acts):
    """``[(fused's, composed's) (out, grads)]`` of each case ``(x, k1, b1, k2, b2, qs, dy)``
    with its activation in ``acts``, in one program (programs, not cases, are what cost)."""
    return [
        tuple(_value_and_grads.__wrapped__(fn, *case, act) for fn in (_fused, _composed))
        for case, act in zip(cases, acts, strict=True)
    ]


def _case(rng, act, recipe, **kw):
    """``(x, k1, b1, k2, b2, qs, dy)`` for ``act`` under ``recipe``."""
    x, k1, b1, k2, b2, dy = _operands(rng, act, **kw)
    return (x, k1, b1, k2, b2, _sets(RECIPES[recipe]), dy)


def _sets(recipe):
    return QuantizerSet.create(recipe), QuantizerSet.create(recipe)


def _assert_close(got, want, exact: bool, rtol: float, what: str):
    """Leaf by leaf: bitwise where ``exact``, else within ``rtol`` of the leaf's norm."""
    g_leaves, w_leaves = jax.tree.leaves(got), jax.tree.leaves(want)
    assert len(g_leaves) == len(w_leaves), what
    for i, (g, w) in enumerate(zip(g_leaves, w_leaves, strict=True)):
        assert g.shape == w.shape and g.dtype == w.dtype, (what, i, g.shape, w.shape)
        g64, w64 = np.asarray(g, np.float64), np.asarray(w, np.float64)
        if exact:
            np.testing.assert_array_equal(g64, w64, err_msg=f"{what} leaf {i}")
        else:
            err = np.linalg.norm(g64 - w64) / max(np.linalg.norm(w64), 1e-30)
            assert err <= rtol, f"{what} leaf {i}: relative error {err:.3g} > {rtol}"


# ---- the same results as two dense calls ------------------------------------------------


# bf16 for every activation (the activation's math is the same under every recipe); the FP8
# recipes for a non-gated and a gated activation (the hand-offs across the GEMM boundary: the
# quantized act_lu forward and quantize_dact_dbias backward, which tests/test_quantized_output.py
# checks for every activation and scaling mode). One program per recipe.
EQUALS_ACTS = {
    "bf16": ACTS,
    "delayed": SOME_ACTS[:2],
    "current": SOME_ACTS[:2],
    "mxfp8": SOME_ACTS[:2],
    "blockwise": SOME_ACTS[1:2],  # gated: the (K, 2, N) kernel's 128x128 tiles span both halves
}


@pytest.mark.parametrize("recipe", list(EQUALS_ACTS))
def test_equals_two_dense_calls(recipe, rng):
    """Output, every gradient and each quantizer set's cotangent (delayed: the next state of
    the x, kernel and grad quantizers of both GEMMs) equal the composition's; delayed scaling
    over two steps (the second with the state the first returned)."""
    acts = EQUALS_ACTS[recipe]
    cases = [_case(rng, act, recipe) for act in acts]
    for step in range(2 if recipe == "delayed" else 1):
        results = _fused_and_composed(cases, tuple(names(a) for a in acts))
        for act, (got, want) in zip(acts, results, strict=True):
            # On the GPU the composition's forward GEMM applies GELU / ReLU in its epilogue (on
            # the float32 h) and the fused backward gelu' in its dgrad epilogue: not bitwise.
            what = f"{act.alias} {recipe} step {step}"
            _assert_close(got, want, not do.KERNEL_GEMM, 2**-5, what)
        cases = [c[:5] + (got[1][5],) + c[6:] for c, (got, _) in zip(cases, results, strict=True)]


def _gelu_and_derivative(h):
    """The tanh GELU and its derivative in float64 (docs/numerics.md §1)."""
    c = np.sqrt(2 / np.pi)
    t = np.tanh(c * (h + 0.044715 * h**3))
    return 0.5 * h * (1 + t), 0.5 * (1 + t) + 0.5 * h * (1 - t * t) * c * (1 + 3 * 0.044715 * h * h)


def _mlp_float64(x, k1, b1, k2, b2, dy):
    """The GELU MLP and its gradients in float64, by hand (2-D x)."""
    x, k1, k2, dy = (np.asarray(a, np.float64) for a in (x, k1, k2, dy))
    h = x @ k1 + (0 if b1 is None else np.asarray(b1, np.float64))
    y, dgelu = _gelu_and_derivative(h)
    out = y @ k2 + (0 if b2 is None else np.asarray(b2, np.float64))
    dh = (dy @ k2.T) * dgelu
    return {
        "out": out,
        "dx": dh @ k1.T,
        "dk1": x.T @ dh,
        "db1": dh.sum(0),
        "dk2": y.T @ dy,
        "db2": dy.sum(0),
    }


@pytest.mark.parametrize(
    "dtype", [jnp.float32, jnp.bfloat16, jnp.float16], ids=["f32", "bf16", "f16"]
)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_against_float64(dtype, bias, rng):
    """GELU (the fused-epilogue activation on the GPU) against the float64 MLP, within a few
    roundings of the dtype (two GEMMs, h and the activation rounded in between)."""
    act = ACT_BY_ALIAS["gelu"]
    x, k1, b1, k2, b2, dy = _operands(rng, act, lead=(48,), dtype=dtype, bias=bias)
    k2 = k2.astype(k1.dtype)
    b2 = None if b2 is None else b2.astype(k1.dtype)
    out, (dx, dk1, db1, dk2, db2, _) = _value_and_grads(
        _fused, x, k1, b1, k2, b2, _sets(None), dy, names(act)
    )
    want = _mlp_float64(x, k1, b1, k2, b2, dy)
    got = {"out": out, "dx": dx, "dk1": dk1, "dk2": dk2, "db1": db1, "db2": db2}
    rtol = {jnp.float32: 1e-5, jnp.bfloat16: 2**-6, jnp.float16: 2**-9}[dtype]
    for name, g in got.items():
        if g is None:
            assert not bias, name
            continue
        w = want[name]
        err = np.linalg.norm(np.asarray(g, np.float64) - w) / np.linalg.norm(w)
        assert err <= rtol, f"{name}: relative error {err:.3g} > {rtol}"


# ---- the fusions are taken ------------------------------------------------------------------


def _gemm_epilogues(jaxpr) -> list:
    """``(epilogue, grad_bias)`` of every GEMM primitive in ``jaxpr`` (sub-jaxprs included),
    and the names of the other te_jax primitives."""
    gemms, others = [], []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "te_jax_gemm":
            cfg = eqn.params["config"]
            gemms.append((cfg.epilogue, cfg.grad_bias))
        elif eqn.primitive.name.startswith("te_jax"):
            others.append(eqn.primitive.name)
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            g, o = _gemm_epilogues(sub)
            gemms, others = gemms + g, others + o
    return gemms, others


# Pairwise over (bias, kernel_2's output axes, backward): every pair of values meets once.
DGELU_CASES = [
    (True, (H,), "dgelu_bgrad"),
    (True, (2, H // 2), "dgelu"),
    (False, (H,), "dgelu"),
    (False, (2, H // 2), "dgelu_bgrad"),
]


@pytest.mark.parametrize(
    "bias, out_axes, backward",
    DGELU_CASES,
    ids=[f"{'bias' if b else 'nobias'}-out{len(o)}-{w}" for b, o, w in DGELU_CASES],
)
def test_dgelu_epilogue_path(bias, out_axes, backward, rng):
    """The bf16 GELU backward with ``gelu_backward="dgelu"`` / ``"dgelu_bgrad"``: kernel_2's
    dgrad GEMM takes the DGELU epilogue (dbias_1, where there is a bias, summed in it with
    ``"dgelu_bgrad"``, from dh in float32 with ``"dgelu"``) and no dact pass runs; against the
    composition within a bf16 rounding of the intermediate. Off a GPU the GEMM primitive runs
    its pure-JAX epilogues; the default ``"dact"`` runs the dact pass instead. The cases are
    pairwise over bias, output axes and backward (they meet in the GEMM's grad_bias flag and
    the dbias reshape)."""
    act = ACT_BY_ALIAS["gelu"]
    x, k1, b1, k2, b2, dy = _operands(rng, act, bias=bias)
    k2 = k2.astype(k1.dtype).reshape((INTER,) + out_axes)
    b2 = None if b2 is None else b2.astype(k1.dtype).reshape(out_axes)
    dy = dy.reshape(dy.shape[:-1] + out_axes)
    args = (x, k1, b1, k2, b2, _sets(None), dy)

    def step(backward):
        def fused(x, k1, b1, k2, b2, qs, act, impl=None):
            return fused_mlp(x, k1, k2, b1, b2, act, qs, gelu_backward=backward)

        return lambda *a: _value_and_grads.__wrapped__(fused, *a, names(act))

    gemms, others = _gemm_epilogues(jax.make_jaxpr(step(backward))(*args).jaxpr)
    dgelu = [g for g in gemms if g[0] == GemmEpilogue.DGELU]
    assert dgelu == [(GemmEpilogue.DGELU, bias and backward == "dgelu_bgrad")], gemms
    assert not [o for o in others if "dact" in o], f"a dact pass ran: {others}"
    dact = bias and backward == "dgelu_bgrad" and len(out_axes) == 1  # the default's dact pass
    if dact:
        gemms, others = _gemm_epilogues(jax.make_jaxpr(step("dact"))(*args).jaxpr)
        assert GemmEpilogue.DGELU not in [g[0] for g in gemms], gemms
        assert [o for o in others if "dact" in o], others

    @jax.jit
    def all_steps(*args):  # one program
        composed = _value_and_grads.__wrapped__(_composed, *args, names(act))
        return composed, step(backward)(*args), step("dact")(*args) if dact else None

    want, got, got_dact = all_steps(*args)
    _assert_close(got, want, False, 2**-7, "dgelu epilogue")
    if dact:
        _assert_close(got_dact, want, False, 2**-7, "dact pass")


def test_gelu_backward_checked():
    """An unknown ``gelu_backward`` is a ValueError naming it and the choices."""
    act = ACT_BY_ALIAS["gelu"]
    x, k1, k2 = jnp.ones((4, 16)), jnp.ones((16, 32)), jnp.ones((32, 16))
    with pytest.raises(ValueError, match=r"gelu_backward must be one of 'dact'.*got 'fast'"):
        fused_mlp(x, k1, k2, activation_type=names(act), gelu_backward="fast")


def _lowered_targets(fn, *args) -> list[str]:
    text = jax.jit(fn).lower(*args).compile().as_text()
    return re.findall(r'custom_call_target="([A-Za-z0-9_$]+)"', text)


@pytest.mark.skipif(
    not do.KERNEL_GEMM, reason="the fusions across the GEMM boundary are te_jax_gemm's (CUDA)"
)
@pytest.mark.parametrize("recipe", ["bf16", "bf16_dgelu", "delayed", "current"])
def test_compiled_step_kernels(recipe, rng):
    """The compiled forward + backward of the GELU MLP: six te_jax_gemm calls; bf16 runs one
    dact pass (GELU in the forward GEMM's epilogue), none with the DGELU epilogue switched on;
    FP8 runs one act_lu (the quantized activation, one pass, plus current scaling's amax pass)
    and one dact_dbias_quantize, and quantizes only x, the kernels and dy on their own."""
    act = ACT_BY_ALIAS["gelu"]
    x, k1, b1, k2, b2, dy = _operands(rng, act, lead=(256,))
    qs = _sets(RECIPES.get(recipe))
    backward = "dgelu_bgrad" if recipe == "bf16_dgelu" else "dact"

    def fused(x, k1, b1, k2, b2, qs, act, impl=None):
        return fused_mlp(x, k1, k2, b1, b2, act, qs, gelu_backward=backward)

    def step(x, k1, b1, k2, b2, qs, dy):
        return _value_and_grads.__wrapped__(fused, x, k1, b1, k2, b2, qs, dy, names(act))

    targets = _lowered_targets(step, x, k1, b1, k2, b2, qs, dy)
    count = {t: targets.count(t) for t in set(targets)}
    assert count.pop("te_jax_gemm") == 6, targets
    if recipe.startswith("bf16"):
        assert count == ({} if recipe == "bf16_dgelu" else {"te_jax_dact_dbias_quantize": 1})
        return
    assert count.pop("te_jax_act_lu") == 1, targets
    assert count.pop("te_jax_dact_dbias_quantize") == 1, targets
    assert count.pop("te_jax_quantize") == 4, targets  # x, kernel_1, kernel_2, dy
    count.pop("te_jax_act_amax", None)  # current scaling's amax passes
    count.pop("te_jax_dact_dbias_amax", None)
    assert not count, targets


# ---- transformations ------------------------------------------------------------------------


@pytest.mark.parametrize("recipe", ["bf16", "current"])
def test_vmap_scan_remat(recipe, rng):
    """vmap over a batch axis equals the unbatched op on each slice; lax.scan over two layers
    and jax.checkpoint give the same gradients as the plain loop. Bitwise, except vmap under
    FP8 on te_jax_gemm: the batch folds into M, cuBLASLt picks its FP8 kernel (and its
    accumulation order) by shape, and one h rounded differently can change its FP8 code."""
    act = ACT_BY_ALIAS["swiglu"]
    x, k1, b1, k2, b2, dy = _operands(rng, act, lead=(2, 16))
    qs = _sets(RECIPES[recipe])

    def out(x, k1, b1, k2, b2):
        return fused_mlp(x, k1, k2, b1, b2, names(act), qs)

    @jax.jit
    def batched_and_each(x, k1, b1, k2, b2):  # one program
        each = [out(x[i], k1, b1, k2, b2) for i in range(x.shape[0])]
        return jax.vmap(out, (0, None, None, None, None))(x, k1, b1, k2, b2), each

    batched, each = batched_and_each(x, k1, b1, k2, b2)
    exact = recipe == "bf16" or not do.KERNEL_GEMM
    for i in range(x.shape[0]):
        _assert_close(batched[i], each[i], exact, 2**-5, f"vmap element {i}")

    def loss(params, x, remat):
        def layer(h, p):
            f = jax.checkpoint(out) if remat else out
            return f(h, *p).astype(h.dtype), None

        h, _ = jax.lax.scan(layer, x, params)
        return jnp.sum(h.astype(jnp.float32) * dy)

    k2s = jnp.asarray(k2, k1.dtype)
    params = tuple(jnp.stack([a, a]) for a in (k1, b1, k2s, jnp.asarray(b2, k1.dtype)))

    def loop_loss(params, x):
        h = x
        for i in range(2):
            h = out(h, *(p[i] for p in params))
        return jnp.sum(h.astype(jnp.float32) * dy)

    @jax.jit
    def grads(params, x):  # one program
        return tuple(
            jax.grad(f)(params, x)
            for f in (lambda p, x: loss(p, x, False), lambda p, x: loss(p, x, True), loop_loss)
        )

    g_scan, g_remat, g_loop = grads(params, x)
    _assert_close(g_scan, g_loop, True, 0, "scan")
    _assert_close(g_remat, g_loop, True, 0, "remat")


def test_empty_batch_and_mixed_recipes(rng):
    """An empty batch gives empty results; one quantized GEMM and one not is the composition."""
    act = ACT_BY_ALIAS["gelu"]
    empty = _case(rng, act, "bf16", lead=(0, 4))
    x, k1, b1, k2, b2, _, dy = _case(rng, act, "bf16")
    mixed = (x, k1, b1, k2, b2, (QuantizerSet.create(DelayedScaling()), None), dy)
    (got_empty, _), (got, want) = _fused_and_composed([empty, mixed], (names(act),) * 2)
    out, grads = got_empty
    assert out.shape == (0, 4, H) and grads[1].shape == k1.shape
    np.testing.assert_array_equal(grads[1], 0)
    _assert_close(got, want, True, 0, "mixed")


# ---- errors ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "change, match",
    [
        ({"activation_type": None}, "activation_type is required"),
        ({"quantizer_sets": QuantizerSet.create(DelayedScaling())}, "must be a pair"),
        (
            {"kernel_1": np.zeros((H, 2, INTER), np.float32), "bias_1": None},
            r"kernel_1 must be \(H, I\)",
        ),
        ({"kernel_2": np.zeros((INTER + 1, H), np.float32)}, "contracting axes"),
        ({"bias_2": np.zeros((H + 1,), np.float32)}, "bias must have"),
        ({"activation_type": ("silu", "linear")}, "gated"),
        ({"x": np.zeros((4, H), np.int32)}, "int32"),
    ],
)
def test_errors(change, match, rng):
    act = ACT_BY_ALIAS["gelu"]
    x, k1, b1, k2, b2, _ = _operands(rng, act)
    args = dict(x=x, kernel_1=k1, kernel_2=k2, bias_1=b1, bias_2=b2, activation_type="gelu")
    args.update(change)
    with pytest.raises((ValueError, TypeError), match=match):
        fused_mlp(**args)


def test_second_kernel_with_several_output_axes(rng):
    """kernel_2 (I, A, B): out (..., A, B), the same as two dense calls, bf16 and under delayed
    scaling (one program)."""
    act = ACT_BY_ALIAS["gelu"]
    recipes = ("bf16", "delayed")
    x, k1, b1, _, _, _ = _operands(rng, act)
    k2 = jnp.asarray(rng.uniform(-1, 1, (INTER, 2, 16)) / np.sqrt(INTER), jnp.float32)
    b2 = jnp.asarray(rng.uniform(-0.5, 0.5, (2, 16)), jnp.float32)
    dy = jnp.asarray(rng.uniform(-1, 1, x.shape[:-1] + (2, 16)), x.dtype)
    cases = [(x, k1, b1, k2, b2, _sets(RECIPES[r]), dy) for r in recipes]
    results = _fused_and_composed(cases, (names(act),) * len(recipes))
    for recipe, (got, want) in zip(recipes, results, strict=True):
        assert got[0].shape == x.shape[:-1] + (2, 16)
        _assert_close(got, want, not do.KERNEL_GEMM, 2**-5, f"several output axes {recipe}")
