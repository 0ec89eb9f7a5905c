"""A jitted chain of te_jax ops interleaved with jnp ops, for tests/test_command_buffer.py.

    python tests/scripts/command_buffer_chain.py OUT.npz

runs it once (XLA_FLAGS, set by the caller, choose dumps and command buffers) and saves the
outputs. Only elementwise jnp ops sit between the te_jax kernels (te_jax's GEMM picks its
cuBLASLt algorithm once per problem), so the result does not depend on autotuning or reduction
order: with command buffers on or off it must be the same bits.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np

import te_jax


@jax.jit
def mlp_chain(x, dz, w, b):  # x (N, 2, H), dz (N, H), w (H, H), b (H,)
    h = x * 1.5 + 0.25
    y = te_jax.act_lu(h, activation_type="swiglu", implementation="ffi")
    y = jnp.tanh(y) * 0.5 + y
    z = te_jax.act_lu(y, activation_type="gelu", implementation="ffi")
    z2 = z * x[:, 1, :] - 0.125
    dx, dbias = te_jax.quantize_dact_dbias(
        dz * z2, h, activation_type="swiglu", implementation="ffi"
    )
    dx = dx * 2.0 + 1.0
    dy = te_jax.dact_lu(jnp.sin(z2), y, activation_type="gelu", implementation="ffi")
    d = te_jax.dense(z2, w, b, "gelu", implementation="ffi")  # te_jax_gemm, GELU epilogue
    return z2, dx, dbias, jnp.exp(-jnp.abs(dy)), d * 0.5


def main(out_path: str) -> None:
    assert jax.default_backend() == "gpu", jax.default_backend()
    rng = np.random.default_rng(1234)
    x = jnp.asarray(rng.uniform(-3, 3, (256, 2, 384)), jnp.bfloat16)
    dz = jnp.asarray(rng.uniform(-2, 2, (256, 384)), jnp.bfloat16)
    w = jnp.asarray(rng.uniform(-0.1, 0.1, (384, 384)), jnp.bfloat16)
    b = jnp.asarray(rng.uniform(-1, 1, (384,)), jnp.bfloat16)
    outs = [mlp_chain(x, dz, w, b) for _ in range(3)]  # replays of the captured graph too
    first = [np.asarray(a) for a in outs[0]]
    for again in outs[1:]:
        for a, b in zip(first, again, strict=True):
            assert np.array_equal(a.view(np.uint16), np.asarray(b).view(np.uint16))
    np.savez(out_path, *[a.view(np.uint16) for a in first])


if __name__ == "__main__":
    main(sys.argv[1])
