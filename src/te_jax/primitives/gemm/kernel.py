"""The GEMM's kernel lowering: one ``te_jax_gemm`` call (cuBLASLt, ffi/gemm/) on the FFI
contract's rank-2 or rank-3 form, with the cases the contract does not take handled around it.

* Nothing to multiply (a zero-sized M, N, K or batch): the pure-JAX results.
* A shared weight under batch axes (rows contiguous): one GEMM over all rows.
* A batched ``grad_bias``: cuBLASLt's BGRAD reduces one GEMM, so the batch's rounded outputs
  are summed here.
* An addend: cuBLASLt's ``C`` (``beta = 1``), of out's layout.
* Block-scaled operands with a GELU epilogue, which cuBLASLt's block-scaled GEMM does not run:
  the GEMM's output in the output dtype, then te_jax's activation kernel (two roundings); with
  RELU or an addend its float32 accumulator, the rest in JAX (one rounding).
* **The one float32 fallback** for FP8 operands cuBLASLt's FP8 GEMM cannot take (K or N not a
  multiple of ``FP8_ALIGNMENT``, which a shard of a sharded GEMM can be too) and for an FP8
  GEMM with a float32 output and a bias (no such cuBLASLt epilogue): the kernel writes the float32
  accumulator (misaligned operands widened exactly to float32), and the scales, bias and
  epilogue run in JAX (``reference.epilogue``): no rounding beyond float32's.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from te_jax.activation_types import ActivationType
from te_jax.primitives import base
from te_jax.primitives.activation.act_lu import act_lu_kernel
from te_jax.primitives.activation.dact_dbias import dact_dbias_kernel
from te_jax.primitives.gemm.config import GemmConfig
from te_jax.primitives.gemm.epilogue import GemmEpilogue
from te_jax.primitives.gemm.reference_results import F32, FP8, epilogue, reference_results
from te_jax.quantize import formats

__all__ = ["TARGET", "GEMM_WORKSPACE_BYTES", "FP8_ALIGNMENT", "dims", "kernel_results"]

TARGET = "te_jax_gemm"
GEMM_WORKSPACE_BYTES = 32 * 1024 * 1024  # kGemmWorkspaceBytes of ffi/gemm/problem.h
# cuBLASLt's FP8 GEMM needs K and N to be multiples of 16 (16-byte aligned leading dimensions).
FP8_ALIGNMENT = 16


def dims(lhs_shape, rhs_shape, lhs_trans: bool, rhs_trans: bool):
    """``(batch, M, K, N)`` of one-K, one-N operands (the batch axes are lhs's leading axes)."""
    m, k = (lhs_shape[-1], lhs_shape[-2]) if lhs_trans else (lhs_shape[-2], lhs_shape[-1])
    n = rhs_shape[-2] if rhs_trans else rhs_shape[-1]
    return tuple(lhs_shape[:-2]), m, k, n


def kernel_results(
    lhs, rhs, bias, aux, lhs_scale_inv, rhs_scale_inv, addend, config: GemmConfig, *, ffi_call=None
):
    """The local computation of one-K, one-N operands on te_jax's kernel.

    ``ffi_call(target, results, *operands, **attributes)`` makes the custom call
    (``te_jax.primitives.base.ffi_call`` unless given: the tests pass an emulator of the FFI
    contract, to check the buffers off a GPU).
    """
    ffi_call = base.ffi_call if ffi_call is None else ffi_call
    operands = (lhs, rhs, bias, aux, lhs_scale_inv, rhs_scale_inv, addend)
    batch, m, k, n = dims(lhs.shape, rhs.shape, config.lhs_trans, config.rhs_trans)
    if 0 in (math.prod(batch), m, k, n):  # nothing to multiply: acc = 0 (or no output at all)
        return reference_results(*operands, config)
    if batch and rhs.ndim < lhs.ndim and not config.lhs_trans:
        # A shared weight: the rows (batch..., M) are contiguous, one GEMM over all of them (one
        # BGRAD epilogue for dbias too).
        flat_aux = aux.reshape(-1, n) if config.reads_aux else aux
        flat_addend = addend.reshape(-1, n) if config.addend else addend
        outs = kernel_results(
            lhs.reshape(-1, k),
            rhs,
            bias,
            flat_aux,
            lhs_scale_inv,
            rhs_scale_inv,
            flat_addend,
            config,
            ffi_call=ffi_call,
        )
        shapes = config.results(batch + (m, n), (n,))
        return [o.reshape(s) for o, s in zip(outs, shapes, strict=True)]
    if config.grad_bias and batch:
        out = kernel_results(*operands, config.replace(grad_bias=False), ffi_call=ffi_call)[0]
        dbias = jnp.sum(out.astype(F32), axis=tuple(range(out.ndim - 1)))
        return [out, dbias.astype(config.out_dtype)]
    fp8 = np.dtype(lhs.dtype) in FP8
    misaligned = fp8 and (k % FP8_ALIGNMENT or n % FP8_ALIGNMENT)
    f32_bias = fp8 and np.dtype(config.out_dtype) == F32 and bias.size
    # cuBLASLt's block-scaled GEMM also wants M and N multiples of 8 (its heuristic finds no
    # kernel otherwise), and of the epilogues it runs only the plain one (with or without bias).
    block_misaligned = config.block_scaled and (m % 8 or n % 8)
    if config.block_scaled and (misaligned or f32_bias or block_misaligned):
        # Block scales vary along K: the scaled float32 accumulator of the fallback below does
        # not exist; the product of the block-dequantized operands is the pure-JAX one.
        return reference_results(*operands, config)
    if config.gelu_after_gemm:
        return _gemm_then_gelu_kernel(ffi_call, operands, config, batch, m, k, n)
    if config.block_scaled and (config.epilogue != GemmEpilogue.DEFAULT or config.addend):
        # The block-scaled float32 accumulator from cuBLASLt, the rest in XLA (one rounding:
        # RELU commutes with it).
        one, absent = jnp.ones((1,), F32), jnp.zeros((0,), F32)
        plain = config.replace(
            epilogue=GemmEpilogue.DEFAULT, out_dtype=F32, grad_bias=False, addend=False
        )
        flat = (lhs, rhs, absent, absent, lhs_scale_inv, rhs_scale_inv, absent)
        acc = kernel_results(*flat, plain, ffi_call=ffi_call)[0]
        return epilogue(acc, bias, aux, one, one, addend, config)
    if misaligned or f32_bias:
        one, absent = jnp.ones((1,), F32), jnp.zeros((0,), F32)
        if misaligned:
            flat = (formats.to_float32(lhs), formats.to_float32(rhs), absent, absent, one, one)
            scales = (lhs_scale_inv, rhs_scale_inv)
        else:
            flat = (lhs, rhs, absent, absent, lhs_scale_inv, rhs_scale_inv)
            scales = (one, one)
        plain = config.replace(
            epilogue=GemmEpilogue.DEFAULT, out_dtype=F32, grad_bias=False, addend=False
        )
        acc = kernel_results(*flat, absent, plain, ffi_call=ffi_call)[0]
        return epilogue(acc, bias, aux, *scales, addend, config)
    return _call(ffi_call, operands, config, batch, m, k, n)


def _gemm_then_gelu_kernel(ffi_call, operands, config, batch, m, k, n):
    """``config.gelu_after_gemm``: the GEMM writes ``h = a·b + bias`` (``acc`` for DGELU) in the
    output dtype, and te_jax's activation kernels finish, as TransformerEngine does:
    ``out = gelu(h)`` (act_lu), resp. ``out = acc · gelu'(aux)`` with dbias (dact_dbias)."""
    lhs, rhs, bias, aux, lhs_scale_inv, rhs_scale_inv, addend = operands
    dgelu = config.epilogue == GemmEpilogue.DGELU
    plain = config.replace(epilogue=GemmEpilogue.DEFAULT, grad_bias=False)
    absent = jnp.zeros((0,), config.out_dtype)
    gemm = (lhs, rhs, absent if dgelu else bias, absent, lhs_scale_inv, rhs_scale_inv, addend)
    (h,) = _call(ffi_call, gemm, plain, batch, m, k, n)
    if dgelu:
        return dact_dbias_kernel(h, aux, ActivationType.GELU, None, config.grad_bias, 0, False)
    (y,) = act_lu_kernel(h, ActivationType.GELU, None, False)
    return [y, h] if config.writes_aux else [y]


def _call(ffi_call, operands, config, batch, m, k, n):
    """The ``te_jax_gemm`` custom call, on ``(M, K)``-style or strided-batched operands."""
    lhs, rhs, bias, aux, lhs_scale_inv, rhs_scale_inv, addend = operands
    out_shape = batch + (m, n)
    shared_rhs = rhs.ndim < lhs.ndim
    if shared_rhs and not config.lhs_trans:  # rows (batch..., M) are contiguous: fold them
        lhs = lhs.reshape(-1, k)
        call_shape = (lhs.shape[0], n)
    else:  # the strided-batched form (B, ., .), B the product of the batch axes
        if shared_rhs:  # (batch..., K, M) cannot fold into M: repeat the weight per batch
            rhs = jnp.broadcast_to(rhs, batch + rhs.shape)
        if batch:
            lhs = lhs.reshape((-1,) + lhs.shape[-2:])
            rhs = rhs.reshape((-1,) + rhs.shape[-2:])
        call_shape = lhs.shape[:-2] + (m, n)
    if config.reads_aux:
        aux = aux.reshape(call_shape)
    if config.addend:
        addend = addend.reshape(call_shape)
    sds, out_dt = jax.ShapeDtypeStruct, config.out_dtype
    results = [
        sds(call_shape, out_dt),
        sds(call_shape if config.writes_aux else (0,), out_dt),
        sds((n,) if config.grad_bias else (0,), out_dt),
        sds((GEMM_WORKSPACE_BYTES,), np.uint8),
    ]
    out, aux_out, dbias, _ = ffi_call(
        TARGET,
        results,
        lhs,
        rhs,
        bias,
        aux,
        lhs_scale_inv,
        rhs_scale_inv,
        addend,
        **config.ffi_attributes(),
    )
    outs = [out.reshape(out_shape)]
    if config.writes_aux:
        outs.append(aux_out.reshape(out_shape))
    if config.grad_bias:
        outs.append(dbias)
    return outs
