"""The Linen (``te_jax.flax``) and NNX (``te_jax.nnx``) modules are one description
(``te_jax.module_specs``) stored two ways: from the same parameters and FP8 state each module
of one family computes what its counterpart computes, bit for bit (output, the gradient of a
quadratic loss with respect to the input, every parameter and the FP8 state), and compiles to
the same program (the forward's optimized HLO, metadata aside), bf16 and under delayed scaling.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import te_jax.flax as tef
from te_jax import module_specs
from te_jax import nnx as tnnx
from te_jax.recipe import DelayedScaling

H, F, INTER = 32, 24, 64
X_SHAPE = (2, 4, H)


@dataclasses.dataclass(frozen=True)
class Case:
    """One module in both families: ``linen(**linen_args, **settings)``,
    ``nnx(*nnx_args, **settings, rngs=...)``, called with ``call`` keyword arguments."""

    linen: type
    nnx: type
    linen_args: dict
    nnx_args: tuple
    settings: dict
    call: dict = dataclasses.field(default_factory=dict)
    gemms: bool = True  # whether a recipe applies


CASES = {
    "LayerNorm": Case(
        tef.LayerNorm,
        tnnx.LayerNorm,
        {},
        (H,),
        dict(zero_centered_gamma=True),
        gemms=False,
    ),
    "DenseGeneral": Case(
        tef.DenseGeneral,
        tnnx.Linear,
        dict(features=F),
        (H, F),
        dict(activation="gelu", use_bias=True, kernel_axes=("embed", "mlp")),
    ),
    "LayerNormDenseGeneral": Case(
        tef.LayerNormDenseGeneral,
        tnnx.LayerNormLinear,
        dict(features=F),
        (H, F),
        dict(layernorm_type="rmsnorm", activation="relu", use_bias=True),
    ),
    "LayerNormMLP": Case(
        tef.LayerNormMLP,
        tnnx.LayerNormMLP,
        dict(intermediate_dim=INTER),
        (H, INTER),
        dict(activations=("silu", "linear"), use_bias=True, layernorm_type="rmsnorm"),
        dict(deterministic=True),
    ),
    # Dropout configured but off: both families take fused_mlp, as with a rate of 0.
    "LayerNormMLP-dropout-deterministic": Case(
        tef.LayerNormMLP,
        tnnx.LayerNormMLP,
        dict(intermediate_dim=INTER),
        (H, INTER),
        dict(activations="gelu", intermediate_dropout_rate=0.1, gelu_backward="dgelu_bgrad"),
        dict(deterministic=True),
    ),
}
RECIPES = {"bf16": None, "delayed": DelayedScaling(amax_history_len=4)}
PARAMS = [
    pytest.param(name, recipe, id=f"{name}-{recipe}")
    for name, case in CASES.items()
    for recipe in RECIPES
    if case.gemms or recipe == "bf16"
]

# The NNX attribute of each GEMM's quantizers, by the Linen variables' prefix.
_NNX_QUANTIZERS = {"kernel": "quantizers", "wi": "wi_quantizers", "wo": "wo_quantizers"}


def _fp8_to_nnx(fp8: dict) -> dict:
    """Linen's flat ``fp8_metas`` (``{gemm}_{role}_{field}``) as NNX's nested FP8Meta state."""
    out: dict = {}
    for name, value in fp8.items():
        gemm, rest = name.split("_", 1)
        out.setdefault(_NNX_QUANTIZERS[gemm], {})[rest] = value
    return out


def _families(case: Case, recipe: str):
    """``(params, fp8, {"linen": forward, "nnx": forward})``: random values for Linen's variables
    (the names and shapes its init makes), as flat dicts, and each family's
    ``forward(params, fp8, x)`` on them."""
    settings = dict(case.settings)
    if case.gemms:
        settings["recipe"] = RECIPES[recipe]
    x = jnp.zeros(X_SHAPE, jnp.bfloat16)
    linen = case.linen(**case.linen_args, **settings)
    # the variables' names and shapes only (nothing compiled): the values are drawn here
    variables = jax.eval_shape(functools.partial(linen.init, **case.call), jax.random.key(0), x)
    rng = np.random.default_rng(0)
    params = {
        k: jnp.asarray(0.2 * rng.standard_normal(v.shape), v.dtype)
        for k, v in nn.meta.unbox(variables["params"]).items()
    }
    # a delayed-scaling state as a step leaves it: scales other than 1, amaxes recorded
    fp8 = {
        k: jnp.asarray(
            np.full(v.shape, 1.5) if k.endswith("_scale") else np.arange(v.size).reshape(v.shape),
            v.dtype,
        )
        for k, v in variables.get(tef.FP8_COLLECTION, {}).items()
    }

    module = case.nnx(*case.nnx_args, **settings, rngs=nnx.Rngs(0))
    graphdef, nnx_params, nnx_fp8, rest = nnx.split(module, nnx.Param, tnnx.FP8Meta, ...)
    assert set(nnx.to_pure_dict(nnx_params)) == set(params)
    assert nnx.to_pure_dict(nnx_fp8).keys() == _fp8_to_nnx(fp8).keys()

    # one name for both, so the compiled modules are named alike
    def forward_linen(params, fp8, x):
        return linen.apply({"params": params, tef.FP8_COLLECTION: fp8}, x, **case.call)

    def forward_nnx(params, fp8, x):
        return nnx.merge(graphdef, params, _fp8_to_nnx(fp8), rest)(x, **case.call)

    for f in (forward_linen, forward_nnx):
        f.__name__ = f.__qualname__ = "forward"
    return params, fp8, {"linen": forward_linen, "nnx": forward_nnx}


@functools.cache
def _families_of(name: str, recipe: str):
    """``_families`` of ``CASES[name]``, made once for the tests that share it."""
    return _families(CASES[name], recipe)


def _x():
    return jnp.asarray(np.random.default_rng(1).standard_normal(X_SHAPE), jnp.bfloat16)


def _quadratic_loss(f):
    """``Σ_i Σ cot_i · out_i²`` over the module's outputs (``out`` and, where returned,
    ``ln_out``), fixed cotangents: its gradient carries the outputs themselves."""

    def loss(params, fp8, x):
        outs = jax.tree.leaves(f(params, fp8, x))  # None (no ln_out) is no leaf
        total = 0.0
        for i, o in enumerate(outs):
            cot = jnp.asarray(np.random.default_rng(10 + i).standard_normal(o.shape), jnp.float32)
            total += jnp.sum(cot * jnp.square(o.astype(jnp.float32)))
        return total, outs

    return loss


@pytest.mark.parametrize("name, recipe", PARAMS)
def test_outputs_and_gradients_bit_for_bit(name, recipe):
    """Output and the gradient of a quadratic loss with respect to x, every parameter and the
    FP8 state (its next value)."""
    params, fp8, forward = _families_of(name, recipe)

    @jax.jit
    def both(params, fp8, x):  # one program for both families
        return {
            family: jax.value_and_grad(_quadratic_loss(f), (0, 1, 2), has_aux=True)(params, fp8, x)
            for family, f in forward.items()
        }

    results = both(params, fp8, _x())
    _, (d_params, d_fp8, _) = results["linen"]
    assert jax.tree.structure(results["linen"]) == jax.tree.structure(results["nnx"])
    assert all(float(jnp.max(jnp.abs(g))) > 0 for g in jax.tree.leaves(d_params))
    assert d_fp8.keys() == fp8.keys()
    for a, b in zip(
        jax.tree.leaves(results["linen"]), jax.tree.leaves(results["nnx"]), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _compiled_text(f, *args) -> str:
    """The optimized HLO of ``jit(f)`` without its source locations: the tables of files,
    functions and stack frames, and each instruction's metadata (op name, frame)."""
    text = jax.jit(f).lower(*args).compile().as_text()
    text = re.sub(r"\n(FileNames|FunctionNames|FileLocations|StackFrames)\n(.+\n)*", "\n", text)
    return re.sub(r",? metadata=\{[^}]*\}", "", text)


