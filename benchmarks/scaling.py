"""Multi-GPU scaling of a sharded MLP training step: te_jax's ``LayerNormMLP`` stack (bf16, FP8
delayed and current scaling) against the Flax-native block sharded the same way, per
strategy, against the same step on one GPU; and where a tensor-parallel step's time goes.

    python -m benchmarks.scaling                           # every GPU of the host
    python -m benchmarks.scaling --gpus 2,4 --plot --out DIR
    XLA_FLAGS=--xla_force_host_platform_device_count=2 python -m benchmarks.scaling --quick

(On a CPU, give each fake device a core: XLA:CPU's collectives wait for every device's thread,
and with more devices than cores a lone all-reduce can wait forever.)

The step: ``--layers`` residual blocks (LayerNorm → dense → GELU → dense, biases on), the loss
``mean((out − y)²)``, its gradients and an AdamW update; parameters float32, compute bfloat16;
one ``jax.jit`` with the shardings ``te_jax.sharding.MeshResource``'s logical axis rules give
(the Flax-native block carries the same logical names: ``nn.with_logical_partitioning`` on its
parameters, ``nn.with_logical_constraint`` on its intermediate activation).

Strategies on ``n`` GPUs, and how they scale:

* ``dp``: data parallel over ``n``; weak scaling (``--tokens`` per GPU, the global batch ``n``
  times one GPU's);
* ``fsdp``: the same batch, every parameter split over ``n`` too; weak scaling;
* ``tp``: Megatron tensor parallel over ``n``; strong scaling (one GPU's batch);
* ``dp_tp``: data 2 × tensor ``n/2`` (``n ≥ 4``); weak over data, strong over tensor.

Per row: ms per step (median of ``--reps`` samples of the rows of one strategy, interleaved),
tokens per second, scaling efficiency (the one-GPU time of the same row divided by the tensor
axis size, over this time: 1.0 is perfect), and the speedup over ``flax:bf16`` of the same
strategy. For ``tp``: the all-reduce bytes of the compiled step (``benchmarks.collectives``),
a standalone all-reduce of one layer's ``(tokens, hidden)`` bf16 timed (the achieved NVLink
bus bandwidth, ``bytes · 2(n−1)/n / time``), the step of one tensor shard alone on one GPU
(``intermediate / n``: the step without communication), and a profiler trace of ``te:bf16``'s
step: per GPU, the NCCL kernels' time, how much of it runs while a compute kernel runs, and the
exposed rest. Writes ``scaling_<backend>_<n>.md`` / ``.json`` (and ``.png`` with ``--plot``)
under ``--out``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import sys
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from benchmarks._report import OUT_DIR, pyplot
from benchmarks._timing import time_functions
from benchmarks._trace import gpu_kernels, intersection, kind, length, union

ROWS = ("flax:bf16", "te:bf16", "te:delayed", "te:current")
GPU_SHAPE = {"layers": 2, "tokens": 8192, "seq": 2048, "hidden": 4096, "intermediate": 16384}
QUICK_SHAPE = {"layers": 2, "tokens": 256, "seq": 32, "hidden": 128, "intermediate": 512}


def strategies(n: int) -> list[tuple[str, dict]]:
    """``(name, mesh axes)`` of each strategy on ``n`` devices."""
    out = [("dp", {"data": n}), ("fsdp", {"data": n}), ("tp", {"tensor": n})]
    if n >= 4 and n % 2 == 0:
        out.append(("dp_tp", {"data": 2, "tensor": n // 2}))
    return out


def _resource(strategy: str, axes: dict):
    from te_jax.sharding import MeshResource

    data = "data" if "data" in axes else None
    return MeshResource(
        dp_resource=data if strategy.startswith("dp") else None,
        fsdp_resource=data if strategy.startswith("fsdp") else None,
        tp_resource="tensor" if "tensor" in axes else None,
    )


class TeStack(nn.Module):
    layers: int
    intermediate: int
    recipe: object

    @nn.compact
    def __call__(self, x):
        import te_jax.flax as tef

        for i in range(self.layers):
            out, _ = tef.LayerNormMLP(
                self.intermediate,
                activations=("gelu",),
                use_bias=True,
                recipe=self.recipe,
                return_layernorm_output=False,
                name=f"mlp{i}",
            )(x, deterministic=True)
            x = x + out
        return x


class FlaxStack(nn.Module):
    """The block as Flax users write it, with the logical names te_jax's modules use."""

    layers: int
    intermediate: int

    @nn.compact
    def __call__(self, x):
        from te_jax.sharding import BATCH, EMBED, LENGTH, MLP

        part, init = nn.with_logical_partitioning, nn.initializers
        for i in range(self.layers):
            h = nn.LayerNorm(
                dtype=jnp.bfloat16,
                epsilon=1e-6,
                scale_init=part(init.ones, (EMBED,)),
                bias_init=part(init.zeros, (EMBED,)),
                name=f"ln{i}",
            )(x)
            h = nn.Dense(
                self.intermediate,
                dtype=jnp.bfloat16,
                kernel_init=part(init.lecun_normal(), (EMBED, MLP)),
                bias_init=part(init.zeros, (MLP,)),
                name=f"wi{i}",
            )(h)
            h = nn.with_logical_constraint(jax.nn.gelu(h), (BATCH, LENGTH, MLP))
            h = nn.Dense(
                x.shape[-1],
                dtype=jnp.bfloat16,
                kernel_init=part(init.lecun_normal(), (MLP, EMBED)),
                bias_init=part(init.zeros, (EMBED,)),
                name=f"wo{i}",
            )(h)
            x = x + h
        return x


