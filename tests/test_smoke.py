"""The smoke pass (``pytest -m smoke``, the quick one): every public name of
te_jax (``te_jax.__all__``), the Linen and NNX modules and the sharding helpers, each called at
small shapes and checked against the pure-JAX path or a few lines of jax.numpy. The full suite
checks the same ops in depth; test_every_public_name_has_a_smoke_test fails when a name joins
``te_jax.__all__`` with no test here that calls it.
"""

from __future__ import annotations

import inspect
import re
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import te_jax
import te_jax.flax as tef
import te_jax.testing
from helpers import ACT_BY_ALIAS, dz_shape, make_dz, make_x, te_jax_custom_calls, tol
from te_jax import nnx as tnnx
from te_jax.quantize import CurrentScaleQuantizer, MXFP8Quantizer, QuantizeLayout
from te_jax.sharding import BATCH, MLP

pytestmark = pytest.mark.smoke


def _close(got, want, rtol):
    """Relative error of ``got`` against ``want``, as a norm."""
    g, w = np.asarray(got, np.float64), np.asarray(want, np.float64)
    err = np.linalg.norm(g - w) / max(np.linalg.norm(w), 1e-30)
    assert err <= rtol, f"relative error {err:.3g} > {rtol:.3g}"


# ---- the activation ops --------------------------------------------------------------------


@pytest.mark.parametrize("alias", ["gelu", "swiglu"])
def test_activation_ops_match_the_reference(alias, rng):
    """act_lu, dact_lu, quantize_dact_dbias and activation's gradient equal
    te_jax.activation_reference's, and lower to te_jax's kernels exactly where
    te_jax.kernels_enabled() says."""
    act = ACT_BY_ALIAS[alias]
    assert te_jax.ActivationType.parse(alias).is_gated == act.gated
    shape = (4, 2, 24) if act.gated else (4, 24)
    x = jnp.asarray(make_x(rng, shape, jnp.float32, act, kink_margin=0.02))
    dz = jnp.asarray(make_dz(rng, dz_shape(shape, act), jnp.float32))
    t = 2 * tol(jnp.float32, act)

    @jax.jit
    def ops(x, dz):
        dx, dbias = te_jax.quantize_dact_dbias(dz, x, alias)
        grad = jax.grad(lambda x: jnp.sum(te_jax.activation(x, alias) * dz))(x)
        return te_jax.act_lu(x, alias), te_jax.dact_lu(dz, x, alias), dx, dbias, grad

    ref = te_jax.activation_reference
    want_dx, want_dbias = ref.quantize_dact_dbias(dz, x, alias)
    want = (ref.act_lu(x, alias), ref.dact_lu(dz, x, alias), want_dx, want_dbias, want_dx)
    compiled = ops.lower(x, dz).compile()
    for got, w in zip(compiled(x, dz), want, strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(w), rtol=t, atol=t)
    calls = te_jax_custom_calls(compiled.as_text())
    assert bool(calls) == te_jax.kernels_enabled(), calls
    assert te_jax.ffi_available("cpu"), "the CPU extension is always built"


def test_clamped_swiglu_params(rng):
    """ActivationParams / ClampedSwiGLUParams reach the kernel: the reference's values for
    non-default parameters, which differ from the defaults'."""
    act = ACT_BY_ALIAS["clamped_swiglu"]
    params = te_jax.ActivationParams(
        clamped_swiglu=te_jax.ClampedSwiGLUParams(limit=0.75, alpha=1.5, glu_linear_offset=0.5)
    )
    x = jnp.asarray(make_x(rng, (8, 2, 16), jnp.float32, act, params))

    @jax.jit  # one program, not one per eager op
    def run(x):
        return (
            te_jax.act_lu(x, "clamped_swiglu", act_params=params),
            te_jax.activation_reference.act_lu(x, "clamped_swiglu", act_params=params),
            te_jax.act_lu(x, "clamped_swiglu"),
        )

    y, want, default = run(x)
    t = tol(jnp.float32, act)
    np.testing.assert_allclose(np.asarray(y), np.asarray(want), rtol=t, atol=t)
    assert not np.allclose(np.asarray(y), np.asarray(default))


