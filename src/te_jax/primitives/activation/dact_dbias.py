"""The ``dact_dbias`` primitive family: activation gradient, optional dbias
(``DActLuDBiasQuantizeFFI``, target ``te_jax_dact_dbias_quantize``).

Shapes: ``dz (batch..., rows..., H)``, ``x (batch..., rows..., [2,] H)`` ->
``dx`` of x's shape; with ``is_dbias`` also ``dbias (batch..., [2,] H)``, the float32 sum of dx
over the row axes in x's dtype. The leading ``n_batch`` axes are vmapped axes folded into the
kernel's rows: each keeps its own dbias. With ``output_amax``: ``amax = max|dx|`` (float32, (1,)).

dbias is reduced deterministically in two stages: the kernel writes per-row-group float32 partial
sums to a workspace ``[batches, groups, act_len * H]`` and sums them in a fixed order. The group
count depends only on the shape (``dbias_policy``), so the result never depends on the device.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.core import ShapedArray
from jax.interpreters import batching

from te_jax import activation_reference
from te_jax._varying import bind
from te_jax.activation_types import ActivationParams, ActivationType
from te_jax.primitives import base, dbias_policy
from te_jax.quantize.quantize_layout import QuantizeLayout
from te_jax.quantize.scaling_modes import NoScaling, ScalingMode

TARGET = "te_jax_dact_dbias_quantize"


def _ffi_results(x, act, is_dbias, n_batch, output_amax) -> list[jax.ShapeDtypeStruct]:
    """Result buffers of the unquantized call: the FFI contract's six, dbias, workspace."""
    sds, f32 = jax.ShapeDtypeStruct, jnp.float32
    feature = act.feature_shape(x.shape)
    if is_dbias:
        batches = math.prod(x.shape[:n_batch])
        rows = math.prod(x.shape[n_batch : x.ndim - act.act_len])
        dbias = sds(tuple(x.shape[:n_batch]) + feature, x.dtype)
        groups = dbias_policy.UNQUANTIZED.groups(rows, x.shape[-1], x.dtype.itemsize)
        workspace = sds((batches, groups, math.prod(feature)), f32)
    else:
        dbias, workspace = sds((0,), x.dtype), sds((0,), f32)
    return NoScaling.unquantized_ffi_results(sds(x.shape, x.dtype), output_amax) + [
        dbias,
        workspace,
    ]


def dact_dbias_kernel(
    dz, x, act, params, is_dbias, n_batch, output_amax, dbias_from_workspace=False, over_x=False
):
    """The local computation, one unquantized ``te_jax_dact_dbias_quantize`` call. Returns
    ``[dx, (dbias), (amax)]``. With ``over_x`` dx is written over x's buffer (the CPU and CUDA
    kernels read each element of x before they write dx there, in the same thread).

    With ``dbias_from_workspace`` the dbias is returned as float32 partial sums of the local rows
    (summed from the kernel's workspace) so that a cross-shard sum keeps float32 precision.
    """
    dbias_shape = tuple(x.shape[:n_batch]) + act.feature_shape(x.shape)
    if x.size == 0:
        outs = [jnp.zeros(x.shape, x.dtype)]
        if is_dbias:
            dt = jnp.float32 if dbias_from_workspace else x.dtype
            outs.append(jnp.zeros(dbias_shape, dt))
        if output_amax:
            outs.append(jnp.zeros((1,), jnp.float32))
        return outs
    dx, _, _, _, amax, _, dbias, workspace = base.ffi_call(
        TARGET,
        _ffi_results(x, act, is_dbias, n_batch, output_amax),
        dz,
        x,
        jnp.ones((1,), jnp.float32),  # scale
        jnp.zeros((1,), jnp.float32),  # amax
        scaling_mode=ScalingMode.NO_SCALING.impl.ffi_value,
        act_enum=np.int64(act),
        quantize_layout=np.int64(QuantizeLayout.ROWWISE),
        is_dbias=np.bool_(is_dbias),
        act_params=base.act_params_attr(params),
        output_amax=np.bool_(output_amax),
        aliases={1: 0} if over_x else None,
        **base.scale_options_attrs(),
    )
    outs = [dx]
    if is_dbias:
        outs.append(workspace.sum(axis=1).reshape(dbias_shape) if dbias_from_workspace else dbias)
    if output_amax:
        outs.append(amax)
    return outs


# ---- sharding ---------------------------------------------------------------------------------


def _sharding_rule(act, params, is_dbias, n_batch, output_amax, mesh, operand_types, result_types):
    rank = len(operand_types[1].shape)
    lead = base.row_factor_names(rank - act.act_len)
    k = ["k"] if act.is_gated else []
    x_factors = lead + k + ["h"]
    dz = " ".join(act.output_axes(x_factors))
    x = " ".join(x_factors)
    results = [x]
    if is_dbias:
        results.append(" ".join(lead[:n_batch] + k + ["h"]))
    if output_amax:
        results.append("z")
    kwargs = {}
    if act.is_gated:
        kwargs["need_replication_factors"] = ("k",)
    # The row factors are not declared reduction factors (they also map dx, which Shardy forbids
    # for reduction factors); the partition callback psums the dbias partials itself.
    return f"{dz}, {x} -> {', '.join(results)}", kwargs


