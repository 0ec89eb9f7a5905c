"""Sharded te_jax ops on a CPU mesh of 8 devices. Run by tests/test_sharding.py in its own
process (XLA_FLAGS=--xla_force_host_platform_device_count=8 must be set before jax starts):

    XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu \
        python -m pytest tests/sharded/sharded_checks.py

Sharded inputs are never all-gathered: the compiled module has no all-gather, the elementwise
ops no collective at all, and the results equal the unsharded ones; quantize_dact_dbias reduces
its partial dbias sums across the sharded axes.
"""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import float64_oracle as oracle  # noqa: E402
import te_jax  # noqa: E402
import te_jax.flax  # noqa: E402
from helpers import (  # noqa: E402
    ACT_BY_ALIAS,
    assert_dbias_matches,
    assert_matches,
    dbias_bound,
    dz_shape,
    make_dz,
    make_x,
    sharded_devices,
    te_jax_custom_calls,
    tol,
)

DEVICES = sharded_devices(8)
MESH_1D = Mesh(DEVICES, ("x",))
MESH_2D = Mesh(DEVICES.reshape(4, 2), ("a", "b"))
COLLECTIVES = ("all-gather", "all-reduce", "all-to-all", "collective-permute", "reduce-scatter")

GELU, SWIGLU, CLAMPED = (ACT_BY_ALIAS[n] for n in ("gelu", "swiglu", "clamped_swiglu"))
CUSTOM = te_jax.ActivationParams(
    clamped_swiglu=te_jax.ClampedSwiGLUParams(limit=0.75, alpha=1.5, glu_linear_offset=0.5)
)


def _params(act):
    return CUSTOM if act is CLAMPED else None


def _compile(fn, mesh, in_specs, out_specs, *args):
    shard = lambda spec: NamedSharding(mesh, spec)  # noqa: E731
    jitted = jax.jit(
        fn,
        in_shardings=tuple(shard(s) for s in in_specs),
        out_shardings=jax.tree.map(shard, out_specs, is_leaf=lambda s: isinstance(s, P)),
    )
    compiled = jitted.lower(*args).compile()
    placed = [jax.device_put(a, shard(s)) for a, s in zip(args, in_specs, strict=True)]
    return compiled, compiled.as_text(), compiled(*placed)


def _assert_no_collectives(text, allowed=()):
    assert "all-gather" not in text, "a sharded input was all-gathered"
    for c in COLLECTIVES:
        if c not in allowed:
            assert c not in text, f"unexpected {c} in the compiled module"
    assert te_jax_custom_calls(text), "the te_jax kernel is not in the compiled module"


# (activation, dtype, global x shape, x spec): leading-axis and H shardings, 1-D mesh.
ACT_CASES = [
    (GELU, jnp.float32, (16, 5, 24), P("x", None, None)),
    (GELU, jnp.bfloat16, (16, 40), P("x", None)),
    (GELU, jnp.float32, (6, 64), P(None, "x")),  # over H
    (SWIGLU, jnp.float32, (16, 2, 24), P("x", None, None)),
    (SWIGLU, jnp.bfloat16, (4, 2, 64), P(None, None, "x")),  # gated over H, never the act axis
    (CLAMPED, jnp.float32, (8, 3, 2, 16), P("x", None, None, None)),
    (CLAMPED, jnp.float16, (3, 2, 2, 128), P(None, None, None, "x")),
]


def _out_spec(act, spec):
    return P(*spec[:-2], spec[-1]) if act.gated else spec


def _ids(cases):
    return [f"{c[0]}-{jnp.dtype(c[1]).name}-{'x'.join(map(str, c[2]))}-{c[3]}" for c in cases]


@pytest.mark.parametrize("act, dtype, shape, spec", ACT_CASES, ids=_ids(ACT_CASES))
def test_act_lu_sharded(act, dtype, shape, spec, rng):
    params = _params(act)
    x = make_x(rng, shape, dtype, act, params)
    f = lambda x: te_jax.act_lu(
        x,
        activation_type=act.names,
        act_params=params,  # noqa: E731
        implementation="ffi",
    )
    _, text, y = _compile(f, MESH_1D, (spec,), _out_spec(act, spec), jnp.asarray(x))
    _assert_no_collectives(text)
    assert y.sharding.spec == _out_spec(act, spec) or y.sharding.is_equivalent_to(
        NamedSharding(MESH_1D, _out_spec(act, spec)), y.ndim
    )
    unsharded = jax.jit(f)(jnp.asarray(x))
    t = tol(dtype, act)
    np.testing.assert_allclose(
        np.asarray(y, np.float64), np.asarray(unsharded, np.float64), rtol=t, atol=t
    )
    assert_matches(y, oracle.act_lu(x, act.enum, params), dtype, act)