def _model(row: str, shape: dict, intermediate: int):
    import te_jax

    family, prec = row.split(":")
    if family == "flax":
        return FlaxStack(shape["layers"], intermediate)
    recipe = {
        "bf16": None,
        "delayed": te_jax.recipe.DelayedScaling(),
        "current": te_jax.recipe.CurrentScaling(),
    }[prec]
    return TeStack(shape["layers"], intermediate, recipe)


def build_step(row: str, shape: dict, mesh: Mesh, resource, tokens: int, intermediate=None):
    """``(step, state, data sets)``: the jitted training step sharded over ``mesh``, its state
    (parameters, FP8 state, AdamW state) and two ``(x, y)`` sets of ``tokens`` tokens, placed."""
    inter = intermediate or shape["intermediate"]
    model = _model(row, shape, inter)
    rng = np.random.default_rng(0)
    batch = tokens // shape["seq"]
    sets = [
        tuple(
            jnp.asarray(rng.standard_normal((batch, shape["seq"], shape["hidden"])), jnp.bfloat16)
            for _ in range(2)
        )
        for _ in range(2)
    ]
    rules = resource.logical_axis_rules()
    variables = model.init(jax.random.key(0), sets[0][0])
    specs = nn.logical_to_mesh(nn.get_partition_spec(variables), rules)
    fp8_name = next((k for k in variables if k != "params"), None)
    params = nn.meta.unbox(variables["params"])
    fp8 = variables[fp8_name] if fp8_name else {}
    tx = optax.adamw(1e-4)
    opt = tx.init(params)
    p_specs, f_specs = specs["params"], specs.get(fp8_name, {}) if fp8_name else {}
    o_specs = optax.tree_map_params(
        tx, lambda _, s: s, opt, p_specs, transform_non_params=lambda _: P()
    )

    def step(state, x, y):
        params, fp8, opt = state

        def loss_fn(params, fp8):
            v = {"params": params, **({fp8_name: fp8} if fp8_name else {})}
            out = model.apply(v, x)
            return jnp.mean(jnp.square(out.astype(jnp.float32) - y.astype(jnp.float32)))

        loss, (grads, new_fp8) = jax.value_and_grad(loss_fn, (0, 1))(params, fp8)
        updates, opt = tx.update(grads, opt, params)
        return (optax.apply_updates(params, updates), new_fp8, opt), loss

    shard = lambda s: NamedSharding(mesh, s)  # noqa: E731
    state_sh = jax.tree.map(shard, (p_specs, f_specs, o_specs), is_leaf=lambda s: isinstance(s, P))
    b = resource.batch_axes
    data_sh = shard(P(b if len(b) > 1 else (b[0] if b else None), None, None))
    jitted = jax.jit(
        step, in_shardings=(state_sh, data_sh, data_sh), out_shardings=(state_sh, None)
    )
    state = jax.device_put((params, fp8, opt), state_sh)
    sets = [jax.device_put(s, data_sh) for s in sets]
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        compiled = jitted.lower(state, *sets[0]).compile()
    return compiled, state, sets


