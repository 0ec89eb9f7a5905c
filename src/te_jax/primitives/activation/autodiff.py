"""Autodiff rules of the unquantized primitives, given the way JAX's own primitives have them.

``act_lu``, ``y = f(x)`` (gated ``y = f(a)·lin(b)``). Its JVP is the kernel for ``y`` and

    ẏ = act_lu_tangent(ẋ, x)          (f'(x)·ẋ; gated f'(a)·lin(b)·ẋ_a + lin'(b)·f(a)·ẋ_b)

a primitive linear in ``ẋ`` whose **transpose is the fused dact kernel**,
``x̄ = dact_dbias(ȳ, x)``. Reverse mode (``grad``, ``vjp``) therefore runs the forward kernel and
the backward kernel and nothing else; forward mode (``jvp``, ``jacfwd``) evaluates the tangent in
pure JAX (``te_jax.activation_reference.act_lu_tangent``, the same §1 derivatives).

``dact_dbias``, ``(dx, dbias) = (f'(x)·dz, Σ_rows dx)``: linear in ``dz``, not in ``x``. Its JVP
is ``jax.jvp`` of its pure-JAX reference (``f''`` comes from autodiff of the §1 ``f'`` formulas),
so second order (grad of grad, hessians) is exact on every path; the primal stays the kernel.

``amax`` results (``output_amax``) get the tangent of ``max|y|`` from ``y``'s.
"""

from __future__ import annotations

import functools

import jax
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from te_jax import activation_reference
from te_jax._varying import bind, result_aval
from te_jax.primitives import base
from te_jax.primitives.activation import dact_dbias
from te_jax.primitives.activation.act_lu import act_lu_p

__all__ = ["act_lu_tangent_p"]

# ---- act_lu_tangent: ẏ = act_lu_tangent(ẋ, x), linear in ẋ ------------------------------

act_lu_tangent_p = Primitive("te_jax_act_lu_tangent")


def _tangent(t, x, *, act, params):
    return activation_reference.act_lu_tangent(t, x, act, params)


act_lu_tangent_p.def_impl(_tangent)
mlir.register_lowering(act_lu_tangent_p, mlir.lower_fun(_tangent, multiple_results=False))


@act_lu_tangent_p.def_abstract_eval
def _tangent_abstract(t, x, *, act, params):
    # Transposed by autodiff: the result keeps the operands' varying axes (te_jax._varying).
    return result_aval(x, act.output_shape(x.shape), x.dtype)


def _tangent_transpose(ct, t, x, *, act, params):
    """``t̄ = dact(ȳ, x)``: the fused kernel (its own lowering picks the reference elsewhere)."""
    if ad.is_undefined_primal(x):
        raise NotImplementedError("te_jax_act_lu_tangent is linear in its tangent only")
    if type(ct) is ad.Zero:
        return [ad.Zero(t.aval), None]
    (dt,) = bind(
        dact_dbias.dact_dbias_p,
        ct,
        x,
        act=act,
        params=params,
        is_dbias=False,
        n_batch=0,
        output_amax=False,
    )
    return [dt, None]


ad.primitive_transposes[act_lu_tangent_p] = _tangent_transpose


def _tangent_jvp(primals, tangents, *, act, params):
    """Linear in ``t`` (the same primitive along ``ṫ``), plus ``∂/∂x`` along ``ẋ`` in pure JAX."""
    (t, x), (t_dot, x_dot) = primals, tangents
    out = bind(act_lu_tangent_p, t, x, act=act, params=params)
    parts = []
    if type(t_dot) is not ad.Zero:
        parts.append(bind(act_lu_tangent_p, t_dot, x, act=act, params=params))
    if type(x_dot) is not ad.Zero:
        along_x = lambda x: activation_reference.act_lu_tangent(t, x, act, params)  # noqa: E731
        parts.append(jax.jvp(along_x, (x,), (x_dot,))[1])
    return out, functools.reduce(lambda a, b: a + b, parts)


ad.primitive_jvps[act_lu_tangent_p] = _tangent_jvp


def _tangent_batch(args, dims, *, act, params):
    # Elementwise over the rows: the batch axis goes to the front as one more row axis.
    size = next(a.shape[d] for a, d in zip(args, dims, strict=True) if d is not None)
    t, x = (batching.bdim_at_front(a, d, size) for a, d in zip(args, dims, strict=True))
    return bind(act_lu_tangent_p, t, x, act=act, params=params), 0


batching.primitive_batchers[act_lu_tangent_p] = _tangent_batch

# ---- act_lu ------------------------------------------------------------------------------------


def _act_lu_jvp(primals, tangents, *, act, params, output_amax):
    (x,), (x_dot,) = primals, tangents
    outs = bind(act_lu_p, x, act=act, params=params, output_amax=output_amax)
    y_dot = bind(act_lu_tangent_p, ad.instantiate_zeros(x_dot), x, act=act, params=params)
    if not output_amax:
        return outs, [y_dot]
    return outs, [y_dot, jax.jvp(base.amax, (outs[0],), (y_dot,))[1]]


ad.primitive_jvps[act_lu_p] = _act_lu_jvp

# ---- dact_dbias --------------------------------------------------------------------------------


def _dact_dbias_jvp(primals, tangents, **params):
    outs = bind(dact_dbias.dact_dbias_p, *primals, **params)
    tangents = tuple(ad.instantiate_zeros(t) for t in tangents)
    ref = functools.partial(dact_dbias.reference_results, **params)
    return outs, jax.jvp(ref, tuple(primals), tangents)[1]


ad.primitive_jvps[dact_dbias.dact_dbias_p] = _dact_dbias_jvp
