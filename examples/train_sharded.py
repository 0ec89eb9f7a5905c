"""Train the MLP stack of examples/train_mlp.py sharded over a device mesh: data, FSDP and tensor
parallelism with te_jax's Flax modules, unchanged on CPU fake devices and on GPUs.

    python examples/train_sharded.py --mesh data=2,tensor=4            # 8 devices: DP x TP
    python examples/train_sharded.py --mesh data=8 --fsdp               # FSDP over 8 devices
    python examples/train_sharded.py --mesh data=2,tensor=4 --sp        # + sequence parallel
    python examples/train_sharded.py --mesh tensor=8 --recipe delayed --family nnx
    # on a CPU: XLA_FLAGS=--xla_force_host_platform_device_count=8 python examples/...

The mesh axes play the roles ``te_jax.sharding.MeshResource`` gives them (``data``: data
parallel, or FSDP with ``--fsdp``; ``tensor``: tensor parallel, and with ``--sp`` sequence
parallel too). Its logical axis rules map the
modules' parameter names to the mesh (``nn.logical_to_mesh`` for Linen,
``nnx.get_partition_spec`` under ``nnx.logical_axis_rules`` for NNX); the batch is split over
the data axis; the step is one ``jax.jit`` with those shardings, traced under the mesh and the
rules. Each run prints its loss, the collectives of the compiled step, and at the end compares
the losses with the same steps on one device (``--check``, the default) and checks that every
replicated array of the final state (parameters, optimizer moments, FP8 amax histories and
scales) holds the same bytes on each device that holds a copy of it.
"""

from __future__ import annotations

import argparse
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import te_jax
import te_jax.flax as tef
from te_jax import nnx as tnnx
from te_jax.sharding import MeshResource
from te_jax.testing import hlo_collectives

RECIPES = {
    "bf16": None,
    "delayed": te_jax.recipe.DelayedScaling(),
    "current": te_jax.recipe.CurrentScaling(),
}


class LinenStack(nn.Module):
    """``layers`` residual ``LayerNormMLP`` blocks."""

    layers: int
    intermediate: int
    activations: tuple[str, ...]
    recipe: te_jax.recipe.Recipe | None

    @nn.compact
    def __call__(self, x):
        for i in range(self.layers):
            out, _ = tef.LayerNormMLP(
                self.intermediate,
                activations=self.activations,
                recipe=self.recipe,
                return_layernorm_output=False,
                name=f"mlp{i}",
            )(x, deterministic=True)
            x = x + out
        return x


class NNXStack(nnx.Module):
    def __init__(self, args, recipe, rngs):
        self.layers = nnx.List(
            [
                tnnx.LayerNormMLP(
                    args.hidden,
                    args.intermediate,
                    activations=args.activations,
                    recipe=recipe,
                    return_layernorm_output=False,
                    rngs=rngs,
                )
                for _ in range(args.layers)
            ]
        )

    def __call__(self, x):
        for layer in self.layers:
            x = x + layer(x, deterministic=True)[0]
        return x


def linen_state(args, recipe, x0, rules):
    """``(state, state specs, step)``: params, FP8 state and optimizer state, their mesh
    PartitionSpecs, and the step function (not yet jitted)."""
    model = LinenStack(args.layers, args.intermediate, args.activations, recipe)
    variables = jax.jit(model.init)(jax.random.key(0), x0)  # one compiled program
    specs = nn.logical_to_mesh(nn.get_partition_spec(variables), rules)
    params, fp8 = nn.meta.unbox(variables["params"]), variables.get(tef.FP8_COLLECTION, {})
    p_specs, f_specs = specs["params"], specs.get(tef.FP8_COLLECTION, {})
    tx = optax.adamw(args.lr)
    opt = tx.init(params)
    # The optimizer's moments follow their parameters; its step count is replicated.
    o_specs = optax.tree_map_params(
        tx, lambda _, s: s, opt, p_specs, transform_non_params=lambda _: P()
    )

    def step(state, x, y):
        params, fp8, opt = state

        def loss_fn(params, fp8):
            out = model.apply({"params": params, tef.FP8_COLLECTION: fp8}, x)
            return jnp.mean(jnp.square(out.astype(jnp.float32) - y))

        loss, (grads, new_fp8) = jax.value_and_grad(loss_fn, (0, 1))(params, fp8)
        updates, opt = tx.update(grads, opt, params)
        return (optax.apply_updates(params, updates), new_fp8, opt), loss

    return (params, fp8, opt), (p_specs, f_specs, o_specs), step