@pytest.mark.parametrize("act, dtype, shape, spec", ACT_CASES, ids=_ids(ACT_CASES))
def test_dact_lu_sharded(act, dtype, shape, spec, rng):
    params = _params(act)
    x = make_x(rng, shape, dtype, act, params)
    dz = make_dz(rng, dz_shape(shape, act), dtype)
    f = lambda dz, x: te_jax.dact_lu(
        dz,
        x,
        activation_type=act.names,  # noqa: E731
        act_params=params,
        implementation="ffi",
    )
    args = (jnp.asarray(dz), jnp.asarray(x))
    _, text, dx = _compile(f, MESH_1D, (_out_spec(act, spec), spec), spec, *args)
    _assert_no_collectives(text)
    unsharded = jax.jit(f)(*args)
    t = tol(dtype, act)
    np.testing.assert_allclose(
        np.asarray(dx, np.float64), np.asarray(unsharded, np.float64), rtol=t, atol=t
    )
    assert_matches(dx, oracle.dact_lu(dz, x, act.enum, params), dtype, act)


def _check_dact_dbias(mesh, act, dtype, shape, spec, dbias_spec, rng, allowed):
    params = _params(act)
    x = make_x(rng, shape, dtype, act, params)
    dz = make_dz(rng, dz_shape(shape, act), dtype)
    f = lambda dz, x: te_jax.quantize_dact_dbias(  # noqa: E731
        dz, x, activation_type=act.names, act_params=params, implementation="ffi"
    )
    args = (jnp.asarray(dz), jnp.asarray(x))
    _, text, (dx, dbias) = _compile(
        f, mesh, (_out_spec(act, spec), spec), (spec, dbias_spec), *args
    )
    _assert_no_collectives(text, allowed=allowed)
    dx_u, dbias_u = jax.jit(f)(*args)
    t = tol(dtype, act)
    np.testing.assert_allclose(
        np.asarray(dx, np.float64), np.asarray(dx_u, np.float64), rtol=t, atol=t
    )
    dx64 = oracle.dact_lu(dz, x, act.enum, params)
    assert_matches(dx, dx64, dtype, act)
    # The global dbias: partial sums reduced across the sharded axes, equal to the unsharded one
    # up to summation order.
    assert_dbias_matches(dbias, dx64, act.gated, dtype, act, what="sharded dbias")
    bound = dbias_bound(dx64, act.gated, dtype, act, scale=2.0)
    assert (np.abs(np.asarray(dbias, np.float64) - np.asarray(dbias_u, np.float64)) <= bound).all()


DBIAS_CASES = [  # leading-axis shardings: dbias all-reduced
    (GELU, jnp.float32, (16, 5, 24), P("x", None, None)),
    (GELU, jnp.bfloat16, (32, 40), P("x", None)),
    (SWIGLU, jnp.float32, (16, 2, 24), P("x", None, None)),
    (CLAMPED, jnp.float16, (8, 3, 2, 16), P("x", None, None, None)),
]


@pytest.mark.parametrize("act, dtype, shape, spec", DBIAS_CASES, ids=_ids(DBIAS_CASES))
def test_quantize_dact_dbias_sharded_leading(act, dtype, shape, spec, rng):
    feature = P(None, None) if act.gated else P(None)
    _check_dact_dbias(
        MESH_1D,
        act,
        dtype,
        shape,
        spec,
        feature,
        rng,
        allowed=("all-reduce", "reduce-scatter", "collective-permute"),
    )


H_CASES = [  # over H: dbias sharded like H, no collective needed
    (GELU, jnp.float32, (6, 64), P(None, "x")),
    (SWIGLU, jnp.bfloat16, (4, 2, 64), P(None, None, "x")),
]


@pytest.mark.parametrize("act, dtype, shape, spec", H_CASES, ids=_ids(H_CASES))
def test_quantize_dact_dbias_sharded_over_h(act, dtype, shape, spec, rng):
    feature = P(None, "x") if act.gated else P("x")
    _check_dact_dbias(MESH_1D, act, dtype, shape, spec, feature, rng, allowed=())


MESH2_CASES = [  # 4x2 mesh: two leading axes, or a leading axis and H
    (GELU, jnp.float32, (8, 6, 24), P("a", "b", None)),
    (SWIGLU, jnp.bfloat16, (8, 6, 2, 24), P("a", "b", None, None)),
    (SWIGLU, jnp.float32, (8, 2, 16), P("a", None, "b")),
]


