"""``python -m te_jax.demo``: trains a small two-layer SwiGLU MLP with te_jax's activation.

The model is ``y = swiglu(x @ W1 + b1) @ W2 + b2`` with ``W1: (D, 2, F)`` (the gated layout
``(..., 2, F)``: activation input at index 0, linear input at index 1), fitted by Adam to a random
teacher network on synthetic data. The forward and backward of the activation are te_jax's
(``te_jax.activation``: ``act_lu`` forward, ``dact_lu`` backward). Every few steps the loss and
gradients are recomputed through the pure-JAX path to show the largest difference.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp

import te_jax


def init_params(key, d_model: int, d_ff: int):
    k1, k2 = jax.random.split(key)
    return {
        "w1": jax.random.normal(k1, (d_model, 2, d_ff)) * d_model**-0.5,
        "b1": jnp.zeros((2, d_ff)),
        "w2": jax.random.normal(k2, (d_ff, d_model)) * d_ff**-0.5,
        "b2": jnp.zeros((d_model,)),
    }


def mlp(params, x, implementation=None):
    h = jnp.einsum("bd,dkf->bkf", x, params["w1"]) + params["b1"]  # (batch, 2, d_ff)
    a = te_jax.activation(h, "swiglu", implementation=implementation)  # (batch, d_ff)
    return a @ params["w2"] + params["b2"]


def loss_fn(params, x, y, implementation=None):
    return jnp.mean((mlp(params, x, implementation) - y) ** 2)


def adam_step(params, grads, state, step, lr=3e-3, b1=0.9, b2=0.999, eps=1e-8):
    m = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, state["m"], grads)
    v = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g * g, state["v"], grads)
    t = step + 1
    params = jax.tree.map(
        lambda p, m, v: p - lr * (m / (1 - b1**t)) / (jnp.sqrt(v / (1 - b2**t)) + eps),
        params,
        m,
        v,
    )
    return params, {"m": m, "v": v}


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

    key = jax.random.PRNGKey(0)
    k_teacher, k_student, k_data = jax.random.split(key, 3)
    teacher = init_params(k_teacher, args.d_model, args.d_ff)
    params = init_params(k_student, args.d_model, args.d_ff)
    state = {"m": jax.tree.map(jnp.zeros_like, params), "v": jax.tree.map(jnp.zeros_like, params)}

    @jax.jit
    def train_step(params, state, step, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        params, state = adam_step(params, grads, state, step)
        return params, state, loss

    grad_ffi = jax.jit(
        jax.value_and_grad(
            lambda p, x, y: loss_fn(p, x, y, "ffi" if te_jax.ffi_available(backend) else None)
        )
    )
    grad_xla = jax.jit(jax.value_and_grad(lambda p, x, y: loss_fn(p, x, y, "xla")))

    # The compiled step must contain te_jax's custom calls when kernels exist.
    x0 = jax.random.normal(k_data, (args.batch, args.d_model))
    hlo = train_step.lower(params, state, 0, x0, mlp(teacher, x0, "xla")).as_text()
    print(f"te_jax kernels in the compiled training step: {'te_jax_act_lu' in hlo}")

    first = last = None
    max_diff = 0.0
    t0 = time.perf_counter()
    for step in range(args.steps):
        x = jax.random.normal(jax.random.fold_in(k_data, step), (args.batch, args.d_model))
        y = mlp(teacher, x, "xla")
        if step % 10 == 0 or step == args.steps - 1:
            (l1, g1), (l2, g2) = grad_ffi(params, x, y), grad_xla(params, x, y)
            diffs = jax.tree.leaves(jax.tree.map(lambda a, b: jnp.max(jnp.abs(a - b)), g1, g2))
            max_diff = max(max_diff, float(jnp.abs(l1 - l2)), *(float(d) for d in diffs))
        params, state, loss = train_step(params, state, step, x, y)
        loss = float(loss)
        first = loss if first is None else first
        last = loss
        if step % 5 == 0 or step == args.steps - 1:
            print(f"step {step:3d}  loss {loss:.5f}")
    elapsed = time.perf_counter() - t0

    print(f"loss: {first:.5f} -> {last:.5f} over {args.steps} steps ({elapsed:.1f} s)")
    print(f"largest difference from the pure-JAX path (loss and gradients): {max_diff:.3e}")
    if not last < first:
        print("ERROR: the loss did not go down")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
