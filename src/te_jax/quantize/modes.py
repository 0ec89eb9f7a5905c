"""Scaling modes and quantize layouts (SPEC.md §4, §5).

The enum values are the ``scaling_mode`` and ``quantize_layout`` attributes of the FFI targets, so
they must not be renumbered.
"""

from __future__ import annotations

import enum

__all__ = ["ScalingMode", "QuantizeLayout"]


class ScalingMode(enum.IntEnum):
    """How a quantized tensor is scaled (SPEC.md §4); the value is the FFI ``scaling_mode``.

    * ``NO_SCALING``: no quantization (output in the input dtype).
    * ``DELAYED_TENSOR_SCALING``: one float32 scale per tensor, taken from the quantizer's state
      (updated from past amaxes after the step).
    * ``MXFP8_1D_SCALING``: one E8M0 (power-of-two) scale per block of 32 elements.
    * ``CURRENT_TENSOR_SCALING``: one float32 scale per tensor, from this tensor's amax.
    * ``NVFP4_1D_SCALING``: one E4M3 scale per block of 16 elements and a float32 global scale.
    """

    NO_SCALING = 0
    DELAYED_TENSOR_SCALING = 1
    MXFP8_1D_SCALING = 2
    CURRENT_TENSOR_SCALING = 3
    NVFP4_1D_SCALING = 4

    @property
    def is_tensor_scaling(self) -> bool:
        """One float32 scale for the whole tensor (delayed, current)."""
        return self in (ScalingMode.DELAYED_TENSOR_SCALING, ScalingMode.CURRENT_TENSOR_SCALING)

    @property
    def is_block_scaling(self) -> bool:
        """One scale per block of consecutive elements (MXFP8, NVFP4)."""
        return self in (ScalingMode.MXFP8_1D_SCALING, ScalingMode.NVFP4_1D_SCALING)

    @property
    def block_size(self) -> int | None:
        """Elements per scale block: 32 (MXFP8), 16 (NVFP4), ``None`` otherwise."""
        return _BLOCK_SIZE.get(self)

    @property
    def is_two_pass(self) -> bool:
        """Whether quantizing needs the tensor's global amax first (current scaling, NVFP4).

        Under sharding that amax is the max over every shard, so these modes take it from
        outside (``reference.quantize_from_amax``).
        """
        return self in (ScalingMode.CURRENT_TENSOR_SCALING, ScalingMode.NVFP4_1D_SCALING)


_BLOCK_SIZE = {ScalingMode.MXFP8_1D_SCALING: 32, ScalingMode.NVFP4_1D_SCALING: 16}


class QuantizeLayout(enum.IntEnum):
    """Which quantized copies an op writes (SPEC.md §5); the value is the FFI
    ``quantize_layout``.

    Rowwise data has the input's shape, blocks (if any) along the last axis. Colwise data is the
    operand a GEMM contracting over the rows needs: for tensor scaling the transpose of the
    flattened 2-D tensor, for block scaling the input's shape with blocks running down the rows.
    """

    ROWWISE = 0
    COLWISE = 1
    ROWWISE_COLWISE = 2

    @property
    def has_rowwise(self) -> bool:
        return self in (QuantizeLayout.ROWWISE, QuantizeLayout.ROWWISE_COLWISE)

    @property
    def has_colwise(self) -> bool:
        return self in (QuantizeLayout.COLWISE, QuantizeLayout.ROWWISE_COLWISE)
