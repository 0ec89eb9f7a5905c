"""The quantized number formats (docs/numerics.md §3).

| dtype            | Q (max finite) | used by                                  |
|------------------|----------------|------------------------------------------|
| float8_e4m3fn    | 448            | delayed, current, MXFP8 data; NVFP4 scales |
| float8_e5m2      | 57344          | delayed, current, MXFP8 data             |
| float4_e2m1fn    | 6              | NVFP4 data                               |
| float8_e8m0fnu   | 2^127          | MXFP8 scales (a biased power of two)     |

Which mode takes which is said by the modes themselves (``ScalingMode.X.impl.q_dtypes``);
``ALLOWED_Q_DTYPES`` and ``DEFAULT_Q_DTYPE`` are views of that.

Casts to these formats round to nearest, ties to even, and saturate: ``saturating_cast`` clips to
``±Q`` first, because the plain conversion (XLA's and ml_dtypes') overflows E4M3 to NaN and E5M2
to inf.

``to_float32`` widens any of these (and bfloat16, float16) to float32 from the bits. A plain
``astype(float32)`` is not safe after a narrowing cast in the same program: XLA:GPU's default
``--xla_allow_excess_precision`` removes the pair ``convert(convert(x, narrow), float32)``, so
``quantize`` then ``dequantize`` in one ``jit`` would silently skip the rounding.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = [
    "E4M3",
    "E5M2",
    "E2M1",
    "E8M0",
    "Q_MAX",
    "ALLOWED_Q_DTYPES",  # noqa: F822 -- module __getattr__
    "DEFAULT_Q_DTYPE",  # noqa: F822 -- module __getattr__
    "q_max",
    "normalize_q_dtype",
    "saturating_cast",
    "to_float32",
]

E4M3 = np.dtype(jnp.float8_e4m3fn)
E5M2 = np.dtype(jnp.float8_e5m2)
E2M1 = np.dtype(jnp.float4_e2m1fn)
E8M0 = np.dtype(jnp.float8_e8m0fnu)

Q_MAX: dict[np.dtype, float] = {E4M3: 448.0, E5M2: 57344.0, E2M1: 6.0}


def q_max(q_dtype) -> float:
    """The largest finite value ``Q`` of a quantized format."""
    dt = np.dtype(q_dtype)
    if dt not in Q_MAX:
        raise ValueError(f"{dt.name} is not a quantized data format; known: {_names(Q_MAX)}")
    return Q_MAX[dt]


def __getattr__(name: str):
    # The per-mode dtype tables, derived from the mode descriptions (imported here, on first
    # use, because the descriptions are built on this module).
    if name in ("ALLOWED_Q_DTYPES", "DEFAULT_Q_DTYPE"):
        from te_jax.quantize.scaling_modes import ScalingMode  # noqa: PLC0415

        allowed = {m: m.impl.q_dtypes for m in ScalingMode if m.impl.q_dtypes}
        if name == "ALLOWED_Q_DTYPES":
            return allowed
        return {m: dtypes[0] for m, dtypes in allowed.items()}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def normalize_q_dtype(q_dtype, mode, what: str = "q_dtype") -> np.dtype:
    """``q_dtype`` (a jnp/np dtype, scalar type or name) as an ``np.dtype`` allowed by ``mode``.

    Raises:
      ValueError: naming the dtype given and the ones ``mode`` allows.
    """
    allowed = mode.impl.q_dtypes
    try:
        dt = np.dtype(q_dtype)
    except TypeError:
        dt = None
    if dt not in allowed:
        raise ValueError(
            f"{what}={q_dtype!r} is not supported by {mode.name}; allowed: {_names(allowed)}"
        )
    return dt


def saturating_cast(v: jax.Array, q_dtype) -> jax.Array:
    """``v`` (float32) cast to ``q_dtype`` with round-to-nearest-even and saturation.

    Finite values beyond ``±Q`` (and ±inf) become ``±Q``; NaN stays NaN for the FP8 formats
    (``clip`` propagates NaN, and both E4M3 and E5M2 have a NaN). E2M1 has no NaN: a NaN input
    comes out as a zero (of unspecified sign), which NVFP4 never feeds it since its scales are
    finite for finite inputs.

    XLA's float32 -> FP8/FP4 conversion rounds to nearest even, ties included, bit-identical to
    ml_dtypes over every representable value, every midpoint and its float32 neighbours (checked
    in the tests); subnormal float32 inputs become a zero of the same sign in each format.
    """
    q = q_max(q_dtype)
    return jnp.clip(v, -q, q).astype(q_dtype)


# dtype -> (exponent bits, mantissa bits, specials, unsigned type of the same width). Specials:
# "ieee" = all-ones exponent is inf (mantissa 0) or NaN; "fn" = only all-ones is NaN (E4M3);
# None = every code is finite (E2M1).
_LAYOUTS: dict[np.dtype, tuple[int, int, str | None, type]] = {
    np.dtype(jnp.float16): (5, 10, "ieee", jnp.uint16),
    E5M2: (5, 2, "ieee", jnp.uint8),
    E4M3: (4, 3, "fn", jnp.uint8),
    E2M1: (2, 1, None, jnp.uint4),
}


def to_float32(a: jax.Array) -> jax.Array:
    """``a`` (bfloat16, float16, E4M3, E5M2 or E2M1) as float32, exactly, decoded from
    its bits with integer ops so that no compiler pass can fuse it with the cast that produced
    ``a`` (see the module doc); NaN stays NaN, signed zeros keep their sign.

    A code with exponent field ``e``, mantissa ``m`` (``M`` bits) and bias ``b`` is
    ``±(e ? 2^M + m : m) · 2^(max(e, 1) - b - M)``: an integer below 2^11 times a normal
    power of two, so the one float multiplication is exact under any denormal mode.
    float32 passes through; float64 is rounded to float32 (``astype``).
    """
    a = jnp.asarray(a)
    dt = np.dtype(a.dtype)
    if dt == np.float32:
        return a
    if dt == np.float64:  # narrowing: one rounding, nothing for a compiler to drop
        return a.astype(jnp.float32)
    if dt != np.dtype(jnp.bfloat16) and dt not in _LAYOUTS:
        raise TypeError(f"to_float32: unsupported dtype {dt.name}")
    return _decode(a)


@jax.jit
def _decode(a: jax.Array) -> jax.Array:
    """``to_float32``'s decoding, traced once per dtype and shape: called eagerly it is one
    program, not a dozen small ones; inside a traced function XLA inlines it (the same
    compiled program)."""
    dt = np.dtype(a.dtype)
    if dt == np.dtype(jnp.bfloat16):  # the top half of a float32
        u = lax.bitcast_convert_type(a, jnp.uint16).astype(jnp.uint32) << 16
        return lax.bitcast_convert_type(u, jnp.float32)
    e_bits, m_bits, specials, unsigned = _LAYOUTS[dt]
    bias = (1 << (e_bits - 1)) - 1
    u = lax.bitcast_convert_type(a, unsigned).astype(jnp.uint32)
    sign = (u >> (e_bits + m_bits)) << 31
    e = ((u >> m_bits) & ((1 << e_bits) - 1)).astype(jnp.int32)
    m = (u & ((1 << m_bits) - 1)).astype(jnp.int32)
    sig = jnp.where(e == 0, m, m | (1 << m_bits))
    pow2 = lax.bitcast_convert_type(
        ((jnp.maximum(e, 1) - bias - m_bits + 127) << 23).astype(jnp.uint32), jnp.float32
    )
    mag = sig.astype(jnp.float32) * pow2
    e_max = (1 << e_bits) - 1
    if specials == "ieee":
        mag = jnp.where(e == e_max, jnp.where(m == 0, jnp.float32(np.inf), jnp.nan), mag)
    elif specials == "fn":
        mag = jnp.where((e == e_max) & (m == (1 << m_bits) - 1), jnp.float32(jnp.nan), mag)
    return lax.bitcast_convert_type(lax.bitcast_convert_type(mag, jnp.uint32) | sign, jnp.float32)


def _names(dtypes) -> str:
    return ", ".join(np.dtype(d).name for d in dtypes)
