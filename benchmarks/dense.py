"""Times ``te_jax.dense`` (GEMM + bias + activation, bf16 and FP8) against what XLA does.

Usage::

    python -m benchmarks.dense                     # the two shapes (GPU), ~2 min on an H100
    python -m benchmarks.dense --quick             # tiny shapes, 3 samples (CPU smoke test)
    python -m benchmarks.dense --shapes 4096x4096x16384 --rows te:gelu,xla:gelu --plot

Shapes are ``M x K x N``: ``x (M, K) · w (K, N) + b (N,)`` in bfloat16 with float32 accumulation
(XLA's bf16 dot accumulates in float32 on the GPU, te_jax's GEMM always does). GPU defaults
``8192x4096x16384`` and ``8192x16384x4096``; CPU and ``--quick`` use tiny shapes.

Rows (all jitted; default XLA flags; every function takes one dict of inputs and XLA prunes what
it does not use). ``fwd`` rows are ``2·M·K·N`` FLOP, ``fwd+bwd`` rows ``6·M·K·N``:

=======================  ============================================================  ============
row                      computes                                                      baseline
=======================  ============================================================  ============
xla:dot                  ``x @ w``                                                     --
xla:dot+bias             ``x @ w + b``                                                 xla:dot
xla:gelu                 ``jax.nn.gelu(x @ w + b, approximate=True)``                  xla:dot
xla:fp8_dot              ``lax.dot_general(xq, wqᵀ)`` E4M3, TN, → bf16, unscaled       xla:dot
xla:fp8_dot_scaled       the same → float32 ``* (sx_inv·sw_inv)`` → bf16               xla:dot
xla:fp8_qdq              Flax-style QDQ: ``(xq·sx_inv) @ (wq·sw_inv)`` in bf16,        xla:dot
                         the kernel ``(K, N)`` as Flax stores it
te:dot                   ``dense(x, w)``                                               xla:dot
te:dot+bias              ``dense(x, w, b)``                                            xla:dot+bias
te:gelu                  ``dense(x, w, b, "gelu")``                                    xla:gelu
te:gelu_fp8_delayed      the same, ``QuantizerSet.create(DelayedScaling())``           xla:gelu
te:gelu_fp8_current      the same, ``CurrentScaling()``                                xla:gelu
te:dot_fp8_blockwise     ``matmul(xq, wq)`` (``te_jax.linear.matmul``): x and w        xla:dot
                         quantized beforehand (1×128 and 128×128 blocks,
                         ``Float8BlockScaling``'s), the GEMM alone
xla:gelu_vjp             ``jax.vjp`` of xla:gelu (x, w, b) → ``y, (dx, dw, db)``       --
te:gelu_vjp              ``jax.vjp`` of te:gelu (x, w, b)                              xla:gelu_vjp
te:gelu_vjp_fp8_delayed  ``jax.vjp`` of te:gelu_fp8_delayed (x, w, b, quantizer set)   xla:gelu_vjp
te:gelu_vjp_fp8_current  ``jax.vjp`` of te:gelu_fp8_current (x, w, b, quantizer set)   xla:gelu_vjp
te:gelu_vjp_fp8_block    the same with ``Float8BlockScaling()``                        xla:gelu_vjp
=======================  ============================================================  ============

The XLA FP8 rows take operands quantized beforehand (not timed) with power-of-two scales; the
te_jax FP8 rows quantize x and the kernel inside the op (timed: it is part of the op). Delayed
scaling runs in its steady state: the quantizer set is updated once with the inputs' amaxes
before anything is timed.

Per row: median time, TFLOP/s, speedup over its baseline (baseline time / row time), relative
error ‖out − ref‖/‖ref‖ against the XLA bf16 result of the same math (flagged above 3e-2 bf16,
1e-1 FP8; the unscaled FP8 dot is rescaled first), and from the compiled HLO: ``te_jax_gemm``
custom calls, ``tanh`` ops (a separate GELU), and transposes / layout copies of FP8 operands.
Timing: ``benchmarks/_timing.py`` (all rows of a shape interleaved, rotating over input sets).
The table goes to stdout, ``<out>/dense_<backend>.md`` and ``.json`` (rewritten after each
shape); ``--plot`` adds a PNG. The summary gives the project's published targets as PASS/FAIL (on
a GPU; INFO elsewhere). The exit code is 0 either way: it is a report.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import platform
import re
import sys
import time
import traceback
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from benchmarks import _report
from benchmarks._timing import Timing, time_functions
from benchmarks.activations import _loadavg, _max_rel_err, _random

BF16 = jnp.bfloat16
F32 = jnp.float32
E4M3 = jnp.float8_e4m3fn
E4M3_MAX = 448.0
TN = (((1,), (1,)), ((), ()))  # contract the last axis of both operands: the FP8 GEMM's form

GPU_SHAPES = ((8192, 4096, 16384), (8192, 16384, 4096))
GPU_QUICK_SHAPES = ((4096, 2048, 8192), (4096, 8192, 2048))
CPU_SHAPES = ((512, 256, 1024), (512, 1024, 256))
CPU_QUICK_SHAPES = ((128, 128, 512), (128, 512, 128))

TOLERANCE = {"bf16": 3e-2, "fp8": 1e-1}
TIMING_METHOD = (
    "host wall clock; per sample a loop of n_inner back-to-back async calls of the compiled "
    "function rotating over the input sets, then one block_until_ready, divided by n_inner "
    "(n_inner sized so a sample lasts ~target_s); all rows of a shape interleaved; median over "
    "reps samples after compile + one warm-up call per input set"
)


# ---------------------------------------------------------------------------------------------
# The rows.


@dataclasses.dataclass(frozen=True)
class Row:
    name: str
    impl: str  # "xla" or "te_jax"
    pass_: str  # "fwd" or "fwd+bwd"
    precision: str  # "bf16", "fp8", "fp8 delayed", "fp8 current", "fp8 blockwise"
    computes: str
    baseline: str | None
    ref: str | None  # the row whose output (on input set 0) this row is compared with
    gemms: int = 0  # te_jax_gemm custom calls expected where the CUDA kernels are on

    @property
    def fp8(self) -> bool:
        return self.precision.startswith("fp8")

    @property
    def flop_factor(self) -> int:
        return 2 if self.pass_ == "fwd" else 6


ROWS = (
    Row("xla:dot", "xla", "fwd", "bf16", "x @ w", None, None),
    Row("xla:dot+bias", "xla", "fwd", "bf16", "x @ w + b", "xla:dot", None),
    Row(
        "xla:gelu",
        "xla",
        "fwd",
        "bf16",
        "jax.nn.gelu(x @ w + b, approximate=True)",
        "xla:dot",
        None,
    ),
    Row(
        "xla:fp8_dot",
        "xla",
        "fwd",
        "fp8",
        "dot_general(e4m3, e4m3ᵀ) -> bf16, unscaled (TN)",
        "xla:dot",
        "xla:dot",
    ),
    Row(
        "xla:fp8_dot_scaled",
        "xla",
        "fwd",
        "fp8",
        "dot_general(e4m3, e4m3ᵀ) -> f32 * (sx_inv*sw_inv) -> bf16",
        "xla:dot",
        "xla:dot",
    ),
    Row(
        "xla:fp8_qdq",
        "xla",
        "fwd",
        "fp8",
        "Flax QDQ: (xq*sx_inv) @ (wq*sw_inv), bf16",
        "xla:dot",
        "xla:dot",
    ),
    Row("te:dot", "te_jax", "fwd", "bf16", "dense(x, w)", "xla:dot", "xla:dot", 1),
    Row(
        "te:dot+bias", "te_jax", "fwd", "bf16", "dense(x, w, b)", "xla:dot+bias", "xla:dot+bias", 1
    ),
    Row("te:gelu", "te_jax", "fwd", "bf16", 'dense(x, w, b, "gelu")', "xla:gelu", "xla:gelu", 1),
    Row(
        "te:gelu_fp8_delayed",
        "te_jax",
        "fwd",
        "fp8 delayed",
        'dense(x, w, b, "gelu", DelayedScaling)',
        "xla:gelu",
        "xla:gelu",
        1,
    ),
    Row(
        "te:gelu_fp8_current",
        "te_jax",
        "fwd",
        "fp8 current",
        'dense(x, w, b, "gelu", CurrentScaling)',
        "xla:gelu",
        "xla:gelu",
        1,
    ),
    Row(
        "te:dot_fp8_blockwise",
        "te_jax",
        "fwd",
        "fp8 blockwise",
        "matmul(xq, wq), blocks 1x128 / 128x128, quantized beforehand",
        "xla:dot",
        "xla:dot",
        1,
    ),
    Row(
        "xla:gelu_vjp", "xla", "fwd+bwd", "bf16", "jax.vjp(xla:gelu) -> y, (dx, dw, db)", None, None
    ),
    Row(
        "te:gelu_vjp",
        "te_jax",
        "fwd+bwd",
        "bf16",
        "jax.vjp(te:gelu) -> y, (dx, dw, db)",
        "xla:gelu_vjp",
        "xla:gelu_vjp",
        3,
    ),
    Row(
        "te:gelu_vjp_fp8_delayed",
        "te_jax",
        "fwd+bwd",
        "fp8 delayed",
        "jax.vjp(te:gelu_fp8_delayed) -> y, (dx, dw, db, new qs)",
        "xla:gelu_vjp",
        "xla:gelu_vjp",
        3,
    ),
    Row(
        "te:gelu_vjp_fp8_current",
        "te_jax",
        "fwd+bwd",
        "fp8 current",
        "jax.vjp(te:gelu_fp8_current) -> y, (dx, dw, db)",
        "xla:gelu_vjp",
        "xla:gelu_vjp",
        3,
    ),
    Row(
        "te:gelu_vjp_fp8_block",
        "te_jax",
        "fwd+bwd",
        "fp8 blockwise",
        "jax.vjp(te:gelu, Float8BlockScaling) -> y, (dx, dw, db)",
        "xla:gelu_vjp",
        "xla:gelu_vjp",
        3,
    ),
)
ROW_BY_NAME = {r.name: r for r in ROWS}


def _function(row: Row, te_jax, impl: str | None) -> Callable:
    """``f(inp) -> output`` for one row; ``inp`` is the dict made by ``_make_inputs``."""

    def xla_gelu(x, w, b):
        return jax.nn.gelu(x @ w + b, approximate=True)

    def te_gelu(x, w, b, qs=None):
        return te_jax.dense(x, w, b, "gelu", quantizer_set=qs, implementation=impl)

    qs_key = {
        "fp8 delayed": "qs_delayed",
        "fp8 current": "qs_current",
        "fp8 blockwise": "qs_blockwise",
    }.get(row.precision)
    n = row.name
    if n == "xla:dot":
        return lambda i: i["x"] @ i["w"]
    if n == "xla:dot+bias":
        return lambda i: i["x"] @ i["w"] + i["b"]
    if n == "xla:gelu":
        return lambda i: xla_gelu(i["x"], i["w"], i["b"])
    if n == "xla:fp8_dot":
        return lambda i: lax.dot_general(i["xq"], i["wq_t"], TN, preferred_element_type=BF16)
    if n == "xla:fp8_dot_scaled":
        return lambda i: (
            lax.dot_general(i["xq"], i["wq_t"], TN, preferred_element_type=F32)
            * (i["sx_inv"] * i["sw_inv"])
        ).astype(BF16)
    if n == "xla:fp8_qdq":
        # flax.linen.fp8_ops.dequantize: q.astype(dtype) * scale.astype(dtype), then the dot.
        return lambda i: (
            (i["xq"].astype(BF16) * i["sx_inv"].astype(BF16))
            @ (i["wq"].astype(BF16) * i["sw_inv"].astype(BF16))
        )
    if n == "te:dot":
        return lambda i: te_jax.dense(i["x"], i["w"], implementation=impl)
    if n == "te:dot+bias":
        return lambda i: te_jax.dense(i["x"], i["w"], i["b"], implementation=impl)
    if n in ("te:gelu", "te:gelu_fp8_delayed", "te:gelu_fp8_current"):
        return lambda i: te_gelu(i["x"], i["w"], i["b"], None if qs_key is None else i[qs_key])
    if n == "xla:gelu_vjp":

        def f(i):
            y, pull = jax.vjp(xla_gelu, i["x"], i["w"], i["b"])
            return y, pull(i["dy"])

        return f
    if n == "te:gelu_vjp":

        def f(i):
            y, pull = jax.vjp(te_gelu, i["x"], i["w"], i["b"])
            return y, pull(i["dy"])

        return f
    if n == "te:dot_fp8_blockwise":
        from te_jax.linear.matmul import matmul  # the GEMM of two ScaledTensors

        return lambda i: matmul(i["xq_block"], i["wq_block"], implementation=impl).out
    if n in ("te:gelu_vjp_fp8_delayed", "te:gelu_vjp_fp8_current", "te:gelu_vjp_fp8_block"):

        def f(i):
            y, pull = jax.vjp(te_gelu, i["x"], i["w"], i["b"], i[qs_key])
            dx, dw, db, new_qs = pull(i["dy"])
            return y, (dx, dw, db), new_qs

        return f
    raise ValueError(f"no function for row {n}")


def _comparable(row: Row, out, inp):
    """The part of ``out`` compared with the reference row's output."""
    if row.name == "xla:fp8_dot":  # unscaled: undo the (power-of-two) scales
        return out.astype(F32) * (inp["sx_inv"] * inp["sw_inv"])
    if row.pass_ == "fwd+bwd":
        return out[:2]  # (y, (dx, dw, db)); not the FP8 quantizer set's cotangent
    return out


