"""Delayed scaling's next state under every transform equals the plain step's (te_jax.recipe).

Where uses of one quantizer set meet (a vmapped batch sharing it, a layer applied twice, a scan
over steps, micro-batches of an accumulated step) the next state is the one a single use on all
the data gives: amaxes combine by max, never by sum. Each test compares a transformed step with
the plain one, bit for bit, on a loss that is not linear in the output (sum of squares, so the
gradient of a micro-batch is that slice of the full batch's gradient), after a few steps so the
histories are not empty, with margin > 0 and both amax algorithms.

Cost: one compiled program per distinct step, shared wherever the tests can share it. The
merge itself (where the amax algorithm and the history length enter) runs under both recipes;
each transform runs under one, the two recipes taking turns so that both meet vmap (shared and
stacked), share, scan and gradient accumulation (the transforms combine amaxes before the
update, the same code for either algorithm). The Flax modules (Linen and NNX) use "max" (a
history of 4, margin 1: a doubled or dropped history shift shows).
"""

from __future__ import annotations

import functools
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import te_jax
import te_jax.flax as tef
from te_jax import nnx as tnnx
from te_jax.quantize import DelayedScaleQuantizer
from te_jax.recipe import DelayedScaling, QuantizerSet

ROLES = ("x", "kernel", "grad")
RECIPES = {
    "max": DelayedScaling(amax_history_len=4, margin=1),
    "most_recent_L1": DelayedScaling(amax_history_len=1, amax_compute_algo="most_recent"),
}
B, S, K, N = 4, 8, 32, 32


def _inputs(seed, batch=B):
    kx, kw = jax.random.split(jax.random.PRNGKey(seed))
    # Per-example spreads differ, so each example's amax differs from the batch's.
    spread = jnp.arange(1, batch + 1, dtype=jnp.float32)[:, None, None]
    x = (jax.random.normal(kx, (batch, S, K)) * spread).astype(jnp.bfloat16)
    w = (jax.random.normal(kw, (K, N)) * 0.1).astype(jnp.bfloat16)
    return x, w


def _loss(x, w, qs):
    y = te_jax.dense(x, w, activation_type="gelu", quantizer_set=qs)
    return jnp.sum(jnp.square(y.astype(jnp.float32)))


_plain_step = jax.jit(jax.grad(_loss, argnums=(1, 2)))
_update = jax.jit(lambda q, a: q.update(a))  # eagerly, update would compile op by op
_merge = jax.jit(lambda q, us: q.merge_updates(*us))  # one program per (quantizer, count)


def _advanced(recipe, steps=3):
    """A set after ``steps`` plain steps on varied inputs: non-trivial histories."""
    qs = QuantizerSet.create(recipe)
    for i in range(steps):
        x, w = _inputs(100 + i)
        qs = _plain_step(x * (i + 1), w, qs)[1]
    return qs


def _assert_same_state(got: QuantizerSet, want: QuantizerSet):
    for r in ROLES:
        g, w = getattr(got, r), getattr(want, r)
        np.testing.assert_array_equal(np.asarray(g.scale), np.asarray(w.scale), err_msg=r)
        np.testing.assert_array_equal(
            np.asarray(g.amax_history), np.asarray(w.amax_history), err_msg=r
        )


@pytest.fixture(params=sorted(RECIPES), scope="module")
def state(request):
    return _advanced(RECIPES[request.param])


# A transform's test under one recipe (the module docstring says which meets which).
ON_MAX = pytest.mark.parametrize("state", ["max"], indirect=True)
ON_L1 = pytest.mark.parametrize("state", ["most_recent_L1"], indirect=True)


# ---- merge_updates: the max of the uses' amaxes -----------------------------------------------


@pytest.mark.parametrize(
    "amaxes",
    [(2.0, 5.0, 3.0), (0.0, 4.0), (0.0, 0.0), (np.nan, 1.0), (np.inf, 2.0), (1e-40, 3.0)],
    ids=["three", "zero", "zeros", "nan", "inf", "subnormal"],
)
def test_merge_updates_is_update_with_the_largest_amax(state, amaxes):
    q = state.grad
    updates = [_update(q, jnp.float32(a)) for a in amaxes]
    got = _merge(q, updates)
    want = _update(q, jnp.float32(np.nan if np.isnan(amaxes).any() else max(amaxes)))
    assert np.asarray(got.scale).view(np.uint32) == np.asarray(want.scale).view(np.uint32)
    np.testing.assert_array_equal(np.asarray(got.amax_history), np.asarray(want.amax_history))


