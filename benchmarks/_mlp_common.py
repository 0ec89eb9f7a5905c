"""What the MLP-step benchmarks share (``benchmarks/mlp.py``, ``benchmarks/ops.py``): the
Flax-native block, the step's loss, the input sets, the compiled step's peak memory and custom
calls, the command-line options of the timing method and the writing of the result."""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks._clocks import GpuClockLog
from benchmarks._report import OUT_DIR
from benchmarks._timing import time_functions

BLOCKS = {"gelu": ("gelu",), "swiglu": ("silu", "linear")}
GPU_SHAPE = {"tokens": 8192, "hidden": 4096, "gelu": 16384, "swiglu": 10944}
QUICK_SHAPE = {"tokens": 256, "hidden": 128, "gelu": 512, "swiglu": 336}


def flax_block(act: tuple[str, ...], inter: int, dot_general_cls=None):
    """The Flax-native block, written the way Flax users write it: ``nn.LayerNorm → nn.Dense →
    jax.nn activation → nn.Dense`` (SwiGLU: one ``nn.Dense`` to ``2·I`` split in two), float32
    parameters, bfloat16 computation; ``dot_general_cls`` in both Denses (e.g. Flax's
    ``nn.Fp8DotGeneralOp``, te_jax's ``te_jax.flax.DotGeneral``), or their default."""
    import flax.linen as nn

    dot = {} if dot_general_cls is None else {"dot_general_cls": dot_general_cls}

    class FlaxMLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.LayerNorm(dtype=jnp.bfloat16, epsilon=1e-6)(x)
            gated = len(act) == 2
            h = nn.Dense(inter * (2 if gated else 1), dtype=jnp.bfloat16, **dot)(h)
            if gated:
                a, b = jnp.split(h, 2, axis=-1)
                h = jax.nn.silu(a) * b
            else:
                h = jax.nn.gelu(h, approximate=True)
            return nn.Dense(x.shape[-1], dtype=jnp.bfloat16, **dot)(h)

    return FlaxMLP()


def step_loss(y, dy):
    """The step's loss, ``sum(y · dy)`` in float32: its gradient with respect to ``y`` is
    ``dy``, a standard-normal array (no FP8 underflow in the backward)."""
    return jnp.sum(y.astype(jnp.float32) * dy)


def value_and_grads(out):
    """``step(state, x, dy)``: ``step_loss(out(state, x), dy)`` and its gradients with respect
    to (state, x)."""

    # The loss value is returned too: without it XLA drops the second GEMM's forward, whose
    # output only the loss reads.
    def step(state, x, dy):
        return jax.value_and_grad(lambda s, x: step_loss(out(s, x), dy), (0, 1))(state, x)

    return step


def input_sets(rows: int, k: int, n: int, count: int, seed: int = 0) -> list[tuple]:
    """``count`` pairs ``(x (rows, k), dy (rows, n))``, standard normal, bfloat16."""
    rng = np.random.default_rng(seed)
    return [
        (
            jnp.asarray(rng.standard_normal((rows, k)), jnp.bfloat16),
            jnp.asarray(rng.standard_normal((rows, n)), jnp.bfloat16),
        )
        for _ in range(count)
    ]


def peak_bytes(compiled) -> int | None:
    """The compiled step's peak device memory: arguments + outputs + temporaries - aliased."""
    try:
        ma = compiled.memory_analysis()
        return int(
            ma.argument_size_in_bytes
            + ma.output_size_in_bytes
            + ma.temp_size_in_bytes
            - ma.alias_size_in_bytes
        )
    except Exception:  # noqa: BLE001 - a backend without the analysis
        return None


def custom_calls(text: str) -> str:
    """te_jax custom calls and cuBLAS(Lt) GEMM calls in the compiled step's HLO, counted."""
    names = re.findall(r'custom_call_target="([A-Za-z0-9_$]+)"', text)
    counts: dict[str, int] = {}
    for n in names:
        counts[n] = counts.get(n, 0) + 1
    return ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) or "(XLA only)"


def timed(fns: dict, sets, args) -> tuple[dict, GpuClockLog]:
    """``(timings, clocks)``: ``time_functions`` of ``fns`` over ``sets`` with the options'
    reps, sample length and settling, the GPU clock logged meanwhile."""
    with GpuClockLog() as clocks:
        timings = time_functions(
            fns,
            sets,
            reps=args.reps,
            target_s=args.target_ms / 1e3,
            settle_s=args.settle_ms / 1e3,
        )
    return timings, clocks


def row_record(row: str, t, clocks: GpuClockLog, flop: float) -> dict:
    """A timed row: median ms, spread, dispatch ms, the clocks while it ran, TFLOP/s."""
    return {
        "row": row,
        "ms": t.median_s * 1e3,
        "spread": t.spread,
        "dispatch_ms": t.dispatch_s * 1e3,
        "clocks": clocks.summary(t.windows),
        "tflops": flop / t.median_s / 1e12,
    }


