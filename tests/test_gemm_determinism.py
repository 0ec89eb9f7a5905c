"""On a GPU: with ``TE_JAX_DETERMINISTIC=1`` te_jax's GEMMs give the same bits in every process.

By default the CUDA GEMM handler times cuBLASLt's candidate algorithms for problems of at least
2^30 multiply-adds and keeps the fastest, which can differ from one process to the next (and so
can the bits). The deterministic switch takes the heuristic's first choice untimed
(ffi/gemm/NOTES.md, "Deterministic GEMMs"). Each case runs one script in three fresh processes
at once, sharing the GPU, with shapes above that threshold, and compares the SHA-256 of every
output's bytes (and the updated delayed-scaling state): a bf16 dense with bias
and GELU (the GELU_AUX and DGELU + dbias epilogues) forward and backward, and an FP8 one under
delayed scaling. Only public API, so the script keeps working as the Python side changes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest

import te_jax

_ON_GPU = jax.default_backend() == "gpu" and te_jax.ffi_available("cuda")

pytestmark = [
    pytest.mark.long,
    pytest.mark.skipif(not _ON_GPU, reason="te_jax's GEMM kernels run on a GPU only"),
]

PROCESSES = 3

# One case per process: argv[1] is "bf16" or "fp8". Prints one JSON line: {name: sha256}.
_SCRIPT = r"""
import hashlib, json, sys

import jax
import jax.numpy as jnp
import numpy as np

import te_jax

case = sys.argv[1]
M = K = N = 4096  # 2^36 multiply-adds per GEMM: the default would time candidates
kx, kk, kb = jax.random.split(jax.random.PRNGKey(0), 3)
x = jax.random.normal(kx, (M, K), jnp.float32).astype(jnp.bfloat16)
kernel = (jax.random.normal(kk, (K, N), jnp.float32) / np.sqrt(K)).astype(jnp.bfloat16)
bias = (0.1 * jax.random.normal(kb, (N,), jnp.float32)).astype(jnp.bfloat16)

if case == "bf16":
    def loss(x, kernel, bias):
        y = te_jax.dense(x, kernel, bias, activation_type=("gelu",))
        return jnp.sum(jnp.square(y.astype(jnp.float32))), y

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))
    (l, y), grads = step(x, kernel, bias)
    outs = {"loss": l, "y": y, "dx": grads[0], "dkernel": grads[1], "dbias": grads[2]}
else:
    qs = te_jax.QuantizerSet.create(te_jax.recipe.DelayedScaling())

    def loss(x, kernel, bias, qs):
        y = te_jax.dense(x, kernel, bias, quantizer_set=qs)
        return jnp.sum(jnp.square(y.astype(jnp.float32))), y

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))
    (l, y), grads = step(x, kernel, bias, qs)
    outs = {"loss": l, "y": y, "dx": grads[0], "dkernel": grads[1], "dbias": grads[2]}
    for i, leaf in enumerate(jax.tree.leaves(grads[3])):  # the updated delayed-scaling state
        outs[f"qs{i}"] = leaf

outs = jax.block_until_ready(outs)
digest = {k: hashlib.sha256(np.asarray(v).tobytes()).hexdigest() for k, v in outs.items()}
digest["kernels_enabled"] = bool(te_jax.kernels_enabled())
print(json.dumps(digest))
"""


def _run(case: str) -> list[dict]:
    env = dict(os.environ)
    env["TE_JAX_DETERMINISTIC"] = "1"
    env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"  # the processes share the GPU
    env.pop("TE_JAX_IMPLEMENTATION", None)
    env.pop("TE_JAX_GEMM_CANDIDATES", None)  # the default candidate timing is what is switched off
    src = str(Path(te_jax.__file__).resolve().parent.parent)  # the te_jax this test imported
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _SCRIPT, case],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(PROCESSES)
    ]
    digests = []
    for i, proc in enumerate(procs):
        try:
            out, err = proc.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise
        assert proc.returncode == 0, f"{case} process {i}: {out[-3000:]}\n{err[-8000:]}"
        digests.append(json.loads(out.strip().splitlines()[-1]))
    return digests


@pytest.mark.parametrize("case", ["bf16", "fp8"])
def test_deterministic_gemms_repeat_bitwise_across_processes(case):
    digests = _run(case)
    assert all(d.pop("kernels_enabled") for d in digests), "te_jax's kernels were not used"
    first = digests[0]
    for i, d in enumerate(digests[1:], 1):
        differ = sorted(k for k in first if first[k] != d.get(k))
        assert not differ, f"{case}: process {i} differs from process 0 in {differ}"
