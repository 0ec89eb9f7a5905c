"""te_jax.flax (Linen) and te_jax.nnx modules, one test body for both families.

Against a pure-Flax block from the same parameters (``nn.LayerNorm`` / ``nn.RMSNorm`` →
``nn.Dense`` → ``jax.nn`` activation → ``nn.Dense``): forward and every gradient; Linen and NNX
against each other (identical results); FP8 recipes within FP8 tolerance, delayed scaling's
state over steps (docs/numerics.md §4); training, scan over layers, remat, dropout, checkpoints,
logical axes and errors.
"""

from __future__ import annotations

import dataclasses
import math

import flax.linen as nn
import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import qdq_oracle as qdq
import quantize_oracle as qo
import te_jax
import te_jax.flax as tef
from helpers import ACTS
from te_jax import nnx as tnnx
from te_jax.recipe import CurrentScaling, DelayedScaling, Float8BlockScaling, MXFP8BlockScaling

FAMILIES = ("linen", "nnx")


@pytest.fixture(autouse=True)
def _float32_reference_dots():
    """The pure-Flax references' float32 dots in float32 (XLA's GPU default is TF32); te_jax's
    own GEMMs do not read this setting."""
    with jax.default_matmul_precision("highest"):
        yield


# ---- the two families behind one interface ------------------------------------------------


@dataclasses.dataclass
class Built:
    """A module of either family as pure functions: ``apply(params, fp8, x, rng=None)`` →
    module output, with ``params`` a flat ``{name: array}`` dict (the same names in both
    families) and ``fp8`` the FP8 state (flat ``{gemm_role_field: array}``)."""

    params: dict
    fp8: dict
    apply: object


def _flat_fp8_nnx(state) -> dict:
    out = {}
    for path, v in jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(state))[0]:
        names = [p.key for p in path]
        gemm = {"wi_quantizers": "wi_", "wo_quantizers": "wo_", "quantizers": "kernel_"}[names[0]]
        out[gemm + names[-1]] = v
    return out


def _nested_fp8_nnx(flat: dict, like) -> dict:
    pure = nnx.to_pure_dict(like)
    back = {"wi_": "wi_quantizers", "wo_": "wo_quantizers", "kernel_": "quantizers"}
    for name, v in flat.items():
        for prefix, attr in back.items():
            if name.startswith(prefix):
                pure[attr][name[len(prefix) :]] = v
    return pure


def _nnx_merge(graphdef, p_state, f_state, rest, params: dict, fp8: dict):
    """The NNX module of ``nnx.split(m, nnx.Param, FP8Meta, ...)`` with its parameters and FP8
    state replaced by the flat dicts ``params`` and ``fp8``."""
    p = nnx.to_pure_dict(p_state)
    p.update(params)
    ps = nnx.State(p_state)
    nnx.replace_by_pure_dict(ps, p)
    fs = nnx.State(f_state)
    nnx.replace_by_pure_dict(fs, _nested_fp8_nnx(fp8, f_state))
    return nnx.merge(graphdef, ps, fs, rest)


LINEN = {
    "LayerNormMLP": tef.LayerNormMLP,
    "DenseGeneral": tef.DenseGeneral,
    "LayerNormDenseGeneral": tef.LayerNormDenseGeneral,
}
NNX = {
    "LayerNormMLP": tnnx.LayerNormMLP,
    "DenseGeneral": tnnx.Linear,
    "LayerNormDenseGeneral": tnnx.LayerNormLinear,
}


def build(family: str, kind: str, hidden: int, x, seed=0, **opts) -> Built:
    """``kind`` ("LayerNormMLP", "DenseGeneral", "LayerNormDenseGeneral") of ``family`` with
    Linen-style options (``intermediate_dim`` / ``features``)."""
    if family == "linen":
        m = LINEN[kind](**opts)
        keys = {"params": jax.random.key(seed), "dropout": jax.random.key(1)}
        variables = jax.jit(m.init)(keys, x)  # one program, not op by op
        params = nn.meta.unbox(variables["params"])

        def apply(params, fp8, x, rng=None, deterministic=True):
            kw = {} if kind != "LayerNormMLP" else {"deterministic": deterministic}
            rngs = {} if rng is None else {"dropout": rng}
            return m.apply({"params": params, "fp8_metas": fp8}, x, rngs=rngs, **kw)

        return Built(dict(params), dict(variables.get("fp8_metas", {})), apply)
    opts = dict(opts)
    if kind == "LayerNormMLP":
        args = (hidden, opts.pop("intermediate_dim"))
    else:
        args = (hidden, opts.pop("features"))
    m = NNX[kind](*args, rngs=nnx.Rngs(params=seed, dropout=1), **opts)
    graphdef, p_state, f_state, rest = nnx.split(m, nnx.Param, tnnx.FP8Meta, ...)

    def apply(params, fp8, x, rng=None, deterministic=True):
        model = _nnx_merge(graphdef, p_state, f_state, rest, params, fp8)
        if rng is not None:
            model.dropout.rngs = nnx.Rngs(dropout=rng).dropout
        if kind == "LayerNormMLP":
            return model(x, deterministic=deterministic)
        return model(x)

    return Built(dict(nnx.to_pure_dict(p_state)), _flat_fp8_nnx(f_state), apply)


