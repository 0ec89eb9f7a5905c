"""``te_jax.ops`` benchmark: the LayerNormMLP block as a fused ``te_jax.ops.Sequential`` against
``te_jax.nnx.LayerNormMLP`` (bf16, FP8 delayed and current scaling), the same Sequential
unfused, and the Flax-native block; one training step each (forward + backward, no optimizer).

    python -m benchmarks.ops                         # GPU: tokens 8192, hidden 4096
    python -m benchmarks.ops --quick                 # tiny shapes, 3 samples (CPU smoke test)
    python -m benchmarks.ops --blocks gelu --rows te_nnx:delayed,ops:delayed --plot --out DIR

What is timed: the step of benchmarks.mlp, ``out = block(x)``, the loss ``sum(out · dy)`` (dy
standard normal: no FP8 underflow in the backward) and its gradients with respect to x, every
parameter and (FP8) the FP8 state, whose "gradient" is the next state. The te_jax rows are NNX
models stepped by ``nnx.jit(nnx.value_and_grad(loss, argnums=(DiffState(0, (Param, FP8Meta)),
1)))``, in NNX's tree mode (``graph=False``; ``--nnx-jit graph`` for the default graph mode,
whose compiled step returns every variable of the model and so copies all the parameters on
every call). The block (benchmarks.mlp's): tokens 8192, hidden H 4096, ``gelu`` (I 16384) and
``swiglu`` (I 10944), tiny under ``--quick`` and on a CPU. Rows, per block:

- ``te_nnx:<prec>``: ``te_jax.nnx.LayerNormMLP(H, I, activations=act, use_bias=True,
  recipe=...)``, its first output: the baseline of this benchmark.
- ``ops:<prec>``: ``ops.Sequential(ops.LayerNorm(H), ops.Linear(H, I or 2I), ops.Bias(..),
  ops.Activation(act), ops.Linear(I, H), ops.Bias(H), recipe=..., rngs=nnx.Rngs(0))``: its
  fused plan (``LayerNorm``, ``MLP``: one ``te_jax.fused_mlp`` both ways).
- ``ops_unfused:<prec>``: the same Sequential with ``fuse=False``: each basic op on its own.
- ``flax:bf16``: the Flax-native block of benchmarks.mlp, jitted (the user's reference).

``<prec>``: ``bf16`` (no recipe, x bf16), ``delayed`` (``DelayedScaling()``, timed in its steady
state: the state after three steps) and ``current`` (``CurrentScaling()``). The three te_jax
models of one precision hold the same parameters (copied from the Sequential); the first step's
output, dx and parameter gradients of every ``ops`` row are compared with ``te_nnx``'s
(``‖Δ‖/‖ref‖``; the run stops with an AssertionError above ``TOL``), and under delayed scaling
the output after the three steps too (the FP8 state carried: a check, PASS/FAIL). Per row: ms
per step
(benchmarks.mlp's method: median of ``--reps`` samples of ``--target-ms``, samples of all rows
interleaved, each after ``--settle-ms`` of untimed steps of its own row; inputs rotated over
``--sets`` sets), TFLOP/s of the six GEMMs, the speed ratio to ``te_nnx`` of its precision
(``te_nnx ms / row ms``: the target is ``ops`` >= 0.98, within 2%), the speedup over
``flax:bf16``, the step's peak memory (XLA's compiled memory analysis), the dispatch time, on a
GPU the SM clock and power, and the custom calls of the compiled step.

A second table, one GEMM + bias + GELU forward + backward (the same loss and gradients), bf16,
``x (M, K)``, M×K×N 8192×4096×16384 on a GPU (``--gemm``): ``gemm:ops``, ``ops.Sequential(
ops.Linear(K, N), ops.Bias(N), ops.Activation("gelu"))`` (fused: the bias and GELU in the
GEMM's epilogue, dact + dbias in one pass), ``gemm:ops_unfused`` (``fuse=False``) and
``gemm:xla``, ``jax.nn.gelu(x @ w + b, approximate=True)`` jitted (w, b the Sequential's float32
parameters cast to bf16, as the Linear does), and ``gemm:bias_only``, TE-PyTorch's plan for this
block (its ``ForwardLinearBiasActivation`` puts only the bias in the GEMM's epilogue, the GELU
runs as its own kernel): ``ops.Sequential(Linear, Bias, Identity(), Activation("gelu"))``, whose
Identity leaves the GEMM the bias alone (its backward: dact, then the Bias's own dbias). A
third, GEMM + bias + residual, M×K×K (8192×4096×4096 on a GPU): ``res:ops``,
``ops.Sequential(ops.Linear(K, K), ops.Bias(K), ops.AddResidual())`` (fused:
``ForwardLinearBiasAdd``, the residual the GEMM's addend), ``res:ops_unfused`` and ``res:xla``,
``x @ w + b + x`` jitted. Writes ``ops_<backend>.md`` / ``.json`` and, with ``--plot``
(matplotlib), ``ops_<backend>.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import functools
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
    step_loss,
    timed,
    value_and_grads,
    write_result,
)
from benchmarks._report import pyplot

PRECISIONS = ("bf16", "delayed", "current")
FAMILIES = ("te_nnx", "ops", "ops_unfused")
# The single-GEMM tables: each a Sequential whose forward is one fused GEMM, against XLA.
GEMM_TABLES = ("gemm", "res")
GEMM_TITLES = {"gemm": "GEMM + bias + GELU", "res": "GEMM + bias + residual"}
GEMM_ROWS = tuple(f"{t}:{r}" for t in GEMM_TABLES for r in ("ops", "ops_unfused", "xla"))
# TransformerEngine-PyTorch's plan for [Linear, Bias, GELU]: its ForwardLinearBiasActivation puts
# only the bias in the GEMM, the activation runs as its own kernel.
GEMM_ROWS = GEMM_ROWS[:2] + ("gemm:bias_only",) + GEMM_ROWS[2:]
ROWS = ("flax:bf16",) + tuple(f"{f}:{p}" for p in PRECISIONS for f in FAMILIES) + GEMM_ROWS
GEMM_GPU, GEMM_QUICK = (8192, 4096, 16384), (256, 128, 512)
# The target: an ops row at >= 0.98x the speed of te_nnx of its precision (within 2%).
TARGET = 0.98
# The largest ‖Δ‖/‖ref‖ of an ops row's output, dx or parameter gradient against te_nnx's (the
# same parameters): bit-identical where the plans run the same kernels, a bf16 rounding of h
# (~2⁻⁹) apart where GELU runs in the fused GEMM's epilogue, and the module rounds dbias and
# the norm's gradients to bf16 where the Sequential keeps float32 sums.
TOL = 2e-2
# An ops row's peak memory may exceed te_nnx's by this fraction (the module's bf16 norm and
# bias gradients against the Sequential's float32 sums: bytes).
PEAK_SLACK = 0.01
# The Sequential's op and parameter for each te_jax.nnx.LayerNormMLP parameter.
MODULE_PARAMS = {
    "scale": (0, "scale"),
    "ln_bias": (0, "bias"),
    "wi_kernel": (1, "kernel"),
    "wi_bias": (2, "bias"),
    "wo_kernel": (4, "kernel"),
    "wo_bias": (5, "bias"),
}


def _recipe(prec: str):
    import te_jax

    return {
        "bf16": None,
        "delayed": te_jax.recipe.DelayedScaling(),
        "current": te_jax.recipe.CurrentScaling(),
    }[prec]


def sequential_mlp(act, hidden: int, inter: int, recipe, fuse: bool):
    """The LayerNormMLP block (no residual) as ``te_jax.ops`` basic ops."""
    from flax import nnx

    from te_jax import ops

    wide = inter * len(act)
    return ops.Sequential(
        ops.LayerNorm(hidden),
        ops.Linear(hidden, wide),
        ops.Bias(wide),
        ops.Activation(act),
        ops.Linear(inter, hidden),
        ops.Bias(hidden),
        recipe=recipe,
        fuse=fuse,
        rngs=nnx.Rngs(0),
    )


def _first(y):
    """The block's output: te_jax.nnx.LayerNormMLP returns ``(out, ln_out)``."""
    return y[0] if isinstance(y, tuple) else y


