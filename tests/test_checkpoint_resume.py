"""An orbax checkpoint of a whole train state with delayed scaling's FP8 state (Linen: a
``TrainState`` whose params hold ``_overwrite_with_gradient``; NNX: the model's parameters and
``FP8Meta`` variables and the optimizer's state) restores, and the run resumed from it is bit
for bit the run that never stopped."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx
from flax.training.train_state import TrainState

import te_jax
from te_jax.flax import OVERWRITE_WITH_GRADIENT
from te_jax.nnx import FP8Meta, update_fp8_state

H, INTER = 32, 64
RECIPE = te_jax.recipe.DelayedScaling(amax_history_len=8)


def _batch(i):
    x = jax.random.normal(jax.random.PRNGKey(10 + i), (4, 8, H), jnp.bfloat16)
    w = jax.random.normal(jax.random.PRNGKey(20 + i), (4, 8, H))
    return x, w


def _loss(y, w):
    yf = y.astype(jnp.float32)
    return jnp.sum(w * yf * yf) / y.size  # quadratic: gradients reach every scale


def _assert_trees_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    jax.tree.map(lambda u, v: np.testing.assert_array_equal(np.asarray(u), np.asarray(v)), a, b)


def _save_restore(tmp_path, tree):
    """``tree`` written by orbax and read back (into arrays of the same shapes and dtypes)."""
    path = tmp_path / "ckpt"
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(path, tree)
        ckptr.wait_until_finished()
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)
        return ckptr.restore(path, abstract)


def test_linen_train_state_resumes_bit_for_bit(tmp_path):
    module = te_jax.flax.LayerNormMLP(
        INTER,
        use_bias=True,
        intermediate_dropout_rate=0.0,
        recipe=RECIPE,
        fp8_collection=OVERWRITE_WITH_GRADIENT,
        return_layernorm_output=False,
    )
    variables = jax.jit(module.init)(jax.random.PRNGKey(0), _batch(0)[0])
    state = TrainState.create(apply_fn=module.apply, params=variables, tx=optax.adam(1e-2))

    @jax.jit
    def step(state, x, w):
        grads = jax.grad(lambda v: _loss(module.apply(v, x)[0], w))(state.params)
        return state.apply_gradients(grads=grads)

    for i in range(3):
        state = step(state, *_batch(i))
    restored = _save_restore(tmp_path, state)
    _assert_trees_equal(restored, state)
    assert np.count_nonzero(restored.params[OVERWRITE_WITH_GRADIENT]["wi_x_amax_history"]) == 3
    for i in range(3, 5):
        state, restored = step(state, *_batch(i)), step(restored, *_batch(i))
    _assert_trees_equal(restored, state)


def test_nnx_model_and_optimizer_resume_bit_for_bit(tmp_path):
    def make():
        model = te_jax.nnx.LayerNormMLP(H, INTER, use_bias=True, recipe=RECIPE, rngs=nnx.Rngs(0))
        return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

    @nnx.jit
    def step(model, opt, x, w):
        diff = nnx.DiffState(0, (nnx.Param, FP8Meta))
        grads = nnx.grad(lambda m: _loss(m(x)[0], w), argnums=diff)(model)
        opt.update(model, grads)
        update_fp8_state(model, grads)

    model, opt = make()
    for i in range(3):
        step(model, opt, *_batch(i))
    saved = nnx.to_pure_dict(nnx.state((model, opt)))
    restored = _save_restore(tmp_path, saved)
    _assert_trees_equal(restored, saved)
    model2, opt2 = make()  # fresh: the checkpoint's values replace its initial ones
    state2 = nnx.state((model2, opt2))
    nnx.replace_by_pure_dict(state2, restored)
    nnx.update((model2, opt2), state2)
    for i in range(3, 5):
        step(model, opt, *_batch(i))
        step(model2, opt2, *_batch(i))
    _assert_trees_equal(nnx.to_pure_dict(nnx.state((model2, opt2))), nnx.to_pure_dict(
        nnx.state((model, opt))
    ))
    hist = nnx.state(model2, FP8Meta)
    assert any(np.count_nonzero(np.asarray(v)) == 5 for v in jax.tree.leaves(hist))
