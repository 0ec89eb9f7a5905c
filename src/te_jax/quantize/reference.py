"""Pure-JAX quantization: the ``implementation="xla"`` path, and what the kernels must match
bit for bit (SPEC.md §3-§5).

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

Each operation is one float32 operation, evaluated left to right as written. Where the blocks
and the colwise transpose fall, and the output shapes, are in ``layout``.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from te_jax.quantize import formats, ieee
from te_jax.quantize.layout import (
    block_axis,
    check_quantize_input,
    colwise_perm,
    scale_shapes,
    split_blocks,
)
from te_jax.quantize.modes import ScalingMode
from te_jax.quantize.quantizers import (
    CurrentScaleQuantizer,
    DelayedScaleQuantizer,
    MXFP8Quantizer,
    NVFP4Quantizer,
    Quantizer,
)
from te_jax.quantize.scaled_tensor import ScaledTensor

__all__ = [
    "quantize",
    "quantize_from_amax",
    "quantize_with_scale",
    "check_quantize_input",
    "scale_shapes",
    "amax",
    "current_scale",
    "nvfp4_global_scale",
    "mxfp8_exponent",
    "NVFP4_GLOBAL_Q",
]

_F32_MAX = np.float32(np.finfo(np.float32).max)
NVFP4_GLOBAL_Q = 6.0 * 448.0  # E2M1 max times E4M3 max: S maps the tensor amax onto it

# ---------------------------------------------------------------------------------------------
# Building blocks (the FFI path and the sharding rules reuse them).


def amax(y: jax.Array) -> jax.Array:
    """``max |y|`` over the whole tensor, float32 ``()``; exact (subnormals included), NaN if
    any element is NaN, 0 for an empty tensor."""
    return ieee.abs_max(formats.to_float32(jnp.asarray(y)))


@functools.partial(jax.jit, static_argnums=1)
def _scale_from(amax_: jax.Array, numerator: float) -> jax.Array:
    """``numerator / amax``; 1 when amax is 0; float32 max when the quotient overflows.

    ``ieee.div``: XLA's native division is not correctly rounded on every backend (XLA:GPU's
    is ``div.full.f32``); an amax too small for the quotient gives inf, then float32 max.
    Jitted: the exact division is a few hundred integer ops, traced once per shape instead of
    at every call (a model quantizes in many places).
    """
    amax_ = jnp.asarray(amax_, jnp.float32)
    s = ieee.div(np.float32(numerator), amax_)  # a native division is not exact on every backend
    s = jnp.where(jnp.isinf(s), _F32_MAX, s)  # amax tiny or subnormal: Q/amax overflows
    return jnp.where(ieee.is_zero(amax_), jnp.float32(1.0), s)


def current_scale(amax: jax.Array, q_max: float) -> jax.Array:
    """Current scaling's scale: ``Q / amax``; 1 when ``amax == 0``; float32 max when
    ``Q / amax`` overflows (amax below ~Q / 3.4e38). NaN amax gives NaN. Float32 ``()``."""
    return _scale_from(amax, q_max)


def nvfp4_global_scale(amax: jax.Array) -> jax.Array:
    """NVFP4's global scale ``S = (6 · 448) / amax``; 1 when ``amax == 0``; float32 max when the
    quotient overflows. Float32 ``()``."""
    return _scale_from(amax, NVFP4_GLOBAL_Q)


def _significand_exponent(value: float) -> tuple[int, int]:
    """``value = M · 2^(e-23)`` with integer ``M`` in ``[2^23, 2^24)`` (a float32 constant)."""
    frac, exp = math.frexp(value)  # value = frac · 2^exp, frac in [0.5, 1)
    m = frac * 2**24
    if m != int(m) or np.float32(value) != value:
        raise ValueError(f"{value} is not a float32")
    return int(m), exp - 1


def mxfp8_exponent(amax_b: jax.Array, q_max: float) -> jax.Array:
    """The MXFP8 block exponent ``e = ceil(log2(amax_b / Q))`` of the exact real quotient,
    clamped to ``[-127, 127]``, as int32 (the E8M0 byte is ``e + 127``).

    An all-zero block gives -127 (the smallest scale, byte 0); an infinite amax clamps to 127;
    a NaN amax gives 128 (byte 0xFF, E8M0's NaN).

    Computed on the significands, without rounding: with ``amax_b = Ma · 2^(ea-23)`` and
    ``Q = Mq · 2^(eq-23)``, ``amax_b / Q = (Ma / Mq) · 2^(ea-eq)`` with ``Ma / Mq`` in
    ``(1/2, 2)``, so ``e = ea - eq + (Ma > Mq)``.
    """
    amax_b = jnp.asarray(amax_b, jnp.float32)
    mq, eq = _significand_exponent(float(q_max))
    _, ma, ea = ieee.split(amax_b)
    e = ea - eq + (ma > mq).astype(jnp.int32)
    e = jnp.clip(e, -127, 127)
    e = jnp.where(ieee.is_zero(amax_b), -127, e)
    e = jnp.where(jnp.isinf(amax_b), 127, e)
    return jnp.where(jnp.isnan(amax_b), 128, e).astype(jnp.int32)


# ---------------------------------------------------------------------------------------------
# The quantizers.


def _as_amax(value, what: str) -> jax.Array:
    a = jnp.asarray(value, jnp.float32)
    if a.shape not in ((), (1,)):
        raise ValueError(f"te_jax.quantize: {what} must have shape () or (1,), got {a.shape}")
    return a.reshape(())


def _tensor_scaled(y32, quantizer: Quantizer, scale, amax_, n_feature_axes, dq_dtype):
    lay = quantizer.q_layout
    q = formats.saturating_cast(ieee.mul(y32, scale), quantizer.q_dtype)
    scale_inv = ieee.div(np.float32(1.0), scale)
    colwise = None
    if lay.has_colwise:
        colwise = jnp.transpose(q, colwise_perm(q.ndim, n_feature_axes))
    return ScaledTensor(
        data=q if lay.has_rowwise else None,
        scale_inv=scale_inv,
        colwise_data=colwise,
        colwise_scale_inv=scale_inv if lay.has_colwise else None,
        amax=amax_,
        scaling_mode=quantizer.scaling_mode,
        q_layout=lay,
        dq_dtype=dq_dtype,
        n_feature_axes=n_feature_axes,
    )


def _mxfp8_direction(y32, q_dtype, axis):
    """One direction of MXFP8: ``(data, scale_inv)`` with blocks along ``axis``."""
    blocks = split_blocks(y32, axis, 32)
    e = mxfp8_exponent(ieee.abs_max(blocks, axis=axis + 1), formats.q_max(q_dtype))
    e_b = jnp.expand_dims(e, axis + 1)
    scaled = ieee.ldexp(blocks, -e_b)  # y · 2^-e, exact (2^-e alone may be subnormal)
    scaled = jnp.where(e_b == 128, jnp.float32(jnp.nan), scaled)  # NaN block: NaN data
    q = formats.saturating_cast(scaled, q_dtype).reshape(y32.shape)
    scale_inv = lax.bitcast_convert_type((e + 127).astype(jnp.uint8), formats.E8M0)
    return q, scale_inv


def _nvfp4_direction(y32, y_s, global_scale, axis):
    """One direction of NVFP4: ``(data, block_scale)`` with blocks of 16 along ``axis``;
    ``y_s`` is ``y · S``, shared by both directions."""
    amax_b = ieee.abs_max(split_blocks(y32, axis, 16), axis=axis + 1)
    block_scale = formats.saturating_cast(
        ieee.mul(ieee.div_by_int(amax_b, 6), global_scale), formats.E4M3
    )
    bs = jnp.expand_dims(formats.to_float32(block_scale), axis + 1)  # E4M3 values are normal
    # A native division (not a multiplication by 1/bs: see ieee.true_divide) is exact here: bs
    # is a normal float32 (or 0, masked below); an operand or result below 2^-126 is at most
    # 2^-117 in magnitude and becomes a signed zero in E2M1 whether or not the backend flushes.
    scaled = ieee.true_divide(split_blocks(y_s, axis, 16), bs)
    q = jnp.where(bs == 0, jnp.float32(0.0), scaled)
    return formats.saturating_cast(q, formats.E2M1).reshape(y32.shape), block_scale


def _block_scaled(y32, quantizer: Quantizer, amax_, n_feature_axes, dq_dtype):
    lay, mode = quantizer.q_layout, quantizer.scaling_mode
    fields = {}
    if mode is ScalingMode.MXFP8_1D_SCALING:
        direction = lambda axis: _mxfp8_direction(y32, quantizer.q_dtype, axis)
    else:
        global_scale = nvfp4_global_scale(amax_)
        fields = {"amax": amax_, "global_scale_inv": ieee.div(np.float32(1.0), global_scale)}
        y_s = ieee.mul(y32, global_scale)
        direction = lambda axis: _nvfp4_direction(y32, y_s, global_scale, axis)
    if lay.has_rowwise:
        fields["data"], fields["scale_inv"] = direction(block_axis(y32.ndim, n_feature_axes, False))
    if lay.has_colwise:
        axis = block_axis(y32.ndim, n_feature_axes, True)
        fields["colwise_data"], fields["colwise_scale_inv"] = direction(axis)
    return ScaledTensor(
        **fields, scaling_mode=mode, q_layout=lay, dq_dtype=dq_dtype, n_feature_axes=n_feature_axes
    )


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
    mode = quantizer.scaling_mode
    if mode is ScalingMode.MXFP8_1D_SCALING:
        raise ValueError(
            "te_jax.quantize_from_amax: MXFP8 scales each block by its own amax; there is no "
            "tensor amax to pass (use quantize)"
        )
    amax_ = _as_amax(amax, "amax")
    return _quantize(y, quantizer, amax_, n_feature_axes)


def quantize(y: jax.Array, quantizer: Quantizer, *, n_feature_axes: int = 1) -> ScaledTensor:
    """Quantizes ``y`` as ``quantizer`` says (SPEC.md §4; formulas in the module doc).

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
    amax_ = None
    if quantizer.scaling_mode is not ScalingMode.MXFP8_1D_SCALING:
        amax_ = amax(y)
    return _quantize(y, quantizer, amax_, n_feature_axes)


def _quantize(y, quantizer, amax_, n_feature_axes) -> ScaledTensor:
    y32 = formats.to_float32(y)
    dq_dtype = y.dtype
    mode = quantizer.scaling_mode
    if mode.is_block_scaling:
        return _block_scaled(y32, quantizer, amax_, n_feature_axes, dq_dtype)
    if isinstance(quantizer, DelayedScaleQuantizer):
        scale = jnp.asarray(quantizer.scale, jnp.float32)
        if scale.shape not in ((), (1,)):
            raise ValueError(
                "te_jax.quantize: DelayedScaleQuantizer.scale must have shape () or (1,), got "
                f"{scale.shape} (quantize with a stack of quantizers under jax.vmap)"
            )
        scale = scale.reshape(())
    else:
        scale = current_scale(amax_, quantizer.q_max)
    return _tensor_scaled(y32, quantizer, scale, amax_, n_feature_axes, dq_dtype)


def quantize_with_scale(
    y: jax.Array,
    scaling_mode: ScalingMode,
    q_layout,
    q_dtype,
    scale: jax.Array | None = None,
    *,
    n_feature_axes: int = 1,
) -> ScaledTensor:
    """``quantize`` from a bare configuration instead of a quantizer (for primitive rules).

    ``scale`` (float32 ``()`` or ``(1,)``) is DELAYED's scale and is ignored by the other
    modes, which derive their scales from ``y``.
    """
    mode = ScalingMode(scaling_mode)
    if mode is ScalingMode.DELAYED_TENSOR_SCALING:
        if scale is None:
            raise ValueError("te_jax.quantize_with_scale: DELAYED_TENSOR_SCALING needs a scale")
        quantizer: Quantizer = DelayedScaleQuantizer(
            q_dtype=q_dtype,
            q_layout=q_layout,
            scale=scale,
            amax_history=jnp.zeros((1,), jnp.float32),  # not used by quantize
        )
    else:
        quantizer = _STATELESS[mode](q_dtype=q_dtype, q_layout=q_layout)
    return quantize(y, quantizer, n_feature_axes=n_feature_axes)


_STATELESS = {
    ScalingMode.CURRENT_TENSOR_SCALING: CurrentScaleQuantizer,
    ScalingMode.MXFP8_1D_SCALING: MXFP8Quantizer,
    ScalingMode.NVFP4_1D_SCALING: NVFP4Quantizer,
}
