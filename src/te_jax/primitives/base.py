"""Machinery shared by the te_jax primitives.

Every FFI op family is two primitives:

* an **inner** primitive that lowers to the XLA FFI custom call (same target name on ``cpu`` and
  ``cuda``), with every buffer of the FFI contract (scales, amax, workspace) in its signature;
* an **outer** primitive, the one the public functions bind: it has the user-facing signature, an
  abstract evaluation, a batching rule that folds the vmapped axis into the kernel's rows, and a
  lowering that goes through ``custom_partitioning`` (so a sharded input is split, never
  all-gathered) on platforms with kernels, and through the pure-JAX reference elsewhere.

``custom_partitioning`` has no batching or AD rule; it therefore sits inside the outer
primitive's lowering, and the AD rules (``te_jax.primitives.activation.autodiff``) are the outer
primitives' own.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import ShapedArray
from jax.experimental.custom_partitioning import custom_partitioning
from jax.extend.core import Primitive
from jax.interpreters import mlir, xla
from jax.sharding import NamedSharding, PartitionSpec

from te_jax._ffi import registered_platforms
from te_jax._varying import bind
from te_jax.activation_types import ActivationParams, ClampedSwiGLUParams

# Lowering platforms te_jax has kernels for (when its extension is built).
KERNEL_PLATFORMS = ("cpu", "cuda")


def act_params_attr(params: ActivationParams | None) -> dict:
    """The ``act_params`` struct attribute; the FFI always receives every field."""
    c = (params.clamped_swiglu if params is not None else None) or ClampedSwiGLUParams()
    return {
        "clamped_swiglu": {
            "limit": np.float32(c.limit),
            "alpha": np.float32(c.alpha),
            "glu_linear_offset": np.float32(c.glu_linear_offset),
        }
    }


def scale_options_attrs(options=None) -> dict:
    """The ``power_2_scale`` and ``amax_epsilon`` attributes, which every call of the three
    quantizing targets (``te_jax_act_lu``, ``te_jax_quantize``, ``te_jax_dact_dbias_quantize``)
    passes: blockwise FP8's ``BlockScaleOptions`` (``QuantConfig.scale_options``), and False
    and 0 for ``None`` (every other mode, and the unquantized calls, whose kernels ignore
    them)."""
    return dict(
        power_2_scale=np.bool_(options is not None and options.power_2_scale),
        amax_epsilon=np.float32(0.0 if options is None else options.amax_epsilon),
    )


def amax(y: jax.Array, batch_axes: int = 0) -> jax.Array:
    """``max|y|`` in float32 (NaN propagates), the ``output_amax`` result computed in JAX.

    ``batch_axes = 0``: shape ``(1,)``. ``batch_axes = 1``: one per element of the leading axis,
    shape ``(B, 1)`` (what a vmapped ``(1,)`` amax is).
    """
    a = jnp.abs(y.astype(jnp.float32))
    if batch_axes:
        return jnp.max(a.reshape(y.shape[0], -1), axis=1, initial=0.0)[:, None]
    return jnp.max(a, initial=0.0).reshape(1)


def make_primitive(name: str) -> Primitive:
    p = Primitive(name)
    p.multiple_results = True
    p.def_impl(lambda *args, **params: xla.apply_primitive(p, *args, **params))
    return p


def register_outer_rules(
    outer: Primitive,
    local: Callable,
    partitioned: Callable,
    reference: Callable,
    platforms: Iterable[str] | None = None,
    partitioned_reference: Callable | None = None,
) -> None:
    """Eager impl and lowerings of an outer primitive.

    All three callables take the primitive's operands positionally and its params by keyword and
    return the list of results: ``local`` runs the kernel on unsharded operands, ``partitioned``
    is ``local`` under ``custom_partitioning``, ``reference`` is the pure-JAX path.

    Under ``jit`` the op lowers through ``partitioned`` where kernels exist and through
    ``reference`` elsewhere. Eager calls run ``local`` directly, by the platform they run on
    (``eager_backend``): ``custom_partitioning`` needs the device assignment of a jitted
    computation; where the platform has no kernel, ``reference`` runs as one program per
    static configuration and shape (what ``jit`` of the op compiles), not op by op: its exact
    integer arithmetic (``te_jax.quantize.ieee``, ``formats``) is dozens of small ops per call.

    ``platforms`` are the lowering platforms (``"cpu"``, ``"cuda"``) with a kernel for this op:
    by default every platform whose extension is registered; an op whose FFI target exists on
    some platforms only (the GEMM: CUDA) names them (``te_jax._ffi.target_platforms``).

    ``partitioned_reference``, where given, is ``reference`` under the same
    ``custom_partitioning`` as the kernel, the lowering on every other platform: the op then
    shards the same way (same collectives) everywhere, and the CPU tests check the partition
    the GPU runs.
    """
    kernel_platforms = registered_platforms() if platforms is None else frozenset(platforms)
    backends = _backend_names(kernel_platforms)

    def eager(*operands, **params):
        if eager_backend(operands) in backends:
            return local(*operands, **params)
        return _as_program(reference, tuple(sorted(params)))(*operands, **params)

    outer.def_impl(eager)
    _requires_devices_during_lowering(outer)
    default = reference if partitioned_reference is None else partitioned_reference
    mlir.register_lowering(outer, mlir.lower_fun(default, multiple_results=True))
    for platform in sorted(kernel_platforms):
        mlir.register_lowering(
            outer, mlir.lower_fun(partitioned, multiple_results=True), platform=platform
        )


@functools.cache
def _as_program(fn: Callable, param_names: tuple[str, ...]) -> Callable:
    """``fn`` jitted with its keyword params static (a primitive's params are hashable)."""
    return jax.jit(fn, static_argnames=param_names)


def _requires_devices_during_lowering(p: Primitive) -> None:
    """``custom_partitioning`` lowers only with a concrete device assignment; JAX provides one
    for the primitives in this (private) set, as it does for ``custom_partitioning`` itself.
    Without it a single-device ``jit`` lowers abstractly and ``custom_partitioning`` fails."""
    from jax._src import dispatch  # noqa: PLC0415 -- private, isolated here

    dispatch.prim_requires_devices_during_lowering.add(p)


def eager_backend(operands: Iterable) -> str:
    """JAX's name of the backend an eager (un-jitted) call runs on: that of a committed operand's
    device, else of ``jax.default_device``'s, else ``jax.default_backend()``. Under
    ``jax.default_device(cpu)`` on a GPU machine the call runs on the CPU although the default
    backend is the GPU's."""
    for x in operands:
        if isinstance(x, jax.Array) and x.committed:
            return next(iter(x.devices())).platform
    device = jax.config.jax_default_device
    if device is not None:
        return device if isinstance(device, str) else device.platform
    return jax.default_backend()


def _backend_names(platforms: Iterable[str]) -> frozenset[str]:
    """Kernel lowering platforms by JAX's backend names ("cuda" is the "gpu" backend)."""
    names = set(platforms)
    if "cuda" in names:
        names.add("gpu")
    return frozenset(names)


def make_partitioned(
    impl: Callable,
    n_operands: int,
    static_names: Sequence[str],
    partition: Callable,
    sharding_rule: Callable,
) -> Callable:
    """Wraps ``impl(*operands, *statics)`` in ``custom_partitioning``.

    Returns ``fn(*operands, **params)`` taking the statics by name. ``partition`` and
    ``sharding_rule`` receive the statics first (``custom_partitioning``'s convention).
    """
    static_argnums = tuple(range(n_operands, n_operands + len(static_names)))
    cp = custom_partitioning(impl, static_argnums=static_argnums)
    cp.def_partition(partition=partition, sharding_rule=sharding_rule)

    def call(*operands, **params):
        return cp(*operands, *(params[n] for n in static_names))

    return call


def spec_of(arg_shape, rank: int) -> list:
    """The PartitionSpec of an argument as a list padded to ``rank`` entries."""
    sharding = getattr(arg_shape, "sharding", None)
    spec = list(getattr(sharding, "spec", ()) or ())
    return spec + [None] * (rank - len(spec))


def mesh_axes(entries: Sequence) -> tuple[str, ...]:
    """Mesh axis names used by the given PartitionSpec entries."""
    axes: list[str] = []
    for e in entries:
        if e is None:
            continue
        for a in e if isinstance(e, tuple) else (e,):
            if a not in axes:
                axes.append(a)
    return tuple(axes)


def named(mesh, spec: Sequence) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec(*spec))


