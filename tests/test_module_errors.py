"""The Linen (``te_jax.flax``) and NNX (``te_jax.nnx``) modules' errors: raised at trace time as a
ValueError / TypeError that names the module, what the user wrote (the value, the shape) and the
fix, never a Flax or JAX internal error (``ScopeCollectionNotFound``, ``ScopeParamShapeError``,
an IndexError, a ZeroDivisionError from an initializer)."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import te_jax.flax as tef
from te_jax import nnx as tnnx
from te_jax.recipe import CurrentScaling, DelayedScaling, MXFP8BlockScaling

H = 64
KEY = jax.random.key(0)


def _ones(shape, dtype=jnp.float32):
    return jnp.ones(shape, dtype)


def _raises(exc, match, fn):
    """``fn()`` raises exactly ``exc`` (not a subclass from Flax or JAX) matching ``match``."""
    with pytest.raises(exc, match=match) as info:
        fn()
    assert type(info.value) is exc, type(info.value)


# ---- delayed scaling's state: "fp8_metas" (Linen) -------------------------------------------

LINEN_FP8 = {
    "DenseGeneral": (lambda r: tef.DenseGeneral(32, recipe=r), "kernel_x_scale", {}),
    "LayerNormDenseGeneral": (
        lambda r: tef.LayerNormDenseGeneral(32, recipe=r),
        "kernel_x_scale",
        {},
    ),
    "LayerNormMLP": (
        lambda r: tef.LayerNormMLP(intermediate_dim=32, recipe=r),
        "wi_x_scale",
        {"deterministic": True},
    ),
}


@pytest.mark.parametrize("init_recipe", [None, CurrentScaling()], ids=["none", "current"])
@pytest.mark.parametrize("name", list(LINEN_FP8))
def test_delayed_scaling_on_variables_made_without_it(name, init_recipe):
    """Variables initialized without delayed scaling, applied with it: the message says the
    collection is missing and why, and its recipe for adding the state works."""
    make, var, kw = LINEN_FP8[name]
    x = _ones((2, 4, H))
    # raised at trace time: shapes only, nothing compiled or run
    variables = jax.eval_shape(lambda x: make(init_recipe).init(KEY, x, **kw), x)
    m = make(DelayedScaling(amax_history_len=4))
    match = (
        rf"te_jax.flax.{name}: recipe=DelayedScaling\(\) keeps its FP8 state in the 'fp8_metas' "
        rf"collection, but the variables given hold no '{var}' \(at /\): the module was "
        r"initialized without a delayed-scaling recipe.*initialize it again with "
        r"recipe=DelayedScaling\(\.\.\.\).*module.apply\(variables, x, "
        r"mutable=\[\"fp8_metas\"\]\)"
    )
    _raises(ValueError, match, lambda: jax.eval_shape(lambda v: m.apply(v, x, **kw), variables))
    _, state = jax.eval_shape(  # the message's fix
        lambda v: m.apply(v, x, mutable=["fp8_metas"], **kw), variables
    )
    jax.eval_shape(lambda v: m.apply(v, x, **kw), {**variables, **state})


class _Body(nn.Module):
    @nn.compact
    def __call__(self, c, _):
        return c + tef.DenseGeneral(H, recipe=DelayedScaling(amax_history_len=4))(c), None


def _stack(**scan_kw):
    return nn.scan(_Body, split_rngs={"params": True}, length=2, **scan_kw)()


@pytest.mark.parametrize(
    "where, axes",
    [("init", {"params": 0}), ("apply", {"params": 0})],
    ids=["init", "apply-with-state-from-a-good-scan"],
)
def test_scan_without_fp8_metas_in_variable_axes(where, axes):
    x = _ones((2, 4, H))
    match = (
        r"te_jax.flax.DenseGeneral: recipe=DelayedScaling\(\) keeps its FP8 state in the "
        r"'fp8_metas' collection, but .*'kernel_x_scale'.*/scan\(\)/DenseGeneral_0.*list "
        r"\"fp8_metas\" beside \"params\" in the nn.scan.*"
        r'variable_axes=\{"params": 0, "fp8_metas": 0\}'
    )
    bad = _stack(variable_axes=axes)
    if where == "init":
        _raises(ValueError, match, lambda: bad.init(KEY, x, None))
    else:
        good = _stack(variable_axes={"params": 0, "fp8_metas": 0})
        variables = jax.eval_shape(lambda x: good.init(KEY, x, None), x)  # shapes only
        _raises(
            ValueError, match, lambda: jax.eval_shape(lambda v: bad.apply(v, x, None), variables)
        )
        jax.eval_shape(lambda v: good.apply(v, x, None), variables)


# ---- the input's feature axes against what the module was built for ------------------------

NNX_MODULES = {
    "Linear": (lambda **kw: tnnx.Linear(H, 32, rngs=nnx.Rngs(0), **kw), "in_features"),
    "LayerNorm": (lambda **kw: tnnx.LayerNorm(H, rngs=nnx.Rngs(0), **kw), "num_features"),
    "LayerNormLinear": (
        lambda **kw: tnnx.LayerNormLinear(H, 32, rngs=nnx.Rngs(0), **kw),
        "in_features",
    ),
    "LayerNormLinear-no-norm": (
        lambda **kw: tnnx.LayerNormLinear(H, 32, enable_layernorm=False, rngs=nnx.Rngs(0), **kw),
        "in_features",
    ),
    "LayerNormMLP": (lambda **kw: tnnx.LayerNormMLP(H, 32, rngs=nnx.Rngs(0), **kw), "hidden_size"),
}

LINEN_MODULES = {
    "DenseGeneral": (lambda **kw: tef.DenseGeneral(32, **kw), "kernel", (H, 32)),
    "LayerNorm": (lambda **kw: tef.LayerNorm(**kw), "scale", (H,)),
    "LayerNormDenseGeneral": (lambda **kw: tef.LayerNormDenseGeneral(32, **kw), "kernel", (H, 32)),
    "LayerNormMLP": (
        lambda **kw: tef.LayerNormMLP(intermediate_dim=32, **kw),
        "wi_kernel",
        (H, 32),
    ),
}


def _nnx_name(key):
    return key.split("-")[0]


@pytest.mark.parametrize("name", list(NNX_MODULES))
def test_nnx_input_hidden_size_mismatch(name):
    make, field = NNX_MODULES[name]
    match = (
        rf"te_jax.nnx.{_nnx_name(name)}: the input's last axis has size 100 \(input shape "
        rf"\(2, 3, 100\)\), but the module was built with {field}=64: give it inputs of shape "
        rf"\(\.\.\., 64\), or build it with {field}=100"
    )
    _raises(ValueError, match, lambda: make()(_ones((2, 3, 100))))


@pytest.mark.parametrize("name", list(NNX_MODULES))
def test_nnx_scalar_input(name):
    make, field = NNX_MODULES[name]
    match = (
        rf"te_jax.nnx.{_nnx_name(name)}: the input \(shape \(\)\) has no feature axis, but the "
        rf"module was built with {field}=64: give it inputs of shape \(\.\.\., 64\)"
    )
    _raises(ValueError, match, lambda: make()(jnp.ones(())))


def test_nnx_linear_several_in_features():
    m = tnnx.Linear((3, H), 32, rngs=nnx.Rngs(0))
    match = (
        r"te_jax.nnx.Linear: the input's last 2 axes are \(3, 100\) \(input shape \(2, 3, 100\)\), "
        r"but the module was built with in_features=\(3, 64\): give it inputs of shape "
        r"\(\.\.\., 3, 64\), or build it with in_features=\(3, 100\)"
    )
    _raises(ValueError, match, lambda: m(_ones((2, 3, 100))))


@pytest.mark.parametrize("name", list(LINEN_MODULES))
def test_linen_input_hidden_size_mismatch(name):
    make, param, shape = LINEN_MODULES[name]
    m = make()
    variables = m.init(KEY, _ones((2, 3, H)))
    match = (
        rf"te_jax.flax.{name}: the input's last axis has size 100 \(input shape \(2, 3, 100\)\), "
        rf"but the module's variables were initialized for 64 \({param} of shape "
        rf"{_re(shape)}\): give it inputs of shape \(\.\.\., 64\), or initialize the module"
    )
    _raises(ValueError, match, lambda: m.apply(variables, _ones((2, 3, 100))))


def test_linen_dense_general_leading_axis_mismatch():
    m = tef.DenseGeneral(32, axis=0)
    variables = m.init(KEY, _ones((H, 3)))
    match = (
        r"te_jax.flax.DenseGeneral: the input's axes \(0,\) are \(100,\) \(input shape \(100, 3\)\)"
        r", but the module's variables were initialized for 64 \(kernel of shape \(64, 32\)\): "
        r"give it inputs of shape axes \(0,\) of sizes \(64,\)"
    )
    _raises(ValueError, match, lambda: m.apply(variables, _ones((100, 3))))


def _re(shape) -> str:
    return str(tuple(shape)).replace("(", r"\(").replace(")", r"\)")


# ---- Linen variables from a module with other fields ----------------------------------------


@pytest.mark.parametrize(
    "made, used, match",
    [
        (
            tef.DenseGeneral(32),
            tef.DenseGeneral(16),
            r"te_jax.flax.DenseGeneral: parameter 'kernel' is \(64, 32\) in the variables given, "
            r"but this module and input make it \(64, 16\).*initialize it again",
        ),
        (
            tef.LayerNormMLP(intermediate_dim=32),
            tef.LayerNormMLP(intermediate_dim=32, activations="swiglu"),
            r"te_jax.flax.LayerNormMLP: parameter 'wi_kernel' is \(64, 32\) in the variables "
            r"given, but this module and input make it \(64, 2, 32\)",
        ),
        (
            tef.DenseGeneral(32, use_bias=False),
            tef.DenseGeneral(32, use_bias=True),
            r"te_jax.flax.DenseGeneral: the variables given have no parameter 'bias' "
            r"\(shape \(32,\)\).*use_bias",
        ),
        (
            tef.LayerNorm(layernorm_type="rmsnorm"),
            tef.LayerNorm(layernorm_type="layernorm"),
            r"te_jax.flax.LayerNorm: the variables given have no parameter 'ln_bias'.*"
            r"layernorm_type",
        ),
    ],
    ids=["features", "gated-activation", "use_bias", "layernorm_type"],
)
def test_linen_variables_from_other_fields(made, used, match):
    x = _ones((2, 3, H))
    kw = {"deterministic": True} if isinstance(made, tef.LayerNormMLP) else {}
    variables = made.init(KEY, x, **kw)
    _raises(ValueError, match, lambda: used.apply(variables, x, **kw))


# ---- fields: dtypes, sizes, recipe, activation, dropout --------------------------------------


def _linen(cls, kw, x=None):
    """Initializes the Linen module ``cls(**kw)`` on ``x`` (default ``(2, 3, H)``)."""
    x = _ones((2, 3, H)) if x is None else x
    if cls is tef.LayerNormMLP:
        kw = {"intermediate_dim": 32, **kw}
    elif cls is not tef.LayerNorm:
        kw = {"features": 32, **kw}
    return lambda: cls(**kw).init(KEY, x)


def _nnx(cls, kw, x=None):
    """Builds the NNX module ``cls(..., **kw)`` and calls it on ``x`` (default ``(2, 3, H)``)."""
    x = _ones((2, 3, H)) if x is None else x
    args = {
        tnnx.Linear: (H, 32),
        tnnx.LayerNorm: (H,),
        tnnx.LayerNormLinear: (H, 32),
        tnnx.LayerNormMLP: (H, 32),
    }[cls]
    kw = dict(kw)
    args = kw.pop("args", args)
    return lambda: cls(*args, rngs=nnx.Rngs(0), **kw)(x)


LINEN_ALL = [tef.DenseGeneral, tef.LayerNorm, tef.LayerNormDenseGeneral, tef.LayerNormMLP]
NNX_ALL = [tnnx.Linear, tnnx.LayerNorm, tnnx.LayerNormLinear, tnnx.LayerNormMLP]
DENSE_LINEN = [tef.DenseGeneral, tef.LayerNormDenseGeneral, tef.LayerNormMLP]
DENSE_NNX = [tnnx.Linear, tnnx.LayerNormLinear, tnnx.LayerNormMLP]


def _cases():
    """``(id, call, exception, match)`` for every module of both families."""
    for family, classes, build in (("flax", LINEN_ALL, _linen), ("nnx", NNX_ALL, _nnx)):
        for cls in classes:
            w = rf"te_jax.{family}.{cls.__name__}: "
            yield (
                f"{family}.{cls.__name__}-dtype-int8",
                build(cls, {"dtype": jnp.int8}),
                TypeError,
                w + r"dtype must be float32, bfloat16 or float16 \(or float64\), got int8",
            )
            yield (
                f"{family}.{cls.__name__}-dtype-not-a-dtype",
                build(cls, {"dtype": "floaty"}),
                TypeError,
                w + r"dtype='floaty' is not a dtype; use jnp.float32",
            )
            yield (
                f"{family}.{cls.__name__}-param_dtype-int32",
                build(cls, {"param_dtype": jnp.int32}),
                TypeError,
                w + r"param_dtype must be float32, bfloat16 or float16 \(or float64\), got int32",
            )
            yield (
                f"{family}.{cls.__name__}-int-input",
                build(cls, {}, _ones((2, 3, H), jnp.int32)),
                TypeError,
                w + r"the input is int32; the module computes in float32, bfloat16 or float16.*"
                r"cast the input, or set the module's dtype=",
            )
    for family, classes, build in (("flax", DENSE_LINEN, _linen), ("nnx", DENSE_NNX, _nnx)):
        for cls in classes:
            w = rf"te_jax.{family}.{cls.__name__}: "
            yield (
                f"{family}.{cls.__name__}-recipe-class",
                build(cls, {"recipe": DelayedScaling}),
                TypeError,
                w + r"recipe must be a recipe instance, got the class DelayedScaling: write "
                r"DelayedScaling\(\)",
            )
            yield (
                f"{family}.{cls.__name__}-recipe-str",
                build(cls, {"recipe": "fp8"}),
                TypeError,
                w + r"recipe must be te_jax.recipe.DelayedScaling\(\).* or None, got str",
            )
            field = "activations" if cls.__name__ == "LayerNormMLP" else "activation"
            yield (
                f"{family}.{cls.__name__}-unknown-activation",
                build(cls, {field: "swish"}),
                ValueError,
                w + r"unknown activation_type 'swish'; valid names: .*gelu.*swiglu",
            )
    sizes = [
        ("flax", tef.DenseGeneral, {"features": 0}, ValueError, "features", "0"),
        ("flax", tef.DenseGeneral, {"features": (8, -1)}, ValueError, "features", r"\(8, -1\)"),
        ("flax", tef.LayerNormMLP, {"intermediate_dim": 0}, ValueError, "intermediate_dim", "0"),
        ("flax", tef.LayerNormMLP, {"intermediate_dim": 3.0}, TypeError, "intermediate_dim", "3.0"),
        ("nnx", tnnx.Linear, {"args": (H, -3)}, ValueError, "out_features", "-3"),
        ("nnx", tnnx.Linear, {"args": (0, 8)}, ValueError, "in_features", "0"),
        ("nnx", tnnx.LayerNorm, {"args": (True,)}, TypeError, "num_features", "True"),
        ("nnx", tnnx.LayerNormMLP, {"args": ("64", 32)}, TypeError, "hidden_size", "'64'"),
        ("nnx", tnnx.LayerNormMLP, {"args": (H, 0)}, ValueError, "intermediate_dim", "0"),
    ]
    for family, cls in (("flax", tef.LayerNormMLP), ("nnx", tnnx.LayerNormMLP)):
        build = _linen if family == "flax" else _nnx
        yield (
            f"{family}.{cls.__name__}-gelu_backward",
            build(cls, {"gelu_backward": "fast"}),
            ValueError,
            rf"te_jax.{family}.{cls.__name__}: gelu_backward must be one of 'dact', 'dgelu', "
            r"'dgelu_bgrad', got 'fast'",
        )
    for family, cls, kw, exc, field, got in sizes:
        build = _linen if family == "flax" else _nnx
        yield (
            f"{family}.{cls.__name__}-{field}-{got}",
            build(cls, kw),
            exc,
            rf"te_jax.{family}.{cls.__name__}: {field} must be a positive int.*, got {got}(\n|$)",
        )


CASES = list(_cases())


@pytest.mark.parametrize("call, exc, match", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_fields(call, exc, match):
    _raises(exc, match, call)


def test_linen_dropout_without_its_rng():
    m = tef.LayerNormMLP(intermediate_dim=32, intermediate_dropout_rate=0.1)
    x = _ones((2, 3, H))
    # init falls back to the "params" rng; all at trace time (shapes only)
    variables = jax.eval_shape(lambda x: m.init(KEY, x), x)
    match = (
        r"te_jax.flax.LayerNormMLP: intermediate_dropout_rate=0.1 draws from the 'dropout' rng, "
        r"which apply was not given: pass rngs=\{'dropout': key\}, or deterministic=True"
    )
    _raises(ValueError, match, lambda: jax.eval_shape(lambda v: m.apply(v, x), variables))
    jax.eval_shape(lambda v: m.apply(v, x, rngs={"dropout": KEY}), variables)
    jax.eval_shape(lambda v: m.apply(v, x, deterministic=True), variables)


# ---- MXFP8: the module's tokens (batch × sequence) -----------------------------------------


def _mx_nnx(name):
    make = {
        "Linear": lambda: tnnx.Linear(H, H, recipe=MXFP8BlockScaling(), rngs=nnx.Rngs(0)),
        "LayerNormMLP": lambda: tnnx.LayerNormMLP(
            H, H, recipe=MXFP8BlockScaling(), rngs=nnx.Rngs(0)
        ),
    }[name]
    m = make()

    def loss(m, x):
        out = m(x)
        return jnp.sum((out[0] if isinstance(out, tuple) else out).astype(jnp.float32))

    return m, loss


@pytest.mark.parametrize("name, op", [("Linear", "dense"), ("LayerNormMLP", "fused_mlp")])
def test_mxfp8_tokens_not_a_multiple_of_32(name, op):
    """8 tokens (batch 2 × sequence 4): the forward runs; training names the tokens."""
    m, loss = _mx_nnx(name)
    x = _ones((2, 4, H), jnp.bfloat16)
    jax.eval_shape(lambda x: loss(m, x), x)  # the forward alone takes any token count
    match = (
        rf"te_jax.{op}: differentiating under MXFP8_1D_SCALING \(MXFP8BlockScaling\): the tokens "
        r"\(batch × sequence: the product of x's leading axes \(2, 4\)\) must be a multiple of 32"
        r".*x of shape \(2, 4, 64\) has 8\. Pad the batch or sequence"
    )
    _raises(ValueError, match, lambda: nnx.grad(loss)(m, x))


def test_mxfp8_linen_tokens():
    m = tef.LayerNormMLP(intermediate_dim=H, recipe=MXFP8BlockScaling())
    x = _ones((1, 8, H), jnp.bfloat16)
    # init on 8 tokens runs the forward only; both at trace time (shapes only)
    variables = jax.eval_shape(lambda x: m.init(KEY, x, deterministic=True), x)

    def loss(params):
        return jnp.sum(m.apply({"params": params}, x, deterministic=True)[0].astype(jnp.float32))

    match = r"te_jax.fused_mlp: .*the tokens \(batch × sequence.*\(1, 8\)\).*has 8"
    _raises(ValueError, match, lambda: jax.eval_shape(jax.grad(loss), variables["params"]))


_NORM_OFF = {"enable_layernorm": False, "layernorm_type": "batchnorm"}
NORM_OFF_CASES = {
    "flax.LayerNormMLP": _linen(tef.LayerNormMLP, _NORM_OFF),
    "flax.LayerNormDenseGeneral": _linen(tef.LayerNormDenseGeneral, _NORM_OFF),
    "nnx.LayerNormMLP": _nnx(tnnx.LayerNormMLP, _NORM_OFF),
    "nnx.LayerNormLinear": _nnx(tnnx.LayerNormLinear, _NORM_OFF),
}


@pytest.mark.parametrize("where", list(NORM_OFF_CASES))
def test_layernorm_type_checked_with_the_norm_off(where):
    """Both families check ``layernorm_type`` whether or not the norm is on (a misspelt one is
    a mistake either way)."""
    match = (
        rf"te_jax.{where}: layernorm_type must be one of 'layernorm', 'rmsnorm', got 'batchnorm'"
    )
    _raises(ValueError, match, NORM_OFF_CASES[where])
