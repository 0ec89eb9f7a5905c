"""Remat of te_jax's MLP by checkpoint name: ``te_jax.fused_mlp`` names its GEMMs' residuals
(``ffn1`` = h; ``ffn{1,2}_input``, ``_kernel``, ``_quantizers``) and the block's output is
``ffn2``; ``jax.checkpoint_policies.save_only_these_names`` over them recomputes nothing (the
te_jax kernels in the compiled step, GEMMs included on a GPU, are those of the step without
remat, counted in the HLO; a policy that saves nothing runs more), and the gradients are those
of the step without remat."""

from __future__ import annotations

import re
from collections import Counter

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import te_jax
import te_jax.flax as tef
from te_jax import QuantizerSet

H, INTER = 64, 128
NAMES = ("ffn1",) + tuple(
    f"ffn{i}_{part}" for i in (1, 2) for part in ("input", "kernel", "quantizers")
)
POLICIES = {
    "none": None,
    "all_names": jax.checkpoint_policies.save_only_these_names(*NAMES),
    "nothing": jax.checkpoint_policies.nothing_saveable,
}
RECIPES = {
    "bf16": None,
    "delayed": te_jax.recipe.DelayedScaling(),
    "current": te_jax.recipe.CurrentScaling(),
}


def _kernels(compiled) -> Counter:
    return Counter(re.findall(r'custom_call_target="(te_jax_[a-z_]+)"', compiled.as_text()))


def _operands():
    ks = jax.random.split(jax.random.PRNGKey(0), 3)
    x = jax.random.normal(ks[0], (8, 32, H), jnp.bfloat16)
    return x, jax.random.normal(ks[1], (H, INTER)) / 8, jax.random.normal(ks[2], (INTER, H)) / 8


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_policies_by_name_quantize_nothing_twice(recipe):
    qs = (QuantizerSet.create(RECIPES[recipe]),) * 2 if RECIPES[recipe] else (None, None)
    x, k1, k2 = _operands()
    b1, b2 = jnp.full((INTER,), 0.1), jnp.full((H,), -0.1)

    def block(x, k1, k2, qs):
        return te_jax.fused_mlp(x, k1, k2, b1, b2, ("gelu",), qs)

    steps, kernels = {}, {}
    for name, policy in POLICIES.items():
        f = block if policy is None else jax.checkpoint(block, policy=policy)

        def loss(x, k1, k2, qs, f=f):
            return jnp.sum(f(x, k1, k2, qs).astype(jnp.float32) ** 2)

        step = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))
        kernels[name] = _kernels(step.lower(x, k1, k2, qs).compile())
        steps[name] = step(x, k1, k2, qs)
    assert kernels["all_names"] == kernels["none"], kernels
    assert sum(kernels["nothing"].values()) > sum(kernels["none"].values()), kernels
    jax.tree.map(
        lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
        steps["all_names"],
        steps["none"],
    )


def test_module_output_is_ffn2_under_nn_remat():
    """LayerNormMLP under ``nn.remat`` with the names policy: the kernels of the step without
    remat (delayed scaling), and its output named ``ffn2``."""
    x = _operands()[0]
    policy = jax.checkpoint_policies.save_only_these_names(*NAMES, "ffn2")
    kw = dict(intermediate_dim=INTER, use_bias=True, recipe=te_jax.recipe.DelayedScaling())
    plain, remat = tef.LayerNormMLP(**kw), nn.remat(tef.LayerNormMLP, policy=policy)(**kw)
    v = jax.jit(plain.init)(jax.random.PRNGKey(0), x)

    def step(m):
        def loss(v):
            return jnp.sum(m.apply(v, x)[0].astype(jnp.float32) ** 2)

        return jax.jit(jax.grad(loss)).lower(v).compile()

    assert _kernels(step(remat)) == _kernels(step(plain))
    jaxpr = jax.make_jaxpr(lambda v: plain.apply(v, x)[0])(v)
    assert "name=ffn2" in str(jaxpr)
