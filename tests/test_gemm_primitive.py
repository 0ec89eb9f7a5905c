"""te_jax.primitives.bind_gemm against a float64 NumPy reference, on whichever path the backend
takes (the te_jax_gemm kernel on CUDA, the pure-JAX lowering elsewhere), plus vmap, jit, the
trace-time checks, the dispatch rule and the kernel path's FFI buffers (a contract emulator).

Tolerance of an output element (the te_jax_gemm contract: float32 accumulation, one rounding):
|out - ref| <= (K+2)·2^-23·Σ|a||b| (the accumulation, scales and bias in float32) + 1 ulp of
out_dtype; an epilogue adds its float32 evaluation (gelu: 2^-20·|h|, Lipschitz 1.13) and 1 ulp.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import dense_oracle as do
import float64_oracle as f64
from helpers import assert_within, cpp_enum, enable_x64, np_dtype, te_jax_custom_calls
from te_jax import _ffi
from te_jax.primitives import GEMM_WORKSPACE_BYTES, GemmEpilogue, GemmResult, bind_gemm
from te_jax.primitives import gemm as gemm_mod
from te_jax.primitives.gemm import GemmConfig
from te_jax.primitives.gemm.kernel import FP8_ALIGNMENT, kernel_results

E = GemmEpilogue
F32, BF16, F16 = np.dtype(np.float32), np.dtype(jnp.bfloat16), np.dtype(jnp.float16)
E4M3, E5M2 = np.dtype(jnp.float8_e4m3fn), np.dtype(jnp.float8_e5m2)
DTYPES = [F32, BF16, F16]
DTYPE_IDS = ["f32", "bf16", "f16"]
IMPLS = [None, "xla"]
TRANS = [(False, False), (True, False), (False, True), (True, True)]
TRANS_IDS = ["NN", "TN", "NT", "TT"]

# Whether bind_gemm(..., implementation=impl) runs the kernel on this backend.
KERNEL = _ffi.target_available(gemm_mod.TARGET, jax.default_backend())


def runs_kernel(impl) -> bool:
    return KERNEL and impl != "xla" and os.environ.get("TE_JAX_IMPLEMENTATION", "") != "xla"


# ---- inputs and the float64 reference -----------------------------------------------------------


def stored(a, trans: bool):
    """The stored form of a row-major math operand (transposed when ``trans``)."""
    return np.ascontiguousarray(np.swapaxes(a, -1, -2)) if trans else a


def math_form(a, trans: bool) -> np.ndarray:
    """The float64 math operand of a stored (jax or numpy) array."""
    a = np.asarray(a).astype(np.float64)
    return np.swapaxes(a, -1, -2) if trans else a


def random_operands(
    rng, m, k, n, dtype, *, batch=(), lhs_trans=False, rhs_trans=False, rhs_dtype=None
):
    """lhs, rhs (jax arrays, stored form) from random normal values rounded to the dtypes."""
    lhs = rng.normal(size=batch + (m, k)).astype(np_dtype(dtype))
    rhs = rng.normal(size=batch + (k, n)).astype(np_dtype(rhs_dtype or dtype))
    return jnp.asarray(stored(lhs, lhs_trans)), jnp.asarray(stored(rhs, rhs_trans))


def random_like(rng, shape, dtype, scale=1.0):
    return jnp.asarray((scale * rng.normal(size=shape)).astype(np_dtype(dtype)))


def _scalar(scale_inv) -> float:
    return 1.0 if scale_inv is None else float(np.asarray(scale_inv, np.float32).reshape(()))


def expect(
    lhs,
    rhs,
    bias=None,
    aux=None,
    lhs_scale_inv=None,
    rhs_scale_inv=None,
    addend=None,
    *,
    lhs_trans=False,
    rhs_trans=False,
    epilogue=E.DEFAULT,
    out_dtype=None,
    grad_bias=False,
    kernel=False,
    **_,
):
    """{name: (float64 reference, allowed error)} for out, aux, dbias (what was asked for).

    ``kernel``: the bound of cuBLASLt's kernel path, which (measured on an H100) rounds the
    float32 accumulator to a 16-bit output's dtype before adding the bias (half an ulp of acc
    more), and evaluates gelu / gelu' within 2^-18·|h| / 2^-16 (absolute, on gelu') of exact:
    bounded here with a factor of 2 to spare."""
    L, R = math_form(lhs, lhs_trans), math_form(rhs, rhs_trans)
    out_dt = np.dtype(out_dtype or np.asarray(lhs).dtype)
    s = _scalar(lhs_scale_inv) * _scalar(rhs_scale_inv)
    k = L.shape[-1]
    acc = np.matmul(L, R) * s
    mag = np.matmul(np.abs(L), np.abs(R)) * abs(s)
    b = 0.0 if bias is None else np.asarray(bias).astype(np.float64)
    c = 0.0 if addend is None else np.asarray(addend).astype(np.float64)
    h = acc + c + b
    acc_err = (k + 2) * 2.0**-23 * (mag + np.abs(b) + np.abs(c))
    epilogue = E(epilogue)
    fi = ml_dtypes.finfo(out_dt)
    eps, tiny = float(fi.eps), float(fi.smallest_subnormal)
    if kernel and (bias is not None or addend is not None) and out_dt.itemsize == 2:
        acc_err = acc_err + 0.5 * eps * np.abs(acc)
    if kernel and np.dtype(np.asarray(lhs).dtype).itemsize == 1:
        # Hopper's FP8 tensor cores accumulate each block of K in reduced precision before the
        # float32 promotion (tests/dense_oracle.py, docs/numerics.md §8).
        acc_err = acc_err + do.FP8_MMA_ACC * mag
    gelu_err, dgelu_err = (2.0**-17, 2.0**-15) if kernel else (2.0**-20, 2.0**-20)
    if epilogue == E.DGELU:
        y = acc * f64.gelu(np.asarray(aux).astype(np.float64))[1]
        err = 1.13 * acc_err + dgelu_err * np.abs(acc)
    elif epilogue in (E.GELU, E.GELU_AUX):
        y = f64.gelu(h)[0]
        err = 1.13 * acc_err + gelu_err * np.abs(h)
    elif epilogue == E.RELU:
        y, err = f64.relu(h)[0], acc_err
    else:
        y, err = h, acc_err
    ulps = 1 if epilogue == E.DEFAULT else 2
    want = {"out": (y, err + ulps * (eps * np.abs(y) + tiny))}
    if epilogue == E.GELU_AUX:
        want["aux"] = (h, acc_err + eps * np.abs(h) + tiny)
    if grad_bias:
        axes = tuple(range(y.ndim - 1))
        rows = int(np.prod(y.shape[:-1]))
        dbias = y.sum(axis=axes)
        bound = err.sum(axis=axes) + rows * 2.0**-23 * np.abs(y).sum(axis=axes)
        if kernel:  # cuBLASLt's BGRAD sums the outputs rounded to out_dtype
            bound = bound + eps * np.abs(y).sum(axis=axes)
        want["dbias"] = (dbias, bound + eps * np.abs(dbias) + tiny)
    return want


def check(result: GemmResult, args: dict, what="", kernel=KERNEL):
    """Every returned field against ``expect``; ``kernel``: whether the result may come from the
    kernel (its bound, ``expect``)."""
    out_dt = np.dtype(args.get("out_dtype") or np.asarray(args["lhs"]).dtype)
    want = expect(**args, kernel=kernel)
    for name in ("out", "aux", "dbias"):
        got = getattr(result, name)
        if name not in want:
            assert got is None, f"{what}{name}: not asked for, got {got}"
            continue
        ref, bound = want[name]
        got = np.asarray(got)
        assert got.dtype == out_dt, f"{what}{name}: dtype {got.dtype}, want {out_dt}"
        assert got.shape == ref.shape, f"{what}{name}: shape {got.shape}, want {ref.shape}"
        assert_within(got.astype(np.float64), ref, bound, f"{what}{name}")


def call(args: dict, impl, *, use_jit=True) -> GemmResult:
    """bind_gemm on ``args`` (arrays traced, options static), jitted unless told."""
    arrays = {k: v for k, v in args.items() if k in _ARRAY_ARGS and v is not None}
    static = {k: v for k, v in args.items() if k not in _ARRAY_ARGS}
    fn = lambda a: bind_gemm(**a, **static, implementation=impl)  # noqa: E731
    return (jax.jit(fn) if use_jit else fn)(arrays)


_ARRAY_ARGS = ("lhs", "rhs", "bias", "aux", "lhs_scale_inv", "rhs_scale_inv", "addend")


def check_impls(*cases: dict, what=""):
    """bind_gemm on each case's ``args`` with every implementation (IMPLS), all in one jitted
    program, each result checked against ``expect`` (the kernel's bound where it runs)."""
    arrays = [{k: v for k, v in a.items() if k in _ARRAY_ARGS and v is not None} for a in cases]
    static = [{k: v for k, v in a.items() if k not in _ARRAY_ARGS} for a in cases]

    @jax.jit
    def run(arrays):
        return [
            [bind_gemm(**a, **st, implementation=i) for i in IMPLS]
            for a, st in zip(arrays, static, strict=True)
        ]

    for c, (args, results) in enumerate(zip(cases, run(arrays), strict=True)):
        for impl, result in zip(IMPLS, results, strict=True):
            check(result, args, f"{what}case {c} impl={impl} ", kernel=runs_kernel(impl))


def fp8(rng, shape, dtype, scale=2.0):
    """Random FP8 data (ml_dtypes' round-to-nearest of normal values) as a jax array."""
    return jnp.asarray((scale * rng.normal(size=shape)).astype(np_dtype(dtype)))


# ---- numerics -----------------------------------------------------------------------------------


def _layout_cases():
    """Every (dtype, layout), the bias on in every other one: each dtype and each layout meets
    both with and without a bias. Both implementations in each case."""
    for d, (dtype, did) in enumerate(zip(DTYPES, DTYPE_IDS, strict=True)):
        for t, (trans, tid) in enumerate(zip(TRANS, TRANS_IDS, strict=True)):
            bias = (d + t) % 2 == 0
            yield pytest.param(dtype, trans, bias, id=f"{did}-{tid}-{'bias' if bias else 'nobias'}")


@pytest.mark.parametrize("dtype, trans, with_bias", list(_layout_cases()))
def test_layouts_and_bias(dtype, trans, with_bias, rng):
    m, k, n = 7, 33, 5
    lhs, rhs = random_operands(rng, m, k, n, dtype, lhs_trans=trans[0], rhs_trans=trans[1])
    args = dict(lhs=lhs, rhs=rhs, lhs_trans=trans[0], rhs_trans=trans[1])
    if with_bias:
        args["bias"] = random_like(rng, (n,), dtype)
    check_impls(args)


# name: (operand dtype, out dtype, (lhs_trans, rhs_trans), lhs batch, rhs batched, bias, K, N)
ADDEND_CASES = {
    "f32_NN_bias": (F32, F32, (False, False), (), False, True, 33, 5),
    "bf16_TN": (BF16, BF16, (True, False), (), False, False, 33, 5),
    "f16_NT_bias": (F16, F16, (False, True), (), False, True, 33, 5),
    "bf16_rank3_bias": (BF16, BF16, (False, True), (2,), True, True, 33, 5),
    "bf16_shared_weight": (BF16, BF16, (False, False), (2,), False, True, 33, 5),
    "fp8_bf16_bias": (E4M3, BF16, (False, True), (), False, True, 32, 16),
    "fp8_f32_bias": (E4M3, F32, (False, True), (), False, True, 32, 16),  # the float32 fallback
    "fp8_misaligned": (E4M3, BF16, (False, True), (), False, False, 24, 8),  # likewise
}


def _addend_args(rng, name):
    dtype, out_dt, (lt, rt), batch, rhs_batched, with_bias, k, n = ADDEND_CASES[name]
    m = 7
    if dtype == E4M3:
        lhs, rhs = fp8(rng, batch + (m, k), E4M3), fp8(rng, (n, k), E4M3)
        scales = dict(
            lhs_scale_inv=jnp.asarray([0.5], jnp.float32),
            rhs_scale_inv=jnp.asarray([0.25], jnp.float32),
            out_dtype=out_dt,
        )
    else:
        rbatch = batch if rhs_batched else ()
        lhs = random_like(rng, batch + ((k, m) if lt else (m, k)), dtype)
        rhs = random_like(rng, rbatch + ((n, k) if rt else (k, n)), dtype)
        scales = {}
    args = dict(lhs=lhs, rhs=rhs, lhs_trans=lt, rhs_trans=rt, **scales)
    args["addend"] = random_like(rng, batch + (m, n), out_dt, scale=4.0)
    if with_bias:
        args["bias"] = random_like(rng, (n,), out_dt)
    return args


def test_addend(rng):
    """``out = (L·R·scales + addend) + bias``, one rounding: every layout, dtype and form
    (strided batch, a shared weight folded into M, FP8, the FP8 float32 fallbacks), both
    implementations, in one program; the addend's tangent passes through unchanged."""
    check_impls(*(_addend_args(rng, name) for name in ADDEND_CASES))
    args = _addend_args(rng, "bf16_shared_weight")
    arrays = {k: v for k, v in args.items() if k in _ARRAY_ARGS}
    static = {k: v for k, v in args.items() if k not in _ARRAY_ARGS}
    dc = random_like(rng, args["addend"].shape, BF16)

    def f(c):
        return bind_gemm(**{**arrays, "addend": c}, **static).out

    _, tangent = jax.jit(lambda c, t: jax.jvp(f, (c,), (t,)))(arrays["addend"], dc)
    np.testing.assert_array_equal(np.asarray(tangent), np.asarray(dc))


def test_addend_grouped_axes(rng):
    """An addend of a grouped GEMM (``n_ndim=2``: a gated kernel's ``(K, 2, N)``) has out's
    grouped shape ``(M, 2, N)``."""
    lhs, rhs = random_like(rng, (7, 32), BF16), random_like(rng, (32, 2, 8), BF16)
    addend, bias = random_like(rng, (7, 2, 8), BF16), random_like(rng, (2, 8), BF16)
    out = jax.jit(lambda *a: bind_gemm(a[0], a[1], a[2], addend=a[3], n_ndim=2).out)(
        lhs, rhs, bias, addend
    )
    flat = dict(
        lhs=lhs, rhs=rhs.reshape(32, 16), bias=bias.reshape(16), addend=addend.reshape(7, 16)
    )
    check(GemmResult(out.reshape(7, 16)), flat)


EPILOGUE_CASES = [
    (E.DEFAULT, False),
    (E.GELU_AUX, False),
    (E.RELU, False),
    (E.GELU, False),
    (E.DGELU, False),
    (E.DGELU, True),
]
EPILOGUE_IDS = ["default", "gelu_aux", "relu", "gelu", "dgelu", "dgelu_bgrad"]


def epilogue_args(rng, lhs, rhs, epilogue, grad_bias, out_shape, io_dtype, **kw):
    """The call's arguments: DGELU gets an aux (values of a pre-activation), the others a bias,
    both in ``io_dtype`` (out_dtype)."""
    args = dict(lhs=lhs, rhs=rhs, epilogue=epilogue, grad_bias=grad_bias, **kw)
    if epilogue == E.DGELU:
        args["aux"] = random_like(rng, out_shape, io_dtype, scale=2.0)
    else:
        args["bias"] = random_like(rng, out_shape[-1:], io_dtype)
    return args


@pytest.mark.parametrize("case", EPILOGUE_CASES, ids=EPILOGUE_IDS)
def test_epilogues(case, rng):
    """Each epilogue in every dtype (one program)."""
    epilogue, grad_bias = case
    m, k, n = 33, 16, 7
    trans = TRANS[int(epilogue) % 4]  # every epilogue with some layout
    cases = []
    for dtype in DTYPES:
        lhs, rhs = random_operands(rng, m, k, n, dtype, lhs_trans=trans[0], rhs_trans=trans[1])
        cases.append(
            epilogue_args(
                rng,
                lhs,
                rhs,
                epilogue,
                grad_bias,
                (m, n),
                dtype,
                lhs_trans=trans[0],
                rhs_trans=trans[1],
            )
        )
    check_impls(*cases)


@pytest.mark.parametrize("impl", IMPLS, ids=["auto", "xla"])
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
def test_gelu_aux_is_the_rounded_pre_activation(dtype, impl, rng):
    """aux of GELU_AUX is h rounded once: the out of the DEFAULT epilogue with the same bias
    (bit for bit where the pure-JAX path runs; within the tolerance on the kernel)."""
    m, k, n = 9, 33, 17
    lhs, rhs = random_operands(rng, m, k, n, dtype)
    bias = random_like(rng, (n,), dtype)
    args = dict(lhs=lhs, rhs=rhs, bias=bias)
    h = np.asarray(call(args, impl).out)
    aux = np.asarray(call({**args, "epilogue": E.GELU_AUX}, impl).aux)
    ref = np.asarray(
        gemm_mod.reference_results(
            lhs,
            rhs,
            bias,
            jnp.zeros((0,), dtype),
            jnp.ones((1,)),
            jnp.ones((1,)),
            jnp.zeros((0,), dtype),
            GemmConfig(epilogue=E.GELU_AUX, out_dtype=np.dtype(dtype)),
        )[1]
    )
    if runs_kernel(impl) or jax.default_backend() != "cpu":
        # Two GEMMs agree only within the bound where the backend may pick different algorithms
        # for them (cuBLASLt, XLA:GPU's autotuner); XLA:CPU computes both the same way.
        bound = expect(**args, kernel=True)["out"][1]
        assert_within(aux.astype(np.float64), h.astype(np.float64), 2 * bound, "aux vs h")
    else:
        np.testing.assert_array_equal(aux, h)
        np.testing.assert_array_equal(aux, ref)


FP8_PAIRS = [(E4M3, E4M3), (E4M3, E5M2), (E5M2, E4M3)]
FP8_IDS = ["e4m3xe4m3", "e4m3xe5m2", "e5m2xe4m3"]


@pytest.mark.parametrize("pair", FP8_PAIRS, ids=FP8_IDS)
def test_fp8(pair, rng):
    """Each FP8 pair into every output dtype (one program)."""
    m, k, n = 7, 48, 32
    cases = [
        dict(
            lhs=fp8(rng, (m, k), pair[0]),
            rhs=fp8(rng, (n, k), pair[1]),  # (N, K): rhs_trans
            bias=random_like(rng, (n,), out_dtype),
            lhs_scale_inv=jnp.float32(0.75),
            rhs_scale_inv=jnp.asarray([1.5], jnp.float32),
            rhs_trans=True,
            out_dtype=out_dtype,
        )
        for out_dtype in DTYPES
    ]
    check_impls(*cases)


@pytest.mark.parametrize("case", EPILOGUE_CASES[1:], ids=EPILOGUE_IDS[1:])
def test_fp8_epilogues(case, rng):
    epilogue, grad_bias = case
    m, k, n = 33, 32, 16
    lhs, rhs = fp8(rng, (m, k), E4M3), fp8(rng, (n, k), E5M2)
    args = epilogue_args(
        rng,
        lhs,
        rhs,
        epilogue,
        grad_bias,
        (m, n),
        BF16,
        rhs_trans=True,
        out_dtype=BF16,
        lhs_scale_inv=jnp.float32(0.5),
        rhs_scale_inv=jnp.float32(3.0),
    )
    check_impls(args)


def test_fp8_fast_accumulation(rng):
    """split_accumulator=False: cuBLASLt's fast FP8 accumulation (about 13 mantissa bits on
    Hopper); the pure-JAX path ignores it. Checked against a bound that loose."""
    m, k, n = 16, 64, 32
    args = dict(
        lhs=fp8(rng, (m, k), E4M3),
        rhs=fp8(rng, (n, k), E4M3),
        rhs_trans=True,
        out_dtype=F32,
        split_accumulator=False,
    )
    got = np.asarray(call(args, None).out, np.float64)
    L, R = math_form(args["lhs"], False), math_form(args["rhs"], True)
    assert_within(got, L @ R, k * 2.0**-13 * (np.abs(L) @ np.abs(R)) + 1e-30, "fast accum")


BATCHED_CASES = [
    (E.DEFAULT, False, (False, False)),
    (E.GELU_AUX, False, (True, True)),
    (E.RELU, False, (True, False)),
    (E.DGELU, True, (False, True)),
]


@pytest.mark.parametrize("case", BATCHED_CASES, ids=["default", "gelu_aux", "relu", "dgelu_bgrad"])
def test_rank3_batched(case, rng):
    """(B, ., .) operands: B independent GEMMs; bias shared; dbias sums over B and M. float32
    and bfloat16 in one program."""
    epilogue, grad_bias, trans = case
    b, m, k, n = 3, 7, 33, 9
    cases = []
    for dtype in (F32, BF16):
        lhs, rhs = random_operands(
            rng, m, k, n, dtype, batch=(b,), lhs_trans=trans[0], rhs_trans=trans[1]
        )
        cases.append(
            epilogue_args(
                rng,
                lhs,
                rhs,
                epilogue,
                grad_bias,
                (b, m, n),
                dtype,
                lhs_trans=trans[0],
                rhs_trans=trans[1],
            )
        )
    check_impls(*cases)


def test_rank3_fp8(rng):
    b, m, k, n = 2, 5, 32, 16
    args = dict(
        lhs=fp8(rng, (b, m, k), E4M3),
        rhs=fp8(rng, (b, n, k), E4M3),
        rhs_trans=True,
        out_dtype=F16,
        lhs_scale_inv=jnp.float32(0.25),
        rhs_scale_inv=jnp.float32(2.0),
        epilogue=E.GELU_AUX,
        bias=random_like(rng, (n,), F16),
    )
    check_impls(args)


ZERO_SHAPES = [((), 0, 8, 5), ((), 6, 0, 5), ((), 6, 8, 0), ((0,), 4, 8, 5), ((2,), 0, 3, 4)]
ZERO_IDS = ["M0", "K0", "N0", "B0", "B2M0"]


@pytest.mark.parametrize("case", [EPILOGUE_CASES[1], EPILOGUE_CASES[5]], ids=["gelu_aux", "dbias"])
def test_zero_sizes(case, rng):
    """Empty M, N or B give empty outputs (a zero dbias); K = 0 gives acc = 0, i.e.
    epilogue(bias). Every shape of ZERO_SHAPES in one program."""
    epilogue, grad_bias = case
    cases = []
    for batch, m, k, n in ZERO_SHAPES:
        lhs, rhs = random_operands(rng, m, k, n, BF16, batch=batch, lhs_trans=True)
        cases.append(
            epilogue_args(rng, lhs, rhs, epilogue, grad_bias, batch + (m, n), BF16, lhs_trans=True)
        )
    check_impls(*cases)


@pytest.mark.parametrize("epilogue", [E.DEFAULT, E.GELU_AUX], ids=["default", "gelu_aux"])
def test_outputs_aliasing_donated_inputs(epilogue, rng):
    """The outputs written into donated inputs' buffers (jit's donation aliases them) that the
    step reads before the GEMM: those reads see the inputs. On the kernel, the problem (large
    enough for the initialize stage to time cuBLASLt's candidates, and of a shape no other test
    uses, so this call is its first) must never have its candidates write the call's outputs."""
    # m·n·k >= 2^30: timed on the kernel (elsewhere any shape checks the aliasing)
    m, k, n = (1040, 1024, 1032) if runs_kernel(None) else (40, 24, 32)
    lhs, rhs = random_operands(rng, m, k, n, BF16)
    bias = random_like(rng, (n,), BF16)
    donated = [random_like(rng, (m, n), BF16) for _ in range(2)]
    # The sums as read before the call (float32, any order: within 1e-5 of sum |d|).
    sums = [float(np.sum(np.asarray(d, np.float64))) for d in donated]
    slack = [1e-5 * float(np.sum(np.abs(np.asarray(d, np.float64)))) for d in donated]

    def step(d0, d1, lhs, rhs, bias):
        r = bind_gemm(lhs, rhs, bias=bias, epilogue=epilogue)
        return (jnp.sum(d0.astype(jnp.float32)), jnp.sum(d1.astype(jnp.float32))), r

    n_out = 2 if epilogue == E.GELU_AUX else 1  # out, and aux
    fn = jax.jit(step, donate_argnums=tuple(range(n_out))).lower(*donated, lhs, rhs, bias).compile()
    header = fn.as_text().split("\n", 1)[0]  # the program checked here is the one run below
    aliased = len(re.findall(r"\(\d+, \{\}, (?:may|must)-alias\)", header))
    assert aliased == n_out, f"{aliased} outputs alias donated inputs: this test tests nothing"
    reads, result = fn(*donated, lhs, rhs, bias)
    for r, want, tol in zip(reads, sums, slack, strict=True):
        assert abs(float(r) - want) <= tol, f"a donated input read {float(r)}, held {want}"
    check(result, dict(lhs=lhs, rhs=rhs, bias=bias, epilogue=epilogue), kernel=runs_kernel(None))


@pytest.mark.parametrize("impl", IMPLS, ids=["auto", "xla"])
def test_eager_equals_jit(impl, rng):
    lhs, rhs = random_operands(rng, 7, 33, 16, BF16, rhs_trans=True)
    args = dict(
        lhs=lhs, rhs=rhs, rhs_trans=True, epilogue=E.GELU_AUX, bias=random_like(rng, (16,), BF16)
    )
    eager, jitted = call(args, impl, use_jit=False), call(args, impl)
    check(eager, args, "eager ")
    check(jitted, args, "jit ")
    if jax.default_backend() == "cpu":  # one computation, op by op or fused: the same bits
        for a, b in zip(eager, jitted, strict=True):
            if a is not None:
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_float64_takes_the_pure_jax_path(rng):
    with enable_x64():
        lhs = jnp.asarray(rng.normal(size=(5, 9)))
        rhs = jnp.asarray(rng.normal(size=(9, 3)))
        bias = jnp.asarray(rng.normal(size=(3,)))
        r = jax.jit(lambda a, b, c: bind_gemm(a, b, c, epilogue=E.GELU_AUX))(lhs, rhs, bias)
        assert r.out.dtype == jnp.float64
        h = np.asarray(lhs) @ np.asarray(rhs) + np.asarray(bias)
        np.testing.assert_allclose(np.asarray(r.aux), h, rtol=1e-13, atol=1e-13)
        np.testing.assert_allclose(np.asarray(r.out), f64.gelu(h)[0], rtol=1e-12, atol=1e-13)
        with pytest.raises(TypeError, match="te_jax.gemm: the FFI kernels take"):
            bind_gemm(lhs, rhs, implementation="ffi")


# ---- vmap ---------------------------------------------------------------------------------------


def _take(args, axes, i):
    """Element i along each axis (NumPy: no compilation per shape)."""
    return [
        a if ax is None else np.take(np.asarray(a), i, axis=ax)
        for a, ax in zip(args, axes, strict=True)
    ]


def _gemm_eqns(jaxpr) -> list:
    """Every te_jax_gemm equation of a jaxpr, sub-jaxprs included."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive is gemm_mod.gemm_p:
            found.append(eqn)
        for v in eqn.params.values():
            for sub in v if isinstance(v, (tuple, list)) else (v,):
                inner = getattr(sub, "jaxpr", None)
                if inner is not None:
                    found += _gemm_eqns(getattr(inner, "jaxpr", inner))
    return found


def _prims(jaxpr) -> set[str]:
    names = set()
    for eqn in jaxpr.eqns:
        names.add(eqn.primitive.name)
        for v in eqn.params.values():
            inner = getattr(v, "jaxpr", None)
            if inner is not None:
                names |= _prims(getattr(inner, "jaxpr", inner))
    return names


# name: (dtype, lhs (math) dims, options, {arg: batched shape builder}, in_axes per level)
# Shapes: M=5, K=32, N=16 (FP8-legal), V=3 (outer), W=2 (inner), B=2 (rank-3 operands).
M_, K_, N_ = 5, 32, 16
VMAP_CASES = {
    # lhs only, rhs a shared rank-2 weight: the vmapped rows fold into M
    "lhs_only": dict(dtype=F32, lhs=(3, M_, K_), bias=True, axes=[(0, None, None, None)]),
    # lhs only with lhs_trans: the rank-3 form; batch axis not leading
    "lhs_only_trans": dict(
        dtype=BF16,
        lhs=(K_, 3, M_),
        lhs_trans=True,
        bias=True,
        epilogue=E.GELU_AUX,
        axes=[(1, None, None, None)],
    ),
    "rhs_only": dict(dtype=BF16, rhs=(3, N_, K_), rhs_trans=True, axes=[(None, 0, None, None)]),
    "both": dict(
        dtype=F16,
        lhs=(3, M_, K_),
        rhs=(3, K_, N_),
        epilogue=E.DGELU,
        aux=(M_, N_),
        axes=[(0, 0, None, None)],
    ),
    "nested_lhs": dict(
        dtype=BF16,
        lhs=(3, 2, M_, K_),
        bias=True,
        epilogue=E.RELU,
        axes=[(0, None, None, None), (0, None, None, None)],
    ),
    "nested_rhs_then_lhs": dict(
        dtype=F32,
        lhs=(2, M_, K_),
        rhs=(3, K_, N_),
        axes=[(None, 0, None, None), (0, None, None, None)],
    ),
    "lhs_over_rank3": dict(
        dtype=BF16, lhs=(3, 2, M_, K_), rhs=(2, K_, N_), bias=True, axes=[(0, None, None, None)]
    ),
    "both_over_rank3_nested": dict(
        dtype=F32,
        lhs=(3, 2, 2, M_, K_),
        rhs=(3, 2, 2, K_, N_),
        axes=[(0, 0, None, None), (0, 0, None, None)],
    ),
    "bias_batched": dict(
        dtype=BF16, lhs=(3, M_, K_), bias=(3, N_), epilogue=E.GELU_AUX, axes=[(0, None, 0, None)]
    ),
    "bias_only_batched": dict(
        dtype=F16, bias=(3, N_), epilogue=E.RELU, axes=[(None, None, 0, None)]
    ),
    "aux_only_batched": dict(
        dtype=BF16, aux=(3, M_, N_), epilogue=E.DGELU, axes=[(None, None, None, 0)]
    ),
    "dbias_batched": dict(
        dtype=BF16,
        lhs=(3, M_, K_),
        aux=(3, M_, N_),
        epilogue=E.DGELU,
        grad_bias=True,
        axes=[(0, None, None, 0)],
    ),
    "dbias_nested": dict(
        dtype=F32,
        lhs=(2, M_, K_),
        rhs=(3, K_, N_),
        aux=(3, 2, M_, N_),
        epilogue=E.DGELU,
        grad_bias=True,
        axes=[(None, 0, None, 0), (0, None, None, 0)],
    ),
    "fp8_lhs_only": dict(
        dtype=E4M3,
        rhs_dtype=E5M2,
        lhs=(3, M_, K_),
        rhs_trans=True,
        bias=True,
        out_dtype=BF16,
        axes=[(0, None, None, None, None, None)],
    ),
    "fp8_nested": dict(
        dtype=E5M2,
        rhs_dtype=E4M3,
        lhs=(2, 3, M_, K_),
        rhs_trans=True,
        out_dtype=F16,
        epilogue=E.RELU,
        bias=True,
        axes=[(0, None, None, None, None, None), (0, None, None, None, None, None)],
    ),
    # the addend: batched with lhs (the batching rule), broadcast to lhs's batch, batched alone
    "addend_with_lhs": dict(
        dtype=BF16,
        lhs=(3, M_, K_),
        bias=True,
        addend=(3, M_, N_),
        axes=[(0, None, None, None, None, None, 0)],
    ),
    "addend_shared": dict(
        dtype=F16, lhs=(3, M_, K_), addend=(M_, N_), axes=[(0, None, None, None, None, None, None)]
    ),
    "addend_only_batched": dict(
        dtype=F32, addend=(3, M_, N_), bias=True, axes=[(None, None, None, None, None, None, 0)]
    ),
    "fp8_scales_batched": dict(
        dtype=E4M3,
        lhs=(3, M_, K_),
        rhs_trans=True,
        out_dtype=F32,
        scales=(3,),
        epilogue=E.GELU_AUX,
        axes=[(0, None, None, None, 0, 0)],
    ),
}


def _vmap_inputs(case, rng):
    dt = case["dtype"]
    is_fp8 = dt in (E4M3, E5M2)
    out_dt = case.get("out_dtype", dt)
    lt, rt = case.get("lhs_trans", False), case.get("rhs_trans", False)

    def data(shape, dtype):
        return fp8(rng, shape, dtype) if is_fp8 else random_like(rng, shape, dtype)

    lhs = data(case.get("lhs", (K_, M_) if lt else (M_, K_)), dt)
    rhs = data(case.get("rhs", (N_, K_) if rt else (K_, N_)), case.get("rhs_dtype", dt))
    bias = case.get("bias")
    bias = None if not bias else random_like(rng, (N_,) if bias is True else bias, out_dt)
    aux = case.get("aux")
    aux = None if aux is None else random_like(rng, aux, out_dt, scale=2.0)
    args = [lhs, rhs, bias, aux]
    if is_fp8:
        shape = case.get("scales", ())
        args += [jnp.asarray(rng.uniform(0.5, 2.0, size=shape), jnp.float32) for _ in range(2)]
    if "addend" in case:
        args += [None] * (6 - len(args))
        args.append(random_like(rng, case["addend"], out_dt, scale=2.0))
    static = dict(
        lhs_trans=lt,
        rhs_trans=rt,
        epilogue=case.get("epilogue", E.DEFAULT),
        out_dtype=case.get("out_dtype"),
        grad_bias=case.get("grad_bias", False),
    )
    return args, static


# vmap of the pure-JAX path (implementation="xla": JAX's batching of te_jax's pure-JAX GEMM)
# on the cases where each form meets it once: transposed and rank-3 operands, both operands
# and nested levels, a batched bias, DGELU's aux and dbias, FP8 with batched scales.
XLA_VMAP = {
    "lhs_only_trans",
    "both",
    "nested_rhs_then_lhs",
    "both_over_rank3_nested",
    "bias_only_batched",
    "dbias_nested",
    "fp8_nested",
    "fp8_scales_batched",
    "addend_only_batched",
}
VMAP_PARAMS = [
    pytest.param(name, impl, id=f"{name}-{'auto' if impl is None else impl}")
    for name in VMAP_CASES
    for impl in IMPLS
    if impl is None or name in XLA_VMAP
]


@pytest.mark.parametrize("name, impl", VMAP_PARAMS)
def test_vmap(name, impl, rng):
    """vmap (and nested vmap) equals the unbatched calls, each within the tolerance of the
    float64 reference; on the primitive path one batched te_jax_gemm, never a loop."""
    case = VMAP_CASES[name]
    args, static = _vmap_inputs(case, rng)
    names = _ARRAY_ARGS[: len(args)]

    def f(*a):
        r = bind_gemm(*a, **static, implementation=impl)
        return tuple(x for x in r if x is not None)

    levels = case["axes"]
    # The primitive's batching rule on the CPU (the reference lowering): bit for bit the
    # unbatched calls. Elsewhere, both within the tolerance of the float64 reference: cuBLAS(Lt)
    # picks algorithms by shape, and vmap of the pure-JAX function (implementation="xla") makes
    # dot_generals that XLA's CPU dot sums in another order.
    EXACT_VMAP = jax.default_backend() == "cpu" and impl is None and not KERNEL  # noqa: N806
    g = f
    for axes in reversed(levels):
        g = jax.vmap(g, in_axes=axes)
    batched = jax.jit(g)(*args)
    single = jax.jit(f)

    def sizes(a, level_axes):
        return next(x.shape[ax] for x, ax in zip(a, level_axes, strict=True) if ax is not None)

    def walk(a, depth, index):
        if depth == len(levels):
            kw = dict(zip(names, a, strict=True), **static)
            got = tuple(np.asarray(x)[index] for x in batched)
            ref = single(*a)
            res = GemmResult(*(_fill(got, static)))
            check(res, kw, f"{name}{index} ")
            want = expect(**kw, kernel=KERNEL)
            for gname, g_, r_ in zip(
                ("out", "aux", "dbias"), res[:3], _fill(ref, static)[:3], strict=True
            ):
                if g_ is None:
                    continue
                what = f"{name}{index} {gname} vs the unbatched call"
                if EXACT_VMAP:
                    np.testing.assert_array_equal(np.asarray(g_), np.asarray(r_), err_msg=what)
                else:
                    bound = 2 * want[gname][1]
                    assert_within(
                        np.asarray(g_, np.float64), np.asarray(r_, np.float64), bound, what
                    )
            return
        for i in range(sizes(a, levels[depth])):
            walk(_take(a, levels[depth], i), depth + 1, index + (i,))

    walk(args, 0, ())
    if impl is None:
        jaxpr = jax.make_jaxpr(g)(*args).jaxpr
        eqns = _gemm_eqns(jaxpr)
        assert len(eqns) == 1, f"{name}: {len(eqns)} te_jax_gemm equations"
        assert not _prims(jaxpr) & {"while", "scan", "cond"}, f"{name}: a loop in {_prims(jaxpr)}"
        if name == "lhs_only":  # folded: the weight is not repeated
            assert eqns[0].invars[1].aval.shape == (K_, N_)


def _fill(outs, static):
    """(out, aux, dbias) from the tuple of non-None results."""
    it = iter(outs)
    out = next(it)
    aux = next(it) if static["epilogue"] == E.GELU_AUX else None
    dbias = next(it) if static["grad_bias"] else None
    assert next(it, None) is None, "more results than asked for"
    return out, aux, dbias


# ---- dispatch and lowering ----------------------------------------------------------------------


def test_the_kernel_lowering_only_where_te_jax_gemm_is_registered(rng):
    lhs, rhs = random_operands(rng, 8, 16, 16, BF16)
    hlo = jax.jit(lambda a, b: bind_gemm(a, b).out).lower(lhs, rhs).compile().as_text()
    assert ("te_jax_gemm" in te_jax_custom_calls(hlo)) == KERNEL
    assert "cpu" not in _ffi.target_platforms(gemm_mod.TARGET)  # the contract has no CPU handler
    hlo = jax.jit(lambda a, b: bind_gemm(a, b, implementation="xla").out).lower(lhs, rhs)
    assert not te_jax_custom_calls(hlo.compile().as_text())


def test_implementation_choice(rng, monkeypatch):
    lhs, rhs = random_operands(rng, 4, 16, 16, F32)
    prims = lambda impl: _prims(  # noqa: E731
        jax.make_jaxpr(lambda a, b: bind_gemm(a, b, implementation=impl).out)(lhs, rhs).jaxpr
    )
    assert "te_jax_gemm" in prims(None)
    assert "te_jax_gemm" not in prims("xla")
    monkeypatch.setenv("TE_JAX_IMPLEMENTATION", "xla")
    assert "te_jax_gemm" not in prims(None)
    monkeypatch.delenv("TE_JAX_IMPLEMENTATION")
    with pytest.raises(ValueError, match="te_jax.gemm: implementation must be None, 'ffi' or"):
        bind_gemm(lhs, rhs, implementation="cuda")
    if KERNEL:
        assert "te_jax_gemm" in prims("ffi")
    else:
        with pytest.raises(
            RuntimeError,
            match=rf"te_jax.gemm: implementation='ffi' but te_jax has no te_jax_gemm kernel for "
            rf"the '{jax.default_backend()}' backend",
        ):
            bind_gemm(lhs, rhs, implementation="ffi")


def test_enum_and_constants():
    assert {e.name: int(e) for e in GemmEpilogue} == {
        "DEFAULT": 0,
        "GELU_AUX": 1,
        "RELU": 2,
        "DGELU": 3,
        "GELU": 4,
    }
    assert str(GemmEpilogue.DGELU) == "GemmEpilogue.DGELU"
    lhs, rhs = _a((4, 16), BF16), _a((16, 8), BF16)
    by_name = bind_gemm(lhs, rhs, epilogue="gelu_aux", out_dtype="bfloat16")
    assert by_name.aux is not None and by_name.out.dtype == jnp.bfloat16
    assert GEMM_WORKSPACE_BYTES == 33554432
    assert GemmResult._fields == ("out", "aux", "dbias")


def _bound_config(lhs, rhs, **kw) -> GemmConfig:
    """The ``config`` of the one te_jax_gemm equation of a bind_gemm call's jaxpr (traced now:
    the environment is read at trace time)."""
    jaxpr = jax.make_jaxpr(lambda a, b: bind_gemm(a, b, **kw).out)(lhs, rhs).jaxpr
    eqns = _gemm_eqns(jaxpr)
    assert len(eqns) == 1, eqns
    assert set(eqns[0].params) == {"config"}, eqns[0].params
    config = eqns[0].params["config"]
    assert type(config) is GemmConfig, type(config)
    return config


def test_gemm_config_is_the_only_parameter(rng, monkeypatch):
    """The primitive's one parameter is a GemmConfig: hashable (a jit cache key), frozen, with
    the six te_jax_gemm attributes derived from it; ``deterministic`` comes from
    ``te_jax.dispatch.deterministic_gemm`` at trace time (its parsing: tests/test_dispatch.py)."""
    lhs, rhs = random_operands(rng, 4, 16, 8, BF16, rhs_trans=True)
    monkeypatch.delenv("TE_JAX_IMPLEMENTATION", raising=False)  # the primitive, not pure JAX
    monkeypatch.delenv("TE_JAX_DETERMINISTIC", raising=False)
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "deterministic_ops" not in f]
    monkeypatch.setenv("XLA_FLAGS", " ".join(flags))

    config = _bound_config(lhs, rhs, rhs_trans=True, epilogue=E.GELU_AUX)
    want = GemmConfig(rhs_trans=True, epilogue=E.GELU_AUX, out_dtype=BF16)
    assert config == want and hash(config) == hash(want)
    assert config.deterministic is False
    assert len({config, want, want.replace(split_accumulator=False)}) == 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.deterministic = True
    attrs = config.ffi_attributes()
    assert (
        set(attrs)
        == set(ContractEmulator.ATTRS)
        == {
            "lhs_trans",
            "rhs_trans",
            "epilogue",
            "grad_bias",
            "split_accumulator",
            "deterministic",
            "lhs_scale_mode",
            "rhs_scale_mode",
        }
    )
    assert attrs == dict(
        lhs_trans=False,
        rhs_trans=True,
        epilogue=int(E.GELU_AUX),
        grad_bias=False,
        split_accumulator=True,
        deterministic=False,
        lhs_scale_mode=0,
        rhs_scale_mode=0,
    )
    with pytest.raises(TypeError):  # removed with the amax output: not a keyword any more
        bind_gemm(lhs, rhs, rhs_trans=True, output_amax=True)

    monkeypatch.setenv("TE_JAX_DETERMINISTIC", "1")
    config = _bound_config(lhs, rhs, rhs_trans=True)
    assert config.deterministic is True and bool(config.ffi_attributes()["deterministic"])
    monkeypatch.delenv("TE_JAX_DETERMINISTIC")
    assert _bound_config(lhs, rhs, rhs_trans=True).deterministic is False


@pytest.mark.parametrize("enum", [GemmEpilogue, gemm_mod.GemmScaleMode], ids=lambda e: e.__name__)
def test_enum_matches_the_cpp_declaration(enum):
    """ffi/gemm/problem.h's ``enum class GemmEpilogue`` / ``GemmScaleMode``: the same members and
    values (names compared without a ``k`` prefix, underscores and case)."""
    ffi_dir = os.path.join(os.path.dirname(__file__), "..", "ffi")
    name = enum.__name__
    headers = [
        p
        for p in sorted(glob.glob(os.path.join(ffi_dir, "gemm", "**", "*.h"), recursive=True))
        if re.search(rf"enum class {name}\b", open(p).read())
    ]
    assert headers, f"no ffi/gemm header declares enum class {name}"

    def norm(name):
        return re.sub(r"^k(?=[A-Z])", "", name).replace("_", "").upper()

    cpp = cpp_enum(os.path.relpath(headers[0], ffi_dir), name)
    assert {norm(k): v for k, v in cpp.items()} == {norm(e.name): int(e) for e in enum}


# ---- the kernel path's FFI buffers, against an emulator of the contract -------------------------


class ContractEmulator:
    """Stands in for ``base.ffi_call``: checks every buffer and attribute against the te_jax_gemm
    FFI contract (ffi/gemm/targets.h) and computes the contract's math in float64 (one rounding)."""

    ATTRS = {
        "lhs_trans",
        "rhs_trans",
        "epilogue",
        "grad_bias",
        "split_accumulator",
        "deterministic",
        "lhs_scale_mode",
        "rhs_scale_mode",
    }
    INT_ATTRS = {"epilogue", "lhs_scale_mode", "rhs_scale_mode"}
    WORKSPACE = 3  # the results: out, aux_out, dbias, workspace

    def __init__(self):
        self.calls = []
        self.addends = []
        self.attrs = []
        self.dtypes = []

    def __call__(self, target, results, *operands, **attrs):
        """Eagerly on arrays, or traced (under jit: the buffers' shapes, dtypes and attributes
        checked at trace time, the math in a host callback)."""
        assert target == "te_jax_gemm"
        assert set(attrs) == self.ATTRS, attrs
        for k, v in attrs.items():
            assert type(v) is (np.int64 if k in self.INT_ATTRS else np.bool_), (k, type(v))
        self.attrs.append(attrs)
        lhs, rhs, bias, aux, lsi, rsi, addend = operands
        self.calls.append((lhs.shape, rhs.shape, bias.shape, aux.shape))
        self.addends.append(addend.shape)
        self.dtypes.append((np.dtype(lhs.dtype), np.dtype(rhs.dtype), np.dtype(results[0].dtype)))
        lt, rt, ep = bool(attrs["lhs_trans"]), bool(attrs["rhs_trans"]), E(attrs["epilogue"])
        assert lhs.ndim in (2, 3) and rhs.ndim == lhs.ndim
        assert lhs.shape[:-2] == rhs.shape[:-2]
        for s in (lsi, rsi):
            assert s.shape == (1,) and np.dtype(s.dtype) == np.float32
        assert len(results) == 4, [r.shape for r in results]
        out_sds = results[0]
        out_dt = np.dtype(out_sds.dtype)
        math_shape = lambda a, t: a.shape[:-2] + a.shape[-2:][::-1] if t else a.shape  # noqa: E731
        L, R = tuple(math_shape(lhs, lt)), tuple(math_shape(rhs, rt))
        assert L[-1] == R[-2]
        fp8_ops = np.dtype(lhs.dtype) in (E4M3, E5M2)
        if not fp8_ops:
            assert out_dt == np.dtype(lhs.dtype) == np.dtype(rhs.dtype)
        else:
            assert not lt and rt and L[-1] % 16 == 0 and R[-1] % 16 == 0
        out_shape = L[:-1] + R[-1:]
        n = out_shape[-1]
        assert tuple(out_sds.shape) == out_shape
        assert bias.shape in ((0,), (n,)) and (bias.size == 0 or np.dtype(bias.dtype) == out_dt)
        if ep == E.DGELU:
            assert aux.shape == out_shape and np.dtype(aux.dtype) == out_dt and bias.size == 0
        else:
            assert aux.shape == (0,)
        if addend.shape != (0,):
            assert ep == E.DEFAULT and addend.shape == out_shape
            assert np.dtype(addend.dtype) == out_dt
        shapes = [tuple(r.shape) for r in results]
        assert shapes[1] == (out_shape if ep == E.GELU_AUX else (0,))
        assert shapes[2] == ((n,) if attrs["grad_bias"] else (0,))
        assert all(np.dtype(r.dtype) == out_dt for r in results[:3])
        ws = results[self.WORKSPACE]
        assert shapes[self.WORKSPACE] == (GEMM_WORKSPACE_BYTES,) and ws.dtype == np.uint8

        def math(lhs, rhs, bias, aux, lsi, rsi, addend):
            lhs, rhs, bias, aux, lsi, rsi, addend = (
                np.asarray(x) for x in (lhs, rhs, bias, aux, lsi, rsi, addend)
            )
            if not fp8_ops:
                assert lsi[0] == rsi[0] == 1.0
            acc = np.matmul(math_form(lhs, lt), math_form(rhs, rt)) * float(lsi[0]) * float(rsi[0])
            acc = acc + (addend.astype(np.float64) if addend.ndim > 1 else 0.0)
            h = acc + (bias.astype(np.float64) if bias.size else 0.0)
            y = {
                E.DEFAULT: lambda: h,
                E.GELU_AUX: lambda: f64.gelu(h)[0],
                E.GELU: lambda: f64.gelu(h)[0],
                E.RELU: lambda: f64.relu(h)[0],
                E.DGELU: lambda: acc * f64.gelu(aux.astype(np.float64))[1],
            }[ep]()
            dbias = y.reshape(-1, n).sum(0) if attrs["grad_bias"] else np.zeros(0)
            return [
                y.astype(out_dt),
                h.astype(out_dt) if ep == E.GELU_AUX else np.zeros((0,), out_dt),
                dbias.astype(out_dt),
                np.zeros((GEMM_WORKSPACE_BYTES,), np.uint8),
            ]

        if any(isinstance(x, jax.core.Tracer) for x in operands):
            sds = [jax.ShapeDtypeStruct(r.shape, r.dtype) for r in results]
            return jax.pure_callback(math, sds, *operands)
        return [jnp.asarray(r) for r in math(*operands)]


