"""MLP block benchmark: te_jax's ``LayerNormMLP`` (Linen and NNX; bf16, FP8 delayed and current
scaling, blockwise FP8: ``Float8BlockScaling``) against the Flax-native block and Flax's own FP8
(``nn.Fp8DotGeneralOp``), one training step each (forward + backward, no optimizer).

    python -m benchmarks.mlp                         # GPU: tokens 8192, hidden 4096
    python -m benchmarks.mlp --quick                 # tiny shapes, 3 samples (CPU smoke test)
    python -m benchmarks.mlp --blocks gelu --rows flax:bf16,te_linen:delayed --plot --out DIR

Blocks: ``gelu`` (intermediate 16384) and ``swiglu`` (intermediate 10944: the GELU block's
parameter count, 3·H·I ≈ 2·H·16384). The Flax-native block is written the way Flax users write
it: ``nn.LayerNorm → nn.Dense → jax.nn activation → nn.Dense`` (SwiGLU: one ``nn.Dense`` to
``2·I`` split in two), parameters float32, computation bfloat16 (``dtype=jnp.bfloat16``),
jitted, default XLA flags. ``flax:te_delayed`` / ``flax:te_current`` are that block with
``dot_general_cls=functools.partial(te_jax.flax.DotGeneral, recipe=...)`` in both Denses (FP8
with one argument per layer, the state in ``_overwrite_with_gradient`` as Flax's own FP8 keeps
it), the drop-in against ``flax:fp8_ops``. ``te_linen:bf16_dgelu`` is ``te_linen:bf16`` with
the GELU backward in the dgrad GEMM's DGELU epilogue instead of a separate dact pass (dbias_1
a float32 sum of dh; ``gelu_backward="dgelu"``), ``te_linen:bf16_dgelu_bgrad`` with dbias_1 in
the epilogue too (``"dgelu_bgrad"``): A/B rows of that fusion, off by default.
``te_linen:delayed_accum4`` is ``te_linen:delayed`` with the same tokens as 4 micro-batches in
one jitted ``lax.scan`` (gradient accumulation: parameter gradients summed, FP8 states merged),
whose weights XLA:GPU quantizes in every micro-batch; ``te_linen:delayed_accum4_cached`` quantizes
them once before the scan (``te_jax.flax.quantize_kernels``). Every row computes
the same step: ``out = block(x)``, the loss ``sum(out · dy)`` and its gradients with respect to
x, every parameter and (FP8 rows) the FP8 state, whose "gradient" is the next state.

Per row: ms per step (median of ``--reps`` samples of ``--target-ms``; samples of all rows
interleaved, each after ``--settle-ms`` of untimed steps of its own row, because the step holds
the GPU at its power limit and a sample's clock otherwise depends on the row before it; inputs
rotated over ``--sets`` sets, default 2), TFLOP/s (``6 · tokens · H · I · (act_len + 1)``:
three GEMMs of each of the two dense layers; the norm and activation are not counted), speedup
over ``flax:bf16`` of the same block, the step's peak device memory as XLA's compiled memory
analysis gives it (arguments + outputs + temporaries − aliased), the host time to dispatch one
call, and on a GPU the median SM clock and board power while the row's samples ran
(``nvidia-smi``, ``benchmarks/_clocks.py``). Writes ``mlp_<backend>.md`` / ``.json`` and, with
``--plot`` (matplotlib), ``mlp_<backend>.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time

import jax
import jax.numpy as jnp

from benchmarks._mlp_common import (
    BLOCKS,
    add_step_args,
    bar_panel,
    clock_cells,
    custom_calls,
    flax_block,
    input_sets,
    names,
    peak_bytes,
    row_record,
    run_meta,
    save_figure,
    step_defaults,
    timed,
    value_and_grads,
    write_result,
)
from benchmarks._report import pyplot
from benchmarks._trace import gpu_kernels, kernel_breakdown

ROWS = (
    "flax:bf16",
    "flax:fp8_ops",
    "flax:te_delayed",
    "flax:te_current",
    "te_linen:bf16",
    "te_linen:bf16_dgelu",
    "te_linen:bf16_dgelu_bgrad",
    "te_linen:delayed",
    "te_linen:delayed_accum4",
    "te_linen:delayed_accum4_cached",
    "te_linen:current",
    "te_linen:blockwise",
    "te_nnx:bf16",
    "te_nnx:delayed",
    "te_nnx:current",
    "te_nnx:blockwise",
)
# The te_linen rows with the bf16 GELU backward in the dgrad GEMM's DGELU epilogue (dbias_1 a
# float32 sum of dh), or DGELU + BGRAD: LayerNormMLP's gelu_backward (te_jax.fused_mlp's).
GELU_BACKWARD = {"bf16_dgelu": "dgelu", "bf16_dgelu_bgrad": "dgelu_bgrad"}
# Rows whose step runs its tokens as micro-batches in one jitted scan (gradient accumulation):
# row -> (the precision it accumulates, micro-batch count, kernels quantized once before the
# scan with te_jax.flax.quantize_kernels). Without the cache XLA:GPU quantizes every kernel in
# every micro-batch (it runs no loop-invariant code motion).
ACCUMULATE = {
    "delayed_accum4": ("delayed", 4, False),
    "delayed_accum4_cached": ("delayed", 4, True),
}
# The published targets: row -> minimum speedup over flax:bf16.
WANTED = {
    "te_linen:bf16": 1.05,
    "te_nnx:bf16": 1.05,
    "te_linen:delayed": 1.55,
    "te_nnx:delayed": 1.55,
    "te_linen:current": 1.40,
    "te_nnx:current": 1.40,
    "te_linen:blockwise": 1.35,
    "te_nnx:blockwise": 1.35,
}


def _recipe(te_jax, name: str):
    return {
        "bf16": None,
        "bf16_dgelu": None,
        "bf16_dgelu_bgrad": None,
        "delayed": te_jax.recipe.DelayedScaling(),
        "current": te_jax.recipe.CurrentScaling(),
        "blockwise": te_jax.recipe.Float8BlockScaling(),
    }[ACCUMULATE.get(name, (name,))[0]]


def _flax_dot_general(te_jax, prec: str):
    """The Flax block's ``dot_general_cls`` for a ``flax:<prec>`` row: none (bf16), Flax's
    ``nn.Fp8DotGeneralOp`` or te_jax's ``te_jax.flax.DotGeneral`` under the row's recipe."""
    import flax.linen as nn

    if prec == "fp8_ops":
        return nn.Fp8DotGeneralOp
    if prec.startswith("te_"):
        import te_jax.flax as tef

        return functools.partial(tef.DotGeneral, recipe=_recipe(te_jax, prec[3:]))
    return None


def _step_fn(row: str, act, hidden: int, inter: int, x0, te_jax):
    """``(state, step)``: ``step(state, x, dy)`` returns ``sum(block(x) · dy)`` and its
    gradients with respect to (state, x); ``state`` holds the parameters and any FP8 state."""
    family, prec = row.split(":")
    key = jax.random.key(0)
    if family == "flax":
        m = flax_block(act, inter, _flax_dot_general(te_jax, prec))
        state = m.init(key, x0)

        def out(state, x):
            return m.apply(state, x)

    elif family == "te_linen":
        import te_jax.flax as tef

        m = tef.LayerNormMLP(
            inter,
            activations=act,
            use_bias=True,
            recipe=_recipe(te_jax, prec),
            return_layernorm_output=False,
            gelu_backward=GELU_BACKWARD.get(prec, "dact"),
        )
        state = jax.tree.map(lambda a: a, m.init(key, x0))

        def out(state, x):
            return m.apply(state, x)[0]

    else:
        from flax import nnx

        from te_jax import nnx as tnnx

        model = tnnx.LayerNormMLP(
            hidden,
            inter,
            activations=act,
            use_bias=True,
            recipe=_recipe(te_jax, prec),
            return_layernorm_output=False,
            rngs=nnx.Rngs(0),
        )
        graphdef, state = nnx.split(model)

        def out(state, x):
            return nnx.merge(graphdef, state)(x)[0]

    one_batch = value_and_grads(out)

    if prec not in ACCUMULATE:
        return state, jax.jit(one_batch)
    _, n, cached = ACCUMULATE[prec]
    recipe = _recipe(te_jax, prec)

    @jax.jit
    def accumulate(state, x, dy):
        """The same tokens as ``n`` micro-batches in a scan: parameter gradients summed, the
        FP8 states merged (te_jax.flax.merge_fp8_metas), x's gradient put back together;
        ``cached``: the kernels quantized once, before the scan."""
        import te_jax.flax as tef

        step = one_batch
        if cached:
            cache = tef.quantize_kernels(m, state)
            step = value_and_grads(lambda s, x: m.apply({**s, **cache}, x)[0])

        def body(acc, xd):
            value, (g, dx) = step(state, *xd)
            total, g_params = acc
            return (total + value, jax.tree.map(jnp.add, g_params, g["params"])), (
                g["fp8_metas"],
                dx,
            )

        micro = [a.reshape(n, -1, a.shape[-1]) for a in (x, dy)]
        zero = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, state["params"]))
        (value, g_params), (news, dx) = jax.lax.scan(body, zero, micro)
        fp8 = tef.merge_fp8_metas(
            recipe, state["fp8_metas"], *(jax.tree.map(lambda a, i=i: a[i], news) for i in range(n))
        )
        return value, ({"params": g_params, "fp8_metas": fp8}, dx.reshape(x.shape))

    return state, accumulate


def run_block(block: str, shape: dict, rows: list[str], args, te_jax) -> dict:
    act = BLOCKS[block]
    tokens, hidden, inter = shape["tokens"], shape["hidden"], shape[block]
    sets = input_sets(tokens, hidden, hidden, args.sets)
    flop = 6 * tokens * hidden * inter * (len(act) + 1)
    fns, meta = {}, {}
    for row in rows:
        state, step = _step_fn(row, act, hidden, inter, sets[0][0], te_jax)
        prec = row.split(":")[1]
        if ACCUMULATE.get(prec, (prec,))[0] in ("delayed", "fp8_ops", "te_delayed"):
            # Steady state: the FP8 state after a few steps (scales from real amaxes).
            for _ in range(3):
                g = step(state, *sets[0])[1][0]
                state = _next_state(row, state, g)
        fns[row] = functools.partial(step, state)
        compiled = step.lower(state, *sets[0]).compile()
        hlo = compiled.as_text()
        meta[row] = {"peak_bytes": peak_bytes(compiled), "kernels": custom_calls(hlo)}
        if args.hlo:
            os.makedirs(args.out, exist_ok=True)
            name = f"mlp_{block}_{row.replace(':', '_')}.hlo.txt"
            with open(os.path.join(args.out, name), "w") as f:
                f.write(hlo)
    fns.update(_norm_quantize_fns(rows, te_jax))
    timings, clocks = timed(fns, sets, args)
    base = timings.get("flax:bf16")
    out_rows = []
    for row in rows:
        t = timings[row]
        r = {"block": block, **row_record(row, t, clocks, flop), **meta[row]}
        r["speedup"] = None if base is None else base.median_s / t.median_s
        out_rows.append(r)
    profile = {}
    for row in [r for r in rows if r in args.profile]:
        n = args.profile_steps
        kernels = gpu_kernels(functools.partial(fns[row], *sets[0]), steps=n)
        first = next(iter(kernels.values()), None)
        profile[row] = (
            None if first is None else kernel_breakdown(first, steps=n, top=args.profile_top)
        )
        gemm = (profile[row] or {}).get("by_kind", {}).get("gemm")
        if gemm and gemm["ms"] > 0:
            # The step's GEMMs at their rate in the trace, beside a single GEMM's (dense).
            profile[row]["gemm_tflops"] = flop / (gemm["ms"] * 1e-3) / 1e12
        if profile[row]:
            kinds = ", ".join(
                f"{k} {v['ms']:.3f} ms ({v['launches']:.0f})"
                for k, v in profile[row]["by_kind"].items()
            )
            p = profile[row]
            gaps = ", ".join(f"{g['us']:.0f} us before {g['before'][:40]}" for g in p["gaps"][:3])
            rate = f"; GEMMs {p['gemm_tflops']:.0f} TFLOP/s" if "gemm_tflops" in p else ""
            print(
                f"profile {block} {row}: busy {p['busy_ms']:.3f} of {p['span_ms']:.3f} ms; "
                f"{kinds}{rate}; longest gaps: {gaps}"
            )
    return {
        "block": block,
        "tokens": tokens,
        "hidden": hidden,
        "intermediate": inter,
        "rows": out_rows,
        "norm_quantize": _norm_quantize_share(rows, timings),
        "profile": profile,
        "profile_steps": args.profile_steps,
    }


def _norm_quantize_fns(rows: list[str], te_jax) -> dict:
    """The FP8 step's quantize pass over the norm's output (``(tokens, hidden)`` bf16, both
    copies; current scaling's amax pass included), timed alone: the pass a fused norm +
    quantize kernel would remove."""
    from te_jax.quantize import quantize
    from te_jax.quantize.quantize_layout import QuantizeLayout

    fns = {}
    for prec in ("delayed", "current"):
        if any(r.startswith("te_") and r.endswith(":" + prec) for r in rows):
            q = te_jax.QuantizerSet.create(_recipe(te_jax, prec))
            q = q.with_layout("x", QuantizeLayout.ROWWISE_COLWISE)
            fns[f"norm_quantize:{prec}"] = jax.jit(lambda x, dy, q=q: quantize(x, q))
    return fns


def _norm_quantize_share(rows: list[str], timings) -> dict:
    """``{recipe: {"ms", "share"}}``: the pass's time and its share of te_linen's step."""
    out = {}
    for prec in ("delayed", "current"):
        t = timings.get(f"norm_quantize:{prec}")
        step = timings.get(f"te_linen:{prec}") or timings.get(f"te_nnx:{prec}")
        if t is not None and step is not None:
            out[prec] = {"ms": t.median_s * 1e3, "share": t.median_s / step.median_s}
    return out


def _next_state(row: str, state, grads):
    """The FP8 state a training loop carries into the next step: the FP8 part of the
    gradient (te_jax's FP8Meta / fp8_metas; Flax's _overwrite_with_gradient)."""
    if row.startswith("te_nnx"):
        from flax import nnx

        from te_jax import nnx as tnnx

        return nnx.merge_state(state, nnx.filter_state(grads, tnnx.FP8Meta))
    coll = "fp8_metas" if row.startswith("te_linen") else "_overwrite_with_gradient"
    return {**state, coll: grads[coll]}


def checks(result: dict) -> list[str]:
    lines = []
    for sec in result["blocks"]:
        by = {r["row"]: r for r in sec["rows"]}
        base = by.get("flax:bf16")
        for row, want in WANTED.items():
            if row in by and by[row]["speedup"] is not None:
                s = by[row]["speedup"]
                lines.append(
                    f"{'PASS' if s >= want else 'FAIL'}  {sec['block']}: {row} "
                    f"{s:.3f}x flax:bf16 (wanted >= {want})"
                )
        for prec, nq in sec.get("norm_quantize", {}).items():
            lines.append(
                f"INFO  {sec['block']}: the norm output's quantize pass ({prec}) {nq['ms']:.3f} "
                f"ms = {100 * nq['share']:.1f}% of the step (a fused norm + quantize kernel is "
                f"called for above 2%)"
            )
        fp8_ops = by.get("flax:fp8_ops")
        for row in (
            "te_linen:delayed",
            "te_linen:current",
            "te_nnx:delayed",
            "te_nnx:current",
            "flax:te_delayed",
            "flax:te_current",
        ):
            if fp8_ops and row in by:
                ok = by[row]["ms"] < fp8_ops["ms"]
                lines.append(
                    f"{'PASS' if ok else 'FAIL'}  {sec['block']}: {row} faster than "
                    f"flax:fp8_ops ({by[row]['ms']:.3f} vs {fp8_ops['ms']:.3f} ms)"
                )
        if base and base["peak_bytes"]:
            for row, r in by.items():
                if row.startswith("te_") and r["peak_bytes"]:
                    ok = r["peak_bytes"] <= base["peak_bytes"]
                    lines.append(
                        f"{'PASS' if ok else 'FAIL'}  {sec['block']}: {row} peak memory "
                        f"{r['peak_bytes'] / 2**20:.0f} MiB <= flax:bf16's "
                        f"{base['peak_bytes'] / 2**20:.0f} MiB"
                    )
    return lines


def markdown(result: dict) -> str:
    m = result["meta"]
    out = [
        f"# te_jax LayerNormMLP benchmark: {m['backend']} ({m['device']})",
        "",
        f"- date {m['date']}; command `{m['command']}`; jax {m['jax']}; reps {m['reps']} of "
        f"{m['target_ms']:.0f} ms, each after {m['settle_ms']:.0f} ms of untimed steps",
        "- one training step (forward + backward, no optimizer); bf16 compute, float32 "
        "parameters; peak = XLA's compiled memory analysis of the step",
        "",
    ]
    for sec in result["blocks"]:
        out += [
            f"## {sec['block']}: tokens {sec['tokens']}, hidden {sec['hidden']}, "
            f"intermediate {sec['intermediate']}",
            "",
            "| row | ms/step | TFLOP/s | speedup vs flax:bf16 | peak MiB | spread | dispatch ms "
            "| SM MHz | W | kernels |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in sec["rows"]:
            sp = "" if r["speedup"] is None else f"{r['speedup']:.3f}"
            pk = "" if r["peak_bytes"] is None else f"{r['peak_bytes'] / 2**20:.0f}"
            out.append(
                f"| {r['row']} | {r['ms']:.3f} | {r['tflops']:.1f} | {sp} | {pk} | "
                f"{r['spread']:.3f} | {r.get('dispatch_ms', 0):.3f} | {clock_cells(r)} | "
                f"{r['kernels']} |"
            )
        out.append("")
        out += _profile_markdown(sec)
    out += ["## Checks", "", "```", *result["checks"], "```", ""]
    return "\n".join(out)


def _profile_markdown(sec: dict) -> list[str]:
    """The ``--profile`` rows' traces: device time per kernel kind, then the top kernels."""
    prof = sec.get("profile") or {}
    if not prof:
        return []
    out = [
        f"### {sec['block']}: where the step's device time goes "
        f"(trace of {sec.get('profile_steps', 3)} steps)",
        "",
    ]
    if all(v is None for v in prof.values()):
        return out + ["No GPU kernels were traced (not a GPU backend).", ""]
    kinds = sorted({k for v in prof.values() if v for k in v["by_kind"]})
    out += [
        "| row | busy ms | span ms | GEMM TFLOP/s | "
        + " | ".join(f"{k} ms (launches)" for k in kinds)
        + " |",
        "|---|---|---|---|" + "---|" * len(kinds),
    ]
    for row, v in prof.items():
        if v:
            cells = [
                f"{v['by_kind'][k]['ms']:.3f} ({v['by_kind'][k]['launches']:.0f})"
                if k in v["by_kind"]
                else ""
                for k in kinds
            ]
            span = v.get("span_ms", 0.0)
            rate = f"{v['gemm_tflops']:.0f}" if "gemm_tflops" in v else ""
            out.append(
                f"| {row} | {v['busy_ms']:.3f} | {span:.3f} | {rate} | " + " | ".join(cells) + " |"
            )
    out.append("")
    for row, v in prof.items():
        if v:
            out += [
                f"{row}, top kernels:",
                "",
                "| kernel | kind | ms | launches |",
                "|---|---|---|---|",
            ]
            out += [
                f"| `{t['name'][:90]}` | {t['kind']} | {t['ms']:.3f} | {t['launches']:.0f} |"
                for t in v["top"]
            ]
            out.append("")
            if v.get("gaps"):
                out += [f"{row}, longest idle gaps:", "", "| us | after | before |"]
                out.append("|---|---|---|")
                out += [
                    f"| {g['us']:.1f} | `{g['after'][:60]}` | `{g['before'][:60]}` |"
                    for g in v["gaps"][:6]
                ]
                out.append("")
    return out


def plot(result: dict, path: str) -> str | None:
    plt = pyplot()
    if plt is None:
        return None
    secs = result["blocks"]
    fig, axes = plt.subplots(1, len(secs), figsize=(6 * len(secs), 4), squeeze=False)
    for ax, sec in zip(axes[0], secs, strict=True):
        rows = sec["rows"]
        colors = ["gray" if r["row"].startswith("flax") else "tab:blue" for r in rows]
        labels = [None if r["speedup"] is None else f"{r['speedup']:.2f}x" for r in rows]
        bar_panel(ax, rows, colors, labels, f"{sec['block']} (I={sec['intermediate']})")
    fig.suptitle(
        f"LayerNormMLP step, {result['meta']['device']} (labels: speedup over flax:bf16)",
        fontsize=11,
    )
    return save_figure(plt, fig, path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.mlp", description=__doc__.split("\n\n")[0]
    )
    add_step_args(p, ROWS)
    p.add_argument(
        "--hlo",
        action="store_true",
        help="also write each row's compiled step (XLA's optimized HLO) as "
        "mlp_<block>_<row>.hlo.txt under --out",
    )
    p.add_argument(
        "--profile",
        default="",
        help="rows whose step is traced (jax.profiler): device time per kernel kind and the "
        "top kernels, e.g. flax:bf16,te_linen:bf16",
    )
    p.add_argument(
        "--profile-steps",
        type=int,
        default=3,
        help="steps per trace (default 3, at the burst clocks that follow the profiler's start; "
        "tens of steps trace the sustained clocks of a power-limited step)",
    )
    p.add_argument(
        "--profile-top", type=int, default=12, help="kernels listed per traced row (default 12)"
    )
    args = p.parse_args(argv)
    args.profile = {r.strip() for r in args.profile.split(",") if r.strip()}
    import te_jax

    shape = step_defaults(args)
    rows = names(args.rows)
    bad = [r for r in rows if r not in ROWS]
    blocks = names(args.blocks)
    bad += sorted(args.profile - set(rows))
    if bad or any(b not in BLOCKS for b in blocks):
        p.error(f"unknown rows {bad} or blocks {blocks}; rows: {', '.join(ROWS)}")
    t0 = time.time()
    result = {"meta": run_meta("benchmarks.mlp", argv, args), "blocks": []}
    for block in blocks:
        sec = run_block(block, shape, rows, args, te_jax)
        result["blocks"].append(sec)
        for r in sec["rows"]:
            sp = "" if r["speedup"] is None else f"x{r['speedup']:.3f}"
            pk = "" if r["peak_bytes"] is None else f"{r['peak_bytes'] / 2**20:.0f} MiB"
            clk = r["clocks"]
            clk = f"{clk['sm_mhz']:.0f} MHz {clk['watts']:.0f} W  " if clk else ""
            print(
                f"{block:7s} {r['row']:25s} {r['ms']:9.3f} ms {r['tflops']:8.1f} TFLOP/s "
                f"{sp:>7s} {pk:>10s}  dispatch {r['dispatch_ms']:.3f} ms  {clk}{r['kernels']}",
                flush=True,
            )
    result["checks"] = checks(result)
    print("\n".join(result["checks"]))
    write_result(result, args, "mlp", markdown, plot, t0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
