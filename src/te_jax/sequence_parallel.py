"""Sequence parallelism's edges: the ``length`` axis gathered into, and split again after, the
tensor-parallel region (Megatron-style).

Outside the region the activations ``x (batch, length, hidden)`` are split along ``length`` over
``MeshResource.sp_resource`` (logical axes ``(BATCH, LENGTH, EMBED)``); inside it each shard
needs the whole sequence (``(BATCH, None, EMBED)``). The two functions here move between the two
with the collectives Megatron uses in both directions:

============================ ============================== ==============================
function                     forward                        backward (the gradient)
============================ ============================== ==============================
``gather_sequence``          all-gather along ``length``    reduce-scatter along ``length``
``split_sequence``           reduce-scatter (the            all-gather along ``length``
                             row-parallel GEMM's sum)
============================ ============================== ==============================

Both are the identity where the active Flax logical axis rules do not split ``length``
(``te_jax.sharding.sequence_parallel()``) or ``x`` is not 3-D.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from te_jax.sharding import BATCH, EMBED, LENGTH, logical_constraint, sequence_parallel

__all__ = ["gather_sequence", "split_sequence"]

_WHOLE = (BATCH, None, EMBED)  # (batch, length, hidden), the sequence whole
_SPLIT = (BATCH, LENGTH, EMBED)  # the sequence split over sp_resource


def gather_sequence(x):
    """``x (batch, length, hidden)``, split along ``length`` under sequence parallelism, made
    whole for the tensor-parallel region: an all-gather forward, a reduce-scatter of the
    gradient backward. ``x`` itself otherwise."""
    if jnp.ndim(x) != 3 or not sequence_parallel():
        return x
    return _gather(x)


def split_sequence(x):
    """``x (batch, length, hidden)`` split along ``length`` again after the tensor-parallel
    region: the row-parallel GEMM's sum becomes a reduce-scatter forward, the gradient an
    all-gather backward. ``x`` itself otherwise."""
    if jnp.ndim(x) != 3 or not sequence_parallel():
        return x
    return _split(x)


# Each direction's constraint is the other's in the backward (with_sharding_constraint alone
# would keep the gradient whole, an all-reduce where Megatron's reduce-scatter belongs).
@jax.custom_vjp
def _gather(x):
    return logical_constraint(x, _WHOLE)


@jax.custom_vjp
def _split(x):
    return logical_constraint(x, _SPLIT)


_gather.defvjp(lambda x: (_gather(x), None), lambda _, g: (logical_constraint(g, _SPLIT),))
_split.defvjp(lambda x: (_split(x), None), lambda _, g: (logical_constraint(g, _WHOLE),))
