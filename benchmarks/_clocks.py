"""The GPU's SM clock and board power while rows are timed: ``nvidia-smi`` sampled in the
background, the samples attributed to each row by wall-clock windows.

A step held at the board's power limit runs at lower clocks than a burst does, so two rows'
times compare only at the clocks they actually ran at (benchmarks/README.md). ``GpuClockLog``
starts ``nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw -lms PERIOD`` for the GPU this
process uses (the first entry of ``CUDA_VISIBLE_DEVICES``, else GPU 0) and, on exit, parses its
samples; ``summary(windows)`` gives the median clock and power over the samples inside the given
``(start, end)`` wall-clock windows (``time.time()``). Where there is no ``nvidia-smi`` (the CPU)
everything is empty.
"""

from __future__ import annotations

import datetime
import os
import shutil
import statistics
import subprocess
import tempfile

_FORMAT = "%Y/%m/%d %H:%M:%S.%f"


def _gpu_index() -> str:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    return visible if visible.isdigit() else "0"


def parse(text: str) -> list[tuple[float, float, float]]:
    """``[(time.time() seconds, SM MHz, watts), ...]`` from ``nvidia-smi``'s CSV lines
    (``timestamp, clocks.sm, power.draw``, no header, no units); other lines are skipped."""
    out = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 3:
            continue
        try:
            t = datetime.datetime.strptime(parts[0], _FORMAT).timestamp()
            out.append((t, float(parts[1]), float(parts[2])))
        except ValueError:
            continue
    return out


class GpuClockLog:
    """Context manager: ``nvidia-smi`` samples every ``period_ms`` while the block runs."""

    def __init__(self, period_ms: int = 50):
        self.period_ms = period_ms
        self.samples: list[tuple[float, float, float]] = []
        self._proc = None
        self._file = None

    def __enter__(self) -> GpuClockLog:
        smi = shutil.which("nvidia-smi")
        if smi:
            self._file = tempfile.TemporaryFile(mode="w+")
            self._proc = subprocess.Popen(
                [
                    smi,
                    "--query-gpu=timestamp,clocks.sm,power.draw",
                    "--format=csv,noheader,nounits",
                    f"--loop-ms={self.period_ms}",
                    f"--id={_gpu_index()}",
                ],
                stdout=self._file,
                stderr=subprocess.DEVNULL,
            )
        return self

    def __exit__(self, *exc) -> None:
        if self._proc is None:
            return
        self._proc.terminate()
        try:
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
        self._file.seek(0)
        self.samples = parse(self._file.read())
        self._file.close()

    def summary(self, windows: list[tuple[float, float]]) -> dict | None:
        """``{"sm_mhz", "watts", "n"}``: medians over the samples inside ``windows``; ``None``
        without samples there."""
        inside = [(c, w) for t, c, w in self.samples if any(a <= t <= b for a, b in windows)]
        if not inside:
            return None
        return {
            "sm_mhz": statistics.median(c for c, _ in inside),
            "watts": statistics.median(w for _, w in inside),
            "n": len(inside),
        }
