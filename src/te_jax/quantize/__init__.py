"""Quantization: scaling modes, quantizers, ``ScaledTensor`` and the pure-JAX reference.

``te_jax.quantize`` is both this package and a function::

    from te_jax.quantize import MXFP8Quantizer, QuantizeLayout
    q = te_jax.quantize(x, MXFP8Quantizer(jnp.float8_e4m3fn, QuantizeLayout.ROWWISE_COLWISE))
    x_approx = q.dequantize()

Calling the module quantizes ``x`` with the FFI kernel where there is one
(``te_jax.quantized.quantize``) and the pure-JAX ``te_jax.quantize.reference`` otherwise; see
``docs/quantization.md``.

Modules: ``scaling_modes`` (ScalingMode and one description per mode: its dtypes, shapes,
kernel inputs, sharding factors and arithmetic), ``quantize_layout`` (QuantizeLayout),
``formats`` (the FP8/FP4 formats and the saturating cast), ``geometry`` (where blocks and
transposes fall), ``scale_math`` (amax and the scale formulas), ``quantizers``,
``scaled_tensor``, ``layout`` (output shapes, input checks), ``reference`` (quantize in pure
JAX), ``ieee`` (float32 arithmetic independent of the backend's denormal mode).

This package does not import ``te_jax.primitives`` (which imports it); the FFI path of the
callable module is imported on first call.
"""

from __future__ import annotations

import sys
import types

from te_jax.quantize import formats, ieee, layout, reference
from te_jax.quantize.quantize_layout import QuantizeLayout
from te_jax.quantize.quantizers import (
    CurrentScaleQuantizer,
    DelayedScaleQuantizer,
    MXFP8Quantizer,
    NVFP4Quantizer,
    Quantizer,
)
from te_jax.quantize.scaled_tensor import ScaledTensor
from te_jax.quantize.scaling_modes import ScalingMode

__all__ = [
    "ScalingMode",
    "QuantizeLayout",
    "ScaledTensor",
    "Quantizer",
    "DelayedScaleQuantizer",
    "CurrentScaleQuantizer",
    "MXFP8Quantizer",
    "NVFP4Quantizer",
    "formats",
    "ieee",
    "layout",
    "reference",
]


class _QuantizeModule(types.ModuleType):
    """The ``te_jax.quantize`` package, callable as ``te_jax.quantize(x, quantizer)``."""

    def __call__(
        self, x, quantizer, *, implementation: str | None = None, n_feature_axes: int = 1
    ) -> ScaledTensor:
        """Quantizes ``x`` (see ``te_jax.quantized.quantize``); returns a ``ScaledTensor``."""
        from te_jax.quantized import quantize as _quantize  # noqa: PLC0415 -- cycle

        return _quantize(x, quantizer, implementation=implementation, n_feature_axes=n_feature_axes)


sys.modules[__name__].__class__ = _QuantizeModule