def _mesh(axes: dict, devices) -> Mesh:
    n = int(np.prod(list(axes.values())))
    return Mesh(np.array(devices[:n]).reshape(tuple(axes.values())), tuple(axes))


def time_group(rows: list[str], shape, axes: dict, strategy: str, tokens: int, args) -> dict:
    """``{row: ms}`` of the rows' steps on ``axes``, samples interleaved."""
    mesh = _mesh(axes, jax.devices())
    resource = _resource(strategy, axes)
    fns = {}
    for row in rows:
        step, state, sets = build_step(row, shape, mesh, resource, tokens)
        fns[row] = functools.partial(
            lambda i, step, state, sets: step(state, *sets[i]), step=step, state=state, sets=sets
        )
    t = time_functions(fns, [(0,), (1,)], reps=args.reps, target_s=args.target_ms / 1e3)
    return {row: t[row].median_s * 1e3 for row in rows}


# ---------------------------------------------------------------------------------------------
# Where a tensor-parallel step's time goes.


def trace_overlap(fn, steps: int) -> dict:
    """Profiles ``steps`` calls of ``fn()``; per GPU, per step: the NCCL kernels run
    (``comm_kernels``), their time (``comm_ms``), the part of it during which a compute kernel
    also runs (``overlap_ms``), and the compute kernels' busy time (``compute_ms``)."""
    per_gpu = {}
    for gpu, kernels in gpu_kernels(fn, steps).items():
        comm, comp = [], []
        for name, start, dur in kernels:
            (comm if kind(name) == "nccl" else comp).append((start, start + dur))
        cu, ku = union(comm), union(comp)
        per_gpu[gpu] = {
            "comm_kernels": len(comm) / steps,
            "comm_ms": length(cu) / 1e6 / steps,
            "overlap_ms": intersection(cu, ku) / 1e6 / steps,
            "compute_ms": length(ku) / 1e6 / steps,
        }
    return {"per_gpu": per_gpu} if per_gpu else {"error": "the profiler recorded no GPU kernels"}


def _all_reduce_lines(text: str) -> list[str]:
    """``computation: instruction`` of each all-reduce in compiled HLO text (to tell an async
    wrapper's body from the ENTRY's own instructions)."""
    from te_jax.testing import hlo_collectives

    out, comp = [], "?"
    for line in text.splitlines():
        if line and not line[0].isspace() and line.rstrip().endswith("{"):
            comp = line.split("(")[0].split()[-1]
        if any(kind == "all-reduce" for kind, _, _ in hlo_collectives(line)):
            out.append(f"{comp}: {line.strip()[:200]}")
    return out