@pytest.mark.parametrize("act, dtype, shape, spec", MESH2_CASES, ids=_ids(MESH2_CASES))
def test_2d_mesh(act, dtype, shape, spec, rng):
    params = _params(act)
    x = make_x(rng, shape, dtype, act, params)
    f = lambda x: te_jax.act_lu(
        x,
        activation_type=act.names,
        act_params=params,  # noqa: E731
        implementation="ffi",
    )
    _, text, y = _compile(f, MESH_2D, (spec,), _out_spec(act, spec), jnp.asarray(x))
    _assert_no_collectives(text)
    assert_matches(y, oracle.act_lu(x, act.enum, params), dtype, act)

    dz = make_dz(rng, dz_shape(shape, act), dtype)
    g = lambda dz, x: te_jax.dact_lu(
        dz,
        x,
        activation_type=act.names,  # noqa: E731
        act_params=params,
        implementation="ffi",
    )
    _, text, dx = _compile(
        g, MESH_2D, (_out_spec(act, spec), spec), spec, jnp.asarray(dz), jnp.asarray(x)
    )
    _assert_no_collectives(text)
    assert_matches(dx, oracle.dact_lu(dz, x, act.enum, params), dtype, act)

    h_axis = spec[-1]
    feature = P(None, h_axis) if act.gated else P(h_axis)
    _check_dact_dbias(
        MESH_2D,
        act,
        dtype,
        shape,
        spec,
        feature,
        rng,
        allowed=("all-reduce", "reduce-scatter", "collective-permute"),
    )


@pytest.mark.parametrize("act", [GELU, SWIGLU], ids=str)
def test_grad_sharded(act, rng):
    """jit(grad) of a loss through te_jax.activation on a sharded input: no all-gather."""
    shape = (16, 2, 24) if act.gated else (16, 24)
    spec = P("x", *([None] * (len(shape) - 1)))
    x = make_x(rng, shape, jnp.float32, act, kink_margin=0.02)
    w = make_dz(rng, dz_shape(shape, act), jnp.float32)
    loss = lambda x, w: jnp.sum(  # noqa: E731
        te_jax.activation(x, activation_type=act.names, implementation="ffi") * w
    )
    _, text, g = _compile(
        jax.grad(loss), MESH_1D, (spec, _out_spec(act, spec)), spec, jnp.asarray(x), jnp.asarray(w)
    )
    assert "all-gather" not in text
    assert te_jax_custom_calls(text)
    assert_matches(g, oracle.dact_lu(w, x, act.enum), jnp.float32, act)


@pytest.mark.parametrize("act", [GELU, SWIGLU], ids=str)
def test_grad_inside_shard_map(act, rng):
    """grad of te_jax.activation taken outside shard_map, the op inside it (check_vma=True):
    each shard's gradient is its own dact, never summed with the other shards' (the tangent
    primitive's result keeps its operands' varying axes, so no psum meets the cotangent)."""
    shape = (16, 2, 24) if act.gated else (16, 24)
    spec = P("x", *([None] * (len(shape) - 1)))
    x = make_x(rng, shape, jnp.float32, act, kink_margin=0.02)
    w = make_dz(rng, dz_shape(shape, act), jnp.float32)
    inner = jax.shard_map(
        lambda x: te_jax.activation(x, activation_type=act.names),
        mesh=MESH_1D,
        in_specs=spec,
        out_specs=_out_spec(act, spec),
    )
    g = jax.jit(jax.grad(lambda x: jnp.sum(inner(x) * w)))(jnp.asarray(x))
    assert_matches(g, oracle.dact_lu(w, x, act.enum), jnp.float32, act)


def test_gate_axis_sharded_is_gathered_and_correct(rng):
    """The documented exception (README, sharding): a gated x whose act axis (the 2 of
    (..., 2, H)) is split over a mesh axis is all-gathered on that axis before the kernel, and the
    result is still right."""
    mesh = Mesh(DEVICES[:2], ("g",))
    x = make_x(rng, (8, 2, 32), jnp.float32, SWIGLU, None)
    f = lambda x: te_jax.act_lu(x, "swiglu", implementation="ffi")  # noqa: E731
    _, text, y = _compile(f, mesh, (P(None, "g", None),), P(None, None), jnp.asarray(x))
    assert "all-gather" in text, "the split act axis is gathered before the kernel"
    assert te_jax_custom_calls(text)
    assert_matches(y, oracle.act_lu(x, SWIGLU.enum, None), jnp.float32, SWIGLU)


# ---- mesh contexts: jax.set_mesh, the older `with mesh:`, explicit axes ------------------------

_RULES = te_jax.sharding.MeshResource(fsdp_resource="a", tp_resource="b").logical_axis_rules()
_WANT = {
    "scale": P("a"),
    "ln_bias": P("a"),
    "wi_kernel": P("a", "b"),
    "wo_kernel": P("b", "a"),
}


