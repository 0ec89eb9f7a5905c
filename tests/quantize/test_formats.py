"""Formats: the Q table, the allowed dtypes per mode, and the saturating cast, which must round
exactly like ml_dtypes (XLA's float32 -> FP8/FP4 conversion is checked here, E2M1 included)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from te_jax.quantize import ScalingMode, formats

from .cases import E2M1, E4M3, E5M2

F32 = np.float32


def _probe_values(q_dtype, rng):
    """Every finite value of the format, every midpoint and its two float32 neighbours, values
    beyond max, subnormal float32s and random values, with both signs."""
    n = 16 if q_dtype == E2M1 else 256
    vals = np.arange(n, dtype=np.uint8).view(q_dtype).astype(F32)
    vals = np.unique(vals[np.isfinite(vals)])
    mids = ((vals[:-1].astype(np.float64) + vals[1:]) / 2).astype(F32)
    q = formats.q_max(q_dtype)
    beyond = np.array([q * 1.01, q * 1.5, q * 2, 1e30, np.finfo(F32).max, np.inf], F32)
    sub = np.array([1e-45, 1e-40, 1e-39, 1.1e-38], F32)
    rand = (rng.standard_normal(20000) * 2.0 ** rng.integers(-20, 17, 20000)).astype(F32)
    x = np.concatenate(
        [
            vals,
            mids,
            np.nextafter(mids, F32(np.inf)),
            np.nextafter(mids, F32(-np.inf)),
            beyond,
            sub,
            rand,
        ]
    )
    return np.concatenate([x, -x])


@pytest.mark.parametrize("q_dtype", [E4M3, E5M2, E2M1], ids=str)
def test_saturating_cast_matches_ml_dtypes(q_dtype, rng):
    x = _probe_values(q_dtype, rng)
    got = np.asarray(jax.jit(lambda v: formats.saturating_cast(v, q_dtype))(x))
    q = formats.q_max(q_dtype)
    want = np.clip(x, -q, q).astype(q_dtype)
    np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))
    # Saturation: never inf or NaN from a finite or infinite input.
    assert np.isfinite(got.astype(F32)).all()
    assert got.astype(F32).max() == q and got.astype(F32).min() == -q


def _all_codes(dtype):
    """Every bit pattern of ``dtype`` as an array of that dtype (E2M1: one code per uint8)."""
    dt = np.dtype(dtype)
    if dt == E2M1:
        return np.arange(16, dtype=np.uint8).view(E2M1)  # ml_dtypes keeps one code per byte
    unsigned = {1: np.uint8, 2: np.uint16}[dt.itemsize]
    return np.arange(1 << (8 * dt.itemsize), dtype=np.int64).astype(unsigned).view(dt)


def _same_float32(got, want):
    got, want = np.asarray(got, F32), np.asarray(want, F32)
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(got), nan)
    np.testing.assert_array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, E4M3, E5M2, E2M1], ids=str)
def test_to_float32_decodes_every_code(dtype):
    codes = _all_codes(dtype)
    _same_float32(jax.jit(formats.to_float32)(jnp.asarray(codes)), codes.astype(F32))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, E4M3, E5M2, E2M1], ids=str)
def test_rounding_survives_a_round_trip_in_one_program(dtype, rng):
    """narrow-then-widen inside one jit keeps the rounding (XLA:GPU drops the pair
    convert(convert(x)) by default; to_float32 is not a convert)."""
    x = (rng.standard_normal(4096) * 1.37).astype(F32)
    q = formats.Q_MAX.get(np.dtype(dtype))
    narrow = (lambda v: formats.saturating_cast(v, dtype)) if q else (lambda v: v.astype(dtype))
    got = jax.jit(lambda v: formats.to_float32(narrow(v)))(x)
    want = (np.clip(x, -q, q) if q else x).astype(dtype).astype(F32)
    _same_float32(got, want)


@pytest.mark.parametrize("q_dtype", [E4M3, E5M2], ids=str)
def test_nan_stays_nan(q_dtype):
    got = jax.jit(lambda v: formats.saturating_cast(v, q_dtype))(jnp.asarray([np.nan, 1.0]))
    assert np.isnan(np.asarray(got, F32)[0])


def test_plain_conversion_does_not_saturate():
    """Why saturating_cast clips: the bare conversion overflows E4M3 to NaN, E5M2 to inf."""
    x = jnp.asarray([500.0, 60000.0 * 2], jnp.float32)
    assert np.isnan(float(x[0].astype(jnp.float8_e4m3fn)))
    assert np.isinf(float(x[1].astype(jnp.float8_e5m2)))


def test_tables():
    assert formats.Q_MAX == {E4M3: 448.0, E5M2: 57344.0, E2M1: 6.0}
    for dt, q in formats.Q_MAX.items():
        assert float(ml_dtypes.finfo(dt).max) == q
    assert formats.ALLOWED_Q_DTYPES[ScalingMode.NVFP4_1D_SCALING] == (E2M1,)
    assert ScalingMode.NVFP4_1D_SCALING.impl.q_dtypes == (E2M1,)
    for mode in (
        ScalingMode.DELAYED_TENSOR_SCALING,
        ScalingMode.CURRENT_TENSOR_SCALING,
        ScalingMode.MXFP8_1D_SCALING,
    ):
        assert formats.ALLOWED_Q_DTYPES[mode] == (E4M3, E5M2)
        assert mode.impl.q_dtypes == (E4M3, E5M2)
    assert formats.E8M0 == np.dtype(ml_dtypes.float8_e8m0fnu)


def test_normalize_q_dtype():
    mode = ScalingMode.MXFP8_1D_SCALING
    assert formats.normalize_q_dtype(jnp.float8_e5m2, mode) == E5M2
    assert formats.normalize_q_dtype("float8_e4m3fn", mode) == E4M3
    with pytest.raises(ValueError, match=r"'e4m3' is not supported by MXFP8_1D_SCALING; allowed:"):
        formats.normalize_q_dtype("e4m3", mode)
    with pytest.raises(ValueError, match=r"bfloat16 is not a quantized data format; known:"):
        formats.q_max(jnp.bfloat16)


def test_modes_and_layouts():
    from te_jax.quantize import QuantizeLayout as L
    from te_jax.quantize import ScalingMode as M

    assert [int(m) for m in M] == [0, 1, 2, 3, 4, 5, 6]
    assert [int(lay) for lay in L] == [0, 1, 2]
    assert [m for m in M if m.is_tensor_scaling] == [
        M.DELAYED_TENSOR_SCALING,
        M.CURRENT_TENSOR_SCALING,
    ]
    assert [m for m in M if m.is_block_scaling] == [
        M.MXFP8_1D_SCALING,
        M.NVFP4_1D_SCALING,
        M.FP8_BLOCK_1D_SCALING,
        M.FP8_BLOCK_2D_SCALING,
    ]
    assert [m for m in M if m.is_two_pass] == [M.CURRENT_TENSOR_SCALING, M.NVFP4_1D_SCALING]
    assert [m.block_size for m in M] == [None, None, 32, None, 16, 128, 128]
    assert [m for m in M if m.impl.partial_blocks] == [
        M.FP8_BLOCK_1D_SCALING,
        M.FP8_BLOCK_2D_SCALING,
    ]
    assert [(lay.has_rowwise, lay.has_colwise) for lay in L] == [
        (True, False),
        (False, True),
        (True, True),
    ]
