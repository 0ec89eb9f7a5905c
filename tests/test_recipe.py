"""te_jax.recipe: the recipes' defaults, formats and errors, QuantizerSet.create for each recipe,
and the QuantizerSet pytree (flatten / unflatten, jit, a lax.scan carry, vmap over a stack)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import te_jax
from te_jax.quantize import (
    CurrentScaleQuantizer,
    DelayedScaleQuantizer,
    Float8Block1DQuantizer,
    Float8Block2DQuantizer,
    MXFP8Quantizer,
    QuantizeLayout,
    ScalingMode,
)
from te_jax.recipe import (
    FP8_FORMATS,
    CurrentScaling,
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    Format,
    MXFP8BlockScaling,
    QParams,
    QuantizerSet,
    Recipe,
)

E4M3, E5M2 = np.dtype(jnp.float8_e4m3fn), np.dtype(jnp.float8_e5m2)
ROLES = ("x", "kernel", "grad")
RECIPES = [DelayedScaling, CurrentScaling, MXFP8BlockScaling]
QUANTIZER = {
    DelayedScaling: DelayedScaleQuantizer,
    CurrentScaling: CurrentScaleQuantizer,
    MXFP8BlockScaling: MXFP8Quantizer,
}
MODE = {
    DelayedScaling: ScalingMode.DELAYED_TENSOR_SCALING,
    CurrentScaling: ScalingMode.CURRENT_TENSOR_SCALING,
    MXFP8BlockScaling: ScalingMode.MXFP8_1D_SCALING,
}


def test_exported():
    assert te_jax.QuantizerSet is QuantizerSet
    assert te_jax.recipe.DelayedScaling is DelayedScaling
    assert set(FP8_FORMATS) == {"HYBRID", "E4M3"}


def test_defaults():
    d = DelayedScaling()
    assert (d.fp8_format, d.amax_history_len, d.margin, d.amax_compute_algo) == (
        "HYBRID",
        1024,
        0,
        "max",
    )
    assert CurrentScaling().fp8_format == "HYBRID"
    assert MXFP8BlockScaling().fp8_format == "E4M3"  # as TransformerEngine's MXFP8 recipe


@pytest.mark.parametrize("recipe_cls", RECIPES, ids=lambda c: c.__name__)
@pytest.mark.parametrize(
    "fmt, fwd, grad",
    [
        ("HYBRID", E4M3, E5M2),
        ("E4M3", E4M3, E4M3),
        ("hybrid", E4M3, E5M2),
        (Format.HYBRID, E4M3, E5M2),
        (Format.E4M3, E4M3, E4M3),
    ],
    ids=["HYBRID", "E4M3", "hybrid", "Format.HYBRID", "Format.E4M3"],
)
def test_formats(recipe_cls, fmt, fwd, grad):
    """HYBRID: E4M3 for x and kernel, E5M2 for the gradient; E4M3: E4M3 throughout (the name is
    case-insensitive, normalised to upper case; TransformerEngine's Format members too)."""
    r = recipe_cls(fp8_format=fmt)
    assert isinstance(r, Recipe)
    assert r.fp8_format == (fmt.value if isinstance(fmt, Format) else fmt.upper())
    assert np.dtype(r.forward_dtype) == fwd and np.dtype(r.grad_dtype) == grad
    qs = QuantizerSet.create(r)
    assert [np.dtype(getattr(qs, role).q_dtype) for role in ROLES] == [fwd, fwd, grad]


@pytest.mark.parametrize("recipe_cls", RECIPES, ids=lambda c: c.__name__)
@pytest.mark.parametrize("fmt", ["E5M2", "fp8", "", None, 3])
def test_bad_fp8_format(recipe_cls, fmt):
    with pytest.raises(
        ValueError, match=f"{recipe_cls.__name__}: fp8_format must be one of 'HYBRID', 'E4M3', got"
    ):
        recipe_cls(fp8_format=fmt)


def test_transformer_engine_names():
    """TransformerEngine's Float8CurrentScaling is CurrentScaling; its Format.E5M2 (E5M2 for
    every tensor) is refused naming the formats te_jax has."""
    assert Float8CurrentScaling is CurrentScaling
    assert Float8CurrentScaling(fp8_format=Format.HYBRID) == CurrentScaling()
    with pytest.raises(ValueError, match=r"DelayedScaling: fp8_format=Format.E5M2 .*Format.HYBRID"):
        DelayedScaling(fp8_format=Format.E5M2)


@pytest.mark.parametrize("algo", ["mean", "MAX", None])
def test_bad_amax_compute_algo(algo):
    with pytest.raises(
        ValueError,
        match="DelayedScaling: amax_compute_algo must be one of 'max', 'most_recent', got",
    ):
        DelayedScaling(amax_compute_algo=algo)


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"amax_history_len": 0}, "amax_history_len must be an int >= 1"),
        ({"amax_history_len": 2.5}, "amax_history_len must be an int >= 1"),
        ({"margin": -1}, "margin must be a non-negative int"),
    ],
    ids=["history-0", "history-float", "margin-negative"],
)
def test_bad_delayed_parameters(kw, match):
    """Rejected when the recipe is built or, at the latest, when its quantizers are made."""
    with pytest.raises(ValueError, match=match):
        QuantizerSet.create(DelayedScaling(**kw))


