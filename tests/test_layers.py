"""te_jax.layers: the functional pieces the Linen and NNX modules share."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from te_jax import ActivationParams, ActivationType, layers


def _einsum_dense(x, kernel, bias, axes, act):
    """float64 NumPy: contract x's ``axes`` with the kernel's leading axes, then the
    activation (gelu or swiglu here)."""
    x, kernel = np.asarray(x, np.float64), np.asarray(kernel, np.float64)
    rest = [a for a in range(x.ndim) if a not in axes]
    xm = np.transpose(x, rest + list(axes)).reshape(*[x.shape[a] for a in rest], -1)
    k = kernel.reshape(int(np.prod([x.shape[a] for a in axes])), -1)
    h = xm @ k
    if bias is not None:
        h = h + np.asarray(bias, np.float64).reshape(-1)
    out_shape = kernel.shape[len(axes) :]
    if act == "swiglu":
        h = h.reshape(*h.shape[:-1], 2, -1)
        a, b = h[..., 0, :], h[..., 1, :]
        return (a / (1 + np.exp(-a)) * b).reshape(*xm.shape[:-1], *out_shape[1:])
    g = 0.5 * h * (1 + np.tanh(np.sqrt(2 / np.pi) * (h + 0.044715 * h**3)))
    return g.reshape(*xm.shape[:-1], *out_shape)


@pytest.mark.parametrize(
    "x_shape, axis, features, act",
    [
        ((3, 4, 6), -1, (5,), "gelu"),
        ((3, 4, 6), (1, 2), (2, 5), "gelu"),
        ((4, 3, 6), 0, (5,), "gelu"),  # a leading axis: moved to the end first
        ((3, 4, 6), -1, (2, 5), "swiglu"),  # gated, features folded into N
    ],
    ids=["last", "two-trailing", "leading", "gated-2d-features"],
)
def test_dense_general_matches_float64(x_shape, axis, features, act, rng):
    act_t = ActivationType.parse(act)
    axes = layers.normalize_axes("t", axis, len(x_shape))
    k_shape = layers.dense_kernel_shape([x_shape[a] for a in axes], features, act_t)
    x = rng.standard_normal(x_shape).astype(np.float32)
    kernel = (rng.standard_normal(k_shape) / 3).astype(np.float32)
    bias = rng.standard_normal(k_shape[len(axes) :]).astype(np.float32)
    got = layers.dense_general(jnp.asarray(x), kernel, bias, axis=axis, activation_type=act)
    want = _einsum_dense(x, kernel, bias, axes, act)
    assert got.shape == want.shape
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=2e-5, atol=2e-5)


def test_init_kernel_fan_in_and_gated_halves():
    """Fan-in is the product of the contracted axes; a gated kernel's halves are two
    independently drawn (K, N) kernels, each with the (K, N) kernel's variance."""
    init = nn.initializers.variance_scaling(1.0, "fan_in", "normal")
    key = jax.random.key(0)
    k = layers.init_kernel(init, key, (8, 16, 2, 512), 2, True, jnp.float32)
    assert k.shape == (8, 16, 2, 512)
    for half in (k[:, :, 0], k[:, :, 1]):
        assert abs(float(jnp.var(half)) * 128 - 1) < 0.05
    assert not np.allclose(k[:, :, 0], k[:, :, 1])
    plain = layers.init_kernel(init, key, (8, 16, 512), 2, False, jnp.bfloat16)
    assert (
        plain.dtype == jnp.bfloat16
        and abs(float(jnp.var(plain.astype(jnp.float32))) * 128 - 1) < 0.05
    )


def test_fit_axes():
    assert layers.fit_axes("t", (), (4, 5), False) is None
    assert layers.fit_axes("t", ("embed", "act", "mlp"), (4, 2, 5), False) == (
        "embed",
        "act",
        "mlp",
    )
    assert layers.fit_axes("t", ("embed", "act", "mlp"), (4, 5), True) == ("embed", "mlp")
    assert layers.fit_axes("t", ("act", "mlp"), (5,), True) == ("mlp",)
    with pytest.raises(ValueError, match="3 logical axis names"):
        layers.fit_axes("t", ("a", "b", "c"), (4, 5), False)


def test_resolve_activation():
    act, params = layers.resolve_activation("t", "clamped_swiglu", {"limit": 5.0})
    assert act is ActivationType.CLAMPED_SWIGLU and params.clamped_swiglu.limit == 5.0
    assert layers.resolve_activation("t", ("gelu",), None) == (ActivationType.GELU, None)
    assert layers.resolve_activation("t", None, None) == (None, None)
    with pytest.raises(ValueError, match="t: activation_params"):
        layers.resolve_activation("t", "gelu", {"limit": 5.0})
    with pytest.raises(ValueError, match="^t: "):
        layers.resolve_activation("t", "tanh", None)
    with pytest.raises(ValueError, match="without an activation"):
        layers.resolve_activation("t", None, ActivationParams.create("clamped_swiglu"))
    with pytest.raises(TypeError, match="recipe must be"):
        layers.check_recipe("t", "delayed")
