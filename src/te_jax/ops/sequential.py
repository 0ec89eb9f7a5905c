"""``Sequential``: basic ops run as one differentiable function built from their fused plan.

The forward runs the forward plan's ``fuser_forward``s in order, the backward the backward
plan's ``fuser_backward``s in reverse, as one ``jax.custom_vjp`` whose residuals are the ops'
``OperationContext``s. Both plans cover the same basic ops and exchange one context per basic
op, so a fusion in one direction needs none in the other. Parameters and FP8 state are read
from the NNX variables before the ``custom_vjp`` and are its inputs: ``nnx.grad`` gives each
parameter's gradient and (delayed scaling) each ``FP8Meta``'s next state, as the te_jax
modules do (``te_jax.nnx.update_fp8_state``).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from te_jax import fp8_autodiff
from te_jax.ops.base import BasicOperation, FusibleOperation, OpArgs, OpGrads, plain
from te_jax.ops.context import OperationContext
from te_jax.ops.registry import backward_fusions, build_plan, forward_fusions
from te_jax.recipe import Recipe, autocast_recipe

__all__ = ["Sequential"]

_WHERE = "te_jax.ops.Sequential"


class Sequential(nnx.Module):
    """Basic ops in a row, run as their fused plan.

    Args:
      *ops: ``BasicOperation``s (``te_jax.ops.Linear``, ``Bias``, ``Activation``, ... or one of
        your own), applied in order.
      recipe: ``None`` or a ``te_jax.recipe`` recipe: every ``Linear`` then runs its GEMMs in
        FP8 with its own quantizers (delayed scaling's state as ``FP8Meta`` variables).
        ``None`` inside ``te_jax.autocast`` takes its recipe (where the sequence has a
        ``Linear``).
      fuse: ``False`` runs each basic op on its own (the unfused plan, for comparison).
      rngs: ``nnx.Rngs`` for the ops built without one (their parameters, dropout keys).

    Calling it: ``seq(x, *extra_inputs)`` (one extra input per ``AddExtraInput``, in order).
    Reverse-mode differentiable (``jax.grad`` / ``nnx.grad``); ``jit``, ``nnx.jit``,
    ``nnx.scan``, ``nnx.remat``.

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> from te_jax import ops
      >>> seq = ops.Sequential(ops.RMSNorm(32), ops.Linear(32, 64), ops.Bias(64),
      ...                      ops.Activation("gelu"), ops.Linear(64, 32), ops.Bias(32),
      ...                      ops.AddResidual(), rngs=nnx.Rngs(0))
      >>> [repr(op) for op in seq.fused_plan()]
      ['RMSNorm', 'MLP(Linear, Bias, Activation, Linear, Bias)', 'AddResidual']
      >>> seq(jnp.ones((4, 32), jnp.bfloat16)).shape
      (4, 32)
    """

    def __init__(
        self,
        *ops: BasicOperation,
        recipe: Recipe | None = None,
        fuse: bool = True,
        rngs: nnx.Rngs | None = None,
    ):
        if not ops:
            raise ValueError(f"{_WHERE}: give at least one operation")
        for i, op in enumerate(ops):
            if not isinstance(op, BasicOperation):
                raise TypeError(
                    f"{_WHERE}: operation {i} is a {type(op).__name__}, not a "
                    "te_jax.ops.BasicOperation (te_jax.ops.Linear, Bias, Activation, ... or a "
                    "subclass of BasicOperation)"
                )
        if recipe is not None and not isinstance(recipe, Recipe):
            raise TypeError(
                f"{_WHERE}: recipe must be a te_jax.recipe recipe (DelayedScaling(), "
                "CurrentScaling(), MXFP8BlockScaling(), Float8BlockScaling()) or None, got "
                f"{type(recipe).__name__}"
            )
        if recipe is None and any(op.uses_recipe for op in ops):
            recipe = autocast_recipe()  # te_jax.autocast's, where one is active
        if recipe is not None and not any(op.uses_recipe for op in ops):
            raise ValueError(
                f"{_WHERE}: a recipe ({type(recipe).__name__}) was given but no operation "
                "quantizes (none is a te_jax.ops.Linear): drop the recipe or add the Linear"
            )
        # Layouts first: a parameter's shape may follow its neighbours (a gated kernel).
        for i, op in enumerate(ops):
            op.plan_layout(ops[i + 1 :])
        for i, op in enumerate(ops):
            op.build(i, rngs, recipe)
        self.ops = nnx.List(list(ops))
        self.recipe = recipe
        self.fuse = bool(fuse)

    # ---- the plans --------------------------------------------------------------------------

    def fused_plan(self, direction: str = "forward") -> list[FusibleOperation]:
        """The plan a call runs: basic ops, and ``FusedOperation``s where a registered fusion
        applies (``direction``: ``"forward"`` or ``"backward"``)."""
        if direction not in ("forward", "backward"):
            raise ValueError(
                f"{_WHERE}.fused_plan: direction must be 'forward' or 'backward', got {direction!r}"
            )
        ops = list(self.ops)
        if not self.fuse:
            return ops
        return build_plan(ops, forward_fusions() if direction == "forward" else backward_fusions())

    # ---- a call -----------------------------------------------------------------------------

    def __call__(self, x, *extra_inputs):
        ops = tuple(self.ops)
        x = jnp.asarray(x)
        shape = tuple(x.shape)
        for i, op in enumerate(ops):
            shape = op.check_input(i, shape)
        extra = iter(extra_inputs)
        args = [op.op_args(x, extra) for op in ops]
        left = sum(1 for _ in extra)
        if left:
            n = sum(1 for op in ops if op.takes_extra_input)
            raise ValueError(
                f"{_WHERE}: {len(extra_inputs)} extra inputs given, the sequence takes {n} (one "
                "per AddExtraInput)"
            )
        plans = (_spans(self.fused_plan("forward")), _spans(self.fused_plan("backward")))
        return _run(plans, ops, x, args)


def _spans(plan) -> tuple[tuple[FusibleOperation, int, int], ...]:
    """Each planned op with the range ``[start, stop)`` of the basic ops it runs."""
    out, i = [], 0
    for op in plan:
        n = len(op.basic_ops)
        out.append((op, i, i + n))
        i += n
    return tuple(out)


# ---- the differentiable function ------------------------------------------------------------


def _run(plans, ops, x, args):
    forward_plan, backward_plan = plans
    # Basic op index -> the planned op running it, with its span.
    forward_at = {i: span for span in forward_plan for i in range(span[1], span[2])}
    backward_at = {i: span for span in backward_plan for i in range(span[1], span[2])}

    def forward(x, args, training):
        ctxs = [OperationContext(training) for _ in ops]
        h = x
        for fop, i0, i1 in forward_plan:
            nxt = None
            if i1 < len(ops):  # the planned op that takes this output answers the hand-off
                nop, j0, _ = forward_at[i1]
                nxt = nop.input_quantizer(args[j0], training)
            h = fop.fuser_forward(ctxs[i0:i1], h, args=args[i0:i1], next_op_input_quantizer=nxt)
        return plain(h).astype(x.dtype) if _is_quantized(h) else h, ctxs

    @jax.custom_vjp
    def run(x, args):
        return forward(x, args, False)[0]

    def run_fwd(x, args):
        (x, args), perturbed = fp8_autodiff.unwrap_primals((x, args))
        if fp8_autodiff.under_jvp((x, args)):
            raise TypeError(fp8_autodiff.forward_mode_message(_WHERE))
        flags = _flags(args, perturbed, x)
        operands = [p for kind, p in flags if kind == "operand"]
        states = [[p for kind, p in flags if kind == ("state", i)] for i in _state_owners(args)]
        fp8_autodiff.check_state_differentiated(_WHERE, operands, states)
        y, ctxs = forward(x, args, True)
        return y, (ctxs, args, x)

    def run_bwd(res, dy):
        ctxs, args, x = res
        dy = fp8_autodiff.instantiate(dy)
        grads: list[OpGrads | None] = [None] * len(ops)
        for fop, i0, i1 in reversed(backward_plan):
            prev = None
            if i0:  # the planned op whose backward takes this gradient answers the hand-off
                pop, _, j1 = backward_at[i0 - 1]
                prev = pop.grad_output_quantizer(args[j1 - 1], ctxs[j1 - 1])
            dy, gs = fop.fuser_backward(ctxs[i0:i1], dy, prev_op_grad_output_quantizer=prev)
            grads[i0:i1] = gs
        dx = plain(dy).astype(x.dtype)
        return dx, [_cotangent(a, g) for a, g in zip(args, grads, strict=True)]

    run.defvjp(run_fwd, run_bwd, symbolic_zeros=True)
    return fp8_autodiff.reverse_mode_only(_WHERE, run, x, args)


def _is_quantized(h) -> bool:
    return not isinstance(h, jax.Array) and hasattr(h, "dequantize")


def _state_owners(args: Sequence[OpArgs]) -> list[int]:
    """The ops whose quantizer set carries state (delayed scaling)."""
    return [i for i, a in enumerate(args) if jax.tree.leaves(a.quantizer_set)]


def _flags(args, perturbed, x):
    """``(kind, perturbed)`` per leaf of ``(x, args)`` in flattening order: ``"operand"`` for
    x, parameters and extra inputs, ``("state", i)`` for op i's quantizer-set leaves."""
    kinds = ["operand"] * len(jax.tree.leaves(x))
    for i, a in enumerate(args):
        kinds += ["operand"] * len(jax.tree.leaves(a.params))
        kinds += [("state", i)] * len(jax.tree.leaves(a.quantizer_set))
        kinds += ["operand"] * len(jax.tree.leaves(a.extra))
    return list(zip(kinds, perturbed, strict=True))


def _cotangent(a: OpArgs, g: OpGrads | None) -> OpArgs:
    """``g`` in the structure and dtypes of ``a`` (zeros where an op gave none)."""
    g = g or OpGrads()
    params = {k: _like(v, g.params.get(k)) for k, v in a.params.items()}
    qs = a.quantizer_set
    if qs is not None and jax.tree.leaves(qs):
        qs = g.quantizer_set if g.quantizer_set is not None else jax.tree.map(jnp.zeros_like, qs)
    extra = {k: _like(v, g.extra.get(k)) for k, v in a.extra.items()}
    return OpArgs(params, qs, extra)


def _like(primal, ct):
    """A cotangent for ``primal``: ``ct`` cast to its dtype, zeros where ``ct`` is ``None``,
    ``None`` for an integer or key input (no cotangent)."""
    if primal is None:
        return None
    dtype = jnp.result_type(primal)
    if not jnp.issubdtype(dtype, jnp.inexact):
        return None
    if ct is None:
        return jnp.zeros(jnp.shape(primal), dtype)
    return jnp.asarray(plain(ct)).reshape(jnp.shape(primal)).astype(dtype)
