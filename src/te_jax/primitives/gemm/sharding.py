"""Sharding of the GEMM primitive: its Shardy rule and ``custom_partitioning`` partition.

Factors: the batch axes ``b…``, the rows ``m``, the contraction ``k`` (a reduction factor) and
the columns ``n``. Each shard runs the local GEMM (te_jax's kernel on CUDA, the pure-JAX
product elsewhere: the same partition on every platform) on its block:

* ``b`` / ``m`` split (data parallel): nothing is communicated.
* ``n`` split (column parallel): the bias and dbias are split with it.
* ``k`` split on both operands (row parallel; a wgrad contracting rows split over the data
  axis): each shard's product is a partial sum, all-reduced (``psum``) in the output dtype, or
  reduce-scattered (``psum_scatter``) along ``m`` or ``n`` where the result is wanted split over
  the axes ``k`` is split on (FSDP's weight gradients). The bias is added on the first shard of
  ``k`` only (zeros elsewhere), so once. The GELU / ReLU epilogues are not linear in the
  product and DGELU's dbias sums over rows: for them ``k`` is gathered instead.
* A mesh axis can split one factor only. The activation keeps its split: where the rhs (the
  weight) is split on an axis lhs's batch or rows use (FSDP), the weight is all-gathered along
  it just before the GEMM; the activation is never gathered. Where lhs and rhs split ``k``
  differently, lhs's split is kept and rhs is resharded to it.

dbias (``grad_bias``) is psummed over the axes splitting the rows. An addend is split as the
output is; under a split ``k`` it is added after the reduction (each shard's partial product
is reduced first), so once.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax

from te_jax.primitives import base
from te_jax.primitives.gemm.checks import block_scale_shape
from te_jax.primitives.gemm.config import GemmConfig
from te_jax.primitives.gemm.epilogue import GemmScaleMode
from te_jax.primitives.gemm.groups import arrange, groups

__all__ = ["make_partitioned_gemm"]


def _sharding_rule(config: GemmConfig, operand_types):
    """The Shardy rule: factors ``b…``, ``m``, ``k…`` (reduction factors), ``n…``."""
    lhs, rhs, bias, aux, ls, rs, addend = (t.shape for t in operand_types)
    k_ndim, n_ndim = config.k_ndim, config.n_ndim
    b = [f"b{i}" for i in range(len(lhs) - 1 - k_ndim)]
    k = [f"k{i}" for i in range(k_ndim)]
    n = [f"n{i}" for i in range(n_ndim)]
    shared = len(rhs) == k_ndim + n_ndim
    lhs_f, rhs_f, out = arrange(b, "m", k, n, config.lhs_trans, config.rhs_trans, shared)
    operands = [
        lhs_f,
        rhs_f,
        n if _bias_present(bias, n_ndim) else ["e0"] * len(bias),
        out if config.reads_aux else ["e1"] * len(aux),
        [f"s0_{i}" for i in range(len(ls))],  # a block-scaled operand's scales are 2-D
        [f"s1_{i}" for i in range(len(rs))],
        out if config.addend else ["e2"] * len(addend),
    ]
    results = config.results(out, n)
    rule = (
        ", ".join(" ".join(f) for f in operands) + " -> " + ", ".join(" ".join(f) for f in results)
    )
    return rule, {"reduction_factors": tuple(k)}


def _bias_present(shape, n_ndim: int) -> bool:
    """A bias operand is ``F``-shaped; an absent one is ``(0,)``."""
    return len(shape) == n_ndim and (n_ndim > 1 or shape[0] > 0)


def _entry_axes(entry) -> tuple[str, ...]:
    return base.mesh_axes([entry])


def _partition(config: GemmConfig, local, mesh, arg_shapes, result_shape):
    lhs_trans, rhs_trans = config.lhs_trans, config.rhs_trans
    k_ndim, n_ndim = config.k_ndim, config.n_ndim
    lhs_t, rhs_t = arg_shapes[0], arg_shapes[1]
    # The operands' PartitionSpec entries, grouped as their shapes are (groups.py).
    entries = groups(
        base.spec_of(lhs_t, lhs_t.ndim),
        base.spec_of(rhs_t, rhs_t.ndim),
        lhs_trans,
        rhs_trans,
        k_ndim,
        n_ndim,
    )
    b, m, k, n = list(entries.batch), entries.m, list(entries.kd), list(entries.f)
    nb = len(b)
    used = set(base.mesh_axes(b + [m]))
    n = _free_each(n, used)
    k = _free_each(k, used) if config.is_linear else [None] * k_ndim
    k_axes = base.mesh_axes(k)
    g = groups(lhs_t.shape, rhs_t.shape, lhs_trans, rhs_trans, k_ndim, n_ndim)
    _check_divisible(
        mesh,
        [(f"batch axis {i}", g.batch[i], e) for i, e in enumerate(b)]
        + [("M (rows)", g.m, m)]
        + [(f"K axis {i} (contraction)", g.kd[i], e) for i, e in enumerate(k)]
        + [(f"N axis {i} (columns)", g.f[i], e) for i, e in enumerate(n)],
    )

    # A result wanted split, along m or an n axis, over k's axes: reduce-scatter there.
    results = result_shape if isinstance(result_shape, (list, tuple)) else [result_shape]
    out_spec = b + [m] + n
    wanted = base.spec_of(results[0], len(out_spec))
    scatter = None
    if k_axes:
        for dim in range(nb, len(out_spec)):
            # The wanted split: this dim's own axes (if any), then axes k is split over.
            have, want = _entry_axes(out_spec[dim]), _entry_axes(wanted[dim])
            extra = want[len(have) :]
            if not extra or want[: len(have)] != have or not set(extra) <= set(k_axes):
                continue
            shards = math.prod(mesh.shape[a] for a in want)
            if results[0].shape[dim] % shards == 0:
                scatter = (dim, extra)
                out_spec[dim] = wanted[dim]
                break
    psum_axes = tuple(a for a in k_axes if scatter is None or a not in scatter[1])

    bias_present = _bias_present(arg_shapes[2].shape, n_ndim)
    lhs_spec, rhs_spec, _ = arrange(b, m, k, n, lhs_trans, rhs_trans, entries.shared_rhs)
    arg_specs = [
        lhs_spec,
        rhs_spec,
        n if bias_present else [None] * arg_shapes[2].ndim,
        out_spec if config.reads_aux else [None] * arg_shapes[3].ndim,
        [None] * arg_shapes[4].ndim,
        [None] * arg_shapes[5].ndim,
        out_spec if config.addend else [None] * arg_shapes[6].ndim,
    ]
    arg_shardings = tuple(base.named(mesh, s) for s in arg_specs)

    out_shardings = [base.named(mesh, s) for s in config.results(out_spec, n)]
    row_axes = base.mesh_axes(b + [m])

    # Under a split k the addend joins after the reduction.
    late_addend = bool(k_axes) and config.addend
    local_config = config.replace(addend=False) if late_addend else config

    if config.block_scaled:
        lhs_local = _local_shape(mesh, lhs_t.shape, lhs_spec)
        rhs_local = _local_shape(mesh, rhs_t.shape, rhs_spec)
        block_slices = (
            _block_slice(mesh, config.lhs_scale_mode, lhs_spec, lhs_local),
            _block_slice(mesh, config.rhs_scale_mode, rhs_spec, rhs_local),
        )

    def lower(lhs, rhs, bias, aux, lhs_si, rhs_si, addend):
        if config.block_scaled:  # the scales arrive whole: this shard's blocks
            lhs_si, rhs_si = (f(si) for f, si in zip(block_slices, (lhs_si, rhs_si), strict=True))
        if k_axes and bias_present:
            bias = jnp.where(_first_shard(k_axes), bias, jnp.zeros_like(bias))
        local_addend = jnp.zeros((0,), addend.dtype) if late_addend else addend
        outs = list(local(lhs, rhs, bias, aux, lhs_si, rhs_si, local_addend, local_config))
        if scatter is not None:
            outs[0] = lax.psum_scatter(
                outs[0], scatter[1], scatter_dimension=scatter[0], tiled=True
            )
        if psum_axes:
            outs[0] = lax.psum(outs[0], psum_axes)
        if late_addend:
            total = outs[0].astype(jnp.float32) + addend.astype(jnp.float32)
            outs[0] = total.astype(config.out_dtype)
        if config.grad_bias and row_axes:
            dbias = lax.psum(outs[-1].astype(jnp.float32), row_axes)
            outs[-1] = dbias.astype(config.out_dtype)
        return outs

    return mesh, lower, out_shardings, arg_shardings


def _local_shape(mesh, shape, spec) -> tuple[int, ...]:
    """A shard's shape of an array of ``shape`` split as ``spec``."""
    return tuple(
        size // math.prod(mesh.shape[a] for a in _entry_axes(e))
        for size, e in zip(shape, spec, strict=True)
    )