@functools.cache
def _nnx_fns(graph: bool):
    """``(step, forward)`` of an NNX model, ``nnx.jit``-ed: ``step(model, x, dy)`` returns the
    loss and its gradients with respect to (the parameters and FP8 state, x)."""
    from flax import nnx

    from te_jax.nnx import FP8Meta

    def loss(model, x, dy):
        return step_loss(_first(model(x)), dy)

    diff = nnx.DiffState(0, (nnx.Param, FP8Meta))
    mode = {} if graph else {"graph": False}
    step = nnx.jit(nnx.value_and_grad(loss, argnums=(diff, 1)), **mode)
    forward = nnx.jit(lambda model, x: _first(model(x)), **mode)
    return step, forward


@jax.jit
def _rel(a, b):
    """``‖a - b‖ / ‖b‖`` (float32)."""
    a, b = jnp.ravel(a).astype(jnp.float32), jnp.ravel(b).astype(jnp.float32)
    return jnp.linalg.norm(a - b) / jnp.maximum(jnp.linalg.norm(b), 1e-30)


def _param_grads(row: str, grads) -> dict:
    """The parameter gradients by LayerNormMLP's names, flat (the Sequential's or the
    module's)."""
    if row.startswith("te_nnx"):
        return {n: jnp.ravel(grads[n][...]) for n in MODULE_PARAMS}
    return {n: jnp.ravel(grads["ops"][i][p][...]) for n, (i, p) in MODULE_PARAMS.items()}


