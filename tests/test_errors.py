"""Bad input raises a Python exception naming the problem at trace time (under jax.eval_shape:
no kernel runs), for every public op and implementation (te_jax.dense and te_jax.fused_mlp name
what the caller wrote and the fix); float64 is served by the pure-JAX path
(not an error) unless implementation="ffi"; an object that is not a te_jax quantizer is a
TypeError (the quantizers' own errors: tests/quantize/)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import float64_oracle as oracle
import qdq_oracle as qdq
import te_jax
from helpers import ACT_BY_ALIAS, assert_dbias_matches, enable_x64, make_dz, make_x
from te_jax.normalization import layernorm

IMPLS = [None, "ffi", "xla"]
OPS = ["act_lu", "dact_lu", "quantize_dact_dbias", "activation"]


def _call(op, dz, x, **kw):
    if op == "act_lu":
        return te_jax.act_lu(x, **kw)
    if op == "activation":
        return te_jax.activation(x, **kw)
    if op == "dact_lu":
        return te_jax.dact_lu(dz, x, **kw)
    if op == "quantize_dact_dbias":
        return te_jax.quantize_dact_dbias(dz, x, **kw)
    raise ValueError(op)


def _trace(op, dz_shape, x_shape, dtype=jnp.float32, dz_dtype=None, **kw):
    """Traces the op abstractly (jax.eval_shape): an error here is raised before any kernel."""
    x = jax.ShapeDtypeStruct(x_shape, dtype)
    dz = jax.ShapeDtypeStruct(dz_shape, dz_dtype or dtype)
    return jax.eval_shape(lambda dz, x: _call(op, dz, x, **kw), dz, x)


def _raises(exc, op, dz_shape, x_shape, match=None, **kw):
    with pytest.raises(exc) as info:
        _trace(op, dz_shape, x_shape, **kw)
    if match is not None:
        assert re.search(match, str(info.value), re.I | re.S), str(info.value)
    return str(info.value)


@pytest.mark.parametrize("impl", IMPLS, ids=str)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("bad", ["swish", ("gelu", "bogus"), ("bogus",), "", ("silu", "silu")])
def test_unknown_activation(op, impl, bad):
    msg = _raises(ValueError, op, (4, 8), (4, 8), activation_type=bad, implementation=impl)
    for valid in ("gelu", "swiglu", "clamped_swiglu", "squared_relu"):
        assert valid in msg, f"the message should list the valid names: {msg}"


@pytest.mark.parametrize("impl", IMPLS, ids=str)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize(
    "bad", [("linear", "gelu"), ("linear", "silu"), ("clamped_linear", "clamped_silu")]
)
def test_linear_first_is_an_error(op, impl, bad):
    _raises(
        ValueError, op, (4, 8), (4, 2, 8), match="linear", activation_type=bad, implementation=impl
    )


@pytest.mark.parametrize("impl", IMPLS, ids=str)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("x_shape", [(4, 3, 8), (4, 1, 8), (8,), (2, 8, 2)], ids=str)
def test_gated_input_needs_act_axis_of_two(op, impl, x_shape):
    dz_shape = x_shape[:-2] + x_shape[-1:] if len(x_shape) >= 2 else x_shape
    msg = _raises(ValueError, op, dz_shape, x_shape, activation_type="swiglu", implementation=impl)
    got = r"\D{1,3}".join(map(str, x_shape))
    assert re.search(got, msg) or "2" in msg, f"the message should name the shape: {msg}"


@pytest.mark.parametrize("impl", IMPLS, ids=str)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", [jnp.int32, jnp.int8, jnp.uint8, jnp.bool_], ids=str)
def test_integer_input_is_a_type_error(op, impl, dtype):
    msg = _raises(TypeError, op, (4, 8), (4, 8), dtype=dtype, implementation=impl)
    assert jnp.dtype(dtype).name in msg or "float" in msg, msg


@pytest.mark.parametrize("impl", IMPLS, ids=str)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.complex64], ids=str)
def test_float8_input_is_te_jax_own_type_error(op, impl, dtype):
    """An 8-bit float (or complex) input is te_jax's TypeError naming the accepted dtypes, not an
    error from deep inside jax (it was jax's TypePromotionError from the reference)."""
    with pytest.raises(TypeError) as info:
        _trace(op, (4, 8), (4, 8), dtype=dtype, implementation=impl)
    assert type(info.value) is TypeError, type(info.value)
    msg = str(info.value)
    assert msg.startswith(f"te_jax.{op}:"), msg
    for name in ("float32", "bfloat16", "float16", jnp.dtype(dtype).name):
        assert name in msg, msg


def test_reference_rejects_float8_with_its_own_type_error():
    match = r"te_jax.activation_reference: x must be float32, bfloat16"
    with pytest.raises(TypeError, match=match):
        te_jax.activation_reference.act_lu(jnp.ones((2, 8), jnp.float8_e4m3fn), "gelu")


@pytest.mark.parametrize("op", OPS)
def test_float64_warns_that_it_takes_the_pure_jax_path(op):
    with enable_x64(), pytest.warns(UserWarning, match="float64 input takes the pure-JAX path"):
        _trace(op, (4, 8), (4, 8), dtype=jnp.float64, implementation=None)


@pytest.mark.parametrize("impl", IMPLS, ids=str)
@pytest.mark.parametrize("op", ["dact_lu", "quantize_dact_dbias"])
@pytest.mark.parametrize(
    "act, dz_shape, x_shape",
    [
        ("gelu", (4, 7), (4, 8)),  # H differs
        ("gelu", (3, 8), (4, 8)),  # leading axis differs
        ("gelu", (4, 1, 8), (4, 8)),  # an extra axis
        ("swiglu", (4, 2, 8), (4, 2, 8)),  # x's shape given for dz: dz has no act axis
        ("swiglu", (4, 9), (4, 2, 8)),
        ("swiglu", (8,), (4, 2, 8)),
    ],
    ids=str,
)
def test_dz_shape_mismatch(op, impl, act, dz_shape, x_shape):
    msg = _raises(ValueError, op, dz_shape, x_shape, activation_type=act, implementation=impl)
    assert "dz" in msg, f"the message should name dz: {msg}"


@pytest.mark.parametrize("impl", IMPLS, ids=str)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("act", ["gelu", "swiglu", ("silu", "linear"), "relu"], ids=str)
def test_act_params_on_activation_without_params(op, impl, act):
    params = te_jax.ActivationParams(clamped_swiglu=te_jax.ClampedSwiGLUParams(limit=1.0))
    gated = act != "gelu" and act != "relu"
    x_shape = (4, 2, 8) if gated else (4, 8)
    _raises(
        ValueError, op, (4, 8), x_shape, activation_type=act, act_params=params, implementation=impl
    )


@pytest.mark.parametrize("op", OPS)
def test_bad_implementation_name(op):
    _raises(ValueError, op, (4, 8), (4, 8), match="implementation", implementation="cuda")


class _NotAQuantizer:
    scaling_mode = 1


@pytest.mark.parametrize("impl", IMPLS, ids=str)
@pytest.mark.parametrize("op", ["act_lu", "dact_lu", "quantize_dact_dbias"])
def test_quantizer_must_be_a_te_jax_quantizer(op, impl):
    match = "quantizer must be a te_jax.quantize quantizer"
    with pytest.raises(TypeError, match=match):
        _trace(op, (4, 8), (4, 8), quantizer=_NotAQuantizer(), implementation=impl)
    x = jnp.ones((4, 8), jnp.float32)  # and eagerly
    with pytest.raises(TypeError, match=match):
        _call(op, x, x, quantizer=_NotAQuantizer(), implementation=impl)


@pytest.mark.parametrize("impl", IMPLS, ids=str)
def test_errors_are_raised_eagerly_too(impl):
    x = jnp.ones((4, 3, 8), jnp.float32)
    with pytest.raises(ValueError):
        te_jax.act_lu(x, activation_type="swiglu", implementation=impl)
    with pytest.raises(ValueError):
        te_jax.act_lu(x, activation_type="nope", implementation=impl)
    with pytest.raises(TypeError):
        te_jax.act_lu(jnp.ones((4, 8), jnp.int32), implementation=impl)
    with pytest.raises(ValueError):
        te_jax.dact_lu(jnp.ones((4, 3, 7)), x, implementation=impl)


# --- float64 --------------------------------------------------------------------------------------


@pytest.mark.parametrize("impl", [None, "xla"], ids=str)
@pytest.mark.parametrize("alias", ["gelu", "swiglu", "clamped_swiglu", "geglu_exact"])
def test_float64_is_served_by_the_pure_jax_path(alias, impl, rng):
    act = ACT_BY_ALIAS[alias]
    shape = (3, 2, 13) if act.gated else (3, 13)
    x = make_x(rng, shape, np.float64, act)
    dz = make_dz(rng, shape[:-2] + shape[-1:] if act.gated else shape, np.float64)
    with enable_x64():
        xj, dzj = jnp.asarray(x, jnp.float64), jnp.asarray(dz, jnp.float64)
        kw = dict(activation_type=alias, implementation=impl)

        @jax.jit  # every op in one program, not op by op
        def run(xj, dzj):
            outs = {
                "act_lu": te_jax.act_lu(xj, **kw),
                "activation": te_jax.activation(xj, **kw),
                "dact_lu": te_jax.dact_lu(dzj, xj, **kw),
                "grad": jax.grad(lambda x: jnp.sum(te_jax.activation(x, **kw) * dzj))(xj),
            }
            outs["dx"], dbias = te_jax.quantize_dact_dbias(dzj, xj, **kw)
            return outs, dbias

        outs, dbias = run(xj, dzj)
        for name, a in [*outs.items(), ("dbias", dbias)]:
            assert a.dtype == jnp.float64, (name, a.dtype)
        outs = {k: np.asarray(v) for k, v in outs.items()}
        dbias = np.asarray(dbias)
    y64 = oracle.act_lu(x, act.enum, exact_params=True)  # float64 keeps alpha = 1.702 exact
    dx64 = oracle.dact_lu(dz, x, act.enum, exact_params=True)
    for name, a in outs.items():
        want = y64 if name in ("act_lu", "activation") else dx64
        np.testing.assert_allclose(a, want, rtol=1e-10, atol=1e-12, err_msg=name)
    assert_dbias_matches(dbias, dx64, act.gated, np.float64, act)


@pytest.mark.parametrize("op", OPS)
def test_float64_with_ffi_is_a_type_error(op):
    with enable_x64():
        msg = _raises(TypeError, op, (4, 8), (4, 8), dtype=jnp.float64, implementation="ffi")
    for name in ("float32", "bfloat16", "float16"):
        assert name in msg, f"the message should say which dtypes the kernels take: {msg}"


# --- te_jax.dense / te_jax.fused_mlp / te_jax.layernorm: what the caller wrote, and the fix ------

BF16 = jnp.bfloat16


def _dense_fn(x_shape, k_shape, recipe=None, grad=False, act=None, **kw):
    """``te_jax.dense`` traced abstractly (its gradient with respect to x and the kernel where
    ``grad``)."""

    def f(x, k):
        qs = None if recipe is None else te_jax.QuantizerSet.create(recipe)
        y = te_jax.dense(x, k, activation_type=act, quantizer_set=qs, **kw)
        return jnp.sum(y.astype(jnp.float32))

    f = jax.grad(f, argnums=(0, 1)) if grad else f
    return lambda: jax.eval_shape(
        f, jax.ShapeDtypeStruct(x_shape, BF16), jax.ShapeDtypeStruct(k_shape, jnp.float32)
    )


def _mlp_fn(x_shape, inter, recipe, grad, argnums=(0, 1)):
    """``te_jax.fused_mlp`` (H -> inter -> H) traced abstractly."""
    h = x_shape[-1]

    def f(x, k1, k2):
        qs = (te_jax.QuantizerSet.create(recipe), te_jax.QuantizerSet.create(recipe))
        return jnp.sum(te_jax.fused_mlp(x, k1, k2, None, None, "gelu", qs).astype(jnp.float32))

    f = jax.grad(f, argnums=argnums) if grad else f
    s = jax.ShapeDtypeStruct
    return lambda: jax.eval_shape(
        f, s(x_shape, BF16), s((h, inter), jnp.float32), s((inter, h), jnp.float32)
    )


def _grad_x_only(x_shape, k_shape, recipe):
    """The gradient with respect to x alone (the kernel a constant)."""
    k = jnp.ones(k_shape, jnp.float32)
    qs = te_jax.QuantizerSet.create(recipe)
    f = jax.grad(lambda x: jnp.sum(te_jax.dense(x, k, quantizer_set=qs).astype(jnp.float32)))
    return lambda: jax.eval_shape(f, jax.ShapeDtypeStruct(x_shape, BF16))


MX = te_jax.recipe.MXFP8BlockScaling()
_TOKENS = (
    r"differentiating under MXFP8_1D_SCALING \(MXFP8BlockScaling\): the tokens \(batch × "
    r"sequence: the product of x's leading axes {lead}\) must be a multiple of 32 \(the wgrad "
    r"GEMM contracts over them in blocks of 32\); x of shape {shape} has {n}\. Pad the batch or "
    r"sequence so that batch × sequence is a multiple of 32"
)

DENSE_ERRORS = {
    "kernel-without-output-axis": (
        _dense_fn((4, 64), (64,)),
        ValueError,
        r"te_jax.dense: the kernel has no output axis: it must have at least 2 axes "
        r"\(K, N\.\.\.\): K contracted with x's last axis, then the output axes N\.\.\.; got "
        r"kernel shape \(64,\) for x of shape \(4, 64\)\. For one output per row use "
        r"kernel\[\.\.\., None\] \(shape \(64, 1\)\)",
    ),
    "kernel-without-output-axis-two-contracted": (
        _dense_fn((4, 8, 8), (8, 8), contracting_dims=((-2, -1), (0, 1))),
        ValueError,
        r"te_jax.dense: the kernel has no output axis: it must have at least 3 axes "
        r"\(K\.\.\., N\.\.\.\): 2 axes K\.\.\. contracted with x's last 2 axes.*got kernel "
        r"shape \(8, 8\)",
    ),
    "mxfp8-tokens-8": (
        _dense_fn((8, 64), (64, 64), MX, grad=True),
        ValueError,
        "te_jax.dense: " + _TOKENS.format(lead=r"\(8,\)", shape=r"\(8, 64\)", n=8),
    ),
    "mxfp8-tokens-batch-x-sequence": (
        _dense_fn((2, 4, 64), (64, 64), MX, grad=True),
        ValueError,
        "te_jax.dense: " + _TOKENS.format(lead=r"\(2, 4\)", shape=r"\(2, 4, 64\)", n=8),
    ),
    "mxfp8-tokens-grad-x-only": (
        _grad_x_only((2, 4, 64), (64, 64), MX),
        ValueError,
        "te_jax.dense: " + _TOKENS.format(lead=r"\(2, 4\)", shape=r"\(2, 4, 64\)", n=8),
    ),
    "mxfp8-output-size": (
        _dense_fn((32, 64), (64, 40), MX, grad=True),
        ValueError,
        r"te_jax.dense: differentiating under MXFP8_1D_SCALING \(MXFP8BlockScaling\): the output "
        r"size N must be a multiple of 32 \(the dgrad GEMM contracts over it in blocks of 32\); "
        r"kernel shape \(64, 40\) has N = 40",
    ),
    "mxfp8-gated-output-size": (
        _dense_fn((32, 64), (64, 2, 40), MX, grad=True, act="swiglu"),
        ValueError,
        r"te_jax.dense: differentiating under MXFP8.*kernel shape \(64, 2, 40\) has N = 40",
    ),
    "mxfp8-tokens-and-output-size": (
        _dense_fn((8, 64), (64, 40), MX, grad=True),
        ValueError,
        r"te_jax.dense: differentiating under MXFP8.*x of shape \(8, 64\) has 8.*; and the output "
        r"size N must be a multiple of 32.*N = 40\. Use features.*; or train with "
        r"DelayedScaling\(\) / CurrentScaling\(\)",
    ),
    "mxfp8-contracted-size": (
        _dense_fn((32, 40), (40, 64), MX),
        ValueError,
        r"te_jax.dense: MXFP8_1D_SCALING \(MXFP8BlockScaling\) quantizes x and the kernel in "
        r"blocks of 32 along K, the contracted size: K = 40 \(x's contracting axes \(40,\), x "
        r"shape \(32, 40\), kernel shape \(40, 64\)\) is not a multiple of 32",
    ),
    "fused_mlp-mxfp8-tokens": (
        _mlp_fn((2, 4, 64), 64, MX, grad=True),
        ValueError,
        "te_jax.fused_mlp: " + _TOKENS.format(lead=r"\(2, 4\)", shape=r"\(2, 4, 64\)", n=8),
    ),
    "fused_mlp-mxfp8-tokens-grad-x-only": (
        _mlp_fn((2, 4, 64), 64, MX, grad=True, argnums=0),
        ValueError,
        "te_jax.fused_mlp: " + _TOKENS.format(lead=r"\(2, 4\)", shape=r"\(2, 4, 64\)", n=8),
    ),
    "fused_mlp-mxfp8-intermediate": (
        _mlp_fn((32, 64), 40, MX, grad=False),
        ValueError,
        r"te_jax.fused_mlp: MXFP8_1D_SCALING \(MXFP8BlockScaling\) quantizes .* K = 40",
    ),
    "layernorm-int-x": (
        lambda: layernorm(jnp.ones((2, 8), jnp.int32), jnp.ones((8,))),
        TypeError,
        r"te_jax.layernorm: x must be a float array, got int32",
    ),
    "layernorm-scalar-x": (
        lambda: layernorm(jnp.ones(()), jnp.ones((8,))),
        ValueError,
        r"te_jax.layernorm: x must have a feature axis \(\.\.\., H\), got a scalar",
    ),
}


@pytest.mark.parametrize("case", list(DENSE_ERRORS))
def test_dense_level_errors_name_the_input_and_the_fix(case):
    call, exc, match = DENSE_ERRORS[case]
    with pytest.raises(exc, match=match) as info:
        call()
    assert type(info.value) is exc, type(info.value)


@pytest.mark.parametrize("op", ["dense", "fused_mlp"])
def test_mxfp8_forward_alone_takes_any_token_count(op, rng):
    """The tokens and the output size only matter to the backward's GEMMs: 8 tokens and an
    output of 40 (neither a multiple of 32) run forward, to the MXFP8 product
    (tests/qdq_oracle.py's interval: x's blocks along K, the kernel's down K), while their
    gradient is refused with DENSE_ERRORS' messages."""
    x = jnp.asarray(rng.uniform(-1, 1, (2, 4, 64)), BF16)
    k1 = jnp.asarray(rng.uniform(-1, 1, (64, 40 if op == "dense" else 64)) / 8, jnp.float32)
    k2 = jnp.asarray(rng.uniform(-1, 1, (64, 64)) / 8, jnp.float32)
    qs = te_jax.QuantizerSet.create(MX)
    e4m3 = np.dtype(jnp.float8_e4m3fn)

    def product(a, k):  # MXFP8 operands, a float32 dot of their dequantized values, bf16 out
        qa = qdq.qdq(a, "mxfp8", e4m3, src_dtype=np.dtype(BF16))
        qk = qdq.qdq(qdq.point(k), "mxfp8", e4m3, src_dtype=np.float32, colwise=True)
        return qdq.rounded(qdq.matmul(qa, qk), BF16)

    want = product(qdq.point(np.asarray(x).reshape(8, 64)), k1)
    if op == "dense":  # jitted: one program, not op by op
        got = jax.jit(lambda x, k1: te_jax.dense(x, k1, quantizer_set=qs))(x, k1)
    else:
        got = jax.jit(lambda x, k1, k2: te_jax.fused_mlp(x, k1, k2, None, None, "gelu", (qs, qs)))(
            x, k1, k2
        )
        gelu = next(a for a in ACT_BY_ALIAS.values() if a.alias == "gelu").enum
        h = qdq.rounded(qdq.activation(want, gelu, gated=False), BF16)
        want = product(h, k2)
    assert got.shape == (2, 4, k1.shape[1] if op == "dense" else 64) and got.dtype == BF16
    inside = want.contains(np.asarray(got).reshape(8, -1))
    assert inside.all(), f"{int((~inside).sum())} of {inside.size} outside the MXFP8 product"
    call = (
        _dense_fn(x.shape, k1.shape, MX, grad=True)
        if op == "dense"
        else _mlp_fn(x.shape, 64, MX, grad=True)
    )
    with pytest.raises(ValueError, match="differentiating under MXFP8"):
        call()


def test_quantize_keeps_its_own_axis_message():
    """Called directly, quantize names its axis (it knows no tokens)."""
    q = te_jax.quantize.MXFP8Quantizer(jnp.float8_e4m3fn, te_jax.quantize.QuantizeLayout.COLWISE)
    with pytest.raises(
        ValueError, match=r"te_jax.quantize.quantize: .*innermost leading axis \(axis 0"
    ):
        jax.eval_shape(
            lambda x: te_jax.quantize.quantize(x, q), jax.ShapeDtypeStruct((8, 64), BF16)
        )
