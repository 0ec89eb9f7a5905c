"""``Activation``: any te_jax activation or gated pair, on the flat ``(..., 2N)`` layout a
``Linear`` writes (the first half activated, the second the linear gate)."""

from __future__ import annotations

import math

from te_jax.activation_ops import act_lu, quantize_dact_dbias
from te_jax.activation_types import ActivationLike, ActivationParams
from te_jax.layers import resolve_activation
from te_jax.ops.base import BasicOperation, OpGrads, plain

__all__ = ["Activation", "activation_backward"]

_WHERE = "te_jax.ops.Activation"


class Activation(BasicOperation):
    """``y = act(x)``: non-gated ``(..., F) -> (..., F)``; gated ``(..., 2N) -> (..., N)``,
    ``y = f(x[..., :N]) · x[..., N:]`` (te_jax's ``(..., 2, N)`` layout, docs/numerics.md §1).

    The forward is te_jax's ``act_lu`` kernel, quantizing its output for the ``Linear`` after
    it in the same pass under a recipe; the backward its ``dact`` kernel, quantizing the
    gradient for the ``Linear`` before it.

    Args:
      activation_type: ``"gelu"``, ``("silu", "linear")``, ``"swiglu"``, an ``ActivationType``.
      act_params: ``ActivationParams`` (clamped SwiGLU).
      implementation: ``None``, ``"ffi"`` or ``"xla"``.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from te_jax import ops
      >>> x = jnp.linspace(-1.0, 1.0, 64).reshape(4, 16)           # (..., 2N), N = 8
      >>> y = ops.Sequential(ops.Activation("swiglu"))(x)
      >>> y.shape, bool(jnp.allclose(y, jax.nn.silu(x[:, :8]) * x[:, 8:], atol=1e-6))
      ((4, 8), True)
    """

    def __init__(
        self,
        activation_type: ActivationLike,
        *,
        act_params: ActivationParams | None = None,
        implementation: str | None = None,
    ):
        if activation_type is None:
            raise ValueError(f"{_WHERE}: activation_type is required, e.g. 'gelu' or 'swiglu'")
        self.act, self.act_params = resolve_activation(_WHERE, activation_type, act_params)
        self.implementation = implementation

    def check_input(self, index, shape):
        if len(shape) < 1:
            raise ValueError(f"{_WHERE} (operation {index}): takes (..., F) inputs, got a scalar")
        if self.act.is_gated:
            if shape[-1] % 2:
                raise ValueError(
                    f"{_WHERE} (operation {index}): the gated {self.act.name} takes (..., 2N) "
                    f"inputs (activated half, then gate); got shape {shape}, whose last axis is "
                    "odd"
                )
            return shape[:-1] + (shape[-1] // 2,)
        return shape

    def act_input_features(self, f: int) -> tuple[int, ...]:
        """The activation's input features in te_jax's layout: ``(2, N)`` gated, else ``(F,)``."""
        return (2, f // 2) if self.act.is_gated else (f,)

    def op_forward(self, ctx, x, args, *, next_op_input_quantizer=None, **_):
        x = plain(x)
        lead, f = tuple(x.shape)[:-1], x.shape[-1]
        h = x.reshape(lead + self.act_input_features(f))
        q = next_op_input_quantizer
        out_f = self.check_input(0, x.shape)[-1]
        use = q is not None and q.accepts(lead + (out_f,), 1)
        y = act_lu(
            h,
            self.act,
            quantizer=q.quantizer if use else None,
            act_params=self.act_params,
            implementation=self.implementation,
        )
        if ctx.training:
            ctx.save_for_backward(h)
        ctx.in_features = f
        return y

    def fuser_backward(self, ctxs, dy, *, prev_op_grad_output_quantizer):
        (ctx,) = ctxs
        (h,) = ctx.saved_tensors
        dx, _ = activation_backward(self, h, plain(dy), prev_op_grad_output_quantizer, False)
        return dx, [OpGrads()]


def activation_backward(op: Activation, h, dy, handoff, with_dbias: bool):
    """``(dx, dbias)``: one ``quantize_dact_dbias`` pass over ``dy`` and the activation's input
    ``h (*lead, *features)``, quantized with ``handoff`` where the consumer accepts it (a
    ScaledTensor in ``h``'s shape), else a plain ``dx`` in the flat ``(*lead, F)`` and
    ``dbias (F,)`` float (``None`` without ``with_dbias``)."""
    n_feat = 2 if op.act.is_gated else 1
    lead = tuple(h.shape)[: h.ndim - n_feat]
    use = handoff is not None and handoff.accepts(h.shape, n_feat, exact=True)
    dx, db = quantize_dact_dbias(
        dy.astype(h.dtype),
        h,
        op.act,
        is_dbias=with_dbias,
        quantizer=handoff.quantizer if use else None,
        act_params=op.act_params,
        implementation=op.implementation,
    )
    if not use:
        dx = dx.reshape(lead + (h.size // max(1, math.prod(lead)) if lead else h.size,))
    if db is not None:
        db = db.reshape(-1)
    return dx, db