# ---------------------------------------------------------------------------------------------
# Inputs.


def _pow2_quantize(a):
    """E4M3 copy of ``a`` with a power-of-two scale (so dequantizing is exact), and 1/scale."""
    amax = jnp.max(jnp.abs(a.astype(F32)))
    scale = jnp.exp2(jnp.floor(jnp.log2(E4M3_MAX / jnp.maximum(amax, 1e-30))))
    q = jnp.clip(a.astype(F32) * scale, -E4M3_MAX, E4M3_MAX).astype(E4M3)
    return q, (1.0 / scale).astype(F32)


@jax.jit
def _fp8_operands(x, w):
    xq, sx_inv = _pow2_quantize(x)
    wq, sw_inv = _pow2_quantize(w)
    return {"xq": xq, "wq": wq, "wq_t": wq.T, "sx_inv": sx_inv, "sw_inv": sw_inv}


def _block_operands(te_jax, x, w):
    """x (1×128 blocks, rowwise: the GEMM contracts its last axis) and w (128×128 blocks; its
    colwise copy, the transpose, is the one a GEMM contracting w's first axis reads), quantized
    as Float8BlockScaling's forward quantizes them."""
    q = te_jax.quantize
    layout = q.QuantizeLayout
    return {
        "xq_block": q.quantize(x, q.Float8Block1DQuantizer(q_layout=layout.ROWWISE)),
        "wq_block": q.quantize(w, q.Float8Block2DQuantizer(q_layout=layout.ROWWISE_COLWISE)),
    }


