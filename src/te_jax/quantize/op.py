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

    Args:
      x: ``(..., N)`` float32, bfloat16 or float16.
      quantizer: a ``DelayedScaleQuantizer``, ``CurrentScaleQuantizer``, ``MXFP8Quantizer`` or
        ``NVFP4Quantizer``; its ``q_layout`` says which copies are written.
      implementation: ``None``, ``"ffi"`` or ``"xla"``.
      n_feature_axes: how many trailing axes form N.

    Returns:
      A ``ScaledTensor``: ``data`` in x's shape and the quantizer's ``q_dtype`` (rowwise),
      ``colwise_data`` (colwise: ``(N, M)`` for tensor scaling, x's shape for block scaling),
      their ``scale_inv``; ``dequantize()`` is ``data · scale_inv`` in x's dtype.

    Example:
      >>> import jax.numpy as jnp
      >>> from te_jax.quantize import CurrentScaleQuantizer, QuantizeLayout, quantize
      >>> x = jnp.linspace(-1.0, 1.0, 128, dtype=jnp.float32).reshape(4, 32)
      >>> st = quantize(x, CurrentScaleQuantizer(jnp.float8_e4m3fn, QuantizeLayout.ROWWISE_COLWISE))
      >>> st.data.shape, st.colwise_data.shape, st.data.dtype, st.scale_inv.shape
      ((4, 32), (32, 4), dtype(float8_e4m3fn), ())
      >>> x_approx = st.data.astype(jnp.float32) * st.scale_inv       # data · scale_inv
      >>> bool(jnp.allclose(x_approx, x, rtol=2**-4, atol=2**-9))      # E4M3: 3 mantissa bits
      True
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
