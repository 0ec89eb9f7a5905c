"""te_jax.normalization.layernorm against float64 references and Flax's own norms: the forward,
its derivative rule (the tangent and the hand-written backward it transposes to) and second
order through it."""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import enable_x64
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


def _plain(x, gamma, beta, kind, zero_centered, eps):
    """The norm's formula in plain jnp (differentiated by JAX): the float64 reference."""
    if kind == "layernorm":
        x = x - jnp.mean(x, -1, keepdims=True)
    y = x / jnp.sqrt(jnp.mean(jnp.square(x), -1, keepdims=True) + eps)
    y = y * ((1.0 if zero_centered else 0.0) + gamma)
    return y if beta is None else y + beta


def _inputs(rng, kind, dtype):
    x = jnp.asarray((rng.standard_normal((3, 5, 64)) * 3 + 1), dtype)
    gamma = jnp.asarray(rng.standard_normal(64), jnp.float32)
    beta = jnp.asarray(rng.standard_normal(64), jnp.float32) if kind == "layernorm" else None
    dy = jnp.asarray(rng.standard_normal(x.shape), dtype)
    return x, gamma, beta, dy


def _float64(fn, *arrays):
    """``fn`` of the arrays in float64 (x64 on), as NumPy float64."""
    with enable_x64():
        args = [None if a is None else jnp.asarray(np.asarray(a, np.float64)) for a in arrays]
        return jax.tree.map(lambda a: np.asarray(a, np.float64), fn(*args))


def _close(got, want, dtype, what):
    """Within one rounding to ``dtype`` plus float32 arithmetic relative to the largest value."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, what
    tol = float(jnp.finfo(dtype).eps) * np.abs(want) + 2e-6 * np.abs(want).max()
    err = np.abs(got - want)
    assert (err <= tol).all(), f"{what}: worst error {err.max():.3g}"


@pytest.mark.parametrize("zero_centered", [False, True], ids=["gamma", "zero-centered"])
@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_backward_and_tangent_match_float64(kind, zero_centered, dtype, rng):
    """reverse mode (the hand-written backward: dx in x's dtype, dγ and dβ in the parameters'
    float32) and forward mode (the tangent) against JAX's derivatives of the formula in float64."""
    x, gamma, beta, dy = _inputs(rng, kind, dtype)
    opts = dict(layernorm_type=kind, zero_centered_gamma=zero_centered, epsilon=1e-5)

    def ours(x, g, b):
        return layernorm(x, g, b, **opts)

    def ref(x, g, b):
        return _plain(x, g, b, kind, zero_centered, 1e-5)

    y, vjp = jax.vjp(ours, x, gamma, beta)
    grads = jax.jit(vjp)(dy)
    want = _float64(lambda *a: jax.vjp(ref, *a[:3])[1](a[3]), x, gamma, beta, dy)
    for name, g, w in zip(("dx", "dgamma", "dbeta"), grads, want, strict=True):
        if w is None:
            assert g is None, name
            continue
        assert g.dtype == (dtype if name == "dx" else jnp.float32), name
        _close(g, w, dtype if name == "dx" else jnp.float32, name)

    # forward mode: ẏ for tangents of every input at once
    tx, tg = (jnp.asarray(rng.standard_normal(a.shape), a.dtype) for a in (x, gamma))
    tb = None if beta is None else jnp.asarray(rng.standard_normal(beta.shape), beta.dtype)
    _, y_dot = jax.jit(lambda *a: jax.jvp(ours, a[:3], a[3:]))(x, gamma, beta, tx, tg, tb)
    want_dot = _float64(lambda *a: jax.jvp(ref, a[:3], a[3:])[1], x, gamma, beta, tx, tg, tb)
    assert y_dot.dtype == dtype
    _close(y_dot, want_dot, dtype, "y_dot")


@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm"])
def test_second_order_and_vmap(kind, rng):
    """A Hessian-vector product (forward over reverse) and vmap of the gradient equal those of
    the plain formula (float32, the same math in another order)."""
    x, gamma, beta, dy = _inputs(rng, kind, jnp.float32)

    def loss(fn):
        return lambda x, g: jnp.sum(jnp.sin(fn(x, g)) * dy)

    ours = loss(lambda x, g: layernorm(x, g, beta, layernorm_type=kind, epsilon=1e-5))
    ref = loss(lambda x, g: _plain(x, g, beta, kind, False, 1e-5))
    v = (jnp.asarray(rng.standard_normal(x.shape), jnp.float32), gamma * 0.5)
    transforms = {
        "hvp": lambda f: jax.jvp(jax.grad(f, (0, 1)), (x, gamma), v)[1],
        "vmap-grad": lambda f: jax.vmap(jax.grad(f, (0, 1)), (0, None))(x, gamma),
    }
    for name, transform in transforms.items():
        got = jax.jit(functools.partial(transform, ours))()
        want = jax.jit(functools.partial(transform, ref))()
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_allclose(
                a, b, rtol=2e-4, atol=2e-4 * float(np.abs(b).max()), err_msg=name
            )