# ---- dense, fused_mlp, recipes and the quantizer set ------------------------------------------


def _dense_inputs(rng):
    x = jnp.asarray(rng.standard_normal((32, 64)), jnp.float32)
    w1 = jnp.asarray(rng.standard_normal((64, 96)) / 8, jnp.float32)
    w2 = jnp.asarray(rng.standard_normal((96, 64)) / 10, jnp.float32)
    b1 = jnp.asarray(rng.standard_normal((96,)), jnp.float32)
    b2 = jnp.asarray(rng.standard_normal((64,)), jnp.float32)
    return x, w1, w2, b1, b2


def test_gemm_dense_and_fused_mlp(rng):
    """gemm is GEMM + bias + its epilogue; dense is GEMM + bias + any activation; fused_mlp is
    two of them."""
    x, w1, w2, b1, b2 = _dense_inputs(rng)

    @jax.jit  # one program, not one per eager op
    def run(x, w1, w2, b1, b2):
        h_want = jax.nn.gelu(jnp.dot(x, w1, precision="highest") + b1, approximate=True)
        y_want = jnp.dot(h_want, w2, precision="highest") + b2
        h = te_jax.dense(x, w1, b1, activation_type="gelu")
        g = te_jax.gemm(x, w1, b1, epilogue="gelu")
        y = te_jax.fused_mlp(x, w1, w2, b1, b2, activation_type="gelu")
        return h_want, y_want, h, g, y, te_jax.dense(h, w2, b2)

    h_want, y_want, h, g, y, y_of_h = run(x, w1, w2, b1, b2)
    _close(h, h_want, 1e-5)
    _close(g, h_want, 1e-5)
    _close(y, y_want, 1e-5)
    _close(y, y_of_h, 1e-5)


def test_quantize_kernel(rng):
    """quantize_kernel's codes, given to dense, are the codes dense makes itself."""
    x, w1, _, b1, _ = _dense_inputs(rng)
    qs = te_jax.QuantizerSet.create(te_jax.recipe.CurrentScaling())

    @jax.jit
    def run(x, w1, b1):
        qk = te_jax.quantize_kernel(w1, qs)
        return te_jax.dense(x, w1, b1, "gelu", qs, quantized_kernel=qk), te_jax.dense(
            x, w1, b1, "gelu", qs
        )

    cached, plain = run(x.astype(jnp.bfloat16), w1, b1)
    np.testing.assert_array_equal(np.asarray(cached), np.asarray(plain))


def test_dot_general_and_the_normed_ops(rng):
    """dot_general is lax.dot_general (here with a batch axis); layernorm_dense / layernorm_mlp
    are the norm followed by dense / the MLP, in TransformerEngine-JAX's signatures."""
    x, w1, w2, b1, b2 = _dense_inputs(rng)
    gamma = jnp.ones((x.shape[-1],), jnp.float32)
    beta = jnp.zeros((x.shape[-1],), jnp.float32)

    @jax.jit
    def run(x, w1, w2, b1, b2):
        xb = jnp.stack([x, 2 * x])  # (2, M, K) against per-batch weights (2, K, N)
        wb = jnp.stack([w1, w1])
        dn = (((2,), (1,)), ((0,), (0,)))
        got = te_jax.dot_general(xb, wb, dn)
        want = jax.lax.dot_general(xb, wb, dn, precision="highest")
        ln = (x - x.mean(-1, keepdims=True)) / jnp.sqrt(x.var(-1, keepdims=True) + 1e-6)
        d = te_jax.layernorm_dense(x, w1, gamma, beta, b1)
        m = te_jax.layernorm_mlp(x, gamma, beta, [w1, w2], [b1, b2], "layernorm")
        m_want = te_jax.fused_mlp(ln.astype(x.dtype), w1, w2, b1, b2)
        return got, want, d, te_jax.dense(ln.astype(x.dtype), w1, b1), m, m_want

    got, want, d, d_want, m, m_want = run(x, w1, w2, b1, b2)
    _close(got, want, 1e-5)
    _close(d, d_want, 1e-4)
    _close(m, m_want, 1e-4)


