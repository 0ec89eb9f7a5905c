"""The scaling-mode descriptions (``ScalingMode.X.impl``): one per mode, FFI values that agree
with ``ffi/common/scaling.h``, and shapes that agree with ``shapes.scale_shapes``."""

from __future__ import annotations

import numpy as np
import pytest

from helpers import SCALED_TENSOR_FIELDS, cpp_enum
from te_jax.quantize import QuantizeLayout, ScalingMode, formats, shapes
from te_jax.quantize.geometry import Geometry
from te_jax.quantize.scaling_modes import (
    CurrentTensorScaling,
    DelayedTensorScaling,
    Float8Block1DScaling,
    Float8Block2DScaling,
    MXFP8BlockScaling,
    NoScaling,
    NVFP4BlockScaling,
)

from .cases import E2M1, E4M3, E5M2

QUANTIZING = [m for m in ScalingMode if m is not ScalingMode.NO_SCALING]


def test_enums_match_the_cpp_attributes():
    assert cpp_enum("common/scaling.h", "ScalingMode") == {m.name: int(m) for m in ScalingMode}
    layouts = {lay.name: int(lay) for lay in QuantizeLayout}
    assert cpp_enum("common/scaling.h", "QuantizeLayout") == layouts
    for m in ScalingMode:
        assert m.impl.mode is m and m.impl.ffi_value == np.int64(m)


def test_one_description_per_mode():
    assert [type(m.impl) for m in ScalingMode] == [
        NoScaling,
        DelayedTensorScaling,
        MXFP8BlockScaling,
        CurrentTensorScaling,
        NVFP4BlockScaling,
        Float8Block1DScaling,
        Float8Block2DScaling,
    ]
    assert ScalingMode.NO_SCALING.impl.q_dtypes == () and not ScalingMode.NO_SCALING.impl.quantizes
    assert ScalingMode.NVFP4_1D_SCALING.impl.q_dtypes == (E2M1,)
    assert ScalingMode.MXFP8_1D_SCALING.impl.block_scale_dtype == formats.E8M0
    assert ScalingMode.NVFP4_1D_SCALING.impl.block_scale_dtype == E4M3
    assert formats.DEFAULT_Q_DTYPE == {m: m.impl.q_dtypes[0] for m in QUANTIZING}
    # Which per-tensor operand the kernel reads: delayed's scale, the two-pass modes' amax.
    assert [m.impl.batch_operand for m in QUANTIZING] == ["scale"] * 2 + ["amax"] * 2 + [
        "scale"
    ] * 2
    assert [m for m in ScalingMode if m.impl.uses_quantizer_scale] == [
        ScalingMode.DELAYED_TENSOR_SCALING
    ]
    assert [m for m in ScalingMode if m.impl.kernel_writes_amax] == [
        ScalingMode.DELAYED_TENSOR_SCALING
    ]


def test_result_names():
    RC = QuantizeLayout.ROWWISE_COLWISE
    assert ScalingMode.DELAYED_TENSOR_SCALING.impl.result_names(RC) == (
        "data",
        "colwise_data",
        "scale_inv",
        "amax",
    )
    assert ScalingMode.MXFP8_1D_SCALING.impl.result_names(QuantizeLayout.COLWISE) == (
        "colwise_data",
        "colwise_scale_inv",
    )
    assert ScalingMode.NVFP4_1D_SCALING.impl.result_names(RC) == SCALED_TENSOR_FIELDS


@pytest.mark.parametrize("mode", QUANTIZING, ids=lambda m: m.name)
@pytest.mark.parametrize("layout", list(QuantizeLayout), ids=lambda lay: lay.name)
@pytest.mark.parametrize(("shape", "nf"), [((4, 64, 96), 1), ((3, 32, 2, 64), 2)])
def test_batched_shapes_extend_the_public_ones(mode, layout, shape, nf):
    """A primitive result (batch axes, per-tensor slots of shape (1,)) is the ScaledTensor
    field's shape with the batch axes in front."""
    q_dtype = mode.impl.q_dtypes[-1]
    public = shapes.scale_shapes(shape, mode, layout, nf, q_dtype)
    batched = mode.impl.shapes(Geometry.of((5,) + shape, nf, 1), layout, q_dtype)
    per_tensor = mode.impl.per_tensor_names()
    for name, s in batched.items():
        want = public[name].shape + ((1,) if name in per_tensor else ())
        assert s.shape == (5,) + want, name
        assert s.dtype == public[name].dtype, name
    assert {n for n, s in public.items() if s is not None} == set(
        mode.impl.scaled_tensor_fields(layout)
    )


