"""Quantized outputs of the public ops, and the standalone ``te_jax.quantize(x, quantizer)``.

``quantized_output`` is what ``act_lu`` / ``quantize_dact_dbias`` / ``dact_lu`` call when given a
quantizer: it validates at trace time, then either binds the fused kernels
(``te_jax.primitives.quantized``) or runs the op in pure JAX followed by
``te_jax.quantize.reference.quantize`` (``implementation="xla"``); both give the same bits.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from te_jax import primitives, reference
from te_jax.activation_types import ActivationParams, ActivationType
from te_jax.dispatch import use_ffi
from te_jax.primitives.quantized import QuantConfig
from te_jax.quantize import reference as qref
from te_jax.quantize.modes import ScalingMode
from te_jax.quantize.quantizers import Quantizer
from te_jax.quantize.scaled_tensor import ScaledTensor

__all__ = ["quantize", "quantized_output"]


def _check_quantizer(op: str, quantizer) -> None:
    if not isinstance(quantizer, Quantizer):
        raise TypeError(
            f"te_jax.{op}: quantizer must be a te_jax.quantize quantizer (DelayedScaleQuantizer, "
            f"CurrentScaleQuantizer, MXFP8Quantizer or NVFP4Quantizer) or None, got "
            f"{type(quantizer).__name__}"
        )


def _y_shape(kind: str, act: ActivationType | None, x_shape) -> tuple:
    if kind == "act" and act.is_gated:
        return tuple(x_shape[:-2]) + (x_shape[-1],)
    return tuple(x_shape)


def quantized_output(
    op: str,
    kind: str,
    operands: tuple,
    quantizer,
    act: ActivationType | None = None,
    params: ActivationParams | None = None,
    is_dbias: bool = False,
    implementation: str | None = None,
):
    """``kind`` = "act" | "quantize" | "dact" (see primitives.quantized); returns the
    ``ScaledTensor`` (and dbias or None for "dact")."""
    _check_quantizer(op, quantizer)
    x = operands[-1]
    dtype = jnp.result_type(x)
    nf = 2 if kind == "dact" and act.is_gated else 1
    y_shape = _y_shape(kind, act, jnp.shape(x))
    qref.check_quantize_input(y_shape, dtype, quantizer, nf, f"te_jax.{op}")
    if not use_ffi(op, implementation, dtype):
        dbias = None
        if kind == "act":
            y = reference.act_lu(x, act, params)
        elif kind == "quantize":
            y = x
        else:
            y, dbias = reference.quantize_dact_dbias(*operands, act, is_dbias, params)
        st = qref.quantize(y, quantizer, n_feature_axes=nf)
        return (st, dbias) if kind == "dact" else st

    cfg = QuantConfig.of(quantizer)
    if cfg.mode == ScalingMode.NVFP4_1D_SCALING and y_shape[-1] % 2:
        raise ValueError(
            f"te_jax.{op}: the NVFP4 kernels pack two E2M1 codes per byte along the last axis, "
            f"which must be even; got shape {y_shape} (implementation='xla' takes any shape)"
        )
    if cfg.mode == ScalingMode.DELAYED_TENSOR_SCALING:
        scale = quantizer.scale
    else:
        scale = jnp.ones((), jnp.float32)
    res = primitives.bind_quantized(tuple(operands), scale, kind, act, params, cfg, is_dbias)
    scalar = ("amax", "global_scale_inv") + (("scale_inv",) if cfg.mode.is_tensor_scaling else ())
    fields = {k: (v.reshape(()) if k in scalar else v) for k, v in res.items() if k != "dbias"}
    if cfg.mode.is_tensor_scaling and cfg.layout.has_colwise:
        fields["colwise_scale_inv"] = fields["scale_inv"]  # shared, as the reference has it
    st = ScaledTensor(
        data=fields.get("data"),
        scale_inv=fields.get("scale_inv"),
        colwise_data=fields.get("colwise_data"),
        colwise_scale_inv=fields.get("colwise_scale_inv"),
        amax=fields.get("amax"),
        global_scale_inv=fields.get("global_scale_inv"),
        scaling_mode=cfg.mode,
        q_layout=cfg.layout,
        dq_dtype=jnp.dtype(dtype),
        n_feature_axes=nf,
    )
    return (st, res.get("dbias")) if kind == "dact" else st


def quantize(x: jax.Array, quantizer, implementation: str | None = None) -> ScaledTensor:
    """Quantizes ``x (..., N)`` with ``quantizer`` (every mode and layout of SPEC.md §4-§5).

    One pass for DELAYED and MXFP8; CURRENT and NVFP4 take two passes over x (the global amax,
    then the scaled cast) with nothing else in memory. Returns a ``ScaledTensor``; its
    ``dequantize()`` gives back x's dtype.
    """
    dtype = jnp.result_type(x)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(
            f"te_jax.quantize: x must be a floating-point array (float32, bfloat16 or float16), "
            f"got {jnp.dtype(dtype).name}"
        )
    if jnp.ndim(x) < 1:
        raise ValueError("te_jax.quantize: x must have at least one axis (..., N), got a scalar")
    return quantized_output("quantize", "quantize", (x,), quantizer, implementation=implementation)
