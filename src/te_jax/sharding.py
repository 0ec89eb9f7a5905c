"""Which mesh axis does what: data, FSDP, tensor and sequence parallelism for te_jax's ops and
modules, as Flax logical axis rules.

te_jax's ops shard the way XLA's own do: under ``jax.jit`` with sharded inputs and parameters
(``NamedSharding``), each op runs on its shards and communicates only what its math needs
(``te_jax.primitives.gemm.sharding``: the weight, never the activation, is gathered; a split
contraction is all-reduced or reduce-scattered). Nothing here is needed for that; this module
names the roles so that a mesh and Flax's logical axis rules shard a te_jax model in one line::

    mesh = jax.make_mesh((2, 4), ("data", "tensor"))
    resource = te_jax.sharding.MeshResource(dp_resource="data", tp_resource="tensor")
    with nn.logical_axis_rules(resource.logical_axis_rules()):   # or nnx.logical_axis_rules
        specs = nn.get_partition_spec(variables)                  # parameters -> mesh axes

Logical axis names te_jax's modules put on their parameters (``te_jax.flax`` / ``te_jax.nnx``):

========== ============================================ =========================
name       dimension                                    mesh axis
========== ============================================ =========================
``embed``  the model (hidden) dimension ``H``           ``fsdp_resource``
``mlp``    the MLP's intermediate dimension ``I``       ``tp_resource``
``act``    the gate axis (``2``) of a gated kernel      never split
========== ============================================ =========================

and the names for activations (for ``nn.with_logical_constraint`` in a user's model):
``batch`` -> ``(dp_resource, fsdp_resource)`` (FSDP is data parallel too), ``length`` ->
``sp_resource``, ``embed`` and ``mlp`` as above where the axis is still free. Each name is a
constant here (``BATCH``, ``LENGTH``, ``EMBED``, ``MLP``, ``ACT``; all five in ``LOGICAL_AXES``).

With ``tp_resource`` the MLP is Megatron-style: ``wi`` (``(H, I)``, gated ``(H, 2, I)``) column
parallel, the activation and its gradient local to each shard, ``wo`` (``(I, H)``) row
parallel with one all-reduce of the output in the forward and one of ``dx`` in the backward.
With ``fsdp_resource`` every parameter is split over that axis and all-gathered just before its
GEMM, and its gradient reduce-scattered. With ``sp_resource`` the activations outside the
tensor-parallel region stay split along ``length``; ``te_jax.sequence_parallel`` holds the
all-gather / reduce-scatter pair at the region's edges.

te_jax's constraints see the mesh of ``jax.set_mesh(mesh)`` and that of JAX's older (deprecated)
``with mesh:`` block alike; Flax's own logical constraints see only the first.
"""

from __future__ import annotations

import dataclasses
import warnings

import jax
import jax.numpy as jnp

__all__ = [
    "BATCH",
    "LENGTH",
    "EMBED",
    "MLP",
    "ACT",
    "LOGICAL_AXES",
    "MeshResource",
    "logical_constraint",
    "logical_shard_counts",
    "placed_initializer",
    "check_explicit_mesh",
    "check_logical_axes",
    "sequence_parallel",
]

# The logical axis names te_jax's modules put on parameters and activations (the table above).
BATCH = "batch"
LENGTH = "length"
EMBED = "embed"
MLP = "mlp"
ACT = "act"
LOGICAL_AXES = (BATCH, LENGTH, EMBED, MLP, ACT)


# TransformerEngine's MeshResource fields for parallelism te_jax does not have.
_NOT_SUPPORTED = {
    "cp_resource": "context parallelism",
    "pp_resource": "pipeline parallelism",
    "ep_resource": "expert parallelism",
}


