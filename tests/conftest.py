"""pytest configuration: per-test random generators, the backend in the report header, the
``long`` tests first in the order (pytest-xdist then starts them early and fills in around them),
and on a CPU XLA compiling with little optimisation (``_compile_for_numbers``) into a compilation
cache the run's processes share (``_share_compiled_programs``).

The tests run unchanged on CPU (CI) and on a GPU: the backend is ``jax.default_backend()``.
The sharded checks (``tests/sharded/sharded_checks.py``) need 8 devices set up before jax
starts, so ``tests/test_sharding.py`` runs them in their own process; their file name keeps them
out of this collection, as does that of ``tests/scripts/command_buffer_chain.py``.
"""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
import zlib

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # float64_oracle, helpers

# pytest-xdist's workers share a GPU: none may reserve most of its memory up front (jax's default).
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


def _compile_for_numbers():
    """On a CPU the suite checks numbers and programs, not speed: XLA compiles with little
    optimisation (LLVM's expensive passes off; about a third less CPU time per test), and the
    processes the tests start (the 8-device checks, the examples) inherit it. A GPU run keeps
    XLA's defaults: its tests check the fused kernels. ``JAX_DISABLE_MOST_OPTIMIZATIONS=0``
    in the environment keeps them on a CPU too."""
    import jax

    if os.environ.get("JAX_DISABLE_MOST_OPTIMIZATIONS") is None and jax.default_backend() == "cpu":
        jax.config.update("jax_disable_most_optimizations", True)
        os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")


_compile_for_numbers()


def _share_compiled_programs():
    """On a CPU the run's processes (pytest-xdist's workers, the processes the 8-device checks
    and the examples start) share one persistent compilation cache: a program one of them
    compiled (an eager op, a module's init, a step that two tests build alike) the others load
    instead of compiling it again. A fresh directory per run, removed at its end: no run reuses
    another's programs. A ``JAX_COMPILATION_CACHE_DIR`` already in the environment (the run's,
    passed down to its processes, or the user's own) is kept."""
    import jax

    if os.environ.get("JAX_COMPILATION_CACHE_DIR") or jax.default_backend() != "cpu":
        return
    path = tempfile.mkdtemp(prefix="te_jax_test_programs_")
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    settings = {  # every program, however small or quick to compile (eager ops are both)
        "jax_compilation_cache_dir": path,
        "jax_persistent_cache_min_compile_time_secs": 0,
        "jax_persistent_cache_min_entry_size_bytes": 0,
    }
    for name, value in settings.items():
        jax.config.update(name, value)
        os.environ[name.upper()] = str(value)  # the processes started from here


_share_compiled_programs()


def pytest_report_header(config):
    import jax

    try:
        import te_jax

        avail = {p: te_jax.ffi_available(p) for p in ("cpu", "cuda")}
    except Exception as e:  # the import error is reported by the tests themselves
        avail = f"te_jax not importable: {e!r}"
    return [
        f"jax {jax.__version__}, backend {jax.default_backend()}, devices {jax.devices()}",
        f"te_jax ffi_available: {avail}",
    ]


def pytest_collection_modifyitems(config, items):
    """The tests marked ``long`` (the slowest) first, the rest in their order."""
    items.sort(key=lambda item: item.get_closest_marker("long") is None)


@pytest.fixture
def rng(request):
    """A generator seeded by the test's id: fresh inputs for each test, reproducible runs."""
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))
