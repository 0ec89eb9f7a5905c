"""Fusions: functions that rewrite a plan (a list of ``FusibleOperation``s) into one with some
runs of basic ops replaced by a ``FusedOperation``. The forward and the backward have their own
lists (a fusion may apply in one direction only); ``Sequential`` applies each list in order.

A fusion is ``plan -> plan``; ``fuse_pattern`` writes the common kind, a run of basic op types
replaced where a condition holds::

    def my_fusion(plan):
        return te_jax.ops.fuse_pattern(plan, (Linear, Scale), lambda ops: LinearScale(ops))

    te_jax.ops.register_forward_fusion(my_fusion)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from te_jax.ops.base import BasicOperation, FusedOperation, FusibleOperation

__all__ = [
    "Fusion",
    "register_forward_fusion",
    "register_backward_fusion",
    "forward_fusions",
    "backward_fusions",
    "fuse_pattern",
    "build_plan",
]

Fusion = Callable[[list[FusibleOperation]], list[FusibleOperation]]

_FORWARD: list[Fusion] = []
_BACKWARD: list[Fusion] = []


def _register(registry: list[Fusion], fusion: Fusion, prepend: bool) -> Fusion:
    if not callable(fusion):
        raise TypeError(f"te_jax.ops: a fusion must be callable (plan -> plan), got {fusion!r}")
    if fusion not in registry:
        registry.insert(0, fusion) if prepend else registry.append(fusion)
    return fusion


def register_forward_fusion(fusion: Fusion, *, prepend: bool = False) -> Fusion:
    """Add ``fusion`` to the forward's list (after the others, or first with ``prepend``: a
    fusion applied earlier claims its ops first). Returns it, so it can be a decorator.

    A fusion is ``plan -> plan`` (a list of ``FusibleOperation``s); registered for good, it
    applies to every ``Sequential`` whose ops it matches.

    Example:
      >>> import jax.numpy as jnp
      >>> from te_jax import ops
      >>> class Double(ops.BasicOperation):
      ...     def op_forward(self, ctx, x, args, **_):
      ...         return 2 * x
      >>> class Quadruple(ops.FusedOperation):              # two Doubles in one pass
      ...     def fuser_forward(self, ctxs, x, *, args, next_op_input_quantizer):
      ...         return 4 * x
      >>> @ops.register_forward_fusion
      ... def fuse_doubles(plan):
      ...     return ops.fuse_pattern(plan, (Double, Double), Quadruple)
      >>> seq = ops.Sequential(Double(), Double())
      >>> seq.fused_plan(), seq.fused_plan("backward")
      ([Quadruple(Double, Double)], [Double, Double])
      >>> seq(jnp.ones(2)).tolist()
      [4.0, 4.0]
    """
    return _register(_FORWARD, fusion, prepend)


def register_backward_fusion(fusion: Fusion, *, prepend: bool = False) -> Fusion:
    """Add ``fusion`` to the backward's list (see ``register_forward_fusion``). Returns it.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from te_jax import ops
      >>> class Double(ops.BasicOperation):
      ...     def op_forward(self, ctx, x, args, **_):
      ...         return 2 * x
      ...
      ...     def op_backward(self, ctx, dy):
      ...         return 2 * dy, {}
      >>> class QuadrupleBackward(ops.FusedOperation):      # both backwards in one pass
      ...     def fuser_backward(self, ctxs, dy, *, prev_op_grad_output_quantizer):
      ...         return 4 * dy, [ops.OpGrads(), ops.OpGrads()]
      >>> @ops.register_backward_fusion
      ... def fuse_double_backwards(plan):
      ...     return ops.fuse_pattern(plan, (Double, Double), QuadrupleBackward)
      >>> seq = ops.Sequential(Double(), Double())
      >>> seq.fused_plan("backward")
      [QuadrupleBackward(Double, Double)]
      >>> jax.grad(lambda x: seq(x).sum())(jnp.ones(2)).tolist()
      [4.0, 4.0]
    """
    return _register(_BACKWARD, fusion, prepend)


def forward_fusions() -> tuple[Fusion, ...]:
    return tuple(_FORWARD)


def backward_fusions() -> tuple[Fusion, ...]:
    return tuple(_BACKWARD)


def fuse_pattern(
    plan: Sequence[FusibleOperation],
    pattern: Sequence[type],
    make: Callable[[tuple[BasicOperation, ...]], FusedOperation | None],
) -> list[FusibleOperation]:
    """``plan`` with each run of basic ops of the types in ``pattern`` (in order, not yet
    fused) replaced by ``make(run)``, scanning left to right; where ``make`` returns ``None``
    (its condition does not hold) the run is left alone.

    Example:
      >>> from flax import nnx
      >>> from te_jax import ops
      >>> plan = [ops.Linear(32, 64, rngs=nnx.Rngs(0)), ops.Bias(64, rngs=nnx.Rngs(0)),
      ...         ops.Activation("gelu")]
      >>> ops.fuse_pattern(plan, (ops.Linear, ops.Bias), ops.ForwardLinearBiasActivation)
      [ForwardLinearBiasActivation(Linear, Bias), Activation]
    """
    plan, out, i, n = list(plan), [], 0, len(pattern)
    while i < len(plan):
        run = plan[i : i + n]
        if len(run) == n and all(
            isinstance(op, BasicOperation) and isinstance(op, t)
            for op, t in zip(run, pattern, strict=True)
        ):
            fused = make(tuple(run))
            if fused is not None:
                out.append(fused)
                i += n
                continue
        out.append(plan[i])
        i += 1
    return out


def build_plan(ops: Sequence[BasicOperation], fusions: Sequence[Fusion]) -> list[FusibleOperation]:
    """``ops`` rewritten by each of ``fusions`` in turn; each fusion must keep the basic ops,
    in order (it groups them, never drops or reorders one)."""
    plan: list[FusibleOperation] = list(ops)
    for fusion in fusions:
        new = list(fusion(list(plan)))
        flat = [b for op in new for b in op.basic_ops]
        if len(flat) != len(ops) or any(a is not b for a, b in zip(flat, ops, strict=True)):
            raise ValueError(
                f"te_jax.ops: the fusion {getattr(fusion, '__name__', fusion)!r} changed the "
                "sequence's basic ops (a fusion groups consecutive ops, in order)"
            )
        plan = new
    return plan
