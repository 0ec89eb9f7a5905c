"""``te_jax.quantize.quantize``, the standalone quantize op, and the package's public names (a
plain module: the op is a function in it, the package itself is not callable)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import quantize_oracle as oracle
import te_jax
import te_jax.quantize as tq
from te_jax.quantize import MXFP8Quantizer, QuantizeLayout, ScaledTensor, reference

from .cases import E4M3, FIELDS


def test_package_exports():
    for name in (
        "quantize",
        "ScalingMode",
        "QuantizeLayout",
        "ScaledTensor",
        "DelayedScaleQuantizer",
        "CurrentScaleQuantizer",
        "MXFP8Quantizer",
        "NVFP4Quantizer",
    ):
        assert hasattr(tq, name) and name in tq.__all__
    assert te_jax.quantize is tq and not callable(tq)
    assert callable(tq.quantize) and tq.quantize.__module__ == "te_jax.quantize.op"


def test_quantize_op_gives_the_reference_bits(rng):
    """``te_jax.quantize.quantize(x, q)`` gives the reference's bits (implementation="xla" and the
    default, which is the FFI kernel where te_jax has one)."""
    x = jnp.asarray(rng.uniform(-3, 3, (64, 32)).astype(np.float32))
    q = MXFP8Quantizer(E4M3, QuantizeLayout.ROWWISE_COLWISE)
    want = jax.jit(reference.quantize)(x, q)
    for impl in ("xla", None):
        got = jax.jit(lambda x, q, impl=impl: tq.quantize(x, q, implementation=impl))(x, q)
        assert isinstance(got, ScaledTensor)
        for name in FIELDS:
            g, w = getattr(got, name), getattr(want, name)
            assert (g is None) == (w is None), (impl, name)
            if g is not None:
                np.testing.assert_array_equal(
                    oracle.raw_bits(g), oracle.raw_bits(w), err_msg=f"{impl} {name}"
                )