def _plan(model) -> dict:
    """A Sequential's plans, as the ops' names."""
    return {d: [repr(op) for op in model.fused_plan(d)] for d in ("forward", "backward")}


def _mlp_models(rows: list[str], act, hidden: int, inter: int) -> dict:
    """``{row: model}`` for the te_jax rows (plus ``te_nnx:<prec>`` of every precision with an
    ops row: the reference the ops rows are checked against), parameters shared within a
    precision."""
    from flax import nnx

    from te_jax import nnx as tnnx

    models = {}
    for prec in PRECISIONS:
        want = [f"{f}:{prec}" for f in FAMILIES if f"{f}:{prec}" in rows]
        if not want:
            continue
        recipe = _recipe(prec)
        fused = sequential_mlp(act, hidden, inter, recipe, True)
        models[f"te_nnx:{prec}"] = ref = tnnx.LayerNormMLP(
            hidden,
            inter,
            activations=act,
            use_bias=True,
            recipe=recipe,
            return_layernorm_output=False,
            rngs=nnx.Rngs(0),
        )
        for name, (i, p) in MODULE_PARAMS.items():
            dst = getattr(ref, name)
            dst[...] = getattr(fused.ops[i], p)[...].reshape(dst[...].shape)
        if f"ops:{prec}" in want:
            models[f"ops:{prec}"] = fused
        if f"ops_unfused:{prec}" in want:
            unfused = sequential_mlp(act, hidden, inter, recipe, False)
            nnx.update(unfused, nnx.state(fused, nnx.Param))
            models[f"ops_unfused:{prec}"] = unfused
    return models


def _prepare(row: str, model, sets, args) -> tuple:
    """The compiled step's peak memory and custom calls, the first step's outputs (forward
    output, dx, parameter gradients) and, delayed scaling, its steady state (three steps, the
    FP8 state carried) with the forward output there: ``(fn, meta, first, steady)``."""
    from te_jax.nnx import update_fp8_state

    step, forward = _nnx_fns(args.nnx_jit == "graph")
    meta = _compiled(step, model, *sets[0])
    if hasattr(model, "fused_plan"):
        meta["plan"] = _plan(model)
    _, (grads, dx) = step(model, *sets[0])
    first = {"out": forward(model, sets[0][0]), "dx": dx}
    if row.split(":")[0] in FAMILIES:
        first.update(_param_grads(row, grads))
    steady = {}
    if row.endswith(":delayed"):
        for i in range(3):
            update_fp8_state(model, grads)
            if i < 2:
                grads = step(model, *sets[0])[1][0]
        steady["out"] = forward(model, sets[0][0])
    return functools.partial(step, model), meta, first, steady


