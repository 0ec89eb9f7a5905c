"""Train a stack of transformer MLP blocks with te_jax's Flax modules, in bf16 or FP8.

    python examples/train_mlp.py                              # Linen and NNX, bf16 + every recipe
    python examples/train_mlp.py --family nnx --recipe delayed --layers 4 --steps 200
    python examples/train_mlp.py --recipe blockwise           # DeepSeek-V3's blockwise FP8
    python examples/train_mlp.py --hidden 1024 --tokens 8192  # GPU-sized

The model is ``layers`` residual blocks ``x = x + LayerNormMLP(x)`` (``te_jax.flax`` under
``nn.scan``, or ``te_jax.nnx`` under ``nnx.scan``; each layer rematerialised), fitted with optax
AdamW to a fixed random teacher on synthetic data. With an FP8 recipe the two GEMMs of every
layer run in FP8; delayed scaling's state (``fp8_metas`` in Linen, ``FP8Meta`` variables in
NNX) comes back as the gradient with respect to it and replaces the old state each step — it
never reaches the optimizer.
"""

from __future__ import annotations

import argparse
import re
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import te_jax
import te_jax.flax as tef
from te_jax import nnx as tnnx

RECIPES = {
    "bf16": None,
    "delayed": te_jax.recipe.DelayedScaling(),
    "current": te_jax.recipe.CurrentScaling(),
    "mxfp8": te_jax.recipe.MXFP8BlockScaling(),
    "blockwise": te_jax.recipe.Float8BlockScaling(),
}


def make_optimizer(args):
    """AdamW at ``args.lr``, constant or decayed to 0 over the run (``--lr-schedule cosine``)."""
    lr = args.lr
    if args.lr_schedule == "cosine":
        lr = optax.cosine_decay_schedule(args.lr, args.steps)
    return optax.adamw(lr)


# ---- Linen ------------------------------------------------------------------------------------


class ResidualMLP(nn.Module):
    """One layer: ``x + LayerNormMLP(x)``, shaped for ``nn.scan`` (carry, per-layer output)."""

    intermediate: int
    recipe: te_jax.recipe.Recipe | None

    @nn.compact
    def __call__(self, x, _):
        out, _ = tef.LayerNormMLP(
            self.intermediate,
            activations=("silu", "linear"),
            layernorm_type="rmsnorm",
            recipe=self.recipe,
            return_layernorm_output=False,
            name="mlp",
        )(x, deterministic=True)
        return x + out, None


class LinenStack(nn.Module):
    layers: int
    intermediate: int
    recipe: te_jax.recipe.Recipe | None

    @nn.compact
    def __call__(self, x):
        scanned = nn.scan(
            nn.remat(ResidualMLP),
            variable_axes={"params": 0, tef.FP8_COLLECTION: 0},
            split_rngs={"params": True},
            length=self.layers,
            metadata_params={nn.PARTITION_NAME: "layers"},
        )
        x, _ = scanned(self.intermediate, self.recipe, name="layers")(x, None)
        return x


def linen_trainer(args, recipe, x0):
    """``(state, step)``: the Linen model's variables and optimizer state, and a jitted step."""
    model = LinenStack(args.layers, args.intermediate, recipe)
    variables = jax.jit(model.init)(jax.random.key(0), x0)  # one compiled program
    params = nn.meta.unbox(variables["params"])
    fp8 = variables.get(tef.FP8_COLLECTION, {})
    tx = make_optimizer(args)

    @jax.jit
    def step(state, x, y):
        params, fp8, opt = state

        def loss_fn(params, fp8):
            out = model.apply({"params": params, tef.FP8_COLLECTION: fp8}, x)
            return jnp.mean(jnp.square(out.astype(jnp.float32) - y))

        loss, (grads, new_fp8) = jax.value_and_grad(loss_fn, (0, 1))(params, fp8)
        updates, opt = tx.update(grads, opt, params)
        # The FP8 "gradient" is the next FP8 state (never an optimizer input).
        return (optax.apply_updates(params, updates), new_fp8, opt), loss

    return (params, fp8, tx.init(params)), step


# ---- NNX --------------------------------------------------------------------------------------