def clock_cells(r: dict) -> str:
    """The row's median SM clock and board power while it was timed (``nvidia-smi``)."""
    c = r.get("clocks")
    return " | ".join(("", "") if not c else (f"{c['sm_mhz']:.0f}", f"{c['watts']:.0f}"))


def bar_panel(ax, rows: list[dict], colors: list[str], labels: list[str | None], title: str):
    """One plot panel: each row's ms per step as a bar, ``labels`` above the bars."""
    xs = range(len(rows))
    ax.bar(xs, [r["ms"] for r in rows], color=colors)
    for x, r, label in zip(xs, rows, labels, strict=True):
        if label:
            ax.text(x, r["ms"], label, ha="center", va="bottom", fontsize=7)
    ax.set_xticks(list(xs))
    ax.set_xticklabels([r["row"] for r in rows], rotation=40, ha="right", fontsize=8)
    ax.set_ylabel("ms / step")
    ax.set_title(title, fontsize=10)


def save_figure(plt, fig, path: str) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def add_step_args(p: argparse.ArgumentParser, rows: tuple[str, ...]) -> None:
    """The options of the step benchmarks: blocks, rows, shapes and the timing method."""
    p.add_argument("--blocks", default="gelu,swiglu", help="gelu, swiglu (default both)")
    p.add_argument("--rows", default=",".join(rows), help="rows to time (default all)")
    p.add_argument("--quick", action="store_true", help="tiny shapes, 3 samples")
    p.add_argument("--tokens", type=int, default=None)
    p.add_argument("--reps", type=int, default=None, help="samples per row (GPU 10, CPU 3)")
    p.add_argument(
        "--target-ms", type=float, default=None, help="one sample's length (GPU 500, CPU 100)"
    )
    p.add_argument(
        "--settle-ms",
        type=float,
        default=None,
        help="untimed run of the same row before each sample, so it is timed at its own "
        "sustained clock (GPU 500, CPU 0)",
    )
    p.add_argument(
        "--sets", type=int, default=2, help="input sets the calls rotate over (default 2)"
    )
    p.add_argument("--out", default=OUT_DIR, help="directory for .md / .json / .png")
    p.add_argument("--plot", action="store_true", help="also write a PNG bar chart")


def step_defaults(args) -> dict:
    """Fills the timing options left unset (GPU / CPU / ``--quick`` defaults) and returns the
    shape: ``GPU_SHAPE`` on a GPU, else (and under ``--quick``) ``QUICK_SHAPE``; ``--tokens``
    overrides the tokens."""
    gpu = jax.default_backend() == "gpu"
    shape = dict(GPU_SHAPE if gpu and not args.quick else QUICK_SHAPE)
    if args.tokens:
        shape["tokens"] = args.tokens
    args.reps = args.reps or (3 if args.quick or not gpu else 10)
    args.target_ms = args.target_ms or (20.0 if args.quick else 500.0 if gpu else 100.0)
    if args.settle_ms is None:
        args.settle_ms = 500.0 if gpu and not args.quick else 0.0
    return shape


def names(csv: str) -> list[str]:
    """The non-empty, stripped items of a comma-separated option."""
    return [r.strip() for r in csv.split(",") if r.strip()]


def run_meta(prog: str, argv: list[str] | None, args) -> dict:
    """The result's ``meta``: backend, device, versions, date, command and timing options."""
    return {
        "backend": jax.default_backend(),
        "device": jax.devices()[0].device_kind,
        "jax": jax.__version__,
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "command": f"python -m {prog} " + " ".join(argv or sys.argv[1:]),
        "reps": args.reps,
        "target_ms": args.target_ms,
        "settle_ms": args.settle_ms,
    }


def write_result(result: dict, args, name: str, markdown, plot, t0: float) -> list[str]:
    """Writes ``<out>/<name>_<backend>.json`` and ``.md`` (``markdown(result)``) and, with
    ``--plot``, ``.png`` (``plot(result, path)``); prints and returns the paths."""
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"{name}_{result['meta']['backend']}")
    with open(stem + ".json", "w") as f:
        json.dump(result, f, indent=1)
    with open(stem + ".md", "w") as f:
        f.write(markdown(result))
    written = [stem + ".md", stem + ".json"]
    if args.plot and plot(result, stem + ".png"):
        written.append(stem + ".png")
    print(f"wrote {', '.join(written)} (total {time.time() - t0:.0f} s)")
    return written


__all__ = [
    "BLOCKS",
    "GPU_SHAPE",
    "QUICK_SHAPE",
    "add_step_args",
    "bar_panel",
    "clock_cells",
    "custom_calls",
    "flax_block",
    "input_sets",
    "names",
    "peak_bytes",
    "row_record",
    "run_meta",
    "save_figure",
    "step_defaults",
    "step_loss",
    "timed",
    "value_and_grads",
    "write_result",
]
