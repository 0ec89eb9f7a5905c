"""The scale arithmetic of the quantizing modes, in exact IEEE float32 (docs/numerics.md §4).

``amax`` (the tensor's ``max |y|``), current scaling's ``Q / amax``, NVFP4's global scale
``S = 6·448 / amax``, the MXFP8 block exponent ``ceil(log2(amax_b / Q))`` and the blockwise FP8
block scale (``BlockScaleOptions``, ``fp8_block_scale``). Shared by the scaling-mode descriptions
(``scaling_modes``) and re-exported by ``reference``.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from te_jax.quantize import formats, ieee

__all__ = [
    "amax",
    "current_scale",
    "nvfp4_global_scale",
    "mxfp8_exponent",
    "NVFP4_GLOBAL_Q",
    "BlockScaleOptions",
    "fp8_block_scale",
]

_F32_MAX = np.float32(np.finfo(np.float32).max)
NVFP4_GLOBAL_Q = 6.0 * 448.0  # E2M1 max times E4M3 max: S maps the tensor amax onto it


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


@dataclasses.dataclass(frozen=True)
class BlockScaleOptions:
    """How a blockwise FP8 block scale is chosen (TransformerEngine's ``QParams``): a hashable,
    static part of the blockwise quantizers and of the ops that quantize with them.

    Attributes:
      power_2_scale: round each scale down to a power of two (exact scaling, and
        ``scale_inv = 1 / scale`` exact too).
      amax_epsilon: a floor on each block's amax before ``Q / amax`` (float32; 0 for none).

    Example:
      >>> from te_jax.quantize.scale_math import BlockScaleOptions
      >>> BlockScaleOptions(power_2_scale=False, amax_epsilon=1e-12).amax_epsilon
      1e-12
    """

    power_2_scale: bool = True
    amax_epsilon: float = 0.0

    def __post_init__(self):
        if not isinstance(self.power_2_scale, (bool, np.bool_)):
            raise TypeError(f"power_2_scale must be a bool, got {self.power_2_scale!r}")
        eps = self.amax_epsilon
        if isinstance(eps, bool) or not isinstance(eps, (int, float, np.floating, np.integer)):
            raise TypeError(f"amax_epsilon must be a float, got {eps!r}")
        if not (math.isfinite(float(eps)) and float(eps) >= 0.0):
            raise ValueError(f"amax_epsilon must be a finite float >= 0, got {eps!r}")
        object.__setattr__(self, "power_2_scale", bool(self.power_2_scale))
        object.__setattr__(self, "amax_epsilon", float(eps))


_MANTISSA_OFF = np.uint32(0xFF800000)  # sign and exponent bits of a float32
_SIG_1_75 = 0xE00000  # the significand of 1.75 (448 and 57344, E4M3's and E5M2's largest)


def fp8_block_scale(amax_b: jax.Array, q_max: float, options: BlockScaleOptions) -> jax.Array:
    """Blockwise FP8's scale per block from the block amaxes ``amax_b`` (float32, any shape):

    ``a = max(amax_b, ε)`` (NaN stays NaN); ``scale = RN(Q / a)``, float32 max where that
    overflows; with ``power_2_scale`` the scale's mantissa bits cleared (``2^floor(log2 ·)``);
    ``scale = 1`` where ``a`` is 0, inf or NaN. Float32, ``amax_b``'s shape.
    """
    a = jnp.asarray(amax_b, jnp.float32)
    eps = np.float32(options.amax_epsilon)
    # max(a, eps) on the bit patterns (an amax is +0, positive or +NaN, which order as their
    # bits, NaN above all): a float max reads a subnormal amax as 0 where denormals are zero.
    a_bits, eps_bits = ieee.bits(a), np.uint32(eps.view(np.uint32))
    a = ieee.from_bits(jnp.where(a_bits < eps_bits, eps_bits, a_bits))
    if options.power_2_scale and _significand_exponent(float(q_max))[0] == _SIG_1_75:
        # Q = 1.75 · 2^q (E4M3, E5M2): RN(Q / a) never rounds up to a power of two (the
        # quotient's significand 1.75 / m_a is at most 1.75, or below 1 by more than 2^-24,
        # half an ulp there being 2^-25), so 2^floor(log2 RN(Q / a)) = 2^-e with MXFP8's exact
        # e = ceil(log2(a / Q)); its clamp to [-127, 127] gives the overflow's 2^127. No
        # division.
        e = mxfp8_exponent(a, q_max)
        s = jax.lax.bitcast_convert_type((127 - e) << 23, jnp.float32)
    else:
        s = ieee.div(np.float32(q_max), a)  # a native division is not exact on every backend
        s = jnp.where(jnp.isinf(s), _F32_MAX, s)
        if options.power_2_scale:
            u = jax.lax.bitcast_convert_type(s, jnp.uint32) & _MANTISSA_OFF
            s = jax.lax.bitcast_convert_type(u, jnp.float32)
    degenerate = ieee.is_zero(a) | jnp.isinf(a) | jnp.isnan(a)
    return jnp.where(degenerate, jnp.float32(1.0), s)
