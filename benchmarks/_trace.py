"""GPU kernel traces of jitted steps: ``jax.profiler`` captures read back with ``ProfileData``.

- ``gpu_kernels(fn, steps)``: every kernel ``steps`` calls of ``fn()`` ran, per GPU, as
  ``(name, start_ns, duration_ns)``.
- ``kernel_breakdown(kernels, steps)``: per kernel name and per kind (GEMM, te_jax, XLA fusion,
  NCCL, other) the launches and milliseconds per step: where a step's device time goes.
- ``union`` / ``length`` / ``intersection``: interval arithmetic for overlap questions (NCCL
  against compute, benchmarks/scaling.py).
"""

from __future__ import annotations

import glob
import os
import tempfile
from collections.abc import Callable

import jax

Kernel = tuple[str, int, int]

# Kernel kinds by name (lower case); the first that matches wins.
KINDS = (
    ("nccl", ("nccl",)),
    ("gemm", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "matmul", "splitk")),
    ("te_jax", ("te_jax",)),
    ("xla_fusion", ("fusion", "triton", "reduce", "convert", "copy", "transpose")),
)


def gpu_kernels(fn: Callable, steps: int) -> dict[str, list[Kernel]]:
    """``{"/device:GPU:i": [(name, start_ns, duration_ns), ...]}``: the kernels of ``steps``
    calls of ``fn()`` after one untraced call (compilation); empty where no GPU ran. The
    profiler's start leaves the GPU idle, so the first traced steps run at burst clocks; a
    power-limited step reaches its sustained clocks only after many steps."""
    from jax.profiler import ProfileData

    jax.block_until_ready(fn())
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            out = None
            for _ in range(steps):
                out = fn()
            jax.block_until_ready(out)
        paths = glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)
        if not paths:
            return {}
        data = ProfileData.from_file(max(paths, key=os.path.getmtime))
    out: dict[str, list[Kernel]] = {}
    for plane in data.planes:
        if not plane.name.startswith("/device:GPU:"):
            continue
        out[plane.name] = [
            (e.name, int(e.start_ns), int(e.duration_ns))
            for line in plane.lines
            if line.name.startswith("Stream")
            for e in line.events
        ]
    return out


def kind(name: str) -> str:
    low = name.lower()
    return next((k for k, keys in KINDS if any(s in low for s in keys)), "other")


def kernel_breakdown(kernels: list[Kernel], steps: int, top: int = 12) -> dict:
    """Per step: ``busy_ms`` (union of the kernels' intervals), ``span_ms`` (first start to last
    end), ``by_kind`` ``{kind: {"ms", "launches"}}``, the ``top`` kernels by time, ``[{"name",
    "kind", "ms", "launches"}]``, and the longest idle ``gaps`` of the whole trace, ``[{"us",
    "after", "before"}]`` (the kernels either side)."""
    by_name: dict[str, list[float]] = {}
    for name, _, dur in kernels:
        row = by_name.setdefault(name, [0.0, 0])
        row[0] += dur / 1e6 / steps
        row[1] += 1 / steps
    by_kind: dict[str, dict] = {}
    for name, (ms, n) in by_name.items():
        k = by_kind.setdefault(kind(name), {"ms": 0.0, "launches": 0.0})
        k["ms"] += ms
        k["launches"] += n
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]
    ordered = sorted(kernels, key=lambda k: k[1])
    gaps, end, last = [], None, None
    for name, s, d in ordered:
        if end is not None and s > end:
            gaps.append({"us": (s - end) / 1e3, "after": last, "before": name})
        if end is None or s + d > end:
            end, last = s + d, name
    span = (end - ordered[0][1]) if ordered else 0
    return {
        "busy_ms": length(union([(s, s + d) for _, s, d in kernels])) / 1e6 / steps,
        "span_ms": span / 1e6 / steps,
        "gaps": sorted(gaps, key=lambda g: -g["us"])[:top],
        "by_kind": dict(sorted(by_kind.items(), key=lambda kv: -kv[1]["ms"])),
        "top": [{"name": n, "kind": kind(n), "ms": ms, "launches": c} for n, (ms, c) in ranked],
    }


def union(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The sorted, disjoint union of ``[start, end)`` intervals."""
    out: list[list[int]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def length(intervals) -> int:
    return sum(b - a for a, b in intervals)


def intersection(u: list[tuple[int, int]], v: list[tuple[int, int]]) -> int:
    """Total length of the overlap of two sorted, disjoint interval lists."""
    i = j = total = 0
    while i < len(u) and j < len(v):
        lo, hi = max(u[i][0], v[j][0]), min(u[i][1], v[j][1])
        total += max(0, hi - lo)
        if u[i][1] < v[j][1]:
            i += 1
        else:
            j += 1
    return total
