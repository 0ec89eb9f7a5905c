"""``BackwardActivationBias``: the backward of ``[Bias, Activation]`` as one
``quantize_dact_dbias`` pass: ``dh = act'(h) · dy``, ``dbias = Σ dh`` and ``dh`` quantized for the
``Linear`` before (its gradient quantizer) where there is one. Always applies."""

from __future__ import annotations

from te_jax.ops.base import FusedOperation, OpGrads, plain
from te_jax.ops.basic.activation import Activation, activation_backward
from te_jax.ops.basic.bias import Bias
from te_jax.ops.registry import fuse_pattern

__all__ = ["BackwardActivationBias", "fuse_backward_activation_bias"]


class BackwardActivationBias(FusedOperation):
    """dact + dbias (+ quantize) in one kernel pass: ``dh = act'(h) · dy`` (``(..., F)``) and
    ``dbias = Σ dh`` over the leading axes (``(F,)``, float32).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from flax import nnx
      >>> from te_jax import ops
      >>> seq = ops.Sequential(ops.Linear(32, 64), ops.Bias(64), ops.Activation("gelu"),
      ...                      rngs=nnx.Rngs(0))
      >>> seq.fused_plan("backward")
      [Linear, BackwardActivationBias(Bias, Activation)]
      >>> dx = jax.grad(lambda x: seq(x).sum())(jnp.ones((4, 32)))
      >>> dx.shape
      (4, 32)
    """

    def fuser_forward(self, ctxs, x, *, args, next_op_input_quantizer):
        raise NotImplementedError("BackwardActivationBias is a backward fusion")

    def fuser_backward(self, ctxs, dy, *, prev_op_grad_output_quantizer):
        act = self.ops[1]
        (h,) = ctxs[1].saved_tensors
        dx, db = activation_backward(act, h, plain(dy), prev_op_grad_output_quantizer, True)
        return dx, [OpGrads({"bias": db}), OpGrads()]


def fuse_backward_activation_bias(plan):
    """The backward fusion: each ``[Bias, Activation]`` whose sizes agree."""
    return fuse_pattern(
        plan,
        (Bias, Activation),
        lambda ops: BackwardActivationBias(ops),
    )
