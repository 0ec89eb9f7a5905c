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
    """dact + dbias (+ quantize) in one kernel pass."""

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
