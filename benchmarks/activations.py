"""Times every te_jax activation op against its XLA-native equivalent on the current backend.

Usage::

    python -m benchmarks.activations                 # full table, 1 GiB per operand on a GPU
    python -m benchmarks.activations --quick         # fewer repeats, smaller operands
    python -m benchmarks.activations --acts gelu,swiglu --dtypes bfloat16 --small --plot

Ops, for every activation type and dtype:

- ``fwd``:        ``te_jax.act_lu(x, act)`` vs ``jax.jit(te_jax.activation_reference.act_lu)``;
                  exact GELU (and exact GeGLU) also vs ``jax.nn.gelu(x, approximate=False)``.
- ``dact``:       ``te_jax.dact_lu(dz, x, act)`` vs ``jax.vjp`` of the reference forward.
- ``dact+dbias``: ``te_jax.quantize_dact_dbias(dz, x, act, is_dbias=True)`` vs ``jax.vjp`` of
                  the reference forward + a float32 sum over the leading axes.
- ``copy``:       the ceiling, ``jnp.copy`` of an array whose read + write equals an op's bytes.

Shapes: ``M`` rows of ``H`` features with each ``(M, H)`` tensor of ``--gib`` GiB: ``x`` is
``(M, H)``, or ``(M, 2, H)`` (twice that) for gated types, ``dz`` and ``y`` are ``(M, H)``. Bytes
moved = every input read once + every output written once, from the arrays' real sizes; the
formula per op is in the JSON. The timing method is in ``benchmarks/_timing.py``. The table goes
to stdout, ``<out>/activations_<backend>.md`` and ``.json``; ``--plot`` adds a PNG.
"""

from __future__ import annotations

import argparse
import functools
import gc
import importlib
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

from benchmarks import _report
from benchmarks._timing import Timing, check_copy_is_real, copy_elements, time_copy, time_functions

ACTIVATIONS: dict[str, tuple[str, ...]] = {
    "gelu": ("gelu",),
    "geglu": ("gelu", "linear"),
    "glu": ("sigmoid", "linear"),
    "silu": ("silu",),
    "swiglu": ("silu", "linear"),
    "relu": ("relu",),
    "reglu": ("relu", "linear"),
    "quick_gelu": ("quick_gelu",),
    "qgeglu": ("quick_gelu", "linear"),
    "squared_relu": ("squared_relu",),
    "sreglu": ("squared_relu", "linear"),
    "clamped_swiglu": ("clamped_silu", "clamped_linear"),
    "gelu_exact": ("gelu_exact",),
    "geglu_exact": ("gelu_exact", "linear"),
}
OPS = ("fwd", "dact", "dact+dbias")
BYTES_FORMULA = {
    "fwd": "x + y = (G + 1)·M·H·itemsize   (G = 2 gated, 1 otherwise)",
    "dact": "dz + x + dx = (1 + 2G)·M·H·itemsize",
    "dact+dbias": "dz + x + dx + dbias = (1 + 2G)·M·H·itemsize + G·H·itemsize",
    "copy": "2·N·4 (a uint32 array of N elements read once and written once)",
}
TIMING_METHOD = (
    "host wall clock; per sample a loop of n_inner back-to-back async calls of the jitted "
    "function rotating over the input sets, then one block_until_ready, divided by n_inner "
    "(n_inner sized so a sample lasts ~target_s); te_jax and baseline samples interleaved; "
    "median over reps samples after compile + one warm-up call per input set"
)