def _compiled(step, *args) -> dict:
    """The compiled step's peak memory and custom calls (its calls reuse the executable)."""
    compiled = step.lower(*args).compile()
    return {"peak_bytes": peak_bytes(compiled), "kernels": custom_calls(compiled.as_text())}


def _errors(outputs: dict, ref: dict) -> dict:
    """``{name: ‖Δ‖/‖ref‖}`` for every output both hold."""
    return {k: float(_rel(v, ref[k])) for k, v in outputs.items() if k in ref}


def run_block(block: str, shape: dict, rows: list[str], args) -> dict:
    act = BLOCKS[block]
    tokens, hidden, inter = shape["tokens"], shape["hidden"], shape[block]
    sets = input_sets(tokens, hidden, hidden, args.sets)
    flop = 6 * tokens * hidden * inter * (len(act) + 1)
    fns, meta, refs = {}, {}, {}
    for row, model in _mlp_models(rows, act, hidden, inter).items():
        fn, meta[row], first, steady = _prepare(row, model, sets, args)
        prec = row.split(":")[1]
        if row.startswith("te_nnx"):
            refs[prec] = first, steady
        else:
            err = _errors(first, refs[prec][0])
            meta[row]["errors"] = err
            worst = max(err, key=err.get)
            if err[worst] > TOL:
                raise AssertionError(
                    f"{block} {row}: the first step's {worst} differs from te_nnx:{prec}'s by "
                    f"{err[worst]:.3g} (‖Δ‖/‖ref‖ > {TOL}); all: {err}"
                )
            if steady:
                meta[row]["steady_err"] = _errors(steady, refs[prec][1])["out"]
        if row in rows:
            fns[row] = fn
        del first, steady
    refs.clear()
    if "flax:bf16" in rows:
        m = flax_block(act, inter)
        state = m.init(jax.random.key(0), sets[0][0])
        step = jax.jit(value_and_grads(m.apply))
        meta["flax:bf16"] = _compiled(step, state, *sets[0])
        fns["flax:bf16"] = functools.partial(step, state)
    order = [r for r in ROWS if r in fns]
    timings, clocks = timed({r: fns[r] for r in order}, sets, args)
    out_rows = []
    for row in order:
        r = {**row_record(row, timings[row], clocks, flop), **meta[row]}
        base = timings.get("te_nnx:" + row.split(":")[1]) if row != "flax:bf16" else None
        r["vs_te_nnx"] = None if base is None else base.median_s / timings[row].median_s
        flax = timings.get("flax:bf16")
        r["speedup"] = None if flax is None else flax.median_s / timings[row].median_s
        if r.get("errors"):
            r["out_err"], r["err"] = r["errors"]["out"], max(r["errors"].values())
        out_rows.append(r)
    return dict(block=block, tokens=tokens, hidden=hidden, intermediate=inter, rows=out_rows)


def _gemm_ops(table: str, k: int, n: int, bias_only: bool = False) -> tuple:
    """The basic ops of a single-GEMM table's Sequential; ``bias_only``: an ``Identity`` between
    the Bias and the activation, so that the GEMM takes the bias alone (TE-PyTorch's plan)."""
    from te_jax import ops

    if table == "gemm":
        mid = (ops.Identity(),) if bias_only else ()
        return ops.Linear(k, n), ops.Bias(n), *mid, ops.Activation("gelu")
    return ops.Linear(k, n), ops.Bias(n), ops.AddResidual()


def _gemm_xla(table: str):
    """What a JAX user writes for the table's block: ``f(params, x)``, jitted by the caller."""

    def xla(p, x):
        kernel, bias = p["kernel"].astype(x.dtype), p["bias"].astype(x.dtype)
        if table == "gemm":
            return jax.nn.gelu(x @ kernel + bias, approximate=True)
        return x @ kernel + bias + x

    return xla


