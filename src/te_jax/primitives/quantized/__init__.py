"""Quantized outputs of the te_jax ops as one outer primitive, ``te_jax_quantized``: ``act_lu``,
the standalone ``quantize`` and ``dact`` (+ dbias) with an FP8 / FP4 output
(docs/numerics.md §4-§6).

Modules, one job each: ``config`` (the op kind and the quantizer's static configuration),
``shapes`` (geometry and result shapes), ``ffi_calls`` (the FFI calls), ``local`` (one shard's
computation, the two-pass amax logic), ``reference_results`` (the results in pure JAX, as
``act_lu.reference_results`` / ``dact_dbias.reference_results`` are the unquantized family's),
``sharding`` (Shardy rule and partition), ``primitive`` (the primitive, batching,
``bind_quantized``). It has no autodiff rules: a quantized output is not differentiable
(``te_jax.quantized_output``).
Everything that depends on the scaling mode is the mode's description
(``te_jax.quantize.scaling_modes``).
"""

from te_jax.primitives.quantized.config import OpKind, QuantConfig
from te_jax.primitives.quantized.primitive import bind_quantized

__all__ = ["OpKind", "QuantConfig", "bind_quantized"]
