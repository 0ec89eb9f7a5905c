"""Bad input is refused at trace time, with a message naming what is wrong and what was
expected (nothing here compiles)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import quantize_oracle as oracle
from te_jax.quantize import (
    CurrentScaleQuantizer,
    DelayedScaleQuantizer,
    MXFP8Quantizer,
    NVFP4Quantizer,
    QuantizeLayout,
    reference,
    shapes,
)

from .cases import CURRENT, DELAYED, E2M1, E4M3, Config, assert_same_bits

RC = QuantizeLayout.ROWWISE_COLWISE


def _trace(y_shape, dtype, quantizer, nf=1):
    """Traces reference.quantize abstractly: errors surface, nothing runs."""
    y = jax.ShapeDtypeStruct(y_shape, dtype)
    return jax.eval_shape(lambda y: reference.quantize(y, quantizer, n_feature_axes=nf), y)


@pytest.mark.parametrize(
    "dtype", [jnp.int32, jnp.bool_, jnp.uint8, jnp.complex64, jnp.float8_e4m3fn, jnp.float4_e2m1fn]
)
def test_non_input_dtype(dtype):
    match = r"te_jax.quantize: the input must be float32, bfloat16 or float16 .*got"
    with pytest.raises(TypeError, match=match):
        _trace((4, 32), dtype, MXFP8Quantizer())


def test_float64_is_accepted_by_the_reference():
    shapes.check_quantize_input((4, 32), np.float64, MXFP8Quantizer(), 1, "quantize")


@pytest.mark.parametrize(
    "quantizer,shape,nf,match",
    [
        (
            MXFP8Quantizer(),
            (4, 48),
            1,
            r"MXFP8_1D_SCALING rowwise quantization needs the last axis \(axis 1, size 48\) "
            r"divisible by the block size 32; got shape \(4, 48\)",
        ),
        (
            NVFP4Quantizer(),
            (3, 2, 24),
            2,
            r"NVFP4_1D_SCALING rowwise .*\(axis 2, size 24\) divisible by the block size 16",
        ),
        (
            MXFP8Quantizer(E4M3, QuantizeLayout.COLWISE),
            (64,),
            1,
            r"MXFP8_1D_SCALING colwise quantization blocks 32 consecutive rows, so it needs a "
            r"leading \(row\) axis",
        ),
        (
            NVFP4Quantizer(E2M1, RC),
            (8, 2, 32),
            2,
            r"innermost leading axis \(axis 0, size 8\) divisible by the block size 16",
        ),
        (
            MXFP8Quantizer(E4M3, RC),
            (4, 40, 32),
            1,
            r"colwise quantization needs the innermost leading axis \(axis 1, size 40\) "
            r"divisible by the block size 32",
        ),
        (
            NVFP4Quantizer(E2M1, QuantizeLayout.COLWISE),
            (2, 32),
            2,
            r"needs a leading \(row\) axis before the 2 feature axis\(es\)",
        ),
        (
            CurrentScaleQuantizer(),
            (4, 8),
            3,
            r"n_feature_axes must be an int from 1 to the "
            r"input's rank 2, got 3",
        ),
        (CurrentScaleQuantizer(), (4, 8), 0, r"n_feature_axes must be an int from 1"),
        (CurrentScaleQuantizer(), (), 1, r"cannot quantize a scalar"),
    ],
)
def test_bad_shapes(quantizer, shape, nf, match):
    with pytest.raises(ValueError, match=match):
        _trace(shape, jnp.bfloat16, quantizer, nf)
    with pytest.raises(ValueError, match=match):  # the shared check, as the FFI path calls it
        shapes.check_quantize_input(shape, jnp.float32, quantizer, nf, "te_jax.act_lu")


def test_check_names_the_op():
    with pytest.raises(ValueError, match=r"^te_jax.act_lu: MXFP8_1D_SCALING rowwise"):
        shapes.check_quantize_input((2, 33), jnp.float32, MXFP8Quantizer(), 1, "act_lu")


@pytest.mark.parametrize("config", [Config(DELAYED, E4M3), Config(CURRENT, E4M3)], ids=str)
@pytest.mark.parametrize(
    "shape, nf", [((7,), 1), ((3, 5), 1), ((3, 5, 2, 7), 2), ((0, 3), 1)], ids=str
)
def test_tensor_scaling_takes_any_shape(shape, nf, config):
    """Tensor scaling has no blocks: a shape no block mode takes (odd, 1-D, empty, gated)
    quantizes, every field the oracle's bits, the colwise copy ``features + leading``."""
    y = np.random.default_rng(len(shape) + nf).standard_normal(shape).astype(np.float16)
    quantizer = config.quantizer(scale=3.0)
    got = jax.jit(reference.quantize, static_argnames="n_feature_axes")(
        jnp.asarray(y), quantizer, n_feature_axes=nf
    )
    scale = 3.0 if config.mode is DELAYED else None
    want = oracle.quantize(y, int(config.mode), int(RC), config.q_dtype, nf, scale=scale)
    assert got.colwise_data.shape == shape[len(shape) - nf :] + shape[: len(shape) - nf]
    assert_same_bits(got, want, f"{config} {shape}")