def test_ffi_results_follow_the_contract():
    """Six flattened buffers: output, colwise_output, scale_inv, colwise_scale_inv, amax,
    global_scale_inv (float32 per-tensor slots, empty where the mode has none)."""
    g = Geometry.of((2, 64, 32), 1, 1)  # B = 2, M = 64, N = 32
    RC = QuantizeLayout.ROWWISE_COLWISE
    shapes = lambda m: [(r.shape, np.dtype(r.dtype)) for r in m.impl.ffi_results(g, RC, E5M2)]
    f32, u8 = np.dtype(np.float32), np.dtype(np.uint8)
    assert shapes(ScalingMode.DELAYED_TENSOR_SCALING) == [
        ((128, 32), E5M2),
        ((2, 32, 64), E5M2),
        ((2,), f32),
        ((0,), u8),
        ((2,), f32),
        ((0,), f32),
    ]
    assert shapes(ScalingMode.MXFP8_1D_SCALING) == [
        ((128, 32), E5M2),
        ((128, 32), E5M2),
        ((128, 1), formats.E8M0),
        ((4, 32), formats.E8M0),
        ((0,), f32),
        ((0,), f32),
    ]
    nvfp4 = [(r.shape, np.dtype(r.dtype)) for r in NVFP4BlockScaling().ffi_results(g, RC, E2M1)]
    assert nvfp4[2:] == [((128, 2), E4M3), ((8, 32), E4M3), ((0,), f32), ((2,), f32)]
    # Blockwise FP8: the codes as delayed scaling's, each copy's float32 scales (cuBLASLt's
    # layout, per batch element) as (B * rows, cols).
    assert shapes(ScalingMode.FP8_BLOCK_1D_SCALING) == [
        ((128, 32), E5M2),
        ((2, 32, 64), E5M2),
        ((2, 64), f32),  # (ceil(32/128), round_up(64, 4)) per element
        ((2, 32), f32),  # (ceil(64/128), round_up(32, 4))
        ((0,), f32),
        ((0,), f32),
    ]
    assert shapes(ScalingMode.FP8_BLOCK_2D_SCALING)[2:4] == [((2, 4), f32), ((2, 4), f32)]


@pytest.mark.parametrize("mode", QUANTIZING, ids=lambda m: m.name)
@pytest.mark.parametrize(("shape", "nf"), [((3, 4, 64, 96), 1), ((5, 130, 2, 70), 2)])
def test_ffi_buffers_hold_the_results(mode, shape, nf):
    """Each quantized result the kernel writes is its FFI buffer reshaped
    (primitives/quantized/local.py): the same element count and dtype, for batched tensors of
    every layout (blockwise FP8 with odd rows and features too)."""
    if not mode.impl.partial_blocks and nf == 2:
        shape = (5, 128, 2, 64)
    g = Geometry.of(shape, nf, 1)
    for layout in QuantizeLayout:
        q_dtype = mode.impl.q_dtypes[0]
        results = mode.impl.shapes(g, layout, q_dtype)
        buffers = mode.impl.fields_of_ffi_results(mode.impl.ffi_results(g, layout, q_dtype))
        for name, want in results.items():
            if name == "amax" and not mode.impl.kernel_writes_amax:
                continue  # the two-pass modes' amax comes from their first pass
            got = buffers[name]
            assert np.prod(got.shape) == np.prod(want.shape), (layout, name, got, want)
            assert np.dtype(got.dtype) == np.dtype(want.dtype), (layout, name)
