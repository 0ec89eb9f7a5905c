"""The ``act_lu`` primitive family: activation forward (``ActLuFFI``, target ``te_jax_act_lu``).

Shapes: ``x (rows..., [2,] H) -> y (rows..., H)`` in x's dtype; with ``output_amax`` also
``amax = max|y|`` as float32 of shape ``(1,)`` (over the global tensor when sharded).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.core import ShapedArray
from jax.interpreters import batching

from te_jax import activation_reference
from te_jax._varying import bind
from te_jax.activation_types import ActivationParams, ActivationType
from te_jax.primitives import base
from te_jax.quantize.quantize_layout import QuantizeLayout
from te_jax.quantize.scaling_modes import NoScaling, ScalingMode

TARGET = "te_jax_act_lu"


def act_lu_kernel(x, act, params, output_amax):
    """The local computation: one unquantized ``te_jax_act_lu`` call (zero-size inputs need no
    kernel). Returns ``[y, (amax)]``."""
    if x.size == 0:
        y = jnp.zeros(act.output_shape(x.shape), x.dtype)
        return [y, jnp.zeros((1,), jnp.float32)] if output_amax else [y]
    f32 = jnp.float32
    results = NoScaling.unquantized_ffi_results(
        jax.ShapeDtypeStruct(act.output_shape(x.shape), x.dtype), output_amax
    )
    y, _, _, _, amax, _ = base.ffi_call(
        TARGET,
        results,
        x,
        jnp.ones((1,), f32),  # scale
        jnp.zeros((1,), f32),  # amax
        act_enum=np.int64(act),
        scaling_mode=ScalingMode.NO_SCALING.impl.ffi_value,
        quantize_layout=np.int64(QuantizeLayout.ROWWISE),
        act_params=base.act_params_attr(params),
        output_amax=np.bool_(output_amax),
        **base.scale_options_attrs(),
    )
    return [y, amax] if output_amax else [y]


# ---- sharding ---------------------------------------------------------------------------------


def _sharding_rule(act, params, output_amax, mesh, operand_types, result_types):
    rank = len(operand_types[0].shape)
    rows = base.row_factor_names(rank - act.act_len)
    x = rows + (["k"] if act.is_gated else []) + ["h"]
    results = [" ".join(act.output_axes(x))] + (["z"] if output_amax else [])
    rule = f"{' '.join(x)} -> {', '.join(results)}"
    return rule, ({"need_replication_factors": ("k",)} if act.is_gated else {})


def _partition(act, params, output_amax, mesh, arg_shapes, result_shape):
    rank = len(arg_shapes[0].shape)
    x_spec = base.spec_of(arg_shapes[0], rank)
    if act.is_gated:
        x_spec[-2] = None  # the act axis is never split: a and b of one column stay together
    y_spec = act.output_axes(x_spec)
    out_shardings = [base.named(mesh, y_spec)]
    if output_amax:
        out_shardings.append(base.named(mesh, [None]))
    axes = base.mesh_axes(x_spec)

    def lower(x):
        outs = act_lu_kernel(x, act, params, output_amax)
        if output_amax and axes:
            outs[1] = lax.pmax(outs[1], axes)
        return outs

    return mesh, lower, out_shardings, (base.named(mesh, x_spec),)


_STATICS = ("act", "params", "output_amax")
_partitioned = base.make_partitioned(act_lu_kernel, 1, _STATICS, _partition, _sharding_rule)

# ---- outer: what the public API binds ---------------------------------------------------------

act_lu_p = base.make_primitive("te_jax_act_lu")


@act_lu_p.def_abstract_eval
def _act_lu_abstract(x, *, act, params, output_amax):
    y = ShapedArray(act.output_shape(x.shape), x.dtype)
    return (y, ShapedArray((1,), jnp.float32)) if output_amax else (y,)


def reference_results(x, *, act, params, output_amax):
    """The outer primitive's results in pure JAX: ``[y]``, or ``[y, amax]``."""
    y = activation_reference.act_lu(x, act, params)
    if not output_amax:
        return [y]
    return [y, base.amax(y)]


base.register_outer_rules(
    act_lu_p,
    local=lambda x, **p: act_lu_kernel(x, **p),
    partitioned=lambda x, **p: _partitioned(x, **p),
    reference=reference_results,
)


def _act_lu_batch(args, dims, *, act, params, output_amax):
    (x,), (d,) = args, dims
    x = jnp.moveaxis(x, d, 0)  # feature axes stay trailing: the batch axis becomes a row axis
    (y,) = bind(act_lu_p, x, act=act, params=params, output_amax=False)
    if not output_amax:
        return [y], [0]
    # One amax per batch element; rare (unquantized amax under vmap), so a second pass is fine.
    return [y, base.amax(y, batch_axes=1)], [0, 0]


batching.primitive_batchers[act_lu_p] = _act_lu_batch


def bind_act_lu(
    x: jax.Array,
    act: ActivationType,
    params: ActivationParams | None,
    output_amax: bool = False,
) -> list[jax.Array]:
    """Binds the outer primitive: ``[y]``, or ``[y, amax]`` with ``output_amax``."""
    return bind(act_lu_p, x, act=act, params=params, output_amax=output_amax)