# ---- the pure-Flax reference ------------------------------------------------------------------

_JAX_NN = {
    "gelu": lambda a: jax.nn.gelu(a, approximate=True),
    "gelu_exact": lambda a: jax.nn.gelu(a, approximate=False),
    "sigmoid": jax.nn.sigmoid,
    "silu": jax.nn.silu,
    "relu": jax.nn.relu,
    "quick_gelu": lambda a: a * jax.nn.sigmoid(1.702 * a),
    "squared_relu": lambda a: jnp.square(jax.nn.relu(a)),
}


def _reference_activation(h, act):
    """``jax.nn`` forms; gated h is ``(..., 2, N)`` (activation at 0, linear at 1)."""
    names = act.names
    if names[0] == "clamped_silu":  # clamped SwiGLU, default parameters
        m = jnp.minimum(h[..., 0, :], 7.0)
        return m * jax.nn.sigmoid(1.702 * m) * (jnp.clip(h[..., 1, :], -7.0, 7.0) + 1.0)
    if act.gated:
        return _JAX_NN[names[0]](h[..., 0, :]) * h[..., 1, :]
    return _JAX_NN[names[0]](h)


def reference_mlp(params, x, act, norm, zero_centered, dtype):
    """nn.LayerNorm / nn.RMSNorm → nn.Dense → jax.nn activation → nn.Dense, in ``dtype``."""
    ln = x
    if norm is not None:
        scale = params["scale"] + (1.0 if zero_centered else 0.0)
        if norm == "layernorm":
            ln = nn.LayerNorm(epsilon=1e-6, dtype=dtype, use_fast_variance=False).apply(
                {"params": {"scale": scale, "bias": params["ln_bias"]}}, x
            )
        else:
            ln = nn.RMSNorm(epsilon=1e-6, dtype=dtype).apply({"params": {"scale": scale}}, x)
    k1 = params["wi_kernel"]
    d = {"kernel": k1.reshape(k1.shape[0], -1)}
    if "wi_bias" in params:
        d["bias"] = params["wi_bias"].reshape(-1)
    h = nn.Dense(d["kernel"].shape[1], use_bias="bias" in d, dtype=dtype).apply({"params": d}, ln)
    if act.gated:
        h = h.reshape(*h.shape[:-1], 2, -1)
    y = _reference_activation(h, act)
    d2 = {"kernel": params["wo_kernel"]}
    if "wo_bias" in params:
        d2["bias"] = params["wo_bias"]
    out = nn.Dense(x.shape[-1], use_bias="bias" in d2, dtype=dtype).apply({"params": d2}, y)
    return out, ln


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


TOL = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2}


def _x(rng, shape, dtype):
    return jnp.asarray(rng.standard_normal(shape), dtype)


def _cotangent(shape):
    return jnp.asarray(np.random.default_rng(7).standard_normal(shape), jnp.float32)


def _check_block_against_reference(b: Built, x, act, norm, zero_centered, dtype, tol):
    """Forward (out, ln_out) and gradients (x, every parameter) of ``b`` against the reference
    block on the same parameters, a cotangent spread over the output: each within ``tol``
    (relative 2-norm)."""
    cot = _cotangent(x.shape)

    def loss_mod(params, x):
        out, ln = b.apply(params, b.fp8, x)
        return jnp.sum(out.astype(jnp.float32) * cot), (out, ln)

    def loss_ref(params, x):
        p = {k: v.astype(dtype) for k, v in params.items()}
        out, ln = reference_mlp(p, x, act, norm, zero_centered, dtype)
        return jnp.sum(out.astype(jnp.float32) * cot), (out, ln)

    (_, (out, ln)), (gp, gx) = jax.jit(jax.value_and_grad(loss_mod, (0, 1), has_aux=True))(
        b.params, x
    )
    (_, (out_r, ln_r)), (gp_r, gx_r) = jax.jit(jax.value_and_grad(loss_ref, (0, 1), has_aux=True))(
        b.params, x
    )
    assert out.dtype == dtype and out.shape == x.shape
    checks = {"out": (out, out_r), "ln_out": (ln, ln_r), "dx": (gx, gx_r)}
    checks.update({f"d{k}": (gp[k], gp_r[k]) for k in gp_r})
    for what, (got, want) in checks.items():
        assert rel_err(got, want) <= tol, (what, rel_err(got, want))


# ---- forward and gradients against the reference ---------------------------------------------

