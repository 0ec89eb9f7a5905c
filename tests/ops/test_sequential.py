"""te_jax.ops.Sequential: the fused plan against the unfused one (every activation, each
recipe), against te_jax's LayerNormMLP module, the plans it builds, FP8 state, transforms and
errors."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import helpers
import te_jax
from te_jax import ops
from te_jax.activation_types import ActivationType
from te_jax.nnx import FP8Meta, update_fp8_state

D, F = 32, 64  # hidden, intermediate
RECIPES = {
    "bf16": None,
    "delayed": te_jax.recipe.DelayedScaling(),
    "current": te_jax.recipe.CurrentScaling(),
    "mxfp8": te_jax.recipe.MXFP8BlockScaling(),
}


def mlp(
    act,
    recipe=None,
    fuse=True,
    norm=ops.LayerNorm,
    seed=0,
    residual=True,
    bias_init=None,
):
    bias_init = bias_init or nnx.initializers.normal(0.5)
    gated = ActivationType.parse(act).is_gated
    wide = 2 * F if gated else F
    tail = (ops.AddResidual(),) if residual else ()
    head = (norm(D),) if norm is not None else ()
    return ops.Sequential(
        *head,
        ops.Linear(D, wide),
        ops.Bias(wide, bias_init=bias_init),
        ops.Activation(act),
        ops.Linear(F, D),
        ops.Bias(D, bias_init=bias_init),
        *tail,
        recipe=recipe,
        fuse=fuse,
        rngs=nnx.Rngs(seed),
    )


def x_of(shape=(2, 32, D), seed=1):
    return jax.random.normal(jax.random.PRNGKey(seed), shape, jnp.bfloat16)


def loss(model, x):
    """Quadratic in the output, weighted: its gradients reach every rounding and scale."""
    y = model(x)
    w = jax.random.normal(jax.random.PRNGKey(9), y.shape)
    yf = y.astype(jnp.float32)
    return jnp.sum(w * yf * yf) / y.size * 64.0, y


@functools.cache
def _step():
    diff = nnx.DiffState(0, (nnx.Param, FP8Meta))
    return nnx.jit(nnx.grad(loss, argnums=diff, has_aux=True))


def step(model, x):
    """``(gradients incl. the next FP8 state, y)`` of one jitted step."""
    return _step()(model, x)


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / (np.max(np.abs(b)) + 1e-30))


def lba(act, recipe=None, fuse=True):
    """``[Linear, Bias, Activation, Linear]``: no MLP fusion (no second bias), so the forward
    runs ForwardLinearBiasActivation and the backward BackwardActivationBias, with the FP8
    hand-offs to and from the second Linear."""
    gated = ActivationType.parse(act).is_gated
    wide = 2 * F if gated else F
    zero = nnx.initializers.zeros
    return ops.Sequential(
        ops.Linear(D, wide),
        ops.Bias(wide, bias_init=zero),
        ops.Activation(act),
        ops.Linear(F, D),
        recipe=recipe,
        fuse=fuse,
        rngs=nnx.Rngs(0),
    )


# Each group is one jitted program (every pair's fused and unfused step side by side): the
# programs, not the comparisons, are what cost. Every activation goes through the MLP fusion and
# the unfused chain in bf16 (the activation's math is the recipe's in every one); the recipes
# meet the FP8 hand-offs on both patterns: (pattern, recipe) pairwise, delayed scaling on a gated
# and a non-gated activation in each pattern, the 3-op forward fusion that quantizes for the next
# Linear under delayed and current scaling, MXFP8 (whose hand-off is off) on both.
FUSED_GROUPS = {
    "every-activation-bf16": [("mlp", a.alias, "bf16") for a in helpers.ACTS],
    "mlp-fp8": [
        ("mlp", a, r)
        for a, r in (("gelu", "delayed"), ("swiglu", "delayed"), ("gelu", "current"))
        + (("gelu", "mxfp8"),)
    ],
    "lba": [
        ("lba", a, r)
        for a, r in (
            ("gelu", "bf16"),
            ("gelu", "delayed"),
            ("swiglu", "delayed"),
            ("swiglu", "mxfp8"),
            ("relu", "current"),
        )
    ],
}


@functools.cache
def _grad_fn():
    return nnx.grad(loss, argnums=nnx.DiffState(0, (nnx.Param, FP8Meta)), has_aux=True)


@nnx.jit
def _steps(models, x):
    """``step`` of each model, in one program."""
    return [_grad_fn()(m, x) for m in models]


def _pair(pattern, act, recipe):
    if pattern == "mlp":
        small = dict(norm=None, residual=False, bias_init=nnx.initializers.zeros)
        fused = mlp(act, RECIPES[recipe], **small)
        unfused = mlp(act, RECIPES[recipe], fuse=False, **small)
        assert "MLP(" in repr(fused.fused_plan()[0])
    else:
        fused, unfused = lba(act, RECIPES[recipe]), lba(act, RECIPES[recipe], fuse=False)
        assert "BackwardActivationBias" in repr(fused.fused_plan("backward"))
    return fused, unfused


@pytest.mark.parametrize("group", list(FUSED_GROUPS))
def test_fused_equals_unfused(group):
    """Outputs, gradients and next FP8 state bit for bit, except the bias gradients, which the
    fused ops sum in float32 from float32 dh (the MLP fusion's dbias_2: rounded to the compute
    dtype, as te_jax.fused_mlp does) where the unfused Bias sums the rounded dh (one bf16
    rounding per element). Zero biases: the fused GEMM adds the bias to its float32
    accumulator, the unfused Bias to the rounded product (one more rounding of h; the module
    test covers non-zero biases in the fused GEMM)."""
    cases = FUSED_GROUPS[group]
    models = [m for case in cases for m in _pair(*case)]
    results = _steps(models, x_of())
    for i, (pattern, act, recipe) in enumerate(cases):
        (g1, y1), (g0, y0) = results[2 * i], results[2 * i + 1]
        _check_fused_equals_unfused(f"{pattern}-{act}-{recipe}", act, recipe, g1, y1, g0, y0)


def _check_fused_equals_unfused(case, act, recipe, g1, y1, g0, y0):
    # On te_jax's CUDA GEMM GELU runs in the fused GEMM's epilogue on the float32 accumulator
    # where no FP8 hand-off to the next Linear takes the act_lu path (unquantized, and MXFP8,
    # whose hand-off is off); unfused, act_lu reads the rounded h: a bf16 rounding of h apart.
    # (ReLU's epilogue commutes with the rounding: bit for bit.)
    epilogue = recipe in ("bf16", "mxfp8") and act == "gelu" and jax.default_backend() == "gpu"
    if epilogue:
        assert _rel(y1, y0) <= 4 * 2.0**-8, case
    else:
        np.testing.assert_array_equal(np.asarray(y1), np.asarray(y0), case)
    p1, p0 = nnx.state(g1, nnx.Param), nnx.state(g0, nnx.Param)
    for (path, a), (_, b) in zip(
        jax.tree_util.tree_leaves_with_path(p1),
        jax.tree_util.tree_leaves_with_path(p0),
        strict=True,
    ):
        bias = "bias" in jax.tree_util.keystr(path)
        bound = 4 * 2.0**-8 if epilogue else 2 * 2.0**-8 if bias else 0.0
        assert _rel(a, b) <= bound, (case, jax.tree_util.keystr(path), _rel(a, b))
    s1, s0 = nnx.state(g1, FP8Meta), nnx.state(g0, FP8Meta)
    assert jax.tree.structure(s1) == jax.tree.structure(s0), case
    jax.tree.map(
        lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b), case), s1, s0
    )


def _module_loss(m, x):
    y = m(x)[0]
    w = jax.random.normal(jax.random.PRNGKey(9), y.shape)
    yf = y.astype(jnp.float32)
    return jnp.sum(w * yf * yf) / y.size * 64.0, y


@nnx.jit
def _sequential_and_module_steps(pairs, x):
    """``[(step(seq), step(module)), ...]`` in one program."""
    mod_grad = nnx.grad(_module_loss, argnums=nnx.DiffState(0, (nnx.Param, FP8Meta)), has_aux=True)
    return [(_grad_fn()(seq, x), mod_grad(mod, x)) for seq, mod in pairs]


def _sequential_and_module(act, recipe):
    """An MLP Sequential and a te_jax.nnx.LayerNormMLP with the same parameters."""
    gated = ActivationType.parse(act).is_gated
    seq = mlp(act, RECIPES[recipe], residual=False)
    mod = te_jax.nnx.LayerNormMLP(
        D, F, activations=act, use_bias=True, recipe=RECIPES[recipe], rngs=nnx.Rngs(0)
    )
    o = seq.ops
    k1 = o[1].kernel[...]
    mod.wi_kernel[...] = k1.reshape(D, 2, F) if gated else k1
    mod.wi_bias[...] = o[2].bias[...].reshape(mod.wi_bias[...].shape)
    mod.wo_kernel[...] = o[4].kernel[...]
    mod.wo_bias[...] = o[5].bias[...]
    # A norm whose output's amax is no FP8 value: its quantized copy's amax is not its own.
    o[0].scale[...] = mod.scale[...] = 1.37 + jax.random.uniform(jax.random.PRNGKey(5), (D,))
    o[0].bias[...] = mod.ln_bias[...] = jax.random.normal(jax.random.PRNGKey(6), (D,)) / 3
    return seq, mod


@pytest.mark.parametrize("recipe", ["bf16", "delayed"])
def test_equals_the_layernorm_mlp_module(recipe):
    """The Sequential MLP computes what te_jax.nnx.LayerNormMLP computes (same parameters),
    GELU and SwiGLU: the framework adds no arithmetic of its own. Under delayed scaling, over
    three more steps with the state advanced, the same FP8 state and outputs as the module."""
    acts = ("gelu", "swiglu")
    pairs = [_sequential_and_module(act, recipe) for act in acts]
    x = x_of()
    results = _sequential_and_module_steps(pairs, x)
    for act, ((gs, ys), (gm, ym)) in zip(acts, results, strict=True):
        np.testing.assert_array_equal(np.asarray(ys), np.asarray(ym), act)
        grads = {
            "wi_kernel": gs.ops[1].kernel,
            "wo_kernel": gs.ops[4].kernel,
            "wo_bias": gs.ops[5].bias,
            "wi_bias": gs.ops[2].bias,
            "scale": gs.ops[0].scale,
        }
        # The module rounds dbias and the norm's gradients to the compute dtype (its ops
        # return them in bf16); the Sequential's are float32 sums: one bf16 rounding apart.
        for name, g in grads.items():
            want = np.asarray(getattr(gm, name)[...]).reshape(np.shape(g[...]))
            bound = 1e-6 if "kernel" in name else 2.0**-8
            assert _rel(g[...], want) <= bound, (act, name, _rel(g[...], want))
    if RECIPES[recipe] is None:
        return
    # Three steps with the state advanced (the same compiled program): the same FP8 state and
    # outputs as the module (the norm's output reaches the fused MLP unquantized, its amax
    # measured once); the fourth step's outputs are those of the third state.
    for _ in range(3):
        for (seq, mod), ((gs, _), (gm, _)) in zip(pairs, results, strict=True):
            update_fp8_state(seq, gs)
            update_fp8_state(mod, gm)
        results = _sequential_and_module_steps(pairs, x)
    for act, (seq, mod), ((_, ys), (_, ym)) in zip(acts, pairs, results, strict=True):
        for mine, theirs in ((seq.ops[1], mod.wi_quantizers), (seq.ops[4], mod.wo_quantizers)):
            for name, v in nnx.state(theirs, FP8Meta).items():
                np.testing.assert_array_equal(
                    np.asarray(getattr(mine.quantizers, name)[...]), np.asarray(v[...]), name
                )
        np.testing.assert_array_equal(np.asarray(ys), np.asarray(ym), act)


def test_fused_plans():
    assert [repr(op) for op in mlp("gelu").fused_plan()] == [
        "LayerNorm",
        "MLP(Linear, Bias, Activation, Linear, Bias)",
        "AddResidual",
    ]
    assert [repr(op) for op in mlp("gelu").fused_plan("backward")] == [
        "LayerNorm",
        "MLP(Linear, Bias, Activation, Linear, Bias)",
        "AddResidual",
    ]
    assert [repr(op) for op in lba("gelu").fused_plan()] == [
        "ForwardLinearBiasActivation(Linear, Bias, Activation)",
        "Linear",
    ]
    assert [repr(op) for op in lba("gelu").fused_plan("backward")] == [
        "Linear",
        "BackwardActivationBias(Bias, Activation)",
        "Linear",
    ]
    # No epilogue for SwiGLU: the GEMM takes the bias, the activation runs as its own kernel.
    assert [repr(op) for op in lba("swiglu").fused_plan()] == [
        "ForwardLinearBiasActivation(Linear, Bias)",
        "Activation",
        "Linear",
    ]
    assert [repr(op) for op in mlp("gelu", fuse=False).fused_plan()] == [
        "LayerNorm",
        "Linear",
        "Bias",
        "Activation",
        "Linear",
        "Bias",
        "AddResidual",
    ]


def test_row_parallel_and_user_ops_are_left_alone():
    from .test_basic_ops import Double

    seq = ops.Sequential(
        ops.Linear(D, F, parallel_mode="row"),
        ops.Bias(F),
        ops.Activation("gelu"),
        ops.Linear(F, D),
        ops.Bias(D),
        Double(),
        ops.Activation("relu"),
        rngs=nnx.Rngs(0),
    )
    assert [repr(op) for op in seq.fused_plan()] == [
        "Linear",
        "Bias",
        "Activation",
        "ForwardLinearBiasActivation(Linear, Bias)",
        "Double",
        "Activation",
    ]
    assert [repr(op) for op in seq.fused_plan("backward")][:2] == [
        "Linear",
        "BackwardActivationBias(Bias, Activation)",
    ]
    g, y = step(seq, x_of())
    assert y.shape == (2, 32, D) and np.isfinite(np.asarray(y)).all()


def test_parameters_are_the_same_with_fusion_on_and_off():
    a, b = (
        nnx.state(mlp("swiglu", RECIPES["delayed"])),
        nnx.state(mlp("swiglu", RECIPES["delayed"], fuse=False)),
    )
    assert jax.tree.structure(a) == jax.tree.structure(b)
    jax.tree.map(lambda u, v: np.testing.assert_array_equal(np.asarray(u), np.asarray(v)), a, b)


def test_delayed_scaling_state_advances():
    seq = mlp("gelu", RECIPES["delayed"])
    x = x_of()
    before = jax.tree.map(np.array, nnx.state(seq, FP8Meta))  # a copy, not the live variables
    g, _ = step(seq, x)
    update_fp8_state(seq, g)
    after = nnx.state(seq, FP8Meta)
    q = after["ops"][1]["quantizers"]
    for role in ("x", "kernel", "grad"):
        hist = np.asarray(q[f"{role}_amax_history"][...])
        assert hist[-1] > 0, role  # this step's amax recorded
    changed = jax.tree.map(lambda u, v: bool(np.any(np.asarray(u) != np.asarray(v))), before, after)
    assert all(jax.tree.leaves(changed))
    # The next step quantizes with the new scales (different output, same shapes).
    update_fp8_state(seq, step(seq, x)[0])
    assert np.asarray(nnx.state(seq, FP8Meta)["ops"][4]["quantizers"]["x_scale"][...]) != 1.0


def test_scan_over_layers_with_remat():
    """nnx.scan over a stack of Sequential blocks (parameters stacked by nnx.vmap), with
    nnx.remat, equals the layers applied one by one, and differentiates (the output and the
    gradients in one jitted program)."""

    @nnx.jit
    @nnx.vmap(in_axes=0, out_axes=0)
    def make(seed):
        return mlp("gelu", RECIPES["current"], seed=0)

    layers = make(jnp.arange(2))

    @nnx.remat
    def body(layer, h):
        return layer(h)

    @nnx.jit
    @nnx.grad(has_aux=True)
    def scanned_grad(layers, x):
        @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
        def run(layer, h):
            return body(layer, h)

        y = run(layers, x)
        return jnp.sum(y.astype(jnp.float32) ** 2), y

    x = x_of()
    g, y = scanned_grad(layers, x)
    single = mlp("gelu", RECIPES["current"], seed=0)
    twice = nnx.jit(lambda m, x: m(m(x)))
    if jax.default_backend() == "cpu":
        np.testing.assert_array_equal(np.asarray(y), np.asarray(twice(single, x)))
    else:  # two programs: te_jax's GEMM may time different algorithms (summation orders)
        assert _rel(y, twice(single, x)) <= 2.0**-4
    assert g.ops[1].kernel[...].shape == (2, D, F)
    assert np.isfinite(np.asarray(g.ops[1].kernel[...])).all()


def test_errors_name_the_op_and_its_index():
    seq = ops.Sequential(ops.Linear(D, F), ops.Bias(D), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"Bias \(operation 1\).*\(\.\.\., 32\).*64"):
        seq(x_of())
    with pytest.raises(ValueError, match=r"Linear \(operation 0\).*\(\.\.\., 32\)"):
        ops.Sequential(ops.Linear(D, F), rngs=nnx.Rngs(0))(x_of((2, 16)))
    with pytest.raises(ValueError, match="Activation: .*nope"):
        ops.Activation("nope")
    with pytest.raises(ValueError, match="recipe .*no operation quantizes"):
        ops.Sequential(ops.Bias(D), recipe=RECIPES["delayed"], rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"Linear \(operation 0\).*rngs"):
        ops.Sequential(ops.Linear(D, F))
    with pytest.raises(TypeError, match="operation 1 is a int"):
        ops.Sequential(ops.Identity(), 3)
    with pytest.raises(ValueError, match=r"gated SWIGLU .*odd"):
        ops.Sequential(ops.Activation("swiglu"))(x_of((2, 3)))
    with pytest.raises(ValueError, match="extra inputs given"):
        ops.Sequential(ops.Identity())(x_of(), x_of())


def test_delayed_state_left_undifferentiated_warns():
    seq = mlp("gelu", RECIPES["delayed"])
    graphdef, state = nnx.split(seq)

    def grads(state, x):  # parameters only: the FP8 state left out
        return nnx.grad(lambda m, x: loss(m, x)[0])(nnx.merge(graphdef, state), x)

    with pytest.warns(te_jax.fp8_autodiff.FP8StateNotUpdatedWarning):  # at trace time
        jax.eval_shape(grads, state, x_of())


def test_forward_mode_is_a_clear_error():
    seq = mlp("gelu")
    with pytest.raises(TypeError, match="te_jax.ops.Sequential: forward-mode"):
        jax.eval_shape(lambda x: jax.jvp(lambda x: seq(x), (x,), (x,)), x_of())


def test_a_fusion_of_your_own():
    """A user fusion registered in both directions replaces its pattern in both plans and
    computes what the unfused ops compute."""
    from .test_basic_ops import Double

    class Halve(ops.BasicOperation):
        def op_forward(self, ctx, x, args, **_):
            return x / 2

        def op_backward(self, ctx, dy):
            return dy / 2, {}

    class DoubleHalve(ops.FusedOperation):
        def fuser_forward(self, ctxs, x, *, args, next_op_input_quantizer):
            return x

        def fuser_backward(self, ctxs, dy, *, prev_op_grad_output_quantizer):
            return dy, [ops.OpGrads(), ops.OpGrads()]

    def fuse_double_halve(plan):
        return ops.fuse_pattern(plan, (Double, Halve), DoubleHalve)

    ops.register_forward_fusion(fuse_double_halve)
    ops.register_backward_fusion(fuse_double_halve)
    seq = ops.Sequential(ops.Linear(D, D), Double(), Halve(), ops.Bias(D), rngs=nnx.Rngs(0))
    assert [repr(op) for op in seq.fused_plan()][1] == "DoubleHalve(Double, Halve)"
    assert [repr(op) for op in seq.fused_plan("backward")][1] == "DoubleHalve(Double, Halve)"
    unfused = ops.Sequential(
        ops.Linear(D, D), Double(), Halve(), ops.Bias(D), rngs=nnx.Rngs(0), fuse=False
    )
    (g1, y1), (g0, y0) = _steps([seq, unfused], x_of())
    np.testing.assert_array_equal(np.asarray(y1), np.asarray(y0))

    def bad(plan):
        return plan[:-1]

    with pytest.raises(ValueError, match="changed the sequence's basic ops"):
        ops.registry.build_plan(list(seq.ops), [bad])


def test_quantize_op_hands_the_linear_its_quantized_input():
    """``Quantize`` before a Linear quantizes with that Linear's quantizer: the same step as the
    Linear quantizing its own input (the x quantizer's next state included); ``Identity``
    between them leaves the Linear to quantize."""
    recipe = RECIPES["delayed"]

    def seq(middle):
        return ops.Sequential(
            ops.Activation("gelu"), middle, ops.Linear(D, D), recipe=recipe, rngs=nnx.Rngs(0)
        )

    x = x_of()
    (g1, y1), (g0, y0) = _steps(
        [seq(ops.Quantize(forward=True, backward=True)), seq(ops.Identity())], x
    )
    np.testing.assert_array_equal(np.asarray(y1), np.asarray(y0))
    jax.tree.map(
        lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
        nnx.state(g1),
        nnx.state(g0),
    )