# name: (lhs stored shape, rhs stored shape, lhs_trans, rhs_trans, the kernel's lhs shape)
KERNEL_FORMS = {
    "rank2": ((7, 33), (33, 5), False, False, (7, 33)),
    "rank2_TT": ((33, 7), (5, 33), True, True, (33, 7)),
    "rank3": ((2, 7, 33), (2, 5, 33), False, True, (2, 7, 33)),
    "shared_rhs_folds": ((3, 7, 33), (33, 5), False, False, (21, 33)),
    "shared_rhs_folds_2": ((2, 3, 7, 33), (5, 33), False, True, (42, 33)),
    "shared_rhs_lhs_trans": ((3, 33, 7), (33, 5), True, False, (3, 33, 7)),
    "batch_axes_merge": ((2, 3, 33, 7), (2, 3, 33, 5), True, False, (6, 33, 7)),
}


def _kernel_form_cases():
    """Each form with DGELU + BGRAD (whose dbias a strided-batched call takes outside it) and
    two other epilogues, turning with the form: every epilogue meets a rank-2 kernel call (plain
    or folded) and a strided-batched (rank-3) one."""
    others = list(range(5))  # the EPILOGUE_CASES before dgelu_bgrad
    for i, form in enumerate(KERNEL_FORMS):
        for j in sorted({others[(2 * i) % 5], others[(2 * i + 1) % 5], 5}):
            yield pytest.param(form, EPILOGUE_CASES[j], id=f"{form}-{EPILOGUE_IDS[j]}")


