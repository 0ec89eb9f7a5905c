"""Public names no other test reaches directly: ``te_jax.layers.layernorm_mlp`` (against a
float64 block, and bitwise against the ops it is built from), ``te_jax.nnx.QuantizerState``,
``te_jax.sharding.sequence_parallel`` and ``te_jax.sharding.logical_constraint`` (what they
do without a mesh; on an 8-device mesh: tests/sharded/mlp_sharded_checks.py)."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import te_jax
from helpers import enable_x64
from te_jax import layers
from te_jax import nnx as tnnx
from te_jax.normalization import layernorm
from te_jax.recipe import CurrentScaling, DelayedScaling, MXFP8BlockScaling, QuantizerSet
from te_jax.sharding import BATCH, MLP, MeshResource, logical_constraint, sequence_parallel

H, INTER = 24, 40


# ---- te_jax.layers.layernorm_mlp ------------------------------------------------------------


def _block_operands(rng, act, norm):
    gated = act == "swiglu"
    k1_shape = (H, 2, INTER) if gated else (H, INTER)
    f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)  # noqa: E731
    return dict(
        x=f(2, 6, H),
        kernel_1=f(*k1_shape) / np.sqrt(H),
        kernel_2=f(INTER, H) / np.sqrt(INTER),
        bias_1=0.5 * f(*k1_shape[1:]),
        bias_2=0.5 * f(H),
        gamma=None if norm is None else 1 + 0.3 * f(H),
        beta=None if norm != "layernorm" else 0.3 * f(H),
    )


def _reference_norm(ops, norm):
    x = ops["x"]
    if norm is not None:
        xc = x - x.mean(-1, keepdims=True) if norm == "layernorm" else x
        x = xc / jnp.sqrt(jnp.mean(xc**2, -1, keepdims=True) + 1e-6) * ops["gamma"]
        if ops["beta"] is not None:
            x = x + ops["beta"]
    return x


def _reference_block(ops, act, norm, mask):
    """The block's math in float64: norm, dense, activation, ``· mask``, dense."""
    x = _reference_norm(ops, norm)
    k1 = ops["kernel_1"]
    h = x @ k1.reshape(H, -1) + ops["bias_1"].reshape(-1)
    if act == "swiglu":
        h = h.reshape(*h.shape[:-1], 2, INTER)
        y = jax.nn.silu(h[..., 0, :]) * h[..., 1, :]
    else:
        y = jax.nn.gelu(h, approximate=True)
    if mask is not None:
        y = y * mask
    return y @ ops["kernel_2"] + ops["bias_2"]


def _loss(out):
    # not linear in the output: its gradient at the output depends on the output
    return 0.5 * jnp.sum(jnp.square(out) * jnp.linspace(0.5, 1.5, out.shape[-1]))


LAYERS_CASES = [
    ("gelu", "layernorm", False),
    ("swiglu", "rmsnorm", True),
    ("gelu", None, True),
    ("swiglu", "layernorm", False),
]


@pytest.mark.parametrize(
    "act, norm, drop",
    LAYERS_CASES,
    ids=[f"{a}-{n}-{'drop' if d else 'nodrop'}" for a, n, d in LAYERS_CASES],
)
def test_layernorm_mlp_against_float64(act, norm, drop, rng):
    """``layers.layernorm_mlp``: the output and every gradient of a non-linear loss within
    float32 rounding of the float64 block (the ``dropout`` callable applied to the activation's
    output), and ``ln_out`` the norm's output (x itself without a norm)."""
    ops = _block_operands(rng, act, norm)
    mask = None
    if drop:  # a fixed "dropout": half the intermediate zeroed, the rest doubled
        mask = jnp.asarray(rng.integers(0, 2, (2, 6, INTER)) * 2.0, jnp.float32)
    kind = norm or "layernorm"

    def f(ops):
        return layers.layernorm_mlp(
            **ops,
            activation_type=act,
            layernorm_type=kind,
            dropout=None if mask is None else (lambda h: h * mask),
        )

    (loss, (out, ln_out)), grads = jax.jit(
        jax.value_and_grad(lambda o: (_loss(f(o)[0]), f(o)), has_aux=True)
    )(ops)
    if norm is None:
        np.testing.assert_array_equal(np.asarray(ln_out), np.asarray(ops["x"]))
    with enable_x64():  # one float64 program, not one per eager op
        ops64 = jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), ops)
        m64 = None if mask is None else jnp.asarray(mask, jnp.float64)

        @jax.jit
        def reference(o, m64):
            block64 = lambda o: _reference_block(o, act, norm, m64)  # noqa: E731
            loss64, grads64 = jax.value_and_grad(lambda o: _loss(block64(o)))(o)
            return loss64, grads64, block64(o), _reference_norm(o, norm)

        loss64, grads64, want_out, want_ln = jax.tree.map(np.asarray, reference(ops64, m64))

    def rel(a, b):
        return np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b)

    assert rel(out, want_out) <= 2e-6 and rel(ln_out, want_ln) <= 2e-7
    assert abs(float(loss) - float(loss64)) <= 2e-6 * abs(float(loss64))
    for name, g in grads.items():
        if g is None:
            assert ops[name] is None
            continue
        assert rel(g, grads64[name]) <= 2e-5, (name, rel(g, grads64[name]))


