"""``ForwardLinearBiasAdd``: ``[Linear, Bias, AddResidual]`` (or ``AddExtraInput``, with or
without the ``Bias``) as one GEMM that adds the bias and the residual in its own pass.

``y = x · kernel + r + bias``: the residual ``r`` is the GEMM's addend (cuBLASLt's ``C`` with
``beta = 1`` on te_jax's CUDA GEMM; the same float32 sum in the pure-JAX GEMM), so the sum is
rounded once, where the unfused plan rounds ``x · kernel + bias`` and then the sum. Where ``r``
is not in the GEMM's output dtype it is added after the GEMM, as ``AddInput`` does.

Applies where the ``Linear`` is not row-parallel (a row-parallel GEMM's output is a partial sum:
the bias and the residual belong after its reduction). The backward is each basic op's own
(``dr = dy``).
"""

from __future__ import annotations

from te_jax.ops.base import FusedOperation
from te_jax.ops.basic.bias import Bias
from te_jax.ops.basic.linear import Linear, linear_forward
from te_jax.ops.basic.simple import AddInput
from te_jax.ops.registry import fuse_pattern

__all__ = ["ForwardLinearBiasAdd", "fuse_forward_linear_bias_add"]


class ForwardLinearBiasAdd(FusedOperation):
    """``x · kernel + r + bias`` (or ``x · kernel + r``) as one GEMM call: ``x (..., in)`` and
    ``r (..., out)`` → ``(..., out)``, one rounding to the compute dtype.

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> from te_jax import ops
      >>> seq = ops.Sequential(ops.Linear(32, 32), ops.Bias(32), ops.AddResidual(),
      ...                      rngs=nnx.Rngs(0))
      >>> seq.fused_plan()
      [ForwardLinearBiasAdd(Linear, Bias, AddResidual)]
      >>> x = jnp.linspace(-1.0, 1.0, 128).reshape(4, 32)
      >>> hi = lambda a, b: jnp.dot(a, b, precision="highest")  # float32 on any GPU
      >>> bool(jnp.allclose(seq(x), hi(x, seq.ops[0].kernel[...]) + seq.ops[1].bias[...] + x,
      ...                   atol=1e-5))
      True
    """

    def fuser_forward(self, ctxs, x, *, args, next_op_input_quantizer):
        linear, add = self.ops[0], self.ops[-1]
        bias = self.ops[1] if len(self.ops) == 3 else None
        b = None
        if bias is not None:
            b = args[1].params["bias"]
            ctxs[1].features = bias.features
        lead = tuple(x.shape)[:-1]
        r = add.added_input(args[-1], lead + (linear.out_features,))
        k = args[0].params["kernel"]
        y, _ = linear_forward(linear, ctxs[0], x, k, b, args[0].quantizer_set, addend=r)
        return y

    def fuser_backward(self, ctxs, dy, *, prev_op_grad_output_quantizer):
        raise NotImplementedError("ForwardLinearBiasAdd is a forward fusion")


def _make(ops):
    linear = ops[0]
    if linear.parallel_mode == "row":
        return None
    if len(ops) == 3 and ops[1].features != linear.out_features:
        return None
    return ForwardLinearBiasAdd(ops)


def fuse_forward_linear_bias_add(plan):
    """The forward fusion: ``[Linear, Bias, AddInput]`` (an ``AddResidual`` or
    ``AddExtraInput``), then ``[Linear, AddInput]``."""
    plan = fuse_pattern(plan, (Linear, Bias, AddInput), _make)
    return fuse_pattern(plan, (Linear, AddInput), _make)
