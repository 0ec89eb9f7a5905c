"""te_jax.autocast: a default recipe for modules and Sequentials given none (TransformerEngine's
``autocast``); a module's own recipe wins, ``enabled=False`` turns the default off."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import te_jax
import te_jax.flax
import te_jax.nnx
from te_jax import ops
from te_jax.recipe import CurrentScaling, DelayedScaling, autocast_recipe

X = jax.random.normal(jax.random.PRNGKey(1), (8, 32), jnp.bfloat16)


def test_linen_module_without_a_recipe_takes_the_autocast_recipe():
    """Traced under autocast, a recipe-less DenseGeneral is the one given the recipe: the same
    variables (FP8 state included) and the same output bits."""
    plain = te_jax.flax.DenseGeneral(features=16)
    own = te_jax.flax.DenseGeneral(features=16, recipe=DelayedScaling())
    with te_jax.autocast(recipe=DelayedScaling()):
        variables = plain.init(jax.random.PRNGKey(0), X)
        y_auto = jax.jit(plain.apply)(variables, X)
    assert set(variables) == {"params", "fp8_metas"}
    ref = own.init(jax.random.PRNGKey(0), X)
    jax.tree.map(np.testing.assert_array_equal, nn.unbox(variables), nn.unbox(ref))
    np.testing.assert_array_equal(np.asarray(y_auto), np.asarray(jax.jit(own.apply)(ref, X)))
    # Outside the context the same module is unquantized again.
    assert "fp8_metas" not in plain.init(jax.random.PRNGKey(0), X)


def test_nnx_and_sequential_take_it_when_made():
    with te_jax.autocast():  # DelayedScaling() by default, as TransformerEngine's
        lin = te_jax.nnx.Linear(32, 16, rngs=nnx.Rngs(0))
        seq = ops.Sequential(ops.Linear(32, 16), rngs=nnx.Rngs(0))
        ops.Sequential(ops.LayerNorm(32))  # nothing to quantize: no recipe, no error
    assert nnx.state(lin, te_jax.nnx.FP8Meta)  # delayed scaling's state was made
    assert seq.recipe == DelayedScaling()
    assert ops.Sequential(ops.Linear(32, 16), rngs=nnx.Rngs(0)).recipe is None


def test_own_recipe_wins_and_enabled_false_turns_it_off():
    with te_jax.autocast(recipe=DelayedScaling()):
        assert autocast_recipe() == DelayedScaling()
        assert autocast_recipe(CurrentScaling()) == CurrentScaling()
        own = te_jax.nnx.Linear(32, 16, recipe=CurrentScaling(), rngs=nnx.Rngs(0))
        with te_jax.autocast(enabled=False):
            assert autocast_recipe() is None
            off = te_jax.nnx.Linear(32, 16, rngs=nnx.Rngs(0))
        assert autocast_recipe() == DelayedScaling()
    assert autocast_recipe() is None
    assert not nnx.state(own, te_jax.nnx.FP8Meta)  # current scaling: stateless
    assert not nnx.state(off, te_jax.nnx.FP8Meta)


def test_a_recipe_that_is_not_one_is_refused():
    with pytest.raises(TypeError, match="autocast: recipe must be a te_jax.recipe recipe"):
        with te_jax.autocast(recipe="delayed"):
            pass