def test_recipes_are_frozen_values():
    """Hashable and compared by value (usable as static arguments)."""
    assert DelayedScaling(margin=1) == DelayedScaling(margin=1)
    assert hash(CurrentScaling()) == hash(CurrentScaling())
    assert DelayedScaling() != DelayedScaling(amax_history_len=16)
    with pytest.raises(AttributeError):
        DelayedScaling().margin = 2


@pytest.mark.parametrize("recipe_cls", RECIPES, ids=lambda c: c.__name__)
def test_create(recipe_cls):
    qs = QuantizerSet.create(recipe_cls())
    assert not qs.is_empty and qs.scaling_mode == MODE[recipe_cls]
    for role in ROLES:
        q = getattr(qs, role)
        assert type(q) is QUANTIZER[recipe_cls], role
        assert q.scaling_mode == MODE[recipe_cls]
    lay = qs.with_layout("kernel", QuantizeLayout.COLWISE)
    assert lay.q_layout == QuantizeLayout.COLWISE and type(lay) is type(qs.kernel)


def test_create_delayed_state():
    r = DelayedScaling(
        fp8_format="E4M3", amax_history_len=5, margin=2, amax_compute_algo="most_recent"
    )
    qs = QuantizerSet.create(r)
    for role in ROLES:
        q = getattr(qs, role)
        assert (q.margin, q.amax_compute_algo, q.amax_history_len) == (2, "most_recent", 5)
        np.testing.assert_array_equal(np.asarray(q.scale), np.float32(1.0))
        np.testing.assert_array_equal(np.asarray(q.amax_history), np.zeros(5, np.float32))
        assert q.scale.dtype == jnp.float32 and q.amax_history.dtype == jnp.float32
    # with_layout keeps the state (the same arrays)
    assert qs.with_layout("grad", QuantizeLayout.ROWWISE_COLWISE).scale is qs.grad.scale


def test_create_none_is_the_empty_set():
    qs = QuantizerSet.create(None)
    assert qs.is_empty and qs.scaling_mode is None
    assert (qs.x, qs.kernel, qs.grad) == (None, None, None)
    assert QuantizerSet().is_empty
    assert jax.tree.leaves(qs) == []


@pytest.mark.parametrize(
    "recipe",
    ["delayed", DelayedScaling, CurrentScaleQuantizer(), 1],
    ids=["str", "class", "quantizer", "int"],
)
def test_create_rejects_what_is_not_a_recipe(recipe):
    with pytest.raises(TypeError, match="QuantizerSet.create: recipe must be"):
        QuantizerSet.create(recipe)


def test_partial_set_is_an_error():
    q = CurrentScaleQuantizer()
    with pytest.raises(
        ValueError,
        match=r"give all three quantizers \(x, kernel, grad\) or none; "
        "got x=CurrentScaleQuantizer, kernel=NoneType",
    ):
        QuantizerSet(x=q)
    with pytest.raises(ValueError, match="give all three quantizers"):
        QuantizerSet(x=q, kernel=q)
    with pytest.raises(TypeError, match="kernel must be a te_jax.quantize quantizer, got str"):
        QuantizerSet(x=q, kernel="e4m3", grad=q)


