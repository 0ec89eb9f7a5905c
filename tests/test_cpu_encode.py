"""The CPU loops' FP8 / FP4 encoders (ffi/activation/cpu/encode.h) against common/formats.h, bit
for bit, and the CPU kernels' exact fallbacks against the pure-JAX reference.

test_encoders_match_formats_h builds ffi/cpu/tests/encode_test.cc with the CPU extension's
optimisation flags and runs it: float32 bit patterns through the E4M3 / E5M2 / E2M1 encoders
(every sign, exponent and top 12 significand bits with the low bits at and next to each rounding
tie, so every code, tie and float32 subnormal, inf and NaN payloads, plus every 1021st pattern
and 2^22 pseudo-random ones: 25 M patterns), and the one-multiply scaled encodes (tensor, MXFP8,
NVFP4) on sampled inputs, with the FPU in IEEE mode and with FTZ + DAZ (as XLA's CPU threads run);
formats.h's div_by_e4m3 (the CUDA NVFP4 kernels' division by the block scale) against a / b over
every float32 significand; and the CUDA kernels' NVFP4 codes by comparison (16-bit inputs)
against the division, for every bfloat16 and float16 magnitude. All bit for bit. About 10 s on
2 cores plus the compile; skipped where no C++ compiler is found.
Set TE_JAX_ENCODE_TEST_FULL=1 to run the encoders on all 2^32 bit patterns instead (about 25 s
more on 2 idle cores).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import te_jax
from helpers import QUANT_MODES, SCALED_TENSOR_FIELDS
from te_jax.quantize import (
    CurrentScaleQuantizer,
    DelayedScaleQuantizer,
    MXFP8Quantizer,
    NVFP4Quantizer,
    QuantizeLayout,
)

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT / "ffi" / "cpu" / "tests" / "encode_test.cc"


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return name
    return None


def _xla_include() -> Path:
    import jaxlib

    return Path(jaxlib.__file__).parent / "include"


@pytest.mark.long
@pytest.mark.skipif(_compiler() is None, reason="no C++ compiler")
def test_encoders_match_formats_h(tmp_path):
    exe = tmp_path / "encode_test"
    # The extension's flags (CMakeLists.txt): the vectorised loops must be the ones it runs.
    flags = ["-std=c++17", "-O3", "-fno-trapping-math", "-pthread"]
    includes = [f"-I{ROOT / 'ffi'}", "-isystem", str(_xla_include())]
    build = [_compiler(), *flags, *includes, str(SOURCE), "-o", str(exe)]
    proc = subprocess.run(build, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"build failed:\n{' '.join(build)}\n{proc.stderr}"
    args = [str(exe)]
    if os.environ.get("TE_JAX_ENCODE_TEST_FULL") == "1":
        args.append("--full")
    proc = subprocess.run(args, capture_output=True, text=True, timeout=900)
    print(proc.stdout)
    assert proc.returncode == 0 and proc.stdout.rstrip().endswith("PASS"), proc.stdout + proc.stderr


# --- the kernels' exact fallbacks, end to end ---------------------------------------------------

E2M1 = jnp.float4_e2m1fn
CONFIGS = QUANT_MODES
FIELDS = SCALED_TENSOR_FIELDS


def _quantizer(mode, q_dtype, layout, scale):
    if mode == "delayed":
        q = DelayedScaleQuantizer(
            q_dtype=q_dtype,
            q_layout=layout,
            scale=jnp.asarray(scale, jnp.float32),
            amax_history=jnp.zeros((4,), jnp.float32),
        )
        return q
    cls = {"current": CurrentScaleQuantizer, "mxfp8": MXFP8Quantizer, "nvfp4": NVFP4Quantizer}
    return cls[mode](q_dtype, layout)


def _edge_inputs(rng):
    """float32 [64, 64] inputs, each with a delayed scale, that take the kernels' exact paths
    (tensor scales above 2^100, MXFP8 exponents below -100, NaN and inf blocks) next to the plain
    one-multiply ones, subnormal inputs included. The kernels run with FTZ + DAZ (XLA's CPU
    threads), so a one-multiply product of a subnormal would be 0 where it must not."""
    f32 = np.float32
    y = (rng.standard_normal((64, 64)) * 3).astype(f32)
    special = y.copy()
    special[0, 5], special[3, 40], special[40, 7] = np.nan, np.inf, -np.inf
    special[9, 9] = -np.nan  # a NaN product's code is the positive NaN's on every path
    mixed = y.astype(np.float64)
    mixed[:, :16] *= 2.0**-110  # tiny colwise MXFP8 blocks (columns 0-15)
    mixed[:, 32:] *= 2.0**-118  # tiny rowwise blocks (and subnormal values)
    # Subnormals near 2^-126 (what DAZ reads as 0) scaled to nonzero codes: tensor scales just
    # above 2^100, and MXFP8 blocks whose one normal value gives an exponent just below -100.
    bits = rng.integers(0x400000, 0x800000, (64, 64), dtype=np.uint32)
    sub = (bits | (rng.integers(0, 2, (64, 64), dtype=np.uint32) << 31)).view(f32)
    # One normal value per rowwise block (columns 0-31, 32-63) and colwise block (rows 0-31,
    # 32-63): 2^-100 (E5M2 exponent -115) or 2^-110.5 (E4M3 exponent -119).
    blocks = sub.copy()
    blocks[:, 0], blocks[:, 32] = 2.0**-100, 2.0**-110.5
    blocks[0, 0::2] = blocks[32, 0::2] = 2.0**-100
    blocks[0, 1::2] = blocks[32, 1::2] = 2.0**-110.5
    p100 = f32(2.0**100)
    return [
        (sub, 2.0**115, "subnormals, scale 2^115"),
        (sub, 2.0**118, "subnormals, scale 2^118"),
        (blocks, 1.0, "subnormal blocks"),
        ((y * 2.0**-120).astype(f32), 2.0**120, "tiny tensor"),
        ((y.astype(np.float64) * 2.0**-135).astype(f32), 3.0, "subnormal tensor"),
        ((y * 2.0**100).astype(f32), 2.0**-100, "huge tensor"),
        (y, p100, "scale 2^100"),
        (y, np.nextafter(p100, f32(np.inf)), "scale above 2^100"),
        (y, -0.0, "scale -0"),
        (special, 3.0, "NaN and inf"),
        (special, np.nan, "NaN scale"),
        (mixed.astype(f32), 1.0, "tiny blocks"),
    ]


def _raw_bits(a):
    a = np.asarray(a.astype(jnp.float32)) if a.dtype == E2M1 else np.asarray(a)
    return a.view(np.uint8 if a.dtype.itemsize == 1 else np.uint32)


ROWWISE_FIELDS = ("data", "scale_inv", "amax", "global_scale_inv")


@pytest.mark.parametrize(
    ("mode", "q_dtype"), CONFIGS, ids=[f"{m}-{jnp.dtype(d).name}" for m, d in CONFIGS]
)
def test_cpu_kernels_equal_the_reference_on_edge_values(mode, q_dtype, rng):
    """te_jax.quantize on the CPU kernels, ROWWISE and ROWWISE_COLWISE, against the pure-JAX
    reference, bit for bit (NaN bits included), on inputs that take the kernels' exact (not
    one-multiply) paths. One program per configuration: the reference runs once, in
    ROWWISE_COLWISE (its rowwise fields are the ROWWISE layout's: the colwise copy is computed
    beside them), and the ROWWISE kernel leaves the colwise fields None."""
    if not te_jax.ffi_available("cpu"):
        pytest.skip("no CPU extension")
    rc, rowwise = QuantizeLayout.ROWWISE_COLWISE, QuantizeLayout.ROWWISE

    @jax.jit
    def run(x, scale):
        def q(layout, impl):
            return te_jax.quantize.quantize(
                x, _quantizer(mode, q_dtype, layout, scale), implementation=impl
            )

        return q(rowwise, "ffi"), q(rc, "ffi"), q(rc, "xla")

    for x, scale, name in _edge_inputs(rng):
        with jax.default_device(jax.devices("cpu")[0]):
            got_row, got_rc, want = run(jnp.asarray(x), jnp.float32(scale))
        for layout, got in (("ROWWISE", got_row), ("ROWWISE_COLWISE", got_rc)):
            for f in FIELDS:
                g, w = getattr(got, f), getattr(want, f)
                if layout == "ROWWISE" and f not in ROWWISE_FIELDS:
                    w = None
                assert (g is None) == (w is None), (name, layout, f)
                if g is not None:
                    np.testing.assert_array_equal(
                        _raw_bits(g), _raw_bits(w), err_msg=f"{name} {layout} {f}"
                    )
