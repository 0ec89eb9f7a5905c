"""The ops with no GEMM and no parameters: ``Identity``, ``Quantize``, ``Dropout``,
``AddResidual`` and ``AddExtraInput``."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from te_jax.ops.base import BasicOperation, OpArgs, OpGrads, plain

__all__ = ["Identity", "Quantize", "Dropout", "AddInput", "AddResidual", "AddExtraInput"]


class Identity(BasicOperation):
    """``y = x`` (and ``dx = dy``).

    Example:
      >>> import jax.numpy as jnp
      >>> from te_jax import ops
      >>> x = jnp.ones((4, 8), jnp.bfloat16)
      >>> bool((ops.Sequential(ops.Identity())(x) == x).all())
      True
    """

    def op_forward(self, ctx, x, args, **_):
        return x

    def fuser_backward(self, ctxs, dy, *, prev_op_grad_output_quantizer):
        return dy, [OpGrads()]


class Quantize(BasicOperation):
    """Quantize the tensor that crosses here for the ``Linear`` it feeds: in the forward with
    the next op's input quantizer (``forward=True``), in the backward with the previous op's
    gradient quantizer (``backward=True``). Where the neighbour has none (no recipe, not a
    Linear) it is the identity. The value is the same as the Linear quantizing it itself; the
    op makes the quantization a step of its own (e.g. before a user op that passes it on).

    Example:
      >>> import jax.numpy as jnp, te_jax
      >>> from flax import nnx
      >>> from te_jax import ops
      >>> seq = ops.Sequential(ops.Quantize(), ops.Linear(32, 16),
      ...                      recipe=te_jax.recipe.CurrentScaling(), rngs=nnx.Rngs(0))
      >>> [repr(op) for op in seq.fused_plan()]
      ['Quantize', 'Linear']
      >>> seq(jnp.ones((4, 32), jnp.bfloat16)).shape
      (4, 16)
    """

    def __init__(self, forward: bool = True, backward: bool = False):
        self.forward = bool(forward)
        self.backward = bool(backward)

    def op_forward(self, ctx, x, args, *, next_op_input_quantizer=None, **_):
        q = next_op_input_quantizer
        return q.quantize(plain(x)) if self.forward and q is not None else x

    def fuser_backward(self, ctxs, dy, *, prev_op_grad_output_quantizer):
        q = prev_op_grad_output_quantizer
        return (q.quantize(plain(dy)) if self.backward and q is not None else dy), [OpGrads()]


class Dropout(BasicOperation):
    """Inverted dropout: each element kept with probability ``1 - rate`` and scaled by
    ``1 / (1 - rate)`` (elements along ``broadcast_dims`` share a draw). Off when
    ``deterministic`` (``model.eval()`` sets it). Keys from the ``rngs``' ``dropout`` stream.

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> from te_jax import ops
      >>> seq = ops.Sequential(ops.Dropout(0.5, rngs=nnx.Rngs(dropout=0)))
      >>> sorted(set(seq(jnp.ones((4, 8))).ravel().tolist()))      # dropped, or kept · 2
      [0.0, 2.0]
      >>> seq.eval()
      >>> bool((seq(jnp.ones((4, 8))) == 1.0).all())
      True
    """

    def __init__(
        self,
        rate: float,
        *,
        broadcast_dims: Sequence[int] = (),
        deterministic: bool = False,
        rngs: nnx.Rngs | None = None,
    ):
        if not 0.0 <= float(rate) < 1.0:
            raise ValueError(f"te_jax.ops.Dropout: rate must be in [0, 1), got {rate!r}")
        self.rate = float(rate)
        self.broadcast_dims = tuple(broadcast_dims)
        self.deterministic = bool(deterministic)
        self.rngs = nnx.data(None if rngs is None else rngs["dropout"].fork())

    def build(self, index, rngs, recipe) -> None:
        if self.rngs is None and rngs is not None:
            try:
                self.rngs = rngs["dropout"].fork()
            except KeyError:  # no such stream: a call that drops says what it needs
                pass

    def _active(self) -> bool:
        return self.rate > 0.0 and not self.deterministic

    def op_args(self, sequence_input, extra_inputs) -> OpArgs:
        if not self._active():
            return OpArgs()
        if self.rngs is None:
            raise ValueError(
                "te_jax.ops.Dropout: needs rngs with a 'dropout' stream (give rngs to the "
                "Dropout or the Sequential), or deterministic=True"
            )
        return OpArgs(extra={"key": self.rngs()})

    def op_forward(self, ctx, x, args, **_):
        x = plain(x)
        ctx.scale = 0.0
        if "key" not in args.extra:
            return x
        shape = list(x.shape)
        for d in self.broadcast_dims:
            shape[d] = 1
        keep = jax.random.bernoulli(args.extra["key"], 1.0 - self.rate, tuple(shape))
        keep = jnp.broadcast_to(keep, x.shape)
        ctx.scale = 1.0 / (1.0 - self.rate)
        ctx.save_for_backward(keep)
        return jnp.where(keep, x * jnp.asarray(ctx.scale, x.dtype), jnp.zeros((), x.dtype))

    def fuser_backward(self, ctxs, dy, *, prev_op_grad_output_quantizer):
        ctx = ctxs[0]
        dy = plain(dy)
        if not ctx.saved_tensors:
            return dy, [OpGrads()]
        (keep,) = ctx.saved_tensors
        return jnp.where(keep, dy * jnp.asarray(ctx.scale, dy.dtype), 0), [OpGrads()]


class AddInput(BasicOperation):
    """``y = x + r`` for an input ``r`` of x's shape, summed in float32 and rounded once to
    x's dtype (the base of ``AddResidual`` and ``AddExtraInput``)."""

    def _other(self, sequence_input, extra_inputs):
        raise NotImplementedError

    def op_args(self, sequence_input, extra_inputs) -> OpArgs:
        return OpArgs(extra={"input": self._other(sequence_input, extra_inputs)})

    def added_input(self, args: OpArgs, shape) -> jax.Array:
        """``r`` from this op's ``args``, checked against the shape of the tensor it is added
        to."""
        r = args.extra["input"]
        if jnp.shape(r) != tuple(shape):
            raise ValueError(
                f"te_jax.ops.{type(self).__name__}: the added input has shape {jnp.shape(r)}, "
                f"the operation's input {tuple(shape)}"
            )
        return r

    def op_forward(self, ctx, x, args, **_):
        x = plain(x)
        r = self.added_input(args, x.shape)
        return (x.astype(jnp.float32) + r.astype(jnp.float32)).astype(x.dtype)

    def fuser_backward(self, ctxs, dy, *, prev_op_grad_output_quantizer):
        dy = plain(dy)
        return dy, [OpGrads(extra={"input": dy})]


