"""The GEMM in pure JAX: the primitive's lowering where there is no kernel, the
``implementation="xla"`` path, and the tests' oracle.

``lax.dot_general`` accumulates ``L @ R`` in float32 (float64 for float64 operands) at HIGHEST
precision; then ``epilogue`` below, shared with the kernel's float32 fallbacks
(``kernel.py``), applies the scales, the bias and the epilogue and rounds once.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from te_jax import activation_reference
from te_jax.primitives.gemm.config import GemmConfig
from te_jax.primitives.gemm.epilogue import GemmEpilogue
from te_jax.quantize import formats

__all__ = ["accumulate", "epilogue", "reference_results", "F32", "F64", "FP8"]

F32 = np.dtype(np.float32)
F64 = np.dtype(np.float64)
FP8 = (formats.E4M3, formats.E5M2)

_gelu = activation_reference.component("gelu")
_relu = activation_reference.component("relu")


def accumulate(lhs, rhs, config: GemmConfig, cdt) -> jax.Array:
    """``L @ R`` accumulated in ``cdt``, shape ``(batch..., M, N)``: one K axis, one N axis;
    rhs with lhs's batch axes or rank 2 (shared over them)."""
    if np.dtype(lhs.dtype) in FP8:  # dot_general takes no FP8: widen exactly
        lhs, rhs = formats.to_float32(lhs), formats.to_float32(rhs)
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


def reference_results(
    lhs, rhs, bias, aux, lhs_scale_inv, rhs_scale_inv, addend, config: GemmConfig
):
    """The primitive's results in pure JAX (one K axis, one N axis; ``split_accumulator`` and
    ``deterministic`` have no effect: the accumulation is always float32)."""
    cdt = F64 if np.dtype(config.out_dtype) == F64 else F32
    acc = accumulate(lhs, rhs, config, cdt)
    return epilogue(acc, bias, aux, lhs_scale_inv, rhs_scale_inv, addend, config)
