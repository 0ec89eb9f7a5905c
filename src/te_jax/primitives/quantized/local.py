"""The local computation of a quantized op: the FFI passes on one shard's operands.

One-pass modes (delayed, MXFP8) make one quantizing call. The two-pass modes (current scaling,
NVFP4) first take the tensor amax (and dbias) in an amax pass, max-reduce it across the shards
with ``reduce_amax`` (the partition's ``pmax``), and hand it to the quantizing call, whose kernel
derives the scale (``Q / amax``, resp. ``6·448 / amax``) and writes ``1 / scale``, both exactly
(``ffi/common/quant_output.h``). So every shard quantizes with the global scale.
"""

from __future__ import annotations

import jax.numpy as jnp

from te_jax.primitives.quantized.ffi_calls import amax_pass, quantize_pass
from te_jax.primitives.quantized.reference_results import reference_results
from te_jax.primitives.quantized.shapes import geometry, result_avals, result_names

__all__ = ["kernel", "local_results"]


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
    if spec.two_pass:
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
    if "dbias" in avals:
        fields["dbias"] = workspace.sum(axis=1) if dbias_f32 else dbias
    return {k: fields[k].reshape(aval.shape) for k, aval in avals.items()}


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