@dataclasses.dataclass(frozen=True)
class MeshResource:
    """The mesh axis (a name of the mesh, or ``None``) of each kind of parallelism.

    Attributes:
      dp_resource: data parallelism: the batch split over it, parameters replicated.
      fsdp_resource: fully sharded data parallelism: the batch split over it too, and every
        parameter split along its ``embed`` dimension.
      tp_resource: tensor parallelism: the MLP's intermediate dimension (``mlp``) split.
      sp_resource: sequence parallelism: the activations' ``length`` dimension split outside
        the tensor-parallel region (usually ``tp_resource``'s axis).
      tpsp_resource: TransformerEngine's name for tensor and sequence parallelism on one axis:
        sets ``tp_resource`` and ``sp_resource`` to it.
      cp_resource, pp_resource, ep_resource: TransformerEngine's context, pipeline and expert
        parallelism, which te_jax does not have: accepted as ``None`` only.

    Example:
      >>> import jax, jax.numpy as jnp, flax.linen as nn, te_jax.flax
      >>> from te_jax.sharding import MeshResource
      >>> resource = MeshResource(fsdp_resource="data", tp_resource="tensor")
      >>> resource.logical_axis_rules()
      (('batch', 'data'), ('length', None), ('embed', 'data'), ('mlp', 'tensor'), ('act', None))
      >>> mlp = te_jax.flax.LayerNormMLP(intermediate_dim=64, activations=("silu", "linear"))
      >>> shapes = jax.eval_shape(mlp.init, jax.random.key(0), jnp.ones((4, 32)))  # no compile
      >>> with nn.logical_axis_rules(resource.logical_axis_rules()):
      ...     specs = nn.logical_to_mesh(nn.get_partition_spec(shapes))
      >>> tuple(specs["params"]["wi_kernel"])             # (H, 2, I): FSDP, gate, tensor
      ('data', None, 'tensor')
    """

    dp_resource: str | None = None
    fsdp_resource: str | None = None
    tp_resource: str | None = None
    sp_resource: str | None = None
    tpsp_resource: str | None = None
    cp_resource: str | None = None
    pp_resource: str | None = None
    ep_resource: str | None = None

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if v is not None and not isinstance(v, str):
                raise TypeError(
                    f"te_jax.sharding.MeshResource: {f.name} must be a mesh axis name (str) or "
                    f"None, got {v!r}"
                )
        for field, what in _NOT_SUPPORTED.items():
            if getattr(self, field) is not None:
                raise ValueError(
                    f"te_jax.sharding.MeshResource: {field}={getattr(self, field)!r}: te_jax has "
                    f"no {what} (its ops shard over data, FSDP, tensor and sequence axes); "
                    f"leave {field} None"
                )
        if self.tpsp_resource is not None:
            for field in ("tp_resource", "sp_resource"):
                if getattr(self, field) not in (None, self.tpsp_resource):
                    raise ValueError(
                        f"te_jax.sharding.MeshResource: tpsp_resource={self.tpsp_resource!r} "
                        f"is tensor and sequence parallelism on one axis, but {field}="
                        f"{getattr(self, field)!r} names another: give one of them"
                    )
                object.__setattr__(self, field, self.tpsp_resource)
        if self.dp_resource is not None and self.dp_resource == self.fsdp_resource:
            raise ValueError(
                "te_jax.sharding.MeshResource: dp_resource and fsdp_resource name the same "
                f"mesh axis {self.dp_resource!r}; FSDP is data parallel already (give "
                "fsdp_resource alone)"
            )
        if self.tp_resource is not None and self.tp_resource in (
            self.dp_resource,
            self.fsdp_resource,
        ):
            raise ValueError(
                "te_jax.sharding.MeshResource: tp_resource must be an axis of its own, got "
                f"{self.tp_resource!r} for data parallelism too"
            )

    @property
    def batch_axes(self) -> tuple[str, ...]:
        """The mesh axes the batch is split over: data parallel, then FSDP."""
        return tuple(a for a in (self.dp_resource, self.fsdp_resource) if a is not None)

    def logical_axis_rules(self) -> tuple[tuple[str, str | tuple[str, ...] | None], ...]:
        """Flax logical axis rules (``nn.logical_axis_rules`` / ``nnx.logical_axis_rules``)
        mapping ``LOGICAL_AXES`` to this mesh's axes."""
        batch = self.batch_axes
        return (
            (BATCH, batch if len(batch) > 1 else (batch[0] if batch else None)),
            (LENGTH, self.sp_resource),
            (EMBED, self.fsdp_resource),
            (MLP, self.tp_resource),
            (ACT, None),
        )

    def check_mesh(self, mesh) -> None:
        """Raises ``ValueError`` if an axis named here is not an axis of ``mesh``."""
        names = tuple(mesh.axis_names)
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if v is not None and v not in names:
                raise ValueError(
                    f"te_jax.sharding.MeshResource: {f.name}={v!r} is not an axis of the mesh "
                    f"(axes {names})"
                )


