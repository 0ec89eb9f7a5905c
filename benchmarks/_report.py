"""Markdown table, summary, pass/fail checks and plot of a benchmark result (a JSON-able dict)."""

from __future__ import annotations

from collections.abc import Callable

# Every benchmark's default --out: a directory .gitignore ignores.
OUT_DIR = "bench_results"
OP_ORDER = ("fwd", "dact", "dact+dbias")
DTYPE_ORDER = ("bfloat16", "float16", "float32")
ACT_ORDER = (
    "gelu",
    "geglu",
    "glu",
    "silu",
    "swiglu",
    "relu",
    "reglu",
    "quick_gelu",
    "qgeglu",
    "squared_relu",
    "sreglu",
    "clamped_swiglu",
    "gelu_exact",
    "geglu_exact",
)


def _sort_key(r: dict):
    return (
        DTYPE_ORDER.index(r["dtype"]) if r["dtype"] in DTYPE_ORDER else 9,
        OP_ORDER.index(r["op"]),
        ACT_ORDER.index(r["activation"]) if r["activation"] in ACT_ORDER else 99,
        r["baseline"] != "xla",
    )


def _is_gpu(result: dict) -> bool:
    return result["meta"]["backend"] in ("gpu", "cuda", "rocm")


def _section(result: dict, name: str) -> dict | None:
    return next((s for s in result["sections"] if s["section"] == name), None)


def fmt_bytes(n: float) -> str:
    if n >= 2**30:
        return f"{n / 2**30:.3g} GiB"
    if n >= 2**20:
        return f"{n / 2**20:.3g} MiB"
    return f"{n / 2**10:.3g} KiB"


def _where(r: dict) -> str:
    """A row's name in check details (a row may carry its own, ``where``)."""
    return r.get("where") or f"{r['op']} {r['activation']} {r['dtype']}"


def _within_spread(r: dict) -> bool:
    """A slowdown no larger than the run-to-run spread of either timing."""
    return (1.0 / r["speedup"] - 1.0) <= max(r["te_spread"], r["base_spread"])


# ---------------------------------------------------------------------------------------------
# Checks.


def _check(
    name: str,
    rows: list[dict],
    value: Callable[[dict], float],
    ok: Callable[[float], bool],
    fmt: str = "{:.3f}",
    worst: str = "min",
    noise_note: bool = False,
) -> dict:
    if not rows:
        return {"check": name, "status": "SKIP", "detail": "not run (filtered out or failed)"}
    vals = [(value(r), r) for r in rows]
    pick = min if worst == "min" else max
    wv, wr = pick(vals, key=lambda t: t[0])
    failing = [(v, r) for v, r in vals if not ok(v)]
    detail = f"worst {fmt.format(wv)} ({_where(wr)}); {len(rows)} rows"
    if failing:
        failing.sort(key=lambda t: t[0], reverse=(worst != "min"))
        listed = ", ".join(f"{_where(r)} {fmt.format(v)}" for v, r in failing[:8])
        more = f" (+{len(failing) - 8} more)" if len(failing) > 8 else ""
        detail += f"; failing {len(failing)}: {listed}{more}"
        noise = sum(1 for _, r in failing if _within_spread(r))
        if noise_note and noise:
            detail += f"; {noise} of the failing within their timing spread"
    return {"check": name, "status": "FAIL" if failing else "PASS", "detail": detail}