def nnx_trainer(args, recipe, x0):
    """``(state, step)`` for the NNX model: ``layers`` LayerNormMLPs created under
    ``nnx.vmap`` and applied under ``nnx.scan``."""

    @nnx.vmap(in_axes=0, out_axes=0)
    def create(key):
        return tnnx.LayerNormMLP(
            args.hidden,
            args.intermediate,
            activations=("silu", "linear"),
            layernorm_type="rmsnorm",
            recipe=recipe,
            return_layernorm_output=False,
            rngs=nnx.Rngs(key),
        )

    layers = create(jax.random.split(jax.random.key(0), args.layers))
    optimizer = nnx.Optimizer(layers, make_optimizer(args), wrt=nnx.Param)

    @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
    @nnx.remat
    def forward(layer, x):
        return x + layer(x, deterministic=True)[0]

    @nnx.jit
    def step(state, x, y):
        layers, optimizer = state

        def loss_fn(layers):
            return jnp.mean(jnp.square(forward(layers, x).astype(jnp.float32) - y))

        # Differentiate with respect to the parameters and the FP8 state: the optimizer takes
        # the former (wrt=nnx.Param), the FP8 state becomes the latter's "gradient".
        loss, grads = nnx.value_and_grad(
            loss_fn, argnums=nnx.DiffState(0, (nnx.Param, tnnx.FP8Meta))
        )(layers)
        optimizer.update(layers, grads)
        tnnx.update_fp8_state(layers, grads)
        return loss

    return (layers, optimizer), lambda state, x, y: (state, step(state, x, y))


# ---- the run ----------------------------------------------------------------------------------


def te_jax_kernels(fn, *args) -> str:
    """The te_jax custom calls in ``fn``'s compiled form, counted."""
    text = fn.lower(*args).compile().as_text()
    counts: dict[str, int] = {}
    for name in re.findall(r'custom_call_target="(te_jax_\w+)"', text):
        counts[name] = counts.get(name, 0) + 1
    return ", ".join(f"{k} x{v}" for k, v in sorted(counts.items())) or "none (pure-JAX path)"


def train(family: str, recipe_name: str, args) -> dict:
    rng = np.random.default_rng(0)
    teacher = rng.standard_normal((args.hidden, args.hidden)) / np.sqrt(args.hidden)
    batches = []
    for _ in range(8):
        x = rng.standard_normal((args.tokens, args.hidden)).astype(np.float32)
        batches.append((jnp.asarray(x, jnp.bfloat16), jnp.asarray(np.tanh(x @ teacher))))
    trainer = linen_trainer if family == "linen" else nnx_trainer
    state, step = trainer(args, RECIPES[recipe_name], batches[0][0])
    kernels = (
        te_jax_kernels(step, state, *batches[0])
        if family == "linen"
        else "see the Linen run (the same modules)"
    )
    losses, times = [], []
    for i in range(args.steps):
        x, y = batches[i % len(batches)]
        t0 = time.perf_counter()
        state, loss = step(state, x, y)
        loss = float(loss)  # waits for the step
        times.append(time.perf_counter() - t0)
        losses.append(loss)
        if i % args.log_every == 0 or i == args.steps - 1:
            print(f"  [{family} {recipe_name}] step {i:4d}  loss {loss:.5f}", flush=True)
    step_ms = 1e3 * float(np.median(times[1:])) if len(times) > 1 else float("nan")
    return {
        "family": family,
        "recipe": recipe_name,
        "first": losses[0],
        "last": losses[-1],
        # the mean over the last pass through the batches: the end of training, less noisy
        "final": float(np.mean(losses[-len(batches) :])),
        "step_ms": step_ms,
        "kernels": kernels,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", choices=["linen", "nnx", "both"], default="both")
    ap.add_argument("--recipe", choices=[*RECIPES, "all"], default="all")
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--intermediate", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--lr-schedule", choices=["constant", "cosine"], default="constant")
    ap.add_argument("--log-every", type=int, default=20)
    args = ap.parse_args(argv)
    backend = jax.default_backend()
    print(
        f"backend {backend} ({jax.devices()[0].device_kind}); te_jax kernels: "
        f"{te_jax.ffi_available(backend)}"
    )
    families = ["linen", "nnx"] if args.family == "both" else [args.family]
    recipes = list(RECIPES) if args.recipe == "all" else [args.recipe]
    results = [train(f, r, args) for f in families for r in recipes]
    print("\nsummary")
    print(
        f"  {'family':6s} {'recipe':9s} {'first loss':>10s} {'last loss':>10s} "
        f"{'last pass':>10s} {'ms/step':>8s}"
    )
    for r in results:
        print(
            f"  {r['family']:6s} {r['recipe']:9s} {r['first']:10.5f} {r['last']:10.5f} "
            f"{r['final']:10.5f} {r['step_ms']:8.2f}"
        )
    for r in results:
        if r["family"] == "linen":
            print(f"  kernels ({r['recipe']}): {r['kernels']}")
    bad = [r for r in results if not r["last"] < r["first"]]
    for r in bad:
        print(f"ERROR: {r['family']} {r['recipe']}: the loss did not go down")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
