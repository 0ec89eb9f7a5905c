"""The GEMM's trace-time checks: dtypes, ranks, the contraction, the K / N groups, the
epilogue's inputs and the FP8 scales, each a ``TypeError`` / ``ValueError`` naming what was
given (``bind_gemm`` runs them before building its ``GemmConfig``)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from te_jax.primitives.gemm.epilogue import GemmEpilogue, GemmScaleMode
from te_jax.primitives.gemm.groups import groups, rhs_kd
from te_jax.primitives.gemm.kernel import dims
from te_jax.primitives.gemm.reference_results import F32, F64, FP8
from te_jax.quantize import formats

__all__ = [
    "OUT_DTYPES",
    "KERNEL_DTYPES",
    "check_operands",
    "check_groups",
    "check_out_dtype",
    "check_epilogue",
    "check_epilogue_input",
    "check_scale_inv",
    "check_block_operands",
    "block_scale_shape",
]

_WHERE = "te_jax.gemm"
OUT_DTYPES = (F32, np.dtype(jnp.bfloat16), np.dtype(jnp.float16))
KERNEL_DTYPES = OUT_DTYPES + FP8


def _name(dt) -> str:
    return np.dtype(dt).name


def _layout(which: str, trans: bool, rank: int) -> str:
    dims = {
        ("lhs", False): "M, K",
        ("lhs", True): "K, M",
        ("rhs", False): "K, N",
        ("rhs", True): "N, K",
    }[(which, trans)]
    return f"({'B, ' if rank == 3 else ''}{dims})"


def check_operands(lhs, rhs, lhs_trans, rhs_trans):
    """Dtypes, ranks and the contracting dimension. Returns ``(batch, M, K, N, fp8)``."""
    for what, a in (("lhs", lhs), ("rhs", rhs)):
        dt = np.dtype(a.dtype)
        if dt not in KERNEL_DTYPES + (F64,):
            raise TypeError(
                f"{_WHERE}: {what} must be float32, bfloat16, float16, float8_e4m3fn or "
                f"float8_e5m2 (float64 takes the pure-JAX path), got {dt.name}"
            )
    lt, rt = np.dtype(lhs.dtype), np.dtype(rhs.dtype)
    fp8 = lt in FP8
    if fp8 != (rt in FP8) or (not fp8 and lt != rt):
        raise TypeError(
            f"{_WHERE}: lhs and rhs must have the same dtype, or both be FP8; got lhs {lt.name} "
            f"and rhs {rt.name}"
        )
    if fp8 and lt == rt == formats.E5M2:
        raise TypeError(
            f"{_WHERE}: float8_e5m2 lhs with float8_e5m2 rhs is not supported (cuBLASLt has no "
            "such kernel); one of them must be float8_e4m3fn"
        )
    if lhs.ndim < 2:
        raise ValueError(
            f"{_WHERE}: lhs must have rank 2 {_layout('lhs', lhs_trans, 2)} or more (leading "
            f"batch axes), got shape {tuple(lhs.shape)}"
        )
    if rhs.ndim not in (2, lhs.ndim):
        raise ValueError(
            f"{_WHERE}: rhs must have rank 2 {_layout('rhs', rhs_trans, 2)} (one weight for "
            f"every batch element) or lhs's rank {lhs.ndim}, got shape {tuple(rhs.shape)} (lhs "
            f"{tuple(lhs.shape)})"
        )
    if rhs.ndim == lhs.ndim > 2 and lhs.shape[:-2] != rhs.shape[:-2]:
        raise ValueError(
            f"{_WHERE}: lhs and rhs must have the same batch axes, got lhs "
            f"{tuple(lhs.shape)} and rhs {tuple(rhs.shape)}"
        )
    batch, m, k, n = dims(lhs.shape, rhs.shape, lhs_trans, rhs_trans)
    k_rhs = rhs.shape[-1] if rhs_trans else rhs.shape[-2]
    if k != k_rhs:
        raise ValueError(
            f"{_WHERE}: the contracting dimensions differ: lhs {tuple(lhs.shape)} "
            f"{_layout('lhs', lhs_trans, lhs.ndim)} has K = {k}, rhs {tuple(rhs.shape)} "
            f"{_layout('rhs', rhs_trans, rhs.ndim)} has K = {k_rhs}"
        )
    if fp8:
        if lhs_trans or not rhs_trans:
            raise ValueError(
                f"{_WHERE}: FP8 operands need lhs_trans=False and rhs_trans=True (lhs (M, K) and "
                f"rhs (N, K), cuBLASLt's TN layout), got lhs_trans={lhs_trans}, "
                f"rhs_trans={rhs_trans}"
            )
    return batch, m, k, n, fp8


def check_groups(lhs, rhs, lhs_trans, rhs_trans, k_ndim, n_ndim):
    """The K / N groups (``groups.py``) of lhs and rhs, checked; one-K, one-N operands are
    checked by ``_check_operands``."""
    if int(k_ndim) < 1 or int(n_ndim) < 1:
        raise ValueError(f"{_WHERE}: k_ndim and n_ndim must be >= 1, got {k_ndim}, {n_ndim}")
    core = k_ndim + n_ndim
    if lhs.ndim not in (1 + k_ndim, 2 + k_ndim) or rhs.ndim not in (
        core,
        core + lhs.ndim - 1 - k_ndim,
    ):
        raise ValueError(
            f"{_WHERE}: with k_ndim={k_ndim}, n_ndim={n_ndim} lhs must be (B?, M, *K) "
            f"(lhs_trans: (B?, *K, M)) and rhs (B?, *K, *N) (rhs_trans: (B?, *N, *K)); got lhs "
            f"{tuple(lhs.shape)} and rhs {tuple(rhs.shape)}"
        )
    g = groups(lhs.shape, rhs.shape, lhs_trans, rhs_trans, k_ndim, n_ndim)
    if rhs_kd(rhs.shape, rhs_trans, k_ndim, n_ndim) != g.kd:
        raise ValueError(
            f"{_WHERE}: the contracting axes differ: lhs {tuple(lhs.shape)} has K axes {g.kd}, "
            f"rhs {tuple(rhs.shape)} has {rhs_kd(rhs.shape, rhs_trans, k_ndim, n_ndim)}"
        )
    if not g.shared_rhs and tuple(rhs.shape[: len(g.batch)]) != g.batch:
        raise ValueError(
            f"{_WHERE}: lhs and rhs must have the same batch axes, got lhs {tuple(lhs.shape)} "
            f"and rhs {tuple(rhs.shape)}"
        )
    return g


def check_out_dtype(out_dtype, operand_dtype, fp8) -> np.dtype:
    if fp8:
        if out_dtype is None:
            raise TypeError(
                f"{_WHERE}: out_dtype is required for FP8 operands (float32, bfloat16 or float16)"
            )
        dt = np.dtype(jnp.dtype(out_dtype))
        if dt not in OUT_DTYPES:
            raise TypeError(
                f"{_WHERE}: out_dtype must be float32, bfloat16 or float16, got {dt.name}"
            )
        return dt
    dt = np.dtype(jnp.dtype(operand_dtype if out_dtype is None else out_dtype))
    if dt != np.dtype(operand_dtype):
        raise TypeError(
            f"{_WHERE}: out_dtype must be the operands' dtype {_name(operand_dtype)} for a non-FP8 "
            f"GEMM, got {dt.name}"
        )
    return dt


def check_epilogue(epilogue, bias, aux, grad_bias):
    try:
        if isinstance(epilogue, str):
            epilogue = GemmEpilogue[epilogue.upper()]
        epilogue = GemmEpilogue(epilogue)
    except (KeyError, ValueError):
        names = ", ".join(e.name for e in GemmEpilogue)
        raise ValueError(
            f"{_WHERE}: epilogue must be a GemmEpilogue ({names}), got {epilogue!r}"
        ) from None
    if epilogue == GemmEpilogue.DGELU:
        if aux is None:
            raise ValueError(
                f"{_WHERE}: epilogue {epilogue} needs aux, the forward's pre-activation h "
                "(shape of out, in out_dtype)"
            )
        if bias is not None:
            raise ValueError(
                f"{_WHERE}: epilogue {epilogue} takes no bias (grad_bias=True returns dbias), "
                f"got bias of shape {tuple(jnp.shape(bias))}"
            )
    elif aux is not None:
        raise ValueError(
            f"{_WHERE}: aux is the input of epilogue GemmEpilogue.DGELU; epilogue {epilogue} "
            f"takes none, got aux of shape {tuple(jnp.shape(aux))}"
        )
    if grad_bias and epilogue != GemmEpilogue.DGELU:
        raise ValueError(
            f"{_WHERE}: grad_bias=True needs epilogue GemmEpilogue.DGELU (cuBLASLt's "
            f"DGELU_BGRAD), got epilogue {epilogue}"
        )
    return epilogue


def check_addend_epilogue(addend, epilogue) -> None:
    if addend is not None and epilogue != GemmEpilogue.DEFAULT:
        raise ValueError(
            f"{_WHERE}: an addend is added with epilogue GemmEpilogue.DEFAULT only, got epilogue "
            f"{epilogue}: add it after the GEMM, or leave the epilogue out"
        )


def check_epilogue_input(what, a, shape, out_dtype):
    a = jnp.asarray(a)
    if tuple(a.shape) != tuple(shape):
        raise ValueError(
            f"{_WHERE}: {what} must have shape {tuple(shape)}"
            + (" (the output's feature axes)" if what == "bias" else " (out's shape)")
            + f", got {tuple(a.shape)}"
        )
    if np.dtype(a.dtype) != out_dtype:
        raise TypeError(
            f"{_WHERE}: {what} must have out_dtype {out_dtype.name}, got {_name(a.dtype)}"
        )
    return a


def check_block_operands(modes, fp8, batch, lhs_trans, rhs_trans, k_ndim) -> None:
    """Block-scaled operands: FP8, unbatched, the TN form, one K axis, not both 128x128."""
    if all(m == GemmScaleMode.TENSOR for m in modes):
        return
    names = f"lhs_scale_mode={modes[0].name}, rhs_scale_mode={modes[1].name}"
    if not fp8:
        raise ValueError(f"{_WHERE}: {names} scale FP8 operands; these are not FP8")
    if batch or lhs_trans or not rhs_trans or k_ndim != 1:
        raise ValueError(
            f"{_WHERE}: {names}: block-scaled operands must be unbatched, in the TN form "
            "(lhs (M, K), rhs stored (N, K): lhs_trans=False, rhs_trans=True) with one K axis"
        )
    if modes == (GemmScaleMode.BLOCK_2D, GemmScaleMode.BLOCK_2D):
        raise ValueError(
            f"{_WHERE}: {names}: cuBLASLt has no GEMM of two 128x128-block-scaled operands; "
            "scale one of them in 1x128 blocks"
        )


def block_scale_shape(mode, rows: int, k: int) -> tuple[int, int]:
    """The float32 scale shape of an operand stored ``(rows, k)`` under a block ``mode``
    (cuBLASLt's layouts, ffi/gemm/problem.h)."""
    kb = -(-k // 128)
    if mode == GemmScaleMode.BLOCK_1D:
        return (kb, -(-rows // 4) * 4)
    return (-(-rows // 128), -(-kb // 4) * 4)


def check_scale_inv(what, s, fp8, operand_dtype, mode=GemmScaleMode.TENSOR, shape=None):
    """A scale_inv as the primitive takes it: ``(1,)`` per tensor, or a block mode's 2-D
    layout for an operand stored as ``shape`` ``(rows, K)``."""
    if mode != GemmScaleMode.TENSOR:
        want = block_scale_shape(mode, *shape)
        if s is None or np.dtype(jnp.asarray(s).dtype) != F32 or tuple(s.shape) != want:
            got = "None" if s is None else f"{_name(s.dtype)}{tuple(s.shape)}"
            raise ValueError(
                f"{_WHERE}: {what} of a {mode.name} operand stored {tuple(shape)} must be "
                f"float32 {want}, got {got}"
            )
        return jnp.asarray(s)
    if s is None:
        return jnp.ones((1,), F32)
    if not fp8:
        raise ValueError(
            f"{_WHERE}: {what} is only for FP8 operands (the dequantization scale), got "
            f"{_name(operand_dtype)} operands"
        )
    s = jnp.asarray(s)
    if np.dtype(s.dtype) != F32:
        raise TypeError(f"{_WHERE}: {what} must be float32, got {_name(s.dtype)}")
    if tuple(s.shape) not in ((), (1,)):
        raise ValueError(
            f"{_WHERE}: {what} must be a scalar or of shape (1,), got shape {tuple(s.shape)}"
        )
    return s.reshape(1)