@jax.jit
def _warm_delayed(qs, x, w, dy):
    """Delayed scaling's steady state: each quantizer updated once with its tensor's amax (the
    gradient's, dh = dy·gelu'(h), taken as 1.2·max|dy|: gelu' <= 1.13)."""
    amax = lambda a: jnp.max(jnp.abs(a.astype(F32)))
    return type(qs)(
        x=qs.x.update(amax(x)),
        kernel=qs.kernel.update(amax(w)),
        grad=qs.grad.update(1.2 * amax(dy)),
    )


def _make_inputs(te_jax, shape, n_sets: int, seed: int, need_fp8: bool) -> list[dict]:
    """``n_sets`` independent input dicts. ``x`` triangular on [-8, 8], ``w`` uniform with
    ``|w| <= 0.5/sqrt(K)`` (so ``h = x·w`` has a standard deviation near 1: GELU's curved part),
    ``b`` uniform on [-0.5, 0.5), ``dy`` uniform on [-1, 1)."""
    m, k, n = shape
    for s in ((m, k), (k, n), (m, n)):
        if math.prod(s) >= 2**32:
            raise ValueError(f"shape {s} too large for the 32-bit index hash")
    sets = []
    for i in range(n_sets):
        s = np.uint32((seed * 7919 + i * 104729) % 2**32)
        inp = {
            "x": _random((m, k), BF16, s, "x"),
            "w": (_random((k, n), BF16, s + np.uint32(1), "dz") * (0.5 / math.sqrt(k))).astype(
                BF16
            ),
            "b": (_random((n,), BF16, s + np.uint32(2), "dz") * 0.5).astype(BF16),
            "dy": _random((m, n), BF16, s + np.uint32(3), "dz"),
        }
        if need_fp8:
            inp.update(_fp8_operands(inp["x"], inp["w"]))
            qs = te_jax.QuantizerSet.create(te_jax.recipe.DelayedScaling())
            inp["qs_delayed"] = _warm_delayed(qs, inp["x"], inp["w"], inp["dy"])
            inp["qs_current"] = te_jax.QuantizerSet.create(te_jax.recipe.CurrentScaling())
            inp["qs_blockwise"] = te_jax.QuantizerSet.create(te_jax.recipe.Float8BlockScaling())
            inp.update(_block_operands(te_jax, inp["x"], inp["w"]))
        sets.append(inp)
    jax.block_until_ready(sets)
    return sets


