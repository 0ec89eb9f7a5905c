"""``te_jax.dense``: GEMM + bias + activation as one differentiable op (docs/numerics.md §8),
the differentiation of ``te_jax.linear.core``'s forward and backward.

``x (..., K) · kernel (K, *F) + bias (*F) -> act -> y``. With a gated activation the kernel is
``(K, 2, N)``, so the GEMM already writes docs/numerics.md §1's ``(..., 2, N)`` layout and the
activation reads it in place: ``y (..., N)``. The leading axes of x are batch / sequence axes:
the GEMM's rows ``M``, handed to it as they are (one weight shared over them, still one GEMM;
under sharding each keeps its own split) and folded into one axis only under block scaling.

**Where each part runs.**

* CUDA (``implementation`` None or ``"ffi"`` on a GPU): te_jax's cuBLASLt handler runs the
  GEMMs; GELU (tanh) and ReLU run in the forward GEMM's epilogue, on its float32 accumulator;
  the other activations are ``act_lu`` on h (one more pass).
* CPU, and ``implementation="xla"`` anywhere: ``lax.dot_general`` with float32 accumulation,
  then ``act_lu`` on the rounded h (te_jax's CPU kernel; pure JAX for ``"xla"``).

Backward: ``dh = dact(dy, h)`` and ``dbias`` from one fused ``quantize_dact_dbias`` (quantized
to the grad quantizer's FP8 in the same pass under a recipe), then the dgrad GEMM
``dx = dh · kernelᵀ`` and the wgrad GEMM ``dkernel = xᵀ · dh`` (contracting every row axis).

**Differentiation.** Unquantized, the op is a ``custom_jvp`` whose tangent
``ẏ = act'(h)·(ẋ·kernel + x·k̇ + ḃ)`` is a ``te_jax.primitives.custom_linear`` with the backward
above as its transpose: reverse mode (``grad``) runs exactly that backward, forward mode (``jvp``,
``jacfwd``) evaluates the tangent in pure JAX (``tangent``), and second order (Hessian-vector
products) differentiates the kernels' JVPs. Under a recipe it is a ``custom_vjp``, reverse mode
only: forward mode raises a ``TypeError`` (``te_jax.fp8_autodiff``).

**FP8** (``quantizer_set`` from a ``te_jax.recipe``): x and the kernel are quantized (E4M3) by
te_jax's quantize kernels into rowwise and colwise (transposed) copies; the forward GEMM takes
x's rowwise and the kernel's colwise copy, dgrad the gradient's and the kernel's rowwise copies,
wgrad x's and the gradient's colwise copies, so no transpose pass sits in front of any FP8 GEMM.
The scales go to cuBLASLt as device pointers and are applied to the float32 accumulator once,
before the bias and the epilogue. On the CPU and with ``implementation="xla"`` the same
quantized operands are dequantized exactly and multiplied in float32: the same product, so the
CPU path is an oracle for the GPU's. Where a dimension cuBLASLt's FP8 GEMM cannot take (the
contracting one, or the output's columns, not a multiple of 16), the GEMM primitive widens the
FP8 codes exactly to float32 and runs a float32 GEMM, the scales applied to its accumulator (the
same math; on the GPU without FP8 tensor cores).
MXFP8 on Hopper: the quantized storage is real, the GEMMs run on the dequantized operands in the
input dtype (exact: an MXFP8 value is an E4M3/E5M2 number times a power of two).

**Delayed scaling's state** comes back as the cotangent of ``quantizer_set`` (the updated set;
see ``te_jax.recipe``). Differentiating the operands but not the set drops it: a warning says so
(an error under ``TE_JAX_STRICT_FP8_STATE=1``; ``te_jax.fp8_autodiff``).

**A quantized x** (a ``ScaledTensor``, e.g. from ``te_jax.activation(h, act, quantizer=qs.x)``)
is used as it is: no second quantize pass. This call measures nothing for ``quantizer_set.x``, so
its cotangent is zero: the quantizer that made x (normally ``qs.x`` itself, given to
``te_jax.activation``) gets its next state from the activation's backward alone. It must have
the recipe's scaling mode, a rowwise copy, and (where ``dense`` is differentiated) the colwise
copy wgrad reads. Its cotangent is the
gradient of its dequantized value (``te_jax.quantize.scaled_tensor``).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import SymbolicZero

from te_jax import _varying, fp8_autodiff
from te_jax.activation_types import ActivationLike, ActivationParams
from te_jax.linear import core
from te_jax.linear.kernel_cache import check_quantized_kernel
from te_jax.primitives.custom_linear import LinearRule, custom_linear
from te_jax.recipe import QuantizerSet

__all__ = ["dense", "apply"]


# ---- the op ---------------------------------------------------------------------------------


def dense(
    x,
    kernel: jax.Array,
    bias: jax.Array | None = None,
    activation_type: ActivationLike | None = None,
    quantizer_set: QuantizerSet | None = None,
    act_params: ActivationParams | None = None,
    contracting_dims: tuple[Sequence[int], Sequence[int]] = ((-1,), (0,)),
    implementation: str | None = None,
    kernel_axes: Sequence[str | None] | None = None,
    quantized_kernel=None,
):
    """Dense layer: ``y = act(x · kernel + bias)``, one differentiable op.

    ``h = x · kernel + bias`` accumulates in float32 and is rounded once to x's dtype; then
    ``y = act(h)`` (docs/numerics.md §1, §8). ``jax.grad`` gives ``dx``, ``dkernel``, ``dbias``
    (and, under a delayed-scaling recipe, the updated ``quantizer_set``). Without a quantizer set
    ``jax.jvp`` / ``jax.jacfwd`` work too; FP8 is reverse-mode only.

    Args:
      x: ``(..., K)`` float32 / bfloat16 / float16 (the compute dtype), or a ``ScaledTensor``
        (already quantized for this GEMM, see the module docstring).
      kernel: ``(K, *F)``; for a gated activation ``(K, 2, N)``. Cast to x's dtype; under a
        recipe quantized from its own dtype instead (float32 parameters: one rounding).
      bias: ``None`` or ``F``-shaped (``(N,)``, ``(2, N)`` for gated). Cast to x's dtype.
      activation_type: ``None`` (a plain GEMM), any te_jax activation (``("gelu",)``, ``"relu"``)
        or gated pair (``("silu", "linear")``).
      quantizer_set: ``None`` / an empty set (no quantization) or
        ``te_jax.QuantizerSet.create(recipe)``.
      act_params: ``ActivationParams`` for clamped SwiGLU.
      contracting_dims: ``(x_axes, kernel_axes)``; x's must be its trailing axes and the
        kernel's its leading ones, in the same order (the default: last of x, first of kernel).
      implementation: ``None`` (te_jax's kernels where there are some), ``"ffi"`` or ``"xla"``.
      kernel_axes: the kernel's logical axis names (one per axis, ``None`` for none), as the
        Flax modules give them: under a mesh and Flax logical axis rules the kernel's gradient
        is constrained to the kernel's sharding, so an FSDP-sharded kernel's gradient is
        reduce-scattered rather than all-reduced (``te_jax.sharding``). No effect otherwise.
      quantized_kernel: ``None``, or ``te_jax.quantize_kernel(kernel, quantizer_set)``: the
        kernel's codes quantized once for several calls (gradient accumulation's
        micro-batches), used in place of quantizing the kernel here; the same bits. The
        kernel's gradient is still ``dkernel``; the codes get none.

    Returns:
      ``y``: ``(..., *F)`` (gated: ``(..., N)``) in x's dtype.

    Example:
      >>> import jax, jax.numpy as jnp, te_jax
      >>> x = jnp.ones((4, 16, 32), jnp.bfloat16)
      >>> w = jnp.full((32, 2, 64), 0.01, jnp.bfloat16)       # gated kernel (K, 2, N)
      >>> te_jax.dense(x, w, activation_type="swiglu").shape
      (4, 16, 64)
      >>> qs = te_jax.QuantizerSet.create(te_jax.recipe.CurrentScaling())   # FP8
      >>> te_jax.dense(x, w[:, 0], quantizer_set=qs).dtype
      dtype(bfloat16)
    """
    return apply(
        "te_jax.dense",
        x,
        kernel,
        bias,
        activation_type,
        quantizer_set,
        act_params,
        contracting_dims,
        implementation,
        kernel_axes,
        quantized_kernel,
    )


def apply(
    where: str,
    x,
    kernel,
    bias,
    activation_type,
    quantizer_set,
    act_params,
    contracting_dims,
    implementation,
    kernel_axes=None,
    quantized_kernel=None,
):
    """``dense``'s computation for the public op ``where`` (``"te_jax.dense"``,
    ``"te_jax.gemm"``), which names it in its errors: checks, then the differentiable op."""
    cfg, kernel, bias, quantizer_set = core.prepare(
        x,
        kernel,
        bias,
        activation_type,
        quantizer_set,
        act_params,
        contracting_dims,
        implementation,
        where,
        kernel_axes=kernel_axes,
    )
    if quantized_kernel is not None:
        quantized_kernel = check_quantized_kernel(
            where, quantized_kernel, tuple(kernel.shape), len(cfg.contract), quantizer_set
        )
    if cfg.dtype == np.float64:
        return core.dense_float64(x, kernel, bias, cfg)
    # Inside shard_map: one varying-axes type for the differentiable operands (te_jax._varying).
    x, kernel, bias = _varying.match(x, kernel, bias)
    if quantizer_set is None:
        return _dense_unquantized(x, kernel, bias, cfg)
    return fp8_autodiff.reverse_mode_only(
        where, _dense, x, kernel, bias, quantizer_set, quantized_kernel, cfg
    )


# ---- unquantized: a custom_jvp whose tangent transposes to the fused backward ---------------


@functools.partial(jax.custom_jvp, nondiff_argnums=(3,))
def _dense_unquantized(x, kernel, bias, cfg: core.DenseConfig):
    return core.forward(x, kernel, bias, None, cfg, residuals=False)[0]


@functools.partial(_dense_unquantized.defjvp, symbolic_zeros=True)
def _dense_unquantized_jvp(cfg: core.DenseConfig, primals, tangents):
    """``y`` from the forward that keeps the backward's residuals (GELU_AUX on the GPU), and
    ``ẏ = act'(h)·(ẋ·kernel + x·k̇ + ḃ)`` as a ``custom_linear`` of the tangents present:
    ``tangent`` in forward mode, ``_backward`` (dact + dbias, dgrad, wgrad) when transposed."""
    x, kernel, bias = primals
    y, res = core.forward(x, kernel, bias, None, cfg, residuals=True)
    present = tuple(_is_tangent(t) for t in tangents)
    if not any(present):
        return y, jnp.zeros_like(y)
    leaves, tree = jax.tree.flatten(res)
    rule = LinearRule(_tangent_apply, _tangent_transpose, (cfg, tree, present, y.shape))
    (y_dot,) = custom_linear(rule, leaves, [t for t, p in zip(tangents, present, strict=True) if p])
    return y, y_dot


def _is_tangent(t) -> bool:
    """A tangent that is there: not a symbolic zero (an input not differentiated), not the
    empty tangent of ``bias=None``."""
    return t is not None and not isinstance(t, SymbolicZero)


def _present(present, tangents) -> list:
    """The tangents of ``(x, kernel, bias)`` with ``None`` where absent."""
    it = iter(tangents)
    return [next(it) if p else None for p in present]


def _tangent_apply(static, leaves, tangents):
    """Forward mode: ``tangent`` of the tangents present, in y's shape."""
    cfg, tree, present, y_shape = static
    res = jax.tree.unflatten(tree, leaves)
    return (core.tangent(cfg, res, *_present(present, tangents)).reshape(y_shape),)


