"""``Bias``: ``y = x + bias`` over the trailing feature axis."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from te_jax.nnx.modules import param_with_axes
from te_jax.ops.base import BasicOperation, OpArgs, OpGrads, plain
from te_jax.sharding import ACT

__all__ = ["Bias", "add_bias", "bias_gradient"]

_WHERE = "te_jax.ops.Bias"


class Bias(BasicOperation):
    """``y (..., F) = x + bias (F,)``, the sum in float32 rounded once to x's dtype.

    Backward: ``dbias`` the float32 sum of ``dy`` over the leading axes; ``dx = dy``, quantized
    for the ``Linear`` before it (its gradient quantizer) where there is one.

    Args:
      features: ``F``.
      bias_axes: the bias's logical axis name(s), e.g. ``("mlp",)``.
      bias_init: initializer (zeros).
      param_dtype: the bias's dtype (float32).
      rngs: ``nnx.Rngs`` (or give them to the ``Sequential``).

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> from te_jax import ops
      >>> bias = ops.Bias(8, bias_init=nnx.initializers.ones, rngs=nnx.Rngs(0))
      >>> ops.Sequential(bias)(jnp.zeros((2, 8), jnp.bfloat16))[0].tolist()
      [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    """

    def __init__(
        self,
        features: int,
        *,
        bias_axes=None,
        bias_init=nnx.initializers.zeros,
        param_dtype=jnp.float32,
        rngs: nnx.Rngs | None = None,
    ):
        if isinstance(features, bool) or not isinstance(features, int) or features < 1:
            raise ValueError(f"{_WHERE}: features must be a positive int, got {features!r}")
        self.features = features
        self.bias_axes = None if bias_axes is None else tuple(bias_axes)
        self.bias_init = bias_init
        self.param_dtype = jnp.dtype(param_dtype)
        self.view = (features,)
        if rngs is not None:
            self.build(0, rngs, None)

    @property
    def param_axes(self):
        """The bias parameter's logical axis names (``ACT`` first for a gated ``(2, N)``)."""
        if self.bias_axes is None or len(self.view) == 1:
            return self.bias_axes
        return (ACT,) + self.bias_axes[-1:]

    def build(self, index, rngs, recipe) -> None:
        if hasattr(self, "bias"):
            return
        if rngs is None:
            raise ValueError(
                f"{_WHERE} (operation {index}): its bias needs rngs: give rngs=nnx.Rngs(...) to "
                "the Bias or to the Sequential"
            )
        value = self.bias_init(rngs.params(), (self.features,), self.param_dtype)
        self.bias = param_with_axes(value.reshape(self.view), self.param_axes)

    def plan_layout(self, following) -> None:
        """Before a gated ``Activation`` the bias is ``(2, N)``, as the ``Linear`` before it
        views its kernel (``(in, 2, N)``): split over N, both halves of a column stay together."""
        from te_jax.ops.basic.linear import gated_activation_follows  # noqa: PLC0415

        n = self.features
        view = (2, n // 2) if gated_activation_follows(following) and n % 2 == 0 else (n,)
        if view == self.view:
            return
        self.view = view
        if hasattr(self, "bias"):  # made at construction: the same values, viewed
            self.bias = param_with_axes(self.bias[...].reshape(view), self.param_axes)

    def check_input(self, index, shape):
        if len(shape) < 1 or shape[-1] != self.features:
            raise ValueError(
                f"{_WHERE} (operation {index}): takes (..., {self.features}) inputs, got shape "
                f"{shape}"
            )
        return shape

    def op_args(self, sequence_input, extra_inputs) -> OpArgs:
        return OpArgs({"bias": self.bias[...]})

    def op_forward(self, ctx, x, args, **_):
        x = plain(x)
        ctx.features = self.features
        return add_bias(x, args.params["bias"].reshape(self.features))

    def fuser_backward(self, ctxs, dy, *, prev_op_grad_output_quantizer):
        dy = plain(dy)
        db = bias_gradient(dy, 1)
        dx = (
            dy
            if prev_op_grad_output_quantizer is None
            else prev_op_grad_output_quantizer.quantize(dy)
        )
        return dx, [OpGrads({"bias": db})]


def add_bias(x, bias):
    """``x + bias`` over x's trailing axes, in float32, rounded once to x's dtype."""
    return (x.astype(jnp.float32) + bias.astype(jnp.float32)).astype(x.dtype)


def bias_gradient(dy, n_features: int):
    """The float32 sum of ``dy`` over all but its trailing ``n_features`` axes."""
    return jnp.sum(dy.astype(jnp.float32), axis=tuple(range(dy.ndim - n_features)))
