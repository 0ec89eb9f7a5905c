"""A kernel quantized once for several uses: gradient accumulation's micro-batches.

With gradient accumulation a step runs the same layers on several micro-batches from the same
parameters and FP8 state, so every micro-batch would quantize every kernel again. XLA:CPU
hoists those loop-invariant quantizes out of a ``lax.scan`` over the micro-batches; XLA:GPU runs
no loop-invariant code motion, so there each micro-batch pays a pass over every float32 kernel
(TransformerEngine-PyTorch's answer is ``is_first_microbatch``). Here the caller quantizes each
kernel once, outside the loop, and hands the codes to ``dense`` / ``fused_mlp``
(``quantized_kernel=``), which then skip the kernel's quantize; the float32 kernel stays an
input for its gradient (the wgrad GEMM does not read the kernel).

Tensor scaling only (delayed and current): one scale per tensor, so the codes of the kernel
``(*K, *F)`` viewed as the ``(K, F)`` matrix (``K = prod(*K)``, ``F = prod(*F)``) are every
layout the GEMMs read (the rowwise copy is the kernel in row-major order, the colwise copy its
transpose), bit for bit what ``dense`` would have quantized. Block scaling (MXFP8) lays its
scales along the GEMMs' own axes and is refused.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from te_jax.quantize import quantize
from te_jax.quantize.quantize_layout import QuantizeLayout
from te_jax.quantize.scaled_tensor import ScaledTensor
from te_jax.recipe import QuantizerSet

__all__ = ["quantize_kernel", "check_quantized_kernel"]

def quantize_kernel(
    kernel: jax.Array,
    quantizer_set: QuantizerSet,
    n_contracting: int = 1,
    implementation: str | None = None,
) -> ScaledTensor:
    """The kernel's FP8 codes for ``dense`` / ``fused_mlp``'s ``quantized_kernel`` argument.

    ``kernel (*K, *F)``, its first ``n_contracting`` axes contracted, is quantized with
    ``quantizer_set.kernel`` (the same scale, so the same codes ``dense`` computes itself) as the
    ``(K, F)`` matrix, rowwise and colwise: ``data (K, F)``, ``colwise_data (F, K)`` in the
    quantizer's FP8 dtype, one float32 ``scale_inv``, and the ``amax`` that advances delayed
    scaling's kernel state.

    Args:
      kernel: ``(*K, *F)`` float32 / bfloat16 / float16 (the parameter as stored).
      quantizer_set: the GEMM's ``QuantizerSet`` under a tensor-scaling recipe
        (``DelayedScaling``, ``CurrentScaling``), with the state of this step.
      n_contracting: how many leading kernel axes are contracted (``dense``'s
        ``contracting_dims``; 1 for a ``(K, N)`` or gated ``(K, 2, N)`` kernel).
      implementation: ``None``, ``"ffi"`` or ``"xla"``.

    Returns:
      A ``ScaledTensor`` (``ROWWISE_COLWISE``) of shape ``(K, F)``; not differentiated (the
      kernel's gradient is the GEMM's ``dkernel``).

    Example:
      >>> import jax, jax.numpy as jnp, te_jax
      >>> qs = te_jax.QuantizerSet.create(te_jax.recipe.DelayedScaling(amax_history_len=4))
      >>> x = jnp.ones((8, 32), jnp.bfloat16)
      >>> w = jnp.full((32, 2, 16), 0.02, jnp.float32)            # gated (K, 2, N)
      >>> qk = te_jax.quantize_kernel(w, qs)
      >>> qk.data.shape, qk.colwise_data.shape, qk.data.dtype
      ((32, 32), (32, 32), dtype(float8_e4m3fn))
      >>> y = te_jax.dense(x, w, None, "swiglu", qs, quantized_kernel=qk)
      >>> bool((y == te_jax.dense(x, w, None, "swiglu", qs)).all())   # the same bits
      True
    """
    where = "te_jax.quantize_kernel"
    qs = _check_set(where, quantizer_set)
    kernel = jnp.asarray(kernel)
    n_c = int(n_contracting)
    if not 1 <= n_c < kernel.ndim:
        raise ValueError(
            f"{where}: n_contracting must be between 1 and kernel.ndim - 1 = {kernel.ndim - 1} "
            f"(the kernel has contracted axes, then output axes), got {n_contracting}"
        )
    k = math.prod(kernel.shape[:n_c])
    # No gradient flows through the codes: the kernel's is dense's dkernel, its state's the
    # set's cotangent there.
    matrix = jax.lax.stop_gradient(kernel.reshape(k, -1))
    q = jax.lax.stop_gradient(qs.with_layout("kernel", QuantizeLayout.ROWWISE_COLWISE))
    return quantize(matrix, q, implementation=implementation)


def _check_set(where: str, qs) -> QuantizerSet:
    if not isinstance(qs, QuantizerSet) or qs.is_empty:
        raise TypeError(
            f"{where}: a quantized kernel needs the GEMM's QuantizerSet under a recipe "
            f"(te_jax.QuantizerSet.create(te_jax.recipe.DelayedScaling())), got {qs!r}"
        )
    if not qs.scaling_mode.is_tensor_scaling:
        raise ValueError(
            f"{where}: a kernel quantized ahead of its GEMMs needs tensor scaling (DelayedScaling,"
            f" CurrentScaling); {qs.scaling_mode.name} lays its block scales along each GEMM's "
            "own axes: let dense quantize the kernel"
        )
    return qs


def check_quantized_kernel(where: str, qk, kernel_shape: tuple, n_c: int, qs) -> ScaledTensor:
    """``qk`` as ``dense`` / ``fused_mlp`` take it (``quantize_kernel``'s output for this
    kernel and set), else a ``TypeError`` / ``ValueError`` naming ``where``."""
    if not isinstance(qk, ScaledTensor):
        raise TypeError(
            f"{where}: quantized_kernel must be te_jax.quantize_kernel(kernel, quantizer_set)'s "
            f"ScaledTensor, got {type(qk).__name__}"
        )
    if qs is None:
        raise ValueError(
            f"{where}: a quantized_kernel was given without a quantizer_set: pass the set it was "
            "quantized with (or no quantized_kernel for an unquantized GEMM)"
        )
    qs = _check_set(where, qs)
    k = math.prod(kernel_shape[:n_c])
    want = (k, math.prod(kernel_shape[n_c:]))
    if qk.scaling_mode != qs.scaling_mode or qk.q_layout != QuantizeLayout.ROWWISE_COLWISE:
        raise ValueError(
            f"{where}: quantized_kernel is {qk.scaling_mode.name} {qk.q_layout.name}; this GEMM "
            f"takes {qs.scaling_mode.name} ROWWISE_COLWISE codes: make it with "
            "te_jax.quantize_kernel(kernel, quantizer_set)"
        )
    if tuple(qk.data.shape) != want or qk.data.dtype != qs.kernel.q_dtype:
        raise ValueError(
            f"{where}: quantized_kernel holds {qk.data.dtype} {tuple(qk.data.shape)}; the kernel "
            f"{tuple(kernel_shape)} ({n_c} contracted axes) under this set quantizes to "
            f"{jnp.dtype(qs.kernel.q_dtype).name} {want}: make it with "
            f"te_jax.quantize_kernel(kernel, quantizer_set, n_contracting={n_c})"
        )
    return qk
