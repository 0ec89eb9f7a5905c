#!/usr/bin/env python3
"""Exhaustive host check of ffi/common/formats.h (float32 <-> E4M3 / E5M2 / E2M1, E8M0 scales).

    python3 tools/check_formats.py [--chunks N]   # N of the 256 chunks of 2^24 (default: all)

Compiles a small C++ shim around the header with g++ -O3 -fno-trapping-math, once for the
baseline x86-64 and once each for -march=x86-64-v3 / -v4 where this CPU runs them, checks from
GCC's -fopt-info that every batch loop vectorised, and runs each build twice: plain, and with
flush-to-zero + denormals-are-zero set in MXCSR (as XLA's CPU threads run), set only around the
shim's loops, so NumPy's reference is unaffected. Against NumPy + ml_dtypes it checks

  to_e4m3/e5m2/e2m1  every float32 bit pattern: the bits of clip(v, -max, max).astype(fmt) for
                     every non-NaN v; NaN gives the header's documented code (E4M3 0x7f|sign,
                     E5M2 0x7e|sign, E2M1 0x8); agreement with ml_dtypes on NaN is reported
  from_*             every code: ml_dtypes' decode, bit for bit (NaN codes give 0x7fc00000|sign)
  e8m0_exponent      every non-negative float (incl. inf, NaN), q_max = 448 and 57344: the
                     smallest e with amax <= q * 2^e (exact float64 comparisons), clamped to
                     [-127, 127]; 0 -> -127, inf -> 127, NaN -> 128; e8m0_biased = e + 127
  mul_pow2           ~300k y (every exponent, subnormals, random bits) x every k in [-252, 252]:
                     the float32 rounding of the exact y * 2^k (float64) wherever |y * 2^k| >=
                     2^-126, inf or NaN; below that only |result| <= 2^-126 is required (FTZ
                     flushes on the unrounded value; mismatches there are counted and shown).

Exits non-zero on any mismatch. Uses both CPU cores (multiprocessing over chunks).
"""

import argparse
import ctypes
import multiprocessing as mp
import os
import re
import subprocess
import sys
import tempfile
import time

import ml_dtypes
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHUNK = 1 << 24

SHIM = r"""
#include <cstdint>
#include <xmmintrin.h>

#include "common/formats.h"

namespace f = te_jax::fmt;

namespace {
// MXCSR bit 15 = flush-to-zero, bit 6 = denormals-are-zero; restored on return.
struct FpEnv {
  unsigned saved;
  explicit FpEnv(int ftz) : saved(_mm_getcsr()) { if (ftz) _mm_setcsr(saved | 0x8040u); }
  ~FpEnv() { _mm_setcsr(saved); }
};
}  // namespace

@CODECS@

__attribute__((noinline)) static void e8m0_loop(const float* __restrict a, float q,
                                                int32_t* __restrict e, uint8_t* __restrict b,
                                                long n) {
  for (long i = 0; i < n; ++i) {  // LOOPS e8m0
    e[i] = f::e8m0_exponent(a[i], q);
    b[i] = f::e8m0_biased(a[i], q);
  }
}
extern "C" void e8m0(const float* a, float q, int32_t* e, uint8_t* b, long n, int ftz) {
  FpEnv env(ftz);
  e8m0_loop(a, q, e, b, n);
}

__attribute__((noinline)) static void mul_pow2_loop(const float* __restrict y, int k,
                                                    float* __restrict o, long n) {
  for (long i = 0; i < n; ++i) o[i] = f::mul_pow2(y[i], k);  // LOOPS mul_pow2
}
extern "C" void mul_pow2(const float* y, int k, float* o, long n, int ftz) {
  FpEnv env(ftz);
  mul_pow2_loop(y, k, o, n);
}
"""

CODEC = r"""
__attribute__((noinline)) static void enc_@_loop(const float* __restrict x, uint8_t* __restrict o,
                                                long n) {
  for (long i = 0; i < n; ++i) o[i] = f::to_@(x[i]);  // LOOPS enc_@
}
extern "C" void enc_@(const float* x, uint8_t* o, long n, int ftz) {
  FpEnv env(ftz);
  enc_@_loop(x, o, n);
}
__attribute__((noinline)) static void dec_@_loop(const uint8_t* __restrict c, float* __restrict o,
                                                long n) {
  for (long i = 0; i < n; ++i) o[i] = f::from_@(c[i]);  // LOOPS dec_@
}
extern "C" void dec_@(const uint8_t* c, float* o, long n, int ftz) {
  FpEnv env(ftz);
  dec_@_loop(c, o, n);
}
"""

