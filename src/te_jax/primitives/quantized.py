"""Quantized outputs of the te_jax ops: ``act_lu``, standalone ``quantize`` and ``dact`` (+ dbias)
with an FP8 / FP4 output (SPEC.md §4-§6), as one outer primitive, ``te_jax_quantized``.

``kind`` selects the op: ``"act"`` (x -> act(x)), ``"quantize"`` (x -> x) or ``"dact"``
((dz, x) -> act'(x) dz, with dbias). The op's output ``y`` (rounded to x's dtype, the value the
unquantized op returns) has shape ``batch + lead + feat``: ``batch`` are the ``batch_dims``
leading axes added by ``vmap`` (each batch element is its own tensor, with its own scale and
amax), ``feat`` the trailing feature axes (``(2, H)`` for a gated dact, else ``(H,)``).

Results, in order, those the mode and layout produce (see ``result_names``):
  data              y's shape, q_dtype                      (rowwise layouts)
  colwise_data      tensor modes: batch + feat + lead (the transpose of each [M, N]);
                    block modes: y's shape                  (colwise layouts)
  scale_inv         tensor modes: batch + (1,) float32; block modes: the rowwise block scales
                    y.shape[:-1] + (y.shape[-1] // block,)
  colwise_scale_inv block modes: batch + lead[:-1] + (lead[-1] // block,) + feat
  amax              batch + (1,) float32 (tensor modes and NVFP4: the amax measured on y)
  global_scale_inv  batch + (1,) float32 (NVFP4: 1 / S)
  dbias             batch + feat, x's dtype                 (dact with is_dbias)

The FFI calls (``te_jax_act_lu``, ``te_jax_quantize``, ``te_jax_dact_dbias_quantize`` and, for
the two-pass modes, first ``te_jax_act_amax`` / ``te_jax_dact_dbias_amax``) see flattened
buffers (NVFP4 data as float4_e2m1fn, which XLA packs as the kernels write it); this module
reshapes them, and derives no scales: the kernels do (see ``_kernel``). Under sharding the
two-pass modes max-reduce the first pass's amax across the mesh axes y is split on before the
second pass, so every shard quantizes with the global scale.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.core import ShapedArray
from jax.interpreters import batching

from te_jax import reference
from te_jax.activation_types import ActivationParams, ActivationType
from te_jax.primitives import base
from te_jax.primitives.dact_dbias import (
    QUANTIZED_MAX_GROUPS,
    QUANTIZED_TARGET_BLOCKS,
    dbias_groups,
)
from te_jax.quantize import quantizers
from te_jax.quantize import reference as qref
from te_jax.quantize.modes import QuantizeLayout, ScalingMode

IDENTITY_ENUM = np.int64(99)  # ActivationEnum::IDENTITY: the standalone quantize kernels

_F32 = np.dtype(np.float32)
_U8 = np.dtype(np.uint8)
_E8M0 = np.dtype(jnp.float8_e8m0fnu)
_E4M3 = np.dtype(jnp.float8_e4m3fn)
_E2M1 = np.dtype(jnp.float4_e2m1fn)


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    """The static part of a quantizer: what the kernels and the shapes depend on."""

    mode: ScalingMode
    layout: QuantizeLayout
    q_dtype: np.dtype

    @classmethod
    def of(cls, quantizer) -> QuantConfig:
        return cls(
            ScalingMode(quantizer.scaling_mode),
            QuantizeLayout(quantizer.q_layout),
            np.dtype(quantizer.q_dtype),
        )

    @property
    def block(self) -> int:
        return self.mode.block_size or 1

    @property
    def block_scale_dtype(self) -> np.dtype:
        return _E8M0 if self.mode == ScalingMode.MXFP8_1D_SCALING else _E4M3


@dataclasses.dataclass(frozen=True)
class Geometry:
    """Shapes of one call: y = batch + lead + feat."""

    batch: tuple
    lead: tuple
    feat: tuple

    @property
    def y(self) -> tuple:
        return self.batch + self.lead + self.feat

    @property
    def b(self) -> int:
        return math.prod(self.batch)

    @property
    def m(self) -> int:
        return math.prod(self.batch + self.lead)

    @property
    def n(self) -> int:
        return math.prod(self.feat)


def geometry(kind: str, act: ActivationType | None, x_shape, batch_dims: int) -> Geometry:
    if kind == "act" and act.is_gated:
        y = tuple(x_shape[:-2]) + (x_shape[-1],)
    else:
        y = tuple(x_shape)
    nf = 2 if kind == "dact" and act.is_gated else 1
    return Geometry(y[:batch_dims], y[batch_dims : len(y) - nf], y[len(y) - nf :])


def result_names(kind: str, cfg: QuantConfig, is_dbias: bool) -> tuple[str, ...]:
    names = []
    if cfg.layout.has_rowwise:
        names.append("data")
    if cfg.layout.has_colwise:
        names.append("colwise_data")
    if cfg.mode.is_tensor_scaling:
        names.append("scale_inv")
    else:
        if cfg.layout.has_rowwise:
            names.append("scale_inv")
        if cfg.layout.has_colwise:
            names.append("colwise_scale_inv")
    if cfg.mode.is_tensor_scaling or cfg.mode == ScalingMode.NVFP4_1D_SCALING:
        names.append("amax")
    if cfg.mode == ScalingMode.NVFP4_1D_SCALING:
        names.append("global_scale_inv")
    if kind == "dact" and is_dbias:
        names.append("dbias")
    return tuple(names)


def _result_avals(kind, cfg: QuantConfig, is_dbias, g: Geometry, dtype) -> dict:
    bs = cfg.block
    per_batch = ShapedArray(g.batch + (1,), _F32)
    shapes = {
        "data": ShapedArray(g.y, cfg.q_dtype),
        "colwise_data": ShapedArray(
            g.batch + g.feat + g.lead if cfg.mode.is_tensor_scaling else g.y, cfg.q_dtype
        ),
        "amax": per_batch,
        "global_scale_inv": per_batch,
        "dbias": ShapedArray(g.batch + g.feat, dtype),
    }
    if cfg.mode.is_tensor_scaling:
        shapes["scale_inv"] = per_batch
    else:
        y = g.y
        shapes["scale_inv"] = ShapedArray(y[:-1] + (y[-1] // bs,), cfg.block_scale_dtype)
        if g.lead:
            col = g.batch + g.lead[:-1] + (g.lead[-1] // bs,) + g.feat
            shapes["colwise_scale_inv"] = ShapedArray(col, cfg.block_scale_dtype)
    return {k: shapes[k] for k in result_names(kind, cfg, is_dbias)}


# ---- the FFI calls (local: unsharded, or one shard) -------------------------------------------


def _ffi_results(cfg: QuantConfig, g: Geometry) -> list[jax.ShapeDtypeStruct]:
    """Result buffers of the quantizing call: output, colwise_output, scale_inv,
    colwise_scale_inv, amax, global_scale_inv (flattened; empty where not produced)."""
    m, n, b, bs = g.m, g.n, g.b, cfg.block
    sds = jax.ShapeDtypeStruct
    empty = sds((0,), _U8)
    nvfp4 = cfg.mode == ScalingMode.NVFP4_1D_SCALING
    # NVFP4: float4_e2m1fn, which XLA stores two codes per byte as the kernels write them (an
    # unpacking bitcast from uint8 would be an extra pass: 38 ms for 4 M codes on XLA:CPU).
    data = sds((m, n), cfg.q_dtype)
    row, col = cfg.layout.has_rowwise, cfg.layout.has_colwise
    out = [data if row else empty]
    if cfg.mode.is_tensor_scaling:
        out.append(sds((b, n, m // b), cfg.q_dtype) if col else empty)
        out.append(sds((b,), _F32))
        out.append(empty)
    else:
        out.append(data if col else empty)
        out.append(sds((m, n // bs), cfg.block_scale_dtype) if row else empty)
        out.append(sds((m // bs, n), cfg.block_scale_dtype) if col else empty)
    delayed = cfg.mode == ScalingMode.DELAYED_TENSOR_SCALING
    out.append(sds((b,) if delayed else (0,), _F32))  # amax
    out.append(sds((b,) if nvfp4 else (0,), _F32))  # global_scale_inv (1 / S)
    return out


def _dbias_buffers(g: Geometry, dtype, is_dbias: bool) -> list[jax.ShapeDtypeStruct]:
    sds = jax.ShapeDtypeStruct
    if not is_dbias:
        return [sds((0,), dtype), sds((0,), _F32)]
    groups = dbias_groups(
        g.m // g.b,
        g.feat[-1],
        np.dtype(dtype).itemsize,
        target_blocks=QUANTIZED_TARGET_BLOCKS,
        max_groups=QUANTIZED_MAX_GROUPS,
    )
    return [sds((g.b, g.n), dtype), sds((g.b, groups, g.n), _F32)]


def _act_attrs(act, params) -> dict:
    return dict(act_enum=np.int64(act), act_params=base.act_params_attr(params))


def _quant_attrs(cfg: QuantConfig) -> dict:
    return dict(
        scaling_mode=np.int64(cfg.mode),
        quantize_layout=np.int64(cfg.layout),
        output_amax=np.bool_(False),
    )


def _amax_pass(kind, act, params, is_dbias, g: Geometry, operands):
    """First pass of the two-pass modes: ``(amax (B,), dbias (B, N) or None, workspace)``."""
    amax = jax.ShapeDtypeStruct((g.b,), _F32)
    if kind == "dact":
        dz, x = operands
        outs = base.ffi_call(
            "te_jax_dact_dbias_amax",
            [amax] + _dbias_buffers(g, x.dtype, is_dbias),
            dz,
            x,
            is_dbias=np.bool_(is_dbias),
            **_act_attrs(act, params),
        )
        return outs[0], (outs[1] if is_dbias else None), outs[2]
    (x,) = operands
    if kind == "quantize":
        x = x.reshape(g.m, g.n)
        attrs = dict(act_enum=IDENTITY_ENUM, act_params=base.act_params_attr(None))
    else:
        attrs = _act_attrs(act, params)
    (a,) = base.ffi_call("te_jax_act_amax", [amax], x, **attrs)
    return a, None, None


def _quantize_pass(kind, act, params, cfg, is_dbias, g: Geometry, operands, scale=None, amax=None):
    """The quantizing call: ``(6 quantized buffers, dbias or None, workspace)``. DELAYED reads
    ``scale``, CURRENT and NVFP4 ``amax`` (float32, one per batch); the other is a placeholder."""
    unused = jnp.zeros((1,), jnp.float32)
    scale = unused if scale is None else scale
    amax = unused if amax is None else amax
    results = _ffi_results(cfg, g)
    if kind == "dact":
        dz, x = operands
        outs = base.ffi_call(
            "te_jax_dact_dbias_quantize",
            results + _dbias_buffers(g, x.dtype, is_dbias),
            dz,
            x,
            scale,
            amax,
            is_dbias=np.bool_(is_dbias),
            **_act_attrs(act, params),
            **_quant_attrs(cfg),
        )
        return outs[:6], (outs[6] if is_dbias else None), outs[7]
    (x,) = operands
    if kind == "quantize":
        outs = base.ffi_call(
            "te_jax_quantize",
            results,
            x.reshape(g.m, g.n),
            scale,
            amax,
            **_quant_attrs(cfg),
        )
    else:
        outs = base.ffi_call(
            "te_jax_act_lu",
            results,
            x,
            scale,
            amax,
            **_act_attrs(act, params),
            **_quant_attrs(cfg),
        )
    return outs, None, None


def _kernel(
    operands, scale, kind, act, params, cfg, is_dbias, batch_dims, reduce_amax=None, dbias_f32=False
):
    """The local computation: a dict of the results (see the module docstring).

    ``scale`` (batch + (1,)) is DELAYED's scale. The two-pass modes hand the second pass the
    amax of the first, max-reduced by ``reduce_amax`` (the partition's pmax), and the kernel
    derives the scale (Q / amax, resp. 6 * 448 / amax) and writes 1 / scale, both exactly
    (problem.h). With ``dbias_f32`` dbias is the float32 sum of the local rows (for a
    cross-shard sum in float32).
    """
    x = operands[-1]
    g = geometry(kind, act, x.shape, batch_dims)
    avals = _result_avals(kind, cfg, is_dbias, g, x.dtype)
    res = {}
    dbias = workspace = None
    if cfg.mode.is_two_pass:
        amax, dbias, workspace = _amax_pass(kind, act, params, is_dbias, g, operands)
        if reduce_amax is not None:
            amax = reduce_amax(amax)
        bufs, _, _ = _quantize_pass(kind, act, params, cfg, False, g, operands, amax=amax)
        res["amax"] = amax
        if cfg.mode == ScalingMode.NVFP4_1D_SCALING:
            res["global_scale_inv"] = bufs[5]
    else:
        s = scale.reshape(g.b).astype(jnp.float32)
        bufs, dbias, workspace = _quantize_pass(kind, act, params, cfg, is_dbias, g, operands, s)
        if cfg.mode == ScalingMode.DELAYED_TENSOR_SCALING:
            res["amax"] = bufs[4]
            if reduce_amax is not None:
                res["amax"] = reduce_amax(res["amax"])
    data, colwise, scale_inv, colwise_scale_inv, _, _ = bufs
    if "data" in avals:
        res["data"] = data
    if "colwise_data" in avals:
        res["colwise_data"] = colwise
    if "scale_inv" in avals:
        res["scale_inv"] = scale_inv
    if "colwise_scale_inv" in avals:
        res["colwise_scale_inv"] = colwise_scale_inv
    if "dbias" in avals:
        res["dbias"] = workspace.sum(axis=1) if dbias_f32 else dbias
    return {k: v.reshape(avals[k].shape) for k, v in res.items()}


def _local_list(operands, scale, kind, act, params, cfg, is_dbias, batch_dims, **kw):
    x = operands[-1]
    if x.size == 0:
        return _reference(
            *operands,
            scale,
            kind=kind,
            act=act,
            params=params,
            cfg=cfg,
            is_dbias=is_dbias,
            batch_dims=batch_dims,
        )
    res = _kernel(operands, scale, kind, act, params, cfg, is_dbias, batch_dims, **kw)
    return [res[k] for k in result_names(kind, cfg, is_dbias)]


# ---- the pure-JAX path ------------------------------------------------------------------------


def quantizer_of(cfg: QuantConfig, scale):
    """A quantizer with ``cfg``'s configuration (DELAYED: with ``scale``)."""
    if cfg.mode == ScalingMode.DELAYED_TENSOR_SCALING:
        return quantizers.DelayedScaleQuantizer(
            q_dtype=cfg.q_dtype,
            q_layout=cfg.layout,
            scale=scale,
            amax_history=jnp.zeros((1,), jnp.float32),
        )
    cls = {
        ScalingMode.CURRENT_TENSOR_SCALING: quantizers.CurrentScaleQuantizer,
        ScalingMode.MXFP8_1D_SCALING: quantizers.MXFP8Quantizer,
        ScalingMode.NVFP4_1D_SCALING: quantizers.NVFP4Quantizer,
    }[cfg.mode]
    return cls(cfg.q_dtype, cfg.layout)


def _reference_one(operands, scale, kind, act, params, cfg, is_dbias):
    """One (unbatched) tensor: the op in pure JAX, then te_jax.quantize.reference."""
    dbias = None
    if kind == "act":
        y = reference.act_lu(operands[0], act, params)
        nf = 1
    elif kind == "quantize":
        y = operands[0]
        nf = 1
    else:
        dz, x = operands
        y, dbias = reference.quantize_dact_dbias(dz, x, act, is_dbias=is_dbias, act_params=params)
        nf = 2 if act.is_gated else 1
    st = qref.quantize(y, quantizer_of(cfg, scale.reshape(())), n_feature_axes=nf)
    res = {
        "data": st.data,
        "colwise_data": st.colwise_data,
        "scale_inv": st.scale_inv,
        "colwise_scale_inv": st.colwise_scale_inv,
        "amax": st.amax,
        "global_scale_inv": st.global_scale_inv,
        "dbias": dbias,
    }
    names = result_names(kind, cfg, is_dbias)
    per_batch = ("amax", "global_scale_inv") + (
        ("scale_inv",) if cfg.mode.is_tensor_scaling else ()
    )
    return [res[k].reshape(1) if k in per_batch else res[k] for k in names]


def _reference(*args, kind, act, params, cfg, is_dbias, batch_dims):
    *operands, scale = args

    def fn(s, *ops):
        return _reference_one(ops, s, kind, act, params, cfg, is_dbias)

    for _ in range(batch_dims):
        fn = jax.vmap(fn)
    return fn(scale, *operands)


# ---- sharding ---------------------------------------------------------------------------------


def _specs(kind, act, batch_dims, x_spec):
    """(x spec with the act axis unsplit, y spec, batch / lead / feat parts of y's spec)."""
    x_spec = list(x_spec)
    if act is not None and act.is_gated:
        x_spec[-2] = None  # a and b of one column stay together
    if kind == "act" and act.is_gated:
        y_spec = x_spec[:-2] + x_spec[-1:]
    else:
        y_spec = list(x_spec)
    nf = 2 if kind == "dact" and act.is_gated else 1
    return x_spec, y_spec, y_spec[:batch_dims], y_spec[batch_dims:-nf], y_spec[-nf:]


def _result_specs(cfg, bspec, lspec, fspec) -> dict:
    y = bspec + lspec + fspec
    per_batch = bspec + [None]
    return {
        "data": y,
        "colwise_data": bspec + fspec + lspec if cfg.mode.is_tensor_scaling else y,
        "scale_inv": per_batch if cfg.mode.is_tensor_scaling else y,
        "colwise_scale_inv": y,
        "amax": per_batch,
        "global_scale_inv": per_batch,
        "dbias": bspec + fspec,
    }


def _block_safe(cfg, x_spec, x_shape, mesh, kind, act, batch_dims):
    """Unsplits the axes a block would straddle (a shard's extent not divisible by the block)."""
    if not cfg.mode.is_block_scaling:
        return x_spec
    bs = cfg.block
    x_spec = list(x_spec)

    def shards(entry):
        axes = base.mesh_axes([entry])
        return math.prod(mesh.shape[a] for a in axes) if axes else 1

    last = len(x_shape) - 1
    if cfg.layout.has_rowwise and (x_shape[last] // shards(x_spec[last])) % bs:
        x_spec[last] = None
    gated = act is not None and act.is_gated
    lead_last = len(x_shape) - (2 if gated else 1) - 1
    if cfg.layout.has_colwise and lead_last >= batch_dims:
        if (x_shape[lead_last] // shards(x_spec[lead_last])) % bs:
            x_spec[lead_last] = None
    return x_spec


def _sharding_rule(kind, act, params, cfg, is_dbias, batch_dims, mesh, operand_types, result_types):
    rank = len(operand_types[-2].shape)  # x
    gated = act is not None and act.is_gated
    n_feat_x = 2 if gated else 1
    rows = base.row_factor_names(rank - n_feat_x)
    bat, lead = rows[:batch_dims], rows[batch_dims:]
    block = cfg.mode.is_block_scaling
    kwargs = {}
    # Block scales have an axis `block` times shorter than the data's: the data's axis is the
    # compound factor (outer, block) and the scale's is the outer factor alone.
    h, h_scale = "h", "h"
    lead_x, lead_scale = list(lead), list(lead)
    # (A compound factor may not have an outer part of size 1: an axis of exactly one block
    # gets a separate size-1 factor in the scale instead, and stays unsplit.)
    shape = operand_types[-2].shape
    if block and cfg.layout.has_rowwise:
        if shape[-1] > cfg.block:
            h = "(h hb)"
            kwargs["hb"] = cfg.block
        else:
            h_scale = "hs"
    if block and cfg.layout.has_colwise and lead:
        if shape[rank - n_feat_x - 1] > cfg.block:
            lead_x[-1] = f"({lead[-1]} rb)"
            kwargs["rb"] = cfg.block
        else:
            lead_scale[-1] = "rs"
    k = ["k"] if gated else []
    x = " ".join(bat + lead_x + k + [h])
    scale = " ".join(bat + ["z"])
    feat_y = [h] if kind == "act" else k + [h]
    y = " ".join(bat + lead_x + feat_y)
    names = result_names(kind, cfg, is_dbias)
    tensor = cfg.mode.is_tensor_scaling
    per_batch = " ".join(bat + ["z"])
    rule = {
        "data": y,
        "colwise_data": " ".join(bat + feat_y + lead_x) if tensor else y,
        "scale_inv": per_batch if tensor else " ".join(bat + lead_x + feat_y[:-1] + [h_scale]),
        "colwise_scale_inv": " ".join(bat + lead_scale + feat_y),
        "amax": per_batch,
        "global_scale_inv": per_batch,
        "dbias": " ".join(bat + feat_y),
    }
    operands = ([" ".join(bat + lead_x + [h])] if kind == "dact" else []) + [x, scale]
    if gated:
        kwargs["need_replication_factors"] = ("k",)
    return f"{', '.join(operands)} -> {', '.join(rule[n] for n in names)}", kwargs


def _partition(kind, act, params, cfg, is_dbias, batch_dims, mesh, arg_shapes, result_shape):
    x_shape = arg_shapes[-2].shape
    rank = len(x_shape)
    x_spec = base.spec_of(arg_shapes[-2], rank)
    x_spec = _block_safe(cfg, x_spec, x_shape, mesh, kind, act, batch_dims)
    x_spec, y_spec, bspec, lspec, fspec = _specs(kind, act, batch_dims, x_spec)
    specs = _result_specs(cfg, bspec, lspec, fspec)
    names = result_names(kind, cfg, is_dbias)
    out_shardings = [base.named(mesh, specs[n]) for n in names]
    # One tensor per batch element: its amax is reduced over the axes splitting lead and feat.
    amax_axes = base.mesh_axes(lspec + fspec)
    row_axes = base.mesh_axes(lspec)

    def lower(*args):
        *operands, scale = args
        reduce = (lambda a: lax.pmax(a, amax_axes)) if amax_axes else None
        sum_dbias = is_dbias and bool(row_axes)
        res = _kernel(
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
    if kind == "dact":  # dz: x without the act axis
        operand_specs.insert(0, x_spec[:-2] + x_spec[-1:] if act.is_gated else list(x_spec))
    arg_shardings = tuple(base.named(mesh, s) for s in operand_specs) + (
        base.named(mesh, bspec + [None]),
    )
    return mesh, lower, out_shardings, arg_shardings


_STATICS = ("kind", "act", "params", "cfg", "is_dbias", "batch_dims")


def _local1(x, scale, kind, act, params, cfg, is_dbias, batch_dims):
    return _local_list((x,), scale, kind, act, params, cfg, is_dbias, batch_dims)


def _local2(dz, x, scale, kind, act, params, cfg, is_dbias, batch_dims):
    return _local_list((dz, x), scale, kind, act, params, cfg, is_dbias, batch_dims)


_partitioned1 = base.make_partitioned(_local1, 2, _STATICS, _partition, _sharding_rule)
_partitioned2 = base.make_partitioned(_local2, 3, _STATICS, _partition, _sharding_rule)

# ---- the outer primitive ----------------------------------------------------------------------

quantized_p = base.make_primitive("te_jax_quantized")


@quantized_p.def_abstract_eval
def _abstract(*args, kind, act, params, cfg, is_dbias, batch_dims):
    x = args[-2]
    g = geometry(kind, act, x.shape, batch_dims)
    return list(_result_avals(kind, cfg, is_dbias, g, x.dtype).values())


def _local(*args, **p):
    *operands, scale = args
    return _local_list(tuple(operands), scale, **p)


def _partitioned(*args, **p):
    return (_partitioned2 if p["kind"] == "dact" else _partitioned1)(*args, **p)


base.register_outer_rules(quantized_p, local=_local, partitioned=_partitioned, reference=_reference)


def _batch(args, dims, *, kind, act, params, cfg, is_dbias, batch_dims):
    """vmap: the batch axis becomes a new leading batch axis (one tensor per element)."""
    size = next(a.shape[d] for a, d in zip(args, dims, strict=True) if d is not None)
    args = [batching.bdim_at_front(a, d, size) for a, d in zip(args, dims, strict=True)]
    outs = quantized_p.bind(
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
    kind: str,
    act: ActivationType | None,
    params: ActivationParams | None,
    cfg: QuantConfig,
    is_dbias: bool = False,
) -> dict:
    """Binds the outer primitive; returns ``{result name: array}`` (see ``result_names``)."""
    outs = quantized_p.bind(
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