# ---------------------------------------------------------------------------------------------
# HLO inspection.

_LOWERED_GEMM = re.compile(r"custom_call @te_jax_gemm\w*\(|call_target_name = \"te_jax_gemm")
_COMPILED_GEMM = re.compile(r'custom_call_target="te_jax_gemm[^"]*"')
_TE_CALL = re.compile(r'custom_call_target="(te_jax_\w+)"')
_XLA_GEMM = re.compile(r'custom_call_target="(__cublas[^"]*)"|"kind":"(__triton[^"]*gemm[^"]*)"')
_TANH = re.compile(r"\btanh\(")
# An FP8 result produced by a transpose, or by a copy (XLA's layout-changing transpose).
_F8_MOVE = re.compile(r"=\s*f8e\w+\[[^\]]*\](?:\{[^}]*\})?\s+(transpose|copy)\(")


def _inspect(lowered_text: str, compiled_text: str | None) -> dict:
    info = {"te_jax_gemm_lowered": len(_LOWERED_GEMM.findall(lowered_text))}
    if compiled_text is None:
        info.update(te_jax_gemm=info["te_jax_gemm_lowered"], tanh=None, f8_transposes=None)
        return info
    te_calls: dict[str, int] = {}
    for t in _TE_CALL.findall(compiled_text):
        te_calls[t] = te_calls.get(t, 0) + 1
    xla_gemms: dict[str, int] = {}
    for a, b in _XLA_GEMM.findall(compiled_text):
        xla_gemms[a or b] = xla_gemms.get(a or b, 0) + 1
    moves = _F8_MOVE.findall(compiled_text)
    compiled_gemms = len(_COMPILED_GEMM.findall(compiled_text))
    info.update(
        te_jax_gemm_compiled=compiled_gemms,
        # Under custom_partitioning the call appears only after partitioning: take the larger.
        te_jax_gemm=max(compiled_gemms, info["te_jax_gemm_lowered"]),
        te_jax_calls=te_calls,
        xla_gemm_calls=xla_gemms,
        tanh=len(_TANH.findall(compiled_text)),
        f8_transposes=len(moves),
        f8_transpose_ops=sorted(set(moves)),
    )
    return info


# ---------------------------------------------------------------------------------------------
# Options.


def _parse_shapes(text: str) -> tuple[tuple[int, int, int], ...]:
    shapes = []
    for s in text.split(","):
        s = s.strip().lower()
        if not s:
            continue
        parts = s.split("x")
        if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise argparse.ArgumentTypeError(f"shape {s!r} is not MxKxN (e.g. 8192x4096x16384)")
        shapes.append(tuple(int(p) for p in parts))
    if not shapes:
        raise argparse.ArgumentTypeError("no shapes given")
    return tuple(shapes)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.dense",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--shapes",
        type=_parse_shapes,
        default=None,
        help="comma-separated MxKxN (default GPU "
        + ",".join("x".join(map(str, s)) for s in GPU_SHAPES)
        + "; CPU and --quick: tiny shapes)",
    )
    p.add_argument(
        "--rows",
        default="all",
        help="comma-separated substrings of row names (e.g. 'gelu' or 'te:dot'; each row's "
        "baseline comes along); rows: " + ", ".join(r.name for r in ROWS),
    )
    p.add_argument(
        "--reps",
        type=int,
        default=None,
        help="timed samples per row, median reported (default GPU 10, CPU 5; --quick 3)",
    )
    p.add_argument(
        "--target-ms",
        type=float,
        default=None,
        help="length of one sample in ms (default GPU 40, CPU 100; --quick 15 / 30)",
    )
    p.add_argument(
        "--settle-ms",
        type=float,
        default=0.0,
        help="untimed calls of the same row before each sample, so a power-limited GPU times it "
        "at its own sustained clock (benchmarks/_timing.py; default 0)",
    )
    p.add_argument("--sets", type=int, default=2, help="input sets rotated over (>= 2)")
    p.add_argument("--quick", action="store_true", help="small shapes, fewer samples")
    p.add_argument(
        "--implementation",
        default="auto",
        choices=["auto", "ffi", "xla"],
        help="te_jax.dense's implementation= ('auto' passes None: te_jax's kernels where "
        "there are some; default)",
    )
    p.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="stop starting new shapes (and skip timing) after this many seconds, so a "
        "time-limited run still writes its report (default GPU 210, else none)",
    )
    p.add_argument("--out", default=_report.OUT_DIR, help="output directory")
    p.add_argument("--plot", action="store_true", help="also write a PNG (needs matplotlib)")
    a = p.parse_args(argv)
    a.argv = list(sys.argv[1:] if argv is None else argv)

    a.backend = jax.default_backend()
    a.gpu = a.backend in ("gpu", "cuda", "rocm")
    if a.shapes is None:
        if a.gpu:
            a.shapes = GPU_QUICK_SHAPES if a.quick else GPU_SHAPES
        else:
            a.shapes = CPU_QUICK_SHAPES if a.quick else CPU_SHAPES
    if a.reps is None:
        a.reps = 3 if a.quick else (10 if a.gpu else 5)
    if a.target_ms is None:
        a.target_ms = (15.0 if a.gpu else 30.0) if a.quick else (40.0 if a.gpu else 100.0)
    if a.budget_s is None:
        a.budget_s = 210.0 if a.gpu else math.inf
    if a.sets < 2:
        p.error("--sets must be >= 2 (rotation keeps inputs out of L2)")
    if a.reps < 1:
        p.error("--reps must be >= 1")
    if a.rows == "all":
        a.row_list = list(ROWS)
    else:
        subs = [s.strip() for s in a.rows.split(",") if s.strip()]
        chosen = {r.name for r in ROWS if any(s in r.name for s in subs)}
        if not chosen:
            p.error(f"--rows {a.rows!r} matches no row; rows: {', '.join(r.name for r in ROWS)}")
        # Each chosen row brings its baseline and reference rows along.
        chosen |= {x for n in chosen for x in (ROW_BY_NAME[n].baseline, ROW_BY_NAME[n].ref) if x}
        a.row_list = [r for r in ROWS if r.name in chosen]
    a.impl = None if a.implementation == "auto" else a.implementation
    return a


