"""te_jax.flax.from_transformer_engine on synthetic TransformerEngine-JAX variable trees: TE's
shapes (a non-gated wi_kernel ``(H, 1, I)``, scales ``(1,)``) and FP8 names
(``{role}{postfix}_{field}``, postfix ``""`` for a dense layer, ``"_0"``/``"_1"`` for the MLP's
GEMMs), written here from TE-JAX's convention rather than from te_jax's converter."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import te_jax
from te_jax.flax import OVERWRITE_WITH_GRADIENT, from_transformer_engine

H, INTER, L = 16, 32, 8
RECIPE = te_jax.recipe.DelayedScaling(amax_history_len=L)
X = jax.random.normal(jax.random.PRNGKey(1), (2, 4, H), jnp.bfloat16)
ROLES, FIELDS = ("x", "kernel", "grad"), ("scale", "amax_history")


def _te_tree(variables, gemms, collection="fp8_metas"):
    """The TE-JAX tree of the same values as te_jax's ``variables``, FP8 state made to move
    (scales and histories not their initial ones, so a mix-up of names shows)."""
    params = dict(nn.unbox(variables["params"]))
    if params.get("wi_kernel") is not None and params["wi_kernel"].ndim == 2:
        params["wi_kernel"] = params["wi_kernel"][:, None, :]
        params["wi_bias"] = params["wi_bias"][None, :]
    state, te_state = {}, {}
    for g, (gemm, postfix) in enumerate(gemms):
        for r, role in enumerate(ROLES):
            scale = jnp.float32(2.0 + 4 * g + r)
            history = jax.random.uniform(jax.random.PRNGKey(10 * g + r), (L,)) * (1 + g + r)
            state[f"{gemm}_{role}_scale"], state[f"{gemm}_{role}_amax_history"] = scale, history
            te_state[f"{role}{postfix}_scale"] = scale.reshape(1)
            te_state[f"{role}{postfix}_amax_history"] = history
    return {"params": params, collection: te_state}, state


@pytest.mark.parametrize(
    "module, gemms",
    [
        (
            te_jax.flax.LayerNormMLP(intermediate_dim=INTER, use_bias=True, recipe=RECIPE),
            (("wi", "_0"), ("wo", "_1")),
        ),
        (
            te_jax.flax.LayerNormMLP(
                intermediate_dim=INTER, activations=("silu", "linear"), use_bias=True, recipe=RECIPE
            ),
            (("wi", "_0"), ("wo", "_1")),
        ),
        (te_jax.flax.DenseGeneral(features=INTER, use_bias=True, recipe=RECIPE), (("kernel", ""),)),
    ],
    ids=["mlp-gelu", "mlp-swiglu", "dense"],
)
def test_loads_into_the_module_of_the_same_name(module, gemms):
    """The converted tree is te_jax's own (parameters and FP8 state), so the module computes
    with it what it computes with its own variables."""
    mine = jax.jit(module.init)(jax.random.PRNGKey(0), X)  # one program, not op by op
    te_tree, state = _te_tree(mine, gemms)
    loaded = from_transformer_engine(module, te_tree)
    want = {"params": nn.unbox(mine["params"]), "fp8_metas": state}
    jax.tree.map(np.testing.assert_array_equal, loaded, want)
    run = jax.jit(module.apply)
    jax.tree.map(np.testing.assert_array_equal, run(loaded, X), run(want, X))


def test_the_overwrite_with_gradient_collection_goes_where_the_module_keeps_it():
    module = te_jax.flax.DenseGeneral(
        features=INTER, recipe=RECIPE, fp8_collection=OVERWRITE_WITH_GRADIENT
    )
    mine = jax.jit(module.init)(jax.random.PRNGKey(0), X)  # one program, not op by op
    te_tree, state = _te_tree(mine, (("kernel", ""),), collection=OVERWRITE_WITH_GRADIENT)
    loaded = from_transformer_engine(module, te_tree)
    assert set(loaded) == {"params", OVERWRITE_WITH_GRADIENT}
    jax.tree.map(np.testing.assert_array_equal, loaded[OVERWRITE_WITH_GRADIENT], state)


def test_errors_name_what_does_not_fit():
    mlp = te_jax.flax.LayerNormMLP(intermediate_dim=INTER, use_bias=True, recipe=RECIPE)
    variables = jax.jit(mlp.init)(jax.random.PRNGKey(0), X)  # one program, not op by op
    te_tree, _ = _te_tree(variables, (("wi", "_0"), ("wo", "_1")))
    swiglu = te_jax.flax.LayerNormMLP(
        intermediate_dim=INTER, activations=("silu", "linear"), recipe=RECIPE
    )
    with pytest.raises(ValueError, match=r"take a TE-JAX wi_kernel of shape \(H, 2, I\)"):
        from_transformer_engine(swiglu, te_tree)
    longer = te_jax.flax.LayerNormMLP(
        intermediate_dim=INTER, use_bias=True, recipe=te_jax.recipe.DelayedScaling()
    )
    with pytest.raises(ValueError, match=f"hold {L} steps.*amax_history_len={L}"):
        from_transformer_engine(longer, te_tree)
    missing = {
        **te_tree,
        "fp8_metas": {k: v for k, v in te_tree["fp8_metas"].items() if k != "grad_1_scale"},
    }
    with pytest.raises(ValueError, match="no 'grad_1_scale'.*te_jax's wo_grad_scale"):
        from_transformer_engine(mlp, missing)
    more = {**te_tree, "fp8_metas": {**te_tree["fp8_metas"], "x_2_scale": jnp.ones(1)}}
    with pytest.raises(ValueError, match=r"no te_jax counterpart: \['x_2_scale'\]"):
        from_transformer_engine(mlp, more)
    with pytest.raises(ValueError, match=r"no counterpart for: \['lora'\]"):
        from_transformer_engine(mlp, {**te_tree, "lora": {}})
    with pytest.raises(TypeError, match="got LayerNorm"):
        from_transformer_engine(te_jax.flax.LayerNorm(), te_tree)


def test_applying_a_transformer_engine_tree_names_the_converter():
    """A TE-JAX tree applied as it is (its non-gated (H, 1, I) kernel) is an error that names
    from_transformer_engine, traced only (eval_shape)."""
    mlp = te_jax.flax.LayerNormMLP(64)
    x = jnp.ones((4, 32), jnp.float32)
    params = nn.unbox(jax.eval_shape(mlp.init, jax.random.key(0), x)["params"])
    params = {k: jnp.zeros(v.shape, v.dtype) for k, v in params.items()}
    params["wi_kernel"] = params["wi_kernel"][:, None, :]
    with pytest.raises(ValueError, match=r"\(32, 1, 64\).*from_transformer_engine"):
        jax.eval_shape(lambda p: mlp.apply({"params": p}, x), params)