# ---- the pytree -----------------------------------------------------------------------------


def _sets():
    return {
        "delayed": QuantizerSet.create(DelayedScaling(amax_history_len=4)),
        "current": QuantizerSet.create(CurrentScaling()),
        "mxfp8": QuantizerSet.create(MXFP8BlockScaling()),
        "empty": QuantizerSet.create(None),
    }


def _assert_same_set(a, b, what=""):
    assert isinstance(a, QuantizerSet) and isinstance(b, QuantizerSet), what
    assert jax.tree.structure(a) == jax.tree.structure(b), what
    for la, lb in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(la), np.asarray(lb), err_msg=what)


@pytest.mark.parametrize("name", list(_sets()))
def test_flatten_unflatten(name):
    qs = _sets()[name]
    leaves, treedef = jax.tree.flatten(qs)
    # Delayed scaling's scale and amax_history per quantizer are the leaves; the others have none.
    assert len(leaves) == (6 if name == "delayed" else 0)
    back = jax.tree.unflatten(treedef, leaves)
    _assert_same_set(back, qs, name)
    for role in ROLES:
        a, b = getattr(back, role), getattr(qs, role)
        assert type(a) is type(b)
        if a is not None:
            assert a.q_dtype == b.q_dtype and a.q_layout == b.q_layout
    if name == "delayed":
        paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(qs)[0]]
        assert paths == [f".{r}.{f}" for r in ROLES for f in ("scale", "amax_history")]


@pytest.mark.parametrize("name", list(_sets()))
def test_jit_identity(name):
    qs = _sets()[name]
    _assert_same_set(jax.jit(lambda q: q)(qs), qs, name)


def _updated(qs, a):
    """Every quantizer of a delayed set updated with amax ``a`` (x), 2a (kernel), 3a (grad)."""
    return QuantizerSet(
        x=qs.x.update(a), kernel=qs.kernel.update(2 * a), grad=qs.grad.update(3 * a)
    )


def test_scan_carry():
    """A delayed set as a lax.scan carry, updated each step, equals the same Python loop."""
    qs = _sets()["delayed"]
    amaxes = jnp.asarray([1.0, 4.0, 0.5, 2.0, 3.0], jnp.float32)  # more steps than the history
    got, scales = jax.jit(
        lambda qs, a: jax.lax.scan(lambda q, a: (_updated(q, a), q.x.scale), qs, a)
    )(qs, amaxes)
    want, update = qs, jax.jit(_updated)
    for i, a in enumerate(amaxes):
        assert float(scales[i]) == float(want.x.scale)
        want = update(want, a)
    _assert_same_set(got, want, "scan carry")
    assert float(got.x.scale) == pytest.approx(448.0 / 4.0)  # the max over the last 4 steps


def test_vmap_over_a_stacked_set():
    """Sets stacked leaf by leaf (one per layer) go through vmap: each member updated on its
    own, as unstacked."""
    members = [_updated(_sets()["delayed"], jnp.float32(a)) for a in (1.0, 8.0, 0.25)]
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *members)
    assert stacked.x.scale.shape == (3,) and stacked.grad.amax_history.shape == (3, 4)
    amaxes = jnp.asarray([2.0, 0.5, 1.0], jnp.float32)
    got = jax.jit(jax.vmap(_updated))(stacked, amaxes)
    for i, (m, a) in enumerate(zip(members, amaxes, strict=True)):
        _assert_same_set(jax.tree.map(lambda s, i=i: s[i], got), _updated(m, a), f"member {i}")


@pytest.mark.parametrize("name", ["current", "mxfp8", "empty"])
def test_stateless_sets_through_transformations(name):
    """Sets without leaves pass through jit, scan and vmap as static structure."""
    qs = _sets()[name]
    carry, _ = jax.lax.scan(lambda q, a: (q, a), qs, jnp.zeros(2))
    assert jax.tree.structure(carry) == jax.tree.structure(qs)
    out = jax.vmap(lambda q, a: (q, a), in_axes=(None, 0))(qs, jnp.zeros(2))[0]
    assert jax.tree.structure(out) == jax.tree.structure(qs)


