"""The GEMM in pure JAX: the primitive's lowering where there is no kernel, the
``implementation="xla"`` path, and the tests' oracle.

``lax.dot_general`` accumulates ``L @ R`` in float32 (float64 for float64 operands) at HIGHEST
precision; then ``epilogue`` below, shared with the kernel's float32 fallbacks
(``kernel.py``), applies the scales, the bias and the epilogue and rounds once; block-scaled
operands with a GELU epilogue round the GEMM's output before the GELU too (``kernel.py``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from te_jax import activation_reference
from te_jax.primitives.gemm.config import GemmConfig
from te_jax.primitives.gemm.epilogue import GemmEpilogue, GemmScaleMode
from te_jax.quantize import formats

__all__ = [
    "accumulate",
    "block_dequantize",
    "epilogue",
    "reference_results",
    "F32",
    "F64",
    "FP8",
]

F32 = np.dtype(np.float32)
F64 = np.dtype(np.float64)
FP8 = (formats.E4M3, formats.E5M2)

_gelu = activation_reference.component("gelu")
_relu = activation_reference.component("relu")


def accumulate(lhs, rhs, config: GemmConfig, cdt) -> jax.Array:
    """``L @ R`` accumulated in ``cdt``, shape ``(batch..., M, N)``: one K axis, one N axis;
    rhs with lhs's batch axes or rank 2 (shared over them)."""
    if np.dtype(lhs.dtype) in FP8:  # dot_general takes no FP8: widen exactly
        lhs = formats.to_float32(lhs)
    if np.dtype(rhs.dtype) in FP8:
        rhs = formats.to_float32(rhs)
    lc = lhs.ndim - (2 if config.lhs_trans else 1)
    rc = rhs.ndim - (1 if config.rhs_trans else 2)
    batch = tuple(range(lhs.ndim - 2)) if rhs.ndim == lhs.ndim else ()
    # Output axes: batch, lhs's free axes in order (the shared-rhs case: batch..., M), then N.
    return lax.dot_general(
        lhs,
        rhs,
        (((lc,), (rc,)), (batch, batch)),
        precision=lax.Precision.HIGHEST,
        preferred_element_type=cdt,
    )


def epilogue(acc, bias, aux, lhs_scale_inv, rhs_scale_inv, addend, config: GemmConfig) -> list:
    """Everything after the accumulation: scales, addend, bias, epilogue, one rounding; aux and
    dbias.

    ``acc`` is the unscaled accumulator (float32, or float64 for float64 operands) of any
    leading shape; ``addend`` (with ``config.addend``) has acc's shape; dbias sums over every
    axis but the last. The sums run in cuBLASLt's order: ``(acc · scales + addend) + bias``.
    """
    cdt = np.dtype(acc.dtype)
    acc = acc * lhs_scale_inv.astype(cdt)[0] * rhs_scale_inv.astype(cdt)[0]
    h = acc + addend.astype(cdt) if config.addend else acc
    h = h + bias.astype(cdt) if bias.size else h
    ep = config.epilogue
    if config.gelu_after_gemm:
        # The GEMM writes h (acc for DGELU) in the output dtype, the GELU kernel reads it.
        def to_out(v):
            return v.astype(config.out_dtype).astype(cdt)

        acc, h = to_out(acc), to_out(h)
    if ep == GemmEpilogue.DGELU:
        y = acc * _gelu(aux.astype(cdt), None)[1]
    elif ep in (GemmEpilogue.GELU_AUX, GemmEpilogue.GELU):
        y = _gelu(h, None)[0]
    elif ep == GemmEpilogue.RELU:
        y = _relu(h, None)[0]
    else:
        y = h
    out_dt = config.out_dtype
    outs = [y.astype(out_dt)]
    if config.writes_aux:
        outs.append(h.astype(out_dt))
    if config.grad_bias:
        outs.append(jnp.sum(y, axis=tuple(range(y.ndim - 1))).astype(out_dt))
    return outs


_BLOCK = 128


def block_dequantize(data, scale_inv, mode: GemmScaleMode) -> jax.Array:
    """An FP8 operand stored ``(rows, K)`` times its block scales, in float32 (each element
    ``data[r, k] · s``, rounded once): ``BLOCK_1D`` scales ``(ceil(K/128), round_up(rows, 4))``
    (``s = scale_inv[k // 128, r]``), ``BLOCK_2D`` ``(ceil(rows/128), round_up(ceil(K/128), 4))``
    (``s = scale_inv[r // 128, k // 128]``); the padding is not read."""
    rows, k = data.shape
    kb = -(-k // _BLOCK)
    if mode == GemmScaleMode.BLOCK_1D:
        per_block = scale_inv[:, :rows].T  # (rows, kb)
        s = jnp.repeat(per_block, _BLOCK, axis=1)[:, :k]
    else:
        per_tile = scale_inv[:, :kb]  # (ceil(rows/128), kb)
        s = jnp.repeat(jnp.repeat(per_tile, _BLOCK, axis=0), _BLOCK, axis=1)[:rows, :k]
    return formats.to_float32(data) * s


def reference_results(
    lhs, rhs, bias, aux, lhs_scale_inv, rhs_scale_inv, addend, config: GemmConfig
):
    """The primitive's results in pure JAX (one K axis, one N axis; ``split_accumulator`` and
    ``deterministic`` have no effect: the accumulation is always float32). A block-scaled
    operand (TN form, unbatched) is dequantized by its blocks first (``block_dequantize``) and
    multiplied in float32; a tensor scale multiplies the accumulator."""
    cdt = F64 if np.dtype(config.out_dtype) == F64 else F32
    one = jnp.ones((1,), F32)
    if config.lhs_scale_mode != GemmScaleMode.TENSOR:
        lhs, lhs_scale_inv = block_dequantize(lhs, lhs_scale_inv, config.lhs_scale_mode), one
    if config.rhs_scale_mode != GemmScaleMode.TENSOR:
        rhs, rhs_scale_inv = block_dequantize(rhs, rhs_scale_inv, config.rhs_scale_mode), one
    acc = accumulate(lhs, rhs, config, cdt)
    return epilogue(acc, bias, aux, lhs_scale_inv, rhs_scale_inv, addend, config)
