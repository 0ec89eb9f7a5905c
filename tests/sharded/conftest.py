"""Runs one part of a check file: tests/test_sharding.py starts each file as several processes
(TE_JAX_CHECKS_PART=K/N keeps the K-th of N contiguous runs of the collected tests), so that
pytest-xdist can run them side by side. Without the variable every test runs.

The summary line ``te_jax part K/N: collected C, kept R`` lets the caller check that the whole
file was collected and that this part ran all it kept.
"""

from __future__ import annotations

import os

import pytest

PART_ENV = "TE_JAX_CHECKS_PART"


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


def pytest_collection_modifyitems(config, items):
    part = _part()
    if part is None:
        return
    begin, end = part_bounds(*part, len(items))
    config.stash[_COUNTS] = (len(items), end - begin)
    config.hook.pytest_deselected(items=items[:begin] + items[end:])
    items[:] = items[begin:end]


_COUNTS = pytest.StashKey[tuple[int, int]]()


def pytest_terminal_summary(terminalreporter, config):
    part = _part()
    if part is not None and _COUNTS in config.stash:
        collected, kept = config.stash[_COUNTS]
        terminalreporter.write_line(
            f"te_jax part {part[0]}/{part[1]}: collected {collected}, kept {kept}"
        )