# ---------------------------------------------------------------------------------------------
# One shape.


def _log(t0: float, msg: str) -> None:
    print(f"[{time.time() - t0:6.1f} s] {msg}", flush=True)


def _err_msg(e: BaseException) -> str:
    """The exception's first line, and its last where that differs (a wrapped traceback's
    first line is only "Traceback ...")."""
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
    msg = lines[0][:300] if lines else ""
    if len(lines) > 1:
        msg += f" ... {lines[-1][:300]}"
    return f"{type(e).__name__}: {msg}"


def run_shape(te_jax, args, shape, seed: int, t0: float) -> dict:
    m, k, n = shape
    tag = f"{m}x{k}x{n}"
    flop = 2 * m * k * n
    sec = {"shape": list(shape), "name": tag, "flop_fwd": flop, "rows": [], "errors": []}
    errors = sec["errors"]
    _log(t0, f"== shape {tag}: x ({m}, {k}) · w ({k}, {n}) + b ({n},), bfloat16 ==")
    rows = args.row_list
    try:
        sets = _make_inputs(te_jax, shape, args.sets, seed, any(r.fp8 for r in rows))
    except Exception as e:
        errors.append(f"{tag} inputs: {_err_msg(e)}")
        _log(t0, f"ERROR {errors[-1]}")
        return sec
    inp0 = (sets[0],)

    # Compile every row once; the compiled executable is what is timed.
    compiled: dict[str, Callable] = {}
    records: dict[str, dict] = {}
    for row in rows:
        if time.time() - t0 > args.budget_s:
            errors.append(f"{row.name} {tag}: not compiled, past the {args.budget_s:.0f} s budget")
            _log(t0, f"ERROR {errors[-1]}")
            continue
        rec = {
            "row": row.name,
            "where": f"{row.name} {tag}",
            "impl": row.impl,
            "pass": row.pass_,
            "precision": row.precision,
            "computes": row.computes,
            "shape": list(shape),
            "flop": row.flop_factor // 2 * flop,
            "baseline": row.baseline,
            "ref": row.ref,
            "tolerance": TOLERANCE["fp8" if row.fp8 else "bf16"],
            "expected_te_jax_gemm": row.gemms,
            "rel_err": None,
            "ms": None,
        }
        try:
            c0 = time.perf_counter()
            lowered = jax.jit(_function(row, te_jax, args.impl)).lower(*inp0)
            lowered_text = lowered.as_text()
            exe = lowered.compile()
            rec["compile_s"] = time.perf_counter() - c0
            try:
                compiled_text = exe.as_text()
            except Exception:
                compiled_text = None
            rec.update(_inspect(lowered_text, compiled_text))
            compiled[row.name] = exe
            del lowered, lowered_text, compiled_text
            _log(
                t0,
                f"compiled {row.name:26s} {rec['compile_s']:6.2f} s | te_jax_gemm "
                f"{rec['te_jax_gemm']} | tanh {rec.get('tanh')} | f8 transposes "
                f"{rec.get('f8_transposes')}",
            )
        except Exception as e:
            errors.append(f"{row.name} {tag} compile: {_err_msg(e)}")
            _log(t0, f"ERROR {errors[-1]}")
            if os.environ.get("BENCH_TRACEBACK"):
                traceback.print_exc()
        records[row.name] = rec

    # One run of each on input set 0: the correctness guard (and it weeds out rows that fail).
    refs: dict[str, object] = {}
    needed = {r.ref for r in rows if r.ref}
    for row in rows:
        if row.name not in compiled:
            continue
        try:
            out = compiled[row.name](*inp0)
            jax.block_until_ready(out)
            ref = refs.get(row.ref) if row.ref else None
            if ref is not None:
                records[row.name]["rel_err"] = _max_rel_err(_comparable(row, out, sets[0]), ref)
            if row.name in needed:
                refs[row.name] = _comparable(row, out, sets[0])
            del out
        except Exception as e:
            errors.append(f"{row.name} {tag} run: {_err_msg(e)}")
            _log(t0, f"ERROR {errors[-1]}")
            del compiled[row.name]
    del refs
    gc.collect()

    # Time all rows of the shape together (interleaved samples).
    timings: dict[str, Timing] = {}
    if time.time() - t0 > args.budget_s:
        errors.append(f"{tag}: timing skipped, past the {args.budget_s:.0f} s budget")
        _log(t0, f"ERROR {errors[-1]}")
    elif compiled:
        _log(t0, f"timing {len(compiled)} rows: {args.reps} samples of ~{args.target_ms:g} ms each")
        kw = {
            "reps": args.reps,
            "target_s": args.target_ms / 1e3,
            "settle_s": args.settle_ms / 1e3,
        }
        arg_sets = [(s,) for s in sets]
        try:
            timings = time_functions(compiled, arg_sets, **kw)
        except Exception as e:
            _log(t0, f"interleaved timing failed ({_err_msg(e)}); timing rows one by one")
            for name, fn in compiled.items():
                try:
                    timings[name] = time_functions({name: fn}, arg_sets, **kw)[name]
                except Exception as e1:
                    errors.append(f"{name} {tag} timing: {_err_msg(e1)}")
                    _log(t0, f"ERROR {errors[-1]}")
        del arg_sets

    for name, rec in records.items():
        t = timings.get(name)
        if t is None:
            continue
        rec.update(
            ms=t.median_s * 1e3,
            min_ms=t.min_s * 1e3,
            te_spread=t.spread,  # this row's spread (the key _report._within_spread reads)
            n_inner=t.n_inner,
            reps=t.reps,
            tflops=rec["flop"] / t.median_s / 1e12,
        )
    for rec in records.values():
        base = records.get(rec["baseline"]) if rec["baseline"] else None
        if rec["ms"] is not None and base is not None and base["ms"] is not None:
            rec["base_ms"] = base["ms"]
            rec["base_spread"] = base["te_spread"]
            rec["speedup"] = base["ms"] / rec["ms"]
        else:
            rec["speedup"] = None
    sec["rows"] = list(records.values())
    for rec in sec["rows"]:
        if rec["ms"] is not None:
            print("  " + _line(rec), flush=True)
    del compiled, sets, inp0
    gc.collect()
    return sec


