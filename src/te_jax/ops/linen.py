"""``LinenSequential``: a ``te_jax.ops.Sequential`` as a Linen module.

The Linen module holds no operation objects (NNX modules are stateful; a Linen module's fields
are static settings): it holds zero-argument callables that make them, e.g.
``functools.partial(ops.Linear, 512, 2048)``, and builds the ``Sequential`` from them on each
call (Flax's ``nnx.bridge.ToLinen``, which then loads the Linen variables into it; under ``jit``
the construction costs nothing). The variables are the te_jax Linen modules':

* ``"params"``: each op's parameters, named ``ops/<index>/<name>`` (``ops/1/kernel``), boxed in
  ``nn.LogicallyPartitioned`` with the op's logical axis names where it has them, so
  ``nn.get_partition_spec`` and ``nn.logical_to_mesh_sharding`` shard them as the modules' own;
* ``"fp8_metas"`` (delayed scaling): each ``Linear``'s quantizer state, whose gradient is the
  next state (``te_jax.flax.update_fp8_metas``), as in ``te_jax.flax.LayerNormMLP``.

Dropout draws from the ``"dropout"`` rng stream given to ``apply`` and is off with
``deterministic=True``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import flax.linen as nn
from flax import nnx
from flax.nnx import bridge

from te_jax.ops.base import BasicOperation
from te_jax.ops.basic import Dropout
from te_jax.ops.sequential import Sequential
from te_jax.recipe import Recipe

__all__ = ["LinenSequential"]

_WHERE = "te_jax.ops.LinenSequential"


class LinenSequential(nn.Module):
    """Basic ops in a row, run as their fused plan: ``te_jax.ops.Sequential`` in Linen.

    Attributes:
      ops: zero-argument callables, each returning one ``BasicOperation`` (an op class without
        required arguments, or ``functools.partial(ops.Linear, d, 4 * d)``), in order.
      recipe: ``None`` or a ``te_jax.recipe`` recipe (``Sequential``'s).
      fuse: ``False`` runs each basic op on its own.

    Calling it: ``module.apply(variables, x, *extra_inputs, deterministic=False,
    rngs={"dropout": key})`` (the key only with an active ``Dropout``). Returns the
    ``Sequential``'s output, ``(..., F)`` in x's dtype.

    Under a delayed-scaling recipe a training step takes ``grads = jax.grad(loss)(variables,
    x)`` and ``variables = te_jax.flax.update_fp8_metas(variables, grads)`` (besides the
    optimizer's update of ``"params"``).

    Example:
      >>> import functools, jax, jax.numpy as jnp
      >>> from te_jax import ops
      >>> d = 32
      >>> mlp = ops.LinenSequential((
      ...     functools.partial(ops.LayerNorm, d), functools.partial(ops.Linear, d, 2 * d),
      ...     functools.partial(ops.Bias, 2 * d), functools.partial(ops.Activation, "gelu"),
      ...     functools.partial(ops.Linear, 2 * d, d), functools.partial(ops.Bias, d)))
      >>> x = jnp.ones((4, d), jnp.bfloat16)
      >>> variables = mlp.init(jax.random.key(0), x)
      >>> jax.tree.map(jnp.shape, variables["params"]["seq"]["ops"][1])    # ops/1/kernel
      {'kernel': (32, 64)}
      >>> mlp.apply(variables, x).shape
      (4, 32)
    """

    ops: Sequence[Callable[[], BasicOperation]]
    recipe: Recipe | None = None
    fuse: bool = True

    @nn.compact
    def __call__(self, x, *extra_inputs, deterministic: bool = False):
        if isinstance(self.ops, BasicOperation) or not isinstance(self.ops, Sequence):
            raise TypeError(
                f"{_WHERE}: ops must be a sequence of callables that make the operations, "
                f"e.g. (functools.partial(ops.Linear, 64, 256), ops.Identity), got "
                f"{type(self.ops).__name__}"
            )
        settings = dict(
            factories=tuple(self.ops),
            recipe=self.recipe,
            fuse=self.fuse,
            deterministic=bool(deterministic),
            has_dropout_rng=self.has_rng("dropout"),
        )
        inner = bridge.ToLinen(_build, kwargs=settings, metadata_fn=_linen_value, name="seq")
        return inner(x, *extra_inputs)


def _build(factories, recipe, fuse, deterministic, has_dropout_rng, rngs) -> Sequential:
    """The ``Sequential`` the factories describe (ToLinen's constructor, on every call)."""
    made = []
    for i, make in enumerate(factories):
        if isinstance(make, BasicOperation) or not callable(make):
            raise TypeError(
                f"{_WHERE}: ops[{i}] is a {type(make).__name__}: give a callable that makes the "
                "operation (e.g. functools.partial(ops.Linear, 64, 256)), not an operation "
                "object (a Linen module's fields hold settings, not NNX state)"
            )
        op = make()
        if not isinstance(op, BasicOperation):
            raise TypeError(
                f"{_WHERE}: ops[{i}]() returned a {type(op).__name__}, not a "
                "te_jax.ops.BasicOperation"
            )
        made.append(op)
    active = [i for i, op in enumerate(made) if isinstance(op, Dropout) and op.rate > 0.0]
    if active and not deterministic and not has_dropout_rng:
        raise ValueError(
            f"{_WHERE}: the Dropout at ops[{active[0]}] needs a 'dropout' rng: "
            "apply(..., rngs={'dropout': key}), or call it with deterministic=True"
        )
    seq = Sequential(*made, recipe=recipe, fuse=fuse, rngs=rngs)
    if deterministic:
        seq.eval()
    return seq


def _linen_value(variable: nnx.Variable):
    """A Linen variable's value: a parameter with logical axis names boxed in
    ``nn.LogicallyPartitioned`` (te_jax.flax's convention), anything else bare."""
    axes = variable.get_metadata().get("out_sharding")
    if isinstance(variable, nnx.Param) and axes is not None:
        return nn.LogicallyPartitioned(variable.get_value(), tuple(axes))
    return variable.get_value()