@pytest.mark.parametrize("form, case", list(_kernel_form_cases()))
def test_kernel_path_buffers(form, case, rng):
    """The kernel path (``local``) on the forms the primitive gets (vmap gives rank > 3 and a
    shared rank-2 rhs): the FFI call gets the contract's buffers and its results come back in
    place."""
    lshape, rshape, lt, rt, kernel_lhs = KERNEL_FORMS[form]
    epilogue, grad_bias = case
    emulator = ContractEmulator()
    lhs, rhs = random_like(rng, lshape, BF16), random_like(rng, rshape, BF16)
    m = lshape[-1] if lt else lshape[-2]
    n = rshape[-2] if rt else rshape[-1]
    out_shape = lshape[:-2] + (m, n)
    args = epilogue_args(
        rng, lhs, rhs, epilogue, grad_bias, out_shape, BF16, lhs_trans=lt, rhs_trans=rt
    )
    absent = jnp.zeros((0,), BF16)
    config = GemmConfig(
        lhs_trans=lt, rhs_trans=rt, epilogue=epilogue, out_dtype=BF16, grad_bias=grad_bias
    )
    outs = kernel_results(
        lhs,
        rhs,
        args.get("bias", absent),
        args.get("aux", absent),
        jnp.ones((1,)),
        jnp.ones((1,)),
        absent,
        config,
        ffi_call=emulator,
    )
    assert len(emulator.calls) == 1 and emulator.calls[0][0] == kernel_lhs, emulator.calls
    # A strided-batched (rank-3) call's dbias is the sum of its outputs, taken outside it.
    in_kernel = config.replace(grad_bias=grad_bias and len(kernel_lhs) == 2)
    assert emulator.attrs[0] == in_kernel.ffi_attributes()
    check(GemmResult(*_fill(outs, args)), args, kernel=True)