def test_merge_updates_ignores_absent_uses(state):
    """A zero state (a use's zero cotangent) contributes nothing; all absent gives zero."""
    q = state.x
    zero = jax.tree.map(jnp.zeros_like, q)
    _assert_quantizer_equal(_merge(q, [_update(q, 3.0), zero]), _update(q, 3.0))
    _assert_quantizer_equal(_merge(q, [zero, zero]), zero)


def _assert_quantizer_equal(got, want):
    np.testing.assert_array_equal(np.asarray(got.scale), np.asarray(want.scale))
    np.testing.assert_array_equal(np.asarray(got.amax_history), np.asarray(want.amax_history))


def test_merge_updates_of_a_stateless_set_is_itself():
    qs = QuantizerSet.create(te_jax.recipe.CurrentScaling())
    assert qs.merge_updates(qs, qs) is qs
    assert qs.share(3) == (qs, qs, qs)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_share_rejects_a_bad_count(bad):
    with pytest.raises(ValueError, match=r"QuantizerSet.share: n must be an int >= 1, got"):
        QuantizerSet.create(RECIPES["max"]).share(bad)


def test_merge_updates_rejects_what_is_not_a_set():
    qs = QuantizerSet.create(RECIPES["max"])
    with pytest.raises(TypeError, match=r"merge_updates: each update must be a QuantizerSet"):
        qs.merge_updates(qs.x)


# ---- vmap -------------------------------------------------------------------------------------


@ON_MAX
def test_vmap_with_a_shared_set_equals_the_plain_step(state):
    """The set unbatched, the batch vmapped: one update with the batch's largest amaxes."""
    x, w = _inputs(0)
    want = _plain_step(x, w, state)[1]
    vmapped = jax.jit(
        jax.grad(lambda w, qs: jax.vmap(_loss, (0, None, None))(x, w, qs).sum(), (0, 1))
    )
    _assert_same_state(vmapped(w, state)[1], want)


