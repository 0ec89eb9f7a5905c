"""Which mesh axis does what: data, FSDP, tensor and sequence parallelism for te_jax's ops and
modules, as Flax logical axis rules.

te_jax's ops shard the way XLA's own do: under ``jax.jit`` with sharded inputs and parameters
(``NamedSharding``), each op runs on its shards and communicates only what its math needs
(``te_jax.primitives.gemm_sharding``: the weight, never the activation, is gathered; a split
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
``sp_resource``, ``embed`` and ``mlp`` as above where the axis is still free.

With ``tp_resource`` the MLP is Megatron-style: ``wi`` (``(H, I)``, gated ``(H, 2, I)``) column
parallel, the activation and its gradient local to each shard, ``wo`` (``(I, H)``) row
parallel with one all-reduce of the output in the forward and one of ``dx`` in the backward.
With ``fsdp_resource`` every parameter is split over that axis and all-gathered just before its
GEMM, and its gradient reduce-scattered.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp

__all__ = [
    "MeshResource",
    "LOGICAL_AXES",
    "parse_mesh",
    "logical_constraint",
    "sequence_parallel",
    "hlo_collectives",
]

# The logical axis names te_jax's modules and examples use.
LOGICAL_AXES = ("batch", "length", "embed", "mlp", "act")


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
    """

    dp_resource: str | None = None
    fsdp_resource: str | None = None
    tp_resource: str | None = None
    sp_resource: str | None = None

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if v is not None and not isinstance(v, str):
                raise TypeError(
                    f"te_jax.sharding.MeshResource: {f.name} must be a mesh axis name (str) or "
                    f"None, got {v!r}"
                )
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
            ("batch", batch if len(batch) > 1 else (batch[0] if batch else None)),
            ("length", self.sp_resource),
            ("embed", self.fsdp_resource),
            ("mlp", self.tp_resource),
            ("act", None),
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


def parse_mesh(text: str) -> dict[str, int]:
    """``"data=2,tensor=4"`` -> ``{"data": 2, "tensor": 4}`` (the examples' ``--mesh``)."""
    out: dict[str, int] = {}
    for part in (p.strip() for p in text.split(",") if p.strip()):
        name, sep, size = part.partition("=")
        if not sep or not name.strip() or not size.strip().isdigit() or int(size) < 1:
            raise ValueError(f"--mesh: {part!r} must be name=size with size >= 1, e.g. data=2")
        if name.strip() in out:
            raise ValueError(f"--mesh: axis {name.strip()!r} given twice")
        out[name.strip()] = int(size)
    if not out:
        raise ValueError("--mesh: give at least one axis, e.g. data=8")
    return out


def logical_constraint(x, axes):
    """``x`` constrained to the sharding its logical axis names give under the active Flax
    logical axis rules and mesh (``nn.with_logical_constraint``); ``x`` itself where ``axes``
    is ``None`` or no rules or mesh are active."""
    if axes is None:
        return x
    import flax.linen as nn  # noqa: PLC0415 -- Flax only where a model names its axes

    return nn.with_logical_constraint(x, axes)