@pytest.mark.parametrize("recipe_cls", [DelayedScaling, CurrentScaling], ids=lambda c: c.__name__)
def test_gemm_accumulation(recipe_cls):
    """TransformerEngine's MMParams: every FP8 GEMM keeps the float32 promotion by default; the
    set carries the recipe's choice (static: through flatten / unflatten and with_state)."""
    r = recipe_cls()
    assert r.split_accumulator == (True, True, True)
    assert QuantizerSet.create(r).split_accumulator == (True, True, True)
    mm = te_jax.recipe.MMParams
    r = recipe_cls(fp8_gemm_fprop=mm(False), fp8_gemm_wgrad=mm(False))
    qs = QuantizerSet.create(r)
    assert qs.split_accumulator == (False, True, False)
    leaves, tree = jax.tree_util.tree_flatten(qs)
    assert jax.tree_util.tree_unflatten(tree, leaves).split_accumulator == (False, True, False)
    assert qs.with_state(qs.state()).split_accumulator == (False, True, False)
    assert MXFP8BlockScaling().split_accumulator == (True, True, True)
    with pytest.raises(TypeError, match="fp8_gemm_dgrad must be te_jax.recipe.MMParams"):
        recipe_cls(fp8_gemm_dgrad=True)
    with pytest.raises(TypeError, match="split_accumulator must be three bools"):
        QuantizerSet(split_accumulator=(True, False))


def test_float8_block_scaling():
    """TransformerEngine's Float8BlockScaling: its field names and defaults (E4M3, power-of-two
    scales, no epsilon, x / w / grad in 1 / 2 / 1 dimensional blocks, split accumulation), the
    quantizer each role gets, and no state (an empty cotangent)."""
    r = Float8BlockScaling()
    assert (r.fp8_format, r.x_block_scaling_dim, r.w_block_scaling_dim) == ("E4M3", 1, 2)
    assert r.grad_block_scaling_dim == 1 and r.split_accumulator == (True, True, True)
    for p in (r.fp8_quant_fwd_inp, r.fp8_quant_fwd_weight, r.fp8_quant_bwd_grad):
        assert p == QParams(power_2_scale=True, amax_epsilon=0.0)
    qs = QuantizerSet.create(r)
    assert [type(getattr(qs, role)) for role in ROLES] == [
        Float8Block1DQuantizer,
        Float8Block2DQuantizer,
        Float8Block1DQuantizer,
    ]
    assert qs.scaling_mode == ScalingMode.FP8_BLOCK_1D_SCALING and not qs.has_state
    r = Float8BlockScaling(
        fp8_format="HYBRID",
        fp8_quant_bwd_grad=QParams(amax_epsilon=1e-6),
        x_block_scaling_dim=2,
        w_block_scaling_dim=1,
    )
    g, x = r.make_quantizer("grad"), r.make_quantizer("x")
    assert (g.q_dtype, g.power_2_scale, g.amax_epsilon) == (E5M2, False, 1e-6)
    assert type(x) is Float8Block2DQuantizer and x.q_dtype == E4M3
    assert jax.tree.leaves(jax.jit(lambda q: q)(QuantizerSet.create(r))) == []


@pytest.mark.parametrize(
    ("kw", "error", "match"),
    [
        ({"w_block_scaling_dim": 3}, ValueError, "w_block_scaling_dim must be 1 or 2, got 3"),
        ({"grad_block_scaling_dim": 2}, ValueError, "the dgrad GEMM would multiply two"),
        ({"x_block_scaling_dim": 2}, ValueError, "the fprop GEMM would multiply two"),
        (
            {"fp8_gemm_wgrad": te_jax.recipe.MMParams(False)},
            ValueError,
            r"fp8_gemm_wgrad=MMParams\(use_split_accumulator=False\): block scaling needs",
        ),
        ({"fp8_quant_fwd_inp": 1.0}, TypeError, "fp8_quant_fwd_inp must be te_jax.recipe.QParams"),
        ({"fp8_format": "E5M2"}, ValueError, "fp8_format must be one of"),
    ],
)
def test_float8_block_scaling_errors(kw, error, match):
    with pytest.raises(error, match=match):
        Float8BlockScaling(**kw)
    with pytest.raises(ValueError, match="QParams: amax_epsilon must be a finite float >= 0"):
        QParams(amax_epsilon=-1.0)
