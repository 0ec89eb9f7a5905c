"""LayerNorm and RMSNorm over the last axis: the norm in front of an MLP's first GEMM.

``layernorm``: ``y = (x - mean(x)) / sqrt(var(x) + eps) · γ + β``
``rmsnorm``:   ``y = x / sqrt(mean(x²) + eps) · γ``

with the statistics over the last axis computed in float32 (``var`` as the mean of the squared
deviations, not ``E[x²] - E[x]²``) and ``y`` rounded once to x's dtype. With
``zero_centered_gamma`` the stored parameter is ``γ - 1`` (initialised to zeros), so weight decay
pulls the norm towards the identity scale rather than towards zero.

Pure JAX (docs/numerics.md §9), differentiated by a rule of its own: the forward keeps the
per-row statistics (``mean``, ``rstd = 1 / sqrt(var + eps)``, float32) and the backward
recomputes ``x̂ = (x - mean) · rstd`` from x, so XLA reads x and dy and writes dx, dγ, dβ without
a float32 copy of ``x̂`` or ``dy · x̂`` in between. The tangent is a ``custom_linear`` (forward
mode evaluates it, reverse mode runs its transpose, the backward)::

    ẋ̂ = rstd · (ẋc - x̂ · mean(x̂ · ẋc)),  ẋc = ẋ - mean(ẋ)  (rmsnorm: ẋc = ẋ)
    ẏ = ẋ̂ · g + x̂ · ġ + β̇,                 g = γ (or 1 + γ)
    backward: u = dy · g,  dx = rstd · (u - mean(u) - x̂ · mean(x̂ · u))  (rmsnorm: no mean(u)),
              dγ = Σ_rows dy · x̂,  dβ = Σ_rows dy
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero

from te_jax.primitives.custom_linear import LinearRule, custom_linear

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
    cfg = _Norm(kind == "layernorm", zero_centered_gamma, float(epsilon))
    beta = None if beta is None else jnp.asarray(beta)
    return _norm(jnp.asarray(x), jnp.asarray(gamma), beta, cfg)


@dataclasses.dataclass(frozen=True)
class _Norm:
    """The static part of one call."""

    centered: bool  # layernorm (subtract the mean); rmsnorm otherwise
    zero_centered_gamma: bool
    epsilon: float


def _statistics(x, cfg: _Norm):
    """``(x32 - mean, mean or None, rstd)``: float32, the statistics ``(..., 1)``."""
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32, axis=-1, keepdims=True) if cfg.centered else None
    xc = x32 - mean if cfg.centered else x32
    rstd = jax.lax.rsqrt(jnp.mean(jnp.square(xc), axis=-1, keepdims=True) + cfg.epsilon)
    return xc, mean, rstd


def _scale(gamma, cfg: _Norm):
    g = gamma.astype(jnp.float32)
    return 1.0 + g if cfg.zero_centered_gamma else g


@functools.partial(jax.custom_jvp, nondiff_argnums=(3,))
def _norm(x, gamma, beta, cfg: _Norm):
    return _forward(x, gamma, beta, cfg)


def _forward(x, gamma, beta, cfg: _Norm, stats=None):
    """``y`` in x's dtype, from ``_statistics(x, cfg)`` (computed here unless given)."""
    xc, _, rstd = _statistics(x, cfg) if stats is None else stats
    y = xc * rstd * _scale(gamma, cfg)
    if beta is not None:
        y = y + beta.astype(jnp.float32)
    return y.astype(x.dtype)


@functools.partial(_norm.defjvp, symbolic_zeros=True)
def _norm_jvp(cfg: _Norm, primals, tangents):
    x, gamma, beta = primals
    stats = _statistics(x, cfg)
    y = _forward(x, gamma, beta, cfg, stats)
    present = tuple(t is not None and not isinstance(t, SymbolicZero) for t in tangents)
    if not any(present):
        return y, jnp.zeros_like(y)
    _, mean, rstd = stats
    # The statistics as computed values: without the barrier XLA recomputes them inside each
    # backward fusion, which then cannot join dγ's column reduction (a float32 dy·x̂ in memory).
    stats = jax.lax.optimization_barrier(tuple(s for s in (rstd, mean) if s is not None))
    res = (x, stats[0], gamma, *stats[1:])
    beta_dtype = None if beta is None else beta.dtype
    rule = LinearRule(_tangent, _backward, (cfg, present, beta_dtype))
    (y_dot,) = custom_linear(rule, res, [t for t, p in zip(tangents, present, strict=True) if p])
    return y, y_dot


def _xhat(res, cfg: _Norm):
    """``x̂ = (x - mean) · rstd`` from the residuals, float32."""
    x, rstd = res[0], res[1]
    x32 = x.astype(jnp.float32)
    return (x32 - res[3] if cfg.centered else x32) * rstd


def _row_mean(a):
    return jnp.mean(a, axis=-1, keepdims=True)


def _tangent(static, res, tangents):
    """``ẏ`` (module docstring), in x's dtype."""
    cfg, present, _ = static
    x, rstd, gamma = res[:3]
    it = iter(tangents)
    x_dot, g_dot, b_dot = (next(it) if p else None for p in present)
    xhat = _xhat(res, cfg)
    y_dot = jnp.zeros(x.shape, jnp.float32)
    if x_dot is not None:
        xc_dot = x_dot.astype(jnp.float32)
        if cfg.centered:
            xc_dot = xc_dot - _row_mean(xc_dot)
        xhat_dot = rstd * (xc_dot - xhat * _row_mean(xhat * xc_dot))
        y_dot = y_dot + xhat_dot * _scale(gamma, cfg)
    if g_dot is not None:
        y_dot = y_dot + xhat * g_dot.astype(jnp.float32)
    if b_dot is not None:
        y_dot = y_dot + b_dot.astype(jnp.float32)
    return (y_dot.astype(x.dtype),)


def _backward(static, res, cotangents):
    """``(dx, dγ, dβ)`` of the present tangents (module docstring), each in its input's dtype."""
    cfg, present, beta_dtype = static
    x, rstd, gamma = res[:3]
    (dy,) = cotangents
    dy32 = dy.astype(jnp.float32)
    xhat = _xhat(res, cfg)
    rows = tuple(range(x.ndim - 1))
    out = []
    if present[0]:
        u = dy32 * _scale(gamma, cfg)
        du = u - _row_mean(u) if cfg.centered else u
        out.append((rstd * (du - xhat * _row_mean(xhat * u))).astype(x.dtype))
    if present[1]:
        out.append(jnp.sum(dy32 * xhat, axis=rows).astype(gamma.dtype))
    if present[2]:
        out.append(jnp.sum(dy32, axis=rows).astype(beta_dtype))
    return tuple(out)
