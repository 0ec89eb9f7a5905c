"""``te_jax.dot_general``: ``jax.lax.dot_general`` on te_jax's GEMM and quantize kernels, for the
``dot_general`` hook of stock Flax layers (``nn.Dense``, ``nn.DenseGeneral``, ``nnx.Linear``,
``nnx.LinearGeneral``, ``nnx.Einsum``) and ``jnp.einsum(..., _dot_general=...)``.

Any ``dimension_numbers`` ``((lhs_contract, rhs_contract), (lhs_batch, rhs_batch))``: the
operands are laid out as ``te_jax.dense`` takes them, lhs ``(*batch, *lhs_free, *K)`` and rhs
``(*batch, *K, *rhs_free)`` (a transpose only where an operand's axes are not already in that
order; none for ``x @ kernel``, ``"bsd,df->bsf"`` or ``"ebd,edf->ebf"``), and the batch axes are
vmapped: one batched GEMM for all of them, one quantizer set shared by all (an amax over the
whole operand). The result is ``lax.dot_general``'s: ``(*batch, *lhs_free, *rhs_free)``.

lhs is the activation (the set's ``x`` quantizer), rhs the weight (its ``kernel`` quantizer),
the output's gradient the ``grad`` quantizer; under delayed scaling the cotangent of the
quantizer set is its next state, as for ``dense``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from te_jax.linear import dense
from te_jax.recipe import QuantizerSet

__all__ = ["dot_general"]

_WHERE = "te_jax.dot_general"


def _axes(what: str, axes, ndim: int) -> tuple[int, ...]:
    out = []
    for a in axes:
        a = int(a)
        if not -ndim <= a < ndim:
            raise ValueError(f"{_WHERE}: {what} axis {a} is out of range for a rank-{ndim} operand")
        out.append(a % ndim)
    if len(set(out)) != len(out):
        raise ValueError(f"{_WHERE}: {what} axes {tuple(axes)} repeat an axis")
    return tuple(out)


def _dimension_numbers(dimension_numbers, lhs_ndim: int, rhs_ndim: int):
    try:
        (lc, rc), (lb, rb) = dimension_numbers
    except (TypeError, ValueError):
        raise ValueError(
            f"{_WHERE}: dimension_numbers must be ((lhs_contracting, rhs_contracting), "
            f"(lhs_batch, rhs_batch)), as for jax.lax.dot_general; got {dimension_numbers!r}"
        ) from None
    lc, rc = _axes("lhs contracting", lc, lhs_ndim), _axes("rhs contracting", rc, rhs_ndim)
    lb, rb = _axes("lhs batch", lb, lhs_ndim), _axes("rhs batch", rb, rhs_ndim)
    if len(lc) != len(rc) or len(lb) != len(rb):
        raise ValueError(
            f"{_WHERE}: lhs and rhs must name as many contracting and as many batch axes, got "
            f"{dimension_numbers!r}"
        )
    if set(lc) & set(lb) or set(rc) & set(rb):
        raise ValueError(f"{_WHERE}: an axis cannot be both contracting and batch")
    return lc, rc, lb, rb


def dot_general(
    lhs: jax.Array,
    rhs: jax.Array,
    dimension_numbers,
    precision=None,
    preferred_element_type=None,
    *,
    quantizer_set: QuantizerSet | None = None,
    implementation: str | None = None,
    out_sharding=None,
) -> jax.Array:
    """``lax.dot_general(lhs, rhs, dimension_numbers)`` on te_jax's GEMM (module docstring).

    The products accumulate in float32 and are rounded once to the compute dtype, lhs's (float32,
    bfloat16 or float16; rhs is cast to it, or under a recipe quantized from its own dtype).

    Args:
      lhs: the activation, ``(..)`` of any rank.
      rhs: the weight.
      dimension_numbers: ``((lhs_contracting, rhs_contracting), (lhs_batch, rhs_batch))``.
      precision: accepted for ``lax.dot_general``'s signature; te_jax's GEMM always accumulates
        in float32.
      preferred_element_type: the output dtype (default: the compute dtype).
      quantizer_set: ``None`` (no quantization) or ``te_jax.QuantizerSet.create(recipe)``.
      implementation: ``None`` (te_jax's kernels where there are some), ``"ffi"`` or ``"xla"``.
      out_sharding: the output's sharding (applied as a sharding constraint), or ``None``.

    Returns:
      ``(*batch, *lhs_free, *rhs_free)``, as ``lax.dot_general``.

    Example:
      >>> import jax.numpy as jnp, te_jax
      >>> x = jnp.ones((3, 4, 32), jnp.bfloat16)                # "ebd,edf->ebf"
      >>> w = jnp.ones((3, 32, 16), jnp.bfloat16)
      >>> te_jax.dot_general(x, w, (((2,), (1,)), ((0,), (0,)))).shape
      (3, 4, 16)
    """
    del precision  # the GEMM accumulates in float32 whatever is asked
    lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
    lc, rc, lb, rb = _dimension_numbers(dimension_numbers, lhs.ndim, rhs.ndim)
    for a, b in zip(lb, rb, strict=True):
        if lhs.shape[a] != rhs.shape[b]:
            raise ValueError(
                f"{_WHERE}: batch axes differ in size: lhs axis {a} ({lhs.shape[a]}) and rhs axis "
                f"{b} ({rhs.shape[b]})"
            )
    lfree = [a for a in range(lhs.ndim) if a not in lc and a not in lb]
    rfree = [a for a in range(rhs.ndim) if a not in rc and a not in rb]
    x = _permute(lhs, (*lb, *lfree, *lc))
    k = _permute(rhs, (*rb, *rc, *rfree))
    n_c = len(lc)

    def one(x, k):
        contracting = (tuple(range(x.ndim - n_c, x.ndim)), tuple(range(n_c)))
        return dense.apply(
            _WHERE, x, k, None, None, quantizer_set, None, contracting, implementation
        )

    fn = one
    for _ in lb:
        fn = jax.vmap(fn)
    out = fn(x, k)
    if preferred_element_type is not None:
        out = out.astype(preferred_element_type)
    if out_sharding is not None:
        out = lax.with_sharding_constraint(out, out_sharding)
    return out


def _permute(a: jax.Array, order: tuple[int, ...]) -> jax.Array:
    return a if order == tuple(range(a.ndim)) else jnp.transpose(a, order)