@pytest.mark.parametrize("form", ["rank2_TT", "shared_rhs_folds", "batch_axes_merge"])
def test_kernel_path_buffers_addend(form, rng):
    """The addend reaches te_jax_gemm in the call's own form (folded rows, merged batch axes)."""
    lshape, rshape, lt, rt, kernel_lhs = KERNEL_FORMS[form]
    emulator = ContractEmulator()
    lhs, rhs = random_like(rng, lshape, BF16), random_like(rng, rshape, BF16)
    m = lshape[-1] if lt else lshape[-2]
    n = rshape[-2] if rt else rshape[-1]
    args = dict(lhs=lhs, rhs=rhs, lhs_trans=lt, rhs_trans=rt)
    args["addend"] = random_like(rng, lshape[:-2] + (m, n), BF16)
    args["bias"] = random_like(rng, (n,), BF16)
    config = GemmConfig(lhs_trans=lt, rhs_trans=rt, out_dtype=BF16, addend=True)
    one, absent = jnp.ones((1,)), jnp.zeros((0,), BF16)
    outs = kernel_results(
        lhs, rhs, args["bias"], absent, one, one, args["addend"], config, ffi_call=emulator
    )
    call_rows = kernel_lhs[:-2] + ((kernel_lhs[-1] if lt else kernel_lhs[-2]),)
    assert emulator.addends == [call_rows + (n,)], emulator.addends
    check(GemmResult(*_fill(outs, dict(epilogue=E.DEFAULT, grad_bias=False))), args, kernel=True)


