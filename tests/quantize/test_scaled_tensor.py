"""ScaledTensor: a pytree with static metadata, its derived shape, dequantize under jit and vmap,
and the field checks made when it is built."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from te_jax.quantize import (
    CurrentScaleQuantizer,
    MXFP8Quantizer,
    QuantizeLayout,
    ScaledTensor,
    ScalingMode,
    reference,
)

from .cases import E4M3, FIELDS

RC = QuantizeLayout.ROWWISE_COLWISE


def _tensor(layout=RC, shape=(2, 3, 4), nf=1):
    """A hand-built delayed-scaling tensor (exact small values, scale_inv 0.5)."""
    data = jnp.asarray(np.arange(np.prod(shape)).reshape(shape) % 7, jnp.float8_e4m3fn)
    perm = tuple(range(len(shape) - nf, len(shape))) + tuple(range(len(shape) - nf))
    return ScaledTensor(
        data=data if layout.has_rowwise else None,
        scale_inv=jnp.float32(0.5),
        colwise_data=jnp.transpose(data, perm) if layout.has_colwise else None,
        amax=jnp.float32(3.0),
        scaling_mode=ScalingMode.DELAYED_TENSOR_SCALING,
        q_layout=layout,
        dq_dtype=jnp.bfloat16,
        n_feature_axes=nf,
    )


def test_pytree_leaves_and_static_metadata():
    t = _tensor()
    leaves, treedef = jax.tree.flatten(t)
    assert len(leaves) == 5  # global_scale_inv is None: no leaf
    assert t.colwise_scale_inv is t.scale_inv  # filled in from the shared scale
    back = jax.tree.unflatten(treedef, leaves)
    assert isinstance(back, ScaledTensor) and back.dq_dtype == jnp.bfloat16
    assert back.scaling_mode is ScalingMode.DELAYED_TENSOR_SCALING and back.q_layout is RC
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(t)[0]]
    assert paths == [".data", ".scale_inv", ".colwise_data", ".colwise_scale_inv", ".amax"]
    doubled = jax.tree.map(lambda a: a, t)
    assert all(getattr(doubled, f) is getattr(t, f) for f in FIELDS)


@pytest.mark.parametrize("layout", list(QuantizeLayout), ids=lambda lay: lay.name)
@pytest.mark.parametrize("nf", [1, 2])
def test_shape_and_dequantize_from_either_copy(layout, nf):
    t = _tensor(layout, nf=nf)
    assert t.shape == (2, 3, 4) and t.ndim == 3 and t.q_dtype == E4M3 and t.dtype == E4M3
    want = (np.arange(24).reshape(2, 3, 4) % 7) * 0.5
    dq = jax.jit(lambda t: t.dequantize())(t)
    assert dq.dtype == jnp.bfloat16 and dq.shape == (2, 3, 4)
    np.testing.assert_array_equal(np.asarray(dq, np.float64), want)


def test_returned_from_jit_and_vmap(rng):
    ys = jnp.asarray(rng.uniform(-2, 2, (3, 64, 32)).astype(np.float32))
    q = MXFP8Quantizer(E4M3, RC)
    t = jax.jit(jax.vmap(lambda y: reference.quantize(y, q)))(ys)
    assert t.shape == (3, 64, 32)  # rowwise data present: the batched shape
    assert t.scale_inv.shape == (3, 64, 1) and t.colwise_scale_inv.shape == (3, 2, 32)
    # Dequantize a batched tensor under vmap; each member dequantizes alone.
    dq = jax.jit(jax.vmap(ScaledTensor.dequantize))(t)
    one = jax.jit(lambda y: reference.quantize(y, q).dequantize())(ys[1])
    np.testing.assert_array_equal(np.asarray(dq[1]), np.asarray(one))
    assert float(jnp.max(jnp.abs(dq - ys))) <= 2.0 / 16  # E4M3: 3 bits, block max < 2 here


def test_tensor_scaled_batch_dequantizes_under_vmap(rng):
    """Tensor scaling under vmap: per-member scales (B,), colwise copies (B, H, T)."""
    ys = jnp.asarray(rng.uniform(-2, 2, (2, 16, 8)).astype(np.float32))
    q = CurrentScaleQuantizer(E4M3, QuantizeLayout.COLWISE)
    t = jax.jit(jax.vmap(lambda y: reference.quantize(y, q)))(ys)
    assert t.colwise_data.shape == (2, 8, 16) and t.scale_inv.shape == (2,)
    dq = jax.jit(jax.vmap(ScaledTensor.dequantize))(t)
    assert dq.shape == ys.shape
    assert float(jnp.max(jnp.abs(dq - ys))) <= 2.0 / 16


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(data=None), r"data must be given"),
        (dict(colwise_data=jnp.zeros((4, 2, 3))), r"colwise_data must be None"),
        (dict(global_scale_inv=jnp.float32(1)), r"global_scale_inv must be None"),
        (dict(scaling_mode=ScalingMode.NO_SCALING), r"NO_SCALING output is a plain array"),
    ],
)
def test_construction_checks_fields(kwargs, match):
    base = dict(
        data=jnp.zeros((2, 3, 4), jnp.float8_e4m3fn),
        scale_inv=jnp.float32(1),
        scaling_mode=ScalingMode.DELAYED_TENSOR_SCALING,
        q_layout=QuantizeLayout.ROWWISE,
        dq_dtype=jnp.float32,
    )
    with pytest.raises(ValueError, match=match):
        ScaledTensor(**{**base, **kwargs})


def test_construction_is_keyword_only():
    with pytest.raises(TypeError):
        ScaledTensor(jnp.zeros(4))  # the constructor takes keywords only