# ---------------------------------------------------------------------------------------------
# Options.


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.activations",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--gib",
        type=float,
        default=None,
        help="GiB per (M, H) operand; gated x is twice that (default: 1.0 on GPU, "
        "1/64 = 16 MiB on CPU; --quick: 0.25 / 1/256)",
    )
    p.add_argument("--hidden", type=int, default=4096, help="H, the feature axis (default 4096)")
    p.add_argument("--dtypes", default="bfloat16,float32", help="comma-separated dtypes")
    p.add_argument(
        "--acts", default="all", help=f"comma-separated subset of: {', '.join(ACTIVATIONS)}"
    )
    p.add_argument(
        "--ops", default=",".join(OPS), help="comma-separated subset of: fwd,dact,dact+dbias"
    )
    p.add_argument(
        "--reps",
        type=int,
        default=None,
        help="timed samples per function, median reported (default GPU 10, CPU 5; --quick 3)",
    )
    p.add_argument(
        "--target-ms",
        type=float,
        default=None,
        help="length of one sample in ms: sets the calls per sample (default GPU 25, "
        "CPU 100; --quick: 8 / 30)",
    )
    p.add_argument("--sets", type=int, default=2, help="input sets rotated over (>= 2)")
    p.add_argument(
        "--small",
        action="store_true",
        help="also time a small, launch-bound case (--small-kib per operand), "
        "reported in its own table",
    )
    p.add_argument("--small-only", action="store_true", help="only the small case")
    p.add_argument("--small-kib", type=float, default=64.0, help="KiB per operand, small case")
    p.add_argument("--small-hidden", type=int, default=1024, help="H for the small case")
    p.add_argument("--quick", action="store_true", help="fewer repeats, smaller operands")
    p.add_argument(
        "--implementation",
        default="ffi",
        choices=["ffi", "auto"],
        help="te_jax implementation= argument ('auto' passes None; default 'ffi')",
    )
    p.add_argument(
        "--no-check",
        action="store_true",
        help="skip comparing te_jax's outputs with the baseline's",
    )
    p.add_argument(
        "--module",
        default="te_jax",
        help="the package to benchmark (default te_jax; another build or a stand-in "
        "with the same API)",
    )
    p.add_argument("--out", default=_report.OUT_DIR, help="output directory")
    p.add_argument("--plot", action="store_true", help="also write a PNG (needs matplotlib)")
    a = p.parse_args(argv)

    a.backend = jax.default_backend()
    gpu = a.backend in ("gpu", "cuda", "rocm")
    if a.gib is None:
        a.gib = (0.25 if gpu else 1 / 256) if a.quick else (1.0 if gpu else 1 / 64)
    if a.reps is None:
        a.reps = 3 if a.quick else (10 if gpu else 5)
    if a.target_ms is None:
        a.target_ms = (8.0 if gpu else 30.0) if a.quick else (25.0 if gpu else 100.0)
    if a.sets < 2:
        p.error("--sets must be >= 2 (rotation keeps inputs out of L2)")
    a.dtype_list = [s.strip() for s in a.dtypes.split(",") if s.strip()]
    for d in a.dtype_list:
        if d not in ("bfloat16", "float32", "float16"):
            p.error(f"unsupported dtype {d!r}")
    if a.acts == "all":
        a.act_list = list(ACTIVATIONS)
    else:
        a.act_list = [s.strip() for s in a.acts.split(",") if s.strip()]
        bad = [s for s in a.act_list if s not in ACTIVATIONS]
        if bad:
            p.error(f"unknown activation(s) {bad}; valid: {', '.join(ACTIVATIONS)}")
    a.op_list = [s.strip() for s in a.ops.split(",") if s.strip()]
    bad = [s for s in a.op_list if s not in OPS]
    if bad:
        p.error(f"unknown op(s) {bad}; valid: {', '.join(OPS)}")
    a.gpu = gpu
    return a


# ---------------------------------------------------------------------------------------------
# The functions compared.


def _leading_axes(ndim: int, gated: bool) -> tuple[int, ...]:
    return tuple(range(ndim - (2 if gated else 1)))