@ON_L1
def test_nested_vmap_with_a_shared_set_equals_the_plain_step(state):
    x, w = _inputs(1)
    want = _plain_step(x, w, state)[1]
    x2 = x.reshape(2, B // 2, S, K)
    inner = jax.vmap(_loss, (0, None, None))
    outer = jax.vmap(lambda xb, w, qs: inner(xb, w, qs).sum(), (0, None, None))
    got = jax.jit(jax.grad(lambda w, qs: outer(x2, w, qs).sum(), (0, 1)))(w, state)[1]
    _assert_same_state(got, want)


@ON_MAX
def test_vmap_over_a_stacked_set_updates_each_member(state):
    """A stack of sets (batched state), one per member: each member's plain step."""
    xs = jnp.stack([_inputs(i)[0] for i in range(3)])
    w = _inputs(0)[1]
    members = [jax.tree.map(lambda v, i=i: v * (i + 1), state) for i in range(3)]
    stacked = jax.tree.map(lambda *v: jnp.stack(v), *members)
    step = jax.vmap(lambda x, qs: jax.grad(_loss, 2)(x, w, qs))
    got = jax.jit(step)(xs, stacked)
    for i, member in enumerate(members):
        _assert_same_state(jax.tree.map(lambda v, i=i: v[i], got), _plain_step(xs[i], w, member)[1])


# ---- one set, several calls in one step -------------------------------------------------------


def _two_sets_then_merge(state, a, b):
    """The oracle: ``a`` and ``b`` the next states of two calls given separate copies of the
    set (no autodiff sum), merged with ``update(max amax)`` per quantizer."""
    want = {}
    for r in ROLES:
        q = getattr(state, r)
        amax = jnp.maximum(getattr(a, r).amax_history[-1], getattr(b, r).amax_history[-1])
        want[r] = _update(q, amax)
    return QuantizerSet(**want)


def _twice(qa, qb, x, w):
    h = te_jax.dense(x, w, activation_type="gelu", quantizer_set=qa)
    y = te_jax.dense(h, w, activation_type="gelu", quantizer_set=qb)
    return jnp.sum(jnp.square(y.astype(jnp.float32)))


@ON_L1
def test_a_layer_applied_twice_with_share(state):
    x, w = _inputs(2)

    @jax.jit  # one program: the oracle's two sets and share's handles
    def grads(qs):
        apart = jax.grad(_twice, argnums=(0, 1))(qs, qs, x, w)
        return apart, jax.grad(lambda qs: _twice(*qs.share(), x, w))(qs)

    (a, b), got = grads(state)
    want = _two_sets_then_merge(state, a, b)
    _assert_same_state(got, want)
    # Without share, autodiff adds the two next states (the gradient of _twice(qs, qs) is the
    # sum of the two uses' a + b): what share is for.
    assert float(a.x.scale + b.x.scale) != float(want.x.scale)


@ON_MAX
def test_a_scan_over_steps_with_a_carried_handle(state):
    """lax.scan applying one layer to a sequence of inputs, the set shared by every step."""
    x, w = _inputs(3)

    def scanned(qs, xs):
        def body(carry, xt):
            total, q = carry
            q_now, q_next = q.share()
            y = te_jax.dense(xt, w, activation_type="gelu", quantizer_set=q_now)
            return (total + jnp.sum(jnp.square(y.astype(jnp.float32))), q_next), None

        return jax.lax.scan(body, (jnp.float32(0), qs), xs)[0][0]

    got = jax.jit(jax.grad(scanned))(state, x)
    # The same steps, one plain call on all of them: the amaxes of every step met.
    _assert_same_state(got, _plain_step(x, w, state)[1])


@ON_MAX
def test_an_unused_handle_contributes_nothing(state):
    x, w = _inputs(4)
    got = jax.jit(jax.grad(lambda qs: _loss(x, w, qs.share(3)[1])))(state)
    _assert_same_state(got, _plain_step(x, w, state)[1])


def test_share_is_reverse_mode_only(state):
    x, w = _inputs(4)
    with pytest.raises(TypeError, match=r"QuantizerSet.share: forward-mode differentiation"):
        jax.jvp(lambda qs: _loss(x, w, qs.share()[0]), (state,), (state,))


# ---- gradient accumulation and an activation quantized upstream --------------------------------


@ON_L1
def test_gradient_accumulation_with_merge_updates(state):
    """Micro-batches from the same state, their next states merged: the full batch's."""
    x, w = _inputs(5)
    want = _plain_step(x, w, state)[1]
    news = [_plain_step(x[i : i + 1], w, state)[1] for i in range(B)]
    _assert_same_state(state.merge_updates(*news), want)


@ON_L1
def test_an_upstream_quantized_input_is_counted_once(state):
    """``activation(h, quantizer=qs.x)`` then ``dense`` with the same set: the x quantizer's
    next state comes from the activation's amax alone (dense's use of an already quantized x
    contributes nothing), not the old state added to it."""
    x, w = _inputs(6)
    both = te_jax.quantize.QuantizeLayout.ROWWISE_COLWISE

    def loss(qs):
        y = te_jax.activation(x, "gelu", quantizer=qs.with_layout("x", both))
        out = te_jax.dense(y, w, quantizer_set=qs)
        return jnp.sum(jnp.square(out.astype(jnp.float32)))

    got = jax.jit(jax.grad(loss))(state)
    amax = jnp.max(jnp.abs(jax.nn.gelu(x.astype(jnp.float32)).astype(jnp.bfloat16)))
    _assert_quantizer_equal(got.x, _update(state.x, amax.astype(jnp.float32)))


def test_delayed_quantizer_merge_under_vmap_of_stacks():
    """merge_updates on stacks (batched states) merges member by member."""
    q = DelayedScaleQuantizer.create(amax_history_len=3, margin=1)
    stack = jax.tree.map(lambda v: jnp.stack([v, v]), q)
    a = jnp.array([1.0, 6.0], jnp.float32)
    b = jnp.array([4.0, 2.0], jnp.float32)
    up = jax.vmap(lambda q, a: q.update(a))

    @jax.jit  # one program, not one per eager op
    def got_and_want(stack, a, b):
        got = jax.vmap(lambda q, u, v: q.merge_updates(u, v))(stack, up(stack, a), up(stack, b))
        return got, up(stack, jnp.maximum(a, b))

    _assert_quantizer_equal(*got_and_want(stack, a, b))


# ---- the Flax modules ------------------------------------------------------------------------
# Oracle: two uses given separate copies of the state (two modules with the same parameters),
# their next states merged by max (merge_updates, itself checked against update(max) above).

H = 32


def _module_input(seed=7):
    spread = jnp.arange(1, B + 1, dtype=jnp.float32)[:, None, None]
    return (jax.random.normal(jax.random.PRNGKey(seed), (B, S, H)) * spread).astype(jnp.bfloat16)


def _merged(state: dict, a: dict, b: dict, gemm="kernel") -> dict:
    """Linen/NNX FP8 variables ``{gemm}_{role}_{field}``: ``a``'s and ``b``'s next states
    merged by max from ``state``."""
    qs = QuantizerSet.create(RECIPES["max"])

    def as_set(d):
        return qs.with_state({n: d[f"{gemm}_{n}"] for n in qs.state()})

    merged = as_set(state).merge_updates(as_set(a), as_set(b))
    return {f"{gemm}_{n}": v for n, v in merged.state().items()}


def _assert_same_vars(got: dict, want: dict):
    assert sorted(got) == sorted(want)
    for k in want:
        np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(want[k]), err_msg=k)


