"""Pure-JAX quantization: the ``implementation="xla"`` path, and what the kernels must match
bit for bit (docs/numerics.md §3-§5).

``quantize(y, quantizer)`` quantizes the float32 value of ``y`` (float32, bfloat16 or float16;
float64 is rounded to float32 first). All arithmetic is IEEE float32 through ``ieee``, so the
result does not depend on whether the backend flushes denormals (XLA:CPU does).

Per mode, with ``Q`` the format's max (448 E4M3, 57344 E5M2, 6 E2M1) and ``sat`` the saturating
round-to-nearest-even cast (``formats.saturating_cast``):

* DELAYED: ``q = sat(y · scale)`` with the quantizer's ``scale``; ``scale_inv = 1 / scale``;
  ``amax = max|y|`` is reported for the quantizer's update.
* CURRENT: ``amax = max|y|``; ``scale = current_scale(amax, Q)``; then as delayed.
* MXFP8: per block of 32, ``e = mxfp8_exponent(max|y_block|, Q)``; ``q = sat(y · 2^-e)``;
  ``scale_inv = 2^e`` as E8M0.
* NVFP4: ``S = nvfp4_global_scale(amax)``; per block of 16
  ``block_scale = sat_e4m3((amax_block / 6) · S)``, ``q = sat_e2m1((y · S) / block_scale)``
  (0 where ``block_scale`` is 0); ``scale_inv = block_scale``, ``global_scale_inv = 1 / S``.
* Blockwise FP8 (1×128 blocks or 128×128 tiles of ``[M, N]``, partial at the edges):
  ``scale = fp8_block_scale(max|y_block|, Q, options)``; ``q = sat(y · scale)``;
  ``scale_inv = 1 / scale`` (float32, in cuBLASLt's layout: ``scaling_modes``).

Each operation is one float32 operation, evaluated left to right as written. The arithmetic of
each mode is its description's (``scaling_modes``); the scale formulas are ``scale_math``'s;
where the blocks and the colwise transpose fall is ``geometry``'s, the output shapes and the
input checks ``shapes``'.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from te_jax.quantize import formats
from te_jax.quantize.quantizers import Quantizer
from te_jax.quantize.scale_math import (
    NVFP4_GLOBAL_Q,
    amax,
    current_scale,
    mxfp8_exponent,
    nvfp4_global_scale,
)
from te_jax.quantize.scaled_tensor import ScaledTensor
from te_jax.quantize.scaling_modes import ScalingMode
from te_jax.quantize.shapes import check_quantize_input

__all__ = [
    "quantize",
    "quantize_from_amax",
    "quantize_with_scale",
    "amax",
    "current_scale",
    "nvfp4_global_scale",
    "mxfp8_exponent",
    "NVFP4_GLOBAL_Q",
]


def _as_amax(value, what: str) -> jax.Array:
    a = jnp.asarray(value, jnp.float32)
    if a.shape not in ((), (1,)):
        raise ValueError(f"te_jax.quantize: {what} must have shape () or (1,), got {a.shape}")
    return a.reshape(())


def quantize_from_amax(
    y: jax.Array, quantizer: Quantizer, amax: jax.Array, n_feature_axes: int = 1
) -> ScaledTensor:
    """``quantize`` with the tensor amax given, e.g. max-reduced over the shards of a sharded
    tensor (the two-pass modes, current scaling and NVFP4, scale by the global amax).

    For CURRENT and NVFP4 the given ``amax`` sets the scale; for DELAYED it is only reported in
    ``ScaledTensor.amax`` (the scale is the quantizer's). MXFP8 has no tensor amax.

    Args:
      y: ``(..., N)`` floating-point input.
      quantizer: a te_jax quantizer (not MXFP8).
      amax: float32 ``()`` or ``(1,)``.
      n_feature_axes: trailing axes folded into N (1, or 2 for gated ``dact`` outputs).

    Raises:
      TypeError, ValueError: as ``check_quantize_input``; ValueError for an MXFP8 quantizer.
    """
    y = jnp.asarray(y)
    check_quantize_input(y.shape, y.dtype, quantizer, n_feature_axes, "quantize_from_amax")
    if not quantizer.scaling_mode.impl.has_amax:
        raise ValueError(
            "te_jax.quantize_from_amax: MXFP8 scales each block by its own amax; there is no "
            "tensor amax to pass (use quantize)"
        )
    amax_ = _as_amax(amax, "amax")
    return _quantize(y, quantizer, amax_, n_feature_axes)


def quantize(y: jax.Array, quantizer: Quantizer, *, n_feature_axes: int = 1) -> ScaledTensor:
    """Quantizes ``y`` as ``quantizer`` says (docs/numerics.md §4; formulas in the module doc).

    Args:
      y: ``leading + features`` floating-point input (float32, bfloat16, float16; float64 is
        rounded to float32 first). Block modes need the blocked axes divisible by the block
        size (``layout``).
      quantizer: ``DelayedScaleQuantizer``, ``CurrentScaleQuantizer``, ``MXFP8Quantizer`` or
        ``NVFP4Quantizer``; its ``q_layout`` picks rowwise and/or colwise outputs.
      n_feature_axes: the trailing axes folded into N: 1, or 2 for a gated ``dact`` output
        ``(..., 2, H)``. It places the colwise transpose (tensor scaling) and the colwise blocks.

    Returns:
      A ``ScaledTensor`` with ``dq_dtype = y.dtype``; shapes as ``scale_shapes``.

    Raises:
      TypeError: non-floating input, or not a te_jax quantizer.
      ValueError: a blocked axis not divisible by the block size, colwise block scaling
        without a leading axis, or a bad ``n_feature_axes``.
    """
    y = jnp.asarray(y)
    check_quantize_input(y.shape, y.dtype, quantizer, n_feature_axes, "quantize")
    amax_ = amax(y) if quantizer.scaling_mode.impl.has_amax else None
    return _quantize(y, quantizer, amax_, n_feature_axes)


def _quantize(y, quantizer: Quantizer, amax_, n_feature_axes) -> ScaledTensor:
    spec = quantizer.scaling_mode.impl
    scale = quantizer.scale if spec.uses_quantizer_scale else None
    fields = spec.quantize_fields(
        formats.to_float32(y),
        quantizer.q_dtype,
        quantizer.q_layout,
        n_feature_axes,
        scale,
        amax_,
        quantizer.scale_options,
    )
    return ScaledTensor(
        **fields,
        scaling_mode=quantizer.scaling_mode,
        q_layout=quantizer.q_layout,
        dq_dtype=y.dtype,
        n_feature_axes=n_feature_axes,
    )


def quantize_with_scale(
    y: jax.Array,
    scaling_mode: ScalingMode,
    q_layout,
    q_dtype,
    scale: jax.Array | None = None,
    *,
    n_feature_axes: int = 1,
    scale_options=None,
) -> ScaledTensor:
    """``quantize`` from a bare configuration instead of a quantizer (for primitive rules).

    ``scale`` (float32 ``()`` or ``(1,)``) is DELAYED's scale and is ignored by the other
    modes, which derive their scales from ``y``. ``scale_options``: blockwise FP8's
    ``BlockScaleOptions`` (``None``: the quantizer's defaults; the other modes take none).
    """
    quantizer = Quantizer.for_mode(scaling_mode, q_dtype, q_layout, scale, scale_options)
    return quantize(y, quantizer, n_feature_axes=n_feature_axes)
