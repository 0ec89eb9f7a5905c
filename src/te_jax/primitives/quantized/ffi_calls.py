"""The FFI calls of a quantized op on local (unsharded, or one shard's) operands.

``te_jax_act_lu``, ``te_jax_quantize`` and ``te_jax_dact_dbias_quantize`` quantize; the two-pass
modes first call ``te_jax_act_amax`` / ``te_jax_dact_dbias_amax`` for the tensor amax. The
kernels see flattened buffers (``ScalingModeImpl.ffi_results``) and derive every scale
themselves; their per-tensor input goes in the mode's ``batch_operand`` (delayed scaling's
scale, the two-pass modes' amax from the first pass), one float32 per batch element.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from te_jax.activation_types import IDENTITY_ACT_ENUM
from te_jax.primitives import base, dbias_policy
from te_jax.primitives.quantized.config import OpKind, QuantConfig
from te_jax.quantize.geometry import Geometry

__all__ = ["amax_pass", "quantize_pass"]

_F32 = np.dtype(np.float32)


def _dbias_buffers(g: Geometry, dtype, is_dbias: bool) -> list[jax.ShapeDtypeStruct]:
    """dbias ``(B, N)`` and its float32 workspace ``(B, groups, N)`` (empty without dbias)."""
    sds = jax.ShapeDtypeStruct
    if not is_dbias:
        return [sds((0,), dtype), sds((0,), _F32)]
    groups = dbias_policy.QUANTIZED.groups(g.m // g.b, g.feat[-1], np.dtype(dtype).itemsize)
    return [sds((g.b, g.n), dtype), sds((g.b, groups, g.n), _F32)]


def _act_attrs(act, params) -> dict:
    return dict(act_enum=np.int64(act), act_params=base.act_params_attr(params))


def _quant_attrs(cfg: QuantConfig) -> dict:
    """The quantizing targets' attributes; ``power_2_scale`` and ``amax_epsilon`` are
    blockwise FP8's options (False and 0 for the other modes)."""
    return dict(
        scaling_mode=cfg.spec.ffi_value,
        quantize_layout=np.int64(cfg.layout),
        output_amax=np.bool_(False),
        **base.scale_options_attrs(cfg.scale_options),
    )


def amax_pass(kind: OpKind, act, params, is_dbias, g: Geometry, operands):
    """First pass of the two-pass modes: ``(amax (B,), dbias (B, N) or None, workspace)``."""
    amax = jax.ShapeDtypeStruct((g.b,), _F32)
    if kind is OpKind.DACT:
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
    if kind is OpKind.QUANTIZE:
        x = x.reshape(g.m, g.n)
        attrs = dict(act_enum=np.int64(IDENTITY_ACT_ENUM), act_params=base.act_params_attr(None))
    else:
        attrs = _act_attrs(act, params)
    (a,) = base.ffi_call("te_jax_act_amax", [amax], x, **attrs)
    return a, None, None


def quantize_pass(
    kind: OpKind, act, params, cfg: QuantConfig, is_dbias, g: Geometry, operands, per_tensor
):
    """The quantizing call: ``(six buffers of FFI_RESULT_SLOTS, dbias or None, workspace)``.

    ``per_tensor`` (float32, one per batch) goes in the mode's ``batch_operand``; the kernel's
    other per-tensor operand is a placeholder.
    """
    unused = jnp.zeros((1,), jnp.float32)
    scale = per_tensor if cfg.spec.batch_operand == "scale" else unused
    amax = per_tensor if cfg.spec.batch_operand == "amax" else unused
    results = cfg.spec.ffi_results(g, cfg.layout, cfg.q_dtype)
    if kind is OpKind.DACT:
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
    if kind is OpKind.QUANTIZE:
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