@pytest.mark.parametrize("form", ["rank2", "shared_rhs_folds", "rank3"])
def test_kernel_path_buffers_fp8(form, rng):
    emulator = ContractEmulator()
    batch = {"rank2": (), "shared_rhs_folds": (3,), "rank3": (2,)}[form]
    rbatch = batch if form == "rank3" else ()
    lhs, rhs = fp8(rng, batch + (5, 32), E4M3), fp8(rng, rbatch + (16, 32), E5M2)
    bias = random_like(rng, (16,), F16)
    lsi, rsi = jnp.asarray([0.5], jnp.float32), jnp.asarray([1.25], jnp.float32)
    config = GemmConfig(
        rhs_trans=True,
        epilogue=E.GELU_AUX,
        out_dtype=F16,
        split_accumulator=False,
        deterministic=True,
    )
    absent = jnp.zeros((0,), F16)
    outs = kernel_results(lhs, rhs, bias, absent, lsi, rsi, absent, config, ffi_call=emulator)
    args = dict(
        lhs=lhs,
        rhs=rhs,
        bias=bias,
        lhs_scale_inv=0.5,
        rhs_scale_inv=1.25,
        rhs_trans=True,
        epilogue=E.GELU_AUX,
        out_dtype=F16,
    )
    check(GemmResult(*_fill(outs, dict(args, grad_bias=False))), args, kernel=True)
    assert len(emulator.calls) == 1
    # The config's settings reach the kernel as its attributes.
    attrs = emulator.attrs[0]
    assert attrs["deterministic"] and not attrs["split_accumulator"] and attrs["rhs_trans"]
    assert int(attrs["epilogue"]) == int(E.GELU_AUX)