@pytest.mark.parametrize("recipe", ["DelayedScaling", "CurrentScaling", "MXFP8BlockScaling"])
def test_fp8_dense_with_a_quantizer_set(recipe, rng):
    """An FP8 dense and its gradients with each recipe's QuantizerSet: within FP8 noise of
    float32; delayed scaling's next state (the set's "gradient") holds the amax of x."""
    x, w1, *_ = _dense_inputs(rng)
    recipe = getattr(te_jax.recipe, recipe)()
    qs = te_jax.QuantizerSet.create(recipe)

    def loss(x, w, qs):
        return jnp.sum(te_jax.dense(x, w, activation_type="gelu", quantizer_set=qs) ** 2)

    got = jax.jit(jax.value_and_grad(loss, (0, 1, 2)))(x, w1, qs)
    want = jax.jit(jax.value_and_grad(lambda x, w: loss(x, w, None), (0, 1)))(x, w1)
    for g, w in zip((got[0], *got[1][:2]), (want[0], *want[1]), strict=True):
        _close(g, w, 0.1)
    state = got[1][2].state()
    if isinstance(recipe, te_jax.recipe.DelayedScaling):
        assert float(jnp.max(state["x_amax_history"])) == float(jnp.max(jnp.abs(x)))
    else:
        assert not state  # the current and block recipes keep no state


@pytest.mark.parametrize(
    "quantizer",
    [
        CurrentScaleQuantizer(jnp.float8_e4m3fn, QuantizeLayout.ROWWISE_COLWISE),
        MXFP8Quantizer(jnp.float8_e4m3fn, QuantizeLayout.ROWWISE),
    ],
    ids=["current", "mxfp8"],
)
def test_quantize_and_a_fused_quantized_activation(quantizer, rng):
    """te_jax.quantize on te_jax's kernel equals the pure-JAX path bit for bit, and act_lu with
    the quantizer equals quantize of act_lu."""
    x = jnp.asarray(rng.standard_normal((32, 64)) * 4, jnp.bfloat16)

    @jax.jit
    def run(x):
        ffi = te_jax.quantize.quantize(x, quantizer, implementation="ffi")
        return (
            ffi,
            te_jax.quantize.quantize(x, quantizer, implementation="xla"),
            te_jax.act_lu(x, "gelu", quantizer=quantizer),
            te_jax.quantize.quantize(te_jax.act_lu(x, "gelu"), quantizer),
            ffi.dequantize(),  # in the program, not op by op
        )

    ffi, xla, fused, composite, dequantized = run(x)
    for a, b in ((ffi, xla), (fused, composite)):
        for f in ("data", "scale_inv", "colwise_data", "colwise_scale_inv"):
            u, v = getattr(a, f), getattr(b, f)
            assert (u is None) == (v is None), f
            if u is not None:
                np.testing.assert_array_equal(np.asarray(u, np.float32), np.asarray(v, np.float32))
    _close(dequantized, x, 0.1)


# ---- the Flax modules ----------------------------------------------------------------------


def _mlp_reference(x, wi, wo):
    with jax.default_matmul_precision("highest"):
        return jax.nn.gelu(x @ wi, approximate=True) @ wo


def test_linen_layernorm_mlp(rng):
    """te_jax.flax.LayerNormMLP (no norm, no bias) is gelu(x · wi) · wo; with delayed scaling,
    update_fp8_metas takes the next state, which holds the amax of x."""
    x = jnp.asarray(rng.standard_normal((2, 4, 16)), jnp.float32)
    plain = tef.LayerNormMLP(32, activations="gelu", use_bias=False, enable_layernorm=False)
    v = jax.jit(plain.init)(jax.random.key(0), x)  # jitted: one program, not one per eager op
    p = nn.meta.unbox(v["params"])
    _close(jax.jit(plain.apply)(v, x)[0], _mlp_reference(x, p["wi_kernel"], p["wo_kernel"]), 1e-5)

    fp8 = tef.LayerNormMLP(
        32, activations="gelu", enable_layernorm=False, recipe=te_jax.recipe.DelayedScaling()
    )
    v = jax.jit(fp8.init)(jax.random.key(0), x)
    grads = jax.jit(jax.grad(lambda v: jnp.sum(fp8.apply(v, x)[0])))(v)
    new = tef.update_fp8_metas(v, grads)
    amax = new[tef.FP8_COLLECTION]["wi_x_amax_history"]
    assert float(jnp.max(amax)) == float(jnp.max(jnp.abs(x)))