def _make_fns(te_jax, name: str, op: str, impl: str | None) -> dict[str, Callable]:
    """{'te_jax': f, 'xla': f, ['jax.nn': f]}, all jitted, for one (activation, op)."""
    act = ACTIVATIONS[name]
    gated = len(act) == 2
    ref = te_jax.activation_reference

    def ref_fwd(x):
        return ref.act_lu(x, act)

    def xla_vjp(dz, x):
        return jax.vjp(ref_fwd, x)[1](dz)[0]

    if op == "fwd":
        fns = {
            "te_jax": jax.jit(lambda x: te_jax.act_lu(x, act, implementation=impl)),
            "xla": jax.jit(ref_fwd),
        }
        if name == "gelu_exact":
            fns["jax.nn"] = jax.jit(lambda x: jax.nn.gelu(x, approximate=False))
        elif name == "geglu_exact":
            fns["jax.nn"] = jax.jit(
                lambda x: jax.nn.gelu(x[..., 0, :], approximate=False) * x[..., 1, :]
            )
        return fns
    if op == "dact":
        return {
            "te_jax": jax.jit(lambda dz, x: te_jax.dact_lu(dz, x, act, implementation=impl)),
            "xla": jax.jit(xla_vjp),
        }

    def xla_vjp_dbias(dz, x):
        dx = xla_vjp(dz, x)
        dbias = jnp.sum(dx, axis=_leading_axes(dx.ndim, gated), dtype=jnp.float32)
        return dx, dbias.astype(x.dtype)

    return {
        "te_jax": jax.jit(
            lambda dz, x: te_jax.quantize_dact_dbias(dz, x, act, is_dbias=True, implementation=impl)
        ),
        "xla": jax.jit(xla_vjp_dbias),
    }


BASELINE_LABEL = {"xla": "XLA (jit reference)", "jax.nn": "jax.nn.gelu(exact)"}


@jax.jit
def _rel_err(a, b):
    a = a.astype(jnp.float32)
    b = b.astype(jnp.float32)
    num = jnp.sqrt(jnp.sum(jnp.square(a - b)))
    den = jnp.sqrt(jnp.sum(jnp.square(b)))
    bad = jnp.logical_or(jnp.any(jnp.isnan(a)), jnp.any(jnp.isnan(b)))
    return jnp.where(bad, jnp.inf, num / jnp.maximum(den, 1e-30))


def _max_rel_err(out, ref) -> float:
    la, lb = jax.tree.leaves(out), jax.tree.leaves(ref)
    if len(la) != len(lb):
        return math.inf
    errs = []
    for a, b in zip(la, lb, strict=True):
        if a.shape != b.shape:
            return math.inf
        errs.append(float(_rel_err(a, b)))
    return max(errs)


def _tolerance(dtype: str) -> float:
    return {"float32": 1e-3, "float16": 1e-2, "bfloat16": 3e-2}[dtype]


def _lowers_to_te_kernel(fn, args) -> bool | None:
    """Whether a te_jax FFI target (``te_jax_*``) is in the lowered or the compiled module (under
    custom_partitioning the kernel's custom call appears only after partitioning)."""
    pattern = re.compile(r'custom_call_target="te_jax_|custom_call @te_jax_')
    try:
        lowered = fn.lower(*args)
        return bool(
            pattern.search(lowered.as_text()) or pattern.search(lowered.compile().as_text())
        )
    except Exception:
        return None


# ---------------------------------------------------------------------------------------------
# Shapes and inputs.


