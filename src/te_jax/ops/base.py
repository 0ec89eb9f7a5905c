"""The operation model: ``FusibleOperation`` (what a ``Sequential`` runs), ``BasicOperation``
(one op: a user subclasses it) and ``FusedOperation`` (several basic ops run as one), with what
crosses between them: ``OpArgs`` (an op's parameters, quantizer set and extra inputs),
``OpGrads`` (their cotangents) and ``Handoff`` (the quantizer a neighbour quantizes with).

A basic op's forward is ``op_forward(ctx, x, args, *, next_op_input_quantizer,
prev_op_grad_output_quantizer) -> y``; its backward ``op_backward(ctx, dy) -> (dx, dparams)``
(or an ``OpGrads``). Everything an op reads that is a JAX value comes through ``args``
(``Sequential`` reads the NNX variables outside the differentiated function), so the forward
and the backward are pure functions of their arguments.

**The quantizer hand-off.** Under an FP8 recipe an op whose output feeds a ``Linear`` may
quantize it with that Linear's input quantizer (``next_op_input_quantizer``), in the same pass
as its own work (the activation's ``act_lu`` kernel, the norm); the Linear then uses it as it is.
In the backward an op whose input gradient feeds a Linear's backward may quantize it with that
Linear's gradient quantizer (``prev_op_grad_output_quantizer``: the fused dact + dbias +
quantize kernel). Each tensor is then quantized once. A ``Handoff`` says what the consumer
accepts; an op that cannot produce it returns a plain array and the consumer quantizes.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from te_jax.ops.context import OperationContext
from te_jax.quantize import quantize
from te_jax.quantize.scaled_tensor import ScaledTensor

__all__ = [
    "OpArgs",
    "OpGrads",
    "Handoff",
    "FusibleOperation",
    "BasicOperation",
    "FusedOperation",
    "plain",
]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class OpArgs:
    """What one basic op's forward reads besides its input.

    Attributes:
      params: the op's parameters by name (the values of its ``nnx.Param`` attributes).
      quantizer_set: the op's ``QuantizerSet`` under a recipe (a ``Linear``), else ``None``.
      extra: other inputs by name: a dropout key, the residual an ``AddResidual`` adds.

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> from te_jax import ops
      >>> linear = ops.Linear(32, 16, rngs=nnx.Rngs(0))
      >>> x = jnp.ones((4, 32))
      >>> args = linear.op_args(x, iter(()))
      >>> args.params["kernel"].shape, args.quantizer_set, args.extra
      ((32, 16), None, {})
      >>> ops.AddResidual().op_args(x, iter(())).extra["input"] is x   # the sequence's input
      True
    """

    params: dict[str, Any] = dataclasses.field(default_factory=dict)
    quantizer_set: Any = None
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class OpGrads:
    """The cotangents of one basic op's ``OpArgs``: the parameters' gradients (by name), the
    quantizer set's next state (delayed scaling: the convention of ``te_jax.recipe``) and the
    extra inputs' gradients (``None`` for those with none, e.g. a key).

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> from te_jax import ops
      >>> bias = ops.Bias(8, rngs=nnx.Rngs(0))
      >>> x, ctx = jnp.ones((4, 8)), ops.OperationContext()
      >>> y = bias.op_forward(ctx, x, bias.op_args(x, iter(())))
      >>> dx, (grads,) = bias.fuser_backward([ctx], jnp.ones((4, 8)),
      ...                                    prev_op_grad_output_quantizer=None)
      >>> grads.params["bias"].tolist()                  # dbias: the sum of dy over the rows
      [4.0, 4.0, 4.0, 4.0, 4.0, 4.0, 4.0, 4.0]
    """

    params: dict[str, Any] = dataclasses.field(default_factory=dict)
    quantizer_set: Any = None
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True, eq=False)
class Handoff:
    """A quantizer a neighbour may use for the consumer's operand.

    Attributes:
      quantizer: a ``te_jax.quantize`` quantizer with the layout the consumer reads.
      features: the operand's trailing feature shape as the consumer's GEMM reads it.
      fold_rows: the consumer's scaling mode folds the rows into one axis (block scaling).

    Example:
      >>> import jax.numpy as jnp
      >>> from te_jax import ops
      >>> from te_jax.quantize import CurrentScaleQuantizer
      >>> handoff = ops.Handoff(CurrentScaleQuantizer(), features=(32,))
      >>> handoff.accepts((4, 32), 1), handoff.accepts((4, 16), 1)
      (True, False)
      >>> handoff.quantize(jnp.ones((4, 32), jnp.bfloat16)).q_dtype    # a ScaledTensor
      dtype(float8_e4m3fn)
    """

    quantizer: Any
    features: tuple[int, ...]
    fold_rows: bool = False

    def accepts(self, shape: Sequence[int], n_features: int, exact: bool = False) -> bool:
        """Whether a tensor of ``shape`` whose trailing ``n_features`` axes are its features is
        one the consumer takes quantized: the same feature size (``exact``: the same feature
        axes; otherwise ``quantize`` reshapes them, e.g. ``(2N,)`` to ``(2, N)``). Never under
        row folding (block scaling), where the consumer quantizes in its own row layout."""
        if self.fold_rows:
            return False
        got = tuple(shape)[len(shape) - n_features :]
        if exact:
            return got == self.features
        return math.prod(got) == math.prod(self.features)

    def quantize(self, x, implementation=None):
        """``x (..., F)`` quantized for the consumer (its trailing axis viewed as ``features``)
        where it ``accepts`` it, else ``x`` unchanged."""
        if not self.accepts(jnp.shape(x), 1):
            return x
        x = x.reshape(tuple(x.shape)[:-1] + self.features)
        return quantize(
            x, self.quantizer, implementation=implementation, n_feature_axes=len(self.features)
        )


def plain(x):
    """``x``, or its dequantized value where it is a ``ScaledTensor``: what an op that does not
    consume quantized operands reads."""
    return x.dequantize() if isinstance(x, ScaledTensor) else x


class FusibleOperation(nnx.Module):
    """Something a ``Sequential`` runs: one basic op, or several fused into one.

    ``fuser_forward(ctxs, x, *, args, next_op_input_quantizer) -> y`` fills one context per
    basic op (so a fused forward can be followed by each op's own backward, and the other way);
    ``fuser_backward(ctxs, dy, *, prev_op_grad_output_quantizer) -> (dx, [OpGrads, ...])``.

    Example:
      >>> from flax import nnx
      >>> from te_jax import ops
      >>> seq = ops.Sequential(ops.Linear(32, 64), ops.Bias(64), ops.Activation("gelu"),
      ...                      rngs=nnx.Rngs(0))
      >>> (planned,) = seq.fused_plan()
      >>> isinstance(planned, ops.FusibleOperation), [repr(op) for op in planned.basic_ops]
      (True, ['Linear', 'Bias', 'Activation'])
    """

    @property
    def basic_ops(self) -> tuple[BasicOperation, ...]:
        """The basic ops this runs, in order."""
        raise NotImplementedError(f"{type(self).__name__}.basic_ops")

    def fuser_forward(
        self,
        ctxs: Sequence[OperationContext],
        x,
        *,
        args: Sequence[OpArgs],
        next_op_input_quantizer: Handoff | None,
    ):
        """``y`` from ``x``; one context per basic op filled for the backward."""
        raise NotImplementedError(f"{type(self).__name__}.fuser_forward")

    def fuser_backward(
        self,
        ctxs: Sequence[OperationContext],
        dy,
        *,
        prev_op_grad_output_quantizer: Handoff | None,
    ) -> tuple[Any, list[OpGrads]]:
        """``(dx, one OpGrads per basic op)`` from ``dy``."""
        raise NotImplementedError(f"{type(self).__name__}.fuser_backward")

    def __repr__(self) -> str:  # the plan's printout: names, not NNX's variable tree
        return type(self).__name__


class BasicOperation(FusibleOperation):
    """One operation: subclass it and define ``op_forward`` (and ``op_backward``).

    ``op_forward(ctx, x, args, *, next_op_input_quantizer=None,
    prev_op_grad_output_quantizer=None)`` returns ``y`` and saves what the backward needs on
    ``ctx``; ``op_backward(ctx, dy)`` returns ``(dx, dparams)``, ``dparams`` a dict by
    parameter name (or an ``OpGrads``, for an op with a quantizer set or extra inputs).
    Without an ``op_backward`` the backward is JAX's derivative of ``op_forward`` (its
    ``jax.vjp``, kept on the context).

    Parameters are ``nnx.Param`` attributes: ``args.params`` holds their values by attribute
    name. A doubling op, ``y = 2x`` and ``dx = 2 dy``:

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from te_jax import ops
      >>> class Double(ops.BasicOperation):
      ...     def op_forward(self, ctx, x, args, **_):
      ...         return 2 * x
      ...
      ...     def op_backward(self, ctx, dy):
      ...         return 2 * dy, {}
      >>> seq = ops.Sequential(Double(), Double())
      >>> seq(jnp.ones(3)).tolist(), jax.grad(lambda x: seq(x).sum())(jnp.ones(3)).tolist()
      ([4.0, 4.0, 4.0], [4.0, 4.0, 4.0])
    """

    # Whether the op quantizes under a Sequential's recipe (a Linear), and whether it takes one
    # of the Sequential call's extra inputs (AddExtraInput).
    uses_recipe: bool = False
    takes_extra_input: bool = False

    # ---- what Sequential asks of each op ----------------------------------------------------

    @property
    def basic_ops(self) -> tuple[BasicOperation, ...]:
        return (self,)

    def build(self, index: int, rngs: nnx.Rngs | None, recipe) -> None:
        """Called once by the ``Sequential`` that holds the op (at position ``index``): create
        what the op was not given at construction (parameters from ``rngs``; a ``Linear``'s
        quantizers for ``recipe``). Ops without parameters need nothing."""

    def plan_layout(self, following: Sequence[BasicOperation]) -> None:
        """Called by the ``Sequential`` with the ops that follow this one, once, before any
        ``build``: an op may choose a layout for its output's consumers and its parameters (a
        ``Linear`` before a gated activation writes ``(2, N)`` from an ``(in, 2, N)`` kernel).
        By default nothing."""

    def param_names(self) -> tuple[str, ...]:
        """The op's parameters: its ``nnx.Param`` attributes, by name."""
        return tuple(name for name, v in vars(self).items() if isinstance(v, nnx.Param))

    def op_args(self, sequence_input, extra_inputs) -> OpArgs:
        """The op's ``OpArgs`` for one call: parameter values, quantizer set, extra inputs
        (``sequence_input`` is the ``Sequential``'s input, ``extra_inputs`` an iterator over
        the extra arguments of its call)."""
        return OpArgs({n: getattr(self, n)[...] for n in self.param_names()})

    def input_quantizer(self, args: OpArgs, training: bool) -> Handoff | None:
        """The quantizer the op before may quantize this op's input with (``None``: none);
        ``training``: a backward will run (the consumer then reads both copies)."""
        return None

    def grad_output_quantizer(self, args: OpArgs, ctx: OperationContext) -> Handoff | None:
        """The quantizer the op after (in the backward: before) may quantize this op's output
        gradient with (``None``: none)."""
        return None

    def check_input(self, index: int, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The output shape for an input of ``shape``, or a ``ValueError`` naming the op and
        its ``index`` in the sequence; by default the shape is kept."""
        return shape

    # ---- the op ----------------------------------------------------------------------------

    def op_forward(
        self,
        ctx: OperationContext,
        x,
        args: OpArgs,
        *,
        next_op_input_quantizer: Handoff | None = None,
        prev_op_grad_output_quantizer: Handoff | None = None,
    ):
        raise NotImplementedError(f"{type(self).__name__}.op_forward")

    def op_backward(self, ctx: OperationContext, dy):
        """JAX's derivative of ``op_forward`` (kept on ``ctx`` by ``fuser_forward``)."""
        (vjp,) = ctx.saved_tensors
        dx, dparams = vjp(dy)
        return dx, dparams

    def fuser_forward(self, ctxs, x, *, args, next_op_input_quantizer):
        (ctx,), (a,) = ctxs, args
        own = type(self)
        if (
            own.op_backward is BasicOperation.op_backward
            and own.fuser_backward is BasicOperation.fuser_backward
        ):
            # No backward of its own: differentiate the forward (a pure function of x and the
            # parameters) and keep its vjp, a pytree, for the backward.
            def f(x, params):
                return self.op_forward(
                    OperationContext(ctx.training),
                    x,
                    dataclasses.replace(a, params=params),
                    next_op_input_quantizer=None,
                )

            y, vjp = jax.vjp(f, plain(x), a.params)
            ctx.save_for_backward(vjp)
            return y
        return self.op_forward(ctx, x, a, next_op_input_quantizer=next_op_input_quantizer)

    def fuser_backward(self, ctxs, dy, *, prev_op_grad_output_quantizer):
        (ctx,) = ctxs
        dx, grads = self.op_backward(ctx, dy)
        if not isinstance(grads, OpGrads):
            grads = OpGrads(params=dict(grads))
        return dx, [grads]


class FusedOperation(FusibleOperation):
    """Several basic ops run as one (a fusion's result). The basic ops, and so their
    parameters, are the sequence's own, unchanged: fusing changes how they run, never what
    they hold.

    Example:
      >>> from flax import nnx
      >>> from te_jax import ops
      >>> seq = ops.Sequential(ops.Linear(32, 64), ops.Bias(64), ops.Activation("gelu"),
      ...                      rngs=nnx.Rngs(0))
      >>> (fused,) = seq.fused_plan()
      >>> fused
      ForwardLinearBiasActivation(Linear, Bias, Activation)
      >>> all(a is b for a, b in zip(fused.basic_ops, seq.ops))     # the same ops, fused
      True
    """

    def __init__(self, basic_ops: Sequence[BasicOperation]):
        self.ops = nnx.List(list(basic_ops))

    @property
    def basic_ops(self) -> tuple[BasicOperation, ...]:
        return tuple(self.ops)

    def input_quantizer(self, args: OpArgs, training: bool) -> Handoff | None:
        """The hand-off the fused op takes for its input: its first basic op's (``args`` that
        op's); a fusion that quantizes its input itself returns ``None``."""
        return self.ops[0].input_quantizer(args, training)

    def grad_output_quantizer(self, args: OpArgs, ctx: OperationContext) -> Handoff | None:
        """The hand-off its backward takes for its output gradient: its last basic op's
        (``args`` and ``ctx`` that op's); ``None`` where it quantizes the gradient itself."""
        return self.ops[-1].grad_output_quantizer(args, ctx)

    def __repr__(self) -> str:
        inner = ", ".join(type(op).__name__ for op in self.ops)
        return f"{type(self).__name__}({inner})"
