"""``MLP``: ``[Linear, Bias, Activation, Linear, Bias]`` as one ``te_jax.fused_mlp`` (forward and
backward): both GEMMs of the transformer MLP with what lies between them fused across the GEMM
boundary (docs/numerics.md §8; the forward's ``act_lu`` quantizes for the second GEMM, the
backward's ``quantize_dact_dbias`` for the first).

Applies where the first ``Linear`` is not row-parallel (the second may be: the tensor-parallel
MLP is column- then row-parallel, and the GEMM's sharding rule adds ``b₂`` after the reduction,
as in ``te_jax.nnx.LayerNormMLP``), both biases match their Linear and both Linears share a
compute dtype and implementation. The forward fills every basic op's context as the ops' own
forwards do, so any backward plan can follow it; float64 runs the ops one by one.
"""

from __future__ import annotations

import dataclasses

from te_jax.linear import core, fused_mlp
from te_jax.ops.base import FusedOperation, OpGrads, plain
from te_jax.ops.basic.activation import Activation
from te_jax.ops.basic.bias import Bias
from te_jax.ops.basic.linear import Linear
from te_jax.ops.registry import fuse_pattern
from te_jax.sharding import ACT

__all__ = ["MLP", "fuse_mlp"]

_WHERE = "te_jax.ops.MLP"


class MLP(FusedOperation):
    """``act(x · W₁ + b₁) · W₂ + b₂`` through ``te_jax.linear.fused_mlp``'s forward and
    backward: ``x (..., H)`` → ``(..., H)`` in the compute dtype.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from flax import nnx
      >>> from te_jax import ops
      >>> seq = ops.Sequential(ops.Linear(32, 64), ops.Bias(64), ops.Activation("relu"),
      ...                      ops.Linear(64, 32), ops.Bias(32), rngs=nnx.Rngs(0))
      >>> seq.fused_plan()
      [MLP(Linear, Bias, Activation, Linear, Bias)]
      >>> x = jnp.linspace(-1.0, 1.0, 128).reshape(4, 32)
      >>> l1, b1, _, l2, b2 = seq.ops
      >>> hi = lambda a, b: jnp.dot(a, b, precision="highest")  # float32 on any GPU
      >>> h = jax.nn.relu(hi(x, l1.kernel[...]) + b1.bias[...])
      >>> bool(jnp.allclose(seq(x), hi(h, l2.kernel[...]) + b2.bias[...], atol=1e-5))
      True
    """

    def input_quantizer(self, args, training):
        """None: te_jax.fused_mlp quantizes x itself (with the first Linear's quantizer, whose
        next state it takes from x's own amax), so a neighbour's quantized x would be
        dequantized and quantized again."""
        return None

    def _operands(self, args):
        l1, b1, act, l2, b2 = self.ops
        k1 = args[0].params["kernel"].reshape((l1.in_features,) + l1.output_view)
        bias1 = args[1].params["bias"].reshape(l1.output_view)
        return l1, act, l2, k1, bias1, args[3].params["kernel"], args[4].params["bias"]

    def fuser_forward(self, ctxs, x, *, args, next_op_input_quantizer):
        l1, act, l2, k1, bias1, k2, bias2 = self._operands(args)
        x = plain(x)
        if l1.dtype is not None:
            x = x.astype(l1.dtype)
        axes = (_axes(l1), l2.kernel_axes)
        prepared = fused_mlp.configure(
            x,
            k1,
            k2,
            bias1,
            bias2,
            act.act,
            (args[0].quantizer_set, args[3].quantizer_set),
            act.act_params,
            l1.implementation,
            axes,
            "dact",
            _WHERE,
        )
        if prepared is None:  # float64: the ops one by one
            ctxs[0].mlp = None
            for i, op in enumerate(self.ops):
                x = op.fuser_forward(
                    ctxs[i : i + 1], x, args=args[i : i + 1], next_op_input_quantizer=None
                )
            return x
        cfg, (x, k1, bias1, k2, bias2, q1, q2) = prepared
        training = ctxs[0].training
        out, res = fused_mlp.forward(x, k1, bias1, k2, bias2, q1, q2, cfg, residuals=training)
        lead = tuple(x.shape)[:-1]
        for i, (op, c) in enumerate(((l1, cfg.first), (l2, cfg.second))):
            ctx = ctxs[3 * i]
            if training:
                ctx.save_for_backward(res[i]._replace(act_in=None, quantized_x=None))
            ctx.cfg = dataclasses.replace(c, act=None, params=None, has_bias=False)
            ctx.lead = lead
            ctx.kernel_shape = (op.in_features, op.out_features)
        ctxs[1].features, ctxs[4].features = l1.out_features, l2.out_features
        if training:
            ctxs[2].save_for_backward(res[0].act_in.reshape(lead + l1.output_view))
        ctxs[2].in_features = l1.out_features
        ctxs[0].mlp = cfg
        return out.reshape(lead + (l2.out_features,))

    def fuser_backward(self, ctxs, dy, *, prev_op_grad_output_quantizer):
        cfg = ctxs[0].mlp
        if cfg is None:  # float64: the ops one by one
            grads = []
            for i in reversed(range(len(self.ops))):
                dy, g = self.ops[i].fuser_backward(
                    ctxs[i : i + 1], dy, prev_op_grad_output_quantizer=None
                )
                grads = g + grads
            return dy, grads
        (res1,), (res2,), (h,) = (ctxs[i].saved_tensors for i in (0, 3, 2))
        v = core.views(ctxs[0].lead, cfg.first)
        res1 = res1._replace(act_in=h.reshape(v.rows + cfg.first.features))
        dx, dk1, db1, dk2, db2, n1, n2 = fused_mlp.backward(cfg, (res1, res2), plain(dy))
        return dx.reshape(ctxs[0].lead + (ctxs[0].kernel_shape[0],)), [
            OpGrads({"kernel": dk1.reshape(ctxs[0].kernel_shape)}, n1),
            OpGrads({"bias": db1.reshape(-1)}),
            OpGrads(),
            OpGrads({"kernel": dk2.reshape(ctxs[3].kernel_shape)}, n2),
            OpGrads({"bias": db2.reshape(-1)}),
        ]


def _axes(linear: Linear):
    """The first kernel's logical axes in the GEMM's view (``(K, 2, N)`` before a gated
    activation)."""
    axes = linear.kernel_axes
    if axes is not None and len(linear.output_view) == 2:
        axes = (axes[0], ACT, axes[1])
    return axes


def _make(ops):
    l1, b1, act, l2, b2 = ops
    if l1.parallel_mode == "row" or l1.dtype != l2.dtype:
        return None
    if b1.features != l1.out_features or b2.features != l2.out_features:
        return None
    if l1.implementation != l2.implementation:
        return None
    return MLP(ops)


def fuse_mlp(plan):
    """The MLP fusion, both directions: ``[Linear, Bias, Activation, Linear, Bias]``."""
    return fuse_pattern(plan, (Linear, Bias, Activation, Linear, Bias), _make)
