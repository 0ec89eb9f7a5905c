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

dbias (``grad_bias``) is psummed over the axes splitting the rows; ``output_amax`` is the max
over every shard of ``out``.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax

from te_jax.primitives import base
from te_jax.primitives.gemm_epilogue import GemmEpilogue

__all__ = ["make_partitioned_gemm"]

_STATICS = (
    "lhs_trans",
    "rhs_trans",
    "epilogue",
    "out_dtype",
    "grad_bias",
    "output_amax",
    "split_accumulator",
)


def _factors(nb: int, trans: bool, first: str, second: str) -> list[str]:
    return [f"b{i}" for i in range(nb)] + ([second, first] if trans else [first, second])


def _sharding_rule(
    lhs_trans,
    rhs_trans,
    epilogue,
    out_dtype,
    grad_bias,
    output_amax,
    split_accumulator,
    mesh,
    operand_types,
    result_types,
):
    lhs, rhs, bias, aux, ls, rs = (t.shape for t in operand_types)
    nb = len(lhs) - 2
    shared = len(rhs) == 2
    out = _factors(nb, False, "m", "n")
    operands = [
        _factors(nb, lhs_trans, "m", "k"),
        _factors(0 if shared else nb, rhs_trans, "k", "n"),
        ["n"] if bias[0] else ["e0"],
        out if epilogue == GemmEpilogue.DGELU else ["e1"],
        ["s0"] * len(ls),
        ["s1"] * len(rs),
    ]
    results = [out]
    if epilogue == GemmEpilogue.GELU_AUX:
        results.append(out)
    if grad_bias:
        results.append(["n"])
    if output_amax:
        results.append(["a0"])
    # A scalar scale_inv has no factor: its entry is empty.
    rule = (
        ", ".join(" ".join(f) for f in operands) + " -> " + ", ".join(" ".join(f) for f in results)
    )
    return rule, {"reduction_factors": ("k",)}


def _entry_axes(entry) -> tuple[str, ...]:
    return base.mesh_axes([entry])


def _free(entry, used: set[str]):
    """``entry`` if none of its mesh axes is in ``used``, else ``None`` (unsplit)."""
    return entry if entry is not None and not (set(_entry_axes(entry)) & used) else None


def _partition(
    lhs_trans,
    rhs_trans,
    epilogue,
    out_dtype,
    grad_bias,
    output_amax,
    split_accumulator,
    local,
    mesh,
    arg_shapes,
    result_shape,
):
    lhs_t, rhs_t = arg_shapes[0], arg_shapes[1]
    nb = lhs_t.ndim - 2
    shared = rhs_t.ndim == 2
    ls = base.spec_of(lhs_t, lhs_t.ndim)
    rs = base.spec_of(rhs_t, rhs_t.ndim)
    b = ls[:nb]
    m, k = (ls[nb + 1], ls[nb]) if lhs_trans else (ls[nb], ls[nb + 1])
    rk, n = (rs[-1], rs[-2]) if rhs_trans else (rs[-2], rs[-1])
    used = set(base.mesh_axes(b + [m]))
    n = _free(n, used)
    used |= set(_entry_axes(n))
    linear = epilogue == GemmEpilogue.DEFAULT and not grad_bias
    k = _free(k, used) if linear else None
    del rk  # rhs follows lhs's k
    k_axes = _entry_axes(k)
    lhs_shape, rhs_shape = lhs_t.shape, rhs_t.shape
    m_size, k_size = (lhs_shape[-1], lhs_shape[-2]) if lhs_trans else lhs_shape[-2:]
    n_size = rhs_shape[-2] if rhs_trans else rhs_shape[-1]
    _check_divisible(
        mesh,
        [(f"batch axis {i}", lhs_shape[i], e) for i, e in enumerate(b)]
        + [("M (rows)", m_size, m), ("K (contraction)", k_size, k), ("N (columns)", n_size, n)],
    )

    # A result wanted split, along m or n, over k's axes: reduce-scatter there.
    results = result_shape if isinstance(result_shape, (list, tuple)) else [result_shape]
    wanted = base.spec_of(results[0], nb + 2)
    out_spec = b + [m, n]
    scatter = None
    if k_axes:
        for dim in (nb, nb + 1):
            w = wanted[dim]
            size = results[0].shape[dim]
            shards = math.prod(mesh.shape[a] for a in _entry_axes(w)) if w is not None else 1
            if (
                out_spec[dim] is None
                and w is not None
                and set(_entry_axes(w)) <= set(k_axes)
                and size % shards == 0
            ):
                scatter = (dim, _entry_axes(w))
                out_spec[dim] = w
                break
    psum_axes = tuple(a for a in k_axes if scatter is None or a not in scatter[1])

    lhs_spec = b + ([k, m] if lhs_trans else [m, k])
    rhs_spec = ([] if shared else list(b)) + ([n, k] if rhs_trans else [k, n])
    bias_spec = [n] if arg_shapes[2].shape[0] else [None]
    aux_spec = out_spec if epilogue == GemmEpilogue.DGELU else [None]
    arg_specs = [lhs_spec, rhs_spec, bias_spec, aux_spec]
    arg_specs += [[None] * arg_shapes[i].ndim for i in (4, 5)]
    arg_shardings = tuple(base.named(mesh, s) for s in arg_specs)

    out_shardings = [base.named(mesh, out_spec)]
    if epilogue == GemmEpilogue.GELU_AUX:
        out_shardings.append(base.named(mesh, out_spec))
    if grad_bias:
        out_shardings.append(base.named(mesh, [n]))
    if output_amax:
        out_shardings.append(base.named(mesh, [None]))
    row_axes = base.mesh_axes(b + [m])
    out_axes = base.mesh_axes(out_spec)
    params = dict(
        lhs_trans=lhs_trans,
        rhs_trans=rhs_trans,
        epilogue=epilogue,
        out_dtype=out_dtype,
        grad_bias=grad_bias,
        output_amax=False,
        split_accumulator=split_accumulator,
    )

    def lower(lhs, rhs, bias, aux, lhs_si, rhs_si):
        if k_axes and bias.shape[0]:
            first = _first_shard(k_axes)
            bias = jnp.where(first, bias, jnp.zeros_like(bias))
        outs = list(local(lhs, rhs, bias, aux, lhs_si, rhs_si, **params))
        if scatter is not None:
            outs[0] = lax.psum_scatter(
                outs[0], scatter[1], scatter_dimension=scatter[0], tiled=True
            )
        if psum_axes:
            outs[0] = lax.psum(outs[0], psum_axes)
        if grad_bias and row_axes:
            i = 2 if epilogue == GemmEpilogue.GELU_AUX else 1
            outs[i] = lax.psum(outs[i].astype(jnp.float32), row_axes).astype(out_dtype)
        if output_amax:
            a = base.amax(outs[0])
            outs.append(lax.pmax(a, out_axes) if out_axes else a)
        return outs

    return mesh, lower, out_shardings, arg_shardings


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
    """``local(lhs, rhs, bias, aux, lhs_scale_inv, rhs_scale_inv, **params)`` under
    ``custom_partitioning`` with the rule and partition above."""

    def impl(lhs, rhs, bias, aux, ls, rs, *statics):
        return local(lhs, rhs, bias, aux, ls, rs, **dict(zip(_STATICS, statics, strict=True)))

    def partition(*args):
        *statics, mesh, arg_shapes, result_shape = args
        return _partition(*statics, local, mesh, arg_shapes, result_shape)

    return base.make_partitioned(impl, 6, _STATICS, partition, _sharding_rule)
