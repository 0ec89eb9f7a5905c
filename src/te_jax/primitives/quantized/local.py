"""The local computation of a quantized op: the FFI passes on one shard's operands.

One-pass modes (delayed, MXFP8) make one quantizing call. The two-pass modes (current scaling,
NVFP4) first take the tensor amax (and dbias) in an amax pass, max-reduce it across the shards
with ``reduce_amax`` (the partition's ``pmax``), and hand it to the quantizing call, whose kernel
derives the scale (``Q / amax``, resp. ``6·448 / amax``) and writes ``1 / scale``, both exactly
(``ffi/common/quant_output.h``). So every shard quantizes with the global scale.

A gated dact whose rowwise blocks span its two halves (``dact_spans_halves``) takes two passes
too: the unquantized gradient (and dbias), then the standalone quantize of it.
"""

from __future__ import annotations

import jax.numpy as jnp

from te_jax.primitives.activation.dact_dbias import dact_dbias_kernel
from te_jax.primitives.quantized.config import OpKind, QuantConfig
from te_jax.primitives.quantized.ffi_calls import amax_pass, quantize_pass
from te_jax.primitives.quantized.reference_results import reference_results
from te_jax.primitives.quantized.shapes import geometry, result_avals, result_names

__all__ = ["dact_spans_halves", "kernel", "local_results"]


def kernel(
    operands, scale, kind, act, params, cfg, is_dbias, batch_dims, reduce_amax=None, dbias_f32=False
) -> dict:
    """``{result name: array}`` of the op on local operands.

    ``scale`` (``batch + (1,)``) is delayed scaling's scale (ones for the other modes). With
    ``dbias_f32`` dbias is the float32 sum of the local rows (for a cross-shard sum in float32).
    """
    x = operands[-1]
    g = geometry(kind, act, x.shape, batch_dims, cfg)
    avals = result_avals(kind, cfg, is_dbias, g, x.dtype)
    spec = cfg.spec
    if dact_spans_halves(kind, act, cfg, x.shape):
        # dx over x's buffer (where x is not needed afterwards; XLA copies it otherwise): the
        # two passes then hold no more memory than the fused one.
        dx, *rest = dact_dbias_kernel(
            *operands,
            act,
            params,
            is_dbias,
            batch_dims,
            False,
            dbias_from_workspace=dbias_f32,
            over_x=True,
        )
        s = scale.reshape(g.b).astype(jnp.float32)
        bufs, _, _ = quantize_pass(OpKind.QUANTIZE, None, None, cfg, False, g, (dx,), s)
        fields = spec.fields_of_ffi_results(bufs)
        if is_dbias:
            fields["dbias"] = rest[0]
    elif spec.two_pass:
        amax, dbias, workspace = amax_pass(kind, act, params, is_dbias, g, operands)
        if reduce_amax is not None:
            amax = reduce_amax(amax)
        bufs, _, _ = quantize_pass(kind, act, params, cfg, False, g, operands, amax)
        fields = spec.fields_of_ffi_results(bufs)
        fields["amax"] = amax
    else:
        s = scale.reshape(g.b).astype(jnp.float32)
        bufs, dbias, workspace = quantize_pass(kind, act, params, cfg, is_dbias, g, operands, s)
        fields = spec.fields_of_ffi_results(bufs)
        if spec.kernel_writes_amax and reduce_amax is not None:
            fields["amax"] = reduce_amax(fields["amax"])
    if "dbias" in avals and "dbias" not in fields:
        fields["dbias"] = workspace.sum(axis=1) if dbias_f32 else dbias
    return {k: fields[k].reshape(aval.shape) for k, aval in avals.items()}


def dact_spans_halves(kind: OpKind, act, cfg: QuantConfig, x_shape) -> bool:
    """Whether a gated dact's rowwise blocks span both halves of its flattened ``y [M, 2H]``.

    So it is where a mode takes partial blocks (blockwise FP8) and ``H`` is not a multiple of
    the block. One fused pass over ``(dz, x)`` would then compute each value of such a block from
    its own half's inputs, reading every input twice and evaluating the gradient twice (the CUDA
    kernel's "flat" tile). The unquantized dact pass (with dbias), then the standalone quantize
    of its output, gives the same codes and scales (both round ``y`` to x's dtype before
    quantizing) in about half the time (ffi/activation/cuda/NOTES.md); dbias is then the
    unquantized kernel's (docs/numerics.md §2).
    """
    spec = cfg.spec
    return (
        kind is OpKind.DACT
        and act.act_len == 2
        and spec.partial_blocks
        and x_shape[-1] % spec.block_size != 0
    )


def local_results(operands, scale, kind, act, params, cfg, is_dbias, batch_dims, **kw) -> list:
    """The results in order (``result_names``); empty inputs take the pure-JAX path."""
    if operands[-1].size == 0:
        return reference_results(
            *operands,
            scale,
            kind=kind,
            act=act,
            params=params,
            cfg=cfg,
            is_dbias=is_dbias,
            batch_dims=batch_dims,
        )
    res = kernel(operands, scale, kind, act, params, cfg, is_dbias, batch_dims, **kw)
    return [res[k] for k in result_names(kind, cfg, is_dbias)]
