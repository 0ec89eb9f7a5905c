"""The outer primitive ``te_jax_quantized``: abstract evaluation, lowerings, batching, bind."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.interpreters import batching

from te_jax._varying import bind
from te_jax.activation_types import ActivationParams, ActivationType
from te_jax.primitives import base
from te_jax.primitives.quantized.config import OpKind, QuantConfig
from te_jax.primitives.quantized.local import local_results
from te_jax.primitives.quantized.reference_results import reference_results
from te_jax.primitives.quantized.shapes import geometry, result_avals, result_names
from te_jax.primitives.quantized.sharding import partitioned

__all__ = ["quantized_p", "bind_quantized"]

quantized_p = base.make_primitive("te_jax_quantized")


@quantized_p.def_abstract_eval
def _abstract(*args, kind, act, params, cfg, is_dbias, batch_dims):
    x = args[-2]
    g = geometry(kind, act, x.shape, batch_dims, cfg)
    return list(result_avals(kind, cfg, is_dbias, g, x.dtype).values())


def _local(*args, **p):
    *operands, scale = args
    return local_results(tuple(operands), scale, **p)


base.register_outer_rules(
    quantized_p, local=_local, partitioned=partitioned, reference=reference_results
)


def _batch(args, dims, *, kind, act, params, cfg, is_dbias, batch_dims):
    """vmap: the batch axis becomes a new leading batch axis (one tensor per element)."""
    size = next(a.shape[d] for a, d in zip(args, dims, strict=True) if d is not None)
    args = [batching.bdim_at_front(a, d, size) for a, d in zip(args, dims, strict=True)]
    outs = bind(
        quantized_p,
        *args,
        kind=kind,
        act=act,
        params=params,
        cfg=cfg,
        is_dbias=is_dbias,
        batch_dims=batch_dims + 1,
    )
    return outs, [0] * len(outs)


batching.primitive_batchers[quantized_p] = _batch


def bind_quantized(
    operands: tuple,
    scale: jax.Array,
    kind: OpKind,
    act: ActivationType | None,
    params: ActivationParams | None,
    cfg: QuantConfig,
    is_dbias: bool = False,
) -> dict:
    """Binds the outer primitive; returns ``{result name: array}`` (see ``result_names``).

    ``operands`` are ``(x,)`` or, for ``OpKind.DACT``, ``(dz, x)``; ``scale`` is delayed
    scaling's scale (float32 ``()``; ones for the other modes). Per-tensor results have shape
    ``(1,)``.
    """
    outs = bind(
        quantized_p,
        *operands,
        jnp.asarray(scale, jnp.float32).reshape(1),
        kind=kind,
        act=act,
        params=params,
        cfg=cfg,
        is_dbias=is_dbias,
        batch_dims=0,
    )
    return dict(zip(result_names(kind, cfg, is_dbias), outs, strict=True))