class _LinenTwice(nn.Module):
    """One DenseGeneral applied twice (``shared=True``), or two with the same parameters."""

    shared: bool

    @nn.compact
    def __call__(self, x):
        first = tef.DenseGeneral(H, activation="gelu", recipe=RECIPES["max"], name="d")
        second = (
            first
            if self.shared
            else tef.DenseGeneral(H, activation="gelu", recipe=RECIPES["max"], name="e")
        )
        return second(first(x))


def test_linen_module_applied_twice_with_a_mutable_collection():
    x = _module_input()
    shared, apart = _LinenTwice(True), _LinenTwice(False)
    v = jax.jit(shared.init)(jax.random.PRNGKey(0), x)
    params, fp8 = v["params"], v["fp8_metas"]

    def loss(model, params, fp8):
        y, _ = model.apply({"params": params, "fp8_metas": fp8}, x, mutable=["fp8_metas"])
        return jnp.sum(jnp.square(y.astype(jnp.float32)))

    # A step first, so the state is not fresh.
    step = jax.jit(jax.grad(lambda f: loss(shared, params, f)))
    fp8 = step(fp8)
    got = step(fp8)["d"]
    two = {"d": params["d"], "e": params["d"]}
    a = jax.jit(jax.grad(lambda f: loss(apart, two, f)))({"d": fp8["d"], "e": fp8["d"]})
    _assert_same_vars(got, _merged(fp8["d"], a["d"], a["e"]))


def test_linen_scan_over_steps_carrying_the_collection():
    """nn.scan applying one layer at every step, its state carried: the plain step's state."""
    x = _module_input(8)

    class Step(nn.Module):
        @nn.compact
        def __call__(self, total, xt):
            y = tef.DenseGeneral(H, activation="gelu", recipe=RECIPES["max"], name="d")(xt)
            return total + jnp.sum(jnp.square(y.astype(jnp.float32))), None

    scanned = nn.scan(
        Step, variable_broadcast="params", variable_carry="fp8_metas", split_rngs={"params": False}
    )()
    plain = tef.DenseGeneral(H, activation="gelu", recipe=RECIPES["max"])
    v = jax.jit(plain.init)(jax.random.PRNGKey(0), x)

    def scan_loss(fp8):
        vs = {"params": {"d": v["params"]}, "fp8_metas": {"d": fp8}}
        (total, _), _ = scanned.apply(vs, jnp.float32(0), x, mutable=["fp8_metas"])
        return total

    def plain_loss(fp8):
        y = plain.apply({"params": v["params"], "fp8_metas": fp8}, x)
        return jnp.sum(jnp.square(y.astype(jnp.float32)))

    fp8 = v["fp8_metas"]
    _assert_same_vars(jax.jit(jax.grad(scan_loss))(fp8), jax.jit(jax.grad(plain_loss))(fp8))


