"""``python -m te_jax.demo``: trains a transformer MLP block built from te_jax's Flax modules.

The model is a residual ``x + LayerNormMLP(x)`` (``te_jax.flax.LayerNormMLP``: RMSNorm, a SwiGLU
first GEMM with its ``(D, 2, F)`` gated kernel, the second GEMM), fitted with optax Adam to a
random teacher on synthetic data, first unquantized and then with FP8 delayed scaling
(``te_jax.recipe.DelayedScaling``), whose state the training step carries from the gradient.
Every few steps the loss and gradients are recomputed on the pure-JAX path
(``implementation="xla"``) to show the largest difference. ``examples/train_mlp.py`` is the
fuller program (Linen and NNX, every recipe, a scanned stack of layers).
"""

from __future__ import annotations

import argparse
import re
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

import te_jax
import te_jax.flax as tef


class Block(nn.Module):
    """``x + LayerNormMLP(x)``."""

    d_ff: int
    recipe: te_jax.recipe.Recipe | None = None
    implementation: str | None = None

    @nn.compact
    def __call__(self, x):
        out, _ = tef.LayerNormMLP(
            self.d_ff,
            activations="swiglu",
            use_bias=True,
            layernorm_type="rmsnorm",
            recipe=self.recipe,
            implementation=self.implementation,
            name="mlp",
        )(x)
        return x + out


def run(recipe, args, data, teacher) -> tuple[float, float, float, str]:
    """Trains ``Block`` under ``recipe``: (first loss, last loss, largest difference from the
    pure-JAX path, te_jax kernels in the compiled step)."""
    model = Block(args.d_ff, recipe)
    xla_model = Block(args.d_ff, recipe, implementation="xla")
    x0 = data(0)
    variables = jax.jit(model.init)(jax.random.key(1), x0)  # one compiled program
    params, fp8 = nn.meta.unbox(variables["params"]), variables.get(tef.FP8_COLLECTION, {})
    tx = optax.adam(3e-3)
    opt = tx.init(params)

    def loss_fn(params, fp8, x, m=model):
        y = teacher.apply(teacher_vars, x)
        out = m.apply({"params": params, tef.FP8_COLLECTION: fp8}, x)
        return jnp.mean(jnp.square(out - y))

    teacher_vars = jax.jit(teacher.init)(jax.random.key(2), x0)
    grad_xla = jax.jit(jax.value_and_grad(lambda p, s, x: loss_fn(p, s, x, xla_model), (0, 1)))

    @jax.jit
    def step(params, fp8, opt, x):
        loss, (g, new_fp8) = jax.value_and_grad(loss_fn, (0, 1))(params, fp8, x)
        updates, opt = tx.update(g, opt, params)
        # The new FP8 state, and this step's gradients (compared with the pure-JAX path's).
        return optax.apply_updates(params, updates), new_fp8, opt, loss, g

    hlo = step.lower(params, fp8, opt, x0).compile().as_text()
    names = sorted(set(re.findall(r'custom_call_target="(te_jax_\w+)"', hlo)))
    first = last = None
    max_diff = 0.0
    for i in range(args.steps):
        x = data(i)
        compare = i % 10 == 0 or i == args.steps - 1
        if compare:  # the pure-JAX path's loss and gradients at the step's parameters
            l2, g2 = grad_xla(params, fp8, x)
        params, fp8, opt, loss, g1 = step(params, fp8, opt, x)
        if compare:
            d = jax.tree.leaves(jax.tree.map(lambda a, b: jnp.max(jnp.abs(a - b)), g1, g2[0]))
            max_diff = max(max_diff, float(jnp.abs(loss - l2)), *(float(v) for v in d))
        loss = float(loss)
        first = loss if first is None else first
        last = loss
        if i % 10 == 0 or i == args.steps - 1:
            print(f"  step {i:3d}  loss {loss:.5f}")
    return first, last, max_diff, ", ".join(names) or "none (pure-JAX path)"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--d-ff", type=int, default=256)
    args = ap.parse_args(argv)

    backend = jax.default_backend()
    print(f"backend: {backend} ({jax.devices()[0].device_kind})")
    print(f"te_jax FFI kernels registered for this backend: {te_jax.ffi_available(backend)}")
    key = jax.random.key(0)

    def data(i):
        return jax.random.normal(jax.random.fold_in(key, i), (args.batch, args.d_model))

    teacher = Block(args.d_ff // 2, implementation="xla")
    ok = True
    recipes = (("unquantized", None), ("FP8 delayed scaling", te_jax.recipe.DelayedScaling()))
    for name, recipe in recipes:
        print(f"{name}:")
        t0 = time.perf_counter()
        first, last, diff, kernels = run(recipe, args, data, teacher)
        print(
            f"  loss {first:.5f} -> {last:.5f} over {args.steps} steps "
            f"({time.perf_counter() - t0:.1f} s)"
        )
        print(f"  te_jax kernels in the compiled training step: {kernels}")
        print(f"  largest difference from the pure-JAX path (loss and gradients): {diff:.3e}")
        if not last < first:
            print("ERROR: the loss did not go down")
            ok = False
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
