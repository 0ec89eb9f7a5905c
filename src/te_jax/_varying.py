"""Varying manual axes: the types ``jax.shard_map`` gives values inside it (``check_vma=True``,
its default).

Inside ``shard_map`` a value that may differ between the devices of a mesh axis is *varying*
over that axis; one that is the same on all of them (a replicated parameter) is not. JAX checks
the ``out_specs`` and every ``custom_vjp`` cotangent against these types, and differentiates a
cast from unvarying to varying into a ``psum`` of the cotangent: the gradient of a replicated
weight used with a batch-sharded input is summed over the batch axis.

te_jax's primitives have their own abstract evaluation, which knows nothing of these types, so:

* every primitive is bound through ``bind``: its operands cast to the union of their varying
  axes, its results given that union (a kernel's result depends on all of its operands);
* the differentiable arrays of a ``custom_vjp`` op are cast to their union before it
  (``match``), so the op's cotangents have its primals' types and the casts' transposes do the
  sums;
* a primitive that autodiff *transposes* (a tangent map) types its results with its operands'
  axes in its abstract evaluation (``result_aval``): a result typed unvarying would be cast by
  ``bind``, and that cast's transpose would psum the cotangent over the axes before the
  transpose rule sees it;
* a delayed-scaling quantizer's amax is max-reduced over the axes it varies on and its state
  does not (``max_over_extra_axes``), so the next state stays replicated and every device
  quantizes with the same scale.

Outside ``shard_map``, or with ``check_vma=False``, every set here is empty and all of this is
the identity.
"""

from __future__ import annotations

import jax

__all__ = ["varying_axes", "match", "bind", "max_over_extra_axes", "result_aval"]


def _axes_of(x) -> frozenset:
    aval = jax.typeof(x)
    vma = getattr(aval, "vma", None)
    if vma is None:  # jax 0.10: the manual-axis type's ``varying`` set
        vma = getattr(getattr(aval, "mat", None), "varying", None)
    return frozenset(vma or ())


def varying_axes(*trees) -> frozenset:
    """The union of the varying manual axes of the arrays in ``trees``."""
    out: frozenset = frozenset()
    for leaf in jax.tree.leaves(trees):
        if isinstance(leaf, jax.Array):  # tracers too
            out |= _axes_of(leaf)
    return out


def _cast(leaf, axes: frozenset):
    if not isinstance(leaf, jax.Array):
        return leaf
    missing = axes - _axes_of(leaf)
    if not missing:
        return leaf
    return jax.lax.pcast(leaf, tuple(sorted(missing)), to="varying")


def match(*trees, axes: frozenset | None = None):
    """``trees`` with every array cast to varying over ``axes`` (default: the union of theirs)."""
    axes = varying_axes(*trees) if axes is None else axes
    if not axes:
        return trees
    return jax.tree.map(lambda leaf: _cast(leaf, axes), trees)


def bind(primitive, *operands, **params):
    """``primitive.bind(*operands, **params)`` with the operands and results varying over the
    union of the operands' varying axes."""
    axes = varying_axes(*operands)
    if not axes:
        return primitive.bind(*operands, **params)
    outs = primitive.bind(*match(*operands, axes=axes), **params)
    if primitive.multiple_results:
        return [_cast(o, axes) for o in outs]
    return _cast(outs, axes)


def max_over_extra_axes(x, like):
    """``x`` max-reduced (``lax.pmax``) over the axes it varies on and ``like`` does not."""
    extra = varying_axes(x) - varying_axes(like)
    return jax.lax.pmax(x, tuple(sorted(extra))) if extra else x


def result_aval(like, shape, dtype):
    """An abstract result of ``shape`` and ``dtype`` with the varying manual axes of the operand
    aval ``like`` (every operand has them after ``bind``), for the abstract evaluation of a
    primitive that autodiff transposes."""
    return like.update(shape=tuple(shape), dtype=dtype, weak_type=False)