def test_linen_module_under_vmap_equals_the_plain_step():
    """jax.vmap over a LayerNormMLP's apply, the variables shared by the batch."""
    x = _module_input(9)
    mlp = tef.LayerNormMLP(2 * H, activations=("silu", "linear"), recipe=RECIPES["max"])
    v = jax.jit(mlp.init)(jax.random.PRNGKey(0), x)

    def loss(fp8, x):
        out, _ = mlp.apply({"params": v["params"], "fp8_metas": fp8}, x)
        return jnp.sum(jnp.square(out.astype(jnp.float32)))

    vmapped = jax.jit(jax.grad(lambda f: jax.vmap(loss, (None, 0))(f, x).sum()))
    want = jax.jit(jax.grad(loss))(v["fp8_metas"], x)
    got = vmapped(v["fp8_metas"])
    for gemm in ("wi", "wo"):
        _assert_same_vars(got[gemm] if gemm in got else got, want[gemm] if gemm in want else want)


class _NNXPair(nnx.Module):
    def __init__(self, first, second):
        self.first, self.second = first, second


def test_nnx_module_applied_twice():
    x = _module_input(10)
    layer = tnnx.Linear(H, H, activation="gelu", recipe=RECIPES["max"], rngs=nnx.Rngs(0))
    diff = nnx.DiffState(0, tnnx.FP8Meta)
    sq = lambda y: jnp.sum(jnp.square(y.astype(jnp.float32)))
    got = nnx.jit(nnx.grad(lambda m: sq(m(m(x))), argnums=diff))(layer)
    pair = _NNXPair(layer, nnx.clone(layer))
    apart = nnx.jit(nnx.grad(lambda p: sq(p.second(p.first(x))), argnums=diff))(pair)

    qs = QuantizerSet.create(RECIPES["max"])
    as_set = lambda q: qs.with_state({n: q[n][...] for n in qs.state()})
    before = as_set(nnx.state(layer, tnnx.FP8Meta)["quantizers"])
    want = before.merge_updates(
        as_set(apart["first"]["quantizers"]), as_set(apart["second"]["quantizers"])
    )
    _assert_same_state(as_set(got["quantizers"]), want)
    # The module's variables still hold the state it had (the forward wrote the same values).
    _assert_same_state(before, QuantizerSet.create(RECIPES["max"]))


def test_nnx_scan_over_steps_carrying_the_module():
    """nnx.scan applying one layer at every step, the module in the carry: the plain step's."""
    x = _module_input(11)
    layer = tnnx.Linear(H, H, activation="gelu", recipe=RECIPES["max"], rngs=nnx.Rngs(0))
    diff = nnx.DiffState(0, tnnx.FP8Meta)
    sq = lambda y: jnp.sum(jnp.square(y.astype(jnp.float32)))

    def scanned(model):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def body(carry, xt):
            model, total = carry
            return model, total + sq(model(xt))

        return body((model, jnp.float32(0)), x)[1]

    got = nnx.jit(nnx.grad(scanned, argnums=diff))(layer)
    want = nnx.jit(nnx.grad(lambda m: sq(m(x)), argnums=diff))(layer)
    qs = QuantizerSet.create(RECIPES["max"])
    as_set = lambda q: qs.with_state({n: q[n][...] for n in qs.state()})
    _assert_same_state(as_set(got["quantizers"]), as_set(want["quantizers"]))


@functools.cache
def _linen_mlp():
    """The Linen gradient accumulation tests' LayerNormMLP: ``(mlp, x, variables, loss(params,
    fp8, x), step)``, ``step`` the jitted one-batch step ``(params, fp8, x) -> next fp8``. Built
    once: the init and the step are one program each for both tests."""
    mlp = tef.LayerNormMLP(3 * H, activations="gelu", recipe=RECIPES["max"])
    x = _module_input(14)
    v = jax.jit(mlp.init)(jax.random.PRNGKey(0), x)

    def loss(params, fp8, xb):
        out, _ = mlp.apply({"params": params, "fp8_metas": fp8}, xb)
        return jnp.sum(jnp.square(out.astype(jnp.float32)))

    return mlp, x, v, loss, jax.jit(jax.grad(loss, 1))


