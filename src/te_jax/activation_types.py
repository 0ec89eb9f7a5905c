"""Activation types, their names, and their runtime parameters.

The enum values are the ``act_enum`` attribute of the FFI targets
(``ffi/activation/activations.h``): TransformerEngine's ``NVTE_Activation_Type`` order for 0-11,
te_jax's exact-GELU forms for 12-13.

An activation is named by a tuple of TE's names (``("silu", "linear")``), a single string
(``"swiglu"``; the gated forms have their own names), or the enum itself. Gated activations take
``x`` of shape ``(..., 2, H)``: ``x[..., 0, :]`` feeds the activation, ``x[..., 1, :]`` the linear
half, and the output is ``f(a) * b`` of shape ``(..., H)``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from te_jax._enum import NamedIntEnum

__all__ = [
    "ActivationType",
    "ActivationParams",
    "ClampedSwiGLUParams",
    "ActivationLike",
    "IDENTITY_ACT_ENUM",
]


# The act_enum of the standalone quantize kernels: no activation (ActivationEnum::IDENTITY).
IDENTITY_ACT_ENUM = 99


class ActivationType(NamedIntEnum):
    """The activations of docs/numerics.md §1; the value is the FFI ``act_enum``.

    Each member is declared once, as ``value, components, names``: ``components`` are the
    component functions (TE's tuple form: the activation, and ``"linear"`` or
    ``"clamped_linear"`` for the linear half of a gated one), ``names`` the single-string
    names that select it.

    Non-gated: ``y = f(x)``, ``(..., H) -> (..., H)``; gated: ``y = f(a) · b`` with
    ``a = x[..., 0, :]``, ``b = x[..., 1, :]``, ``(..., 2, H) -> (..., H)``.

    Example:
      >>> from te_jax import ActivationType
      >>> act = ActivationType.parse("swiglu")          # or ("silu", "linear")
      >>> act, act.names, act.is_gated
      (<ActivationType.SWIGLU: 4>, ('silu', 'linear'), True)
      >>> act.output_shape((4, 2, 8)), act.feature_shape((4, 2, 8))
      ((4, 8), (2, 8))
    """

    GELU = 0, ("gelu",), ("gelu",)
    GEGLU = 1, ("gelu", "linear"), ("geglu",)
    GLU = 2, ("sigmoid", "linear"), ("glu",)
    SILU = 3, ("silu",), ("silu",)
    SWIGLU = 4, ("silu", "linear"), ("swiglu",)
    RELU = 5, ("relu",), ("relu",)
    REGLU = 6, ("relu", "linear"), ("reglu",)
    QGELU = 7, ("quick_gelu",), ("quick_gelu", "qgelu")
    QGEGLU = 8, ("quick_gelu", "linear"), ("qgeglu",)
    SRELU = 9, ("squared_relu",), ("squared_relu", "srelu")
    SREGLU = 10, ("squared_relu", "linear"), ("sreglu",)
    CLAMPED_SWIGLU = 11, ("clamped_silu", "clamped_linear"), ("clamped_swiglu",)
    GELU_EXACT = 12, ("gelu_exact",), ("gelu_exact",)
    GEGLU_EXACT = 13, ("gelu_exact", "linear"), ("geglu_exact",)

    def __new__(cls, value: int, components: tuple[str, ...], names: tuple[str, ...]):
        obj = int.__new__(cls, value)
        obj._value_ = value
        obj._components = components
        obj._single_names = names
        return obj

    @property
    def is_gated(self) -> bool:
        """Whether the activation takes an ``(..., 2, H)`` input and multiplies by a linear half."""
        return len(self._components) == 2

    @property
    def act_len(self) -> int:
        """Size of the act axis, and the number of trailing feature axes of ``x``: 2 for gated
        activations (``(2, H)``), 1 otherwise (``(H,)``)."""
        return 2 if self.is_gated else 1

    @property
    def names(self) -> tuple[str, ...]:
        """TE's tuple form, e.g. ``("silu", "linear")``: the component functions."""
        return self._components

    def output_axes(self, x_axes: Sequence) -> list:
        """The per-axis entries of the output ``y`` (and of ``dz``) from those of ``x`` (sizes,
        PartitionSpec entries or sharding factors): gated ``(..., 2, H) -> (..., H)`` drops the
        act axis, non-gated ``(..., H) -> (..., H)`` keeps every axis."""
        x_axes = list(x_axes)
        return x_axes[:-2] + x_axes[-1:] if self.is_gated else x_axes

    def output_shape(self, x_shape: Sequence[int]) -> tuple[int, ...]:
        """The shape of ``act_lu(x)`` (and of ``dz``) for ``x`` of shape ``x_shape``."""
        return tuple(self.output_axes(x_shape))

    def feature_shape(self, x_shape: Sequence[int]) -> tuple[int, ...]:
        """The trailing feature axes of ``x`` (dbias's shape): ``(2, H)`` or ``(H,)``."""
        return tuple(x_shape[len(x_shape) - self.act_len :])

    @classmethod
    def parse(cls, activation_type: ActivationLike) -> ActivationType:
        """Maps a tuple, a name or an enum to an ``ActivationType``.

        Raises:
          ValueError: for an unknown name, or a tuple that starts with ``"linear"``.
          TypeError: for anything that is not a string, a sequence of strings or an enum.
        """
        if isinstance(activation_type, ActivationType):
            return activation_type
        if isinstance(activation_type, str):
            key: str | tuple[str, ...] = activation_type.lower()
        elif isinstance(activation_type, Sequence) and all(
            isinstance(n, str) for n in activation_type
        ):
            key = tuple(n.lower() for n in activation_type)
            if key and key[0] in ("linear", "clamped_linear") and len(key) > 1:
                raise ValueError(
                    f"activation_type {tuple(activation_type)!r} starts with the linear half; "
                    f"gated activations are written (activation, 'linear'), e.g. "
                    f"{(key[1], key[0])!r}"
                )
            if len(key) == 1:
                key = key[0]
        else:
            raise TypeError(
                "activation_type must be a name, a tuple of names or a te_jax.ActivationType, "
                f"got {activation_type!r}"
            )
        found = _BY_TUPLE.get(key) if isinstance(key, tuple) else _BY_NAME.get(key)
        if found is None:
            raise ValueError(
                f"unknown activation_type {activation_type!r}; valid names: "
                f"{', '.join(sorted(_BY_NAME))}; valid tuples: "
                f"{', '.join(repr(a.names) for a in ActivationType)}"
            )
        return found