def nnx_state(args, recipe, x0, rules):
    model = NNXStack(args, recipe, nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adamw(args.lr), wrt=nnx.Param)
    graphdef, state = nnx.split((model, optimizer))
    with nnx.logical_axis_rules(rules):
        specs = nnx.get_partition_spec(state)

    def step(state, x, y):
        model, optimizer = nnx.merge(graphdef, state)

        def loss_fn(model):
            return jnp.mean(jnp.square(model(x).astype(jnp.float32) - y))

        loss, grads = nnx.value_and_grad(
            loss_fn, argnums=nnx.DiffState(0, (nnx.Param, tnnx.FP8Meta))
        )(model)
        optimizer.update(model, grads)
        tnnx.update_fp8_state(model, grads)
        return nnx.state((model, optimizer)), loss

    return state, specs, step


def parse_mesh(text: str) -> dict[str, int]:
    """``"data=2,tensor=4"`` -> ``{"data": 2, "tensor": 4}`` (``--mesh``)."""
    out: dict[str, int] = {}
    for part in (p.strip() for p in text.split(",") if p.strip()):
        name, sep, size = part.partition("=")
        if not sep or not name.strip() or not size.strip().isdigit() or int(size) < 1:
            raise ValueError(f"--mesh: {part!r} must be name=size with size >= 1, e.g. data=2")
        if name.strip() in out:
            raise ValueError(f"--mesh: axis {name.strip()!r} given twice")
        out[name.strip()] = int(size)
    if not out:
        raise ValueError("--mesh: give at least one axis, e.g. data=8")
    return out


def collectives(text: str) -> str:
    counts: dict[str, int] = {}
    for op, _, _ in hlo_collectives(text):
        counts[op] = counts.get(op, 0) + 1
    return ", ".join(f"{k} x{v}" for k, v in sorted(counts.items())) or "none"


def replicas_differ(state) -> tuple[int, list[str]]:
    """``(copies compared, paths that differ)``: the shards of each array of ``state`` that
    cover the same index (its replicas over the mesh axes it is not split over), compared byte
    for byte."""
    compared, bad = 0, []
    for path, leaf in jax.tree_util.tree_leaves_with_path(state):
        if not isinstance(leaf, jax.Array):
            continue
        copies: dict[str, bytes] = {}
        for shard in leaf.addressable_shards:
            key, data = str(shard.index), np.asarray(shard.data).tobytes()
            if key in copies:
                compared += 1
                if copies[key] != data:
                    bad.append(jax.tree_util.keystr(path))
                    break
            else:
                copies[key] = data
    return compared, bad


def run(args, recipe_name: str, family: str, mesh: Mesh | None, resource: MeshResource):
    """The losses of ``args.steps`` steps, sharded over ``mesh`` (or on one device), the step's
    median ms, its collectives, and ``replicas_differ`` of the final state."""
    rng = np.random.default_rng(0)
    teacher = rng.standard_normal((args.hidden, args.hidden)) / np.sqrt(args.hidden)
    x = rng.standard_normal((args.batch, args.seq, args.hidden)).astype(np.float32)
    x, y = jnp.asarray(x, jnp.bfloat16), jnp.asarray(np.tanh(x @ teacher))
    rules = resource.logical_axis_rules()
    build = linen_state if family == "linen" else nnx_state
    state, specs, step = build(args, RECIPES[recipe_name], x, rules)
    if mesh is None:
        jitted, what = jax.jit(step), "one device"
        ctx = _nullcontext()
    else:
        shard = lambda s: NamedSharding(mesh, s)  # noqa: E731
        state_sh = jax.tree.map(shard, specs, is_leaf=lambda s: isinstance(s, P))
        batch = resource.batch_axes
        b = batch if len(batch) > 1 else (batch[0] if batch else None)
        data_sh = shard(P(b, resource.sp_resource, None))  # (batch, sequence, hidden)
        jitted = jax.jit(
            step, in_shardings=(state_sh, data_sh, data_sh), out_shardings=(state_sh, None)
        )
        state = jax.device_put(state, state_sh)
        x, y = jax.device_put(x, data_sh), jax.device_put(y, data_sh)
        what = " x ".join(f"{k}={v}" for k, v in mesh.shape.items())
        ctx = _MeshAndRules(mesh, rules)
    losses, times = [], []
    with ctx:
        text = jitted.lower(state, x, y).compile().as_text()
        for i in range(args.steps):
            t0 = time.perf_counter()
            state, loss = jitted(state, x, y)
            losses.append(float(loss))
            times.append(time.perf_counter() - t0)
            if i % args.log_every == 0 or i == args.steps - 1:
                print(f"  [{family} {recipe_name} {what}] step {i:3d}  loss {losses[-1]:.5f}")
    ms = 1e3 * float(np.median(times[1:])) if len(times) > 1 else float("nan")
    return losses, ms, collectives(text), replicas_differ(state)


