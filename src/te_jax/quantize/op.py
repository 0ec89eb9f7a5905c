"""The standalone quantize op, ``te_jax.quantize.quantize(x, quantizer)``: any tensor to a
``ScaledTensor`` with te_jax's quantize kernel, or in pure JAX (``te_jax.quantize.reference``).

The only module of ``te_jax.quantize`` that binds ``te_jax.primitives`` (which imports the
package's other modules), so the package imports it last.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from te_jax.dispatch import check_input_dtype
from te_jax.primitives.quantized import OpKind
from te_jax.quantize.scaled_tensor import ScaledTensor
from te_jax.quantized_output import quantized_output

__all__ = ["quantize"]


def quantize(
    x: jax.Array, quantizer, implementation: str | None = None, n_feature_axes: int = 1
) -> ScaledTensor:
    """Quantizes ``x (..., N)`` with ``quantizer`` (every mode and layout of docs/numerics.md
    §4-§5). ``n_feature_axes`` trailing axes form N (the colwise copy of tensor scaling is
    ``features + leading``): e.g. 2 for a gated kernel ``(K, 2, N)``, whose colwise copy is
    then ``(2, N, K)``.

    One pass for DELAYED and MXFP8; CURRENT and NVFP4 take two passes over x (the global amax,
    then the scaled cast) with nothing else in memory. Returns a ``ScaledTensor``; its
    ``dequantize()`` gives back x's dtype.

    ``implementation`` as for every op (``te_jax.dispatch``): ``None`` (the kernel where te_jax
    has one for the backend, pure JAX otherwise or under ``TE_JAX_IMPLEMENTATION=xla``),
    ``"ffi"`` or ``"xla"`` (``te_jax.quantize.reference.quantize``); both give the same bits.
    Not differentiable (``te_jax.quantized_output``).
    """
    check_input_dtype("te_jax.quantize.quantize", jnp.result_type(x))
    if jnp.ndim(x) < 1:
        raise ValueError(
            "te_jax.quantize.quantize: x must have at least one axis (..., N), got a scalar"
        )
    if not 1 <= int(n_feature_axes) < jnp.ndim(x) + (0 if jnp.ndim(x) > 1 else 1):
        raise ValueError(
            f"te_jax.quantize.quantize: n_feature_axes must be between 1 and x's rank - 1 "
            f"({jnp.ndim(x) - 1}), got {n_feature_axes}"
        )
    return quantized_output(
        "quantize.quantize",
        OpKind.QUANTIZE,
        (x,),
        quantizer,
        implementation=implementation,
        feature_axes=n_feature_axes,
    )