def test_linen_gradient_accumulation_with_merge_fp8_metas():
    _, x, v, _, step = _linen_mlp()
    recipe = RECIPES["max"]
    params = v["params"]
    fp8 = step(params, v["fp8_metas"], x * 0.5)  # a step first: the state is not fresh
    want = step(params, fp8, x)
    news = [step(params, fp8, x[i : i + 2]) for i in (0, 2)]
    got = jax.jit(functools.partial(tef.merge_fp8_metas, recipe))(fp8, *news)  # not op by op
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_nnx_gradient_accumulation_with_merge_fp8_state():
    x = _module_input(13)
    recipe = RECIPES["max"]
    diff = nnx.DiffState(0, tnnx.FP8Meta)
    model = tnnx.LayerNormMLP(H, 2 * H, activations="gelu", recipe=recipe, rngs=nnx.Rngs(0))
    sq = lambda y: jnp.sum(jnp.square(y.astype(jnp.float32)))
    step = nnx.jit(nnx.grad(lambda m, x: sq(m(x)[0]), argnums=diff))
    want_model, acc_model = nnx.clone(model), nnx.clone(model)
    tnnx.update_fp8_state(want_model, step(want_model, x))
    # jitted: one program, not one per eager op of the merge
    nnx.jit(tnnx.merge_fp8_state)(acc_model, *[step(acc_model, x[i : i + 2]) for i in (0, 2)])
    got = jax.tree.leaves(nnx.state(acc_model, tnnx.FP8Meta))
    want = jax.tree.leaves(nnx.state(want_model, tnnx.FP8Meta))
    assert len(got) == len(want) == 12
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_merge_fp8_metas_needs_the_recipe():
    with pytest.raises(TypeError, match=r"merging FP8 states needs the modules' recipe"):
        tef.merge_fp8_metas({}, {})


@pytest.mark.xfail(
    jax.default_backend() == "gpu",
    reason="XLA:GPU runs no loop-invariant code motion (te_jax.flax.quantize_kernels, "
    "tests/test_kernel_cache.py, is the way there)",
    strict=True,
)
def test_gradient_accumulation_quantizes_each_weight_once_per_step():
    """Gradient accumulation in one jitted step (a scan over micro-batches, the FP8 state held
    through the step and merged after it): each weight's quantize depends on nothing the loop
    changes, and XLA hoists it out of the loop, so each weight is quantized once per optimizer
    step, not once per micro-batch (TransformerEngine's ``is_first_microbatch``), with no
    caching API (XLA:CPU; XLA:GPU does not hoist them: an expected failure there). The merged
    state equals the one-batch step's. Counted in the compiled step:
    one ``te_jax_quantize`` per kernel, outside the loop's body; the micro-batches' own
    quantizes (x, the gradient) in it. Fails with XLA's while-loop-invariant-code-motion pass
    disabled."""
    if not te_jax.ffi_available(jax.default_backend()):
        pytest.skip("counts te_jax's quantize kernels: needs the FFI extension")
    recipe = RECIPES["max"]
    _, x, v, loss, step = _linen_mlp()
    n = 2

    @jax.jit
    def accumulate(params, fp8, x):
        def body(acc, xb):
            g_params, g_fp8 = jax.grad(loss, (0, 1))(params, fp8, xb)
            return jax.tree.map(jnp.add, acc, g_params), g_fp8

        zeros = jax.tree.map(jnp.zeros_like, params)
        grads, news = jax.lax.scan(body, zeros, x.reshape(n, -1, *x.shape[1:]))
        merged = tef.merge_fp8_metas(
            recipe, fp8, *(jax.tree.map(lambda a, i=i: a[i], news) for i in range(n))
        )
        return grads, merged

    want = step(v["params"], v["fp8_metas"], x)
    compiled = accumulate.lower(v["params"], v["fp8_metas"], x).compile()  # compiled once
    _, got = compiled(v["params"], v["fp8_metas"], x)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))

    text = compiled.as_text()
    bodies = set(re.findall(r"body=(%[\w.\-]+)", text))
    assert bodies, "the scan is no loop: nothing to hoist out of"
    in_loop, hoisted = [], []
    for comp in re.split(r"\n(?=\S)", text):  # one computation per block
        name = comp.split(" ", 1)[0]
        calls = [
            line for line in comp.splitlines() if 'custom_call_target="te_jax_quantize"' in line
        ]
        (in_loop if name in bodies else hoisted).extend(c.split("custom-call(")[0] for c in calls)
    kernels = {"wi": f"f8e4m3fn[{H},{3 * H}]", "wo": f"f8e4m3fn[{3 * H},{H}]"}
    for name, shape in kernels.items():
        assert sum(shape + "{" in r for r in hoisted) == 1, (name, hoisted)
        assert not any(shape + "{" in r for r in in_loop), (name, in_loop)
    # the micro-batches' own quantizes (x, the gradient) stay in the loop
    assert len(in_loop) == 2, in_loop