# ---------------------------------------------------------------------------------------------
# Checks, Markdown, summary, plot.


def _ok_err(r: dict) -> bool:
    return r["rel_err"] is None or r["rel_err"] <= r["tolerance"]


def _rows(result: dict, name: str | None = None, timed: bool = True) -> list[dict]:
    return [
        r
        for s in result["sections"]
        for r in s["rows"]
        if (name is None or r["row"] == name) and (not timed or r["ms"] is not None)
    ]


def _ratio_to(result: dict, r: dict, other: str) -> float | None:
    """t(other row, same shape) / t(r)."""
    o = next((x for x in _rows(result, other) if x["shape"] == r["shape"]), None)
    return None if o is None else o["ms"] / r["ms"]


def _structural(name: str, rows: list[dict], bad: Callable[[dict], str | None]) -> dict:
    if not rows:
        return {"check": name, "status": "SKIP", "detail": "no rows (filtered out or failed)"}
    failing = [(r, why) for r in rows if (why := bad(r))]
    detail = f"{len(rows)} rows"
    if failing:
        detail += "; failing: " + ", ".join(f"{r['where']} ({why})" for r, why in failing[:8])
    return {"check": name, "status": "FAIL" if failing else "PASS", "detail": detail}


def checks(result: dict) -> list[dict]:
    gpu = result["meta"]["gpu"]
    kernels = result["meta"].get("cuda_kernels_on")
    spd = lambda r: r["speedup"]
    ratio_checks = [
        ("bf16 GEMM+bias+GELU fwd >= 1.05x XLA gelu(x@w+b)", "te:gelu", spd, 1.05, False),
        (
            "bf16 GEMM+bias+GELU fwd >= 0.97x te_jax's own plain GEMM (t(te:dot) / t(te:gelu))",
            "te:gelu",
            lambda r: _ratio_to(result, r, "te:dot"),
            0.97,
            False,
        ),
        ("plain bf16 GEMM >= 0.98x jnp.dot", "te:dot", spd, 0.98, True),
        (
            "FP8 delayed GEMM+bias+GELU fwd >= 1.7x XLA bf16 gelu(x@w+b)",
            "te:gelu_fp8_delayed",
            spd,
            1.7,
            False,
        ),
        (
            "FP8 current GEMM+bias+GELU fwd >= 1.7x XLA bf16 gelu(x@w+b)",
            "te:gelu_fp8_current",
            spd,
            1.7,
            False,
        ),
        ("FP8 blockwise GEMM alone >= 1.40x jnp.dot bf16", "te:dot_fp8_blockwise", spd, 1.4, False),
    ]
    out = []
    for name, row, value, target, noise in ratio_checks:
        rows = [r for r in _rows(result, row) if value(r) is not None]
        c = _report._check(name, rows, value, lambda v, t=target: v >= t, noise_note=noise)
        if not gpu and c["status"] != "SKIP":
            c["status"] = "INFO"
            c["detail"] += " (a GPU target; not judged on this backend)"
        out.append(c)

    te_rows = [
        r for r in _rows(result, timed=False) if r["impl"] == "te_jax" and "te_jax_gemm" in r
    ]
    if not gpu or not kernels:
        why = "not a GPU backend" if not gpu else "te_jax's CUDA kernels are not available"
        skip = "SKIP" if not gpu else "FAIL"
        for name in (
            "every te_jax row lowers to te_jax_gemm (fwd 1, fwd+bwd 3)",
            "bf16 GELU fwd: exactly one te_jax_gemm, no tanh (GELU in the epilogue)",
            "FP8 rows: no transpose of an FP8 operand",
        ):
            out.append({"check": name, "status": skip, "detail": why})
    else:
        out.append(
            _structural(
                "every te_jax row lowers to te_jax_gemm (fwd 1, fwd+bwd 3)",
                te_rows,
                lambda r: (
                    None
                    if r["te_jax_gemm"] == r["expected_te_jax_gemm"]
                    else f"{r['te_jax_gemm']} te_jax_gemm, expected {r['expected_te_jax_gemm']}"
                ),
            )
        )
        out.append(
            _structural(
                "bf16 GELU fwd: exactly one te_jax_gemm, no tanh (GELU in the epilogue)",
                [r for r in te_rows if r["row"] == "te:gelu"],
                lambda r: (
                    None
                    if r["te_jax_gemm"] == 1 and r.get("tanh") == 0
                    else f"{r['te_jax_gemm']} te_jax_gemm, {r.get('tanh')} tanh"
                ),
            )
        )
        out.append(
            _structural(
                "FP8 rows: no transpose of an FP8 operand",
                [r for r in te_rows if r["precision"].startswith("fp8")],
                lambda r: (
                    None
                    if r.get("f8_transposes") == 0
                    else f"{r.get('f8_transposes')} f8 transposes {r.get('f8_transpose_ops')}"
                ),
            )
        )
    out.append(
        _structural(
            "outputs match XLA's bf16 result (rel err <= 3e-2 bf16, 1e-1 FP8)",
            [r for r in _rows(result, timed=False) if r["rel_err"] is not None],
            lambda r: None if _ok_err(r) else f"{r['rel_err']:.2e} > {r['tolerance']:g}",
        )
    )
    return out


