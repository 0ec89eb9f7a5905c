"""Kernels quantized once for several uses (te_jax.quantize_kernel, dense / fused_mlp's
quantized_kernel, te_jax.flax.quantize_kernels): the same bits as quantizing in place, each
kernel quantized once per gradient-accumulation step on any backend, and the errors."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import te_jax
import te_jax.flax as tef

RECIPES = {
    "delayed": te_jax.recipe.DelayedScaling(amax_history_len=4),
    "current": te_jax.recipe.CurrentScaling(),
}


def _normal(seed, shape, scale=1.0, dtype=jnp.float32):
    return (jax.random.normal(jax.random.PRNGKey(seed), shape) * scale).astype(dtype)


def _assert_same(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(u), np.asarray(v))


def _cubed(y):
    """A loss whose gradient depends on y (a linear loss would hide the forward's rounding)."""
    return jnp.sum(y.astype(jnp.float32) ** 3)


# (activation, kernel shape, contracted kernel axes): plain, gated (K, 2, N), two contracted axes.
DENSE_CASES = [(None, (32, 48), 1), ("swiglu", (32, 2, 16), 1), ("gelu", (4, 8, 24), 2)]


def test_dense_with_the_codes_is_dense():
    """Output, every gradient and the next FP8 state bit for bit those of dense quantizing the
    kernel itself, in one program (delayed scaling: the kernel's next state from the codes'
    amax; current scaling is fused_mlp's test)."""
    qs = te_jax.QuantizerSet.create(RECIPES["delayed"])
    x = _normal(0, (2, 6, 32), dtype=jnp.bfloat16)

    def grads(x, kernels, qs, cached):
        out = []
        for (act, _, n_c), k in zip(DENSE_CASES, kernels, strict=True):
            xi = x.reshape(2, 6, *k.shape[:n_c])
            dims = (tuple(range(3 - 1, 3 - 1 + n_c)), tuple(range(n_c)))

            def loss(x, k, qs, act=act, n_c=n_c, dims=dims):
                qk = te_jax.quantize_kernel(k, qs, n_c) if cached else None
                y = te_jax.dense(x, k, None, act, qs, contracting_dims=dims, quantized_kernel=qk)
                return _cubed(y)

            out.append(jax.grad(loss, (0, 1, 2))(xi, k, qs))
        return out

    kernels = [_normal(i + 1, shape, 0.1) for i, (_, shape, _) in enumerate(DENSE_CASES)]
    f = jax.jit(grads, static_argnums=3)
    _assert_same(f(x, kernels, qs, True), f(x, kernels, qs, False))


def test_fused_mlp_with_the_codes_is_fused_mlp():
    q1, q2 = (te_jax.QuantizerSet.create(RECIPES["current"]) for _ in range(2))
    x = _normal(0, (16, 32), dtype=jnp.bfloat16)
    w1, w2 = _normal(1, (32, 2, 24), 0.1), _normal(2, (24, 32), 0.1)

    def grads(cached):
        def loss(x, w1, w2, q1, q2):
            qks = (te_jax.quantize_kernel(w1, q1), te_jax.quantize_kernel(w2, q2))
            y = te_jax.fused_mlp(
                x,
                w1,
                w2,
                None,
                None,
                "geglu",
                (q1, q2),
                quantized_kernels=qks if cached else (None, None),
            )
            return _cubed(y)

        return jax.grad(loss, (0, 1, 2, 3, 4))(x, w1, w2, q1, q2)

    _assert_same(*jax.jit(lambda: (grads(True), grads(False)))())


def _linen_mlp():
    mlp = tef.LayerNormMLP(64, activations="gelu", recipe=RECIPES["delayed"])
    x = _normal(3, (4, 8, 32), dtype=jnp.bfloat16)
    v = jax.jit(mlp.init)(jax.random.PRNGKey(0), x)

    def loss(params, fp8, cache, xb):
        out, _ = mlp.apply({"params": params, "fp8_metas": fp8, **cache}, xb)
        return _cubed(out)

    return mlp, x, v, loss


def _accumulate(mlp, loss, cached: bool, n: int = 2):
    """One gradient-accumulation step: n micro-batches in a scan from one FP8 state, the
    kernels' codes made once before the scan where ``cached``."""

    def step(v, x):
        params, fp8 = v["params"], v["fp8_metas"]
        cache = tef.quantize_kernels(mlp, v) if cached else {}

        def body(acc, xb):
            g_params, g_fp8 = jax.grad(loss, (0, 1))(params, fp8, cache, xb)
            return jax.tree.map(jnp.add, acc, g_params), g_fp8

        zeros = jax.tree.map(jnp.zeros_like, params)
        grads, news = jax.lax.scan(body, zeros, x.reshape(n, -1, *x.shape[1:]))
        merged = tef.merge_fp8_metas(
            mlp.recipe, fp8, *(jax.tree.map(lambda a, i=i: a[i], news) for i in range(n))
        )
        return grads, merged

    return jax.jit(step)


def test_linen_accumulation_with_quantize_kernels():
    """The cached accumulation step gives the uncached step's gradients and FP8 state, bit for
    bit. Its scan body quantizes no kernel (only x, the activation and the gradients) before
    any XLA pass; in the compiled step every kernel's te_jax_quantize sits outside the loop (on
    XLA:GPU, which runs no loop-invariant code motion, only the cache does that; XLA:CPU
    hoists the uncached step's too)."""
    mlp, x, v, loss = _linen_mlp()
    cached, plain = _accumulate(mlp, loss, True), _accumulate(mlp, loss, False)
    compiled = cached.lower(v, x).compile()
    _assert_same(compiled(v, x), plain(v, x))

    def quantizes_in_body(step):
        (scan,) = [e for e in _eqns(jax.make_jaxpr(step)(v, x).jaxpr) if e.primitive.name == "scan"]
        return sum(
            e.primitive.name == "te_jax_quantized" for e in _eqns(scan.params["jaxpr"].jaxpr)
        )

    assert quantizes_in_body(plain) - quantizes_in_body(cached) == 2  # the two kernels

    if not te_jax.ffi_available(jax.default_backend()):
        return  # the compiled step has no te_jax_quantize custom calls to count
    text = compiled.as_text()
    bodies = set(re.findall(r"body=(%[\w.\-]+)", text))
    assert bodies, "the scan is no loop"
    in_loop, outside = [], []
    for comp in re.split(r"\n(?=\S)", text):
        name = comp.split(" ", 1)[0]
        calls = [ln for ln in comp.splitlines() if 'custom_call_target="te_jax_quantize"' in ln]
        (in_loop if name in bodies else outside).extend(c.split("custom-call(")[0] for c in calls)
    for shape in ("f8e4m3fn[32,64]", "f8e4m3fn[64,32]"):  # the kernels' (K, F) codes
        assert sum(shape + "{" in r for r in outside) == 1, (shape, outside)
        assert not any(shape + "{" in r for r in in_loop), (shape, in_loop)


def _eqns(jaxpr):
    """Every equation of ``jaxpr`` and of the jaxprs nested in it (not into scan bodies, which
    the test walks itself)."""
    for e in jaxpr.eqns:
        yield e
        if e.primitive.name == "scan":
            continue
        for sub in jax.extend.core.jaxprs_in_params(e.params):
            yield from _eqns(sub)


def test_first_micro_batch_fills_the_collection_in_a_nested_model():
    """A model with te_jax modules inside it, applied on the first micro-batch with
    ``mutable=["quantized_kernels"]``: every module stores its kernels' codes there (init
    stores none), the other micro-batches read them, and the step's gradients and merged FP8
    state are bit for bit those of quantizing in every micro-batch."""
    import flax.linen as nn

    recipe = RECIPES["delayed"]

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = x + tef.LayerNormMLP(48, recipe=recipe, name="mlp_0")(x)[0]
            return x + tef.LayerNormMLP(48, recipe=recipe, name="mlp_1")(x)[0]

    model = Model()
    x = _normal(5, (2, 8, 32), dtype=jnp.bfloat16)
    v = jax.jit(model.init)(jax.random.PRNGKey(0), x[:1])
    assert set(v) == {"params", "fp8_metas"}

    def loss(params, fp8, cache, xb, fill=False):
        variables = {"params": params, "fp8_metas": fp8, **cache}
        if fill:
            out, filled = model.apply(variables, xb, mutable=[tef.QUANTIZED_KERNELS])
            return _cubed(out), filled
        return _cubed(model.apply(variables, xb)), None

    def step(params, fp8, x, cached):
        (_, cache), (g0, f0) = jax.value_and_grad(loss, (0, 1), has_aux=True)(
            params, fp8, {}, x[0], cached
        )
        cache = cache or {}
        (g1, f1) = jax.grad(lambda p, f: loss(p, f, cache, x[1])[0], (0, 1))(params, fp8)
        grads = jax.tree.map(jnp.add, g0, g1)
        return grads, tef.merge_fp8_metas(recipe, fp8, f0, f1), cache

    run = jax.jit(step, static_argnums=3)
    *cached, cache = run(v["params"], v["fp8_metas"], x, True)
    *plain, _ = run(v["params"], v["fp8_metas"], x, False)
    assert sorted(cache[tef.QUANTIZED_KERNELS]) == ["mlp_0", "mlp_1"]
    assert sorted(cache[tef.QUANTIZED_KERNELS]["mlp_0"]) == ["wi", "wo"]
    _assert_same(cached, plain)
    # every collection mutable (mutable=True) is not asking for the codes: none are stored
    _, updates = jax.eval_shape(lambda v: model.apply(v, x[0], mutable=True), v)
    assert tef.QUANTIZED_KERNELS not in updates


def test_nnx_modules_with_the_codes():
    """te_jax.nnx.quantize_kernels' codes given to the NNX LayerNormMLP and Linear: output,
    parameter gradients and the next FP8 state bit for bit those without, in one program."""
    from flax import nnx

    import te_jax.nnx as tnnx

    recipe = RECIPES["delayed"]
    mlp = tnnx.LayerNormMLP(32, 64, recipe=recipe, rngs=nnx.Rngs(0))
    lin = tnnx.Linear(32, 16, activation="gelu", recipe=recipe, rngs=nnx.Rngs(1))
    x = _normal(4, (2, 8, 32), dtype=jnp.bfloat16)
    wrt = nnx.DiffState(0, (nnx.Param, tnnx.FP8Meta))

    @nnx.jit
    def grads(mlp, lin, x):
        def loss(model, cached):
            cache = tnnx.quantize_kernels(model) if cached else None
            out = model(x, quantized_kernels=cache)
            return _cubed(out[0] if isinstance(out, tuple) else out)

        return [nnx.grad(loss, argnums=wrt)(m, c) for m in (mlp, lin) for c in (True, False)]

    g = grads(mlp, lin, x)
    _assert_same(nnx.to_pure_dict(g[0]), nnx.to_pure_dict(g[1]))
    _assert_same(nnx.to_pure_dict(g[2]), nnx.to_pure_dict(g[3]))
    with pytest.raises(TypeError, match="te_jax.nnx Linear"):
        tnnx.quantize_kernels(nnx.Linear(4, 4, rngs=nnx.Rngs(0)))


def test_errors():
    qs = te_jax.QuantizerSet.create(RECIPES["delayed"])
    x, w = jnp.ones((4, 32), jnp.bfloat16), jnp.ones((32, 16))
    qk = te_jax.quantize_kernel(w, qs)
    with pytest.raises(ValueError, match="without a quantizer_set"):
        jax.eval_shape(lambda: te_jax.dense(x, w, quantized_kernel=qk))
    with pytest.raises(ValueError, match=r"n_contracting=1"):
        jax.eval_shape(lambda: te_jax.dense(x, w[:, :8], quantizer_set=qs, quantized_kernel=qk))
    with pytest.raises(TypeError, match="quantize_kernel"):
        te_jax.dense(x, w, quantizer_set=qs, quantized_kernel=w)
    mx = te_jax.QuantizerSet.create(te_jax.recipe.MXFP8BlockScaling())
    with pytest.raises(ValueError, match="tensor scaling"):
        te_jax.quantize_kernel(w, mx)
    with pytest.raises(TypeError, match="QuantizerSet"):
        te_jax.quantize_kernel(w, None)
    with pytest.raises(ValueError, match="n_contracting"):
        te_jax.quantize_kernel(w, qs, n_contracting=2)
    with pytest.raises(TypeError, match="te_jax.flax DenseGeneral"):
        tef.quantize_kernels(object(), {})
    plain = tef.DenseGeneral(16)
    v = plain.init(jax.random.PRNGKey(0), x)
    with pytest.raises(ValueError, match="no recipe"):
        tef.quantize_kernels(plain, v)
