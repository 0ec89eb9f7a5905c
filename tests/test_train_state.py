"""te_jax's Linen modules under Flax's own training loop: with
``fp8_collection="_overwrite_with_gradient"`` an unmodified ``TrainState.apply_gradients``
advances delayed scaling's state, bit for bit as ``update_fp8_metas`` does beside the optimizer."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training.train_state import TrainState

import te_jax
from te_jax.flax import FP8_COLLECTION, OVERWRITE_WITH_GRADIENT, update_fp8_metas

H, INTER = 32, 64


def _module(collection):
    return te_jax.flax.DenseGeneral(
        features=INTER,
        use_bias=True,
        recipe=te_jax.recipe.DelayedScaling(),
        fp8_collection=collection,
    )


def _data():
    x = jax.random.normal(jax.random.PRNGKey(1), (4, 8, H), jnp.bfloat16)
    w = jax.random.normal(jax.random.PRNGKey(2), (4, 8, INTER))
    return x, w


def _loss(module):
    def loss(variables, x, w):
        y = module.apply(variables, x).astype(jnp.float32)
        return jnp.sum(w * y * y) / y.size  # quadratic: gradients reach every scale

    return loss


def test_train_state_advances_the_fp8_state_as_update_fp8_metas_does():
    x, w = _data()
    tx = optax.adam(1e-2)

    owg = _module(OVERWRITE_WITH_GRADIENT)
    variables = owg.init(jax.random.PRNGKey(0), x)
    assert set(variables) == {"params", OVERWRITE_WITH_GRADIENT}
    state = TrainState.create(apply_fn=owg.apply, params=variables, tx=tx)
    owg_step = jax.jit(lambda s: s.apply_gradients(grads=jax.grad(_loss(owg))(s.params, x, w)))

    mine = _module(FP8_COLLECTION)
    theirs = {"params": variables["params"], FP8_COLLECTION: variables[OVERWRITE_WITH_GRADIENT]}
    opt = tx.init(theirs["params"])

    @jax.jit
    def mine_step(v, opt):
        g = jax.grad(_loss(mine))(v, x, w)
        updates, opt = tx.update(g["params"], opt, v["params"])
        v = update_fp8_metas({**v, "params": optax.apply_updates(v["params"], updates)}, g)
        return v, opt

    for _ in range(3):
        state = owg_step(state)
        theirs, opt = mine_step(theirs, opt)
    for a, b in (("params", "params"), (OVERWRITE_WITH_GRADIENT, FP8_COLLECTION)):
        jax.tree.map(
            lambda p, q: np.testing.assert_array_equal(np.asarray(p), np.asarray(q)),
            state.params[a],
            theirs[b],
        )
    scale = state.params[OVERWRITE_WITH_GRADIENT]["kernel_x_scale"]
    assert float(scale) != 1.0  # the state moved
    assert int(state.step) == 3


def test_a_collection_of_another_name_is_refused():
    x, _ = _data()
    with pytest.raises(ValueError, match=r"fp8_collection must be 'fp8_metas'.*got 'fp8'"):
        _module("fp8").init(jax.random.PRNGKey(0), x)