def _partition(act, params, is_dbias, n_batch, output_amax, mesh, arg_shapes, result_shape):
    rank = len(arg_shapes[1].shape)
    x_spec = base.spec_of(arg_shapes[1], rank)
    if act.is_gated:
        x_spec[-2] = None  # never split the act axis
    dz_spec = act.output_axes(x_spec)
    n_lead = rank - act.act_len
    row_axes = base.mesh_axes(x_spec[n_batch:n_lead])
    out_shardings = [base.named(mesh, x_spec)]
    if is_dbias:
        out_shardings.append(base.named(mesh, x_spec[:n_batch] + x_spec[n_lead:]))
    if output_amax:
        out_shardings.append(base.named(mesh, [None]))
    all_axes = base.mesh_axes(x_spec)

    def lower(dz, x):
        reduce_dbias = is_dbias and bool(row_axes)
        outs = dact_dbias_kernel(
            dz, x, act, params, is_dbias, n_batch, output_amax, dbias_from_workspace=reduce_dbias
        )
        if reduce_dbias:  # partial sums of the local rows -> the global dbias
            outs[1] = lax.psum(outs[1], row_axes).astype(x.dtype)
        if output_amax and all_axes:
            outs[-1] = lax.pmax(outs[-1], all_axes)
        return outs

    arg_shardings = (base.named(mesh, dz_spec), base.named(mesh, x_spec))
    return mesh, lower, out_shardings, arg_shardings


_STATICS = ("act", "params", "is_dbias", "n_batch", "output_amax")


def _local(dz, x, act, params, is_dbias, n_batch, output_amax):
    # custom_partitioning turns every parameter it is given, defaults too, into an operand or a
    # static: this signature is exactly the operands and the statics.
    return dact_dbias_kernel(dz, x, act, params, is_dbias, n_batch, output_amax)


_partitioned = base.make_partitioned(_local, 2, _STATICS, _partition, _sharding_rule)

# ---- outer: what the public API binds ---------------------------------------------------------

dact_dbias_p = base.make_primitive("te_jax_dact_dbias")


@dact_dbias_p.def_abstract_eval
def _abstract(dz, x, *, act, params, is_dbias, n_batch, output_amax):
    outs = [ShapedArray(x.shape, x.dtype)]
    if is_dbias:
        outs.append(ShapedArray(tuple(x.shape[:n_batch]) + act.feature_shape(x.shape), x.dtype))
    if output_amax:
        outs.append(ShapedArray((1,), jnp.float32))
    return outs


def reference_results(dz, x, *, act, params, is_dbias, n_batch, output_amax):
    """The outer primitive's results in pure JAX (its lowering without kernels, and its JVP)."""
    # The leading n_batch axes are vmapped axes, each with its own dbias: vmap the reference.
    fn = functools.partial(
        activation_reference.quantize_dact_dbias,
        activation_type=act,
        is_dbias=is_dbias,
        act_params=params,
    )
    for _ in range(n_batch):
        fn = jax.vmap(fn)
    dx, dbias = fn(dz, x)
    outs = [dx, dbias] if is_dbias else [dx]
    if output_amax:
        outs.append(base.amax(dx))
    return outs


base.register_outer_rules(
    dact_dbias_p,
    local=lambda dz, x, **p: _local(dz, x, **p),
    partitioned=lambda dz, x, **p: _partitioned(dz, x, **p),
    reference=reference_results,
)


def _batch(args, dims, *, act, params, is_dbias, n_batch, output_amax):
    # An unmapped operand has bdim None; it is broadcast. The batch axis goes to the front and
    # becomes the first dbias batch axis.
    size = next(a.shape[d] for a, d in zip(args, dims, strict=True) if d is not None)
    dz, x = (batching.bdim_at_front(a, d, size) for a, d in zip(args, dims, strict=True))
    outs = bind(
        dact_dbias_p,
        dz,
        x,
        act=act,
        params=params,
        is_dbias=is_dbias,
        n_batch=n_batch + 1,
        output_amax=False,
    )
    out_dims = [0] * len(outs)
    if output_amax:
        outs = list(outs) + [base.amax(outs[0], batch_axes=1)]
        out_dims.append(0)
    return outs, out_dims


batching.primitive_batchers[dact_dbias_p] = _batch


def bind_dact_dbias(
    dz: jax.Array,
    x: jax.Array,
    act: ActivationType,
    params: ActivationParams | None,
    is_dbias: bool,
    output_amax: bool = False,
) -> list[jax.Array]:
    """Binds the outer primitive: ``[dx, (dbias), (amax)]``."""
    return bind(
        dact_dbias_p,
        dz,
        x,
        act=act,
        params=params,
        is_dbias=is_dbias,
        n_batch=0,
        output_amax=output_amax,
    )
