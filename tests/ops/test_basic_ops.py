"""Each basic op of te_jax.ops alone in a Sequential: forward and backward against JAX's autodiff
of its pure-JAX form (float32 inputs, so the reference is exact up to float32 rounding; the
kernel paths' own bf16 numerics are tested with the kernels)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import helpers
from te_jax import activation_reference, ops
from te_jax.activation_types import ActivationType

SHAPE = (3, 5, 16)


def _loss_weights(shape):
    return jax.random.normal(jax.random.PRNGKey(7), shape, jnp.float32)


def _run(seq, x, *extra):
    """``y`` and the gradients of a loss quadratic in ``y`` (x's and each parameter's)."""

    def loss(model, x, *extra):
        y = model(x, *extra)
        return jnp.sum(_loss_weights(y.shape) * y.astype(jnp.float32) ** 2), y

    (gm, gx), y = nnx.grad(loss, argnums=(0, 1), has_aux=True)(seq, x, *extra)
    return y, gx, gm


def _reference(f, x, params):
    """``y`` and the gradients of the same loss through JAX's autodiff of ``f(x, params)``."""

    def loss(x, params):
        y = f(x, params)
        return jnp.sum(_loss_weights(y.shape) * y**2)

    return f(x, params), *jax.grad(loss, argnums=(0, 1))(x, params)


def _x(shape=SHAPE, seed=0):
    return jax.random.normal(jax.random.PRNGKey(seed), shape, jnp.float32)


def _close(a, b, tol=2e-5):
    np.testing.assert_allclose(
        np.asarray(a, np.float64),
        np.asarray(b, np.float64),
        rtol=tol,
        atol=tol * float(np.max(np.abs(np.asarray(b))) + 1e-30),
    )


def test_linear():
    seq = ops.Sequential(ops.Linear(16, 24), rngs=nnx.Rngs(0))
    k = seq.ops[0].kernel[...]
    y, gx, gm = _run(seq, _x())
    ry, rgx, rgp = _reference(lambda x, p: jnp.dot(x, p["k"], precision="highest"), _x(), {"k": k})
    _close(y, ry), _close(gx, rgx), _close(gm.ops[0].kernel[...], rgp["k"])


def test_bias():
    seq = ops.Sequential(ops.Bias(16, bias_init=nnx.initializers.normal(1.0)), rngs=nnx.Rngs(0))
    b = seq.ops[0].bias[...]
    y, gx, gm = _run(seq, _x())
    ry, rgx, rgp = _reference(lambda x, p: x + p["b"], _x(), {"b": b})
    _close(y, ry), _close(gx, rgx), _close(gm.ops[0].bias[...], rgp["b"])


@pytest.mark.parametrize("act", helpers.ACTS, ids=str)
def test_activation(act):
    a = ActivationType[act.name]
    seq = ops.Sequential(ops.Activation(a))
    f = SHAPE[-1] * (2 if act.gated else 1)
    x = _x(SHAPE[:-1] + (f,)) * 2
    y, gx, _ = _run(seq, x)

    def ref(x, p):
        h = x.reshape(x.shape[:-1] + ((2, f // 2) if act.gated else (f,)))
        return activation_reference.activation(h, a)

    ry, rgx, _ = _reference(ref, x, {})
    _close(y, ry, 1e-5), _close(gx, rgx, 1e-5)


@pytest.mark.parametrize("kind", ["LayerNorm", "RMSNorm"])
def test_norm(kind):
    op = getattr(ops, kind)(16, epsilon=1e-5)
    seq = ops.Sequential(op)
    scale = jax.random.normal(jax.random.PRNGKey(3), (16,))
    op.scale[...] = scale
    params = {"g": scale}
    if kind == "LayerNorm":
        op.bias[...] = scale[::-1]
        params["b"] = scale[::-1]

    def ref(x, p):
        x64 = x
        if kind == "LayerNorm":
            x64 = x - jnp.mean(x, -1, keepdims=True)
        y = x64 * jax.lax.rsqrt(jnp.mean(x64 * x64, -1, keepdims=True) + 1e-5) * p["g"]
        return y + p["b"] if "b" in p else y

    y, gx, gm = _run(seq, _x())
    ry, rgx, rgp = _reference(ref, _x(), params)
    _close(y, ry), _close(gx, rgx, 1e-4), _close(gm.ops[0].scale[...], rgp["g"], 1e-4)
    if kind == "LayerNorm":
        _close(gm.ops[0].bias[...], rgp["b"], 1e-4)


def test_dropout_keeps_its_mask_for_the_backward():
    seq = ops.Sequential(ops.Dropout(0.5), rngs=nnx.Rngs(dropout=1))
    x = _x() + 10.0  # no zeros: the kept elements are the non-zero outputs
    y, gx, _ = _run(seq, x)
    kept = y != 0
    assert 0.3 < float(jnp.mean(kept)) < 0.7
    np.testing.assert_array_equal(np.asarray(y), np.asarray(jnp.where(kept, 2 * x, 0.0)))
    w = _loss_weights(y.shape)
    _close(gx, jnp.where(kept, 2 * w * 2 * y, 0.0))
    seq.eval()
    np.testing.assert_array_equal(np.asarray(seq(x)), np.asarray(x))


def test_add_residual_and_extra_input():
    seq = ops.Sequential(ops.Identity(), ops.AddResidual(), ops.AddExtraInput())
    x, e = _x(), _x(seed=1)
    y, gx, _ = _run(seq, x, e)
    ry, rgx, _ = _reference(lambda x, p: 2 * x + e, x, {})
    _close(y, ry), _close(gx, rgx)


def test_quantize_is_the_identity_without_a_quantizing_neighbour():
    seq = ops.Sequential(ops.Quantize(forward=True, backward=True))
    y, gx, _ = _run(seq, _x())
    ry, rgx, _ = _reference(lambda x, p: x, _x(), {})
    _close(y, ry), _close(gx, rgx)


class Double(ops.BasicOperation):
    """The user's op of the docs: its own forward and backward."""

    def op_forward(self, ctx, x, args, **_):
        return 2 * x

    def op_backward(self, ctx, dy):
        return 2 * dy, {}


class Scale(ops.BasicOperation):
    """A user op with a parameter and no backward: JAX differentiates its forward."""

    def __init__(self, n, *, rngs):
        self.w = nnx.Param(jax.random.normal(rngs.params(), (n,)))

    def op_forward(self, ctx, x, args, **_):
        return jnp.tanh(x * args.params["w"])


def test_user_ops():
    seq = ops.Sequential(Double(), Scale(16, rngs=nnx.Rngs(2)))
    w = seq.ops[1].w[...]
    y, gx, gm = _run(seq, _x())
    ry, rgx, rgp = _reference(lambda x, p: jnp.tanh(2 * x * p["w"]), _x(), {"w": w})
    _close(y, ry), _close(gx, rgx), _close(gm.ops[1].w[...], rgp["w"])
