"""An op's output quantized: what ``act_lu`` / ``quantize_dact_dbias`` / ``dact_lu`` (given a
quantizer) and the standalone ``te_jax.quantize.quantize(x, quantizer)`` return.

``quantized_output`` is what they call: it validates at trace time, then either binds the fused
kernels (``te_jax.primitives.quantized``) or runs the op in pure JAX followed by
``te_jax.quantize.reference.quantize`` (``implementation="xla"``); both give the same bits.

**Differentiation.** A quantized output is not differentiable, on either path: a nonzero tangent
reaching a quantized op's operands (``jax.grad`` / ``jvp`` through ``act_lu(x, quantizer=q)``,
``quantize``, a quantized ``dact_lu``) raises ``TypeError`` at trace time naming the op. The
encoding is piecewise constant, so its derivative is zero almost everywhere (the pure-JAX path
silently gave zeros); what FP8 training wants instead is the unquantized op's derivative with the
quantization in a ``custom_vjp`` of one's own (straight through), or ``jax.lax.stop_gradient`` on
the input where no gradient should flow.

This is the public-op layer of quantization, beside ``activation`` (the unquantized ops).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from te_jax import activation_reference, primitives
from te_jax.activation_types import ActivationParams, ActivationType
from te_jax.dispatch import use_ffi
from te_jax.primitives.quantized import OpKind, QuantConfig
from te_jax.quantize import reference as qref
from te_jax.quantize.quantizers import Quantizer
from te_jax.quantize.scaled_tensor import ScaledTensor
from te_jax.quantize.shapes import check_quantize_input

__all__ = ["quantized_output"]


def _check_quantizer(op: str, quantizer) -> None:
    if not isinstance(quantizer, Quantizer):
        raise TypeError(
            f"te_jax.{op}: quantizer must be a te_jax.quantize quantizer (DelayedScaleQuantizer, "
            "CurrentScaleQuantizer, MXFP8Quantizer, NVFP4Quantizer, Float8Block1DQuantizer or "
            f"Float8Block2DQuantizer) or None, got "
            f"{type(quantizer).__name__}"
        )


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _not_differentiable(op: str, operands: tuple) -> tuple:
    """The identity on ``operands``; differentiating through it raises (module docstring)."""
    return operands


@_not_differentiable.defjvp
def _not_differentiable_jvp(op, primals, tangents):
    raise TypeError(
        f"te_jax.{op}: a quantized output (ScaledTensor) is not differentiable. Differentiate the "
        "unquantized op (te_jax.activation / act_lu, dact_lu, quantize_dact_dbias without a "
        "quantizer) and quantize inside your own custom_vjp, or apply jax.lax.stop_gradient to "
        "the input if no gradient should flow through it"
    )


def quantized_output(
    op: str,
    kind: OpKind,
    operands: tuple,
    quantizer,
    act: ActivationType | None = None,
    params: ActivationParams | None = None,
    is_dbias: bool = False,
    implementation: str | None = None,
    feature_axes: int = 1,
):
    """The output of ``kind`` on ``operands`` quantized with ``quantizer``: a ``ScaledTensor``
    (and dbias or ``None`` for ``OpKind.DACT``). ``feature_axes``: the standalone quantize's
    trailing axes folded into N."""
    _check_quantizer(op, quantizer)
    x = operands[-1]
    dtype = jnp.result_type(x)
    cfg = dataclasses.replace(QuantConfig.of(quantizer), feature_axes=int(feature_axes))
    nf = kind.n_feature_axes(act, cfg)
    y_shape = kind.output_shape(act, jnp.shape(x))
    check_quantize_input(y_shape, dtype, quantizer, nf, f"te_jax.{op}")
    operands = _not_differentiable(op, tuple(operands))
    if not use_ffi(op, implementation, dtype, backends=cfg.spec.kernel_backends):
        dbias = None
        if kind is OpKind.ACT:
            y = activation_reference.act_lu(x, act, params)
        elif kind is OpKind.QUANTIZE:
            y = x
        else:
            y, dbias = activation_reference.quantize_dact_dbias(*operands, act, is_dbias, params)
        st = qref.quantize(y, quantizer, n_feature_axes=nf)
        return (st, dbias) if kind is OpKind.DACT else st

    spec = cfg.spec
    spec.check_kernel_shape(op, y_shape)
    scale = quantizer.scale if spec.uses_quantizer_scale else jnp.ones((), jnp.float32)
    res = primitives.bind_quantized(tuple(operands), scale, kind, act, params, cfg, is_dbias)
    dbias = res.pop("dbias", None)
    per_tensor = spec.per_tensor_names()
    fields = {k: (v.reshape(()) if k in per_tensor else v) for k, v in res.items()}
    st = ScaledTensor(
        **fields,
        scaling_mode=cfg.mode,
        q_layout=cfg.layout,
        dq_dtype=jnp.dtype(dtype),
        n_feature_axes=nf,
    )
    return (st, dbias) if kind is OpKind.DACT else st
