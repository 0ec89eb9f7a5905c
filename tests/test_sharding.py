"""te_jax.sharding (MeshResource, the logical axis rules), and the sharded checks
(tests/sharded/*_checks.py) run on a CPU mesh of 8 devices, in
their own processes: the device count must be set before jax starts, and this process's jax has
started already. Small files share a process; a long file runs as several
(tests/sharded/conftest.py keeps one part of it in each: its tests' ``pytest.mark.part``, or
contiguous runs), which pytest-xdist spreads over its workers."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
# Each file: the fewest tests it holds (a file that collects fewer has lost some).
CHECK_FILES = {
    "sharded_checks.py": 20,
    "quantized_sharded_checks.py": 33,
    "gemm_sharded_checks.py": 20,
    "mlp_sharded_checks.py": 21,
    "ops_sharded_checks.py": 4,
}
# The processes: the files each runs, and its part of them (K of N). The small files share
# one (starting a process and importing jax and te_jax takes seconds); the quantized ops run
# in their own (every scaling mode's splits); the MLP steps, the slowest checks, are split
# over two (their file marks each test with its part: a family's rows, which share its
# unsharded steps, in one).
PROCESSES = [
    (("sharded_checks.py", "gemm_sharded_checks.py"), 0, 1),
    (("quantized_sharded_checks.py",), 0, 1),
    (("mlp_sharded_checks.py",), 0, 2),
    (("mlp_sharded_checks.py",), 1, 2),
    (("ops_sharded_checks.py",), 0, 1),
]


def _process_id(files, k, n):
    name = "+".join(f.removesuffix("_checks.py") for f in files)
    return name if n == 1 else f"{name}-{k + 1}of{n}"


@pytest.mark.long
@pytest.mark.parametrize("files, part, parts", PROCESSES, ids=[_process_id(*p) for p in PROCESSES])
def test_sharded_checks_pass_on_8_cpu_devices(tmp_path, files, part, parts):
    env = dict(os.environ)
    env["XLA_FLAGS"] = (
        env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()
    env["JAX_PLATFORMS"] = "cpu"  # the mesh is of CPU devices, on a GPU machine too
    env["TE_JAX_SHARDED_SUBPROCESS"] = "1"  # the checks fail rather than skip without 8 devices
    env["TE_JAX_CHECKS_PART"] = f"{part}/{parts}"
    env.pop("TE_JAX_IMPLEMENTATION", None)
    junit = tmp_path / "sharded.xml"
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        *(str(TESTS / "sharded" / f) for f in files),
        "-q",
        "-p",
        "no:cacheprovider",
        f"--junitxml={junit}",
        f"--rootdir={TESTS.parent}",
        "-o",
        "addopts=",
    ]
    proc = subprocess.run(
        cmd, cwd=TESTS.parent, env=env, capture_output=True, text=True, timeout=900
    )
    log = f"$ {' '.join(cmd)}\n{proc.stdout[-20000:]}\n{proc.stderr[-5000:]}"
    assert proc.returncode == 0, log
    suite = ET.parse(junit).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    summary = re.search(rf"te_jax part {part}/{parts}: collected (\d+), kept (\d+)", proc.stdout)
    assert summary, log
    collected, kept = map(int, summary.groups())
    assert collected >= sum(CHECK_FILES[f] for f in files), (collected, log)
    assert kept >= 1 and counts["tests"] == kept, (counts, kept, log)
    assert counts["failures"] == counts["errors"] == counts["skipped"] == 0, (counts, log)


# ---- te_jax.sharding: the mesh axes' roles ---------------------------------------------------


def test_logical_axis_names():
    """The constants spell the names te_jax's modules use; LOGICAL_AXES holds each once."""
    from te_jax import sharding

    names = (sharding.BATCH, sharding.LENGTH, sharding.EMBED, sharding.MLP, sharding.ACT)
    assert names == ("batch", "length", "embed", "mlp", "act")
    assert sharding.LOGICAL_AXES == names


def test_mesh_resource_rules():
    from te_jax.sharding import MeshResource

    rules = dict(MeshResource(fsdp_resource="data", tp_resource="tensor").logical_axis_rules())
    assert rules == {"batch": "data", "length": None, "embed": "data", "mlp": "tensor", "act": None}
    both = dict(MeshResource(dp_resource="replica", fsdp_resource="data").logical_axis_rules())
    assert both["batch"] == ("replica", "data") and both["embed"] == "data"
    assert dict(MeshResource().logical_axis_rules())["batch"] is None
    # TransformerEngine's tpsp_resource: tensor and sequence parallelism on one axis.
    tpsp = MeshResource(dp_resource="data", tpsp_resource="tensor")
    assert (tpsp.tp_resource, tpsp.sp_resource) == ("tensor", "tensor")
    assert dict(tpsp.logical_axis_rules())["length"] == "tensor"


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"dp_resource": "data", "fsdp_resource": "data"}, "same mesh axis"),
        ({"dp_resource": "data", "tp_resource": "data"}, "axis of its own"),
        ({"tp_resource": 3}, "mesh axis name"),
        ({"tpsp_resource": "t", "tp_resource": "u"}, "tp_resource='u' names another"),
        ({"cp_resource": "c"}, "no context parallelism"),
        ({"pp_resource": "p"}, "no pipeline parallelism"),
        ({"ep_resource": "e"}, "no expert parallelism"),
    ],
)
def test_mesh_resource_errors(kwargs, match):
    from te_jax.sharding import MeshResource

    with pytest.raises((TypeError, ValueError), match=match):
        MeshResource(**kwargs)


def test_check_mesh():
    import jax
    import numpy as np
    from jax.sharding import Mesh

    from te_jax.sharding import MeshResource

    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "tensor"))
    MeshResource(dp_resource="data", tp_resource="tensor").check_mesh(mesh)
    with pytest.raises(ValueError, match="not an axis of the mesh"):
        MeshResource(tp_resource="model").check_mesh(mesh)


def test_kernel_axes_are_checked():
    import jax.numpy as jnp

    import te_jax

    x, w = jnp.ones((4, 8), jnp.float32), jnp.ones((8, 16), jnp.float32)
    with pytest.raises(ValueError, match="kernel_axes must name each of the 2 axes"):
        te_jax.dense(x, w, kernel_axes=("embed",))
    assert te_jax.dense(x, w, kernel_axes=("embed", "mlp")).shape == (4, 16)
