"""te_jax.normalization.layernorm against float64 NumPy and Flax's own norms."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from te_jax.normalization import layernorm


def _norm64(x, gamma, beta, kind, zero_centered, eps):
    x = np.asarray(x, np.float64)
    if kind == "layernorm":
        x = x - x.mean(-1, keepdims=True)
    y = x / np.sqrt(np.square(x).mean(-1, keepdims=True) + eps)
    y = y * ((1.0 if zero_centered else 0.0) + np.asarray(gamma, np.float64))
    return y if beta is None else y + np.asarray(beta, np.float64)


@pytest.mark.parametrize("zero_centered", [False, True], ids=["gamma", "zero-centered"])
@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_matches_float64(kind, zero_centered, dtype, rng):
    """float32 statistics, one rounding to x's dtype: within one ulp of the float64 value."""
    x = (rng.standard_normal((3, 5, 48)) * 3 + 1).astype(np.float32)
    gamma = rng.standard_normal(48).astype(np.float32)
    beta = rng.standard_normal(48).astype(np.float32) if kind == "layernorm" else None
    x_in = jnp.asarray(x, dtype)
    got = layernorm(
        x_in, gamma, beta, layernorm_type=kind, zero_centered_gamma=zero_centered, epsilon=1e-5
    )
    assert got.dtype == dtype
    want = _norm64(np.asarray(x_in, np.float64), gamma, beta, kind, zero_centered, 1e-5)
    eps = float(jnp.finfo(dtype).eps)
    bound = eps * np.abs(want) + 1e-5 * (np.abs(want) + 1)
    assert (np.abs(np.asarray(got, np.float64) - want) <= bound).all()


@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm"])
def test_matches_flax_and_its_gradient(kind, rng):
    x = jnp.asarray(rng.standard_normal((4, 32)), jnp.float32)
    gamma = jnp.asarray(rng.standard_normal(32), jnp.float32)
    beta = jnp.asarray(rng.standard_normal(32), jnp.float32) if kind == "layernorm" else None
    if kind == "layernorm":
        mod = nn.LayerNorm(epsilon=1e-6, use_fast_variance=False)
        params = {"scale": gamma, "bias": beta}
    else:
        mod = nn.RMSNorm(epsilon=1e-6)
        params = {"scale": gamma}

    def ours(x, p):
        return jnp.sum(jnp.sin(layernorm(x, p["scale"], p.get("bias"), layernorm_type=kind)))

    def flax_ref(x, p):
        return jnp.sum(jnp.sin(mod.apply({"params": p}, x)))

    for a, b in zip(
        jax.grad(ours, (0, 1))(x, params), jax.grad(flax_ref, (0, 1))(x, params), strict=True
    ):
        for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
            np.testing.assert_allclose(u, v, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(layernorm_type="batchnorm"), "layernorm_type must be one of"),
        (dict(gamma_shape=(7,)), r"gamma must be \(8,\)"),
        (dict(layernorm_type="rmsnorm", beta=True), "rmsnorm has no beta"),
    ],
    ids=["type", "gamma", "rms-beta"],
)
def test_errors(kwargs, match):
    x = jnp.ones((2, 8))
    gamma = jnp.ones(kwargs.pop("gamma_shape", (8,)))
    beta = jnp.ones(8) if kwargs.pop("beta", False) else None
    with pytest.raises(ValueError, match=match):
        layernorm(x, gamma, beta, **kwargs)