def logical_constraint(x, axes):
    """``x`` constrained to the sharding its logical axis names give under the active Flax
    logical axis rules and mesh (``nn.with_logical_constraint``); ``x`` itself where ``axes``
    is ``None`` or no rules or mesh are active. The mesh is ``jax.set_mesh``'s, or where none
    is set that of an enclosing ``with mesh:`` block (which Flax alone would not see, dropping
    the constraint).

    Args:
      x: an array of any shape and dtype (returned in them).
      axes: one logical axis name (or ``None``) per axis of ``x``, e.g. ``("batch", "embed")``.

    Example:
      >>> import jax, jax.numpy as jnp, flax.linen as nn
      >>> from te_jax.sharding import MeshResource, logical_constraint
      >>> x = jnp.ones((4, 32), jnp.bfloat16)
      >>> logical_constraint(x, ("batch", "embed")) is x         # no rules, no mesh
      True
      >>> mesh = jax.make_mesh((1, 1), ("data", "tensor"),
      ...                      axis_types=(jax.sharding.AxisType.Auto,) * 2)
      >>> rules = MeshResource(dp_resource="data", tp_resource="tensor").logical_axis_rules()
      >>> with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
      ...     (eqn,) = jax.make_jaxpr(lambda x: logical_constraint(x, ("batch", "embed")))(x).eqns
      >>> eqn.primitive.name, tuple(eqn.params["sharding"].spec)
      ('sharding_constraint', ('data', None))
    """
    if axes is None:
        return x
    import flax.linen as nn  # noqa: PLC0415 -- Flax only where a model names its axes

    mesh = _legacy_mesh() if jax.sharding.get_abstract_mesh().empty else None
    return nn.with_logical_constraint(x, axes, mesh=mesh)


def logical_shard_counts(axes) -> tuple[int, ...]:
    """How many shards each axis of an array named ``axes`` is split into under the active Flax
    logical axis rules and mesh (``jax.set_mesh``'s, or an enclosing ``with mesh:`` block's):
    the product of the sizes of the mesh axes its name maps to; 1 for a ``None`` name and
    without rules or a mesh.

    Args:
      axes: one logical axis name (or ``None``) per axis, e.g. ``("embed", "mlp")``.

    Example:
      >>> import jax, flax.linen as nn
      >>> from te_jax.sharding import MeshResource, logical_shard_counts
      >>> logical_shard_counts(("batch", "embed"))               # no rules, no mesh
      (1, 1)
      >>> mesh = jax.make_mesh((1, 1), ("data", "tensor"),
      ...                      axis_types=(jax.sharding.AxisType.Auto,) * 2)
      >>> rules = MeshResource(dp_resource="data", tp_resource="tensor").logical_axis_rules()
      >>> with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
      ...     logical_shard_counts(("batch", None, "mlp"))
      (1, 1, 1)
    """
    import flax.linen as nn  # noqa: PLC0415 -- Flax only where a model names its axes

    axes = tuple(axes)
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        mesh = _legacy_mesh()
    if mesh is None or mesh.empty or not nn.get_logical_axis_rules():
        return (1,) * len(axes)
    sizes = dict(mesh.shape)
    counts = []
    for entry in nn.logical_to_mesh_axes(axes):
        names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        n = 1
        for name in names:
            n *= sizes.get(name, 1)
        counts.append(n)
    return tuple(counts)


def placed_initializer(init, axes):
    """``init`` whose value is placed on ``jax.set_mesh``'s mesh as its logical ``axes`` map
    under the active Flax rules: a parameter is created sharded, eagerly or under ``jit``
    (Flax's logical partitioning alone constrains it only where it is used). With
    ``Explicit`` mesh axes (``jax.make_mesh``'s default) it is resharded: there a constraint
    asserts a sharding rather than placing it, and Flax's would fail on the unsharded value.
    Without a mesh ``init``'s value is returned as it is.

    Example:
      >>> import jax, jax.numpy as jnp, flax.linen as nn
      >>> from te_jax.sharding import MeshResource, placed_initializer
      >>> init = placed_initializer(nn.initializers.ones, ("embed", "mlp"))
      >>> init(jax.random.key(0), (4, 8)).shape                  # no mesh: init's value
      (4, 8)
      >>> mesh = jax.make_mesh((1,), ("data",))                   # Explicit axes
      >>> rules = MeshResource(fsdp_resource="data").logical_axis_rules()
      >>> with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
      ...     w = init(jax.random.key(0), (4, 8))
      >>> tuple(w.sharding.spec)
      ('data', None)
    """

    def placed(key, shape, dtype=jnp.float32):
        value = init(key, shape, dtype)
        mesh = jax.sharding.get_abstract_mesh()
        if mesh.empty:
            return value
        import flax.linen as nn  # noqa: PLC0415 -- Flax only where a model names its axes

        spec = nn.logical_to_mesh_axes(axes)
        if jax.sharding.AxisType.Explicit in mesh.axis_types:
            return jax.sharding.reshard(value, spec)
        return jax.lax.with_sharding_constraint(value, spec)

    return placed