def test_kernel_path_skips_empty_problems(rng):
    emulator = ContractEmulator()
    for lshape, rshape in [((0, 16), (16, 8)), ((4, 0), (0, 8)), ((0, 4, 16), (0, 16, 8))]:
        lhs, rhs = random_like(rng, lshape, F32), random_like(rng, rshape, F32)
        bias = random_like(rng, (8,), F32)
        (out,) = kernel_results(
            lhs,
            rhs,
            bias,
            jnp.zeros((0,), F32),
            jnp.ones((1,)),
            jnp.ones((1,)),
            jnp.zeros((0,), F32),
            GemmConfig(out_dtype=F32),
            ffi_call=emulator,
        )
        check(GemmResult(out), dict(lhs=lhs, rhs=rhs, bias=bias))
    assert emulator.calls == []


# ---- FP8 operands cuBLASLt cannot take: the kernel lowering's float32 fallback ------------------

# name: (M, K, N, out_dtype, epilogue, grad_bias): K or N not a multiple of FP8_ALIGNMENT
MISALIGNED_FP8 = {
    "K24": (4, 24, 16, BF16, E.DEFAULT, False),
    "N8": (5, 16, 8, F32, E.GELU_AUX, False),
    "K24_N8": (6, 24, 8, F16, E.RELU, False),
    "K40_dgelu_bgrad": (7, 40, 16, BF16, E.DGELU, True),
    "N24_gelu_f32": (3, 32, 24, F32, E.GELU, False),
}