def test_not_a_quantizer():
    with pytest.raises(TypeError, match=r"quantizer must be a te_jax.quantize quantizer .*got str"):
        _trace((4, 32), jnp.float32, "mxfp8")


@pytest.mark.parametrize(
    "make,match",
    [
        (
            lambda: MXFP8Quantizer(jnp.float4_e2m1fn),
            r"q_dtype=.*float4_e2m1fn.* is not supported "
            r"by MXFP8_1D_SCALING; allowed: float8_e4m3fn, float8_e5m2",
        ),
        (
            lambda: NVFP4Quantizer(jnp.float8_e4m3fn),
            r"not supported by NVFP4_1D_SCALING; "
            r"allowed: float4_e2m1fn",
        ),
        (lambda: CurrentScaleQuantizer(jnp.bfloat16), r"not supported by CURRENT_TENSOR_SCALING"),
        (lambda: DelayedScaleQuantizer.create(jnp.float8_e8m0fnu), r"allowed: float8_e4m3fn"),
        (
            lambda: MXFP8Quantizer(E4M3, 3),
            r"q_layout=3 is not a quantize layout; allowed: "
            r"QuantizeLayout.ROWWISE, QuantizeLayout.COLWISE, QuantizeLayout.ROWWISE_COLWISE",
        ),
        (lambda: MXFP8Quantizer(E4M3, "diagonal"), r"q_layout='diagonal' is not a quantize"),
        (
            lambda: DelayedScaleQuantizer.create(amax_compute_algo="mean"),
            r"amax_compute_algo='mean' is not supported; allowed: 'max', 'most_recent'",
        ),
        (
            lambda: DelayedScaleQuantizer.create(margin=-1),
            r"margin must be a non-negative int, "
            r"got -1",
        ),
        (lambda: DelayedScaleQuantizer.create(margin=0.5), r"margin must be a non-negative int"),
        (
            lambda: DelayedScaleQuantizer.create(amax_history_len=0),
            r"amax_history_len must be an "
            r"int >= 1, got 0",
        ),
    ],
)
def test_bad_quantizer_config(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_quantize_from_amax_refuses_mxfp8():
    with pytest.raises(ValueError, match=r"MXFP8 scales each block by its own amax"):
        reference.quantize_from_amax(jnp.ones((4, 32)), MXFP8Quantizer(), jnp.float32(1))
    with pytest.raises(ValueError, match=r"amax must have shape \(\) or \(1,\), got \(4,\)"):
        reference.quantize_from_amax(jnp.ones((4, 32)), CurrentScaleQuantizer(), jnp.ones(4))


def test_stacked_quantizer_outside_vmap():
    q = DelayedScaleQuantizer(scale=jnp.ones(3), amax_history=jnp.zeros((3, 4)))
    with pytest.raises(
        ValueError,
        match=r"scale must have shape \(\) or \(1,\), got \(3,\) "
        r"\(quantize with a stack of quantizers under jax.vmap\)",
    ):
        _trace((4, 32), jnp.float32, q)
    with pytest.raises(ValueError, match=r"amax_history must have shape \(L,\)"):
        q.update(jnp.float32(1))


def test_scale_shapes_errors():
    from te_jax.quantize import ScalingMode

    with pytest.raises(ValueError, match="NO_SCALING produces no quantized tensor"):
        shapes.scale_shapes((4, 32), ScalingMode.NO_SCALING, RC)
    with pytest.raises(ValueError, match=r"te_jax.scale_shapes: MXFP8_1D_SCALING rowwise"):
        shapes.scale_shapes((4, 31), ScalingMode.MXFP8_1D_SCALING, RC)
