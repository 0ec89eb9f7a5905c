"""LayerNorm and RMSNorm over the last axis: the norm in front of an MLP's first GEMM.

``layernorm``: ``y = (x - mean(x)) / sqrt(var(x) + eps) · γ + β``
``rmsnorm``:   ``y = x / sqrt(mean(x²) + eps) · γ``

with the statistics over the last axis computed in float32 (``var`` as the mean of the squared
deviations, not ``E[x²] - E[x]²``) and ``y`` rounded once to x's dtype. With
``zero_centered_gamma`` the stored parameter is ``γ - 1`` (initialised to zeros), so weight decay
pulls the norm towards the identity scale rather than towards zero.

Pure JAX: XLA fuses the statistics and the scale into one or two passes over x.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["NORM_TYPES", "layernorm", "check_norm_type"]

NORM_TYPES = ("layernorm", "rmsnorm")


def check_norm_type(where: str, layernorm_type: str) -> str:
    """``layernorm_type`` lower-cased, or a ValueError naming the allowed ones."""
    name = layernorm_type.lower() if isinstance(layernorm_type, str) else layernorm_type
    if name not in NORM_TYPES:
        raise ValueError(
            f"{where}: layernorm_type must be one of {', '.join(map(repr, NORM_TYPES))}, "
            f"got {layernorm_type!r}"
        )
    return name


def layernorm(
    x: jax.Array,
    gamma: jax.Array,
    beta: jax.Array | None = None,
    *,
    layernorm_type: str = "layernorm",
    zero_centered_gamma: bool = False,
    epsilon: float = 1e-6,
) -> jax.Array:
    """Normalize ``x (..., H)`` over its last axis (see the module docstring for the math).

    Args:
      x: ``(..., H)`` float array; the result has its dtype.
      gamma: ``(H,)`` scale (``γ - 1`` when ``zero_centered_gamma``).
      beta: ``(H,)`` shift for ``"layernorm"``; must be ``None`` for ``"rmsnorm"``.
      layernorm_type: ``"layernorm"`` or ``"rmsnorm"``.
      zero_centered_gamma: the scale applied is ``1 + gamma``.
      epsilon: added to the variance (mean square) before the square root.

    Returns:
      ``(..., H)`` in x's dtype.
    """
    where = "te_jax.layernorm"
    kind = check_norm_type(where, layernorm_type)
    if not jnp.issubdtype(jnp.result_type(x), jnp.floating):
        raise TypeError(
            f"{where}: x must be a float array, got {jnp.dtype(jnp.result_type(x)).name}"
        )
    if jnp.ndim(x) == 0:
        raise ValueError(f"{where}: x must have a feature axis (..., H), got a scalar")
    h = jnp.shape(x)[-1]
    if jnp.shape(gamma) != (h,):
        raise ValueError(
            f"{where}: gamma must be ({h},) for x of shape {jnp.shape(x)}, got {jnp.shape(gamma)}"
        )
    if kind == "rmsnorm" and beta is not None:
        raise ValueError(f"{where}: rmsnorm has no beta (got one of shape {jnp.shape(beta)})")
    if beta is not None and jnp.shape(beta) != (h,):
        raise ValueError(f"{where}: beta must be ({h},), got {jnp.shape(beta)}")
    x32 = jnp.asarray(x).astype(jnp.float32)
    if kind == "layernorm":
        x32 = x32 - jnp.mean(x32, axis=-1, keepdims=True)
    y = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + epsilon)
    scale = jnp.asarray(gamma).astype(jnp.float32)
    y = y * (1.0 + scale if zero_centered_gamma else scale)
    if beta is not None:
        y = y + jnp.asarray(beta).astype(jnp.float32)
    return y.astype(jnp.result_type(x))
