"""Host-side timing of jitted JAX calls, and the device-copy ceiling.

Method:

- Every timed function is a ``jax.jit``-compiled callable. It is compiled and run once, then run
  once more on every input set (blocking after each) to estimate the time of one call.
- One *sample* is a loop of ``n_inner`` back-to-back calls, dispatched asynchronously and
  rotating over the input sets (call ``i`` uses set ``i % n_sets``, so consecutive calls never
  read the same buffers and nothing is served from L2), followed by a single
  ``block_until_ready`` on the last output; the sample is ``elapsed / n_inner``. All calls run in
  order on one stream, so the last output being ready means every call has finished.
  ``n_inner`` is chosen so one sample lasts about ``target_s`` (dispatch overhead is hidden
  behind the previous calls' device time whenever a call takes longer to run than to dispatch).
- Samples of the functions compared with each other are interleaved (te_jax sample, baseline
  sample, te_jax sample, ...), so clock or thermal drift hits both alike.
- ``settle_s`` > 0 runs the function untimed for that long before each of its samples. On a
  GPU held at its power limit, a short sample otherwise starts at the clock the *previous*
  function left behind, and a lighter or heavier neighbour biases it (benchmarks/README.md,
  "Timing a power-limited GPU"). Settled, every sample runs at its own function's sustained
  clock.
- The reported time is the median of ``reps`` samples; the spread is (max - min) / median.

The output of call ``i`` is dropped when call ``i + 1`` is dispatched: JAX frees device buffers
in stream order, so at most a couple of outputs are alive and a 1 GiB-per-operand run does not
grow its memory with ``n_inner``.
"""

from __future__ import annotations

import dataclasses
import math
import re
import statistics
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp


@dataclasses.dataclass
class Timing:
    median_s: float
    min_s: float
    max_s: float
    n_inner: int
    reps: int
    # Host time to dispatch one call (median over samples): when it nears ``median_s`` the host,
    # not the device, sets the pace (or each call waits for the one before).
    dispatch_s: float = 0.0
    # The samples' wall-clock windows (``time.time()``), to attribute clock readings to a row.
    windows: list[tuple[float, float]] = dataclasses.field(default_factory=list)

    @property
    def spread(self) -> float:
        return (self.max_s - self.min_s) / self.median_s if self.median_s > 0 else 0.0


def _sample(fn: Callable, arg_sets: Sequence[tuple], n_inner: int) -> tuple[float, float, tuple]:
    """``(seconds per call, host seconds per dispatch, (wall start, wall end))`` of one
    sample."""
    n_sets = len(arg_sets)
    wall = time.time()
    t0 = time.perf_counter()
    out = None
    for i in range(n_inner):
        out = fn(*arg_sets[i % n_sets])
    t1 = time.perf_counter()
    jax.block_until_ready(out)
    t2 = time.perf_counter()
    return (t2 - t0) / n_inner, (t1 - t0) / n_inner, (wall, wall + (t2 - t0))


def time_functions(
    fns: dict[str, Callable],
    arg_sets: Sequence[tuple],
    *,
    reps: int,
    target_s: float,
    max_inner: int = 2000,
    settle_s: float = 0.0,
) -> dict[str, Timing]:
    """Times each jitted ``fn(*args)`` over the rotating ``arg_sets``; samples interleaved, each
    after ``settle_s`` of untimed calls of the same function."""
    n_inner: dict[str, int] = {}
    for name, fn in fns.items():
        jax.block_until_ready(fn(*arg_sets[0]))  # compile + first run
        est = math.inf
        for args in arg_sets:
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            est = min(est, time.perf_counter() - t0)
        n_inner[name] = max(1, min(max_inner, math.ceil(target_s / max(est, 1e-7))))
    samples: dict[str, list[tuple]] = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            if settle_s > 0:
                _sample(fn, arg_sets, max(1, round(n_inner[name] * settle_s / target_s)))
            samples[name].append(_sample(fn, arg_sets, n_inner[name]))
    out = {}
    for name, got in samples.items():
        s = [t for t, _, _ in got]
        d = statistics.median(d for _, d, _ in got)
        w = [win for _, _, win in got]
        out[name] = Timing(statistics.median(s), min(s), max(s), n_inner[name], reps, d, w)
    return out


# ---------------------------------------------------------------------------------------------
# The copy ceiling.

_copy = jax.jit(jnp.copy)


def copy_elements(bytes_moved: int) -> int:
    """uint32 elements of a copy that moves about ``bytes_moved`` (half read, half written).

    The copied size is rounded to 1/32 of its power of two (at least 4 KiB), so ops whose byte
    counts differ only by a dbias share one copy; ratios are taken between bandwidths, so the
    rounding (< 1.6%) does not bias them.
    """
    half = bytes_moved / 2
    grain = max(4096, 2 ** (max(0, math.floor(math.log2(max(half, 1)))) - 5))
    return max(1, round(half / grain)) * grain // 4


def check_copy_is_real(n_elements: int) -> tuple[bool, str]:
    """Whether XLA really copies: a new output buffer holding the input's values.

    Returns ``(ok, note)``; the note also says whether the compiled HLO holds a ``copy``.
    """
    x = jax.random.bits(jax.random.key(999), (n_elements,), jnp.uint32)
    hlo = _copy.lower(x).compile().as_text()
    y = _copy(x)
    aliased = y.unsafe_buffer_pointer() == x.unsafe_buffer_pointer()
    equal = bool(jnp.array_equal(x, y))
    has_copy = re.search(r"\bcopy(-start)?\(", hlo) is not None
    note = (
        f"output {'ALIASES' if aliased else 'is a new buffer, not aliasing'} the input; "
        f"values {'equal' if equal else 'DIFFER'}; compiled HLO "
        f"{'has a copy instruction' if has_copy else 'has NO copy instruction'}"
    )
    return (not aliased and equal), note


def time_copy(n_elements: int, *, n_sets: int, reps: int, target_s: float) -> Timing:
    """Times ``jnp.copy`` of a uint32 array of ``n_elements``, rotating over ``n_sets`` inputs."""
    sets = [
        (jax.random.bits(jax.random.key(1000 + i), (n_elements,), jnp.uint32),)
        for i in range(n_sets)
    ]
    try:
        return time_functions({"copy": _copy}, sets, reps=reps, target_s=target_s)["copy"]
    finally:
        del sets