def check_explicit_mesh(where: str, **arrays) -> None:
    """A ``ValueError`` naming ``where`` if ``jax.set_mesh``'s mesh has ``Explicit`` axes and one
    of ``arrays`` is sharded over them. te_jax's ops shard by propagation (their kernels'
    partitioning rules, XLA's sharding passes): meshes with ``Auto`` axes, or ``shard_map``.
    Under explicit sharding (sharding in types) JAX asks every op for its output's sharding and
    asserts every constraint, which te_jax's ops do not answer. Replicated arrays pass.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from te_jax.sharding import check_explicit_mesh
      >>> check_explicit_mesh("my_op", x=jnp.ones((4, 8)))       # no mesh: nothing to check
      >>> mesh = jax.make_mesh((1,), ("data",))                   # Explicit axes
      >>> with jax.set_mesh(mesh):
      ...     x = jax.sharding.reshard(jnp.ones((4, 8)), jax.P("data"))
      ...     try:
      ...         check_explicit_mesh("my_op", x=x)
      ...     except ValueError as e:
      ...         print(str(e)[:50])
      my_op: x is sharded ('data', None) over a mesh wit
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or jax.sharding.AxisType.Explicit not in mesh.axis_types:
        return
    for name, a in arrays.items():
        if a is None:
            continue
        spec = getattr(jax.typeof(a).sharding, "spec", None)
        if spec is not None and any(s is not None for s in spec):
            raise ValueError(
                f"{where}: {name} is sharded {tuple(spec)} over a mesh with Explicit axes "
                f"({dict(zip(mesh.axis_names, mesh.axis_types, strict=True))}); te_jax's ops "
                "shard by propagation: make the mesh with Auto axes, e.g. jax.make_mesh(shape, "
                "names, axis_types=(jax.sharding.AxisType.Auto,) * len(names)), or run the op "
                "inside jax.shard_map"
            )


def _legacy_mesh():
    """The ``jax.sharding.Mesh`` of an enclosing ``with mesh:`` block, or ``None``.

    JAX deprecated that context for ``jax.set_mesh`` but still honours it in ``jit``; its mesh
    is readable only through the deprecated ``thread_resources`` (its warning is silenced here:
    the user chose the context, te_jax only follows it)."""
    from jax.interpreters import pxla  # noqa: PLC0415

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        resources = getattr(pxla, "thread_resources", None)
    if resources is None:  # a JAX without the old context
        return None
    mesh = resources.env.physical_mesh
    return None if mesh.empty else mesh


def check_logical_axes(where: str, what: str, axes, ndim: int) -> tuple[str | None, ...] | None:
    """``axes`` as a tuple of one logical name (or ``None``) per axis of an ``ndim`` array.

    ``None`` stays ``None``; anything else not of that form is a ``ValueError`` naming
    ``where`` and ``what``.

    Example:
      >>> from te_jax.sharding import check_logical_axes
      >>> check_logical_axes("my_layer", "kernel_axes", ["embed", "mlp"], 2)
      ('embed', 'mlp')
      >>> check_logical_axes("my_layer", "kernel_axes", ("embed",), 2)  # doctest: +ELLIPSIS
      Traceback (most recent call last):
        ...
      ValueError: my_layer: kernel_axes must name each of the 2 axes (...), got ('embed',)
    """
    if axes is None:
        return None
    axes = tuple(axes)
    if len(axes) != ndim or not all(a is None or isinstance(a, str) for a in axes):
        raise ValueError(
            f"{where}: {what} must name each of the {ndim} axes (a str or None each), got {axes!r}"
        )
    return axes


def sequence_parallel() -> bool:
    """Whether the active Flax logical axis rules split the ``length`` axis (sequence
    parallelism: ``MeshResource.sp_resource``).

    Example:
      >>> import flax.linen as nn
      >>> from te_jax.sharding import MeshResource, sequence_parallel
      >>> with nn.logical_axis_rules(MeshResource(tpsp_resource="tensor").logical_axis_rules()):
      ...     sequence_parallel()
      True
      >>> sequence_parallel()                                   # no rules active
      False
    """
    from flax.core import spmd  # noqa: PLC0415 -- Flax only where a model shards

    return any(name == LENGTH and axes is not None for name, axes in spmd.get_logical_axis_rules())