def _shard_index(mesh, entry):
    """This shard's index along a spec entry's mesh axes (the first axis the most major)."""
    index = 0
    for a in _entry_axes(entry):
        index = index * mesh.shape[a] + lax.axis_index(a)
    return index


def _block_slice(mesh, mode, spec, local):
    """``scale_inv -> this shard's block scales`` for a block-scaled operand stored
    ``(rows, K)``, split as ``spec`` into ``local`` shards: the whole layout (checks.py's
    ``block_scale_shape``) cut at the shard's blocks and re-padded. A split must leave whole
    blocks (128 along K; along the rows too for 128x128 tiles), else ``ValueError``."""
    if mode == GemmScaleMode.TENSOR:
        return lambda si: si
    rows, k = local
    row_entry, k_entry = spec
    for what, size, entry, blocked in (
        ("K (contraction)", k, k_entry, True),
        ("rows", rows, row_entry, mode == GemmScaleMode.BLOCK_2D),
    ):
        if blocked and _entry_axes(entry) and size % 128:
            raise ValueError(
                f"te_jax.gemm: a {mode.name} operand's {what} is split into shards of {size}, "
                "not a multiple of its 128-element blocks: a block would straddle two shards; "
                "split it over fewer devices or use sizes whose shards are multiples of 128"
            )
    want = block_scale_shape(mode, rows, k)

    def cut(si):
        r0 = _shard_index(mesh, row_entry) * rows
        k0 = _shard_index(mesh, k_entry) * k
        kb = -(-k // 128)
        if mode == GemmScaleMode.BLOCK_1D:  # (K blocks, rows)
            starts, sizes = (k0 // 128, r0), (kb, rows)
        else:  # (row tiles, K tiles)
            starts, sizes = (r0 // 128, k0 // 128), (-(-rows // 128), kb)
        piece = lax.dynamic_slice(si, starts, sizes)
        return jnp.pad(piece, ((0, 0), (0, want[1] - sizes[1])))

    return cut


def _free_each(entries, used: set[str]) -> list:
    """Each entry kept where none of its mesh axes is used yet (they are then), else ``None``
    (unsplit)."""
    out = []
    for e in entries:
        axes = set(_entry_axes(e))
        out.append(e if axes and not axes & used else None)
        used |= axes if out[-1] is not None else set()
    return out


def _check_divisible(mesh, dims) -> None:
    """Each split dimension must divide evenly over its mesh axes: a shard of a padded
    dimension would compute on padding (and block-scaled FP8 blocks would straddle it)."""
    for what, size, entry in dims:
        axes = _entry_axes(entry)
        shards = math.prod(mesh.shape[a] for a in axes)
        if axes and size % shards:
            raise ValueError(
                f"te_jax.gemm: the GEMM's {what} has size {size}, which mesh axes {axes} "
                f"({shards} shards) do not divide evenly; shard it over axes whose sizes divide "
                f"it, or pad it"
            )


def _first_shard(axes: tuple[str, ...]):
    """True on the shards whose index along each of ``axes`` is 0."""
    first = True
    for a in axes:
        first = jnp.logical_and(first, lax.axis_index(a) == 0)
    return first


def make_partitioned_gemm(local):
    """``local(lhs, rhs, bias, aux, lhs_scale_inv, rhs_scale_inv, addend, config)`` under
    ``custom_partitioning`` with the rule and partition above; the ``GemmConfig`` is its one
    static argument."""

    def impl(lhs, rhs, bias, aux, ls, rs, addend, config):
        return local(lhs, rhs, bias, aux, ls, rs, addend, config)

    def partition(config, mesh, arg_shapes, result_shape):
        return _partition(config, local, mesh, arg_shapes, result_shape)

    def sharding_rule(config, _mesh, operand_types, _result_types):
        return _sharding_rule(config, operand_types)

    return base.make_partitioned(impl, 7, ("config",), partition, sharding_rule)
