"""Delayed scaling's next state comes back as the gradient with respect to the quantizer sets
(te_jax.recipe). A step that differentiates the parameters only drops it: ``te_jax.dense`` /
``te_jax.fused_mlp`` then warn at trace time (``FP8StateNotUpdatedWarning``, once per call
site), or raise under ``TE_JAX_STRICT_FP8_STATE=1``; differentiating the sets (or the Linen
``fp8_metas`` collection, the NNX ``FP8Meta`` variables) is silent and moves the scales; the
stateless recipes have nothing to drop.

The warnings and errors come at trace time: where no value is checked, the step is traced
(``jax.eval_shape``, ``jit(...).trace``), not compiled."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import te_jax
import te_jax.flax as tef
from te_jax import nnx as tnnx
from te_jax.fp8_autodiff import STRICT_ENV, FP8StateNotUpdatedError, FP8StateNotUpdatedWarning
from te_jax.recipe import CurrentScaling, DelayedScaling, MXFP8BlockScaling, QuantizerSet

H = 32  # FP8 GEMMs: multiples of 16; MXFP8 blocks: 32
MATCH = (
    r"its operands are differentiated but its delayed-scaling quantizer set is not.*"
    r"Differentiate with respect to the quantizer sets too.*'fp8_metas'.*"
    r"nnx.DiffState\(0, \(nnx.Param, te_jax.nnx.FP8Meta\)\).*" + STRICT_ENV + "=1"
)


@pytest.fixture(autouse=True)
def _not_strict(monkeypatch):
    monkeypatch.delenv(STRICT_ENV, raising=False)


def _operands(rng):
    x = jnp.asarray(rng.uniform(-1, 1, (2, 16, H)), jnp.bfloat16)
    k1 = jnp.asarray(rng.uniform(-1, 1, (H, H)) / np.sqrt(H), jnp.float32)
    k2 = jnp.asarray(rng.uniform(-1, 1, (H, H)) / np.sqrt(H), jnp.float32)
    return x, k1, k2


def _loss(op: str):
    """``loss(kernels, sets, x)`` of one op: ``dense`` (one set) or ``fused_mlp`` (two)."""

    def loss(kernels, sets, x):
        k1, k2 = kernels
        if op == "dense":
            y = te_jax.dense(x, k1, None, "gelu", quantizer_set=sets[0])
        else:
            y = te_jax.fused_mlp(x, k1, k2, None, None, "gelu", tuple(sets))
        return jnp.sum(y.astype(jnp.float32) ** 2)

    return loss


def _sets(recipe):
    return [QuantizerSet.create(recipe), QuantizerSet.create(recipe)]


def _fp8_warnings(fn):
    """``fn()``'s result and the FP8StateNotUpdatedWarnings it emitted (every one: "always")."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fn()
    return out, [w for w in caught if issubclass(w.category, FP8StateNotUpdatedWarning)]


OPS = ["dense", "fused_mlp"]


# (op, wrt, jit) pairwise: each pair of two options' values meets once.
WARN_CASES = [("dense", "kernels", False), ("dense", "x", True)]
WARN_CASES += [("fused_mlp", "kernels", True), ("fused_mlp", "x", False)]


@pytest.mark.parametrize(
    "op, wrt, jit", WARN_CASES, ids=[f"{o}-{w}-{'jit' if j else 'eager'}" for o, w, j in WARN_CASES]
)
def test_warns_when_only_the_operands_are_differentiated(op, wrt, jit, rng):
    """Differentiating the kernels (or x) but not the sets: one warning naming the op and the
    fix, attributed to the caller's line (this file), at trace time (jit: traced only)."""
    x, k1, k2 = _operands(rng)
    sets = _sets(DelayedScaling())
    loss = _loss(op)
    argnum = {"kernels": 0, "x": 2}[wrt]
    grad = jax.grad(loss, argnums=argnum)
    grad = jax.jit(grad).trace if jit else grad
    with pytest.warns(FP8StateNotUpdatedWarning, match=f"te_jax.{op}: " + MATCH) as record:
        grad((k1, k2), sets, x)
    (w,) = [r for r in record if issubclass(r.category, FP8StateNotUpdatedWarning)]
    assert w.filename == __file__


@pytest.mark.parametrize("op", OPS)
def test_silent_when_the_sets_are_differentiated(op, rng):
    """Differentiating the kernels and the sets: no warning, and the sets' "gradient" is the
    next state (the scales have moved from 1)."""
    x, k1, k2 = _operands(rng)
    sets = _sets(DelayedScaling())
    grad = jax.grad(_loss(op), argnums=(0, 1))
    (_, new_sets), caught = _fp8_warnings(lambda: grad((k1, k2), sets, x))
    assert caught == []
    used = new_sets[:1] if op == "dense" else new_sets
    for qs in used:
        assert float(qs.x.scale) != 1.0 and float(qs.kernel.scale) != 1.0


@pytest.mark.parametrize("op", OPS)
def test_silent_without_differentiation(op, rng):
    """A forward pass, and a gradient that does not reach the op: nothing to drop."""
    x, k1, k2 = _operands(rng)
    sets = _sets(DelayedScaling())
    loss = _loss(op)
    _, caught = _fp8_warnings(lambda: jax.jit(loss).trace((k1, k2), sets, x))
    assert caught == []
    unrelated = jax.grad(lambda s, ks: loss(ks, sets, x) * 0 + s)
    _, caught = _fp8_warnings(lambda: jax.eval_shape(unrelated, 1.0, (k1, k2)))
    assert caught == []