def row_factor_names(n: int) -> list[str]:
    """Factor names for the leading (row) axes in a Shardy sharding rule."""
    return [f"r{i}" for i in range(n)]


# ---- the FFI call every te_jax op makes ---------------------------------------------------------
# jax.ffi.ffi_call keeps its attributes as primitive params, which must be hashable, and only
# freezes the top level: act_params (a nested dict) cannot pass. This primitive freezes nested
# dicts into sorted item tuples and rebuilds them in the lowering rule (cpu and cuda only: it is
# bound inside the outer primitives' kernel lowerings).

_ffi_call_p = make_primitive("te_jax_ffi_call")


def _freeze(v):
    if isinstance(v, dict):
        return ("__dict__", tuple(sorted((k, _freeze(x)) for k, x in v.items())))
    return v


def _thaw(v):
    if isinstance(v, tuple) and len(v) == 2 and v[0] == "__dict__":
        return {k: _thaw(x) for k, x in v[1]}
    return v


@_ffi_call_p.def_abstract_eval
def _ffi_call_abstract(*operands, target, results, attrs, aliases):
    return [ShapedArray(shape, dtype) for shape, dtype in results]


def _ffi_call_lowering(ctx, *operands, target, results, attrs, aliases):
    lowering = jax.ffi.ffi_lowering(target, operand_output_aliases=dict(aliases) or None)
    return lowering(ctx, *operands, **_thaw(attrs))


for _platform in KERNEL_PLATFORMS:
    mlir.register_lowering(_ffi_call_p, _ffi_call_lowering, platform=_platform)


def ffi_call(target: str, results, *operands, aliases=None, **attrs) -> list[jax.Array]:
    """Calls the FFI ``target`` on ``operands``; ``results`` are ShapeDtypeStructs.

    ``aliases`` ``{operand index: result index}``: the result is written over the operand's
    buffer (an operand XLA still needs afterwards is copied first), for kernels that read each
    element before they write it, at the same position and in the same thread.
    """
    frozen_results = tuple((tuple(r.shape), np.dtype(r.dtype)) for r in results)
    return bind(
        _ffi_call_p,
        *operands,
        target=target,
        results=frozen_results,
        attrs=_freeze(dict(attrs)),
        aliases=tuple(sorted((aliases or {}).items())),
    )
