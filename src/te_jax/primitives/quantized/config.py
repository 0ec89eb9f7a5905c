"""The static parameters of a quantized call: which op (``OpKind``) and how (``QuantConfig``)."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence

import numpy as np

from te_jax.activation_types import ActivationType
from te_jax.quantize.quantize_layout import QuantizeLayout
from te_jax.quantize.scale_math import BlockScaleOptions
from te_jax.quantize.scaling_modes import ScalingMode, ScalingModeImpl

__all__ = ["OpKind", "QuantConfig"]


class OpKind(enum.Enum):
    """The op whose output ``y`` is quantized.

    * ``ACT``: ``x -> act(x)``; ``y`` has ``act.output_shape(x.shape)``, one feature axis.
    * ``QUANTIZE``: ``x -> x`` (the standalone quantize); one feature axis.
    * ``DACT``: ``(dz, x) -> act'(x)·dz`` (with dbias); ``y`` has x's shape and
      ``act.act_len`` feature axes (``(2, H)`` for a gated activation).
    """

    ACT = "act"
    QUANTIZE = "quantize"
    DACT = "dact"

    @property
    def n_operands(self) -> int:
        """Array operands before the per-tensor scale: ``(dz, x)`` for DACT, else ``(x,)``."""
        return 2 if self is OpKind.DACT else 1

    def output_axes(self, act: ActivationType | None, x_axes: Sequence) -> list:
        """The per-axis entries (sizes, PartitionSpec entries, factors) of ``y`` from x's."""
        return act.output_axes(x_axes) if self is OpKind.ACT else list(x_axes)

    def output_shape(self, act: ActivationType | None, x_shape: Sequence[int]) -> tuple:
        """The shape of ``y`` for ``x`` of shape ``x_shape``."""
        return tuple(self.output_axes(act, x_shape))

    def n_feature_axes(self, act: ActivationType | None, cfg: QuantConfig | None = None) -> int:
        """The trailing axes of ``y`` folded into N (docs/numerics.md §5): a dact's
        ``act.act_len``, an activation's 1, the standalone quantize's ``cfg.feature_axes``."""
        if self is OpKind.DACT:
            return act.act_len
        return cfg.feature_axes if self is OpKind.QUANTIZE and cfg is not None else 1


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    """The static part of a quantizer: what the kernels and the shapes depend on.

    ``scale_options`` is the quantizer's ``scale_options`` (blockwise FP8's
    ``BlockScaleOptions``: the FFI attributes ``power_2_scale`` and ``amax_epsilon``), ``None``
    for the modes without options.
    """

    mode: ScalingMode
    layout: QuantizeLayout
    q_dtype: np.dtype
    feature_axes: int = 1  # the standalone quantize's trailing axes folded into N
    scale_options: BlockScaleOptions | None = None

    @classmethod
    def of(cls, quantizer) -> QuantConfig:
        return cls(
            ScalingMode(quantizer.scaling_mode),
            QuantizeLayout(quantizer.q_layout),
            np.dtype(quantizer.q_dtype),
            scale_options=quantizer.scale_options,
        )

    @property
    def spec(self) -> ScalingModeImpl:
        """The scaling mode's description."""
        return self.mode.impl
