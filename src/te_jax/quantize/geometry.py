"""Where the blocks and the colwise transpose fall in a tensor ``batch + leading + features``.

A tensor is viewed as ``B`` independent flattened 2-D tensors ``[M, N]`` (docs/numerics.md §5):
``batch`` are leading axes added by ``vmap`` (each element its own tensor, with its own scale),
``M = prod(leading)``, ``N = prod(features)``; ``features`` is the last ``n_feature_axes`` axes
(1 for ``act_lu`` outputs and plain tensors, 2 for a gated ``dact`` output ``(..., 2, H)``).
"""

from __future__ import annotations

import dataclasses
import math

import jax

__all__ = ["Geometry", "block_axis", "colwise_perm", "block_scale_shape", "split_blocks"]

Shape = tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Geometry:
    """The axes of one quantized tensor: ``shape = batch + lead + feat``."""

    batch: Shape
    lead: Shape
    feat: Shape

    @classmethod
    def of(cls, shape, n_feature_axes: int, batch_dims: int = 0) -> Geometry:
        """Splits ``shape`` into ``batch_dims`` batch axes, the leading and the feature axes."""
        shape = tuple(shape)
        n_lead_end = len(shape) - n_feature_axes
        return cls(shape[:batch_dims], shape[batch_dims:n_lead_end], shape[n_lead_end:])

    @property
    def b(self) -> int:
        """Number of independent tensors (1 without batch axes)."""
        return math.prod(self.batch)

    @property
    def m(self) -> int:
        """Rows of all the flattened tensors together, ``B · M``."""
        return math.prod(self.batch + self.lead)

    @property
    def n(self) -> int:
        """Columns, ``N``."""
        return math.prod(self.feat)


def block_axis(ndim: int, n_feature_axes: int, colwise: bool) -> int:
    """The axis the blocks run along: the last one (rowwise) or the innermost leading one."""
    return ndim - n_feature_axes - 1 if colwise else ndim - 1


def colwise_perm(ndim: int, n_feature_axes: int) -> tuple[int, ...]:
    """The ``transpose`` permutation from ``leading + features`` to ``features + leading``."""
    n_lead = ndim - n_feature_axes
    return tuple(range(n_lead, ndim)) + tuple(range(n_lead))


def block_scale_shape(shape: Shape, axis: int, block: int) -> Shape:
    """``shape`` with ``axis`` divided by ``block``: one scale per block."""
    shape = tuple(shape)
    return shape[:axis] + (shape[axis] // block,) + shape[axis + 1 :]


def split_blocks(x: jax.Array, axis: int, block: int) -> jax.Array:
    """``x`` with ``axis`` split into ``(size // block, block)``: the block is axis ``axis + 1``."""
    s = x.shape
    return x.reshape(s[:axis] + (s[axis] // block, block) + s[axis + 1 :])