def tp_analysis(n: int, shape: dict, args) -> dict:
    """The TP step's all-reduce bytes, the standalone all-reduce bandwidth, the step of one
    shard without communication, and the trace of the step (module docstring)."""
    from benchmarks.collectives import measure

    axes = {"tensor": n}
    mesh = _mesh(axes, jax.devices())
    resource = _resource("tp", axes)
    tokens, hidden = shape["tokens"], shape["hidden"]
    step, state, sets = build_step("te:bf16", shape, mesh, resource, tokens)
    hlo_ar = measure(step.as_text()).get("all-reduce", {"bytes": 0, "count": 0})
    # Each all-reduce instruction, te_jax's and the Flax-native step's.
    reduces = {
        row: _all_reduce_lines(text)
        for row, text in (
            ("te:bf16", step.as_text()),
            ("flax:bf16", build_step("flax:bf16", shape, mesh, resource, tokens)[0].as_text()),
        )
    }

    # One layer's all-reduce alone: (tokens, hidden) bf16 summed over the tensor axis.
    ar = jax.jit(
        jax.shard_map(
            lambda a: jax.lax.psum(a, "tensor"), mesh=mesh, in_specs=P("tensor"), out_specs=P()
        )
    )
    rng = np.random.default_rng(1)
    ar_sets = [
        (
            jax.device_put(
                jnp.asarray(rng.standard_normal((n * tokens, hidden)), jnp.bfloat16),
                NamedSharding(mesh, P("tensor")),
            ),
        )
        for _ in range(2)
    ]
    local = build_step(
        "te:bf16",
        shape,
        _mesh({"tensor": 1}, jax.devices()),
        _resource("tp", {"tensor": 1}),
        tokens,
        intermediate=shape["intermediate"] // n,
    )
    fns = {
        "tp_step": lambda i: step(state, *sets[i]),
        "local_step": lambda i: local[0](local[1], *local[2][i]),
    }
    t = time_functions(fns, [(0,), (1,)], reps=args.reps, target_s=args.target_ms / 1e3)
    # XLA:CPU's in-process collectives can wait forever with calls of a lone all-reduce queued
    # behind each other: there, one call at a time.
    cpu = jax.default_backend() == "cpu"
    t.update(
        time_functions(
            {"all_reduce": ar},
            ar_sets,
            reps=args.reps,
            target_s=args.target_ms / 1e3,
            max_inner=1 if cpu else 2000,
        )
    )
    ar_bytes = tokens * hidden * 2
    ar_ms = t["all_reduce"].median_s * 1e3
    bus = ar_bytes * 2 * (n - 1) / n / (ar_ms / 1e3) / 1e9
    trace = trace_overlap(lambda: step(state, *sets[0]), args.trace_steps)
    out = {
        "gpus": n,
        "step_ms": t["tp_step"].median_s * 1e3,
        "local_step_ms": t["local_step"].median_s * 1e3,
        "hlo_all_reduce_bytes": hlo_ar["bytes"],
        "hlo_all_reduce_count": hlo_ar["count"],
        "one_all_reduce_bytes": ar_bytes,
        "one_all_reduce_ms": ar_ms,
        "bus_GBps": bus,
        "predicted_comm_ms": hlo_ar["bytes"] / ar_bytes * ar_ms,
        "all_reduce_lines": reduces,
        "trace": trace,
    }
    g = trace.get("per_gpu", {})
    if g:
        comm = float(np.mean([v["comm_ms"] for v in g.values()]))
        ovl = float(np.mean([v["overlap_ms"] for v in g.values()]))
        out["trace_comm_kernels"] = float(np.mean([v["comm_kernels"] for v in g.values()]))
        out["trace_comm_ms"] = comm
        out["trace_overlap_ms"] = ovl
        out["trace_exposed_ms"] = comm - ovl
        if comm > 0:
            out["trace_bus_GBps"] = hlo_ar["bytes"] * 2 * (n - 1) / n / (comm / 1e3) / 1e9
    return out


# ---------------------------------------------------------------------------------------------
# Report.