@pytest.mark.parametrize(
    "recipe", [None, DelayedScaling(amax_history_len=4)], ids=["f32", "delayed"]
)
def test_layernorm_mlp_is_norm_then_fused_mlp(recipe, rng):
    """Without dropout, ``layernorm_mlp`` is ``layernorm`` then ``fused_mlp`` with the quantizer
    sets passed through: the output, every gradient and the sets' next state bitwise."""
    ops = _block_operands(rng, "gelu", "layernorm")
    sets = (QuantizerSet.create(recipe), QuantizerSet.create(recipe))

    def block(ops, sets):
        return layers.layernorm_mlp(**ops, activation_type="gelu", quantizer_sets=sets)[0]

    def parts(ops, sets):
        ln = layernorm(ops["x"], ops["gamma"], ops["beta"])
        k = ("kernel_1", "kernel_2", "bias_1", "bias_2")
        return te_jax.fused_mlp(ln, *(ops[n] for n in k), "gelu", sets)

    got, want = (
        jax.jit(jax.value_and_grad(lambda o, s, f=f: _loss(f(o, s)), (0, 1)))(ops, sets)
        for f in (block, parts)
    )
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    if recipe is not None:  # the state moved: the sets' cotangent is the next state
        assert float(got[1][1][0].x.amax_history[-1]) > 0


# ---- te_jax.nnx.QuantizerState ----------------------------------------------------------------


def _fp8_meta(module) -> dict:
    return nnx.to_pure_dict(nnx.state(module, tnnx.FP8Meta))


@pytest.mark.parametrize(
    "recipe", [None, CurrentScaling(), MXFP8BlockScaling()], ids=["none", "current", "mxfp8"]
)
def test_quantizer_state_without_state(recipe):
    """No recipe: ``None``; a stateless recipe: a fresh set of its scaling mode; neither has an
    FP8Meta variable."""
    qs_state = tnnx.QuantizerState(recipe)
    assert _fp8_meta(qs_state) == {}
    got = qs_state()
    if recipe is None:
        assert got is None
        return
    want = QuantizerSet.create(recipe)
    assert isinstance(got, QuantizerSet) and got.state() == {}
    for role in ("x", "kernel", "grad"):
        g, w = getattr(got, role), getattr(want, role)
        assert type(g) is type(w) and g.q_dtype == w.q_dtype, role


