"""LayerNormMLP's intermediate dropout (Linen ``te_jax.flax`` and NNX ``te_jax.nnx``): the keep
rate, the ``1/(1 − rate)`` rescale, ``intermediate_hidden_dropout_dims`` (one mask along those
axes), the backward dropping what the forward dropped, and no dropout when deterministic.

The block is made transparent so the mask can be read off its output: no norm, ReLU, both
kernels the identity (``I == H``) and a positive input, so the deterministic output is ``x``
itself and a training output is ``x / (1 − rate)`` where kept and exactly 0 where dropped.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import te_jax.flax as tef
from te_jax import nnx as tnnx

FAMILIES = ("linen", "nnx")
SHAPE = (8, 8, 512)  # (batch, length, hidden = intermediate)
RATES = (0.2, 0.5)
BROADCAST_DIMS = [(), (0,), (1,), (0, 1)]
SIGMAS = 5  # the keep-rate bound, in standard deviations of the binomial keep fraction


def _opts(rate, dims):
    return dict(
        activations="relu",
        enable_layernorm=False,
        use_bias=False,
        intermediate_dropout_rate=rate,
        intermediate_hidden_dropout_dims=dims,
    )


def _block(family, rate, dims, x):
    """``run(x, key, deterministic)`` → ``out`` of a transparent LayerNormMLP (identity
    kernels), and ``grad(x, key)`` → ``d/dx ½·Σ out²`` of a training step."""
    hidden = x.shape[-1]
    eye = jnp.eye(hidden, dtype=jnp.float32)
    if family == "linen":
        m = tef.LayerNormMLP(intermediate_dim=hidden, **_opts(rate, dims))
        keys = {"params": jax.random.key(0), "dropout": jax.random.key(1)}
        params = jax.jit(m.init)(keys, x)["params"]
        params = {**params, "wi_kernel": eye, "wo_kernel": eye}

        def run(x, key, deterministic=False):
            rngs = {} if key is None else {"dropout": key}
            return m.apply({"params": params}, x, deterministic, rngs=rngs)[0]

    else:
        rngs = nnx.Rngs(params=0, dropout=1)
        m = tnnx.LayerNormMLP(hidden, hidden, rngs=rngs, **_opts(rate, dims))
        m.wi_kernel[...] = eye
        m.wo_kernel[...] = eye
        graphdef, state = nnx.split(m)

        def run(x, key, deterministic=False):
            model = nnx.merge(graphdef, state)
            if key is not None:
                model.dropout.rngs = nnx.Rngs(dropout=key).dropout
            return model(x, deterministic=deterministic)[0]

    def grad(x, key):
        return jax.grad(lambda x: 0.5 * jnp.sum(jnp.square(run(x, key))))(x)

    @jax.jit
    def training(x, key):
        """One program: the deterministic output, a training output and its gradient, and the
        output under another key."""
        other = run(x, jax.random.fold_in(key, 1))
        return run(x, None, True), run(x, key), grad(x, key), other

    return jax.jit(run, static_argnums=2), training


def _x(rng):
    # positive, so ReLU passes it and a dropped element (exactly 0) is told from a kept one
    return jnp.asarray(rng.uniform(0.5, 2.0, SHAPE), jnp.float32)


# Pairwise: every broadcast-dims value in both families, each family and each dims value with
# both rates.
DROPOUT_CASES = [
    (family, rate, dims)
    for i, dims in enumerate(BROADCAST_DIMS)
    for family, rate in zip(FAMILIES, (RATES[i % 2], RATES[1 - i % 2]), strict=True)
]


@pytest.mark.parametrize(
    "family, rate, dims",
    DROPOUT_CASES,
    ids=[f"{f}-{r}-bcast{''.join(map(str, d))}" for f, r, d in DROPOUT_CASES],
)
def test_dropout_rate_rescale_and_broadcast_dims(family, rate, dims, rng):
    x = _x(rng)
    _, training = _block(family, rate, dims, x)
    x64 = np.asarray(x, np.float64)
    key = jax.random.key(int(rng.integers(1 << 30)))
    det, out, g, other = training(x, key)
    np.testing.assert_array_equal(np.asarray(det), np.asarray(x))  # transparent
    out = np.asarray(out, np.float64)
    kept = out != 0
    # rescale: every kept element is x / (1 − rate), one float32 rounding of it
    np.testing.assert_allclose(out[kept], x64[kept] / (1 - rate), rtol=2**-23, atol=0)

    # broadcast dims: one mask along each of them, a varying one along every other axis
    for axis in range(x.ndim):
        same = (kept == kept.take([0], axis=axis)).all()
        assert same == (axis in dims), f"axis {axis}: mask constant along it is {same}"

    # keep rate, over the independent mask elements only (index 0 of each broadcast axis)
    mask = kept[tuple(slice(0, 1) if a in dims else slice(None) for a in range(x.ndim))]
    n, keep = mask.size, 1 - rate
    bound = SIGMAS * np.sqrt(rate * (1 - rate) / n)
    assert bound < rate / 2, "too few mask elements to tell the rate from half of it"
    assert abs(mask.mean() - keep) < bound, (mask.mean(), keep, bound, n)

    # backward: the same elements dropped, the same rescale (½Σout² → out / (1 − rate))
    g = np.asarray(g, np.float64)
    np.testing.assert_array_equal(g == 0, ~kept)
    np.testing.assert_allclose(g[kept], out[kept] / (1 - rate), rtol=2**-22, atol=0)

    # another key drops other elements; the same key the same ones (another run)
    np.testing.assert_array_equal(np.asarray(training(x, key)[1]), out.astype(np.float32))
    assert (np.asarray(other) != 0).tolist() != kept.tolist()


@pytest.mark.parametrize("family", FAMILIES)
def test_deterministic_means_no_dropout(family, rng):
    """deterministic=True (and NNX's eval mode): the input through unchanged, no mask and no
    rescale, the gradient of ½Σout² equal to x."""
    x = _x(rng)
    run, _ = _block(family, 0.5, (), x)
    for key in (None, jax.random.key(3)):
        np.testing.assert_array_equal(np.asarray(run(x, key, True)), np.asarray(x))
    training = np.asarray(run(x, jax.random.key(3)))
    assert (training == 0).any() and (training != 0).any()
    if family == "nnx":
        m = tnnx.LayerNormMLP(512, 512, rngs=nnx.Rngs(params=0, dropout=1), **_opts(0.5, ()))
        m.wi_kernel[...] = m.wo_kernel[...] = jnp.eye(512, dtype=jnp.float32)
        call = nnx.jit(lambda m, x: m(x)[0])  # one program per mode, not op by op
        m.eval()
        np.testing.assert_array_equal(np.asarray(call(m, x)), np.asarray(x))
        m.train()
        assert (np.asarray(call(m, x)) == 0).any()