def checks(result: dict) -> list[dict]:
    """The acceptance checks (te_jax's speedup targets over XLA), on the large-shape rows
    of this run's backend."""
    sec = _section(result, "large")
    if sec is None:
        return [{"check": "large-shape checks", "status": "SKIP", "detail": "no large section"}]
    rows = sec["rows"]
    xla = [r for r in rows if r["baseline"] == "xla"]
    frac = lambda r: r["te_frac_copy"]
    spd = lambda r: r["speedup"]
    out = []
    if _is_gpu(result):
        out.append(
            _check(
                "GPU: every forward >= 90% of copy bandwidth",
                [r for r in xla if r["op"] == "fwd"],
                frac,
                lambda v: v >= 0.90,
            )
        )
        out.append(
            _check(
                "GPU: every dact and dact+dbias (gated too) >= 85% of copy bandwidth",
                [r for r in xla if r["op"] in ("dact", "dact+dbias")],
                frac,
                lambda v: v >= 0.85,
            )
        )
        out.append(
            _check(
                "GPU: exact GELU forward >= 2x faster than jax.nn.gelu(approximate=False)",
                [
                    r
                    for r in rows
                    if r["op"] == "fwd"
                    and r["activation"] == "gelu_exact"
                    and r["baseline"] == "jax.nn"
                ],
                spd,
                lambda v: v >= 2.0,
            )
        )
        out.append(
            _check(
                "GPU: dgelu+dbias >= 1.2x faster than XLA jax.vjp + sum",
                [r for r in xla if r["op"] == "dact+dbias" and r["activation"] == "gelu"],
                spd,
                lambda v: v >= 1.2,
            )
        )
        out.append(
            _check(
                "GPU: dswiglu >= 1.2x faster than XLA jax.vjp",
                [r for r in xla if r["op"] == "dact" and r["activation"] == "swiglu"],
                spd,
                lambda v: v >= 1.2,
            )
        )
        out.append(
            _check(
                "GPU: dswiglu+dbias >= 1.2x faster than XLA jax.vjp + sum",
                [r for r in xla if r["op"] == "dact+dbias" and r["activation"] == "swiglu"],
                spd,
                lambda v: v >= 1.2,
            )
        )
        out.append(
            _check(
                "GPU: no op slower than its XLA-native equivalent",
                rows,
                spd,
                lambda v: v >= 1.0,
                noise_note=True,
            )
        )
    else:
        out.append(
            _check(
                "CPU: no op more than 1.5x slower than XLA:CPU",
                rows,
                spd,
                lambda v: v >= 1 / 1.5,
                noise_note=True,
            )
        )
        out.append(
            _check(
                "CPU: dact + dbias faster than XLA:CPU",
                [r for r in xla if r["op"] == "dact+dbias"],
                spd,
                lambda v: v > 1.0,
                noise_note=True,
            )
        )
    return out


# ---------------------------------------------------------------------------------------------
# Markdown.


def _shape(r: dict) -> str:
    return "x".join(str(d) for d in r["shape"])


