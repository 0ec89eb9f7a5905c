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

    Example:
      >>> import jax.numpy as jnp
      >>> from te_jax.quantize import CurrentScaleQuantizer, QuantizeLayout, quantize
      >>> QuantizeLayout.ROWWISE_COLWISE.has_colwise, QuantizeLayout.COLWISE.has_rowwise
      (True, False)
      >>> st = quantize(jnp.ones((4, 32)), CurrentScaleQuantizer(q_layout=QuantizeLayout.COLWISE))
      >>> st.data is None, st.colwise_data.shape              # (M, N) -> (N, M)
      (True, (32, 4))
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