class _MeshAndRules:
    """``with jax.set_mesh(mesh), nn.logical_axis_rules(rules):`` as one object."""

    def __init__(self, mesh, rules):
        self._mesh, self._rules = jax.set_mesh(mesh), nn.logical_axis_rules(rules)

    def __enter__(self):
        self._mesh.__enter__()
        self._rules.__enter__()

    def __exit__(self, *exc):
        self._rules.__exit__(*exc)
        return self._mesh.__exit__(*exc)


class _nullcontext:  # noqa: N801
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--mesh", default="data=2,tensor=4", help="axes and sizes, e.g. data=2,tensor=4"
    )
    ap.add_argument("--fsdp", action="store_true", help="the data axis shards parameters (FSDP)")
    ap.add_argument("--sp", action="store_true", help="sequence parallel over the tensor axis")
    ap.add_argument("--family", choices=["linen", "nnx"], default="linen")
    ap.add_argument("--recipe", choices=[*RECIPES, "all"], default="all")
    ap.add_argument("--activations", default="gelu", help="gelu, or a gated pair: silu,linear")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--intermediate", type=int, default=512)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--log-every", type=int, default=5)
    ap.add_argument("--no-check", dest="check", action="store_false", help="skip the 1-device run")
    args = ap.parse_args(argv)
    args.activations = tuple(a.strip() for a in args.activations.split(","))
    axes = parse_mesh(args.mesh)
    n = int(np.prod(list(axes.values())))
    if n > len(jax.devices()):
        ap.error(
            f"--mesh {args.mesh} needs {n} devices, jax has {len(jax.devices())} (on a CPU: "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={n})"
        )
    unknown = set(axes) - {"data", "tensor"}
    if unknown:
        ap.error(f"--mesh: axes are data and tensor, got {sorted(unknown)}")
    mesh = Mesh(np.array(jax.devices()[:n]).reshape(tuple(axes.values())), tuple(axes))
    data = "data" if "data" in axes else None
    resource = MeshResource(
        dp_resource=None if args.fsdp else data,
        fsdp_resource=data if args.fsdp else None,
        tp_resource="tensor" if "tensor" in axes else None,
        sp_resource="tensor" if args.sp and "tensor" in axes else None,
    )
    print(f"backend {jax.default_backend()}, {n} devices; {resource}")
    recipes = list(RECIPES) if args.recipe == "all" else [args.recipe]
    rows, bad = [], []
    for recipe in recipes:
        losses, ms, colls, (copies, differ) = run(args, recipe, args.family, mesh, resource)
        ref = run(args, recipe, args.family, None, resource)[0] if args.check else None
        diff = (
            None
            if ref is None
            else max(abs(a - b) / abs(b) for a, b in zip(losses, ref, strict=True))
        )
        replicas = f"{len(differ)} DIFFER" if differ else f"{copies} equal"
        rows.append((recipe, losses[0], losses[-1], ms, diff, replicas, colls))
        tol = 1e-2 if recipe == "bf16" else 5e-2
        if not losses[-1] < losses[0] or (diff is not None and diff > tol):
            bad.append(f"{recipe}: the loss did not go down, or left the 1-device run's")
        if differ:
            bad.append(f"{recipe}: replicas differ between devices: {', '.join(differ[:5])}")
    print("\nsummary")
    print(
        f"  {'recipe':8s} {'first':>9s} {'last':>9s} {'ms/step':>8s} {'vs 1 device':>11s} "
        f"{'replicas':>14s}  collectives"
    )
    for recipe, first, last, ms, diff, replicas, colls in rows:
        d = "-" if diff is None else f"{diff:.1e}"
        print(f"  {recipe:8s} {first:9.5f} {last:9.5f} {ms:8.2f} {d:>11s} {replicas:>14s}  {colls}")
    for line in bad:
        print(f"ERROR: {line}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
