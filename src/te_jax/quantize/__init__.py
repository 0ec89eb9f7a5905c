"""Quantization: scaling modes, quantizers, ``ScaledTensor``, the quantize op and its pure-JAX
reference::

    from te_jax.quantize import MXFP8Quantizer, QuantizeLayout, quantize
    q = quantize(x, MXFP8Quantizer(jnp.float8_e4m3fn, QuantizeLayout.ROWWISE_COLWISE))
    x_approx = q.dequantize()

``quantize(x, quantizer)`` quantizes ``x`` with te_jax's kernel where there is one and in pure
JAX (``te_jax.quantize.reference``) otherwise; see ``docs/quantization.md``.

Modules: ``scaling_modes`` (ScalingMode and one description per mode: its dtypes, shapes,
kernel inputs, sharding factors and arithmetic), ``quantize_layout`` (QuantizeLayout: which
quantized copies are written), ``formats`` (the FP8/FP4 formats and the saturating cast),
``geometry`` (where blocks and transposes fall), ``scale_math`` (amax and the scale formulas),
``quantizers``, ``scaled_tensor``, ``shapes`` (the scale shapes and the input checks),
``reference`` (quantize in pure JAX), ``ieee`` (float32 arithmetic independent of the backend's
denormal mode) and ``op`` (the ``quantize`` op).

Only ``op`` imports ``te_jax.primitives``, which imports the other modules of this package; so
``op`` is imported last here.
"""

from __future__ import annotations

from te_jax.quantize import formats, ieee, reference, shapes
from te_jax.quantize.op import quantize  # noqa: I001 -- last: it binds te_jax.primitives
from te_jax.quantize.quantize_layout import QuantizeLayout
from te_jax.quantize.quantizers import (
    CurrentScaleQuantizer,
    DelayedScaleQuantizer,
    Float8Block1DQuantizer,
    Float8Block2DQuantizer,
    MXFP8Quantizer,
    NVFP4Quantizer,
    Quantizer,
)
from te_jax.quantize.scaled_tensor import ScaledTensor
from te_jax.quantize.scaling_modes import ScalingMode

__all__ = [
    "quantize",
    "ScalingMode",
    "QuantizeLayout",
    "ScaledTensor",
    "Quantizer",
    "DelayedScaleQuantizer",
    "CurrentScaleQuantizer",
    "MXFP8Quantizer",
    "NVFP4Quantizer",
    "Float8Block1DQuantizer",
    "Float8Block2DQuantizer",
    "formats",
    "ieee",
    "reference",
    "shapes",
]