def _table(rows: list[dict]) -> str:
    head = (
        "| op | activation | dtype | shape (x) | MiB moved | te_jax µs | te_jax GB/s | "
        "te_jax / copy | baseline | baseline µs | baseline / copy | speedup | rel err |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in sorted(rows, key=_sort_key):
        err = "" if r.get("rel_err") is None else f"{r['rel_err']:.1e}"
        if r.get("rel_err") is not None and not r["rel_err"] <= r["tolerance"]:
            err += " **!**"
        kernel = "" if r.get("te_lowers_to_te_kernel") in (True, None) else " (no FFI)"
        lines.append(
            f"| {r['op']} | {r['activation']}{kernel} | {r['dtype']} | {_shape(r)} | "
            f"{r['bytes'] / 2**20:.1f} | {r['te_us']:.1f} | {r['te_gbps']:.1f} | "
            f"{r['te_frac_copy']:.3f} | {r['baseline']} | {r['base_us']:.1f} | "
            f"{r['base_frac_copy']:.3f} | {r['speedup']:.2f} | {err} |"
        )
    return "\n".join(lines)


def _copy_table(sec: dict) -> str:
    lines = [
        "| MiB moved | µs (before) | µs (after) | GB/s before | GB/s after | GB/s used |",
        "|---|---|---|---|---|---|",
    ]
    for c in sec["copies"]:
        lines.append(
            f"| {c['bytes'] / 2**20:.4g} | {c['us_before']:.1f} | {c['us_after']:.1f} | "
            f"{c['gbps_before']:.1f} | {c['gbps_after']:.1f} | {c['gbps']:.1f} |"
        )
    return "\n".join(lines)


def markdown(result: dict, with_summary: bool = True) -> str:
    m = result["meta"]
    parts = [
        f"# te_jax activation benchmark: {m['backend']} ({m['device_kind']})",
        "",
        f"- date: {m['date']}; command: `{m['command']}`",
        f"- jax {m['jax']}, jaxlib {m.get('jaxlib')}, te_jax from `{m['te_jax_file']}`, "
        f"implementation={m['implementation']}, ffi_available cpu={m.get('ffi_available_cpu')} "
        f"cuda={m.get('ffi_available_cuda')}",
        f"- {m['gib_per_operand'] * 1024:.4g} MiB per (M, H) operand (gated x twice that), "
        f"H = {m['hidden']}; {m['input_sets']} input sets rotated; {m['reps']} samples of "
        f"~{m['target_ms']:g} ms each per function",
        f"- timing: {m['timing_method']}",
        f"- host: {m.get('host_cpus')} CPUs, 1-minute load average at start / end: "
        f"{m.get('host_loadavg_1m_start_end')}",
        "- bytes moved: each input read once + each output written once: "
        + "; ".join(f"{k}: {v}" for k, v in m["bytes_formula"].items()),
        "- `te_jax / copy`: achieved bandwidth over that of a device copy moving the same bytes "
        "(the faster of the copies timed before and after the ops); `speedup`: baseline time / "
        "te_jax time; `rel err`: ‖te_jax − baseline‖ / ‖baseline‖ (max over outputs), "
        "**!** above tolerance; `(no FFI)`: the te_jax function did not lower to a te_jax "
        "custom call",
    ]
    if m.get("peak_bytes_in_use"):
        parts.append(f"- device memory peak: {m['peak_bytes_in_use'] / 2**30:.1f} GiB")
    for sec in result["sections"]:
        title = (
            "Large shapes"
            if sec["section"] == "large"
            else "Small shapes (launch-bound; not used by the checks)"
        )
        parts += [
            "",
            f"## {title}: {sec['bytes_per_operand'] / 2**20:.4g} MiB per operand, "
            f"H = {sec['hidden']}",
            "",
            f"Copy ceiling ({sec['copy_check']['note']}):",
            "",
            _copy_table(sec),
            "",
            _table(sec["rows"]),
        ]
        if sec["errors"]:
            parts += ["", "Errors:", ""] + [f"- {e}" for e in sec["errors"]]
    if with_summary:
        parts += ["", "## Summary", "", "```", summary(result), "```", ""]
    return "\n".join(parts)


# ---------------------------------------------------------------------------------------------
# Summary (printed last).


def summary(result: dict) -> str:
    m = result["meta"]
    out = []
    # The small (launch-bound) section first: the large one and the checks end the output.
    for sec in sorted(result["sections"], key=lambda s: s["section"] == "large"):
        rows = sec["rows"]
        out.append(
            f"== summary: {sec['section']} shapes, {m['backend']} ({m['device_kind']}), "
            f"{fmt_bytes(sec['bytes_per_operand'])} per operand, {m['reps']} reps =="
        )
        cs = sec["copies"]
        if cs:
            drift = max(abs(c["gbps_after"] / c["gbps_before"] - 1) for c in cs)
            out.append(
                "copy ceiling: "
                + ", ".join(f"{c['gbps']:.0f} GB/s @ {fmt_bytes(c['bytes'])}" for c in cs)
                + f"  (before/after drift <= {drift:.1%})"
            )
        if not rows:
            out.append("no rows")
        xla = [r for r in rows if r["baseline"] == "xla"]
        out.append("worst te_jax fraction of copy bandwidth | median speedup over XLA:")
        for op in OP_ORDER:
            for gated in (False, True):
                sel = [r for r in xla if r["op"] == op and r["gated"] == gated]
                if not sel:
                    continue
                w = min(sel, key=lambda r: r["te_frac_copy"])
                sp = sorted(r["speedup"] for r in sel)
                out.append(
                    f"  {op + (' gated' if gated else ''):18s} {w['te_frac_copy']:.3f} "
                    f"({w['activation']} {w['dtype']}) | speedup median "
                    f"{sp[len(sp) // 2]:.2f}, min {sp[0]:.2f}"
                )
        slow = sorted((r for r in rows if r["speedup"] < 1.0), key=lambda r: r["speedup"])
        if slow:
            n_noise = sum(1 for r in slow if _within_spread(r))
            out.append(
                f"slower than the XLA-native equivalent ({len(slow)}, {n_noise} of them within "
                "their timing spread):"
            )
            for r in slow[:15]:
                note = " (within timing spread)" if _within_spread(r) else ""
                out.append(
                    f"  {_where(r):32s} vs {r['baseline']:6s} x{r['speedup']:.3f}"
                    f"  te {r['te_us']:.1f} us, base {r['base_us']:.1f} us{note}"
                )
            if len(slow) > 15:
                out.append(f"  ... +{len(slow) - 15} more, all closer to 1 (see the Markdown/JSON)")
        else:
            out.append("slower than the XLA-native equivalent: none")
        bad_err = [
            r for r in rows if r.get("rel_err") is not None and not r["rel_err"] <= r["tolerance"]
        ]
        if bad_err:
            out.append(
                "OUTPUT MISMATCH vs baseline (rel err above tolerance): "
                + ", ".join(f"{_where(r)} vs {r['baseline']} {r['rel_err']:.1e}" for r in bad_err)
            )
        no_ffi = [r for r in rows if r.get("te_lowers_to_te_kernel") is False]
        if no_ffi:
            out.append(
                f"WARNING: {len(no_ffi)} te_jax rows did not lower to a te_jax custom "
                f"call (timed the pure-JAX path?): e.g. {_where(no_ffi[0])}"
            )
        if not sec["copy_check"]["ok"]:
            out.append(f"WARNING: copy ceiling suspect: {sec['copy_check']['note']}")
        for e in sec["errors"][:10]:
            out.append(f"ERROR {e}")
        if len(sec["errors"]) > 10:
            out.append(f"... and {len(sec['errors']) - 10} more errors (see the Markdown/JSON)")
    loads = [x for x in m.get("host_loadavg_1m_start_end") or [] if x is not None]
    if not _is_gpu(result) and loads and max(loads) > 0.5 * (m.get("host_cpus") or 1):
        out.append(
            f"WARNING: host load average {', '.join(f'{x:.1f}' for x in loads)} (start, end) on "
            f"{m.get('host_cpus')} CPUs: other processes shared the CPU; CPU timings are noisy"
        )
    out.append(f"checks ({'GPU' if _is_gpu(result) else 'CPU'}, large shapes):")
    for c in result.get("checks", []):
        out.append(f"  {c['status']:4s}  {c['check']}: {c['detail']}")
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------
# Plot.


def pyplot():
    """``matplotlib.pyplot`` on the Agg backend, or None (with a note) when it is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("--plot: matplotlib is not installed (pip install matplotlib); skipping the plot")
        return None
    return plt


def plot(result: dict, path: str) -> str | None:
    """Fraction of copy bandwidth per activation (te_jax vs XLA), one panel per op x dtype."""
    plt = pyplot()
    if plt is None:
        return None
    sec = _section(result, "large") or result["sections"][0]
    rows = [r for r in sec["rows"] if r["baseline"] == "xla"]
    ops = [o for o in OP_ORDER if any(r["op"] == o for r in rows)]
    dtypes = [d for d in DTYPE_ORDER if any(r["dtype"] == d for r in rows)]
    if not ops or not dtypes:
        print("--plot: nothing to plot")
        return None
    acts = [a for a in ACT_ORDER if any(r["activation"] == a for r in rows)]
    fig, axes = plt.subplots(
        len(ops),
        len(dtypes),
        squeeze=False,
        figsize=((2.5 + 0.6 * len(acts)) * len(dtypes), 1.0 + 3.2 * len(ops)),
    )
    gpu = _is_gpu(result)
    for i, op in enumerate(ops):
        for j, dt in enumerate(dtypes):
            ax = axes[i][j]
            by = {r["activation"]: r for r in rows if r["op"] == op and r["dtype"] == dt}
            xs = list(range(len(acts)))
            te = [by[a]["te_frac_copy"] if a in by else 0 for a in acts]
            xl = [by[a]["base_frac_copy"] if a in by else 0 for a in acts]
            ax.bar([x - 0.2 for x in xs], te, 0.4, label="te_jax")
            ax.bar([x + 0.2 for x in xs], xl, 0.4, label="XLA")
            for x, a in zip(xs, acts, strict=True):
                if a in by:
                    ax.text(
                        x - 0.2,
                        te[x] + 0.02,
                        f"{by[a]['speedup']:.2f}x",
                        ha="center",
                        va="bottom",
                        fontsize=7,
                    )
            ax.axhline(1.0, color="gray", lw=0.8)
            if gpu:
                ax.axhline(0.90 if op == "fwd" else 0.85, color="red", lw=0.8, ls="--")
            ax.set_xticks(xs)
            ax.set_xticklabels(acts, rotation=40, ha="right", fontsize=8)
            ax.set_ylim(0, max(1.15, 1.12 * max(te + xl)))
            ax.set_ylabel("fraction of copy BW")
            ax.set_title(f"{op}, {dt}", fontsize=10)
            if i == 0 and j == 0:
                ax.legend(fontsize=8)
    m = result["meta"]
    fig.suptitle(
        f"te_jax vs XLA: {m['backend']} ({m['device_kind']}), "
        f"{sec['bytes_per_operand'] / 2**20:.4g} MiB per operand "
        f"(labels: speedup over XLA)",
        fontsize=11,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
