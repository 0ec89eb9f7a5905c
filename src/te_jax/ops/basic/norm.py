"""``LayerNorm`` and ``RMSNorm`` over the last axis (``te_jax.normalization.layernorm``: its
derivative rule, docs/numerics.md §9), the output quantized for the ``Linear`` after it under a
recipe."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from te_jax.nnx.modules import param_with_axes
from te_jax.normalization import layernorm
from te_jax.ops.base import BasicOperation, OpArgs, OpGrads, plain
from te_jax.sharding import EMBED

__all__ = ["LayerNorm", "RMSNorm"]


class _Norm(BasicOperation):
    """The norm of ``kind`` (``"layernorm"`` or ``"rmsnorm"``) over ``(..., H)``."""

    kind = "layernorm"

    def __init__(
        self,
        features: int,
        *,
        epsilon: float = 1e-6,
        zero_centered_gamma: bool = False,
        scale_axes=(EMBED,),
        bias_axes=(EMBED,),
        param_dtype=jnp.float32,
        dtype=None,
        rngs: nnx.Rngs | None = None,
    ):
        where = f"te_jax.ops.{type(self).__name__}"
        if isinstance(features, bool) or not isinstance(features, int) or features < 1:
            raise ValueError(f"{where}: features must be a positive int, got {features!r}")
        self.features = features
        self.epsilon = float(epsilon)
        self.zero_centered_gamma = bool(zero_centered_gamma)
        self.scale_axes = None if scale_axes is None else tuple(scale_axes)
        self.bias_axes = None if bias_axes is None else tuple(bias_axes)
        self.param_dtype = jnp.dtype(param_dtype)
        self.dtype = None if dtype is None else jnp.dtype(dtype)
        # Parameters need no randomness: made here (rngs is accepted for a uniform signature).
        one = 0.0 if self.zero_centered_gamma else 1.0
        self.scale = param_with_axes(jnp.full((features,), one, self.param_dtype), self.scale_axes)
        if self.kind == "layernorm":
            self.bias = param_with_axes(jnp.zeros((features,), self.param_dtype), self.bias_axes)

    def check_input(self, index, shape):
        if len(shape) < 1 or shape[-1] != self.features:
            raise ValueError(
                f"te_jax.ops.{type(self).__name__} (operation {index}): takes "
                f"(..., {self.features}) inputs, got shape {shape}"
            )
        return shape

    def op_args(self, sequence_input, extra_inputs) -> OpArgs:
        return OpArgs({n: getattr(self, n)[...] for n in self.param_names()})

    def _norm(self, x, params):
        # The parameters enter in their own dtype (layernorm computes in float32 and returns
        # x's dtype), as in the modules: γ and β are not rounded to the compute dtype first.
        return layernorm(
            x.astype(self.dtype or x.dtype),
            params["scale"],
            params.get("bias"),
            layernorm_type=self.kind,
            zero_centered_gamma=self.zero_centered_gamma,
            epsilon=self.epsilon,
        )

    def op_forward(self, ctx, x, args, *, next_op_input_quantizer=None, **_):
        x = plain(x)
        if ctx.training:
            y, vjp = jax.vjp(self._norm, x, args.params)
            ctx.save_for_backward(vjp)
        else:
            y = self._norm(x, args.params)
        q = next_op_input_quantizer
        return y if q is None else q.quantize(y)

    def fuser_backward(self, ctxs, dy, *, prev_op_grad_output_quantizer):
        (vjp,) = ctxs[0].saved_tensors
        dx, dparams = vjp(plain(dy))
        return dx, [OpGrads(dict(dparams))]


class LayerNorm(_Norm):
    """``y = (x - mean) / sqrt(var + ε) · γ + β`` over the last axis (``1 + γ`` with
    ``zero_centered_gamma``). Parameters ``scale (H,)`` and ``bias (H,)``; statistics in
    float32, ``y`` in the compute dtype (``dtype``, else x's).

    Example:
      >>> import jax.numpy as jnp
      >>> from te_jax import ops
      >>> x = jnp.linspace(-1.0, 1.0, 128).reshape(4, 32)
      >>> y = ops.Sequential(ops.LayerNorm(32))(x)
      >>> mean, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
      >>> bool(jnp.allclose(y, (x - mean) / jnp.sqrt(var + 1e-6), atol=1e-5))
      True
    """

    kind = "layernorm"


class RMSNorm(_Norm):
    """``y = x / sqrt(mean(x²) + ε) · γ`` over the last axis. Parameter ``scale (H,)``;
    statistics in float32, ``y`` in the compute dtype (``dtype``, else x's).

    Example:
      >>> import jax.numpy as jnp
      >>> from te_jax import ops
      >>> x = jnp.linspace(-1.0, 1.0, 128).reshape(4, 32)
      >>> y = ops.Sequential(ops.RMSNorm(32))(x)
      >>> bool(jnp.allclose(y, x / jnp.sqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6)))
      True
    """

    kind = "rmsnorm"
