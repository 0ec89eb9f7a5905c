"""TransformerEngine-JAX's option names on te_jax's Linen modules (te_jax.flax.te_options): the
honoured ones change what they say (the dropout stream, the input's sharding constraint) and
nothing else, the refused ones raise naming te_jax's way."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

import te_jax.flax as tef

H, INTER = 16, 32
AXES = ("batch", "length", "embed")


def _x():
    return jax.random.normal(jax.random.PRNGKey(1), (2, 4, H), jnp.float32)


def test_intermediate_dropout_rng_name_is_the_dropout_stream():
    x = _x()
    te = tef.LayerNormMLP(INTER, intermediate_dropout_rate=0.5, intermediate_dropout_rng_name="d2")
    mine = tef.LayerNormMLP(INTER, intermediate_dropout_rate=0.5, dropout_rng_name="d2")
    v = jax.jit(lambda x: te.init({"params": jax.random.PRNGKey(0)}, x, deterministic=True))(x)
    rngs = {"d2": jax.random.PRNGKey(5)}
    a = jax.jit(lambda v, x: te.apply(v, x, rngs=rngs)[0])(v, x)
    b = jax.jit(lambda v, x: mine.apply(v, x, rngs=rngs)[0])(v, x)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(ValueError, match="name two rng streams"):
        both = tef.LayerNormMLP(
            INTER, intermediate_dropout_rate=0.5, intermediate_dropout_rng_name="d2",
            dropout_rng_name="d3",
        )
        jax.eval_shape(lambda x: both.init(jax.random.PRNGKey(0), x), x)


def _constraints(module, x, **kw):
    """The sharding constraints on the batch axis in the traced init under a one-device mesh and
    rules that map "batch" to it (the parameters' own constraints name no batch)."""
    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    rules = (("batch", "data"), ("length", None), ("embed", None))
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        jaxpr = jax.make_jaxpr(lambda x: module.init(jax.random.PRNGKey(0), x, **kw))(x)
    eqns = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "sharding_constraint"]
    return [e for e in eqns if tuple(e.params["sharding"].spec)[:1] == ("data",)]


@pytest.mark.parametrize(
    "module, field",
    [
        (tef.DenseGeneral(INTER, input_axes=AXES), "input_axes"),
        (tef.LayerNormDenseGeneral(INTER, layernorm_input_axes=AXES), "layernorm_input_axes"),
        (tef.LayerNormMLP(INTER, layernorm_input_axes=AXES), "layernorm_input_axes"),
    ],
    ids=["DenseGeneral", "LayerNormDenseGeneral", "LayerNormMLP"],
)
def test_input_axes_constrain_the_input(module, field):
    kw = {"deterministic": True} if isinstance(module, tef.LayerNormMLP) else {}
    assert len(_constraints(module, _x(), **kw)) == 1
    plain = module.clone(**{field: None})
    assert _constraints(plain, _x(), **kw) == []
    wrong = module.clone(**{field: AXES[1:]})
    with pytest.raises(ValueError, match=f"{field} must name one logical axis"):
        jax.eval_shape(lambda x: wrong.init(jax.random.PRNGKey(0), x, **kw), _x())


def test_transpose_batch_sequence_changes_nothing():
    x = _x()
    m = tef.LayerNormMLP(INTER, transpose_batch_sequence=True)
    v = jax.jit(lambda x: m.init(jax.random.PRNGKey(0), x, deterministic=True))(x)
    a = jax.jit(lambda v, x: m.apply(v, x, deterministic=True)[0])(v, x)
    b = jax.jit(lambda v, x: m.clone(transpose_batch_sequence=False).apply(v, x, True)[0])(v, x)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


REFUSED = [
    (tef.LayerNormMLP(INTER, dot_1_input_axes=AXES), "dot_1_input_axes.*layernorm_input_axes"),
    (tef.LayerNormMLP(INTER, dot_2_input_axes=AXES), "dot_2_input_axes.*kernel_axes_1"),
    (tef.LayerNormDenseGeneral(INTER, dot_input_axes=AXES), "dot_input_axes.*layernorm_input"),
    (tef.LayerNormMLP(INTER, axis=-2), r"axis=-2 .*DenseGeneral\(axis=...\)"),
    (tef.LayerNormDenseGeneral(INTER, axis=(0, 1)), r"axis=\(0, 1\) is not supported"),
    (tef.DenseGeneral(INTER, enable_low_rank_adaptation=True), "no LoRA"),
]


@pytest.mark.parametrize("module, match", REFUSED, ids=[f"{i}" for i in range(len(REFUSED))])
def test_refused_options_name_the_te_jax_way(module, match):
    kw = {"deterministic": True} if isinstance(module, tef.LayerNormMLP) else {}
    with pytest.raises(ValueError, match=match):
        jax.eval_shape(lambda x: module.init(jax.random.PRNGKey(0), x, **kw), _x())
    # axis=-1 (TE-JAX's default, the only one it takes for a normed module) is accepted
    jax.eval_shape(lambda x: tef.LayerNormMLP(INTER, axis=(-1,)).init(
        jax.random.PRNGKey(0), x, deterministic=True), _x())
