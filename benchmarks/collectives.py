"""Collectives of one sharded training step, read off the compiled HLO, against the analytic
minimum of each strategy.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m benchmarks.collectives
    python -m benchmarks.collectives --tokens 16384 --hidden 4096 --intermediate 16384 --out DIR

Compiles (does not run) one training step (forward + backward) of an ``--layers`` stack of
te_jax ``LayerNormMLP`` blocks (Linen; ``--recipe`` bf16 / delayed / current) for DP, FSDP, TP,
DP×TP and FSDP×TP on the first 8 devices (CPU fake devices or GPUs: the partition is the same),
and sums each kind of collective: the elements of the whole tensor it reduces or gathers (an
all-reduce's or all-gather's result, a reduce-scatter's operand) and their bytes in the dtype it
moves. Scalars (FP8 amax reductions) are counted apart. The analytic minimum, in elements, with
``T`` tokens, ``d`` the data axis, ``t`` the tensor axis, ``a`` the activation's width (2 gated):

* TP: the row-parallel GEMM's output all-reduced forward and its input gradient backward, per
  layer: ``2 · L · (T / d) · H``; with sequence parallelism (``tp_sp``) the same elements as
  all-gathers (the block's input forward, its output gradient backward) and as reduce-scatters,
  and the norm's parameter gradients (the norm runs on sequence shards) all-reduced;
* DP: every parameter's gradient all-reduced once (its tensor-parallel shard);
* FSDP: every parameter split along ``embed`` all-gathered once and its gradient
  reduce-scattered once; the others' (``wi_bias``) gradients all-reduced.

Writes ``collectives.md`` / ``.json`` under ``--out``. ``docs/sharding.md`` turns the bytes into
a step-time model at 8 and 64 GPUs.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from benchmarks import _report
from te_jax.testing import hlo_collectives

STRATEGIES = {
    "dp": {"data": 8},
    "fsdp": {"data": 8},
    "tp": {"tensor": 8},
    "tp_sp": {"tensor": 8},
    "dp_tp": {"data": 2, "tensor": 4},
    "fsdp_tp": {"data": 2, "tensor": 4},
}
SP_SEQ = 64  # the sequence length of the sequence-parallel row
_DEF = re.compile(r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+) = (?P<type>\([^)]*\)|[^\s(]+)", re.M)
_ARRAY = re.compile(r"(?P<dt>[a-z]+[0-9]*[a-z0-9]*)\[(?P<dims>[0-9,]*)\]")
_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "f8e4m3fn": 1, "f8e5m2": 1, "s32": 4, "u32": 4}


def _arrays(type_text: str) -> list[tuple[str, int]]:
    """``(dtype, elements)`` of each array in an HLO type (a tuple's elements too)."""
    out = []
    for m in _ARRAY.finditer(type_text):
        dims = [int(d) for d in m["dims"].split(",") if d]
        out.append((m["dt"], int(np.prod(dims)) if dims else 1))
    return out


def measure(text: str) -> dict:
    """``{kind: {"elements", "bytes", "count"}}`` of the data collectives, and ``"scalars"``."""
    types = {m["name"]: m["type"] for m in _DEF.finditer(text)}
    out: dict = {}
    scalars = 0
    for op, result_type, operands in hlo_collectives(text):
        if op == "reduce-scatter":  # the whole tensor is the operand
            arrays = [x for n in operands for x in _arrays(types.get(n, ""))]
        else:
            arrays = _arrays(result_type)
        for dt, n in arrays:
            if n <= 1:
                scalars += 1
                continue
            row = out.setdefault(op, {"elements": 0, "bytes": 0, "count": 0})
            row["elements"] += n
            row["bytes"] += n * _BYTES.get(dt, 4)
            row["count"] += 1
    out["scalars"] = scalars
    return out


def analytic(strategy: str, mesh: dict, args) -> dict:
    """The minimum elements per kind for ``strategy`` (module docstring)."""
    h, i, lay, a = args.hidden, args.intermediate, args.layers, len(args.act)
    d = mesh.get("data", 1)
    t = mesh.get("tensor", 1)
    # Per layer: (elements on one tensor shard, split along embed?)
    params = [
        (h, True),  # scale
        (h, True),  # ln_bias
        (a * h * i // t, True),  # wi_kernel
        (i * h // t, True),  # wo_kernel
    ]
    if args.bias:
        params += [(a * i // t, False), (h, True)]  # wi_bias, wo_bias
    out: dict = {}

    def add(kind, n):
        if n:
            out[kind] = out.get(kind, 0) + n * lay

    if strategy.endswith("_sp"):  # all-gather in, reduce-scatter out; the reverse backward
        add("all-gather", 2 * (args.tokens // d) * h)
        add("reduce-scatter", 2 * (args.tokens // d) * h)
        add("all-reduce", 2 * h)  # the norm (on sequence shards): its two (H,) gradients
    elif t > 1:
        add("all-reduce", 2 * (args.tokens // d) * h)
    if strategy.startswith("dp"):
        add("all-reduce", sum(n for n, _ in params))
    if strategy.startswith("fsdp"):
        add("all-gather", sum(n for n, e in params if e))
        add("reduce-scatter", sum(n for n, e in params if e))
        add("all-reduce", sum(n for n, e in params if not e))
    return out


def run(strategy: str, args):
    import te_jax
    import te_jax.flax as tef
    from te_jax.sharding import MeshResource

    axes = STRATEGIES[strategy]
    n = int(np.prod(list(axes.values())))
    mesh = Mesh(np.array(jax.devices()[:n]).reshape(tuple(axes.values())), tuple(axes))
    data = "data" if "data" in axes else None
    resource = MeshResource(
        dp_resource=data if strategy.startswith("dp") else None,
        fsdp_resource=data if strategy.startswith("fsdp") else None,
        tp_resource="tensor" if "tensor" in axes else None,
        sp_resource="tensor" if strategy.endswith("_sp") else None,
    )
    recipe = {
        "bf16": None,
        "delayed": te_jax.recipe.DelayedScaling(),
        "current": te_jax.recipe.CurrentScaling(),
    }[args.recipe]

    class Stack(nn.Module):
        @nn.compact
        def __call__(self, x):
            for k in range(args.layers):
                out, _ = tef.LayerNormMLP(
                    args.intermediate,
                    activations=args.act,
                    use_bias=args.bias,
                    recipe=recipe,
                    name=f"mlp{k}",
                )(x)
                x = x + out
            return x

    model = Stack()
    # (batch, sequence, hidden) under sequence parallelism (the sequence split), else (T, H).
    sp = resource.sp_resource
    shape = (args.tokens // SP_SEQ, SP_SEQ, args.hidden) if sp else (args.tokens, args.hidden)
    x = jax.ShapeDtypeStruct(shape, jnp.bfloat16)
    variables = jax.eval_shape(model.init, jax.random.key(0), x)
    rules = resource.logical_axis_rules()
    specs = nn.logical_to_mesh(nn.get_partition_spec(variables), rules)

    def step(v, x, dy):  # the loss too: without it XLA drops the last layer's output
        def loss(v):
            return jnp.sum(model.apply(v, x).astype(jnp.float32) * dy)

        return jax.value_and_grad(loss)(v)

    shard = lambda s: NamedSharding(mesh, s)  # noqa: E731
    v_sh = jax.tree.map(shard, specs, is_leaf=lambda s: isinstance(s, P))
    batch = resource.batch_axes
    b = batch if len(batch) > 1 else (batch[0] if batch else None)
    x_sh = shard(P(b, sp, None) if sp else P(b, None))
    jitted = jax.jit(step, in_shardings=(v_sh, x_sh, x_sh), out_shardings=(None, v_sh))
    dy = jax.ShapeDtypeStruct(x.shape, jnp.float32)
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        text = jitted.lower(variables, x, dy).compile().as_text()
    return axes, measure(text), analytic(strategy, axes, args)


def markdown(rows, args) -> str:
    lines = [
        f"# Collectives of one training step ({jax.default_backend()}, {args.recipe})",
        "",
        f"{args.layers} LayerNormMLP layers, tokens {args.tokens}, hidden {args.hidden}, "
        f"intermediate {args.intermediate}, activation {'/'.join(args.act)}; elements of the "
        "whole tensor each collective reduces or gathers, summed per kind.",
        "",
        "| strategy | mesh | kind | count | elements | analytic minimum | ratio | MiB moved |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        for kind in sorted(set(r["measured"]) - {"scalars"} | set(r["analytic"])):
            m = r["measured"].get(kind, {"elements": 0, "bytes": 0, "count": 0})
            want = r["analytic"].get(kind, 0)
            ratio = (
                f"{m['elements'] / want:.3f}" if want else ("-" if not m["elements"] else "extra")
            )
            lines.append(
                f"| {r['strategy']} | {r['mesh']} | {kind} | {m['count']} | {m['elements']} | "
                f"{want} | {ratio} | {m['bytes'] / 2**20:.2f} |"
            )
        n_scalars = r["measured"]["scalars"]
        lines.append(
            f"| {r['strategy']} | {r['mesh']} | scalar (loss, amax) | {n_scalars} | | | | |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.collectives", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--strategies", default=",".join(STRATEGIES))
    ap.add_argument("--recipe", choices=["bf16", "delayed", "current"], default="bf16")
    ap.add_argument("--act", default="silu,linear", help="gelu, or a gated pair (default SwiGLU)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--intermediate", type=int, default=1024)
    ap.add_argument("--no-bias", dest="bias", action="store_false", help="no GEMM biases")
    ap.add_argument("--out", default=_report.OUT_DIR)
    args = ap.parse_args(argv)
    args.act = tuple(a.strip() for a in args.act.split(","))
    if len(jax.devices()) < 8:
        ap.error(
            f"needs 8 devices, jax has {len(jax.devices())} (on a CPU: "
            "XLA_FLAGS=--xla_force_host_platform_device_count=8)"
        )
    rows, ok = [], True
    for s in [x.strip() for x in args.strategies.split(",") if x.strip()]:
        axes, measured, want = run(s, args)
        mesh = "×".join(f"{k}={v}" for k, v in axes.items())
        rows.append({"strategy": s, "mesh": mesh, "measured": measured, "analytic": want})
        for kind in sorted(set(measured) - {"scalars"} | set(want)):
            got = measured.get(kind, {}).get("elements", 0)
            match = got == want.get(kind, 0)
            ok &= match
            print(
                f"{'OK  ' if match else 'DIFF'} {s:8s} {mesh:18s} {kind:15s} {got:>12d} elements, "
                f"analytic {want.get(kind, 0):>12d}"
            )
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "collectives.md"), "w") as f:
        f.write(markdown(rows, args))
    with open(os.path.join(args.out, "collectives.json"), "w") as f:
        json.dump({"args": {k: v for k, v in vars(args).items()}, "rows": rows}, f, indent=1)
    print(f"wrote {args.out}/collectives.md, .json; {'all match' if ok else 'some differ'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