def markdown(result: dict) -> str:
    m, s = result["meta"], result["shape"]
    out = [
        f"# Sharded MLP training step: {m['backend']}, {m['gpus']} × {m['device']}",
        "",
        f"- date {m['date']}; command `{m['command']}`; jax {m['jax']}; reps {m['reps']}",
        f"- {s['layers']} LayerNorm → dense → GELU → dense blocks, hidden {s['hidden']}, "
        f"intermediate {s['intermediate']}, sequence {s['seq']}; {s['tokens']} tokens per "
        "data-parallel replica; loss, gradients and AdamW; float32 parameters, bf16 compute",
        "- efficiency: the one-GPU time of the row ÷ the tensor axis size ÷ this time "
        "(weak scaling over data, strong over tensor); speedup: flax:bf16 of the same "
        "strategy ÷ this row",
        "",
        "| strategy | GPUs | mesh | row | ms/step | tokens/s | efficiency | speedup vs flax:bf16 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        sp = "" if r["speedup"] is None else f"{r['speedup']:.3f}"
        out.append(
            f"| {r['strategy']} | {r['gpus']} | {r['mesh']} | {r['row']} | {r['ms']:.2f} | "
            f"{r['tokens_per_s']:,.0f} | {r['efficiency']:.3f} | {sp} |"
        )
    for tp in result.get("tp", []):
        n = tp["gpus"]
        out += [
            "",
            f"## Tensor parallel over {n} GPUs: te:bf16's step",
            "",
            f"- step {tp['step_ms']:.2f} ms; one tensor shard's step alone on one GPU "
            f"(intermediate / {n}, no communication) {tp['local_step_ms']:.2f} ms",
            f"- the compiled step all-reduces {tp['hlo_all_reduce_bytes'] / 2**20:.1f} MiB in "
            f"{tp['hlo_all_reduce_count']} all-reduces; one "
            f"{tp['one_all_reduce_bytes'] / 2**20:.1f} MiB all-reduce alone takes "
            f"{tp['one_all_reduce_ms']:.3f} ms "
            f"({tp['bus_GBps']:.1f} GB/s bus bandwidth), so the step's all-reduces are "
            f"{tp['predicted_comm_ms']:.2f} ms at that bandwidth",
        ]
        for row, lines in tp["all_reduce_lines"].items():
            out.append(f"- {row}'s all-reduces ({len(lines)}):")
            out += [f"  - `{line}`" for line in lines]
        if "trace_comm_ms" in tp:
            bus = tp.get("trace_bus_GBps")
            out.append(
                f"- trace (mean over GPUs, per step): {tp['trace_comm_kernels']:.1f} NCCL kernels, "
                f"{tp['trace_comm_ms']:.2f} ms"
                + (f" ({bus:.0f} GB/s bus bandwidth)" if bus else "")
                + f", of which {tp['trace_overlap_ms']:.2f} ms overlap a compute kernel; "
                f"exposed {tp['trace_exposed_ms']:.2f} ms = "
                f"{100 * tp['trace_exposed_ms'] / tp['step_ms']:.1f}% of the step"
            )
        else:
            out.append(f"- trace: no GPU kernels found ({tp['trace']})")
    return "\n".join(out) + "\n"


def plot(result: dict, path: str) -> str | None:
    plt = pyplot()
    if plt is None:
        return None
    rows = result["rows"]
    labels = sorted({(r["strategy"], r["gpus"]) for r in rows}, key=lambda k: (k[1], k[0]))
    names = list(dict.fromkeys(r["row"] for r in rows))
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(labels)), 4))
    width = 0.8 / len(names)
    for j, name in enumerate(names):
        by = {(r["strategy"], r["gpus"]): r for r in rows if r["row"] == name}
        xs = [i + j * width for i in range(len(labels))]
        ax.bar(
            xs,
            [by[k]["tokens_per_s"] / 1e3 if k in by else 0 for k in labels],
            width,
            label=name,
            color="gray" if name.startswith("flax") else None,
        )
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(labels))])
    ax.set_xticklabels([f"{s}\n{g} GPU" for s, g in labels], fontsize=8)
    ax.set_ylabel("thousand tokens / s")
    ax.legend(fontsize=8)
    ax.set_title(f"Sharded MLP training step, {result['meta']['device']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.scaling", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--gpus", default=None, help="device counts, e.g. 2,4 (default: all)")
    p.add_argument("--rows", default=",".join(ROWS), help="rows to time (default all)")
    p.add_argument("--strategies", default="dp,fsdp,tp,dp_tp")
    p.add_argument("--quick", action="store_true", help="tiny shapes, 3 samples (CPU smoke)")
    p.add_argument("--reps", type=int, default=None, help="samples per row (GPU 7, CPU 3)")
    p.add_argument("--target-ms", type=float, default=None, help="one sample's length")
    p.add_argument("--trace-steps", type=int, default=3)
    p.add_argument("--out", default=OUT_DIR, help="directory for .md / .json / .png")
    p.add_argument("--plot", action="store_true", help="also write a PNG bar chart")
    args = p.parse_args(argv)
    gpu = jax.default_backend() == "gpu"
    shape = dict(GPU_SHAPE if gpu and not args.quick else QUICK_SHAPE)
    args.reps = args.reps or (7 if gpu and not args.quick else 3)
    args.target_ms = args.target_ms or (300.0 if gpu and not args.quick else 20.0)
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    wanted = {s.strip() for s in args.strategies.split(",") if s.strip()}
    counts = [int(c) for c in args.gpus.split(",")] if args.gpus else [len(jax.devices())]
    if any(r not in ROWS for r in rows) or any(c < 2 or c > len(jax.devices()) for c in counts):
        p.error(
            f"rows {rows} (known: {', '.join(ROWS)}) or --gpus {counts} (each 2.."
            f"{len(jax.devices())}; on a CPU: XLA_FLAGS=--xla_force_host_platform_device_count=N)"
        )
    t0 = time.time()
    result = {
        "meta": {
            "backend": jax.default_backend(),
            "device": jax.devices()[0].device_kind,
            "gpus": max(counts),
            "jax": jax.__version__,
            "python": platform.python_version(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
            "command": "python -m benchmarks.scaling " + " ".join(argv or sys.argv[1:]),
            "reps": args.reps,
        },
        "shape": shape,
        "rows": [],
        "tp": [],
    }
    one = time_group(rows, shape, {"data": 1}, "dp", shape["tokens"], args)
    groups = [("one", 1, {"data": 1}, one)]
    for n in counts:
        for strategy, axes in strategies(n):
            if strategy in wanted:
                tokens = shape["tokens"] * axes.get("data", 1)
                ms = time_group(rows, shape, axes, strategy, tokens, args)
                groups.append((strategy, n, axes, ms))
                print(
                    f"{strategy} on {n}: " + ", ".join(f"{k} {v:.2f} ms" for k, v in ms.items()),
                    flush=True,
                )
    for strategy, n, axes, ms in groups:
        for row in rows:
            tensor, data = axes.get("tensor", 1), axes.get("data", 1)
            base = ms.get("flax:bf16")
            result["rows"].append(
                {
                    "strategy": strategy,
                    "gpus": n,
                    "mesh": "×".join(f"{k}={v}" for k, v in axes.items()),
                    "row": row,
                    "ms": ms[row],
                    "tokens_per_s": shape["tokens"] * data / (ms[row] / 1e3),
                    "efficiency": one[row] / tensor / ms[row],
                    "speedup": None if base is None else base / ms[row],
                }
            )
    if "tp" in wanted and "te:bf16" in rows:
        for n in counts:
            result["tp"].append(tp_analysis(n, shape, args))
    text = markdown(result)
    print(text)
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"scaling_{result['meta']['backend']}_{max(counts)}")
    with open(stem + ".json", "w") as f:
        json.dump(result, f, indent=1)
    with open(stem + ".md", "w") as f:
        f.write(text)
    written = [stem + ".md", stem + ".json"]
    if args.plot and plot(result, stem + ".png"):
        written.append(stem + ".png")
    print(f"wrote {', '.join(written)} (total {time.time() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
