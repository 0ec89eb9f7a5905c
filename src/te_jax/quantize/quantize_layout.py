"""Quantize layouts: which quantized copies an op writes (docs/numerics.md §5).

The enum values are the ``quantize_layout`` attribute of the FFI targets, so they must not be
renumbered.
"""

from __future__ import annotations

from te_jax._enum import NamedIntEnum

__all__ = ["QuantizeLayout"]


class QuantizeLayout(NamedIntEnum):
    """Which quantized copies an op writes (docs/numerics.md §5); the value is the FFI
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
