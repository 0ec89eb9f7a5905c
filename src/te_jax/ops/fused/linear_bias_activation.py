"""``ForwardLinearBiasActivation``: ``[Linear, Bias, Activation]`` or ``[Linear, Bias]`` as one
GEMM, the bias (and GELU / ReLU) in its epilogue.

Applies where the ``Linear`` is not row-parallel (a row-parallel GEMM's output is a partial sum:
the bias and the activation belong after its reduction). On te_jax's CUDA GEMM GELU (tanh) and
ReLU run in the epilogue on the float32 accumulator; other activations, the CPU and
``implementation="xla"`` run the GEMM + bias, then ``act_lu`` on the rounded ``h``. Under a
recipe with a ``Linear`` after it the activation is the ``act_lu`` kernel that quantizes its
output for that Linear in the same pass (the epilogue writes no FP8). The backward is each basic
op's own (or ``BackwardActivationBias``).
"""

from __future__ import annotations

from te_jax.activation_ops import act_lu
from te_jax.linear.core import EPILOGUE_ACTIVATIONS
from te_jax.ops.base import FusedOperation
from te_jax.ops.basic.activation import Activation
from te_jax.ops.basic.bias import Bias
from te_jax.ops.basic.linear import Linear, linear_forward
from te_jax.ops.registry import fuse_pattern

__all__ = ["ForwardLinearBiasActivation", "fuse_forward_linear_bias_activation"]


class ForwardLinearBiasActivation(FusedOperation):
    """``act(x · kernel + bias)`` (or ``x · kernel + bias``) as one GEMM call:
    ``x (..., in)`` → ``(..., out)`` (gated: ``(..., out / 2)``) in the compute dtype.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from flax import nnx
      >>> from te_jax import ops
      >>> seq = ops.Sequential(ops.Linear(32, 64), ops.Bias(64), ops.Activation("gelu"),
      ...                      rngs=nnx.Rngs(0))
      >>> seq.fused_plan()
      [ForwardLinearBiasActivation(Linear, Bias, Activation)]
      >>> x = jnp.linspace(-1.0, 1.0, 128).reshape(4, 32)
      >>> hi = lambda a, b: jnp.dot(a, b, precision="highest")  # float32 on any GPU
      >>> h = hi(x, seq.ops[0].kernel[...]) + seq.ops[1].bias[...]
      >>> bool(jnp.allclose(seq(x), jax.nn.gelu(h, approximate=True), atol=1e-5))
      True
    """

    def fuser_forward(self, ctxs, x, *, args, next_op_input_quantizer):
        linear, bias = self.ops[0], self.ops[1]
        act = self.ops[2] if len(self.ops) == 3 else None
        qs = args[0].quantizer_set
        b = args[1].params["bias"]
        k = args[0].params["kernel"]
        ctxs[1].features = bias.features
        if act is None:
            y, _ = linear_forward(linear, ctxs[0], x, k, b, qs)
            return y
        features = act.act_input_features(linear.out_features)
        q = next_op_input_quantizer
        lead = tuple(x.shape)[:-1]
        out_f = act.check_input(0, lead + (linear.out_features,))[-1]
        if q is not None and q.accepts(lead + (out_f,), 1):
            # The activation quantizes for the next Linear: GEMM + bias here, act_lu after.
            h, _ = linear_forward(linear, ctxs[0], x, k, b, qs, features)
            h = h.reshape(lead + features)
            y = act_lu(
                h,
                act.act,
                quantizer=q.quantizer,
                act_params=act.act_params,
                implementation=act.implementation,
            )
            act_in = h
        else:
            y, act_in = linear_forward(
                linear, ctxs[0], x, k, b, qs, features, act.act, act.act_params
            )
        if ctxs[2].training:
            ctxs[2].save_for_backward(act_in)
        ctxs[2].in_features = linear.out_features
        return y

    def fuser_backward(self, ctxs, dy, *, prev_op_grad_output_quantizer):
        raise NotImplementedError("ForwardLinearBiasActivation is a forward fusion")


def _make(ops):
    linear, bias = ops[0], ops[1]
    if linear.parallel_mode == "row" or bias.features != linear.out_features:
        return None
    if len(ops) == 3 and ops[2].act not in EPILOGUE_ACTIVATIONS:
        return None  # [Linear, Bias] fuses; the activation runs as its own kernel
    return ForwardLinearBiasActivation(ops)


def fuse_forward_linear_bias_activation(plan):
    """The forward fusion: ``[Linear, Bias, Activation]``, then the ``[Linear, Bias]`` left."""
    plan = fuse_pattern(plan, (Linear, Bias, Activation), _make)
    return fuse_pattern(plan, (Linear, Bias), _make)
