"""Runs the sharded checks (tests/sharded/*_checks.py) on a CPU mesh of 8 devices, in
their own process: the device count must be set before jax starts, and this process's jax has
started already."""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
# Each file and the fewest tests it holds (a file that collects fewer has lost some).
CHECK_FILES = {
    "sharded_checks.py": 20,
    "quantized_sharded_checks.py": 20,
    "gemm_sharded_checks.py": 20,
}


@pytest.mark.parametrize("checks", CHECK_FILES)
def test_sharded_checks_pass_on_8_cpu_devices(tmp_path, checks):
    checks_path = TESTS / "sharded" / checks
    env = dict(os.environ)
    env["XLA_FLAGS"] = (
        env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()
    env["JAX_PLATFORMS"] = "cpu"  # the mesh is of CPU devices, on a GPU machine too
    env["TE_JAX_SHARDED_SUBPROCESS"] = "1"  # the checks fail rather than skip without 8 devices
    env.pop("TE_JAX_IMPLEMENTATION", None)
    junit = tmp_path / "sharded.xml"
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        str(checks_path),
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
    assert counts["tests"] >= CHECK_FILES[checks] and counts["failures"] == counts["errors"] == 0, (
        counts,
        log,
    )
    assert counts["skipped"] == 0, (counts, log)