class AddResidual(AddInput):
    """``y = x + the Sequential's input``: the residual connection around the block.

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> from te_jax import ops
      >>> seq = ops.Sequential(ops.Linear(32, 32), ops.AddResidual(), rngs=nnx.Rngs(0))
      >>> x = jnp.linspace(-1.0, 1.0, 128).reshape(4, 32)
      >>> hi = lambda a, b: jnp.dot(a, b, precision="highest")  # float32 on any GPU
      >>> bool(jnp.allclose(seq(x), hi(x, seq.ops[0].kernel[...]) + x, atol=1e-5))
      True
    """

    def _other(self, sequence_input, extra_inputs):
        return sequence_input


class AddExtraInput(AddInput):
    """``y = x + e``, ``e`` the next of the ``Sequential`` call's extra inputs
    (``seq(x, e)``), of the shape of the tensor it is added to.

    Example:
      >>> import jax.numpy as jnp
      >>> from te_jax import ops
      >>> seq = ops.Sequential(ops.Identity(), ops.AddExtraInput())
      >>> seq(jnp.ones((2, 4)), jnp.full((2, 4), 2.0)).tolist()
      [[3.0, 3.0, 3.0, 3.0], [3.0, 3.0, 3.0, 3.0]]
    """

    takes_extra_input = True

    def _other(self, sequence_input, extra_inputs):
        try:
            return jnp.asarray(next(extra_inputs))
        except StopIteration:
            raise ValueError(
                "te_jax.ops.AddExtraInput: the Sequential call has no extra input left for it: "
                "call seq(x, e) with one extra input per AddExtraInput"
            ) from None