def _misaligned_args(rng, name):
    m, k, n, out_dtype, epilogue, grad_bias = MISALIGNED_FP8[name]
    assert k % FP8_ALIGNMENT or n % FP8_ALIGNMENT
    return epilogue_args(
        rng,
        fp8(rng, (m, k), E4M3),
        fp8(rng, (n, k), E5M2),
        epilogue,
        grad_bias,
        (m, n),
        out_dtype,
        rhs_trans=True,
        out_dtype=out_dtype,
        lhs_scale_inv=jnp.float32(0.75),
        rhs_scale_inv=jnp.asarray([1.5], jnp.float32),
    )


@pytest.mark.parametrize("name", list(MISALIGNED_FP8))
def test_misaligned_fp8_matches_the_pure_jax_path(name, rng):
    """FP8 operands whose K or N is not a multiple of 16 are accepted (no error) and give the
    pure-JAX path's result (``implementation="xla"``), both within the float64 reference's
    tolerance; where the kernel runs, its lowering takes the float32 fallback: te_jax_gemm
    gets the operands widened to float32, never FP8 ones."""
    args = _misaligned_args(rng, name)
    kernel = runs_kernel(None)
    arrays = {k: v for k, v in args.items() if k in _ARRAY_ARGS}
    static = {k: v for k, v in args.items() if k not in _ARRAY_ARGS}
    got, pure = jax.jit(lambda a: [bind_gemm(**a, **static, implementation=i) for i in IMPLS])(
        arrays
    )  # one program
    check(got, args, "auto ", kernel=kernel)
    check(pure, args, "xla ", kernel=False)
    want = expect(**args, kernel=kernel)
    for field in ("out", "aux", "dbias"):
        g, p = getattr(got, field), getattr(pure, field)
        assert (g is None) == (p is None), field
        if g is not None:
            what = f"{name} {field} vs implementation='xla'"
            bound = 2 * want[field][1]
            assert_within(np.asarray(g, np.float64), np.asarray(p, np.float64), bound, what)
    if kernel:
        hlo = jax.jit(lambda a: bind_gemm(**a, **static)).lower(arrays).compile().as_text()
        calls = [ln for ln in hlo.splitlines() if 'custom_call_target="te_jax_gemm"' in ln]
        assert calls, "no te_jax_gemm call: the kernel lowering did not run"
        for ln in calls:
            operands = ln.split("custom-call(", 1)[1]
            assert "f8e" not in operands and "f32[" in operands, f"not the fallback: {ln}"


@pytest.mark.parametrize("name", list(MISALIGNED_FP8))
def test_misaligned_fp8_kernel_path_widens_to_float32(name, rng):
    """The kernel lowering's fallback against the contract emulator (any backend): one
    te_jax_gemm call on the operands widened exactly to float32, unscaled, no bias, the DEFAULT
    epilogue into float32; the scales, the bias and the epilogue then in JAX."""
    emulator = ContractEmulator()
    args = _misaligned_args(rng, name)
    m, k, n, out_dtype, epilogue, grad_bias = MISALIGNED_FP8[name]
    absent = jnp.zeros((0,), out_dtype)
    config = GemmConfig(rhs_trans=True, epilogue=epilogue, out_dtype=out_dtype, grad_bias=grad_bias)
    arrays = {k: v for k, v in args.items() if k in _ARRAY_ARGS}
    static = {k: v for k, v in args.items() if k not in _ARRAY_ARGS}

    @jax.jit  # one program (the emulator's math a host callback), not op by op
    def run(a):
        outs = kernel_results(
            a["lhs"],
            a["rhs"],
            a.get("bias", absent),
            a.get("aux", absent),
            a["lhs_scale_inv"].reshape(1),
            a["rhs_scale_inv"].reshape(1),
            absent,
            config,
            ffi_call=emulator,
        )
        return outs, bind_gemm(**a, **static, implementation="xla")

    outs, pure = run(arrays)
    assert emulator.calls == [((m, k), (n, k), (0,), (0,))], emulator.calls
    assert emulator.dtypes == [(F32, F32, F32)], emulator.dtypes
    attrs = emulator.attrs[0]
    assert int(attrs["epilogue"]) == int(E.DEFAULT) and not attrs["grad_bias"]
    check(GemmResult(*_fill(outs, args)), args, kernel=True)
    # The widened operands are exact: the same float32 product as the pure-JAX path's.
    want = expect(**args, kernel=True)
    what = f"{name} out vs implementation='xla'"
    got = np.asarray(outs[0], np.float64)
    assert_within(got, np.asarray(pure.out, np.float64), 2 * want["out"][1], what)


# ---- trace-time checks --------------------------------------------------------------------------


def _a(shape, dtype=F32):
    return jnp.zeros(shape, dtype)


