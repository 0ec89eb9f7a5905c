"""The parameters of a Linear (and a Bias) before a gated activation: ``(in, 2, N)`` and
``(2, N)`` with the halves' own logical axis, as te_jax's modules store a gated kernel, so a
column-parallel split of N keeps each column's halves on one shard."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from te_jax import ops
from te_jax.sharding import ACT, EMBED, MLP

D, N = 8, 16


def _axes(var):
    return var.get_metadata().get("out_sharding")


@pytest.mark.parametrize("with_bias", [True, False])
def test_gated_kernel_and_bias_are_viewed_in_halves(with_bias):
    bias = (ops.Bias(2 * N, bias_axes=(MLP,)),) if with_bias else ()
    seq = ops.Sequential(
        ops.Linear(D, 2 * N, parallel_mode="column"),
        *bias,
        ops.Activation("swiglu"),
        rngs=nnx.Rngs(0),
    )
    kernel = seq.ops[0].kernel
    assert kernel[...].shape == (D, 2, N)
    assert _axes(kernel) == (EMBED, ACT, MLP)
    if with_bias:
        assert seq.ops[1].bias[...].shape == (2, N)
        assert _axes(seq.ops[1].bias) == (ACT, MLP)


def test_parameters_made_at_construction_keep_their_values():
    """A Linear and Bias given rngs make flat parameters; the Sequential views the same values
    (the first N columns the activation's first half)."""
    lin = ops.Linear(D, 2 * N, rngs=nnx.Rngs(3))
    bias = ops.Bias(2 * N, bias_init=nnx.initializers.normal(1.0), rngs=nnx.Rngs(4))
    flat_k, flat_b = np.asarray(lin.kernel[...]), np.asarray(bias.bias[...])
    assert flat_k.shape == (D, 2 * N)
    ops.Sequential(lin, bias, ops.Activation("geglu"))
    np.testing.assert_array_equal(np.asarray(lin.kernel[...]), flat_k.reshape(D, 2, N))
    np.testing.assert_array_equal(np.asarray(bias.bias[...]), flat_b.reshape(2, N))


def test_the_halves_are_the_activation_halves():
    """``swiglu(x · kernel)`` with the viewed kernel is ``silu(x · k[:, 0]) · (x · k[:, 1])``:
    the layout changes the parameter's shape, not the math."""
    seq = ops.Sequential(ops.Linear(D, 2 * N), ops.Activation("swiglu"), rngs=nnx.Rngs(0))
    # Small integers: every product and sum is exact in any GEMM precision (a GPU's TF32 too).
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.integers(-3, 4, (4, D)), jnp.float32)
    seq.ops[0].kernel[...] = jnp.asarray(rng.integers(-2, 3, (D, 2, N)), jnp.float32)
    k = seq.ops[0].kernel[...]
    want = nnx.silu(x @ k[:, 0]) * (x @ k[:, 1])
    np.testing.assert_allclose(np.asarray(seq(x)), np.asarray(want), rtol=1e-5, atol=1e-6)


def test_ungated_neighbours_keep_the_flat_kernel():
    seq = ops.Sequential(
        ops.Linear(D, 2 * N, parallel_mode="column"),
        ops.Bias(2 * N),
        ops.Activation("gelu"),
        rngs=nnx.Rngs(0),
    )
    assert seq.ops[0].kernel[...].shape == (D, 2 * N)
    assert _axes(seq.ops[0].kernel) == (EMBED, MLP)
    assert seq.ops[1].bias[...].shape == (2 * N,)
