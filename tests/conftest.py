"""pytest configuration: per-test random generators, the backend in the report header, and the
``long`` tests first in the order (pytest-xdist then starts them early and fills in around them).

The tests run unchanged on CPU (CI) and on a GPU: the backend is ``jax.default_backend()``.
The sharded checks (``tests/sharded/sharded_checks.py``) need 8 devices set up before jax
starts, so ``tests/test_sharding.py`` runs them in their own process; their file name keeps them
out of this collection, as does that of ``tests/scripts/command_buffer_chain.py``.
"""

from __future__ import annotations

import os
import sys
import zlib

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # float64_oracle, helpers

# pytest-xdist's workers share a GPU: none may reserve most of its memory up front (jax's default).
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


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
