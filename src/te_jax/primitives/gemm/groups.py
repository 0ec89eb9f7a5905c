"""The GEMM's operands with several contraction or feature axes.

``bind_gemm(..., k_ndim, n_ndim)`` takes the contraction ``K`` and the output's columns ``N``
as groups of axes, e.g. a gated kernel ``(H, 2, I)`` as ``K = (H,)``, ``N = (2, I)``:

    lhs   (batch..., M, *Kd)   or, lhs_trans,  (batch..., *Kd, M)
    rhs   ([batch...], *Kd, *F) or, rhs_trans, ([batch...], *F, *Kd)
    out   (batch..., M, *F);  bias, dbias  F;  aux, addend  out's shape

The local computation folds each group into one axis (a free reshape of a contiguous array)
and runs the one-K, one-N GEMM; the shapes the partitioner sees keep the groups, so a mesh axis
can split ``I`` in ``(2, I)`` (each shard holding both halves of its columns) where a folded
``2·I`` axis could only be split into halves.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

from te_jax.primitives.gemm.config import GemmConfig

__all__ = ["Groups", "groups", "arrange", "grouped", "rhs_kd"]


class Groups(NamedTuple):
    batch: tuple[int, ...]
    m: int
    kd: tuple[int, ...]  # the contraction axes
    f: tuple[int, ...]  # the output's feature axes
    shared_rhs: bool  # rhs without lhs's batch axes

    @property
    def k(self) -> int:
        return math.prod(self.kd)

    @property
    def n(self) -> int:
        return math.prod(self.f)


def groups(lhs_shape, rhs_shape, lhs_trans: bool, rhs_trans: bool, k_ndim: int, n_ndim: int):
    """The groups of ``lhs_shape`` / ``rhs_shape`` (no checking: see ``checks.check_groups``)."""
    lhs_shape, rhs_shape = tuple(lhs_shape), tuple(rhs_shape)
    nb = len(lhs_shape) - 1 - k_ndim
    batch = lhs_shape[:nb]
    if lhs_trans:
        kd, m = lhs_shape[nb : nb + k_ndim], lhs_shape[-1]
    else:
        m, kd = lhs_shape[nb], lhs_shape[nb + 1 :]
    core = rhs_shape[len(rhs_shape) - k_ndim - n_ndim :]
    f = core[:n_ndim] if rhs_trans else core[k_ndim:]
    return Groups(batch, m, kd, f, len(rhs_shape) == k_ndim + n_ndim)


def arrange(batch, m, kd, f, lhs_trans: bool, rhs_trans: bool, shared_rhs: bool):
    """``(lhs, rhs, out)`` as lists of per-axis entries (sizes, Shardy factor names or
    PartitionSpec entries) from the groups': the inverse of ``groups``."""
    batch, kd, f = list(batch), list(kd), list(f)
    lhs = batch + (kd + [m] if lhs_trans else [m] + kd)
    rhs = ([] if shared_rhs else batch) + (f + kd if rhs_trans else kd + f)
    return lhs, rhs, batch + [m] + f


def rhs_kd(rhs_shape, rhs_trans: bool, k_ndim: int, n_ndim: int) -> tuple[int, ...]:
    """rhs's contraction axes."""
    core = tuple(rhs_shape)[len(rhs_shape) - k_ndim - n_ndim :]
    return core[n_ndim:] if rhs_trans else core[:k_ndim]


def grouped(fn: Callable) -> Callable:
    """``fn(lhs, rhs, bias, aux, lhs_si, rhs_si, addend, config)`` (the one-K, one-N GEMM) on
    grouped operands: folds the groups, runs ``fn`` with ``config.flat``, and gives its results
    their groups back."""

    def run(lhs, rhs, bias, aux, lhs_si, rhs_si, addend, config: GemmConfig):
        if config.is_flat:
            return fn(lhs, rhs, bias, aux, lhs_si, rhs_si, addend, config)
        lt, rt = config.lhs_trans, config.rhs_trans
        g = groups(lhs.shape, rhs.shape, lt, rt, config.k_ndim, config.n_ndim)
        lhs_shape, rhs_shape, _ = arrange(g.batch, g.m, (g.k,), (g.n,), lt, rt, g.shared_rhs)
        lhs, rhs = lhs.reshape(lhs_shape), rhs.reshape(rhs_shape)
        if bias.ndim == config.n_ndim > 1:  # present (absent is (0,))
            bias = bias.reshape(g.n)
        if config.reads_aux:
            aux = aux.reshape(g.batch + (g.m, g.n))
        if config.addend:
            addend = addend.reshape(g.batch + (g.m, g.n))
        outs = fn(lhs, rhs, bias, aux, lhs_si, rhs_si, addend, config.flat)
        out_shape = g.batch + (g.m,) + g.f
        return [
            o.reshape(want) for o, want in zip(outs, config.results(out_shape, g.f), strict=True)
        ]

    return run
