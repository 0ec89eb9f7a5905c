"""te_jax.ops.LinenSequential: the NNX Sequential's numbers and FP8 state in Linen's variables,
its parameters' logical axes, dropout's rng and clear errors."""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import te_jax
from te_jax import ops
from te_jax.flax import update_fp8_metas
from te_jax.nnx import FP8Meta, update_fp8_state

D, F = 16, 32
P = functools.partial
MLP_OPS = (
    P(ops.LayerNorm, D),
    P(ops.Linear, D, 2 * F),
    P(ops.Bias, 2 * F, bias_init=nnx.initializers.normal(0.5)),
    P(ops.Activation, "swiglu"),
    P(ops.Linear, F, D),
    P(ops.Bias, D, bias_init=nnx.initializers.normal(0.5)),
)


def _x(seed=1):
    return jax.random.normal(jax.random.PRNGKey(seed), (4, 8, D), jnp.bfloat16)


def _weighted_square(y):
    """Quadratic in the output: its gradient reaches every rounding and scale."""
    w = jax.random.normal(jax.random.PRNGKey(9), y.shape)
    return jnp.sum(w * jnp.square(y.astype(jnp.float32))) / y.size * 64.0


def _twin(variables, recipe):
    """The NNX Sequential of the same ops holding ``variables``' parameters and FP8 state."""
    seq = ops.Sequential(*(make() for make in MLP_OPS), recipe=recipe, rngs=nnx.Rngs(0))
    linen = nn.unbox(variables)
    for i, op in enumerate(seq.ops):
        for name, value in linen["params"]["seq"]["ops"].get(i, {}).items():
            getattr(op, name)[...] = value
        for name, value in (
            linen.get("fp8_metas", {})
            .get("seq", {})
            .get("ops", {})
            .get(i, {})
            .get("quantizers", {})
            .items()
        ):
            getattr(op.quantizers, name)[...] = value
    return seq


@pytest.mark.parametrize("recipe", [None, te_jax.recipe.DelayedScaling()], ids=["bf16", "delayed"])
def test_equals_the_nnx_sequential_over_steps(recipe):
    """Output, parameter gradients and (delayed scaling) the FP8 state after three steps, bit
    for bit the NNX Sequential's: the wrapper adds no arithmetic and carries the state in
    ``"fp8_metas"`` where ``update_fp8_metas`` finds it."""
    module = ops.LinenSequential(MLP_OPS, recipe=recipe)
    x = _x()
    variables = module.init(jax.random.PRNGKey(0), x)
    assert set(variables) == ({"params"} if recipe is None else {"params", "fp8_metas"})
    seq = _twin(variables, recipe)

    linen_step = jax.jit(jax.value_and_grad(lambda v, x: _weighted_square(module.apply(v, x))))
    diff = nnx.DiffState(0, (nnx.Param, FP8Meta))
    nnx_step = nnx.jit(nnx.value_and_grad(lambda m, x: _weighted_square(m(x)), argnums=diff))
    for i in range(3):
        (l_linen, g_linen), (l_nnx, g_nnx) = linen_step(variables, x), nnx_step(seq, x)
        assert l_linen == l_nnx, i
        if i == 0:
            for j, grads in nn.unbox(g_linen["params"]["seq"]["ops"]).items():
                for name, mine in grads.items():
                    theirs = g_nnx["ops"][j][name][...]
                    np.testing.assert_array_equal(np.asarray(mine), np.asarray(theirs))
        variables = update_fp8_metas(variables, g_linen)
        update_fp8_state(seq, g_nnx)
    np.testing.assert_array_equal(
        np.asarray(module.apply(variables, x)), np.asarray(nnx.jit(lambda m, x: m(x))(seq, x))
    )
    if recipe is not None:
        for j in (1, 4):
            state = variables["fp8_metas"]["seq"]["ops"][j]["quantizers"]
            assert float(state["x_scale"]) != 1.0  # the state moved
            for name, v in nnx.state(seq.ops[j].quantizers, FP8Meta).items():
                np.testing.assert_array_equal(np.asarray(state[name]), np.asarray(v[...]))


def test_parameters_carry_the_ops_logical_axes():
    """Each parameter with axis names is boxed as te_jax.flax boxes its own, so Flax's logical
    sharding reads them."""
    module = ops.LinenSequential(
        (P(ops.RMSNorm, D), P(ops.Linear, D, F, parallel_mode="column"), P(ops.Bias, F))
    )
    params = module.init(jax.random.PRNGKey(0), _x())["params"]["seq"]["ops"]
    seq = ops.Sequential(
        ops.RMSNorm(D), ops.Linear(D, F, parallel_mode="column"), ops.Bias(F), rngs=nnx.Rngs(0)
    )
    boxed = 0
    for i, op in enumerate(seq.ops):
        for name, v in nnx.state(op, nnx.Param).items():
            got, axes = params[i][name], v.get_metadata().get("out_sharding")
            if axes is None:  # Bias by default: no names, a bare array
                assert isinstance(got, jax.Array), (i, name)
                continue
            assert isinstance(got, nn.LogicallyPartitioned), (i, name)
            assert got.names == tuple(axes), (i, name)
            assert got.value.shape == v[...].shape
            boxed += 1
    assert boxed == 2  # the norm's scale, the kernel


def test_dropout_takes_the_apply_rng_and_deterministic():
    module = ops.LinenSequential((P(ops.Linear, D, F), P(ops.Dropout, 0.5)))
    x = _x()
    variables = module.init(jax.random.PRNGKey(0), x, deterministic=True)
    run = jax.jit(lambda v, x, key: module.apply(v, x, rngs={"dropout": key}))
    a, b, c = (run(variables, x, jax.random.PRNGKey(k)) for k in (3, 4, 3))
    np.testing.assert_array_equal(np.asarray(a), np.asarray(c))
    assert not np.array_equal(np.asarray(a), np.asarray(b))
    dropped = float(jnp.mean(a == 0))
    assert 0.3 < dropped < 0.7, dropped
    kept = module.apply(variables, x, deterministic=True)
    plain = ops.LinenSequential((P(ops.Linear, D, F),)).apply(variables, x)
    np.testing.assert_array_equal(np.asarray(kept), np.asarray(plain))
    with pytest.raises(ValueError, match=r"Dropout at ops\[1\] needs a 'dropout' rng"):
        module.apply(variables, x)


def test_errors_name_what_was_given():
    x = _x()
    with pytest.raises(TypeError, match=r"ops\[1\] is a Linear: give a callable"):
        ops.LinenSequential((P(ops.Identity), ops.Linear(D, F, rngs=nnx.Rngs(0)))).init(
            jax.random.PRNGKey(0), x
        )
    with pytest.raises(TypeError, match=r"ops\[0\]\(\) returned a int"):
        ops.LinenSequential((lambda: 3,)).init(jax.random.PRNGKey(0), x)
    with pytest.raises(TypeError, match="ops must be a sequence of callables"):
        ops.LinenSequential(P(ops.Identity)).init(jax.random.PRNGKey(0), x)
