"""The ``te_jax_quantized`` primitive's results in pure JAX (its lowering where the kernels are
not used, and for empty inputs): the op in ``te_jax.activation_reference``, then
``te_jax.quantize.reference``, vmapped over the batch axes (the same bits as the kernels)."""

from __future__ import annotations

import jax

from te_jax import activation_reference
from te_jax.primitives.quantized.config import OpKind
from te_jax.primitives.quantized.shapes import result_names
from te_jax.quantize import reference as qref

__all__ = ["reference_results"]


def _reference_one(operands, scale, kind, act, params, cfg, is_dbias) -> list:
    """One (unbatched) tensor: the results in order, per-tensor ones of shape ``(1,)``."""
    dbias = None
    if kind is OpKind.ACT:
        y = activation_reference.act_lu(operands[0], act, params)
    elif kind is OpKind.QUANTIZE:
        y = operands[0]
    else:
        dz, x = operands
        y, dbias = activation_reference.quantize_dact_dbias(
            dz, x, act, is_dbias=is_dbias, act_params=params
        )
    st = qref.quantize_with_scale(
        y,
        cfg.mode,
        cfg.layout,
        cfg.q_dtype,
        scale.reshape(()),
        n_feature_axes=kind.n_feature_axes(act, cfg),
        scale_options=cfg.scale_options,
    )
    per_tensor = cfg.spec.per_tensor_names()
    res = {"dbias": dbias}
    for name in result_names(kind, cfg, is_dbias):
        if name != "dbias":
            v = getattr(st, name)
            res[name] = v.reshape(1) if name in per_tensor else v
    return [res[k] for k in result_names(kind, cfg, is_dbias)]


def reference_results(*args, kind, act, params, cfg, is_dbias, batch_dims) -> list:
    """The outer primitive's results (operands, then the scale ``batch + (1,)``) in pure JAX."""
    *operands, scale = args

    def fn(s, *ops):
        return _reference_one(ops, s, kind, act, params, cfg, is_dbias)

    for _ in range(batch_dims):
        fn = jax.vmap(fn)
    return fn(scale, *operands)