def _mlp_grads(context):
    """A delayed-scaling LayerNormMLP's parameter gradients and their compiled shardings, under
    ``context`` and te_jax's FSDP + TP rules."""
    import warnings

    import flax.linen as nn

    mlp = te_jax.flax.LayerNormMLP(64, activations="gelu", recipe=te_jax.recipe.DelayedScaling())
    x = jnp.asarray(np.random.default_rng(0).standard_normal((8, 32)), jnp.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # `with mesh:` is deprecated
        with context, nn.logical_axis_rules(_RULES):
            v = jax.jit(mlp.init)(jax.random.key(0), x)
            loss = lambda v, x: jnp.sum(mlp.apply(v, x)[0].astype(jnp.float32) ** 2)  # noqa: E731
            g = jax.jit(jax.grad(loss)).lower(v, x).compile()(v, x)["params"]
    return {k: nn.unbox(a) for k, a in g.items()}


def test_mesh_contexts_give_the_same_compiled_shardings():
    """Under ``jax.set_mesh`` and under ``with mesh:`` the compiled step shards every parameter
    gradient as the logical rules say (FSDP over "a", TP over "b": te_jax's constraints are
    applied under both) and computes the same values."""
    from jax.sharding import AxisType

    auto = Mesh(DEVICES[:4].reshape(2, 2), ("a", "b"), axis_types=(AxisType.Auto,) * 2)
    legacy = Mesh(DEVICES[:4].reshape(2, 2), ("a", "b"))
    got = {"set_mesh": _mlp_grads(jax.set_mesh(auto)), "with mesh": _mlp_grads(legacy)}
    for name, grads in got.items():
        assert {k: a.sharding.spec for k, a in grads.items()} == _WANT, name
    for k in _WANT:
        np.testing.assert_array_equal(
            np.asarray(got["set_mesh"][k]), np.asarray(got["with mesh"][k])
        )


def test_eager_init_under_set_mesh():
    """Eager ``init`` under ``jax.set_mesh`` creates each parameter sharded as its logical axes
    say; under a mesh with Explicit axes (jax.make_mesh's default) the parameters are placed too,
    and the forward that init runs raises te_jax's error naming the fix (Auto axes)."""
    import flax.linen as nn
    from jax.sharding import AxisType

    mlp = te_jax.flax.LayerNormMLP(64, activations="gelu")
    x = jnp.ones((8, 32), jnp.float32)
    auto = Mesh(DEVICES[:4].reshape(2, 2), ("a", "b"), axis_types=(AxisType.Auto,) * 2)
    with jax.set_mesh(auto), nn.logical_axis_rules(_RULES):
        v = mlp.init(jax.random.key(0), x)
    assert {k: nn.unbox(a).sharding.spec for k, a in v["params"].items()} == _WANT
    explicit = Mesh(DEVICES[:4].reshape(2, 2), ("a", "b"), axis_types=(AxisType.Explicit,) * 2)
    with jax.set_mesh(explicit), nn.logical_axis_rules(_RULES):
        with pytest.raises(ValueError, match="Explicit axes.*AxisType.Auto"):
            mlp.init(jax.random.key(0), x)


@pytest.mark.parametrize("act", ["gelu", "swiglu"])
def test_quantized_kernels_under_fsdp_and_tp(act):
    """te_jax.flax.quantize_kernels' codes in a delayed-scaling LayerNormMLP step sharded FSDP x
    TP (the kernels' (K, F) codes viewed as each GEMM takes them, a gated kernel split over its
    N): gradients and next FP8 state bit for bit the uncached sharded step's."""
    import flax.linen as nn
    from jax.sharding import AxisType

    mesh = Mesh(DEVICES.reshape(2, 4), ("a", "b"), axis_types=(AxisType.Auto,) * 2)
    recipe = te_jax.recipe.DelayedScaling(amax_history_len=4)
    mlp = te_jax.flax.LayerNormMLP(64, activations=act, recipe=recipe)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((4, 8, 32)), jnp.bfloat16)
    v = jax.jit(mlp.init)(jax.random.key(0), x)

    def loss(params, fp8, cache, xb):
        out = mlp.apply({"params": params, "fp8_metas": fp8, **cache}, xb)[0]
        return jnp.sum(out.astype(jnp.float32) ** 3)

    def step(v, x, cached):
        cache = te_jax.flax.quantize_kernels(mlp, v) if cached else {}
        return jax.grad(loss, (0, 1))(v["params"], v["fp8_metas"], cache, x)

    with jax.set_mesh(mesh), nn.logical_axis_rules(_RULES):
        run = jax.jit(step, static_argnums=2)
        cached, plain = run(v, x, True), run(v, x, False)
    for a, b in zip(jax.tree.leaves(cached), jax.tree.leaves(plain), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