def check_logical_axes(where: str, what: str, axes, ndim: int) -> tuple[str | None, ...] | None:
    """``axes`` as a tuple of one logical name (or ``None``) per axis of an ``ndim`` array."""
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
    parallelism: ``MeshResource.sp_resource``)."""
    from flax.core import spmd  # noqa: PLC0415 -- Flax only where a model shards

    return any(
        name == "length" and axes is not None for name, axes in spmd.get_logical_axis_rules()
    )


_WHOLE = ("batch", None, "embed")  # (batch, length, hidden), the sequence whole
_SPLIT = ("batch", "length", "embed")  # the sequence split over sp_resource


def gather_sequence(x):
    """``x (batch, length, hidden)``, split along ``length`` under sequence parallelism, made
    whole for the tensor-parallel region: an all-gather forward, a reduce-scatter of the
    gradient backward. ``x`` itself otherwise."""
    if jnp.ndim(x) != 3 or not sequence_parallel():
        return x
    return _gather(x)


def split_sequence(x):
    """``x (batch, length, hidden)`` split along ``length`` again after the tensor-parallel
    region: the row-parallel GEMM's sum becomes a reduce-scatter forward, the gradient an
    all-gather backward. ``x`` itself otherwise."""
    if jnp.ndim(x) != 3 or not sequence_parallel():
        return x
    return _split(x)


# Each direction's constraint is the other's in the backward (with_sharding_constraint alone
# would keep the gradient whole, an all-reduce where Megatron's reduce-scatter belongs).
@jax.custom_vjp
def _gather(x):
    return logical_constraint(x, _WHOLE)


@jax.custom_vjp
def _split(x):
    return logical_constraint(x, _SPLIT)


_gather.defvjp(lambda x: (_gather(x), None), lambda _, g: (logical_constraint(g, _SPLIT),))
_split.defvjp(lambda x: (_split(x), None), lambda _, g: (logical_constraint(g, _WHOLE),))


_COLLECTIVE_KINDS = (
    "all-gather",
    "all-reduce",
    "reduce-scatter",
    "all-to-all",
    "collective-permute",
)
# "name = TYPE KIND(ARGS)"; TYPE may be a tuple (XLA:GPU combines collectives), nested and with
# /*index=N*/ comments, so it is everything between "= " and the kind.
_COLLECTIVE = re.compile(
    r"= (?P<type>[^\n]*?) (?P<kind>"
    + "|".join(_COLLECTIVE_KINDS)
    + r")(?P<start>-start)?\((?P<args>[^)]*)\)"
)


def _tuple_elements(hlo_type: str) -> list[str] | None:
    """The top-level elements of an HLO tuple type, or None where the type is not a tuple."""
    t = re.sub(r"/\*index=\d+\*/", "", hlo_type).strip()
    if not t.startswith("("):
        return None
    parts, depth, start = [], 0, 1
    for i, ch in enumerate(t):
        if ch in "({[":
            depth += 1
        elif ch in ")}]":
            depth -= 1
        elif ch == "," and depth == 1:
            parts.append(t[start:i].strip())
            start = i + 1
    parts.append(t[start:-1].strip())
    return parts


def _async_result(kind: str, hlo_type: str, n_operands: int) -> str:
    """The result type of an async ``-start``: XLA types it ``(operands, results, ...)`` (the
    operands a tuple when there are several, or a 1-tuple for an all-reduce; a
    collective-permute adds context scalars); a start typed as its result alone is returned
    as is."""
    parts = _tuple_elements(hlo_type)
    if parts is None or len(parts) < 2:
        return hlo_type
    first = _tuple_elements(parts[0])
    if kind == "collective-permute" or (first is None and n_operands == 1 and len(parts) == 2):
        return parts[1]
    if first is not None and len(first) == n_operands and len(parts) == 2:
        return parts[1]
    return hlo_type


def hlo_collectives(hlo_text: str) -> list[tuple[str, str, tuple[str, ...]]]:
    """``(kind, result type, operand names)`` of each collective in compiled HLO text, e.g.
    ``jax.jit(step).lower(*args).compile().as_text()``: what a sharded step communicates.

    Kinds: ``all-gather``, ``all-reduce``, ``reduce-scatter``, ``all-to-all``,
    ``collective-permute``. An async pair (``-start`` / ``-done``) counts once, under its kind,
    with the type of its result (XLA types the start ``(operands, results)``). The result type
    is HLO's text (a tuple for a combined collective), the operands their names without ``%``.
    """
    out = []
    for m in _COLLECTIVE.finditer(hlo_text):
        operands = tuple(a.strip().lstrip("%") for a in m["args"].split(",") if a.strip())
        hlo_type = m["type"]
        if m["start"]:
            hlo_type = _async_result(m["kind"], hlo_type, len(operands))
        out.append((m["kind"], hlo_type, operands))
    return out