def test_nnx_layernorm_mlp(rng):
    """te_jax.nnx.LayerNormMLP (no norm, no bias) is gelu(x · wi) · wo; with delayed scaling,
    update_fp8_state sets the FP8Meta variables to the next state, which holds the amax of x."""
    x = jnp.asarray(rng.standard_normal((2, 4, 16)), jnp.float32)
    plain = tnnx.LayerNormMLP(
        16, 32, activations="gelu", use_bias=False, enable_layernorm=False, rngs=nnx.Rngs(0)
    )
    forward = nnx.jit(lambda m: m(x)[0])  # one program, not one per eager op
    _close(forward(plain), _mlp_reference(x, plain.wi_kernel[...], plain.wo_kernel[...]), 1e-5)

    model = tnnx.LayerNormMLP(
        16,
        32,
        activations="gelu",
        enable_layernorm=False,
        recipe=te_jax.recipe.DelayedScaling(),
        rngs=nnx.Rngs(0),
    )
    wrt = nnx.DiffState(0, (nnx.Param, tnnx.FP8Meta))
    grads = nnx.jit(nnx.grad(lambda m: jnp.sum(m(x)[0]), argnums=wrt))(model)
    tnnx.update_fp8_state(model, grads)
    amax = model.wi_quantizers.x_amax_history[...]
    assert float(jnp.max(amax)) == float(jnp.max(jnp.abs(x)))


def test_autocast():
    """te_jax.autocast: a Linen module given no recipe takes the context's (DelayedScaling()
    by default: it gets an FP8 state), enabled=False turns it off inside (traced only)."""
    x = jnp.ones((2, 16), jnp.float32)
    init = lambda: jax.eval_shape(tef.DenseGeneral(16).init, jax.random.key(0), x)  # noqa: E731
    with te_jax.autocast():
        on = init()
        with te_jax.autocast(enabled=False):
            off = init()
    assert tef.FP8_COLLECTION in on and tef.FP8_COLLECTION not in off
    assert tef.FP8_COLLECTION not in init()


# ---- the sharding helpers ------------------------------------------------------------------


def test_sharding_helpers():
    """te_jax.sharding: MeshResource's logical axis rules, logical_constraint under a
    (one-device) mesh and the rules; te_jax.testing.hlo_collectives on a compiled module's
    text."""
    resource = te_jax.sharding.MeshResource(dp_resource="data", tp_resource="tensor")
    rules = resource.logical_axis_rules()
    assert dict(rules)[BATCH] == "data" and dict(rules)[MLP] == "tensor"
    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "tensor"))
    resource.check_mesh(mesh)
    x = jnp.arange(8.0).reshape(2, 4)
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        assert not te_jax.sharding.sequence_parallel()
        f = jax.jit(lambda x: te_jax.sharding.logical_constraint(x * 2, (BATCH, MLP)))
        y = f(x)
    assert y.sharding.is_equivalent_to(NamedSharding(mesh, P("data", "tensor")), 2)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x) * 2)
    text = "  ROOT %r = f32[8]{0} all-reduce(%c), to_apply=%sum"
    assert te_jax.testing.hlo_collectives(text) == [("all-reduce", "f32[8]{0}", ("c",))]


# ---- every public name has a smoke test ----------------------------------------------------


def test_every_public_name_has_a_smoke_test():
    """Each name of te_jax.__all__ is called (written ``te_jax.<name>``) by a test above."""
    module = sys.modules[__name__]
    sources = "\n".join(
        inspect.getsource(f)
        for name, f in vars(module).items()
        if name.startswith("test_") and f is not test_every_public_name_has_a_smoke_test
    )
    missing = [n for n in te_jax.__all__ if not re.search(rf"\bte_jax\.{n}\b", sources)]
    assert not missing, f"public names with no smoke test in {__file__}: {missing}"