# Each activation once; bias, norm, zero-centred gamma and dtype vary across them, and the
# families take turns (four activations each), so that each family meets every option
# (tests/test_module_parity.py holds the two families to each other bit for bit).
_NORMS = ("layernorm", "rmsnorm", None)
MLP_CASES = [
    (
        FAMILIES[(i // 4) % 2],
        act,
        i % 2 == 0,
        _NORMS[i % 3],
        i % 4 == 1,
        (jnp.float32, jnp.bfloat16)[(i // 2) % 2],
    )
    for i, act in enumerate(ACTS)
]


def _case_id(case):
    family, act, bias, norm, zc, dtype = case
    return (
        f"{family}-{act}-{'bias' if bias else 'nobias'}-{norm or 'nonorm'}{'-zc' if zc else ''}-"
        f"{jnp.dtype(dtype).name}"
    )


@pytest.mark.parametrize("case", MLP_CASES, ids=[_case_id(c) for c in MLP_CASES])
def test_mlp_matches_flax_reference(case, rng):
    family, act, bias, norm, zc, dtype = case
    x = _x(rng, (2, 5, 24), dtype)
    b = build(
        family,
        "LayerNormMLP",
        24,
        x,
        intermediate_dim=40,
        activations=act.names,
        use_bias=bias,
        enable_layernorm=norm is not None,
        layernorm_type=norm or "layernorm",
        zero_centered_gamma=zc,
        bias_init=nn.initializers.normal(0.5),
        scale_init=nn.initializers.normal(0.3) if zc else None,
    )
    assert set(b.params) == (
        {"wi_kernel", "wo_kernel"}
        | ({"wi_bias", "wo_bias"} if bias else set())
        | ({"scale"} if norm else set())
        | ({"ln_bias"} if norm == "layernorm" else set())
    )
    assert b.params["wi_kernel"].shape == ((24, 2, 40) if act.gated else (24, 40))
    _check_block_against_reference(b, x, act, norm, zc, dtype, TOL[dtype])


@pytest.mark.parametrize(
    "axis, features, act",
    [(-1, 12, None), ((1, 2), (3, 4), "gelu"), (-1, 12, "swiglu")],
    ids=["plain", "two-axes-gelu", "swiglu"],
)
@pytest.mark.parametrize("family", FAMILIES)
def test_dense_matches_flax_dense_general(family, axis, features, act, rng):
    x = _x(rng, (3, 4, 6), jnp.float32)
    if family == "nnx":  # Linear contracts the trailing in_features axes
        in_features = 6 if axis == -1 else (4, 6)
        b = build(
            family,
            "DenseGeneral",
            in_features,
            x,
            features=features,
            activation=act,
            bias_init=nn.initializers.normal(0.5),
        )
    else:
        b = build(
            family,
            "DenseGeneral",
            6,
            x,
            features=features,
            axis=axis,
            activation=act,
            bias_init=nn.initializers.normal(0.5),
        )
    act_t = None if act is None else te_jax.ActivationType.parse(act)
    gated = act_t is not None and act_t.is_gated

    def ref(params, x):
        k, bias = params["kernel"], params["bias"]
        if gated:  # (K, 2, N): the two halves as two DenseGenerals
            halves = [
                nn.DenseGeneral(features, axis=axis).apply(
                    {"params": {"kernel": k[:, i], "bias": bias[i]}}, x
                )
                for i in range(2)
            ]
            return jax.nn.silu(halves[0]) * halves[1]
        h = nn.DenseGeneral(features, axis=axis).apply({"params": {"kernel": k, "bias": bias}}, x)
        return h if act is None else jax.nn.gelu(h, approximate=True)

    cot = jnp.asarray(rng.standard_normal(ref(b.params, x).shape), jnp.float32)
    got = jax.jit(jax.value_and_grad(lambda p, x: jnp.sum(b.apply(p, b.fp8, x) * cot), (0, 1)))(
        b.params, x
    )
    want = jax.jit(jax.value_and_grad(lambda p, x: jnp.sum(ref(p, x) * cot), (0, 1)))(b.params, x)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert rel_err(g, w) <= 2e-5


@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize("family", FAMILIES)
def test_layernorm_dense(family, norm, rng):
    """LayerNormDenseGeneral / LayerNormLinear: norm then dense, (y, ln_out); LayerNorm alone."""
    x = _x(rng, (2, 3, 16), jnp.float32)
    b = build(
        family,
        "LayerNormDenseGeneral",
        16,
        x,
        features=8,
        layernorm_type=norm,
        use_bias=True,
        activation="relu",
        bias_init=nn.initializers.normal(0.5),
        scale_init=nn.initializers.normal(1.0),
    )
    y, ln_out = b.apply(b.params, b.fp8, x)
    if norm == "layernorm":
        ln_ref = nn.LayerNorm(epsilon=1e-6, use_fast_variance=False).apply(
            {"params": {"scale": b.params["scale"], "bias": b.params["ln_bias"]}}, x
        )
    else:
        ln_ref = nn.RMSNorm(epsilon=1e-6).apply({"params": {"scale": b.params["scale"]}}, x)
    y_ref = jax.nn.relu(ln_ref @ b.params["kernel"] + b.params["bias"])
    assert rel_err(ln_out, ln_ref) <= 2e-6 and rel_err(y, y_ref) <= 2e-5
    if family == "linen":
        m = tef.LayerNorm(layernorm_type=norm)
        v = jax.jit(m.init)(jax.random.key(0), x)
        assert (
            rel_err(
                m.apply(v, x),
                nn.LayerNorm(epsilon=1e-6).apply(
                    {"params": {"scale": jnp.ones(16), "bias": jnp.zeros(16)}}, x
                )
                if norm == "layernorm"
                else nn.RMSNorm(epsilon=1e-6).apply({"params": {"scale": jnp.ones(16)}}, x),
            )
            <= 2e-6
        )
    else:
        m = tnnx.LayerNorm(16, layernorm_type=norm, rngs=nnx.Rngs(0))
        assert set(nnx.to_pure_dict(nnx.state(m, nnx.Param))) == (
            {"scale", "ln_bias"} if norm == "layernorm" else {"scale"}
        )


# ---- FP8 ---------------------------------------------------------------------------------

RECIPES = {
    "delayed": DelayedScaling(amax_history_len=8),
    "current": CurrentScaling(),
    "mxfp8": MXFP8BlockScaling(),
}


# (x and kernel, gradient) formats: the recipes' defaults, HYBRID for tensor scaling
FORMATS = {
    "delayed": (qdq.E4M3, qdq.E5M2),
    "current": (qdq.E4M3, qdq.E5M2),
    "mxfp8": (qdq.E4M3, qdq.E4M3),
}


@pytest.mark.skipif(
    jax.default_backend() != "cpu",
    reason="the interval reference is float32 accumulation of the exact dequantized product "
    "(the CPU's GEMM); a GPU's GEMMs round otherwise, held to docs/numerics.md §8 by "
    "tests/test_dense.py",
)
# Each recipe once, the families taking turns (test_module_parity: bit for bit to each other).
@pytest.mark.parametrize(
    "family, name",
    [("linen", "delayed"), ("nnx", "current"), ("nnx", "mxfp8")],
    ids=["linen-delayed", "nnx-current", "nnx-mxfp8"],
)
def test_fp8_equals_the_quantize_dequantize_reference(family, name, rng):
    """Forward and every gradient inside tests/qdq_oracle.py's intervals: the block computed
    exactly from operands quantized and dequantized with the op's own scales (FP8's rounding
    itself is in the reference, not in the tolerance), on the module's own ln_out; the loss
    Σ cot · out² / 2, so the output gradient is the module's output times cot. Delayed scaling
    runs on the state a step on other inputs left."""
    act = next(a for a in ACTS if a.alias == "geglu")
    x = _x(rng, (2, 32, 64), jnp.bfloat16)
    b = build(
        family,
        "LayerNormMLP",
        64,
        x,
        intermediate_dim=96,
        activations=act.names,
        use_bias=True,
        recipe=RECIPES[name],
        bias_init=nn.initializers.normal(0.2),
    )
    params = dict(b.params)  # a norm that is not the identity
    params["scale"] = jnp.asarray(1 + 0.2 * rng.standard_normal(64), jnp.float32)
    params["ln_bias"] = jnp.asarray(0.1 * rng.standard_normal(64), jnp.float32)
    cot = _cotangent(x.shape)
    fp8 = b.fp8
    if name == "delayed":  # scales from a step on other inputs (not this x's own amaxes)
        other = _x(rng, x.shape, jnp.bfloat16)
        step = jax.jit(
            jax.grad(lambda s: jnp.sum(b.apply(params, s, other)[0].astype(jnp.float32)))
        )
        fp8 = step(fp8)
        assert all(float(v) != 1.0 for k, v in fp8.items() if k.endswith("_scale"))

    def loss(p, x):
        out, ln = b.apply(p, fp8, x)
        return 0.5 * jnp.sum(cot * jnp.square(out.astype(jnp.float32))), (out, ln)

    (_, (out, ln)), (gp, gx) = jax.jit(jax.value_and_grad(loss, (0, 1), has_aux=True))(params, x)
    rows = lambda a: np.asarray(a).reshape(-1, 64)  # noqa: E731
    np_ = {k: np.asarray(v) for k, v in params.items()}
    ref, _ = qdq.mlp_step(
        rows(ln),
        rows(x),
        np_["scale"],
        np_["wi_kernel"],
        np_["wi_bias"],
        np_["wo_kernel"],
        np_["wo_bias"],
        rows(out),
        rows(cot),
        qdq.Recipe(name, *FORMATS[name]),
        act.enum,
        {k[: -len("_scale")]: np.float32(v) for k, v in fp8.items() if k.endswith("_scale")},
    )
    got = {"out": out, "dx": gx, **{f"d{k}": v for k, v in gp.items()}}
    assert set(got) == set(ref)
    for what, iv in ref.items():
        g = np.asarray(got[what]).astype(np.float64).reshape(iv.lo.shape)
        outside = ~iv.contains(g)
        i = np.unravel_index(np.argmax(outside), g.shape)
        assert not outside.any(), (
            f"{what}: {int(outside.sum())} of {g.size} outside; e.g. {i}: {g[i]} not in "
            f"[{iv.lo[i]}, {iv.hi[i]}]"
        )
        # the reference is tight: far inside FP8's own error (2^-4 of every element)
        width = np.linalg.norm(iv.rad) / np.linalg.norm(iv.mid)
        assert width <= 2**-5, (what, width)


DELAYED_VARIANTS = {
    "max": DelayedScaling(amax_history_len=4),
    "max-margin1": DelayedScaling(amax_history_len=4, margin=1),
    "most_recent-margin2": DelayedScaling(
        amax_history_len=4, margin=2, amax_compute_algo="most_recent"
    ),
}
# each step's input and output-gradient magnitudes: up, down, up, down (the history wraps)
STEP_MAGNITUDES = [1.0, 3.0, 0.5, 2.0, 0.25, 1.5]


@pytest.mark.parametrize(
    "family, variant",
    [("linen", "max"), ("nnx", "max-margin1"), ("linen", "most_recent-margin2")],
    ids=lambda v: v,
)
def test_delayed_state_evolves_over_steps(family, variant, rng):
    """Six training steps on inputs whose magnitude rises and falls: every quantizer's new
    state (forward: x, kernel; backward: grad) is docs/numerics.md §4's update of the state it
    was given (quantize_oracle.delayed_update, with the recipe's margin and amax algorithm),
    with the newest amax that of the tensor it quantized: exact for the kernels, ln_out and
    the output gradient, inside tests/qdq_oracle.py's interval for the activation and wi's
    gradient (they come through an FP8 GEMM). The inputs are such that "max" and
    "most_recent" give different scales, and a shifted history is told from a fresh one."""
    recipe = DELAYED_VARIANTS[variant]
    x0 = _x(rng, (4, 8, 32), jnp.bfloat16)
    b = build(
        family,
        "LayerNormMLP",
        32,
        x0,
        intermediate_dim=64,
        activations="gelu",
        use_bias=True,
        recipe=recipe,
        bias_init=nn.initializers.normal(0.2),
    )
    act = next(a for a in ACTS if a.alias == "gelu")
    p = {k: np.asarray(v) for k, v in b.params.items()}
    rows = lambda a: np.asarray(a).reshape(-1, 32)  # noqa: E731

    def loss(s, x, cot):
        out, ln = b.apply(b.params, s, x)
        return 0.5 * jnp.sum(cot * jnp.square(out.astype(jnp.float32))), (out, ln)

    step = jax.jit(jax.grad(loss, has_aux=True))
    fp8 = b.fp8
    algos_differ = False
    for i, mag in enumerate(STEP_MAGNITUDES):
        x = _x(rng, x0.shape, jnp.bfloat16) * mag
        cot = jnp.asarray(rng.standard_normal(x.shape) * mag, jnp.float32)
        new, (out, ln) = step(fp8, x, cot)
        scales = {t[:-6]: np.float32(v) for t, v in fp8.items() if t.endswith("_scale")}
        _, amax = qdq.mlp_step(
            rows(ln),
            rows(x),
            p["scale"],
            p["wi_kernel"],
            p["wi_bias"],
            p["wo_kernel"],
            p["wo_bias"],
            rows(out),
            rows(cot),
            qdq.Recipe("delayed", *FORMATS["delayed"]),
            act.enum,
            scales,
        )
        for t, iv in amax.items():
            q_max = qo.Q_MAX[FORMATS["delayed"][1 if t.endswith("grad") else 0]]
            got_h = np.asarray(new[f"{t}_amax_history"])
            a = got_h[-1]  # the newest amax ends in the last slot
            assert iv.lo <= a <= iv.hi, (i, t, a, iv)
            if t in ("wi_x", "wi_kernel", "wo_kernel", "wo_grad"):
                assert iv.lo == iv.hi, (t, iv)  # known exactly: the amax is exact
            old_s, old_h = np.float32(fp8[f"{t}_scale"]), np.asarray(fp8[f"{t}_amax_history"])
            want_s, want_h = qo.delayed_update(
                old_s, old_h, a, q_max, recipe.margin, recipe.amax_compute_algo
            )
            np.testing.assert_array_equal(got_h, want_h, err_msg=f"step {i} {t}")
            assert np.float32(new[f"{t}_scale"]) == want_s, (i, t, new[f"{t}_scale"], want_s)
            other = "max" if recipe.amax_compute_algo == "most_recent" else "most_recent"
            alt_s, _ = qo.delayed_update(old_s, old_h, a, q_max, recipe.margin, other)
            algos_differ |= bool(alt_s != want_s)
        fp8 = new
    assert algos_differ, "the inputs never told max from most_recent"


# ---- training ------------------------------------------------------------------------------


class _FlaxBlock(nn.Module):
    """The Flax-native block the issue compares against."""

    inter: int

    @nn.compact
    def __call__(self, x):
        h = nn.LayerNorm(dtype=x.dtype, use_fast_variance=False, epsilon=1e-6)(x)
        h = nn.Dense(self.inter, dtype=x.dtype)(h)
        h = jax.nn.gelu(h, approximate=True)
        return nn.Dense(x.shape[-1], dtype=x.dtype)(h)


def _train(apply, params, fp8, data, steps=50):
    tx = optax.adam(3e-3)
    opt = tx.init(params)

    @jax.jit
    def step(params, fp8, opt, x, y):
        def loss(params, fp8):
            out = apply(params, fp8, x)
            return jnp.mean(jnp.square(out.astype(jnp.float32) - y))

        value, (g, new_fp8) = jax.value_and_grad(loss, (0, 1))(params, fp8)
        updates, opt = tx.update(g, opt, params)
        return optax.apply_updates(params, updates), new_fp8, opt, value

    losses = []
    for i in range(steps):
        x, y = data[i % len(data)]
        params, fp8, opt, value = step(params, fp8, opt, x, y)
        losses.append(float(value))
    return np.array(losses)


@pytest.mark.parametrize(
    "family, name",
    [("linen", None), ("nnx", "delayed"), ("linen", "current"), ("nnx", "mxfp8")],
    ids=["linen-bf16", "nnx-delayed", "linen-current", "nnx-mxfp8"],
)
def test_training_tracks_the_flax_block(family, name, rng):
    """50 adam steps on a synthetic regression: the loss curve tracks the Flax-native bf16
    block's from the same initial parameters (bf16 within 1e-2 relative, FP8 within 5%)."""
    d, inter = 32, 64
    w_true = rng.standard_normal((d, d)) / math.sqrt(d)
    data = []
    for _ in range(4):
        xs = rng.standard_normal((64, d))
        data.append((jnp.asarray(xs, jnp.bfloat16), jnp.asarray(np.tanh(xs @ w_true), jnp.float32)))
    x0 = data[0][0]
    b = build(
        family,
        "LayerNormMLP",
        d,
        x0,
        intermediate_dim=inter,
        activations="gelu",
        use_bias=True,
        return_layernorm_output=False,
        recipe=None if name is None else RECIPES[name],
    )
    flax_block = _FlaxBlock(inter)
    ref_params = {
        "LayerNorm_0": {"scale": b.params["scale"], "bias": b.params["ln_bias"]},
        "Dense_0": {"kernel": b.params["wi_kernel"], "bias": b.params["wi_bias"]},
        "Dense_1": {"kernel": b.params["wo_kernel"], "bias": b.params["wo_bias"]},
    }
    ours = _train(lambda p, s, x: b.apply(p, s, x)[0], b.params, b.fp8, data)
    ref = _train(lambda p, s, x: flax_block.apply({"params": p}, x), ref_params, {}, data)
    assert ref[-1] < 0.5 * ref[0], "the reference did not train"
    tol = 1e-2 if name is None else 5e-2
    assert np.max(np.abs(ours - ref) / ref) <= tol, np.max(np.abs(ours - ref) / ref)


# ---- transformations ---------------------------------------------------------------------


def _scanned_stack(family, n, d, x, opts):
    """``n`` residual LayerNormMLP layers under ``nn.scan`` / ``nnx.scan``, each rematerialised:
    ``(stacked params, stacked fp8 state, f(params, fp8, x))``, flat names as ``build``."""
    if family == "linen":

        class Residual(nn.Module):
            @nn.compact
            def __call__(self, x, _):
                return x + tef.LayerNormMLP(**opts, name="mlp")(x)[0], None

        stack = nn.scan(
            nn.remat(Residual),
            variable_axes={"params": 0, tef.FP8_COLLECTION: 0},
            split_rngs={"params": True},
            length=n,
            metadata_params={nn.PARTITION_NAME: "layers"},
        )()
        v = jax.jit(stack.init)(jax.random.key(3), x, None)

        def f(params, fp8, x):
            return stack.apply({"params": {"mlp": params}, "fp8_metas": {"mlp": fp8}}, x, None)[0]

        return nn.meta.unbox(v["params"]["mlp"]), v["fp8_metas"]["mlp"], f
    opts = dict(opts)
    inter = opts.pop("intermediate_dim")

    @nnx.vmap(in_axes=0, out_axes=0)
    def create(key):
        return tnnx.LayerNormMLP(d, inter, rngs=nnx.Rngs(key), **opts)

    graphdef, p_state, f_state, rest = nnx.split(
        create(jax.random.split(jax.random.key(3), n)), nnx.Param, tnnx.FP8Meta, ...
    )

    @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
    @nnx.remat
    def forward(layer, x):
        return x + layer(x)[0]

    def f(params, fp8, x):
        return forward(_nnx_merge(graphdef, p_state, f_state, rest, params, fp8), x)

    return dict(nnx.to_pure_dict(p_state)), _flat_fp8_nnx(f_state), f


@pytest.mark.parametrize("family", FAMILIES)
def test_scan_over_layers_with_remat(family, rng):
    """A scanned, rematerialised stack equals the same layers unrolled: output, gradients and
    every layer's new FP8 state (delayed scaling, stacked along the layer axis). Two layers:
    the second's input and state are the first's output and its own slice of the stack."""
    n, d = 2, 16
    opts = dict(
        intermediate_dim=32,
        activations="gelu",
        use_bias=True,
        recipe=DelayedScaling(amax_history_len=4),
        bias_init=nn.initializers.normal(0.2),
    )
    x = _x(rng, (4, d), jnp.float32)
    params, fp8, scanned = _scanned_stack(family, n, d, x, opts)
    assert params["wi_kernel"].shape == (n, d, 32) and fp8["wo_grad_amax_history"].shape == (n, 4)
    layer = build(family, "LayerNormMLP", d, x, **opts)

    def unrolled(params, fp8, x):
        for i in range(n):
            at = lambda t, i=i: jax.tree.map(lambda a: a[i], t)  # noqa: E731
            x = x + layer.apply(at(params), at(fp8), x)[0]
        return x

    cot = _cotangent(x.shape)
    grads = [
        jax.jit(jax.value_and_grad(lambda p, s, x, f=f: jnp.sum(f(p, s, x) * cot), (0, 1, 2)))(
            params, fp8, x
        )
        for f in (scanned, unrolled)
    ]
    for a, b in zip(jax.tree.leaves(grads[0]), jax.tree.leaves(grads[1]), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("family", FAMILIES)
def test_dropout_is_deterministic_under_a_fixed_rng(family, rng):
    x = _x(rng, (8, 16), jnp.float32)
    b = build(
        family,
        "LayerNormMLP",
        16,
        x,
        intermediate_dim=64,
        activations="relu",
        intermediate_dropout_rate=0.5,
    )
    plain = build(family, "LayerNormMLP", 16, x, intermediate_dim=64, activations="relu")
    run = lambda key, det=False: b.apply(b.params, b.fp8, x, rng=key, deterministic=det)[0]  # noqa: E731
    k1, k2 = jax.random.key(11), jax.random.key(12)
    np.testing.assert_array_equal(run(k1), run(k1))
    assert not np.array_equal(run(k1), run(k2))
    # deterministic: no dropout, the rate-0 block's output on the same parameters
    np.testing.assert_array_equal(run(k1, det=True), plain.apply(b.params, plain.fp8, x)[0])
    # the dropped intermediate: the output is the second GEMM of a masked, rescaled h
    assert rel_err(run(k1), run(k1, det=True)) > 0.1


@pytest.mark.parametrize("family", FAMILIES)
def test_checkpoint_round_trip(family, rng):
    """flax.serialization bytes of the parameters and the FP8 state restore the same module."""
    x = _x(rng, (4, 32), jnp.float32)
    opts = dict(
        intermediate_dim=32,
        activations=("silu", "linear"),
        use_bias=True,
        recipe=DelayedScaling(amax_history_len=4),
    )
    b = build(family, "LayerNormMLP", 32, x, **opts)
    fp8 = jax.jit(jax.grad(lambda s: jnp.sum(b.apply(b.params, s, x)[0])))(b.fp8)  # non-trivial
    blob = flax.serialization.to_bytes({"params": b.params, "fp8": fp8})
    fresh = build(family, "LayerNormMLP", 32, x, seed=5, **opts)
    restored = flax.serialization.from_bytes({"params": fresh.params, "fp8": fresh.fp8}, blob)
    for a, c in zip(
        jax.tree.leaves(restored), jax.tree.leaves({"params": b.params, "fp8": fp8}), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(c))
    # jitted: one program per module, not one per eager op
    np.testing.assert_array_equal(
        jax.jit(lambda p, s: fresh.apply(p, s, x)[0])(restored["params"], restored["fp8"]),
        jax.jit(lambda p, s: b.apply(p, s, x)[0])(b.params, fp8),
    )
    if family == "nnx":  # the module's own state, through nnx.state / nnx.update
        m = tnnx.LayerNormMLP(
            32,
            32,
            activations=("silu", "linear"),
            use_bias=True,
            recipe=DelayedScaling(amax_history_len=4),
            rngs=nnx.Rngs(0),
        )
        blob = flax.serialization.to_bytes(nnx.to_pure_dict(nnx.state(m)))
        m2 = tnnx.LayerNormMLP(
            32,
            32,
            activations=("silu", "linear"),
            use_bias=True,
            recipe=DelayedScaling(amax_history_len=4),
            rngs=nnx.Rngs(9),
        )
        state = nnx.state(m2)
        nnx.replace_by_pure_dict(
            state, flax.serialization.from_bytes(nnx.to_pure_dict(state), blob)
        )
        nnx.update(m2, state)
        forward = nnx.jit(lambda m: m(x)[0])
        np.testing.assert_array_equal(forward(m2), forward(m))


def test_fp8_state_helpers(rng):
    """update_fp8_metas / update_fp8_state take the gradient's FP8 part as the new state and
    leave the parameters to the optimizer; nnx.Optimizer(wrt=nnx.Param) never sees FP8Meta."""
    x = _x(rng, (4, 32), jnp.float32)
    recipe = DelayedScaling(amax_history_len=4)
    m = tef.LayerNormMLP(32, activations="gelu", recipe=recipe)
    v = jax.jit(m.init)(jax.random.key(0), x)
    g = jax.jit(jax.grad(lambda v: jnp.sum(m.apply(v, x)[0])))(v)  # one program, not op by op
    new = tef.update_fp8_metas(v, g)
    assert new["params"] is v["params"] and new["fp8_metas"] is g["fp8_metas"]
    assert tef.update_fp8_metas(v, {"params": g["params"]}) == dict(v)
    _, updates = jax.jit(lambda v: m.apply(v, x, mutable=[tef.FP8_COLLECTION]))(v)  # mutable form
    assert set(updates) == {tef.FP8_COLLECTION}

    model = tnnx.LayerNormMLP(32, 32, activations="gelu", recipe=recipe, rngs=nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    assert not jax.tree.leaves(nnx.state(opt.opt_state, tnnx.FP8Meta))
    before = nnx.to_pure_dict(nnx.state(model, tnnx.FP8Meta))
    grads = nnx.jit(
        nnx.grad(lambda m: jnp.sum(m(x)[0]), argnums=nnx.DiffState(0, (nnx.Param, tnnx.FP8Meta)))
    )(model)
    opt.update(model, grads)
    tnnx.update_fp8_state(model, grads)
    after = nnx.to_pure_dict(nnx.state(model, tnnx.FP8Meta))
    want = nnx.to_pure_dict(nnx.state(grads, tnnx.FP8Meta))
    for a, w in zip(jax.tree.leaves(after), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(a, w)
    assert float(after["wi_quantizers"]["x_amax_history"][-1]) > 0
    assert float(before["wi_quantizers"]["x_amax_history"][-1]) == 0


def test_logical_axis_names(rng):
    """Every parameter carries logical axis names (TE-JAX's defaults; "act" dropped for a
    non-gated activation)."""
    x = _x(rng, (2, 16), jnp.float32)
    for act, k1, b1 in (
        (("silu", "linear"), ("embed", "act", "mlp"), ("act", "mlp")),
        ("gelu", ("embed", "mlp"), ("mlp",)),
    ):
        want = {
            "scale": ("embed",),
            "ln_bias": ("embed",),
            "wi_kernel": k1,
            "wi_bias": b1,
            "wo_kernel": ("mlp", "embed"),
            "wo_bias": ("embed",),
        }
        v = jax.jit(tef.LayerNormMLP(32, activations=act, use_bias=True).init)(jax.random.key(0), x)
        got = {k: p.names for k, p in v["params"].items()}
        assert got == want
        m = tnnx.LayerNormMLP(16, 32, activations=act, use_bias=True, rngs=nnx.Rngs(0))
        specs = nnx.get_partition_spec(nnx.state(m, nnx.Param))
        assert {k: tuple(p.get_value()) for k, p in specs.items()} == want
    v = tef.DenseGeneral(8, kernel_axes=("embed", "mlp"), bias_axes=("mlp",)).init(
        jax.random.key(0), x
    )
    assert v["params"]["kernel"].names == ("embed", "mlp")


ERRORS = {
    "activation": (dict(activations="tanh"), ValueError, "LayerNormMLP: .*tanh"),
    "no-activation": (dict(activations=None), ValueError, "activations must name"),
    "recipe": (dict(recipe="fp8"), TypeError, "recipe must be"),
    "norm": (dict(layernorm_type="batchnorm"), ValueError, "layernorm_type must be one of"),
    "dropout": (dict(intermediate_dropout_rate=1.0), ValueError, r"in \[0, 1\)"),
    "axes": (dict(kernel_axes_2=("a", "b", "c")), ValueError, "3 logical axis names"),
    "params": (
        dict(activations="gelu", activation_params={"limit": 3.0}),
        ValueError,
        "activation_params",
    ),
}


@pytest.mark.parametrize("case", list(ERRORS))
@pytest.mark.parametrize("family", FAMILIES)
def test_bad_options_raise(family, case):
    opts, exc, match = ERRORS[case]
    x = jnp.ones((2, 16))
    with pytest.raises(exc, match=match):
        build(family, "LayerNormMLP", 16, x, intermediate_dim=32, **opts)


@pytest.mark.parametrize("family", ["linen", "nnx"])
def test_blockwise_step_is_close_to_the_bf16_one(family, rng):
    """A LayerNormMLP step under Float8BlockScaling (x and the gradients in 1×128 blocks, the
    kernels in 128×128 tiles; hidden 200 and intermediate 160 leave partial blocks) against the
    same module without a recipe on the same parameters: the output and every gradient within
    2^-3 of the bf16 step's (relative 2-norm; E4M3 rounds each GEMM operand by up to 2^-4
    relative, and those errors partly cancel in the GEMMs' sums)."""
    x = _x(rng, (2, 70, 200), jnp.bfloat16)
    opts = dict(intermediate_dim=160, activations=("silu", "linear"), use_bias=True)
    fp8 = build(family, "LayerNormMLP", 200, x, recipe=Float8BlockScaling(), **opts)
    bf16 = build(family, "LayerNormMLP", 200, x, **opts)
    cot = _cotangent(x.shape)

    def step(b):
        def loss(p, x):
            out = b.apply(p, b.fp8, x)[0]
            return jnp.sum(cot * out.astype(jnp.float32)), out

        return jax.jit(jax.value_and_grad(loss, (0, 1), has_aux=True))(fp8.params, x)

    (_, got_out), (got_p, got_x) = step(fp8)
    (_, want_out), (want_p, want_x) = step(bf16)
    got = {"out": got_out, "dx": got_x, **got_p}
    want = {"out": want_out, "dx": want_x, **want_p}
    assert set(got) == set(want)
    for what in want:
        g, w = (np.asarray(a[what], np.float64) for a in (got, want))
        err = np.linalg.norm(g - w) / np.linalg.norm(w)
        assert err <= 2**-3, (what, err)