ERROR_CASES = {
    "int_lhs": (
        dict(lhs=_a((4, 16), np.int32), rhs=_a((16, 16))),
        TypeError,
        r"te_jax.gemm: lhs must be float32, bfloat16, float16, float8_e4m3fn or "
        r"float8_e5m2 .*got int32",
    ),
    "int_rhs": (
        dict(lhs=_a((4, 16)), rhs=_a((16, 16), np.int8)),
        TypeError,
        r"te_jax.gemm: rhs must be .*got int8",
    ),
    "mixed_dtypes": (
        dict(lhs=_a((4, 16)), rhs=_a((16, 16), BF16)),
        TypeError,
        r"lhs and rhs must have the same dtype, or both be FP8; got lhs float32 "
        r"and rhs bfloat16",
    ),
    "fp8_with_bf16": (
        dict(lhs=_a((4, 16), E4M3), rhs=_a((16, 16), BF16), rhs_trans=True, out_dtype=BF16),
        TypeError,
        r"got lhs float8_e4m3fn and rhs bfloat16",
    ),
    "e5m2_x_e5m2": (
        dict(lhs=_a((4, 16), E5M2), rhs=_a((16, 16), E5M2), rhs_trans=True, out_dtype=BF16),
        TypeError,
        r"float8_e5m2 lhs with float8_e5m2 rhs is not supported",
    ),
    "rank1": (
        dict(lhs=_a((16,)), rhs=_a((16, 4))),
        ValueError,
        r"te_jax.gemm: lhs must have rank 2 \(M, K\) or more \(leading batch axes\), got shape "
        r"\(16,\)",
    ),
    "rank_mismatch": (
        dict(lhs=_a((2, 2, 4, 16)), rhs=_a((2, 16, 4))),
        ValueError,
        r"rhs must have rank 2 \(K, N\) \(one weight for every batch element\) or lhs's rank 4, "
        r"got shape \(2, 16, 4\)",
    ),
    "batch_mismatch": (
        dict(lhs=_a((2, 4, 16)), rhs=_a((3, 16, 4))),
        ValueError,
        r"the same batch axes, got lhs \(2, 4, 16\) and rhs \(3, 16, 4\)",
    ),
    "contracting": (
        dict(lhs=_a((4, 16)), rhs=_a((4, 17)), rhs_trans=True),
        ValueError,
        r"the contracting dimensions differ: lhs \(4, 16\) \(M, K\) has K = 16, rhs "
        r"\(4, 17\) \(N, K\) has K = 17",
    ),
    "fp8_layout": (
        dict(lhs=_a((4, 16), E4M3), rhs=_a((16, 16), E4M3), out_dtype=BF16),
        ValueError,
        r"FP8 operands need lhs_trans=False and rhs_trans=True .*got "
        r"lhs_trans=False, rhs_trans=False",
    ),
    "fp8_no_out_dtype": (
        dict(lhs=_a((4, 16), E4M3), rhs=_a((16, 16), E4M3), rhs_trans=True),
        TypeError,
        r"out_dtype is required for FP8 operands",
    ),
    "fp8_out_fp8": (
        dict(lhs=_a((4, 16), E4M3), rhs=_a((16, 16), E4M3), rhs_trans=True, out_dtype=E4M3),
        TypeError,
        r"out_dtype must be float32, bfloat16 or float16, got float8_e4m3fn",
    ),
    "out_dtype": (
        dict(lhs=_a((4, 16), BF16), rhs=_a((16, 8), BF16), out_dtype=F32),
        TypeError,
        r"out_dtype must be the operands' dtype bfloat16 for a non-FP8 GEMM, got "
        r"float32",
    ),
    "bias_shape": (
        dict(lhs=_a((4, 16)), rhs=_a((16, 8)), bias=_a((4,))),
        ValueError,
        r"bias must have shape \(8,\) \(the output.s feature axes\), got \(4,\)",
    ),
    "bias_dtype": (
        dict(lhs=_a((4, 16)), rhs=_a((16, 8)), bias=_a((8,), BF16)),
        TypeError,
        r"bias must have out_dtype float32, got bfloat16",
    ),
    "aux_shape": (
        dict(lhs=_a((4, 16)), rhs=_a((16, 8)), aux=_a((8, 4)), epilogue=E.DGELU),
        ValueError,
        r"aux must have shape \(4, 8\) \(out's shape\), got \(8, 4\)",
    ),
    "aux_dtype": (
        dict(lhs=_a((4, 16)), rhs=_a((16, 8)), aux=_a((4, 8), F16), epilogue=E.DGELU),
        TypeError,
        r"aux must have out_dtype float32, got "
        r"float16",
    ),
    "dgelu_no_aux": (
        dict(lhs=_a((4, 16)), rhs=_a((16, 8)), epilogue=E.DGELU),
        ValueError,
        r"epilogue GemmEpilogue.DGELU needs aux",
    ),
    "dgelu_bias": (
        dict(lhs=_a((4, 16)), rhs=_a((16, 8)), aux=_a((4, 8)), bias=_a((8,)), epilogue=E.DGELU),
        ValueError,
        r"epilogue GemmEpilogue.DGELU takes no bias",
    ),
    "aux_without_dgelu": (
        dict(lhs=_a((4, 16)), rhs=_a((16, 8)), aux=_a((4, 8)), epilogue=E.GELU_AUX),
        ValueError,
        r"aux is the input of epilogue GemmEpilogue.DGELU; epilogue "
        r"GemmEpilogue.GELU_AUX takes none",
    ),
    "grad_bias_without_dgelu": (
        dict(lhs=_a((4, 16)), rhs=_a((16, 8)), grad_bias=True),
        ValueError,
        r"grad_bias=True needs epilogue GemmEpilogue.DGELU"
        r".*got epilogue GemmEpilogue.DEFAULT",
    ),
    "bad_epilogue_name": (
        dict(lhs=_a((4, 16)), rhs=_a((16, 8)), epilogue="swiglu"),
        ValueError,
        r"epilogue must be a GemmEpilogue .*got 'swiglu'",
    ),
    "bad_epilogue": (
        dict(lhs=_a((4, 16)), rhs=_a((16, 8)), epilogue=7),
        ValueError,
        r"epilogue must be a GemmEpilogue \(DEFAULT, GELU_AUX, RELU, DGELU, GELU\), "
        r"got 7",
    ),
    "scale_not_fp8": (
        dict(lhs=_a((4, 16)), rhs=_a((16, 8)), lhs_scale_inv=_a((1,))),
        ValueError,
        r"lhs_scale_inv is only for FP8 operands",
    ),
    "scale_dtype": (
        dict(
            lhs=_a((4, 16), E4M3),
            rhs=_a((16, 16), E4M3),
            rhs_trans=True,
            out_dtype=BF16,
            rhs_scale_inv=_a((1,), BF16),
        ),
        TypeError,
        r"rhs_scale_inv must be float32, got bfloat16",
    ),
    "scale_shape": (
        dict(
            lhs=_a((4, 16), E4M3),
            rhs=_a((16, 16), E4M3),
            rhs_trans=True,
            out_dtype=BF16,
            lhs_scale_inv=_a((2,)),
        ),
        ValueError,
        r"lhs_scale_inv must be a scalar or of shape \(1,\), got shape \(2,\)",
    ),
}


ERROR_CASES.update(
    addend_with_gelu=(
        dict(lhs=_a((4, 16)), rhs=_a((16, 8)), addend=_a((4, 8)), epilogue="gelu"),
        ValueError,
        r"an addend is added with epilogue GemmEpilogue.DEFAULT only, got epilogue "
        r"GemmEpilogue.GELU",
    ),
    addend_shape=(
        dict(lhs=_a((4, 16)), rhs=_a((16, 8)), addend=_a((8,))),
        ValueError,
        r"addend must have shape \(4, 8\) \(out's shape\), got \(8,\)",
    ),
    addend_dtype=(
        dict(lhs=_a((4, 16), BF16), rhs=_a((16, 8), BF16), addend=_a((4, 8))),
        TypeError,
        r"addend must have out_dtype bfloat16, got float32",
    ),
)


@pytest.mark.parametrize("name", list(ERROR_CASES))
def test_errors(name):
    kwargs, exc, match = ERROR_CASES[name]
    with pytest.raises(exc, match=match) as info:
        bind_gemm(**kwargs)
    assert str(info.value).startswith("te_jax.gemm: "), str(info.value)
    # the same check at trace time, under jit
    arrays = {k: v for k, v in kwargs.items() if k in _ARRAY_ARGS}
    static = {k: v for k, v in kwargs.items() if k not in _ARRAY_ARGS}
    with pytest.raises(exc, match=match):
        jax.jit(lambda a: bind_gemm(**a, **static))(arrays)


@pytest.mark.parametrize("epilogue", ["default", "gelu_aux", "dgelu"])
def test_shared_weight_over_batch_axes(epilogue, rng):
    """lhs (B1, B2, M, K) against one (K, N) weight (dense's row axes kept apart): the rows'
    GEMM, as on the folded (B1·B2·M, K) lhs, with DGELU's dbias over every row. Both calls
    take the same path (on CUDA the same cuBLASLt call, whose GELU epilogues are its own)."""
    lhs = jnp.asarray(rng.uniform(-1, 1, (2, 3, 4, 16)), jnp.float32)
    rhs = jnp.asarray(rng.uniform(-1, 1, (16, 8)), jnp.float32)
    kw = {"epilogue": epilogue}
    if epilogue == "dgelu":
        kw.update(aux=jnp.asarray(rng.uniform(-2, 2, (2, 3, 4, 8)), jnp.float32), grad_bias=True)
    got = jax.jit(lambda a, b: bind_gemm(a, b, **kw))(lhs, rhs)
    flat_kw = dict(kw)
    if "aux" in kw:
        flat_kw["aux"] = kw["aux"].reshape(24, 8)
    want = jax.jit(lambda a, b: bind_gemm(a, b, **flat_kw))(lhs.reshape(24, 16), rhs)
    np.testing.assert_allclose(got.out.reshape(24, 8), want.out, rtol=1e-6, atol=1e-6)
    if want.aux is not None:
        np.testing.assert_allclose(got.aux.reshape(24, 8), want.aux, rtol=1e-6, atol=1e-6)
    if want.dbias is not None:
        np.testing.assert_allclose(got.dbias, want.dbias, rtol=1e-5, atol=1e-5)