def _fmt(v, f: str, none: str = "") -> str:
    return none if v is None else format(v, f)


def _line(r: dict) -> str:
    sp = "" if r.get("speedup") is None else f"x{r['speedup']:.3f} vs {r['baseline']}"
    err = (
        "" if r["rel_err"] is None else f" | err {r['rel_err']:.1e}" + ("" if _ok_err(r) else " !")
    )
    return (
        f"{r['row']:26s} {r['pass']:7s} {r['precision']:11s} {_fmt(r['ms'], '9.3f')} ms "
        f"{_fmt(r.get('tflops'), '8.1f')} TFLOP/s | {sp:32s} | te_jax_gemm calls: "
        f"{r.get('te_jax_gemm')}{err}"
    )


def _table(sec: dict) -> str:
    head = (
        "| row | pass | precision | computes | ms | TFLOP/s | baseline | speedup | rel err | "
        "te_jax_gemm | tanh | f8 transposes | XLA GEMM calls | compile s |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in sec["rows"]:
        err = _fmt(r["rel_err"], ".1e") + ("" if _ok_err(r) else " **!**")
        xg = ", ".join(f"{k} {v}" for k, v in (r.get("xla_gemm_calls") or {}).items())
        lines.append(
            f"| {r['row']} | {r['pass']} | {r['precision']} | `{r['computes']}` | "
            f"{_fmt(r['ms'], '.3f', 'failed')} | {_fmt(r.get('tflops'), '.1f')} | "
            f"{r['baseline'] or ''} | {_fmt(r.get('speedup'), '.3f')} | {err} | "
            f"{_fmt(r.get('te_jax_gemm'), 'd')} | {_fmt(r.get('tanh'), 'd')} | "
            f"{_fmt(r.get('f8_transposes'), 'd')} | {xg} | {_fmt(r.get('compile_s'), '.1f')} |"
        )
    return "\n".join(lines)


def summary(result: dict) -> str:
    m = result["meta"]
    out = [f"== summary: te_jax.dense, {m['backend']} ({m['device_kind']}), {m['reps']} reps =="]
    for sec in result["sections"]:
        rows = [r for r in sec["rows"] if r["ms"] is not None]
        out.append(f"shape {sec['name']} (M x K x N): {len(rows)} rows timed")
        for r in rows:
            out.append("  " + _line(r))
        for e in sec["errors"][:10]:
            out.append(f"  ERROR {e}")
        if len(sec["errors"]) > 10:
            out.append(f"  ... and {len(sec['errors']) - 10} more errors (see the Markdown/JSON)")
    loads = [x for x in m.get("host_loadavg_1m_start_end") or [] if x is not None]
    if not m["gpu"] and loads and max(loads) > 0.5 * (m.get("host_cpus") or 1):
        out.append(
            f"WARNING: host load average {', '.join(f'{x:.1f}' for x in loads)} on "
            f"{m.get('host_cpus')} CPUs: CPU timings are noisy"
        )
    if m["gpu"] and not m.get("cuda_kernels_on"):
        out.append("WARNING: te_jax's CUDA kernels are off: the te_jax rows timed the XLA path")
    out.append(f"checks ({'GPU' if m['gpu'] else m['backend']}; the exit code is 0 either way):")
    for c in result.get("checks", []):
        out.append(f"  {c['status']:4s}  {c['check']}: {c['detail']}")
    return "\n".join(out)


def markdown(result: dict, with_summary: bool = True) -> str:
    m = result["meta"]
    parts = [
        f"# te_jax.dense benchmark: {m['backend']} ({m['device_kind']})",
        "",
        f"- date: {m['date']}; command: `{m['command']}`",
        f"- jax {m['jax']}, jaxlib {m.get('jaxlib')}, te_jax from `{m['te_jax_file']}`; "
        f"implementation={m['implementation']}; te_jax CUDA kernels on: "
        f"{m.get('cuda_kernels_on')}; XLA_FLAGS={m.get('xla_flags')!r}",
        f"- bfloat16 inputs, float32 accumulation; {m['input_sets']} input sets rotated; "
        f"{m['reps']} samples of ~{m['target_ms']:g} ms per row; wall {m.get('wall_s', 0):.0f} s",
        f"- timing: {m['timing_method']}",
        "- TFLOP/s: 2·M·K·N / t forward, 6·M·K·N / t forward + backward (the te_jax FP8 rows "
        "include quantizing x and the kernel); speedup: baseline time / row time; rel err: "
        "‖out − ref‖ / ‖ref‖ against the XLA bf16 row of the same math, **!** above tolerance; "
        "te_jax_gemm / tanh / f8 transposes: counts in the compiled HLO",
    ]
    if m.get("peak_bytes_in_use"):
        parts.append(f"- device memory peak: {m['peak_bytes_in_use'] / 2**30:.1f} GiB")
    for sec in result["sections"]:
        parts += ["", f"## {sec['name']} (M x K x N)", "", _table(sec)]
        if sec["errors"]:
            parts += ["", "Errors:", ""] + [f"- {e}" for e in sec["errors"]]
    if with_summary:
        parts += ["", "## Summary", "", "```", summary(result), "```", ""]
    return "\n".join(parts)


def plot(result: dict, path: str) -> str | None:
    """TFLOP/s per row, one panel per shape (te_jax vs XLA colours)."""
    secs = [s for s in result["sections"] if any(r["ms"] is not None for r in s["rows"])]
    if not secs:
        print("--plot: nothing to plot")
        return None
    plt = _report.pyplot()
    if plt is None:
        return None
    fig, axes = plt.subplots(1, len(secs), squeeze=False, figsize=(7 * len(secs), 6))
    for ax, sec in zip(axes[0], secs, strict=True):
        rows = [r for r in sec["rows"] if r["ms"] is not None][::-1]
        ys = range(len(rows))
        colors = ["tab:orange" if r["impl"] == "te_jax" else "tab:blue" for r in rows]
        ax.barh(list(ys), [r["tflops"] for r in rows], color=colors)
        ax.set_yticks(list(ys))
        ax.set_yticklabels([f"{r['row']}" for r in rows], fontsize=8)
        for y, r in zip(ys, rows, strict=True):
            if r.get("speedup") is not None:
                ax.text(r["tflops"], y, f" x{r['speedup']:.2f}", va="center", fontsize=7)
        ax.set_xlabel("TFLOP/s (fwd 2MKN, fwd+bwd 6MKN)")
        ax.set_title(f"{sec['name']} (M x K x N)", fontsize=10)
    m = result["meta"]
    fig.suptitle(
        f"te_jax.dense (orange) vs XLA (blue): {m['backend']} ({m['device_kind']}); "
        "labels: speedup over the row's baseline",
        fontsize=11,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------------------------


def _meta(te_jax, args, t_start: float) -> dict:
    dev = jax.devices()[0]
    meta = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "command": "python -m benchmarks.dense " + " ".join(args.argv),
        "backend": args.backend,
        "gpu": args.gpu,
        "device_kind": getattr(dev, "device_kind", str(dev)),
        "host": platform.node(),
        "host_cpus": os.cpu_count(),
        "python": platform.python_version(),
        "jax": jax.__version__,
        "jaxlib": None,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "te_jax_file": getattr(te_jax, "__file__", None),
        "te_jax_version": getattr(te_jax, "__version__", None),
        "implementation": args.implementation,
        "shapes": [list(s) for s in args.shapes],
        "rows": [r.name for r in args.row_list],
        "reps": args.reps,
        "target_ms": args.target_ms,
        "settle_ms": args.settle_ms,
        "input_sets": args.sets,
        "quick": args.quick,
        "budget_s": args.budget_s if math.isfinite(args.budget_s) else None,
        "timing_method": TIMING_METHOD,
        "wall_s": time.time() - t_start,
    }
    try:
        import jaxlib

        meta["jaxlib"] = jaxlib.__version__
    except Exception:
        pass
    try:
        meta["ffi_available_cpu"] = bool(te_jax.ffi_available("cpu"))
        meta["ffi_available_cuda"] = bool(te_jax.ffi_available("cuda"))
        # dense runs te_jax_gemm on the CUDA backend with the CUDA extension loaded.
        meta["cuda_kernels_on"] = (
            args.gpu
            and meta["ffi_available_cuda"]
            and args.implementation != "xla"
            and te_jax.kernels_enabled()
        )
    except Exception:
        meta["cuda_kernels_on"] = None
    try:
        stats = dev.memory_stats() or {}
        meta["peak_bytes_in_use"] = stats.get("peak_bytes_in_use")
    except Exception:
        pass
    return meta


def _write(te_jax, args, sections, t_start, load_start, final: bool) -> tuple[dict, list[str]]:
    result = {"meta": _meta(te_jax, args, t_start), "sections": sections}
    result["meta"]["host_loadavg_1m_start_end"] = [load_start, _loadavg() if final else None]
    result["meta"]["complete"] = final
    result["checks"] = checks(result)
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"dense_{args.backend}")
    with open(stem + ".md", "w") as f:
        f.write(markdown(result))
    with open(stem + ".json", "w") as f:
        json.dump(result, f, indent=1, default=str)
    return result, [stem + ".md", stem + ".json"]


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    t_start = time.time()
    load_start = _loadavg()
    import te_jax  # after parsing, so --help works without the extension

    print(
        f"te_jax.dense benchmark: backend {args.backend} ({jax.devices()[0].device_kind}), "
        f"shapes {', '.join('x'.join(map(str, s)) for s in args.shapes)}, "
        f"{len(args.row_list)} rows, reps {args.reps}, ~{args.target_ms:g} ms per sample, "
        f"{args.sets} input sets, implementation={args.implementation}",
        flush=True,
    )
    sections = []
    for i, shape in enumerate(args.shapes):
        if time.time() - t_start > args.budget_s:
            sections.append(
                {
                    "shape": list(shape),
                    "name": "x".join(map(str, shape)),
                    "rows": [],
                    "errors": [f"skipped: past the {args.budget_s:.0f} s budget"],
                }
            )
            continue
        try:
            sections.append(run_shape(te_jax, args, shape, seed=i + 1, t0=t_start))
        except Exception as e:  # a report: keep what the other shapes measured
            sections.append(
                {
                    "shape": list(shape),
                    "name": "x".join(map(str, shape)),
                    "rows": [],
                    "errors": [f"shape failed: {_err_msg(e)}"],
                }
            )
            traceback.print_exc()
        gc.collect()
        _write(te_jax, args, sections, t_start, load_start, final=False)  # partial results

    result, written = _write(te_jax, args, sections, t_start, load_start, final=True)
    print("\n" + markdown(result, with_summary=False))
    if args.plot:
        png = plot(result, os.path.join(args.out, f"dense_{args.backend}.png"))
        if png:
            written.append(png)
    print(summary(result))
    print(f"wrote {', '.join(written)}  (total {time.time() - t_start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
