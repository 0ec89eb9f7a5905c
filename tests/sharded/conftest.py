"""Runs one part of the check files: tests/test_sharding.py starts them as several processes
(TE_JAX_CHECKS_PART=K/N keeps the K-th of N parts of the collected tests), so that pytest-xdist
can run them side by side. Without the variable every test runs.

A part is the tests marked ``pytest.mark.part(K)`` where the files mark their tests (every test
then carries the mark: the rows that share an unsharded step stay in one process), else the
K-th of N contiguous runs of the collected tests.

The summary line ``te_jax part K/N: collected C, kept R`` lets the caller check that the whole
collection ran and that this part ran all it kept.
"""

from __future__ import annotations

import os

import pytest

PART_ENV = "TE_JAX_CHECKS_PART"


def pytest_configure(config):
    config.addinivalue_line("markers", "part(k): the process (TE_JAX_CHECKS_PART=k/N) it runs in")


def _part() -> tuple[int, int] | None:
    value = os.environ.get(PART_ENV)
    if not value:
        return None
    k, n = (int(v) for v in value.split("/"))
    if not 0 <= k < n:
        raise pytest.UsageError(f"{PART_ENV}={value}: want K/N with 0 <= K < N")
    return k, n


def part_bounds(k: int, n: int, total: int) -> tuple[int, int]:
    """[begin, end) of part k of n over total tests: contiguous runs, sizes differing by <= 1."""
    return k * total // n, (k + 1) * total // n


def _marked_parts(items, n: int) -> list[int] | None:
    """Each item's ``part`` mark, or None where no item has one."""
    marks = [item.get_closest_marker("part") for item in items]
    if not any(marks):
        return None
    unmarked = [item.nodeid for item, m in zip(items, marks, strict=True) if m is None]
    if unmarked:
        raise pytest.UsageError(f"part marks on some tests, not on {unmarked}")
    parts = [m.args[0] for m in marks]
    if set(parts) != set(range(n)):
        raise pytest.UsageError(f"tests marked with parts {sorted(set(parts))}, not 0..{n - 1}")
    return parts


def pytest_collection_modifyitems(config, items):
    part = _part()
    if part is None:
        return
    k, n = part
    parts = _marked_parts(items, n)
    if parts is None:
        begin, end = part_bounds(k, n, len(items))
        keep = set(range(begin, end))
    else:
        keep = {i for i, p in enumerate(parts) if p == k}
    config.stash[_COUNTS] = (len(items), len(keep))
    config.hook.pytest_deselected(items=[it for i, it in enumerate(items) if i not in keep])
    items[:] = [it for i, it in enumerate(items) if i in keep]


_COUNTS = pytest.StashKey[tuple[int, int]]()


def pytest_terminal_summary(terminalreporter, config):
    part = _part()
    if part is not None and _COUNTS in config.stash:
        collected, kept = config.stash[_COUNTS]
        terminalreporter.write_line(
            f"te_jax part {part[0]}/{part[1]}: collected {collected}, kept {kept}"
        )