FORMATS = {  # name: (ml_dtypes type, max, NaN code for +NaN, sign bit, NaN keeps sign)
    "e4m3": (ml_dtypes.float8_e4m3fn, 448.0, 0x7F, 0x80, True),
    "e5m2": (ml_dtypes.float8_e5m2, 57344.0, 0x7E, 0x80, True),
    "e2m1": (ml_dtypes.float4_e2m1fn, 6.0, 0x8, 0x8, False),
}
Q_MAX = (448.0, 57344.0)  # e8m0_reference relies on 57344 = 448 * 2^7


def cpu_flags():
    with open("/proc/cpuinfo") as fh:
        for line in fh:
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    return set()


def build(tmp):
    """Compile the shim for each ISA level this CPU runs; returns [(name, path)]."""
    src = os.path.join(tmp, "shim.cc")
    shim = SHIM.replace("@CODECS@", "".join(CODEC.replace("@", f) for f in FORMATS))
    with open(src, "w") as fh:
        fh.write(shim)
    lines = shim.splitlines()
    loops = {name: i + 1 for i, ln in enumerate(lines) if "// LOOPS" in ln
             for name in ln.split("// LOOPS")[1].split()}
    flags = cpu_flags()
    levels = [("x86-64", [])]
    if {"avx2", "fma", "bmi2"} <= flags:
        levels.append(("x86-64-v3", ["-march=x86-64-v3"]))
    if {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"} <= flags:
        levels.append(("x86-64-v4", ["-march=x86-64-v4"]))
    out, failed = [], []
    for name, extra in levels:
        so = os.path.join(tmp, f"shim_{name}.so")
        info = os.path.join(tmp, f"vec_{name}.txt")
        cmd = ["g++", "-std=c++17", "-O3", "-fno-trapping-math", "-fPIC", "-shared", *extra,
               f"-I{ROOT}/ffi", f"-fopt-info-vec-optimized={info}", src, "-o", so]
        subprocess.run(cmd, check=True)
        with open(info) as fh:
            vec_lines = {int(m.group(1)) for m in re.finditer(r"shim\.cc:(\d+):\d+: optimized: "
                                                               r"loop vectorized", fh.read())}
        missed = [n for n, ln in loops.items() if ln not in vec_lines]
        print(f"built {name}: loops vectorised: "
              f"{'all ' + str(len(loops)) if not missed else 'NOT ' + ', '.join(missed)}")
        failed += [f"{name}: {n} not vectorised" for n in missed]
        out.append((name, so))
    return out, failed


def load(path):
    lib = ctypes.CDLL(path)
    p = ctypes.c_void_p
    for fmt in FORMATS:
        getattr(lib, f"enc_{fmt}").argtypes = [p, p, ctypes.c_long, ctypes.c_int]
        getattr(lib, f"dec_{fmt}").argtypes = [p, p, ctypes.c_long, ctypes.c_int]
    lib.e8m0.argtypes = [p, ctypes.c_float, p, p, ctypes.c_long, ctypes.c_int]
    lib.mul_pow2.argtypes = [p, ctypes.c_int, p, ctypes.c_long, ctypes.c_int]
    return lib


def ptr(a):
    return a.ctypes.data_as(ctypes.c_void_p)


def pow2_f64(e):
    """2^e as float64 for integer arrays e in [-1022, 1023], from the bits (exact, fast)."""
    return ((e.astype(np.int64) + 1023) << 52).view(np.float64)


def e8m0_reference(a):
    """{q: ceil(log2(a / q)) clamped to [-127, 127]} (0 -> -127, inf -> 127, NaN -> 128).

    Candidate for q = 448 = 0.875 * 2^9 from frexp (a = m * 2^ea exactly, m in [1/2, 1)):
    ea - 9, plus 1 if m > 0.875. Then *proved* for every element by the defining inequalities
    448 * 2^(e-1) < a <= 448 * 2^e, exact in float64. 57344 = 448 * 2^7 shifts e by 7 (before
    clamping).
    """
    finite_pos = np.isfinite(a) & (a > 0)
    m, ea = np.frexp(a)
    e = ea - 9 + (m > 0.875)
    x = np.where(finite_pos, a, 448.0).astype(np.float64)  # e = 0 for 448: passes the proof
    e = np.where(finite_pos, e, 0)
    upper = 448.0 * pow2_f64(e)
    assert np.all(x <= upper) and np.all(x > 0.5 * upper), "e8m0 reference is wrong"
    special = np.select([a == 0, np.isinf(a), np.isnan(a)], [-127, 127, 128], 0)
    out = {}
    for q in Q_MAX:
        eq = np.clip(e - int(np.log2(q / 448.0)), -127, 127)
        out[q] = np.where(finite_pos, eq, special).astype(np.int32)
    return out


def differ(got, want):
    """Indices where got != want (the cheap 8-byte comparison first)."""
    if np.array_equal(got.view(np.uint64), want.view(np.uint64)):
        return np.empty(0, np.int64)
    return np.flatnonzero(got != want)


def check_chunk(args):
    """Checks chunk c (bit patterns c*2^24 ...) in every build; returns (messages, stats)."""
    c, libs = args
    libs = [(name, load(path)) for name, path in libs]
    bits = np.uint32(c * CHUNK) + np.arange(CHUNK, dtype=np.uint32)
    v = bits.view(np.float32)
    nan = np.isnan(v)
    has_nan = bool(nan.any())
    neg = (bits >> 31).astype(np.uint8)
    msgs, stats = [], {"nan": int(np.count_nonzero(nan)), "nan_agree_ml_dtypes": {}}
    got = np.empty(CHUNK, np.uint8)
    for fmt, (dt, vmax, nan_code, sign_bit, nan_signed) in FORMATS.items():
        with np.errstate(invalid="ignore"):
            ref = np.clip(v, -vmax, vmax).astype(dt).view(np.uint8)
        want = ref
        if has_nan:
            ref_nan = np.where(neg.astype(bool) & nan_signed, nan_code | sign_bit, nan_code)
            want = np.where(nan, ref_nan, ref).astype(np.uint8)
        stats["nan_agree_ml_dtypes"][fmt] = int(np.count_nonzero(ref[nan] == want[nan]))
        for name, lib in libs:
            for ftz in (0, 1):
                getattr(lib, f"enc_{fmt}")(ptr(v), ptr(got), CHUNK, ftz)
                bad = differ(got, want)
                if bad.size:
                    i = bad[0]
                    msgs.append(f"to_{fmt} [{name} ftz={ftz}]: {bad.size} mismatches, e.g. "
                                f"0x{bits[i]:08x} ({v[i]!r}) -> 0x{got[i]:02x}, want "
                                f"0x{want[i]:02x}")
    if c < 128:  # non-negative floats: amax
        e = np.empty(CHUNK, np.int32)
        biased = np.empty(CHUNK, np.uint8)
        ref = e8m0_reference(v)
        for q in Q_MAX:
            want = ref[q]
            want_biased = (want + 127).astype(np.uint8)
            for name, lib in libs:
                for ftz in (0, 1):
                    lib.e8m0(ptr(v), q, ptr(e), ptr(biased), CHUNK, ftz)
                    bad = np.union1d(differ(e, want), differ(biased, want_biased))
                    if bad.size:
                        i = bad[0]
                        msgs.append(f"e8m0 q={q} [{name} ftz={ftz}]: {bad.size} mismatches, "
                                    f"e.g. amax 0x{bits[i]:08x} ({v[i]!r}) -> {e[i]} / "
                                    f"0x{biased[i]:02x}, want {want[i]}")
    return msgs, stats


def check_decode(libs):
    msgs = []
    codes = np.arange(256, dtype=np.uint8)
    out = np.empty(256, np.float32)
    for fmt, (dt, *_rest) in FORMATS.items():
        src = codes & 0xF if fmt == "e2m1" else codes  # E2M1: the high nibble is ignored
        want = src.view(dt).astype(np.float32).view(np.uint32)
        for name, path in libs:
            lib = load(path)
            for ftz in (0, 1):
                getattr(lib, f"dec_{fmt}")(ptr(codes), ptr(out), 256, ftz)
                bad = np.flatnonzero(out.view(np.uint32) != want)
                if bad.size:
                    i = bad[0]
                    msgs.append(f"from_{fmt} [{name} ftz={ftz}]: {bad.size} mismatches, e.g. "
                                f"0x{i:02x} -> 0x{out.view(np.uint32)[i]:08x}, want "
                                f"0x{want[i]:08x}")
    return msgs


def mul_pow2_inputs():
    rng = np.random.default_rng(0)
    exps = np.arange(256, dtype=np.uint32) << 23
    mants = np.concatenate([np.array([0, 1, 2, 0x400000, 0x7FFFFE, 0x7FFFFF], np.uint32),
                            rng.integers(0, 1 << 23, 250, dtype=np.uint32)])
    grid = (exps[:, None] | mants[None, :]).ravel()       # every exponent, incl. subnormals
    sub = np.arange(0, 1 << 23, 97, dtype=np.uint32)      # dense subnormals
    rand = rng.integers(0, 1 << 32, 100_000, dtype=np.uint64).astype(np.uint32)
    pos = np.concatenate([grid, sub, rand & 0x7FFFFFFF])
    return np.concatenate([pos, pos | 0x80000000]).view(np.float32)


def check_mul_pow2(libs):
    y = mul_pow2_inputs()
    out = np.empty_like(y)
    with np.errstate(invalid="ignore"):  # signalling NaNs
        y64 = y.astype(np.float64)
    msgs, small_mismatch = [], {}
    for k in range(-252, 253):
        with np.errstate(over="ignore", invalid="ignore"):
            exact = np.ldexp(y64, k)  # exact in float64
            ref = exact.astype(np.float32)  # rounded once
        small = np.abs(exact) < 2.0**-126
        for name, path in libs:
            lib = load(path)
            for ftz in (0, 1):
                lib.mul_pow2(ptr(y), k, ptr(out), y.size, ftz)
                same = (out.view(np.uint32) == ref.view(np.uint32)) | (np.isnan(out)
                                                                       & np.isnan(ref))
                bad = np.flatnonzero(~same & ~small)
                bad_small = np.flatnonzero(~same & small & ~(np.abs(out) <= 2.0**-126))
                for b in (bad, bad_small):
                    if b.size:
                        i = b[0]
                        msgs.append(f"mul_pow2 k={k} [{name} ftz={ftz}]: {b.size} mismatches, "
                                    f"e.g. y={y[i]!r} -> {out[i]!r}, want {ref[i]!r}")
                key = f"{name} ftz={ftz}"
                small_mismatch[key] = small_mismatch.get(key, 0) + int(
                    np.count_nonzero(~same & small))
    return msgs, y.size * 505, small_mismatch


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--chunks", type=int, default=256, help="chunks of 2^24 floats (max 256)")
    args = ap.parse_args()
    t0 = time.time()
    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        libs, vec_failures = build(tmp)
        failures += vec_failures
        print(f"build: {time.time() - t0:.1f} s")

        t = time.time()
        failures += check_decode(libs)
        msgs, n_mul, small = check_mul_pow2(libs)
        failures += msgs
        print(f"decode (256 codes x 3 formats) and mul_pow2 ({n_mul} (y, k) pairs per build and "
              f"FP mode): {time.time() - t:.1f} s")
        print("  mul_pow2 results below 2^-126 that differ from the correct rounding "
              "(allowed): " + ", ".join(f"{k}: {v}" for k, v in small.items()))

        t = time.time()
        chunks = list(range(0, 256, max(1, 256 // args.chunks)))[: args.chunks]
        nan_agree = {f: 0 for f in FORMATS}
        n_nan = 0
        with mp.Pool(min(2, os.cpu_count() or 1)) as pool:
            for i, (msgs, stats) in enumerate(pool.imap_unordered(
                    check_chunk, [(c, libs) for c in chunks])):
                failures += msgs
                n_nan += stats["nan"]
                for f, n in stats["nan_agree_ml_dtypes"].items():
                    nan_agree[f] += n
                if (i + 1) % 32 == 0:
                    print(f"  {i + 1}/{len(chunks)} chunks, {time.time() - t:.0f} s", flush=True)
        n_e8m0 = sum(1 for c in chunks if c < 128) * CHUNK
        print(f"encode: {len(chunks) * CHUNK} float32 bit patterns x 3 formats, e8m0: {n_e8m0} "
              f"amax x {len(Q_MAX)} q_max; each in {len(libs)} builds x 2 FP modes: "
              f"{time.time() - t:.1f} s")
        print(f"  NaN inputs: {n_nan}; header's NaN code equal to ml_dtypes' for: "
              + ", ".join(f"{f} {n}" for f, n in nan_agree.items()))

    print(f"total {time.time() - t0:.1f} s")
    if failures:
        print(f"FAILED ({len(failures)}):")
        for m in failures[:60]:
            print("  " + m)
        return 1
    print("OK: all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
