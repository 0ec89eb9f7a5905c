"""``Linear``: ``y = x · kernel`` (no bias: that is ``Bias``), bf16 or FP8 under the
``Sequential``'s recipe, on te_jax's GEMM (``te_jax.linear.core``: the same forward, dgrad and
wgrad as ``te_jax.dense``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax.numpy as jnp
import numpy as np
from flax import nnx

from te_jax.linear import core
from te_jax.module_specs import KERNEL_INIT
from te_jax.nnx.fp8_state import QuantizerState
from te_jax.nnx.modules import param_with_axes
from te_jax.ops.base import BasicOperation, Handoff, OpArgs, OpGrads
from te_jax.quantize.quantize_layout import QuantizeLayout
from te_jax.quantize.scaled_tensor import ScaledTensor
from te_jax.sharding import ACT, EMBED, MLP

__all__ = [
    "Linear",
    "PARALLEL_MODES",
    "gated_activation_follows",
    "linear_forward",
    "linear_backward",
]

_WHERE = "te_jax.ops.Linear"
# Tensor-parallel modes: the kernel's logical axes (column: the output features split, row: the
# input features split; the GEMM's sharding rule then places the collectives).
PARALLEL_MODES = {None: None, "column": (EMBED, MLP), "row": (MLP, EMBED)}


def _positive(field: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{_WHERE}: {field} must be a positive int, got {value!r}")
    return value


class Linear(BasicOperation):
    """``y (..., out_features) = x (..., in_features) · kernel (in_features, out_features)``.

    The GEMM accumulates in float32 and rounds once to the compute dtype (x's, or ``dtype``).
    Under the ``Sequential``'s recipe x and the kernel are quantized (E4M3) and the backward's
    gradient too (E5M2 with the hybrid format), with quantizers of its own (``quantizers``:
    delayed scaling's state as ``te_jax.nnx.FP8Meta``).

    Args:
      in_features, out_features: the kernel's shape.
      parallel_mode: ``None``, ``"column"`` (kernel axes ``(embed, mlp)``: the output features
        split over the tensor-parallel mesh axis) or ``"row"`` (``(mlp, embed)``).
      kernel_axes: the kernel's logical axis names (overrides ``parallel_mode``'s).
      kernel_init: initializer of the ``(in_features, out_features)`` kernel.
      param_dtype: the kernel's dtype (float32).
      dtype: the compute dtype (``None``: x's).
      implementation: ``None``, ``"ffi"`` or ``"xla"``, as for ``te_jax.dense``.
      rngs: ``nnx.Rngs`` (or give them to the ``Sequential``).

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> from te_jax import ops
      >>> linear = ops.Linear(32, 16, rngs=nnx.Rngs(0))
      >>> x = jnp.linspace(-1.0, 1.0, 128).reshape(4, 32)
      >>> y = ops.Sequential(linear)(x)
      >>> hi = lambda a, b: jnp.dot(a, b, precision="highest")  # float32 on any GPU
      >>> y.shape, bool(jnp.allclose(y, hi(x, linear.kernel[...]), atol=1e-5))
      ((4, 16), True)
    """

    uses_recipe = True

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        parallel_mode: str | None = None,
        kernel_axes: Sequence[str | None] | None = None,
        kernel_init: Callable = KERNEL_INIT,
        param_dtype=jnp.float32,
        dtype=None,
        implementation: str | None = None,
        rngs: nnx.Rngs | None = None,
    ):
        self.in_features = _positive("in_features", in_features)
        self.out_features = _positive("out_features", out_features)
        if parallel_mode not in PARALLEL_MODES:
            raise ValueError(
                f"{_WHERE}: parallel_mode must be None, 'column' or 'row', got {parallel_mode!r}"
            )
        self.parallel_mode = parallel_mode
        axes = PARALLEL_MODES[parallel_mode] if kernel_axes is None else tuple(kernel_axes)
        if axes is not None and len(axes) != 2:
            raise ValueError(f"{_WHERE}: kernel_axes must name 2 axes, got {kernel_axes!r}")
        self.kernel_axes = axes
        self.kernel_init = kernel_init
        self.param_dtype = jnp.dtype(param_dtype)
        self.dtype = None if dtype is None else jnp.dtype(dtype)
        self.implementation = implementation
        self.quantizers = QuantizerState(None)
        self.output_view = (self.out_features,)
        if rngs is not None:
            self._init_kernel(rngs)

    @property
    def kernel_shape(self) -> tuple[int, ...]:
        """``(in_features, out_features)``, or ``(in_features, 2, N)`` before a gated
        activation (``plan_layout``): the halves as an axis of their own, as te_jax's modules
        store a gated kernel, so a split of N keeps both halves of each column on one shard."""
        return (self.in_features,) + self.output_view

    @property
    def param_axes(self):
        """The kernel parameter's logical axis names: ``kernel_axes``, with ``ACT`` for the
        halves' axis of a gated kernel."""
        return _view_axes(self.kernel_axes, self.output_view)

    def _init_kernel(self, rngs: nnx.Rngs) -> None:
        # Drawn flat, so the initializer's fan-in/fan-out are the GEMM's, then viewed.
        flat = (self.in_features, self.out_features)
        value = self.kernel_init(rngs.params(), flat, self.param_dtype)
        self.kernel = param_with_axes(value.reshape(self.kernel_shape), self.param_axes)

    def build(self, index, rngs, recipe) -> None:
        if not hasattr(self, "kernel"):
            if rngs is None:
                raise ValueError(
                    f"{_WHERE} (operation {index}): its kernel needs rngs: give rngs=nnx.Rngs(...) "
                    "to the Linear or to the Sequential"
                )
            self._init_kernel(rngs)
        self.quantizers = QuantizerState(recipe)

    def plan_layout(self, following) -> None:
        """Before a gated ``Activation`` (a ``Bias`` between them or not) the kernel is
        ``(in_features, 2, N)`` and the GEMM writes the ``(2, N)`` layout the activation and its
        gradient use: the gradient quantized by the activation's backward is the one this
        GEMM's backward reads, and a column-parallel split of N keeps each column's halves on
        one shard."""
        gated = gated_activation_follows(following)
        n = self.out_features
        view = (2, n // 2) if gated and n % 2 == 0 else (n,)
        if view == self.output_view:
            return
        self.output_view = view
        if hasattr(self, "kernel"):  # made at construction: the same values, viewed
            value = self.kernel[...].reshape(self.kernel_shape)
            self.kernel = param_with_axes(value, self.param_axes)

    def op_args(self, sequence_input, extra_inputs) -> OpArgs:
        return OpArgs({"kernel": self.kernel[...]}, self.quantizers())

    def check_input(self, index, shape):
        if len(shape) < 1 or shape[-1] != self.in_features:
            raise ValueError(
                f"{_WHERE} (operation {index}): takes (..., {self.in_features}) inputs, got "
                f"shape {shape}"
            )
        return shape[:-1] + (self.out_features,)

    def input_quantizer(self, args, training):
        qs = args.quantizer_set
        if qs is None:
            return None
        layout = QuantizeLayout.ROWWISE_COLWISE if training else QuantizeLayout.ROWWISE
        return Handoff(
            qs.with_layout("x", layout),
            (self.in_features,),
            qs.scaling_mode.impl.gemm_folds_rows,
        )

    def grad_output_quantizer(self, args, ctx):
        qs = args.quantizer_set
        if qs is None:
            return None
        cfg = ctx.cfg
        grad = qs.with_layout("grad", QuantizeLayout.ROWWISE_COLWISE)
        return Handoff(grad, cfg.features, cfg.fold_rows)

    def op_forward(self, ctx, x, args, **_):
        return linear_forward(self, ctx, x, args.params["kernel"], None, args.quantizer_set)[0]

    def op_backward(self, ctx, dy):
        dx, dk, _, new_qs = linear_backward(ctx, dy)
        return dx, OpGrads({"kernel": dk}, new_qs)


def _view_axes(kernel_axes, features):
    """The logical axes of the kernel viewed as ``(in, *features)``: ``ACT`` for the halves'
    axis of a gated ``(in, 2, N)`` view."""
    if kernel_axes is None or len(features) != 2:
        return kernel_axes
    return (kernel_axes[0], ACT, kernel_axes[1])


def gated_activation_follows(following: Sequence[BasicOperation]) -> bool:
    """Whether ``following`` (the ops after a ``Linear`` or ``Bias``) starts with a gated
    ``Activation``, a ``Bias`` before it or not."""
    # Imported here: the activation and bias modules import nothing of this one.
    from te_jax.ops.basic.activation import Activation  # noqa: PLC0415
    from te_jax.ops.basic.bias import Bias  # noqa: PLC0415

    rest = list(following[:2])
    if rest and isinstance(rest[0], Bias):
        rest = rest[1:]
    return bool(rest) and isinstance(rest[0], Activation) and rest[0].act.is_gated


def linear_forward(
    op: Linear,
    ctx,
    x,
    kernel,
    bias,
    qs,
    features=None,
    act=None,
    act_params=None,
    addend=None,
):
    """The GEMM of ``op`` (with ``bias`` and ``act`` in it where a fusion gives them): ``y`` or
    ``h``, and ``op``'s context filled (``core.Residuals`` without ``act_in``, the config of
    the GEMM alone, x's leading shape). ``features``: the kernel's output axes as the GEMM
    takes them (``(2, N)`` before a gated activation), by default ``op.output_view``. ``y``
    comes back flat ``(*lead, out_features)`` without ``act``.
    ``addend`` (``(*lead, out_features)``, no ``act``): ``y = x·k + addend + bias``, in the
    GEMM's own pass (one rounding) where it is in y's dtype; otherwise added to the rounded
    ``y`` in float32 and rounded once more, as ``AddInput`` does.
    Returns ``(y, act_in)``: ``act_in`` what dact reads, in ``(*lead, *features)`` (``None``
    without ``act`` or a backward)."""
    features = tuple(features or op.output_view)
    if op.dtype is not None and not isinstance(x, ScaledTensor):
        x = x.astype(op.dtype)
    k = kernel.reshape((op.in_features,) + tuple(features))
    b = None if bias is None else bias.reshape(features)
    axes = _view_axes(op.kernel_axes, features)
    cfg, k, b, qs = core.prepare(
        x, k, b, act, qs, act_params, ((-1,), (0,)), op.implementation, _WHERE, kernel_axes=axes
    )
    lead = tuple(x.shape)[:-1]
    late = addend is not None and np.dtype(addend.dtype) != np.dtype(cfg.dtype)
    y, res = core.forward(x, k, b, qs, cfg, residuals=ctx.training, addend=None if late else addend)
    act_in = None
    if res is not None:
        act_in = res.act_in
        if isinstance(x, ScaledTensor) and qs is not None:
            # x came quantized with this GEMM's x quantizer: its next state is this use's.
            res = res._replace(new_qs=dataclasses.replace(res.new_qs, x=core.next_state(qs.x, x)))
        res = res._replace(act_in=None, quantized_x=None)
        ctx.save_for_backward(res)
    ctx.cfg = dataclasses.replace(cfg, act=None, params=None, has_bias=False)
    ctx.lead = lead
    ctx.kernel_shape = tuple(kernel.shape)
    if act_in is not None:
        act_in = act_in.reshape(lead + features)
    if act is None:
        y = y.reshape(lead + (op.out_features,))
    if late:
        y = (y.astype(jnp.float32) + addend.astype(jnp.float32)).astype(y.dtype)
    return y, act_in


def linear_backward(ctx, dy):
    """``(dx, dkernel, the bias gradient or None, the quantizer set's next state)`` of the GEMM
    ``linear_forward`` ran, from ``dy`` (an array, or a ScaledTensor of the gradient
    quantizer in the GEMM's ``(*rows, *features)``)."""
    (res,) = ctx.saved_tensors
    cfg = ctx.cfg
    v = core.views(ctx.lead, cfg)
    if isinstance(dy, ScaledTensor):
        dh = dy
    else:
        dy2 = dy.reshape(v.rows + cfg.features)
        dh, _ = core.dact(dy2, None, cfg, v, quantizer=core.grad_quantizer(res))
    dx, dk, _, new_qs = core.gemm_grads(cfg, res, v, dh, None)
    return dx.reshape(ctx.lead + (v.k,)), dk.reshape(ctx.kernel_shape), None, new_qs
