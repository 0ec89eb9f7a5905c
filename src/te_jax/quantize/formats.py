"""The quantized number formats (SPEC.md §3) and which scaling mode takes which.

| dtype            | Q (max finite) | used by                                  |
|------------------|----------------|------------------------------------------|
| float8_e4m3fn    | 448            | delayed, current, MXFP8 data; NVFP4 scales |
| float8_e5m2      | 57344          | delayed, current, MXFP8 data             |
| float4_e2m1fn    | 6              | NVFP4 data                               |
| float8_e8m0fnu   | 2^127          | MXFP8 scales (a biased power of two)     |

Casts to these formats round to nearest, ties to even, and saturate: ``saturating_cast`` clips to
``±Q`` first, because the plain conversion (XLA's and ml_dtypes') overflows E4M3 to NaN and E5M2
to inf.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from te_jax.quantize.modes import ScalingMode

__all__ = [
    "E4M3",
    "E5M2",
    "E2M1",
    "E8M0",
    "Q_MAX",
    "ALLOWED_Q_DTYPES",
    "DEFAULT_Q_DTYPE",
    "q_max",
    "normalize_q_dtype",
    "saturating_cast",
]

E4M3 = np.dtype(jnp.float8_e4m3fn)
E5M2 = np.dtype(jnp.float8_e5m2)
E2M1 = np.dtype(jnp.float4_e2m1fn)
E8M0 = np.dtype(jnp.float8_e8m0fnu)

Q_MAX: dict[np.dtype, float] = {E4M3: 448.0, E5M2: 57344.0, E2M1: 6.0}

ALLOWED_Q_DTYPES: dict[ScalingMode, tuple[np.dtype, ...]] = {
    ScalingMode.DELAYED_TENSOR_SCALING: (E4M3, E5M2),
    ScalingMode.CURRENT_TENSOR_SCALING: (E4M3, E5M2),
    ScalingMode.MXFP8_1D_SCALING: (E4M3, E5M2),
    ScalingMode.NVFP4_1D_SCALING: (E2M1,),
}

DEFAULT_Q_DTYPE: dict[ScalingMode, np.dtype] = {
    mode: dtypes[0] for mode, dtypes in ALLOWED_Q_DTYPES.items()
}


def q_max(q_dtype) -> float:
    """The largest finite value ``Q`` of a quantized format."""
    dt = np.dtype(q_dtype)
    if dt not in Q_MAX:
        raise ValueError(f"{dt.name} is not a quantized data format; known: {_names(Q_MAX)}")
    return Q_MAX[dt]


def normalize_q_dtype(q_dtype, mode: ScalingMode, what: str = "q_dtype") -> np.dtype:
    """``q_dtype`` (a jnp/np dtype, scalar type or name) as an ``np.dtype`` allowed by ``mode``.

    Raises:
      ValueError: naming the dtype given and the ones ``mode`` allows.
    """
    allowed = ALLOWED_Q_DTYPES[mode]
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


def _names(dtypes) -> str:
    return ", ".join(np.dtype(d).name for d in dtypes)