def run_gemm(table: str, mkn: tuple[int, int, int], rows: list[str], args) -> dict:
    """One GEMM with its epilogue (``GEMM_TITLES``), forward + backward: the Sequential fused
    and unfused, and XLA."""
    from flax import nnx

    from te_jax import ops

    m, k, n = mkn
    sets = input_sets(m, k, n, args.sets, seed=1)

    def seq(fuse, bias_only=False):
        return ops.Sequential(*_gemm_ops(table, k, n, bias_only), fuse=fuse, rngs=nnx.Rngs(0))

    fused_row, unfused_row, xla_row = (f"{table}:{r}" for r in ("ops", "ops_unfused", "xla"))
    models = {fused_row: seq(True), unfused_row: seq(False)}
    if f"{table}:bias_only" in rows:
        models[f"{table}:bias_only"] = seq(True, bias_only=True)
    for row in models:
        if row != fused_row:
            nnx.update(models[row], nnx.state(models[fused_row], nnx.Param))
    fns, meta, outs = {}, {}, {}
    for row, model in models.items():
        fns[row], meta[row], got, _ = _prepare(row, model, sets, args)
        outs[row] = got["out"]

    xla = _gemm_xla(table)
    lin, bias = models[fused_row].ops[0], models[fused_row].ops[1]
    params = {"kernel": lin.kernel[...], "bias": bias.bias[...]}
    step = jax.jit(value_and_grads(xla))
    meta[xla_row] = _compiled(step, params, *sets[0])
    fns[xla_row] = functools.partial(step, params)
    ref = jax.jit(xla)(params, sets[0][0])
    for row, y in outs.items():
        meta[row]["errors"] = {"out": float(_rel(y, ref))}
    order = [r for r in GEMM_ROWS if r in rows and r.startswith(f"{table}:")]
    timings, clocks = timed({r: fns[r] for r in order}, sets, args)
    out_rows = []
    for row in order:
        r = {**row_record(row, timings[row], clocks, 6 * m * k * n), **meta[row]}
        base = timings.get(xla_row)
        r["speedup"] = None if base is None else base.median_s / timings[row].median_s
        r["err"] = r["errors"]["out"] if r.get("errors") else None
        out_rows.append(r)
    return {"table": table, "m": m, "k": k, "n": n, "rows": out_rows}


def checks(result: dict) -> list[str]:
    gpu = result["meta"]["backend"] == "gpu" and not result["meta"]["quick"]
    lines = []
    for sec in result["blocks"]:
        by = {r["row"]: r for r in sec["rows"]}
        for prec in PRECISIONS:
            ref = by.get(f"te_nnx:{prec}")
            for fam in ("ops", "ops_unfused"):
                r = by.get(f"{fam}:{prec}")
                if ref is None or r is None:
                    continue
                v = r["vs_te_nnx"]
                status = ("PASS" if v >= TARGET else "FAIL") if gpu and fam == "ops" else "INFO"
                want = f" (wanted >= {TARGET}" + ("" if gpu else ", on a GPU") + ")"
                lines.append(
                    f"{status}  {sec['block']}: {r['row']} {v:.3f}x the speed of te_nnx:{prec}"
                    f"{want if fam == 'ops' else ''}; first step ‖Δ‖/‖ref‖: output "
                    f"{r['out_err']:.2g}, max of output, dx, gradients {r['err']:.2g}"
                )
                if r.get("steady_err") is not None:
                    ok = r["steady_err"] <= TOL
                    lines.append(
                        f"{'PASS' if ok else 'FAIL'}  {sec['block']}: {r['row']} after three "
                        f"steps (the FP8 state carried) output ‖Δ‖/‖ref‖ {r['steady_err']:.2g} "
                        f"vs te_nnx:{prec} (wanted <= {TOL}: the same FP8 state)"
                    )
                if fam == "ops" and r["peak_bytes"] and ref["peak_bytes"]:
                    more = r["peak_bytes"] - ref["peak_bytes"]
                    ok = more <= ref["peak_bytes"] * PEAK_SLACK
                    lines.append(
                        f"{'PASS' if ok else 'FAIL'}  {sec['block']}: {r['row']} peak memory "
                        f"{r['peak_bytes'] / 2**20:.1f} MiB, te_nnx:{prec}'s "
                        f"{ref['peak_bytes'] / 2**20:.1f} MiB ({more / 2**10:+.1f} KiB; wanted "
                        f"at most {100 * PEAK_SLACK:.0f}% more)"
                    )
    for g in result.get("gemms", []):
        for r in g["rows"]:
            if not r["row"].endswith(":xla") and r["speedup"] is not None:
                lines.append(
                    f"INFO  {r['row']} {r['speedup']:.3f}x {g['table']}:xla "
                    f"({GEMM_TITLES[g['table']]} step)"
                )
    return lines