def test_quantizer_state_holds_delayed_state_and_takes_its_gradient(rng):
    """Delayed scaling: one FP8Meta per ``QuantizerSet.state()`` name (scale ``()`` = 1,
    history ``(L,)`` zeros); calling it gives the set with the variables' values; the gradient of
    a loss through ``te_jax.dense`` with respect to the FP8Meta variables is that set's next
    state (each quantizer updated with its tensor's amax), and ``update_fp8_state`` writes it."""
    recipe = DelayedScaling(amax_history_len=5, margin=1)
    want_names = set(QuantizerSet.create(recipe).state())
    module = tnnx.QuantizerState(recipe)
    state = _fp8_meta(module)
    assert set(state) == want_names
    for name, v in state.items():
        assert np.shape(v) == (() if name.endswith("_scale") else (5,)), name
        np.testing.assert_array_equal(v, 1.0 if name.endswith("_scale") else 0.0)
    # values of a past step, so the set read back is not the fresh one
    for name in want_names:
        var = getattr(module, name)
        var.set_value(var[...] + (2.5 if name.endswith("_scale") else 0.75))
    qs = module()
    for name, v in qs.state().items():
        np.testing.assert_array_equal(np.asarray(v), np.asarray(getattr(module, name)[...]))

    class Dense(nnx.Module):
        def __init__(self, kernel):
            self.kernel = nnx.Param(kernel)
            self.quantizers = tnnx.QuantizerState(recipe)
            nnx.update(self.quantizers, nnx.state(module, tnnx.FP8Meta))

        def __call__(self, x):
            return te_jax.dense(x, self.kernel[...], quantizer_set=self.quantizers())

    x = jnp.asarray(rng.standard_normal((32, 16)), jnp.bfloat16)
    kernel = jnp.asarray(rng.standard_normal((16, 32)) / 4, jnp.float32)
    model = Dense(kernel)
    graphdef, params, fp8 = nnx.split(model, nnx.Param, tnnx.FP8Meta)

    def loss(fp8):
        return _loss(nnx.merge(graphdef, params, fp8)(x).astype(jnp.float32))

    new = jax.jit(jax.grad(loss))(fp8)
    amax = lambda a: jnp.max(jnp.abs(jnp.asarray(a, jnp.float32)))  # noqa: E731

    @jax.jit  # the oracle: one program, not one per eager op
    def oracle(qs):
        y, vjp = jax.vjp(lambda qs: te_jax.dense(x, kernel, quantizer_set=qs), qs)
        (want,) = vjp(jax.grad(lambda y: _loss(y.astype(jnp.float32)))(y).astype(y.dtype))
        updated = QuantizerSet(
            x=qs.x.update(amax(x)), kernel=qs.kernel.update(amax(kernel)), grad=want.grad
        )
        return want, updated

    want, updated = oracle(qs)
    for name, v in updated.state().items():
        np.testing.assert_array_equal(np.asarray(want.state()[name]), np.asarray(v), name)
    assert float(want.grad.amax_history[-1]) > 0  # the backward's amax recorded
    got = nnx.to_pure_dict(new)["quantizers"]
    for name, v in want.state().items():
        np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(v), err_msg=name)
    tnnx.update_fp8_state(model, new)
    for name, v in want.state().items():
        np.testing.assert_array_equal(np.asarray(getattr(model.quantizers, name)[...]), v)


# ---- te_jax.sharding.sequence_parallel / logical_constraint --------------------------------


@pytest.mark.parametrize("family", ["linen", "nnx"])
def test_sequence_parallel_reads_the_active_rules(family):
    """True exactly where the active logical axis rules split ``length``
    (``MeshResource.sp_resource``), under Linen's and NNX's rule contexts alike."""
    rules_ctx = nn.logical_axis_rules if family == "linen" else nnx.logical_axis_rules
    assert sequence_parallel() is False  # no rules
    cases = [
        (MeshResource(tp_resource="tensor"), False),
        (MeshResource(dp_resource="data", fsdp_resource="fsdp"), False),
        (MeshResource(tp_resource="tensor", sp_resource="tensor"), True),
        (MeshResource(dp_resource="data", sp_resource="seq"), True),
    ]
    for resource, want in cases:
        with rules_ctx(resource.logical_axis_rules()):
            assert sequence_parallel() is want, resource
    assert sequence_parallel() is False  # restored


def test_logical_constraint_without_a_mesh_is_the_identity(rng):
    """``axes=None``: x itself; logical names without rules, or rules without a mesh: x's
    values unchanged, traced or not (the sharding it asks for: the 8-device checks)."""
    x = jnp.asarray(rng.standard_normal((4, 6)), jnp.float32)
    assert logical_constraint(x, None) is x
    rules = MeshResource(dp_resource="data", tp_resource="tensor").logical_axis_rules()
    for ctx in (None, rules):
        with nn.logical_axis_rules(ctx or ()):
            for fn in (logical_constraint, jax.jit(logical_constraint, static_argnums=1)):
                np.testing.assert_array_equal(fn(x, (BATCH, MLP)), x)