@pytest.mark.parametrize(
    "recipe", [CurrentScaling(), MXFP8BlockScaling()], ids=["current", "mxfp8"]
)
@pytest.mark.parametrize("op", OPS)
def test_stateless_recipes_are_silent(op, recipe, rng):
    x, k1, k2 = _operands(rng)
    grad = jax.grad(_loss(op), argnums=0)
    _, caught = _fp8_warnings(lambda: jax.eval_shape(grad, (k1, k2), _sets(recipe), x))
    assert caught == []


@pytest.mark.parametrize("value, raises", [("1", True), ("true", True), ("0", False)])
@pytest.mark.parametrize("op", OPS)
def test_strict_mode_raises(op, value, raises, rng, monkeypatch):
    """``TE_JAX_STRICT_FP8_STATE=1`` makes the warning an error at trace time; ``0`` does not."""
    monkeypatch.setenv(STRICT_ENV, value)
    x, k1, k2 = _operands(rng)
    sets = _sets(DelayedScaling())
    grad = jax.jit(jax.grad(_loss(op), argnums=0)).trace  # at trace time: nothing compiled
    if raises:
        with pytest.raises(FP8StateNotUpdatedError, match=f"te_jax.{op}: " + MATCH):
            grad((k1, k2), sets, x)
    else:
        with pytest.warns(FP8StateNotUpdatedWarning):
            grad((k1, k2), sets, x)
    both = jax.jit(jax.grad(_loss(op), argnums=(0, 1))).trace
    both((k1, k2), sets, x)  # the right step never raises


def test_once_per_call_site(rng):
    """Under Python's default filter the warning shows once per line that calls the op (the
    user's model code), however often it is traced."""
    x, k1, k2 = _operands(rng)
    sets = _sets(DelayedScaling())
    grad = jax.grad(_loss("dense"), argnums=0)
    other = jax.grad(
        lambda k: jnp.sum(te_jax.dense(x, k, quantizer_set=sets[0]).astype(jnp.float32))
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        for _ in range(3):  # one call site of dense, traced three times (a new jit each time,
            # so no tracing cache): one warning
            jax.jit(lambda *a: grad(*a)).trace((k1, k2), sets, x)
        jax.eval_shape(other, k1)  # another call site: another warning
    lines = [w.lineno for w in caught if issubclass(w.category, FP8StateNotUpdatedWarning)]
    assert len(lines) == 2 and lines[0] != lines[1], lines


# ---- the Flax modules ---------------------------------------------------------------------------


def _linen(rng):
    m = tef.LayerNormMLP(H, activations="gelu", recipe=DelayedScaling())
    x = jnp.asarray(rng.uniform(-1, 1, (2, 16, H)), jnp.bfloat16)
    variables = jax.jit(m.init)(jax.random.key(0), x)
    params, fp8 = variables["params"], variables[tef.FP8_COLLECTION]

    def loss(params, fp8):
        out, _ = m.apply({"params": params, tef.FP8_COLLECTION: fp8}, x, deterministic=True)
        return jnp.mean(out.astype(jnp.float32) ** 2)

    return loss, params, fp8


def test_linen_params_only_warns_and_params_with_fp8_metas_does_not(rng):
    loss, params, fp8 = _linen(rng)
    with pytest.warns(FP8StateNotUpdatedWarning, match=MATCH):
        jax.eval_shape(jax.grad(loss, argnums=0), params, fp8)  # traced only
    step = jax.jit(jax.grad(loss, argnums=(0, 1)))  # one program, not op by op
    (_, new_fp8), caught = _fp8_warnings(lambda: step(params, fp8))
    assert caught == []
    moved = jax.tree.map(lambda a, b: bool(jnp.any(a != b)), new_fp8, fp8)
    assert any(jax.tree.leaves(moved))


def _nnx_model():
    return tnnx.LayerNormMLP(H, H, activations="gelu", recipe=DelayedScaling(), rngs=nnx.Rngs(0))


def _nnx_loss(x):
    def loss(model):
        return jnp.mean(model(x, deterministic=True)[0].astype(jnp.float32) ** 2)

    return loss


def test_nnx_default_grad_warns_and_diffstate_with_fp8meta_does_not(rng):
    x = jnp.asarray(rng.uniform(-1, 1, (2, 16, H)), jnp.bfloat16)
    model = _nnx_model()
    graphdef, state = nnx.split(model)
    with pytest.warns(FP8StateNotUpdatedWarning, match=MATCH):  # traced only
        # the default filter: nnx.Param only
        jax.eval_shape(lambda s: nnx.grad(_nnx_loss(x))(nnx.merge(graphdef, s)), state)
    wrt = nnx.DiffState(0, (nnx.Param, tnnx.FP8Meta))
    step = nnx.jit(nnx.grad(_nnx_loss(x), argnums=wrt))  # one program, not op by op
    grads, caught = _fp8_warnings(lambda: step(model))
    assert caught == []
    before = nnx.to_pure_dict(nnx.clone(nnx.state(model, tnnx.FP8Meta)))
    tnnx.update_fp8_state(model, grads)
    after = nnx.to_pure_dict(nnx.state(model, tnnx.FP8Meta))
    moved = jax.tree.map(lambda a, b: bool(jnp.any(a != b)), after, before)
    assert any(jax.tree.leaves(moved))