# Derived from the declarations: a one-element tuple is looked up as its single name.
_BY_TUPLE = {a.names: a for a in ActivationType if a.is_gated}
_BY_NAME: dict[str, ActivationType] = {n: a for a in ActivationType for n in a._single_names}

ActivationLike = ActivationType | str | Sequence[str]


def _as_float(name: str, value) -> float:
    try:
        f = float(value)
    except TypeError as e:  # e.g. a tracer: parameters are static
        raise TypeError(f"{name} must be a Python float (it is static), got {value!r}") from e
    if not math.isfinite(f):
        raise ValueError(f"{name} must be finite, got {f}")
    return f


@dataclasses.dataclass(frozen=True)
class ClampedSwiGLUParams:
    """GPT-OSS clamped SwiGLU parameters.

    ``m = min(a, limit)``; ``y = m·σ(alpha·m) · (clip(b, -limit, limit) + glu_linear_offset)``,
    with ``a = x[..., 0, :]`` and ``b = x[..., 1, :]`` of the gated input ``(..., 2, H)``.

    Example:
      >>> import jax, jax.numpy as jnp, te_jax
      >>> p = te_jax.ClampedSwiGLUParams(limit=7.0, alpha=1.702, glu_linear_offset=1.0)
      >>> x = jnp.array([[8.0, -1.0], [0.5, 9.0]])     # a = [8, -1], b = [0.5, 9]
      >>> y = te_jax.act_lu(x, "clamped_swiglu", act_params=te_jax.ActivationParams(p))
      >>> m, b = jnp.minimum(x[0], 7.0), jnp.clip(x[1], -7.0, 7.0)
      >>> bool(jnp.allclose(y, m * jax.nn.sigmoid(1.702 * m) * (b + 1.0)))
      True
    """

    limit: float = 7.0
    alpha: float = 1.702
    glu_linear_offset: float = 1.0

    def __post_init__(self):
        for field in dataclasses.fields(self):
            object.__setattr__(self, field.name, _as_float(field.name, getattr(self, field.name)))
        if self.limit <= 0:
            raise ValueError(f"ClampedSwiGLUParams.limit must be > 0, got {self.limit}")


@dataclasses.dataclass(frozen=True)
class ActivationParams:
    """Runtime parameters of the parametrised activations. Frozen and hashable (a static arg).

    Attributes:
      clamped_swiglu: ``ClampedSwiGLUParams`` of ``"clamped_swiglu"`` (its defaults when
        ``None``); the other activations take none.

    Example:
      >>> import te_jax
      >>> te_jax.ActivationParams.create("clamped_swiglu", limit=5.0).clamped_swiglu.limit
      5.0
      >>> te_jax.ActivationParams.create("gelu") is None
      True
    """

    clamped_swiglu: ClampedSwiGLUParams | None = None

    @classmethod
    def create(cls, activation_type: ActivationLike, **kwargs) -> ActivationParams | None:
        """``ActivationParams.create("clamped_swiglu", limit=7.0)``; ``None`` for the others."""
        act = ActivationType.parse(activation_type)
        if act is ActivationType.CLAMPED_SWIGLU:
            return cls(clamped_swiglu=ClampedSwiGLUParams(**kwargs))
        if kwargs:
            raise ValueError(f"activation {act.name.lower()} takes no parameters, got {kwargs}")
        return None

    @staticmethod
    def resolve(act: ActivationType, act_params) -> ActivationParams | None:
        """The canonical parameters of ``act``: defaults filled in; ``None`` when it has none.

        Raises ValueError when parameters are given to an activation that has none.
        """
        if isinstance(act_params, ClampedSwiGLUParams):
            act_params = ActivationParams(clamped_swiglu=act_params)
        if act_params is not None and not isinstance(act_params, ActivationParams):
            raise TypeError(
                "act_params must be a te_jax.ActivationParams (or ClampedSwiGLUParams), "
                f"got {type(act_params).__name__}"
            )
        if act is ActivationType.CLAMPED_SWIGLU:
            if act_params is None or act_params.clamped_swiglu is None:
                return ActivationParams(clamped_swiglu=ClampedSwiGLUParams())
            return act_params
        if act_params is not None and act_params.clamped_swiglu is not None:
            raise ValueError(
                f"act_params were given for activation {act.name.lower()} {act.names}, which "
                "takes no parameters (only clamped_swiglu does)"
            )
        return None
