"""A linear map with a custom transpose that every JAX transformation can go through.

``custom_linear(rule, residuals, tangents)`` computes ``rule.apply(static, residuals, tangents)``:
a function linear in ``tangents`` (given the ``residuals``), whose transpose with respect to
``tangents`` is ``rule.transpose(static, residuals, cotangents)``. A custom-JVP op returns it as
its tangent, ``ẏ = custom_linear(rule, res, ẋ)``, with the op's fused backward kernels as the
transpose, in the way ``act_lu``'s tangent transposes to the dact kernel
(``te_jax.primitives.activation.autodiff``):

* reverse mode (``grad``, ``vjp``, ``jacrev``) transposes it: the backward kernels run, the
  forward-mode ``apply`` never does;
* forward mode (``jvp``, ``jacfwd``) evaluates ``apply``, in pure JAX;
* its JVP is linear in ``tangents`` (the same map) plus the derivative of ``apply`` with respect
  to ``residuals``, so forward-over-forward and forward-over-reverse (Hessian-vector products)
  work; its batching rule keeps it a ``custom_linear`` whose transpose is the vmapped transpose.

``jax.custom_derivatives.linear_call`` is the same idea without the last point: its JVP takes no
tangent of the residuals, so a Hessian-vector product through it fails.

``apply`` must be differentiable by JAX in ``residuals``; both functions take the flat tuples
``(static, residuals, tangents or cotangents)`` and return a tuple of arrays; ``transpose``
returns one cotangent per tangent, of that tangent's shape and dtype.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from te_jax._varying import bind, result_aval

__all__ = ["LinearRule", "custom_linear", "custom_linear_p"]


@dataclasses.dataclass(frozen=True)
class LinearRule:
    """A linear map ``t ↦ apply(static, res, t)`` and its transpose
    ``ct ↦ transpose(static, res, ct)``; ``static`` is hashable (a config)."""

    apply: Callable
    transpose: Callable
    static: Hashable = None

    def __call__(self, residuals: tuple, tangents: tuple) -> tuple:
        return tuple(self.apply(self.static, tuple(residuals), tuple(tangents)))

    def transposed(self, residuals: tuple, cotangents: tuple) -> tuple:
        return tuple(self.transpose(self.static, tuple(residuals), tuple(cotangents)))


custom_linear_p = Primitive("te_jax_custom_linear")
custom_linear_p.multiple_results = True


def custom_linear(rule: LinearRule, residuals, tangents) -> list[jax.Array]:
    """``rule.apply(rule.static, residuals, tangents)``, transposed by ``rule.transpose``.

    Args:
      rule: the map and its transpose.
      residuals: a tuple of arrays the map is not linear in (the primal values it needs).
      tangents: a tuple of arrays the map is linear in.

    Returns:
      The list of output arrays of ``apply``.
    """
    residuals, tangents = tuple(residuals), tuple(tangents)
    return bind(custom_linear_p, *residuals, *tangents, rule=rule, n_res=len(residuals))


def _split(args, n_res):
    return tuple(args[:n_res]), tuple(args[n_res:])


def _impl(*args, rule: LinearRule, n_res: int):
    return list(rule(*_split(args, n_res)))


custom_linear_p.def_impl(_impl)
mlir.register_lowering(custom_linear_p, mlir.lower_fun(_impl, multiple_results=True))


@custom_linear_p.def_abstract_eval
def _abstract(*avals, rule: LinearRule, n_res: int):
    specs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals]
    outs = jax.eval_shape(lambda *a: _impl(*a, rule=rule, n_res=n_res), *specs)
    # Transposed by autodiff: the results keep the operands' varying axes (te_jax._varying).
    return [result_aval(avals[0], o.shape, o.dtype) for o in outs]


def _transpose(cts, *args, rule: LinearRule, n_res: int):
    """The cotangents of the tangents: ``rule.transpose`` (the backward kernels)."""
    res, lin = _split(args, n_res)
    if any(ad.is_undefined_primal(r) for r in res):
        raise NotImplementedError("te_jax_custom_linear is linear in its tangents only")
    undefined = [ad.is_undefined_primal(t) for t in lin]
    if all(type(ct) is ad.Zero for ct in cts):
        return [None] * n_res + [
            ad.Zero(t.aval) if u else None for t, u in zip(lin, undefined, strict=True)
        ]
    cts = tuple(map(ad.instantiate_zeros, cts))
    lin_cts = rule.transposed(res, cts)
    return [None] * n_res + [ct if u else None for ct, u in zip(lin_cts, undefined, strict=True)]


ad.primitive_transposes[custom_linear_p] = _transpose


def _jvp(primals, tangents, *, rule: LinearRule, n_res: int):
    """Along the tangents' tangents: the same linear map. Along the residuals' tangents: the
    derivative of ``apply`` in pure JAX (its second-order terms, e.g. ``f''``)."""
    res, lin = _split(primals, n_res)
    d_res, d_lin = _split(tangents, n_res)
    out = custom_linear(rule, res, lin)
    parts = []
    if any(type(t) is not ad.Zero for t in d_lin):
        parts.append(custom_linear(rule, res, tuple(map(ad.instantiate_zeros, d_lin))))
    if any(type(t) is not ad.Zero for t in d_res):
        d_res = tuple(map(ad.instantiate_zeros, d_res))
        parts.append(jax.jvp(lambda *r: rule(r, lin), res, d_res)[1])
    if not parts:
        return out, [ad.Zero(jax.typeof(o).to_tangent_aval()) for o in out]
    return out, [sum(ts[1:], ts[0]) for ts in zip(*parts, strict=True)]


ad.primitive_jvps[custom_linear_p] = _jvp


def _batch(args, dims, *, rule: LinearRule, n_res: int):
    """``vmap`` keeps the map a ``custom_linear``: the vmapped ``apply``, transposed by the
    vmapped ``transpose`` (an unbatched tangent's cotangent summed over the batch)."""
    size = next(a.shape[d] for a, d in zip(args, dims, strict=True) if d is not None)
    batched = LinearRule(_apply_batched, _transpose_batched, (rule, tuple(dims), n_res, size))
    outs = custom_linear(batched, *_split(args, n_res))
    return outs, [0] * len(outs)


def _apply_batched(static, res, lin):
    rule, dims, n_res, size = static
    res_dims, lin_dims = _split(dims, n_res)
    return jax.vmap(rule, in_axes=(res_dims, lin_dims), axis_size=size)(res, lin)


def _transpose_batched(static, res, cts):
    rule, dims, n_res, size = static
    res_dims, lin_dims = _split(dims, n_res)
    lin_cts = jax.vmap(rule.transposed, in_axes=(res_dims, 0), axis_size=size)(res, cts)
    return tuple(map(_unbatch, lin_cts, lin_dims))


def _unbatch(ct, dim):
    """A cotangent batched at 0 as its tangent was: at ``dim``, or summed (in float32) where
    the tangent was not batched."""
    if dim is not None:
        return jnp.moveaxis(ct, 0, dim)
    return jnp.sum(ct.astype(jnp.promote_types(ct.dtype, jnp.float32)), axis=0).astype(ct.dtype)


batching.primitive_batchers[custom_linear_p] = _batch
