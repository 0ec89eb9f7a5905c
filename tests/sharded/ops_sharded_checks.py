"""A te_jax.ops.Sequential MLP block (LayerNorm, column-parallel Linear + Bias + GELU, row-parallel
Linear + Bias, residual) on a CPU mesh of 8 devices (run by tests/test_sharding.py in its own
process): one training step under DP×TP and FSDP×TP equals the unsharded step, and the compiled
step holds the same collectives as te_jax.nnx.LayerNormMLP's under the same mesh and rules."""

from __future__ import annotations

import functools
import os
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import te_jax  # noqa: E402
from helpers import hlo_collectives, sharded_devices  # noqa: E402
from te_jax import nnx as tnnx  # noqa: E402
from te_jax import ops  # noqa: E402
from te_jax.sharding import EMBED, MLP, MeshResource  # noqa: E402

DEVICES = sharded_devices(8)
BATCH, SEQ, H, INTER = 8, 5, 48, 96
STRATEGIES = {
    "dp_tp": ({"data": 2, "tensor": 4}, MeshResource(dp_resource="data", tp_resource="tensor")),
    "fsdp_tp": (
        {"data": 2, "tensor": 4},
        MeshResource(fsdp_resource="data", tp_resource="tensor"),
    ),
}
RECIPES = {"bf16": None, "delayed": te_jax.recipe.DelayedScaling()}


def _sequential(recipe):
    return ops.Sequential(
        ops.LayerNorm(H),
        ops.Linear(H, INTER, parallel_mode="column"),
        ops.Bias(INTER, bias_axes=(MLP,)),
        ops.Activation("gelu"),
        ops.Linear(INTER, H, parallel_mode="row"),
        ops.Bias(H, bias_axes=(EMBED,)),
        ops.AddResidual(),
        recipe=recipe,
        rngs=nnx.Rngs(0),
    )


class _Module(nnx.Module):
    """The same block as te_jax's module (its collectives are the reference)."""

    def __init__(self, recipe):
        self.mlp = tnnx.LayerNormMLP(
            H, INTER, activations="gelu", use_bias=True, recipe=recipe, rngs=nnx.Rngs(0)
        )

    def __call__(self, x):
        return x + self.mlp(x)[0]


MODELS = {"ops": _sequential, "module": _Module}


def _inputs():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((BATCH, SEQ, H)), jnp.bfloat16)
    dy = jnp.asarray(rng.standard_normal((BATCH, SEQ, H)), jnp.float32)
    return x, dy


def _parts(model_name, recipe):
    graphdef, state = nnx.split(MODELS[model_name](RECIPES[recipe]))

    def step(state, x, dy):
        def loss(s, x):
            out = nnx.merge(graphdef, s)(x)
            return jnp.sum(out.astype(jnp.float32) * dy), out

        (_, out), grads = jax.value_and_grad(loss, has_aux=True)(state, x)
        return out, grads

    return state, step


@functools.cache
def _unsharded(model_name, recipe):
    state, step = _parts(model_name, recipe)
    return jax.jit(step)(state, *_inputs())


def _sharded(model_name, recipe, strategy):
    """(sharded (out, grads), the compiled step's collectives)."""
    x, dy = _inputs()
    state, step = _parts(model_name, recipe)
    axes, resource = STRATEGIES[strategy]
    mesh = Mesh(DEVICES.reshape(tuple(axes.values())), tuple(axes))
    rules = resource.logical_axis_rules()
    with nnx.logical_axis_rules(rules):
        specs = nnx.get_partition_spec(state)
    shard = lambda spec: NamedSharding(mesh, spec)  # noqa: E731
    state_sh = jax.tree.map(shard, specs, is_leaf=lambda s: isinstance(s, P))
    act_sh = shard(P(resource.batch_axes[0], None, None))
    jitted = jax.jit(
        lambda *a: step(*a), in_shardings=(state_sh, act_sh, act_sh),
        out_shardings=(act_sh, state_sh),
    )
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        compiled = jitted.lower(state, x, dy).compile()
    placed = jax.device_put(state, state_sh), jax.device_put(x, act_sh), jax.device_put(dy, act_sh)
    return compiled(*placed), hlo_collectives(compiled.as_text())


def _assert_close(got, want, recipe):
    """Each output and gradient within the norm-wise tolerance of the recipe: bf16, a rounding
    of float32 sums taken in another order; FP8, a split sum may move a value across an FP8
    rounding boundary (one code step, 2^-3 of it, in a few elements)."""
    rtol = 2**-7 if recipe == "bf16" else 2**-4
    for (path, g), (_, w) in zip(
        jax.tree_util.tree_leaves_with_path(got),
        jax.tree_util.tree_leaves_with_path(want),
        strict=True,
    ):
        g64, w64 = np.asarray(g, np.float64), np.asarray(w, np.float64)
        err = np.linalg.norm(g64 - w64) / max(np.linalg.norm(w64), 1e-30)
        assert err <= rtol, (jax.tree_util.keystr(path), err)


@pytest.mark.parametrize("strategy", list(STRATEGIES))
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_step_equals_unsharded_with_the_modules_collectives(recipe, strategy):
    got, colls = _sharded("ops", recipe, strategy)
    _assert_close(got, _unsharded("ops", recipe), recipe)
    _, module_colls = _sharded("module", recipe, strategy)
    data = sorted(c for c in colls if c[1] not in ((), (1,)))
    module_data = sorted(c for c in module_colls if c[1] not in ((), (1,)))
    assert data == module_data, (data, module_data)
    assert data, "a DP x TP step with no collective"


def _swiglu_and_linear_bias_add(recipe):
    """A SwiGLU MLP (its column-parallel Linear viewed (H, 2, I/2), both halves on each shard)
    and a column-parallel [Linear, Bias, AddResidual] (ForwardLinearBiasAdd: the residual is the
    GEMM's addend, split as its output is)."""
    return ops.Sequential(
        ops.LayerNorm(H),
        ops.Linear(H, 2 * INTER, parallel_mode="column"),
        ops.Bias(2 * INTER),
        ops.Activation("swiglu"),
        ops.Linear(INTER, H, parallel_mode="row"),
        ops.Bias(H, bias_axes=(EMBED,)),
        ops.AddResidual(),
        ops.Linear(H, H, parallel_mode="column"),
        ops.Bias(H, bias_axes=(MLP,)),
        ops.AddResidual(),
        recipe=recipe,
        rngs=nnx.Rngs(0),
    )


MODELS["swiglu_add"] = _swiglu_and_linear_bias_add


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_swiglu_and_linear_bias_add_under_dp_tp(recipe):
    """The gated layout and ForwardLinearBiasAdd under DP×TP: the unsharded step's output and
    gradients."""
    plan = [repr(op) for op in _swiglu_and_linear_bias_add(None).fused_plan()]
    assert plan[1].startswith("MLP(") and plan[-1].startswith("ForwardLinearBiasAdd("), plan
    got, _ = _sharded("swiglu_add", recipe, "dp_tp")
    _assert_close(got, _unsharded("swiglu_add", recipe), recipe)