def _cell(v, fmt: str) -> str:
    return "" if v is None else format(v, fmt)


def _table(rows: list[dict], ratio_cols: list[tuple[str, str]], err_cols) -> list[str]:
    heads = ["row", "ms/step", "TFLOP/s", *(h for h, _ in ratio_cols), "peak MiB"]
    heads += [h for h, _ in err_cols] + ["spread", "dispatch ms", "SM MHz", "W", "kernels"]
    out = ["| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
    for r in rows:
        pk = None if r["peak_bytes"] is None else r["peak_bytes"] / 2**20
        cells = [r["row"], f"{r['ms']:.3f}", f"{r['tflops']:.2f}"]
        cells += [_cell(r.get(k), ".3f") for _, k in ratio_cols]
        cells += [_cell(pk, ".1f"), *(_cell(r.get(k), ".2g") for _, k in err_cols)]
        cells.append(f"{r['spread']:.3f}")
        cells += [f"{r['dispatch_ms']:.3f}", clock_cells(r), r["kernels"]]
        out.append("| " + " | ".join(cells) + " |")
    return out


def _plans(rows: list[dict]) -> list[str]:
    seen, out = set(), []
    for r in rows:
        fam = r["row"].split(":")[0]
        key = r["row"] if fam in GEMM_TABLES else fam  # a single-GEMM table's rows differ
        if "plan" in r and key not in seen:
            seen.add(key)
            p = r["plan"]
            out.append(f"- `{key}` plan: forward {p['forward']}; backward {p['backward']}")
    return out + ([""] if out else [])


def section_markdown(sec: dict) -> list[str]:
    out = [
        f"## {sec['block']}: tokens {sec['tokens']}, hidden {sec['hidden']}, "
        f"intermediate {sec['intermediate']}",
        "",
    ]
    cols = [("speed vs te_nnx", "vs_te_nnx"), ("speedup vs flax:bf16", "speedup")]
    errs = [
        ("out ‖Δ‖/‖ref‖ vs te_nnx", "out_err"),
        ("max of out, dx, grads", "err"),
        ("out after 3 steps (delayed)", "steady_err"),
    ]
    return out + _table(sec["rows"], cols, errs) + [""] + _plans(sec["rows"])


def gemm_markdown(g: dict) -> list[str]:
    title = GEMM_TITLES[g["table"]]
    out = [f"## {title}, forward + backward: {g['m']}x{g['k']}x{g['n']} (M x K x N)", ""]
    cols = [(f"speedup vs {g['table']}:xla", "speedup")]
    errs = [("‖Δ‖/‖ref‖ vs xla", "err")]
    return out + _table(g["rows"], cols, errs) + [""] + _plans(g["rows"])


def markdown(result: dict) -> str:
    m = result["meta"]
    out = [
        f"# te_jax.ops benchmark: {m['backend']} ({m['device']})",
        "",
        f"- date {m['date']}; command `{m['command']}`; jax {m['jax']}; reps {m['reps']} of "
        f"{m['target_ms']:.0f} ms, each after {m['settle_ms']:.0f} ms of untimed steps; "
        f"nnx.jit in {m['nnx_jit']} mode",
        "- one training step (forward + backward, no optimizer); bf16 compute, float32 "
        "parameters; speed vs te_nnx = te_nnx ms / row ms (target for ops >= "
        f"{TARGET}); peak = XLA's compiled memory analysis of the step",
        "",
    ]
    for sec in result["blocks"]:
        out += section_markdown(sec)
    for g in result.get("gemms", []):
        out += gemm_markdown(g)
    out += ["## Checks", "", "```", *result["checks"], "```", ""]
    return "\n".join(out)


COLORS = {"flax": "gray", "te_nnx": "tab:blue", "ops": "tab:orange", "ops_unfused": "tab:green"}


def plot(result: dict, path: str) -> str | None:
    plt = pyplot()
    if plt is None:
        return None
    panels = [(f"{s['block']} (I={s['intermediate']})", s["rows"]) for s in result["blocks"]]
    for g in result.get("gemms", []):
        title = GEMM_TITLES[g["table"]].replace(" ", "")
        panels.append((f"{title} {g['m']}x{g['k']}x{g['n']}", g["rows"]))
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, (title, rows) in zip(axes[0], panels, strict=True):
        single = rows[0]["row"].split(":")[0] in GEMM_TABLES
        fams = [r["row"].split(":")[-1 if single else 0] for r in rows]
        ratios = [r.get("vs_te_nnx", r.get("speedup")) for r in rows]
        labels = [None if v is None else f"{v:.2f}x" for v in ratios]
        bar_panel(ax, rows, [COLORS.get(f, "gray") for f in fams], labels, title)
    fig.suptitle(
        f"te_jax.ops step, {result['meta']['device']} (labels: speed vs te_nnx; GEMMs: vs xla)",
        fontsize=11,
    )
    return save_figure(plt, fig, path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.ops", description=__doc__.split("\n\n")[0]
    )
    add_step_args(p, ROWS)
    p.add_argument(
        "--gemm",
        default=None,
        help="MxKxN of the GEMM + bias + GELU table (GPU 8192x4096x16384, else 256x128x512); "
        "the residual table takes M x K x K",
    )
    p.add_argument(
        "--nnx-jit",
        choices=("tree", "graph"),
        default="tree",
        help="nnx.jit's mode for the te_jax rows: tree (graph=False, default) or graph (NNX's "
        "default: the step returns, and so copies, every variable)",
    )
    args = p.parse_args(argv)
    shape = step_defaults(args)
    gpu = jax.default_backend() == "gpu"
    rows, blocks = names(args.rows), names(args.blocks)
    bad = [r for r in rows if r not in ROWS] + [b for b in blocks if b not in BLOCKS]
    if bad:
        p.error(f"unknown rows or blocks {bad}; rows: {', '.join(ROWS)}")
    gemm = GEMM_GPU if gpu and not args.quick else GEMM_QUICK
    if args.gemm:
        gemm = tuple(int(v) for v in args.gemm.lower().split("x"))
    t0 = time.time()
    meta = run_meta("benchmarks.ops", argv, args)
    result = {"meta": {**meta, "quick": args.quick, "nnx_jit": args.nnx_jit}, "blocks": []}
    if any(r.split(":")[0] not in GEMM_TABLES for r in rows):
        for block in blocks:
            sec = run_block(block, shape, rows, args)
            result["blocks"].append(sec)
            print("\n".join(section_markdown(sec)), flush=True)
    result["gemms"] = []
    for table in GEMM_TABLES:
        if any(r.startswith(f"{table}:") for r in rows):
            m, k, n = gemm if table == "gemm" else (gemm[0], gemm[1], gemm[1])
            result["gemms"].append(run_gemm(table, (m, k, n), rows, args))
            print("\n".join(gemm_markdown(result["gemms"][-1])), flush=True)
    result["checks"] = checks(result)
    print("\n".join(result["checks"]))
    write_result(result, args, "ops", markdown, plot, t0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
