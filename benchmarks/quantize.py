"""Times te_jax's fused quantized kernels against the XLA-native composites written in jax.numpy.

Usage::

    python -m benchmarks.quantize                    # 1 GiB per (M, H) operand, bfloat16
    python -m benchmarks.quantize --gib 0.0625 --reps 5 --only act   # a smaller CPU run

Rows (``H = --hidden``, ``M`` rows so that one ``(M, H)`` tensor of ``--dtype`` is ``--gib``):

- ``act``:        ``te_jax.act_lu(x, act, quantizer=q)``; composite:
                  ``activation_reference.act_lu`` then the quantization below.
- ``dact+dbias``: ``te_jax.quantize_dact_dbias(dz, x, act, is_dbias=True, quantizer=q)``;
                  composite: ``activation_reference.quantize_dact_dbias`` then the quantization.
- ``quantize``:   ``te_jax.quantize.quantize(x, q)``; composite: the quantization alone.

The composites are what a JAX user writes: tensor scaling ``amax = max|y|`` (current:
``scale = Q / amax``), ``clip(y · scale, ±Q).astype(fp8)``, colwise ``y.T``; MXFP8
``2^ceil(log2(block_amax / Q))`` per 32 values; NVFP4 ``S = 6·448 / amax``, E4M3 block scales per
16 values, E2M1 codes; blockwise FP8 ``2^floor(log2(Q / block_amax))`` per 1×128 block of each
copy (``block1d``: the colwise copy from ``y.T``) or per 128×128 tile (``block2d``), float32
``scale_inv`` (the shapes a multiple of 128, no padding). They are approximations of
docs/numerics.md's exact rules with the same memory traffic, which is what is timed.

Bytes counted (the minimum traffic): every input read once, every output written once (data,
block scales, blockwise FP8's float32 ones included; scalars ignored), plus one more read of the
inputs for the two-pass modes (current scaling, NVFP4), whose second pass recomputes ``y`` from
``x``. ``frac copy`` is the op's bandwidth over a device copy's (``jnp.copy`` of a uint32 array that
moves about the same bytes); the timing method is ``benchmarks/_timing.py``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import _report
from benchmarks._timing import check_copy_is_real, copy_elements, time_copy, time_functions
from benchmarks.activations import _lowers_to_te_kernel, _random

E4M3, E5M2, E2M1 = jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.float4_e2m1fn
Q_MAX = {np.dtype(E4M3): 448.0, np.dtype(E5M2): 57344.0, np.dtype(E2M1): 6.0}
ACTS = {"gelu": ("gelu",), "swiglu": ("silu", "linear")}


@dataclasses.dataclass(frozen=True)
class Case:
    op: str  # "act" | "dact+dbias" | "quantize"
    act: str | None
    mode: str  # "delayed" | "current" | "mxfp8" | "nvfp4" | "block1d" | "block2d"
    layout: str  # "rowwise" | "colwise" | "2x"
    q_dtype: object = E4M3
    frac_target: float | None = None
    speedup_target: float | None = None

    @property
    def name(self) -> str:
        act = f" {self.act}" if self.act else ""
        return f"{self.op}{act} {self.mode} {self.layout} {np.dtype(self.q_dtype).name}"

    @property
    def gated(self) -> bool:
        return self.act is not None and len(ACTS[self.act]) == 2

    @property
    def two_pass(self) -> bool:
        return self.mode in ("current", "nvfp4")


# The rows and their speedup targets over the XLA composite (the acceptance checks).
CASES = [
    *(Case("act", a, "delayed", "rowwise", E4M3, 0.85, 1.8) for a in ACTS),
    *(Case("act", a, "current", "rowwise", E4M3, None, 1.5) for a in ACTS),
    *(Case("act", a, "mxfp8", "2x", E4M3, None, 3.0) for a in ACTS),
    # The FP8 MLP step's forward activation: rowwise for the next GEMM, colwise for its wgrad.
    *(Case("act", "gelu", m, "2x", E4M3) for m in ("delayed", "current")),
    *(Case("act", a, "nvfp4", "rowwise", E2M1) for a in ACTS),
    *(
        Case("dact+dbias", a, m, "rowwise", E5M2, 0.80)
        for a in ACTS
        for m in ("delayed", "current")
    ),
    *(Case("dact+dbias", a, "mxfp8", "2x", E5M2) for a in ACTS),
    *(Case("quantize", None, m, "rowwise", E4M3, 0.85) for m in ("delayed", "current")),
    *(
        Case("quantize", None, m, lay, E4M3)
        for m in ("delayed", "current")
        for lay in ("colwise", "2x")
    ),
    *(Case("quantize", None, "mxfp8", lay, E4M3, 0.80) for lay in ("rowwise", "colwise", "2x")),
    *(Case("quantize", None, "nvfp4", lay, E2M1, 0.80) for lay in ("rowwise", "2x")),
    # Blockwise FP8 (Float8BlockScaling): the step's activations and gradients in 1x128 blocks,
    # both copies; the weights in 128x128 tiles.
    *(Case("act", a, "block1d", "2x", E4M3, 0.85) for a in ACTS),
    *(Case("dact+dbias", a, "block1d", "2x", E4M3, 0.85) for a in ACTS),
    *(Case("quantize", None, m, "2x", E4M3, 0.85) for m in ("block1d", "block2d")),
]


def _quantizer(case: Case):
    from te_jax.quantize import (
        CurrentScaleQuantizer,
        DelayedScaleQuantizer,
        Float8Block1DQuantizer,
        Float8Block2DQuantizer,
        MXFP8Quantizer,
        NVFP4Quantizer,
        QuantizeLayout,
    )

    layout = {
        "rowwise": QuantizeLayout.ROWWISE,
        "colwise": QuantizeLayout.COLWISE,
        "2x": QuantizeLayout.ROWWISE_COLWISE,
    }[case.layout]
    if case.mode == "delayed":
        q = DelayedScaleQuantizer.create(q_dtype=case.q_dtype, amax_history_len=16, q_layout=layout)
        return dataclasses.replace(q, scale=jnp.asarray(0.5, jnp.float32))
    cls = {
        "current": CurrentScaleQuantizer,
        "mxfp8": MXFP8Quantizer,
        "nvfp4": NVFP4Quantizer,
        "block1d": Float8Block1DQuantizer,
        "block2d": Float8Block2DQuantizer,
    }
    return cls[case.mode](case.q_dtype, layout)


# ---------------------------------------------------------------------------------------------
# The XLA composites: y (M, N) in the input dtype -> the quantized outputs.


def _tensor_composite(y, case: Case, scale):
    q_max = Q_MAX[np.dtype(case.q_dtype)]
    y32 = y.astype(jnp.float32)
    amax = jnp.max(jnp.abs(y32))
    if case.mode == "current":
        scale = jnp.where(amax > 0, q_max / amax, 1.0)
    q = jnp.clip(y32 * scale, -q_max, q_max).astype(case.q_dtype)
    out = {"amax": amax, "scale_inv": 1.0 / scale}
    if case.layout != "colwise":
        out["data"] = q
    if case.layout != "rowwise":
        out["colwise_data"] = q.T
    return out


def _blocks(y32, axis: int, size: int):
    m, n = y32.shape
    return y32.reshape(m, n // size, size) if axis == 1 else y32.reshape(m // size, size, n)


def _mxfp8_composite(y, case: Case):
    q_max = Q_MAX[np.dtype(case.q_dtype)]
    y32 = y.astype(jnp.float32)
    out = {}
    for key, axis in (("", 1), ("colwise_", 0)):
        if (axis == 1 and case.layout == "colwise") or (axis == 0 and case.layout == "rowwise"):
            continue
        b = _blocks(y32, axis, 32)
        red = 2 if axis == 1 else 1
        amax = jnp.max(jnp.abs(b), axis=red, keepdims=True)
        e = jnp.clip(jnp.ceil(jnp.log2(amax / q_max)), -127, 127)
        out[key + "data"] = jnp.clip(b * jnp.exp2(-e), -q_max, q_max).astype(case.q_dtype)
        out[key + "scale_inv"] = (e + 127).astype(jnp.uint8)
    return out


def _nvfp4_composite(y, case: Case):
    y32 = y.astype(jnp.float32)
    amax = jnp.max(jnp.abs(y32))
    s = jnp.where(amax > 0, 6.0 * 448.0 / amax, 1.0)
    out = {"amax": amax}
    for key, axis in (("", 1), ("colwise_", 0)):
        if axis == 0 and case.layout == "rowwise":
            continue
        b = _blocks(y32, axis, 16)
        red = 2 if axis == 1 else 1
        bs = (jnp.max(jnp.abs(b), axis=red, keepdims=True) / 6.0 * s).astype(E4M3)
        bs32 = bs.astype(jnp.float32)
        q = jnp.where(bs32 > 0, b * s / bs32, 0.0)
        out[key + "data"] = jnp.clip(q, -6.0, 6.0).astype(E2M1)
        out[key + "scale_inv"] = bs
    return out


def _fp8_block_composite(y, case: Case):
    q_max = Q_MAX[np.dtype(case.q_dtype)]
    y32 = y.astype(jnp.float32)
    m, n = y32.shape

    def scaled(amax):  # power-of-two scales (the recipe's default), 1 for an all-zero block
        scale = jnp.exp2(jnp.floor(jnp.log2(q_max / amax)))
        return jnp.where(amax > 0, scale, 1.0)

    out = {}
    if case.mode == "block2d":  # one tile scale for both copies
        t = y32.reshape(m // 128, 128, n // 128, 128)
        s = scaled(jnp.max(jnp.abs(t), axis=(1, 3), keepdims=True))
        q = jnp.clip(t * s, -q_max, q_max).astype(case.q_dtype).reshape(m, n)
        out.update(data=q, colwise_data=q.T, scale_inv=(1.0 / s).reshape(m // 128, n // 128))
        out["colwise_scale_inv"] = out["scale_inv"].T
        return out
    for key, copy in (("", y32), ("colwise_", y32.T)):  # 1x128 along each copy's rows
        r, c = copy.shape
        b = copy.reshape(r, c // 128, 128)
        s = scaled(jnp.max(jnp.abs(b), axis=2, keepdims=True))
        out[key + "data"] = jnp.clip(b * s, -q_max, q_max).astype(case.q_dtype).reshape(r, c)
        out[key + "scale_inv"] = (1.0 / s).reshape(r, c // 128).T
    return out


def _composite(y, case: Case):
    y2 = y.reshape(-1, y.shape[-1]) if y.ndim != 2 else y
    if case.mode in ("delayed", "current"):
        return _tensor_composite(y2, case, jnp.float32(0.5))
    if case.mode == "mxfp8":
        return _mxfp8_composite(y2, case)
    if case.mode in ("block1d", "block2d"):
        return _fp8_block_composite(y2, case)
    return _nvfp4_composite(y2, case)


def _functions(te_jax, case: Case) -> tuple[dict[str, Callable], Callable]:
    """({"te_jax": f, "xla": g}, make_args) for one case; f and g take the same arguments."""
    from te_jax import activation_reference

    q = _quantizer(case)
    act = ACTS.get(case.act)
    if case.op == "act":
        te = lambda x, q: te_jax.act_lu(x, act, quantizer=q)
        xla = lambda x, q: _composite(activation_reference.act_lu(x, act), case)
    elif case.op == "quantize":
        te = lambda x, q: te_jax.quantize.quantize(x, q)
        xla = lambda x, q: _composite(x, case)
    else:

        def te(dz, x, q):
            return te_jax.quantize_dact_dbias(dz, x, act, is_dbias=True, quantizer=q)

        def xla(dz, x, q):
            dx, dbias = activation_reference.quantize_dact_dbias(dz, x, act, True)
            return _composite(dx.reshape(dx.shape[0], -1), case), dbias

    return {"te_jax": jax.jit(te), "xla": jax.jit(xla)}, q


def _shapes(case: Case, m: int, h: int) -> list[tuple[tuple[int, ...], str]]:
    x = (m, 2, h) if case.gated else (m, h)
    if case.op == "dact+dbias":
        return [((m, h), "dz"), (x, "x")]
    return [(x, "x")]


def _bytes(case: Case, m: int, h: int, itemsize: int) -> int:
    """The minimum traffic (module doc)."""
    n_in = m * h * (2 if case.gated else 1)  # elements of x
    inputs = n_in * itemsize + (m * h * itemsize if case.op == "dact+dbias" else 0)
    n_out = n_in if case.op == "dact+dbias" else m * h  # elements of the quantized tensor
    per_copy = n_out // 2 if case.mode == "nvfp4" else n_out
    copies = 2 if case.layout == "2x" else 1
    scales = {
        "mxfp8": n_out // 32,
        "nvfp4": n_out // 16,
        "block1d": n_out // 128 * 4,
        "block2d": n_out // (128 * 128) * 4,
    }.get(case.mode, 0)
    out = copies * (per_copy + scales)
    if case.op == "dact+dbias":
        out += n_in // m * 4  # dbias, float32
    return inputs * (2 if case.two_pass else 1) + out


def run(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--gib", type=float, default=1.0, help="GiB per (M, H) operand (default 1)")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--target-ms", type=float, default=150.0, help="length of one sample")
    p.add_argument("--sets", type=int, default=2, help="input sets rotated over")
    p.add_argument("--only", default="", help="comma-separated substrings of row names")
    p.add_argument("--out", default=_report.OUT_DIR)
    args = p.parse_args(argv)

    import te_jax

    dtype = jnp.dtype(args.dtype)
    h = args.hidden
    m = max(32, int(args.gib * 2**30 // (h * dtype.itemsize)) // 32 * 32)
    cases = [c for c in CASES if not args.only or any(s in c.name for s in args.only.split(","))]
    ok, note = check_copy_is_real(copy_elements(2**24))
    meta = {
        "backend": jax.default_backend(),
        "device": str(jax.devices()[0].device_kind),
        "host": platform.node(),
        "jax": jax.__version__,
        "dtype": dtype.name,
        "M": m,
        "H": h,
        "gib_per_operand": m * h * dtype.itemsize / 2**30,
        "copy_check": note,
        "command": "python -m benchmarks.quantize "
        + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    print(
        f"# {meta['command']}\n# {meta['device']} ({meta['backend']}), jax {meta['jax']}; "
        f"M={m} H={h} {dtype.name}; copy: {note}",
        flush=True,
    )
    if not ok:
        raise SystemExit("the device copy is not a real copy; no ceiling to compare with")
    copies: dict[int, float] = {}
    rows = []
    for case in cases:
        fns, q = _functions(te_jax, case)
        shapes = _shapes(case, m, h)
        sets = [
            tuple(
                _random(s, dtype, jnp.uint32(10 * i + k), kind)
                for k, (s, kind) in enumerate(shapes)
            )
            + (q,)
            for i in range(args.sets)
        ]
        fused = _lowers_to_te_kernel(fns["te_jax"], sets[0])
        t = time_functions(fns, sets, reps=args.reps, target_s=args.target_ms / 1e3)
        del sets
        nbytes = _bytes(case, m, h, dtype.itemsize)
        n_copy = copy_elements(nbytes)
        if n_copy not in copies:
            tc = time_copy(n_copy, n_sets=args.sets, reps=args.reps, target_s=args.target_ms / 1e3)
            copies[n_copy] = 8 * n_copy / tc.median_s
        bw = nbytes / t["te_jax"].median_s
        row = {
            "case": case.name,
            "bytes": nbytes,
            "te_us": t["te_jax"].median_s * 1e6,
            "xla_us": t["xla"].median_s * 1e6,
            "te_spread": t["te_jax"].spread,
            "xla_spread": t["xla"].spread,
            "te_gbs": bw / 1e9,
            "copy_gbs": copies[n_copy] / 1e9,
            "te_frac_copy": bw / copies[n_copy],
            "xla_frac_copy": nbytes / t["xla"].median_s / copies[n_copy],
            "speedup": t["xla"].median_s / t["te_jax"].median_s,
            "fused_kernel": fused,
            "frac_target": case.frac_target,
            "speedup_target": case.speedup_target,
        }
        rows.append(row)
        print(_line(row), flush=True)
    result = {"meta": meta, "rows": rows}
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"quantize_{meta['backend']}")
    with open(stem + ".json", "w") as f:
        json.dump(result, f, indent=1)
    with open(stem + ".md", "w") as f:
        f.write(markdown(result))
    print(markdown(result))
    return result


def _verdict(row: dict) -> str:
    parts = []
    if row["frac_target"] is not None:
        ok = row["te_frac_copy"] >= row["frac_target"]
        parts.append(f"{'ok' if ok else 'MISS'} >= {row['frac_target']:.2f} copy")
    if row["speedup_target"] is not None:
        ok = row["speedup"] >= row["speedup_target"]
        parts.append(f"{'ok' if ok else 'MISS'} >= {row['speedup_target']:.1f}x")
    return "; ".join(parts)


def _line(r: dict) -> str:
    return (
        f"{r['case']:<40} te {r['te_us']:10.1f} us {r['te_gbs']:7.1f} GB/s "
        f"({r['te_frac_copy']:.2f} copy)  xla {r['xla_us']:10.1f} us ({r['xla_frac_copy']:.2f})  "
        f"x{r['speedup']:.2f}  {_verdict(r)}"
    )


def markdown(result: dict) -> str:
    meta = result["meta"]
    out = [
        f"`{meta['command']}` on {meta['device']} ({meta['backend']}), jax {meta['jax']}, "
        f"{meta['dtype']} M={meta['M']} H={meta['H']} ({meta['gib_per_operand']:.3g} GiB per "
        "(M, H) operand)",
        "",
        "| op | bytes | te_jax µs | GB/s | frac copy | XLA composite µs | XLA frac copy "
        "| speedup | target |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in result["rows"]:
        out.append(
            f"| {r['case']} | {r['bytes'] / 2**20:.0f} MiB | {r['te_us']:.1f} | {r['te_gbs']:.0f} "
            f"| {r['te_frac_copy']:.2f} | {r['xla_us']:.1f} | {r['xla_frac_copy']:.2f} "
            f"| {r['speedup']:.2f}x | {_verdict(r)} |"
        )
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    run()
