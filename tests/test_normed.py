"""te_jax.layernorm_dense / layernorm_mlp in TransformerEngine-JAX's signatures: called with
TE-JAX's positional order they compute te_jax's norm + dense / MLP block bit for bit (TE-JAX's
(H, 1, I) kernel layout included), under FP8 too, with the output named for remat policies;
the option te_jax cannot honour is refused."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import te_jax
from te_jax import QuantizerSet, layers
from te_jax.normalization import layernorm

H, INTER = 32, 64


def _arrays(gated=False):
    ks = jax.random.split(jax.random.PRNGKey(0), 7)
    x = jax.random.normal(ks[0], (2, 8, H), jnp.bfloat16)
    gamma = 1 + 0.1 * jax.random.normal(ks[1], (H,))
    beta = 0.1 * jax.random.normal(ks[2], (H,))
    k1 = jax.random.normal(ks[3], (H, 2, INTER) if gated else (H, INTER)) / np.sqrt(H)
    k2 = jax.random.normal(ks[4], (INTER, H)) / np.sqrt(INTER)
    b1 = 0.1 * jax.random.normal(ks[5], (2, INTER) if gated else (INTER,))
    b2 = 0.1 * jax.random.normal(ks[6], (H,))
    return x, gamma, beta, k1, k2, b1, b2


@pytest.mark.parametrize("recipe", [None, te_jax.recipe.CurrentScaling()], ids=["bf16", "current"])
def test_layernorm_dense_is_norm_then_dense(recipe):
    x, gamma, beta, k1, _, b1, _ = _arrays()
    qs = QuantizerSet.create(recipe) if recipe else None

    @jax.jit
    def both(x, gamma, beta, k, b):
        # TE-JAX's positional order: x, kernel, gamma, beta, bias, norm_type, zero_centered_gamma,
        # epsilon, layernorm_input_axes, dot_input_axes, kernel_axes, batch_first, quantizer_set
        got = te_jax.layernorm_dense(
            x, k, gamma, beta, b, "layernorm", False, 1e-6, None, None, None, True, qs
        )
        want = te_jax.dense(layernorm(x, gamma, beta), k, b, quantizer_set=qs)
        return got, want

    got, want = both(x, gamma, beta, k1, b1)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize(
    "act, te_layout", [(("gelu",), True), (("silu", "linear"), False)], ids=["gelu_H1I", "swiglu"]
)
def test_layernorm_mlp_is_the_block(act, te_layout):
    gated = len(act) == 2
    x, gamma, beta, k1, k2, b1, b2 = _arrays(gated)
    qs = (QuantizerSet.create(te_jax.recipe.DelayedScaling()),) * 2
    te_k1 = k1[:, None, :] if te_layout else k1  # TE-JAX's non-gated (H, 1, I)
    te_b1 = b1[None, :] if te_layout else b1

    @jax.jit
    def both(x, gamma, beta):
        # TE-JAX's positional order up to activation_type
        got = te_jax.layernorm_mlp(
            x, gamma, beta, [te_k1, k2], [te_b1, b2], "rmsnorm", False, 1e-6, None, None, None,
            None, None, "ffn1", "ffn2", act, True, qs,
        )
        want, _ = layers.layernorm_mlp(
            x, k1, k2, b1, b2, gamma, None, activation_type=act, layernorm_type="rmsnorm",
            quantizer_sets=qs,
        )
        return got, want

    got, want = both(x, gamma, beta)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_output_is_named_for_remat_policies():
    x, gamma, beta, k1, k2, b1, b2 = _arrays()

    def f(x):
        return te_jax.layernorm_mlp(x, gamma, beta, [k1, k2], [b1, b2], ffn2_ckpt_name="out2")

    jaxpr = jax.make_jaxpr(f)(x).jaxpr
    names = [e.params.get("name") for e in jaxpr.eqns if e.primitive.name == "name"]
    assert names == ["out2"], names


def test_dot_2_input_axes_is_refused():
    x, gamma, beta, k1, k2, b1, b2 = _arrays()
    with pytest.raises(ValueError, match="dot_2_input_axes=.*kernel_1_axes"):
        te_jax.layernorm_mlp(x, gamma, beta, [k1, k2], [b1, b2], dot_2_input_axes=("a", "b", "c"))
    with pytest.raises(ValueError, match="norm_input_axes must name one logical axis"):
        te_jax.layernorm_mlp(x, gamma, beta, [k1, k2], [b1, b2], norm_input_axes=("a",))
