"""Sharding of a quantized op: the Shardy rule and the ``custom_partitioning`` partition.

A sharded input is never all-gathered: each shard runs the local computation (``local``) on its
rows and columns. The act axis of a gated ``x`` stays unsplit (a and b of one column together);
a block mode also unsplits an axis whose shards a block would straddle. Each batch element is
its own tensor, so its amax is max-reduced over the mesh axes splitting its leading and feature
axes, and dbias partial sums over those splitting its rows.
"""

from __future__ import annotations

import math

from jax import lax

from te_jax.primitives import base
from te_jax.primitives.quantized.config import OpKind
from te_jax.primitives.quantized.local import kernel, local_results
from te_jax.primitives.quantized.shapes import result_names

__all__ = ["partitioned"]


def _x_feature_ndim(kind, act, cfg) -> int:
    """x's trailing feature axes (a gated x's ``(2, H)``; the quantize's ``feature_axes``)."""
    return act.act_len if act is not None else kind.n_feature_axes(None, cfg)


def _y_parts(kind: OpKind, act, cfg, batch_dims: int, x_axes: list) -> tuple[list, list, list]:
    """``(batch, lead, feat)`` entries of ``y`` from those of ``x``."""
    y = kind.output_axes(act, x_axes)
    nf = kind.n_feature_axes(act, cfg)
    return y[:batch_dims], y[batch_dims : len(y) - nf], y[len(y) - nf :]


def _sharding_rule(kind, act, params, cfg, is_dbias, batch_dims, mesh, operand_types, result_types):
    shape = operand_types[-2].shape  # x
    rank = len(shape)
    n_feat_x = _x_feature_ndim(kind, act, cfg)
    rows = base.row_factor_names(rank - n_feat_x)
    gated = act is not None and act.is_gated
    k = ["k"] if n_feat_x == 2 else []  # a gated x's (2, H), or a quantized (K, 2, N) kernel's
    bat, lead, feat = _y_parts(kind, act, cfg, batch_dims, rows + k + ["h"])
    nf = kind.n_feature_axes(act, cfg)  # y's features: x's last nf axes
    factors, lead, h, kwargs = cfg.spec.shardy_factors(
        cfg.layout,
        bat,
        lead,
        feat,
        shape[-1],
        shape[rank - n_feat_x - 1] if lead else None,
        lead_extents=shape[batch_dims : rank - n_feat_x],
        feat_extents=shape[rank - nf :],
    )
    feat = feat[:-1] + [h]
    factors["dbias"] = bat + feat
    x = bat + lead + k + [h]
    operands = ([act.output_axes(x)] if kind is OpKind.DACT else []) + [x, bat + ["z"]]
    results = [factors[n] for n in result_names(kind, cfg, is_dbias)]
    if gated:
        kwargs["need_replication_factors"] = ("k",)
    rule = (
        ", ".join(" ".join(f) for f in operands) + " -> " + ", ".join(" ".join(f) for f in results)
    )
    return rule, kwargs


def _partition(kind, act, params, cfg, is_dbias, batch_dims, mesh, arg_shapes, result_shape):
    x_shape = arg_shapes[-2].shape
    rank = len(x_shape)
    lead_axis = rank - _x_feature_ndim(kind, act, cfg) - 1
    n_feat_y = kind.n_feature_axes(act, cfg)  # y's features: x's last n_feat_y axes

    def shards(entry):
        axes = base.mesh_axes([entry])
        return math.prod(mesh.shape[a] for a in axes) if axes else 1

    # x's axes that give y's last axis, its innermost leading one, and all its leading resp.
    # feature axes (outermost first), with their sizes.
    x_spec = cfg.spec.unsplit_for_blocks(
        cfg.layout,
        base.spec_of(arg_shapes[-2], rank),
        {
            "last": (rank - 1, x_shape[-1]),
            "lead": (lead_axis, x_shape[lead_axis]) if lead_axis >= batch_dims else None,
            "leads": [(a, x_shape[a]) for a in range(batch_dims, lead_axis + 1)],
            "feats": [(a, x_shape[a]) for a in range(rank - n_feat_y, rank)],
        },
        shards,
    )
    if act is not None and act.is_gated:
        x_spec[-2] = None  # a and b of one column stay together
    bspec, lspec, fspec = _y_parts(kind, act, cfg, batch_dims, x_spec)
    specs = cfg.spec.result_specs(cfg.layout, bspec, lspec, fspec)
    specs["dbias"] = bspec + fspec
    names = result_names(kind, cfg, is_dbias)
    out_shardings = [base.named(mesh, specs[n]) for n in names]
    # One tensor per batch element: its amax is reduced over the axes splitting lead and feat.
    amax_axes = base.mesh_axes(lspec + fspec)
    row_axes = base.mesh_axes(lspec)

    def lower(*args):
        *operands, scale = args
        reduce = (lambda a: lax.pmax(a, amax_axes)) if amax_axes else None
        sum_dbias = is_dbias and bool(row_axes)
        res = kernel(
            operands,
            scale,
            kind,
            act,
            params,
            cfg,
            is_dbias,
            batch_dims,
            reduce_amax=reduce,
            dbias_f32=sum_dbias,
        )
        if sum_dbias:
            res["dbias"] = lax.psum(res["dbias"], row_axes).astype(operands[-1].dtype)
        return [res[n] for n in names]

    operand_specs = [x_spec]
    if kind is OpKind.DACT:  # dz: x without the act axis
        operand_specs.insert(0, act.output_axes(x_spec))
    arg_shardings = tuple(base.named(mesh, s) for s in operand_specs) + (
        base.named(mesh, bspec + [None]),
    )
    return mesh, lower, out_shardings, arg_shardings


_STATICS = ("kind", "act", "params", "cfg", "is_dbias", "batch_dims")


def _local1(x, scale, kind, act, params, cfg, is_dbias, batch_dims):
    return local_results((x,), scale, kind, act, params, cfg, is_dbias, batch_dims)


def _local2(dz, x, scale, kind, act, params, cfg, is_dbias, batch_dims):
    return local_results((dz, x), scale, kind, act, params, cfg, is_dbias, batch_dims)


_partitioned = {
    1: base.make_partitioned(_local1, 2, _STATICS, _partition, _sharding_rule),
    2: base.make_partitioned(_local2, 3, _STATICS, _partition, _sharding_rule),
}


def partitioned(*args, **p) -> list:
    """The op under ``custom_partitioning`` (operands, then the scale; statics by name)."""
    return _partitioned[p["kind"].n_operands](*args, **p)