def _rows_for(nbytes: float, hidden: int, itemsize: int) -> int:
    return max(1, int(nbytes // (hidden * itemsize)))


@functools.partial(jax.jit, static_argnums=(0, 1, 3))
def _random(shape: tuple[int, ...], dtype, seed, kind: str) -> jax.Array:
    """Hash-based random fill (an integer hash of the element index: fast on every backend,
    where jax.random is slow for large arrays on a CPU).

    ``kind="x"``: triangular on [-8, 8] (8·(u1 − u2); both signs, about 1.5% beyond clamped
    SwiGLU's limit 7); ``kind="dz"``: uniform on [-1, 1).
    """
    n = math.prod(shape)
    h = jax.lax.iota(jnp.uint32, n).reshape(shape) * jnp.uint32(0x9E3779B1)
    h = h + seed.astype(jnp.uint32) * jnp.uint32(0x85EBCA77)
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x7FEB352D)
    h = h ^ (h >> 15)
    h = h * jnp.uint32(0x846CA68B)
    h = h ^ (h >> 16)
    u1 = (h & 0xFFFF).astype(jnp.float32) * (1.0 / 65536)
    u2 = (h >> 16).astype(jnp.float32) * (1.0 / 65536)
    v = 8.0 * (u1 - u2) if kind == "x" else 2.0 * u1 - 1.0
    return v.astype(dtype)


def _make_inputs(shape_x, shape_dz, dtype, n_sets: int, seed: int):
    """n_sets independent (dz, x) pairs, never zeros (see ``_random``)."""
    if math.prod(shape_x) >= 2**32:
        raise ValueError(f"shape {shape_x} too large for the 32-bit index hash")
    out = []
    for i in range(n_sets):
        s = np.uint32((seed * 7919 + i * 104729) % 2**32)
        out.append(
            (
                _random(tuple(shape_dz), dtype, s + np.uint32(1), "dz"),
                _random(tuple(shape_x), dtype, s, "x"),
            )
        )
    jax.block_until_ready(out)
    return out


def _nbytes_tree(tree) -> int:
    return sum(math.prod(a.shape) * jnp.dtype(a.dtype).itemsize for a in jax.tree.leaves(tree))


# ---------------------------------------------------------------------------------------------
# One section (large or small shapes).


def _plan_bytes(args, section_bytes: float, hidden: int) -> list[int]:
    """Every distinct bytes-moved value of the section (to time the matching copies first)."""
    sizes = set()
    for dt in args.dtype_list:
        isz = jnp.dtype(dt).itemsize
        m = _rows_for(section_bytes, hidden, isz)
        for name in args.act_list:
            g = len(ACTIVATIONS[name])
            for op in args.op_list:
                if op == "fwd":
                    b = (g + 1) * m * hidden * isz
                elif op == "dact":
                    b = (1 + 2 * g) * m * hidden * isz
                else:
                    b = (1 + 2 * g) * m * hidden * isz + g * hidden * isz
                sizes.add(copy_elements(b))
    return sorted(sizes)


def _time_copies(elements: list[int], args, tag: str) -> dict[int, Timing]:
    res = {}
    for n in elements:
        t = time_copy(n, n_sets=args.sets, reps=args.reps, target_s=args.target_ms / 1e3)
        res[n] = t
        gbps = 2 * n * 4 / t.median_s / 1e9
        print(
            f"  copy {tag}: {2 * n * 4 / 2**20:10.2f} MiB moved  {t.median_s * 1e6:10.1f} us  "
            f"{gbps:8.1f} GB/s  (n_inner {t.n_inner}, spread {t.spread:.1%})",
            flush=True,
        )
        gc.collect()
    return res


def run_section(te_jax, args, section: str, section_bytes: float, hidden: int) -> dict:
    impl = None if args.implementation == "auto" else args.implementation
    print(
        f"\n== section '{section}': {section_bytes / 2**20:.4g} MiB per (M, H) operand, "
        f"H = {hidden} ==",
        flush=True,
    )
    copy_sizes = _plan_bytes(args, section_bytes, hidden)
    ok, note = check_copy_is_real(copy_sizes[0])
    print(f"  copy check: {note}", flush=True)
    copies_before = _time_copies(copy_sizes, args, "before")

    rows: list[dict] = []
    errors: list[str] = []
    seed = 0
    for dt in args.dtype_list:
        dtype = jnp.dtype(dt)
        m = _rows_for(section_bytes, hidden, dtype.itemsize)
        for name in args.act_list:
            gated = len(ACTIVATIONS[name]) == 2
            shape_x = (m, 2, hidden) if gated else (m, hidden)
            shape_dz = (m, hidden)
            seed += 1
            sets = _make_inputs(shape_x, shape_dz, dtype, args.sets, seed)
            for op in args.op_list:
                fns = _make_fns(te_jax, name, op, impl)
                arg_sets = [(x,) for _, x in sets] if op == "fwd" else [tuple(s) for s in sets]
                label = f"{op:10s} {name:14s} {dt:8s} {'x'.join(map(str, shape_x))}"
                try:
                    out_shapes = jax.eval_shape(fns["te_jax"], *arg_sets[0])
                    nbytes = _nbytes_tree(arg_sets[0]) + _nbytes_tree(out_shapes)
                    errs = {}
                    if not args.no_check:
                        outs = {k: f(*arg_sets[0]) for k, f in fns.items()}
                        errs = {
                            k: _max_rel_err(outs["te_jax"], outs[k]) for k in fns if k != "te_jax"
                        }
                        del outs
                    ffi = _lowers_to_te_kernel(fns["te_jax"], arg_sets[0])
                    tm = time_functions(
                        fns, arg_sets, reps=args.reps, target_s=args.target_ms / 1e3
                    )
                except Exception as e:
                    msg = f"{label}: {type(e).__name__}: {str(e).splitlines()[0][:300]}"
                    errors.append(msg)
                    print(f"  ERROR {msg}", flush=True)
                    if os.environ.get("BENCH_TRACEBACK"):
                        traceback.print_exc()
                    del fns, arg_sets
                    gc.collect()
                    continue
                te = tm["te_jax"]
                for base in (k for k in fns if k != "te_jax"):
                    bt = tm[base]
                    rows.append(
                        {
                            "section": section,
                            "op": op,
                            "activation": name,
                            "activation_type": list(ACTIVATIONS[name]),
                            "gated": gated,
                            "dtype": dt,
                            "shape": list(shape_x),
                            "dz_shape": list(shape_dz),
                            "bytes": nbytes,
                            "bytes_formula": BYTES_FORMULA[op],
                            "copy_elements": copy_elements(nbytes),
                            "te_us": te.median_s * 1e6,
                            "te_min_us": te.min_s * 1e6,
                            "te_spread": te.spread,
                            "te_n_inner": te.n_inner,
                            "baseline": base,
                            "baseline_label": BASELINE_LABEL[base],
                            "base_us": bt.median_s * 1e6,
                            "base_min_us": bt.min_s * 1e6,
                            "base_spread": bt.spread,
                            "base_n_inner": bt.n_inner,
                            "reps": te.reps,
                            "te_gbps": nbytes / te.median_s / 1e9,
                            "base_gbps": nbytes / bt.median_s / 1e9,
                            "speedup": bt.median_s / te.median_s,
                            "rel_err": errs.get(base),
                            "tolerance": _tolerance(dt),
                            "te_lowers_to_te_kernel": ffi,
                        }
                    )
                    r = rows[-1]
                    print(
                        f"  {label:48s} te {r['te_us']:10.1f} us {r['te_gbps']:7.1f} GB/s | "
                        f"{base:6s} {r['base_us']:10.1f} us | x{r['speedup']:.2f}"
                        + ("" if r["rel_err"] is None else f" | err {r['rel_err']:.1e}"),
                        flush=True,
                    )
                del fns, arg_sets, tm
            del sets
            gc.collect()

    copies_after = _time_copies(copy_sizes, args, "after ")
    copies = {}
    for n in copy_sizes:
        b, a = copies_before[n], copies_after[n]
        best = min(b.median_s, a.median_s)  # the faster copy: the stricter ceiling
        copies[n] = {
            "elements": n,
            "bytes": 2 * n * 4,
            "us_before": b.median_s * 1e6,
            "us_after": a.median_s * 1e6,
            "gbps": 2 * n * 4 / best / 1e9,
            "gbps_before": 2 * n * 4 / b.median_s / 1e9,
            "gbps_after": 2 * n * 4 / a.median_s / 1e9,
            "spread_before": b.spread,
            "spread_after": a.spread,
            "n_inner": b.n_inner,
        }
    for r in rows:
        c = copies[r["copy_elements"]]
        r["copy_gbps"] = c["gbps"]
        r["te_frac_copy"] = r["te_gbps"] / c["gbps"]
        r["base_frac_copy"] = r["base_gbps"] / c["gbps"]
    return {
        "section": section,
        "bytes_per_operand": section_bytes,
        "hidden": hidden,
        "copy_check": {"ok": ok, "note": note},
        "copies": list(copies.values()),
        "rows": rows,
        "errors": errors,
    }


# ---------------------------------------------------------------------------------------------


def _loadavg() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def _meta(te_jax, args, t_start: float) -> dict:
    dev = jax.devices()[0]
    meta = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "command": "python -m benchmarks.activations " + " ".join(sys.argv[1:]),
        "backend": args.backend,
        "device_kind": getattr(dev, "device_kind", str(dev)),
        "device_count": jax.device_count(),
        "host_cpus": os.cpu_count(),
        "python": platform.python_version(),
        "jax": jax.__version__,
        "jaxlib": None,
        "te_jax_file": getattr(te_jax, "__file__", None),
        "te_jax_version": getattr(te_jax, "__version__", None),
        "implementation": args.implementation,
        "gib_per_operand": args.gib,
        "hidden": args.hidden,
        "reps": args.reps,
        "target_ms": args.target_ms,
        "input_sets": args.sets,
        "quick": args.quick,
        "timing_method": TIMING_METHOD,
        "bytes_formula": BYTES_FORMULA,
        "wall_s": time.time() - t_start,
    }
    try:
        import jaxlib

        meta["jaxlib"] = jaxlib.__version__
    except Exception:
        pass
    fa = getattr(te_jax, "ffi_available", None)
    if fa is not None:
        for plat in ("cpu", "cuda"):
            try:
                meta[f"ffi_available_{plat}"] = bool(fa(plat))
            except Exception:
                meta[f"ffi_available_{plat}"] = None
    try:
        stats = dev.memory_stats() or {}
        meta["peak_bytes_in_use"] = stats.get("peak_bytes_in_use")
        meta["bytes_limit"] = stats.get("bytes_limit")
    except Exception:
        pass
    return meta


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    t_start = time.time()
    load_start = _loadavg()
    # Imported after argument parsing, so --help works without the extension.
    te_jax = importlib.import_module(args.module)

    print(
        f"te_jax benchmark: backend {args.backend} ({jax.devices()[0].device_kind}), "
        f"dtypes {args.dtype_list}, {len(args.act_list)} activations, ops {args.op_list}, "
        f"reps {args.reps}, ~{args.target_ms:g} ms per sample, {args.sets} input sets, "
        f"implementation={args.implementation}",
        flush=True,
    )
    sections = []
    if not args.small_only:
        sections.append(run_section(te_jax, args, "large", args.gib * 2**30, args.hidden))
    if args.small or args.small_only:
        sections.append(
            run_section(te_jax, args, "small", args.small_kib * 1024, args.small_hidden)
        )
    result = {"meta": _meta(te_jax, args, t_start), "sections": sections}
    result["meta"]["host_loadavg_1m_start_end"] = [load_start, _loadavg()]
    result["checks"] = _report.checks(result)

    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"activations_{args.backend}")
    md = _report.markdown(result)
    with open(stem + ".md", "w") as f:
        f.write(md)
    with open(stem + ".json", "w") as f:
        json.dump(result, f, indent=1, default=str)
    print("\n" + _report.markdown(result, with_summary=False))
    written = [stem + ".md", stem + ".json"]
    if args.plot:
        png = _report.plot(result, stem + ".png")
        if png:
            written.append(png)
    print(_report.summary(result))
    print(f"wrote {', '.join(written)}  (total {time.time() - t_start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