def _tangent_transpose(static, leaves, cotangents):
    """Reverse mode: the backward, the cotangents of the tangents present."""
    cfg, tree, present, _ = static
    (dy,) = cotangents
    x_ct, dk, dbias, _ = core.backward(cfg, jax.tree.unflatten(tree, leaves), dy)
    return tuple(ct for ct, p in zip((x_ct, dk, dbias), present, strict=True) if p)


# ---- FP8: the custom_vjp --------------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _dense(x, kernel, bias, qs, qk, cfg: core.DenseConfig):
    return core.forward(x, kernel, bias, qs, cfg, residuals=False, quantized_kernel=qk)[0]


def _dense_fwd(x, kernel, bias, qs, qk, cfg):
    """The forward with residuals; ``symbolic_zeros`` tells which inputs are differentiated, so
    a delayed-scaling set left out of the differentiation is reported (te_jax.fp8_autodiff)."""
    (x, kernel, bias), operands = fp8_autodiff.unwrap_primals((x, kernel, bias))
    qs, state = fp8_autodiff.unwrap_primals(qs)
    if fp8_autodiff.under_jvp((x, kernel, bias, qs)):  # jvp of grad: forward over this op
        raise TypeError(fp8_autodiff.forward_mode_message(cfg.where))
    fp8_autodiff.check_state_differentiated(cfg.where, operands, [state])
    (qk,), _ = fp8_autodiff.unwrap_primals((qk,))
    return core.forward(x, kernel, bias, qs, cfg, residuals=True, quantized_kernel=qk)


def _dense_bwd(cfg, res, dy):
    # The quantized kernel's codes get no cotangent (the kernel's gradient is dkernel).
    return (*core.backward(cfg, res, fp8_autodiff.instantiate(dy)), None)


_dense.defvjp(_dense_fwd, _dense_bwd, symbolic_zeros=True)