@pytest.mark.parametrize("name, recipe", PARAMS)
def test_same_compiled_forward(name, recipe):
    params, fp8, forward = _families_of(name, recipe)
    x = _x()
    linen, nnx_ = (_compiled_text(forward[f], params, fp8, x) for f in ("linen", "nnx"))
    assert linen == nnx_


def test_mlp_with_deterministic_dropout_is_fused_mlp():
    """A rate above 0 under ``deterministic=True`` (or NNX's ``model.eval()``) compiles to
    what a rate of 0 does (the fused_mlp op), in both families."""
    case = CASES["LayerNormMLP-dropout-deterministic"]
    params, fp8, families = _families_of("LayerNormMLP-dropout-deterministic", "delayed")
    no_dropout = {**case.settings, "intermediate_dropout_rate": 0.0}
    _, _, plain = _families(dataclasses.replace(case, settings=no_dropout), "delayed")
    # NNX's eval mode: deterministic from the module, not the call
    settings = {**case.settings, "recipe": RECIPES["delayed"]}
    model = tnnx.LayerNormMLP(*case.nnx_args, **settings, rngs=nnx.Rngs(0))
    model.eval()
    graphdef, _, _, rest = nnx.split(model, nnx.Param, tnnx.FP8Meta, ...)

    def forward(params, fp8, x):
        return nnx.merge(graphdef, params, _fp8_to_nnx(fp8), rest)(x)

    families = {**families, "nnx-eval": forward}
    x = _x()
    want = _compiled_text(plain["linen"], params, fp8, x)
    for family, f in families.items():
        assert _compiled_text(f, params, fp8, x) == want, family


def test_specs_describe_the_parameters():
    """Both families' parameters are the spec's (made from the Linen module's fields):
    names, shapes, dtypes and logical axis names."""
    opts = dict(activations=("silu", "linear"), use_bias=True, param_dtype=jnp.bfloat16)
    linen = tef.LayerNormMLP(INTER, **opts)
    spec_cls = module_specs.LayerNormMLPSpec
    spec = spec_cls.create("t", H, **{n: getattr(linen, n) for n in spec_cls.settings()})
    want = {p.name: (p.shape, jnp.dtype(p.dtype), p.axes) for p in spec.params()}
    assert want["wi_kernel"] == ((H, 2, INTER), jnp.dtype(jnp.bfloat16), ("embed", "act", "mlp"))
    v = jax.jit(linen.init)(jax.random.key(0), jnp.zeros(X_SHAPE, jnp.float32))["params"]
    assert {k: (p.value.shape, p.value.dtype, p.names) for k, p in v.items()} == want
    m = tnnx.LayerNormMLP(H, INTER, **opts, rngs=nnx.Rngs(0))
    got = {k: getattr(m, k) for k in want}
    assert {
        k: (p.get_value().shape, p.get_value().dtype, p.get_metadata()["out_sharding"])
        for k, p in got.items()
    } == want
    assert m.spec == dataclasses.replace(spec, where="te_jax.nnx.LayerNormMLP")
