"""The GEMM primitive: one matrix product with a fused epilogue (target ``te_jax_gemm``,
cuBLASLt; its FFI contract is issue 16's gemm_contract.md, bound in ffi/gemm/).

Row-major math, what JAX sees (``B`` is an optional batch of independent GEMMs)::

    L   = lhs  (B?, M, K),  or with lhs_trans the transpose of lhs stored (B?, K, M)
    R   = rhs  (B?, K, N),  or with rhs_trans the transpose of rhs stored (B?, N, K)
    acc = float32(L @ R) · lhs_scale_inv · rhs_scale_inv      (float32 accumulation)
    h   = acc + bias                                          (bias (N,), broadcast over B and M)
    out = epilogue(h), rounded once to out_dtype              (B?, M, N)

The epilogue (``GemmEpilogue``) runs on the float32 ``h``; gelu is the tanh form of
``te_jax.reference`` (the same math as the activation ops):

* ``DEFAULT``:  ``out = h``.
* ``GELU_AUX``: ``out = gelu(h)``, and ``aux = h`` rounded to out_dtype (the backward's input).
* ``RELU``:     ``out = max(h, 0)``.
* ``DGELU``:    ``out = acc · gelu'(aux)`` for the given ``aux`` (the forward's ``h``, shape of
  out, in out_dtype); no bias. With ``grad_bias`` also ``dbias (N,)``, the float32 sum of the
  unrounded out over B and M, rounded to out_dtype.
* ``GELU``:     ``out = gelu(h)``, no aux (the inference forward).

With ``output_amax`` (FP8 operands only): ``amax = max|out|`` of the rounded out, float32 of
shape ``(1,)``.

Dtypes: lhs and rhs are both float32, both bfloat16 or both float16 (out_dtype is theirs), or FP8:
float8_e4m3fn × float8_e4m3fn, e4m3 × float8_e5m2 or e5m2 × e4m3 (not e5m2 × e5m2), with an
out_dtype of float32, bfloat16 or float16, ``lhs_trans=False``, ``rhs_trans=True`` and K and N
multiples of 16. FP8 operands are dequantized by the float32 scale_invs (``(1,)`` or scalars).
float64 operands take the pure-JAX path and compute in float64.

Paths: ``bind_gemm(..., implementation=None)`` binds the outer primitive ``gemm_p``, which lowers
to the kernel on the platforms where ``te_jax_gemm`` is registered (CUDA: there is no CPU
handler) and to ``reference_results`` (pure JAX: ``lax.dot_general`` in float32 at HIGHEST
precision, then the epilogue) everywhere else, both under the same ``custom_partitioning``
(``gemm_sharding``); ``implementation="xla"`` (and float64) calls ``reference_results`` without
the primitive; ``"ffi"`` insists on the kernel (a ``RuntimeError``
on a backend without ``te_jax_gemm``, the CPU included).

vmap: a batched lhs with an unbatched rank-2 rhs (a shared weight) folds the vmapped axes into M,
one GEMM (with ``lhs_trans`` they cannot fold, and the rhs is repeated for a strided-batched
GEMM); any other batched lhs / rhs is the strided-batched form, the unbatched operand repeated. A
batched bias or scale_inv, ``grad_bias`` (one dbias per batch element) or an aux batched alone
run the GEMM without epilogue into float32 (16-bit operands widened exactly to float32 first, so
the accumulation is the same) and apply the scales and the epilogue in JAX: exact, and one GEMM.

Sharding: ``te_jax.primitives.gemm_sharding`` (data, column and row parallel; the weight, never
the activation, gathered where a mesh axis would split both).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.core import ShapedArray
from jax.interpreters import batching

from te_jax import _ffi, reference
from te_jax._varying import bind
from te_jax.dispatch import environment_implementation, use_ffi
from te_jax.primitives import base
from te_jax.primitives.gemm_epilogue import GemmEpilogue
from te_jax.primitives.gemm_groups import arrange, grouped, groups, rhs_kd
from te_jax.primitives.gemm_sharding import make_partitioned_gemm
from te_jax.quantize import formats

__all__ = [
    "GemmEpilogue",
    "GemmResult",
    "GEMM_WORKSPACE_BYTES",
    "TARGET",
    "bind_gemm",
    "gemm_p",
    "reference_results",
]

TARGET = "te_jax_gemm"
GEMM_WORKSPACE_BYTES = 32 * 1024 * 1024  # the contract's kGemmWorkspaceBytes (cuBLASLt's)
_WHERE = "te_jax.gemm"
# cuBLASLt's FP8 GEMM needs K and N to be multiples of 16 (16-byte aligned leading dimensions).
FP8_ALIGNMENT = 16


class GemmResult(NamedTuple):
    """What ``bind_gemm`` returns; ``None`` for what was not asked for."""

    out: jax.Array
    aux: jax.Array | None  # epilogue GELU_AUX: h, the pre-activation
    dbias: jax.Array | None  # grad_bias: (N,)
    amax: jax.Array | None  # output_amax: float32 (1,)


_F32 = np.dtype(np.float32)
_F64 = np.dtype(np.float64)
_HALF = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16))
_OUT_DTYPES = (_F32, *_HALF)
_FP8 = (formats.E4M3, formats.E5M2)
_KERNEL_DTYPES = _OUT_DTYPES + _FP8

_gelu = reference.component("gelu")
_relu = reference.component("relu")


def _dims(lhs_shape, rhs_shape, lhs_trans: bool, rhs_trans: bool):
    """``(batch, M, K, N)`` of the primitive's operands (the batch axes are lhs's leading axes)."""
    m, k = (lhs_shape[-1], lhs_shape[-2]) if lhs_trans else (lhs_shape[-2], lhs_shape[-1])
    n = rhs_shape[-2] if rhs_trans else rhs_shape[-1]
    return tuple(lhs_shape[:-2]), m, k, n


# ---- the pure-JAX path --------------------------------------------------------------------------
# The primitive's operands: lhs (batch..., ., .); rhs with the same batch axes or rank 2 (shared
# over lhs's batch axes: what vmap makes of a weight); bias (N,) or absent (0,); aux (shape of
# out) for DGELU, absent otherwise; the scale_invs float32 (1,).


def _accumulate(lhs, rhs, *, lhs_trans: bool, rhs_trans: bool, cdt) -> jax.Array:
    """``L @ R`` accumulated in ``cdt``, shape ``(batch..., M, N)``."""
    if np.dtype(lhs.dtype) in _FP8:  # dot_general takes no FP8: widen exactly
        lhs, rhs = formats.to_float32(lhs), formats.to_float32(rhs)
    lc = lhs.ndim - (2 if lhs_trans else 1)
    rc = rhs.ndim - (1 if rhs_trans else 2)
    batch = tuple(range(lhs.ndim - 2)) if rhs.ndim == lhs.ndim else ()
    # Output axes: batch, lhs's free axes in order (the shared-rhs case: batch..., M), then N.
    return lax.dot_general(
        lhs,
        rhs,
        (((lc,), (rc,)), (batch, batch)),
        precision=lax.Precision.HIGHEST,
        preferred_element_type=cdt,
    )


def _epilogue(
    acc, bias, aux, lhs_scale_inv, rhs_scale_inv, *, epilogue, out_dtype, grad_bias, output_amax
) -> list[jax.Array]:
    """Everything after the accumulation: scales, bias, epilogue, one rounding; dbias and amax.

    ``acc`` is the unscaled accumulator (float32, or float64 for float64 operands) of any
    leading shape; dbias sums over every axis but the last.
    """
    cdt = np.dtype(acc.dtype)
    acc = acc * lhs_scale_inv.astype(cdt)[0] * rhs_scale_inv.astype(cdt)[0]
    h = acc + bias.astype(cdt) if bias.size else acc
    if epilogue == GemmEpilogue.DGELU:
        y = acc * _gelu(aux.astype(cdt), None)[1]
    elif epilogue in (GemmEpilogue.GELU_AUX, GemmEpilogue.GELU):
        y = _gelu(h, None)[0]
    elif epilogue == GemmEpilogue.RELU:
        y = _relu(h, None)[0]
    else:
        y = h
    out = y.astype(out_dtype)
    outs = [out]
    if epilogue == GemmEpilogue.GELU_AUX:
        outs.append(h.astype(out_dtype))
    if grad_bias:
        outs.append(jnp.sum(y, axis=tuple(range(y.ndim - 1))).astype(out_dtype))
    if output_amax:
        outs.append(jnp.max(jnp.abs(formats.to_float32(out)), initial=0.0).reshape(1))
    return outs


def reference_results(
    lhs,
    rhs,
    bias,
    aux,
    lhs_scale_inv,
    rhs_scale_inv,
    *,
    lhs_trans,
    rhs_trans,
    epilogue,
    out_dtype,
    grad_bias,
    output_amax,
    split_accumulator,
) -> list[jax.Array]:
    """The primitive's results in pure JAX: its lowering without the kernel, the
    ``implementation="xla"`` path and the tests' oracle. ``split_accumulator`` is ignored (the
    accumulation is always float32)."""
    del split_accumulator
    cdt = _F64 if np.dtype(out_dtype) == _F64 else _F32
    acc = _accumulate(lhs, rhs, lhs_trans=lhs_trans, rhs_trans=rhs_trans, cdt=cdt)
    return _epilogue(
        acc,
        bias,
        aux,
        lhs_scale_inv,
        rhs_scale_inv,
        epilogue=epilogue,
        out_dtype=out_dtype,
        grad_bias=grad_bias,
        output_amax=output_amax,
    )


# ---- the kernel path ----------------------------------------------------------------------------


def _kernel(
    lhs,
    rhs,
    bias,
    aux,
    lhs_scale_inv,
    rhs_scale_inv,
    *,
    lhs_trans,
    rhs_trans,
    epilogue,
    out_dtype,
    grad_bias,
    output_amax,
    split_accumulator,
) -> list[jax.Array]:
    """The local computation: one ``te_jax_gemm`` call on the contract's rank-2 or rank-3 form."""
    params = dict(
        lhs_trans=lhs_trans,
        rhs_trans=rhs_trans,
        epilogue=epilogue,
        out_dtype=out_dtype,
        grad_bias=grad_bias,
        output_amax=output_amax,
        split_accumulator=split_accumulator,
    )
    batch, m, k, n = _dims(lhs.shape, rhs.shape, lhs_trans, rhs_trans)
    if 0 in (math.prod(batch), m, k, n):  # nothing to multiply: acc = 0 (or no output at all)
        return reference_results(lhs, rhs, bias, aux, lhs_scale_inv, rhs_scale_inv, **params)
    if batch and rhs.ndim < lhs.ndim and not lhs_trans:
        # A shared weight: the rows (batch..., M) are contiguous, one GEMM over all of them (one
        # BGRAD epilogue for dbias too).
        flat_aux = aux.reshape(-1, n) if epilogue == GemmEpilogue.DGELU else aux
        outs = _kernel(
            lhs.reshape(-1, k), rhs, bias, flat_aux, lhs_scale_inv, rhs_scale_inv, **params
        )
        n_rows = 2 if epilogue == GemmEpilogue.GELU_AUX else 1  # out, and aux
        return [o.reshape(batch + (m, n)) for o in outs[:n_rows]] + list(outs[n_rows:])
    if output_amax:
        # cuBLASLt's AMAX_D exists only for FP8 outputs (te_jax's are 16/32-bit): one reduction.
        outs = _kernel(
            lhs, rhs, bias, aux, lhs_scale_inv, rhs_scale_inv, **dict(params, output_amax=False)
        )
        return outs + [jnp.max(jnp.abs(formats.to_float32(outs[0])), initial=0.0).reshape(1)]
    if grad_bias and batch:
        # cuBLASLt's BGRAD epilogue reduces one GEMM: a batch sums its rounded outputs here.
        out = _kernel(
            lhs, rhs, bias, aux, lhs_scale_inv, rhs_scale_inv, **dict(params, grad_bias=False)
        )[0]
        dbias = jnp.sum(out.astype(_F32), axis=tuple(range(out.ndim - 1))).astype(out_dtype)
        return [out, dbias]
    fp8 = np.dtype(lhs.dtype) in _FP8
    misaligned = fp8 and (k % FP8_ALIGNMENT or n % FP8_ALIGNMENT)
    if misaligned or (fp8 and np.dtype(out_dtype) == _F32 and bias.size):
        # The float32 accumulator from the kernel, the bias and epilogue in JAX (exact: no
        # rounding beyond float32). A shard of a sharded FP8 GEMM whose K or N cuBLASLt's FP8
        # GEMM cannot take: the operands widened exactly to float32, scaled in JAX. A float32
        # output with a bias (cuBLASLt's FP8 GEMM has no bias epilogue for it): scaled in the GEMM.
        one, absent = jnp.ones((1,), _F32), jnp.zeros((0,), _F32)
        if misaligned:
            operands = (formats.to_float32(lhs), formats.to_float32(rhs), absent, absent, one, one)
            scales = (lhs_scale_inv, rhs_scale_inv)
        else:
            operands = (lhs, rhs, absent, absent, lhs_scale_inv, rhs_scale_inv)
            scales = (one, one)
        acc = _kernel(
            *operands,
            **dict(params, epilogue=GemmEpilogue.DEFAULT, out_dtype=_F32, grad_bias=False),
        )[0]
        return _epilogue(
            acc,
            bias,
            aux,
            *scales,
            epilogue=epilogue,
            out_dtype=out_dtype,
            grad_bias=grad_bias,
            output_amax=False,
        )
    out_shape = batch + (m, n)
    shared_rhs = rhs.ndim < lhs.ndim
    if shared_rhs and not lhs_trans:  # rows (batch..., M) are contiguous: fold them into M
        lhs = lhs.reshape(-1, k)
        kshape = (lhs.shape[0], n)
    else:  # the strided-batched form (B, ., .), B the product of the batch axes
        if shared_rhs:  # (batch..., K, M) cannot fold into M: repeat the weight per batch
            rhs = jnp.broadcast_to(rhs, batch + rhs.shape)
        if batch:
            lhs = lhs.reshape((-1,) + lhs.shape[-2:])
            rhs = rhs.reshape((-1,) + rhs.shape[-2:])
        kshape = lhs.shape[:-2] + (m, n)
    if epilogue == GemmEpilogue.DGELU:
        aux = aux.reshape(kshape)
    sds = jax.ShapeDtypeStruct
    results = [
        sds(kshape, out_dtype),
        sds(kshape if epilogue == GemmEpilogue.GELU_AUX else (0,), out_dtype),
        sds((n,) if grad_bias else (0,), out_dtype),
        sds((0,), _F32),  # amax: output_amax was reduced above
        sds((GEMM_WORKSPACE_BYTES,), np.uint8),
    ]
    out, aux_out, dbias, _, _ = base.ffi_call(
        TARGET,
        results,
        lhs,
        rhs,
        bias,
        aux,
        lhs_scale_inv,
        rhs_scale_inv,
        lhs_trans=np.bool_(lhs_trans),
        rhs_trans=np.bool_(rhs_trans),
        epilogue=np.int64(epilogue),
        grad_bias=np.bool_(grad_bias),
        output_amax=np.bool_(False),
        split_accumulator=np.bool_(split_accumulator),
    )
    outs = [out.reshape(out_shape)]
    if epilogue == GemmEpilogue.GELU_AUX:
        outs.append(aux_out.reshape(out_shape))
    if grad_bias:
        outs.append(dbias)
    return outs


# ---- the outer primitive ------------------------------------------------------------------------

gemm_p = base.make_primitive("te_jax_gemm")


@gemm_p.def_abstract_eval
def _abstract(
    lhs,
    rhs,
    bias,
    aux,
    lhs_scale_inv,
    rhs_scale_inv,
    *,
    lhs_trans,
    rhs_trans,
    epilogue,
    out_dtype,
    grad_bias,
    output_amax,
    split_accumulator,
    k_ndim,
    n_ndim,
):
    g = groups(lhs.shape, rhs.shape, lhs_trans, rhs_trans, k_ndim, n_ndim)
    out = ShapedArray(g.batch + (g.m,) + g.f, out_dtype)
    outs = [out]
    if epilogue == GemmEpilogue.GELU_AUX:
        outs.append(out)
    if grad_bias:
        outs.append(ShapedArray(g.f, out_dtype))
    if output_amax:
        outs.append(ShapedArray((1,), _F32))
    return outs


# The kernel lowering goes to the platforms where te_jax_gemm is registered: CUDA when the CUDA
# extension has it (the contract has no CPU handler); the CPU (and a CUDA build without the GEMM)
# lowers to the reference. Both under the same custom_partitioning (gemm_sharding.py).
KERNEL_PLATFORMS = _ffi.target_platforms(TARGET)

base.register_outer_rules(
    gemm_p,
    local=grouped(_kernel),
    partitioned=make_partitioned_gemm(grouped(_kernel)),
    reference=grouped(reference_results),
    platforms=KERNEL_PLATFORMS,
    partitioned_reference=make_partitioned_gemm(grouped(reference_results)),
)


def _batch_operands(lhs, ld, rhs, rd, size):
    """lhs and rhs with the vmapped axis in front: a shared rank-2 rhs stays shared when only lhs
    is batched (the kernel folds the rows into M); otherwise both become (V, batch..., ., .)."""
    if rd is None and rhs.ndim == 2:
        return jnp.moveaxis(lhs, ld, 0), rhs
    lhs = batching.bdim_at_front(lhs, ld, size)
    rhs = batching.bdim_at_front(rhs, rd, size)
    if rhs.ndim < lhs.ndim:  # rhs was shared over lhs's batch axes: repeat it over them
        rhs = jnp.expand_dims(rhs, tuple(range(1, 1 + lhs.ndim - rhs.ndim)))
        rhs = jnp.broadcast_to(rhs, lhs.shape[:-2] + rhs.shape[-2:])
    return lhs, rhs


def _batch(args, dims, **params):
    if params["k_ndim"] != 1 or params["n_ndim"] != 1:
        # Groups fold per example (a reshape vmap batches), then the one-K, one-N rule.
        def one(*operands):
            return grouped(_bind_flat)(*operands, **params)

        outs = jax.vmap(one, in_axes=tuple(dims))(*args)
        return list(outs), [0] * len(outs)
    lhs, rhs, bias, aux, lhs_si, rhs_si = args
    ld, rd, bd, ad, lsd, rsd = dims
    size = next(a.shape[d] for a, d in zip(args, dims, strict=True) if d is not None)
    operands_batched = ld is not None or rd is not None
    if (
        bd is not None
        or lsd is not None
        or rsd is not None
        or params["grad_bias"]
        or (ad is not None and not operands_batched)
    ):
        return _batch_epilogue_outside(args, dims, size, **params)
    lhs, rhs = _batch_operands(lhs, ld, rhs, rd, size)
    if params["epilogue"] == GemmEpilogue.DGELU:
        aux = batching.bdim_at_front(aux, ad, size)
    params_no_amax = {**params, "output_amax": False}
    outs = list(bind(gemm_p, lhs, rhs, bias, aux, lhs_si, rhs_si, **params_no_amax))
    if params["output_amax"]:  # one amax per batch element, of the rounded out
        outs.append(base.amax(formats.to_float32(outs[0]), batch_axes=1))
    return outs, [0] * len(outs)


def _bind_flat(*operands, **params):
    """``gemm_p`` on one-K, one-N operands."""
    return bind(gemm_p, *operands, k_ndim=1, n_ndim=1, **params)


def _batch_epilogue_outside(
    args,
    dims,
    size,
    *,
    lhs_trans,
    rhs_trans,
    epilogue,
    out_dtype,
    grad_bias,
    output_amax,
    split_accumulator,
    k_ndim=1,
    n_ndim=1,
):
    """A batched bias / scale_inv, a per-batch dbias or an aux batched alone: the GEMM writes the
    unscaled float32 accumulator (16-bit operands widened exactly: the same products and float32
    sums), and the scales and the epilogue run in JAX, vmapped, as in the reference."""
    lhs, rhs, bias, aux, lhs_si, rhs_si = args
    ld, rd, bd, ad, lsd, rsd = dims
    acc_dim = None
    if ld is not None or rd is not None:
        lhs, rhs = _batch_operands(lhs, ld, rhs, rd, size)
        acc_dim = 0
    if np.dtype(lhs.dtype) in _HALF:  # the kernel writes float32 only from float32 operands
        lhs, rhs = formats.to_float32(lhs), formats.to_float32(rhs)
    one, absent = jnp.ones((1,), _F32), jnp.zeros((0,), _F32)
    (acc,) = bind(
        gemm_p,
        lhs,
        rhs,
        absent,
        absent,
        one,
        one,
        lhs_trans=lhs_trans,
        rhs_trans=rhs_trans,
        epilogue=GemmEpilogue.DEFAULT,
        out_dtype=_F32,
        grad_bias=False,
        output_amax=False,
        split_accumulator=split_accumulator,
        k_ndim=1,
        n_ndim=1,
    )
    fn = functools.partial(
        _epilogue,
        epilogue=epilogue,
        out_dtype=out_dtype,
        grad_bias=grad_bias,
        output_amax=output_amax,
    )
    in_axes = (acc_dim, bd, ad, lsd, rsd)
    outs = jax.vmap(fn, in_axes=in_axes, axis_size=size)(acc, bias, aux, lhs_si, rhs_si)
    return list(outs), [0] * len(outs)


batching.primitive_batchers[gemm_p] = _batch


# ---- the entry point: checks, then the primitive or the pure-JAX path ---------------------------


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


def _check_operands(lhs, rhs, lhs_trans, rhs_trans):
    """Dtypes, ranks and the contracting dimension. Returns ``(batch, M, K, N, fp8)``."""
    for what, a in (("lhs", lhs), ("rhs", rhs)):
        dt = np.dtype(a.dtype)
        if dt not in _KERNEL_DTYPES + (_F64,):
            raise TypeError(
                f"{_WHERE}: {what} must be float32, bfloat16, float16, float8_e4m3fn or "
                f"float8_e5m2 (float64 takes the pure-JAX path), got {dt.name}"
            )
    lt, rt = np.dtype(lhs.dtype), np.dtype(rhs.dtype)
    fp8 = lt in _FP8
    if fp8 != (rt in _FP8) or (not fp8 and lt != rt):
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
    batch, m, k, n = _dims(lhs.shape, rhs.shape, lhs_trans, rhs_trans)
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
        for dim, v in (("K", k), ("N", n)):
            if v % FP8_ALIGNMENT:
                raise ValueError(
                    f"{_WHERE}: FP8 GEMMs need {dim} to be a multiple of {FP8_ALIGNMENT}, got "
                    f"{dim} = {v}"
                )
    return batch, m, k, n, fp8


def _check_groups(lhs, rhs, lhs_trans, rhs_trans, k_ndim, n_ndim):
    """The K / N groups (``gemm_groups``) of lhs and rhs, checked; one-K, one-N operands are
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


def _check_out_dtype(out_dtype, operand_dtype, fp8) -> np.dtype:
    if fp8:
        if out_dtype is None:
            raise TypeError(
                f"{_WHERE}: out_dtype is required for FP8 operands (float32, bfloat16 or float16)"
            )
        dt = np.dtype(jnp.dtype(out_dtype))
        if dt not in _OUT_DTYPES:
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


def _check_epilogue(epilogue, bias, aux, grad_bias, output_amax, fp8, operand_dtype):
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
    if output_amax and not fp8:
        raise ValueError(
            f"{_WHERE}: output_amax=True is only for FP8 operands (cuBLASLt computes AMAX_D only "
            f"for FP8 GEMMs), got {_name(operand_dtype)} operands"
        )
    return epilogue


def _check_epilogue_input(what, a, shape, out_dtype):
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


def _check_scale_inv(what, s, fp8, operand_dtype):
    if s is None:
        return jnp.ones((1,), _F32)
    if not fp8:
        raise ValueError(
            f"{_WHERE}: {what} is only for FP8 operands (the dequantization scale), got "
            f"{_name(operand_dtype)} operands"
        )
    s = jnp.asarray(s)
    if np.dtype(s.dtype) != _F32:
        raise TypeError(f"{_WHERE}: {what} must be float32, got {_name(s.dtype)}")
    if tuple(s.shape) not in ((), (1,)):
        raise ValueError(
            f"{_WHERE}: {what} must be a scalar or of shape (1,), got shape {tuple(s.shape)}"
        )
    return s.reshape(1)


def bind_gemm(
    lhs: jax.Array,
    rhs: jax.Array,
    bias: jax.Array | None = None,
    aux: jax.Array | None = None,
    lhs_scale_inv: jax.Array | None = None,
    rhs_scale_inv: jax.Array | None = None,
    *,
    lhs_trans: bool = False,
    rhs_trans: bool = False,
    epilogue: GemmEpilogue = GemmEpilogue.DEFAULT,
    out_dtype=None,
    grad_bias: bool = False,
    output_amax: bool = False,
    split_accumulator: bool = True,
    implementation: str | None = None,
    k_ndim: int = 1,
    n_ndim: int = 1,
) -> GemmResult:
    """One GEMM with a fused bias and epilogue (see the module docstring for the math).

    Args:
      lhs: ``(M, K)``, or ``(K, M)`` with ``lhs_trans``; or those with leading batch axes.
      rhs: ``(K, N)``, or ``(N, K)`` with ``rhs_trans``: one weight for every batch element of
        lhs (without lhs_trans the rows of all of them are one GEMM); or with lhs's batch axes.
      bias: ``(N,)`` in out_dtype, added to the float32 accumulator (not with DGELU).
      aux: for ``GemmEpilogue.DGELU`` only: the forward's pre-activation h, out's shape, in
        out_dtype.
      lhs_scale_inv, rhs_scale_inv: FP8 only: float32 scalars or ``(1,)`` that multiply the
        accumulator (dequantization); 1 when ``None``.
      lhs_trans, rhs_trans: whether lhs / rhs are stored transposed (FP8: False and True).
      epilogue: a ``GemmEpilogue`` (or its value or name, e.g. ``"gelu_aux"``).
      out_dtype: the operands' dtype (the default) for non-FP8 operands; float32, bfloat16 or
        float16, required, for FP8 operands.
      grad_bias: with DGELU, also return ``dbias (N,)``.
      output_amax: FP8 only: also return ``amax = max|out|`` (float32, ``(1,)``).
      split_accumulator: FP8 only: False lets cuBLASLt accumulate in its faster, less precise
        mode; ignored otherwise and by the pure-JAX path.
      implementation: ``None`` (the kernel where ``te_jax_gemm`` is registered, the CUDA backend;
        the pure-JAX path elsewhere), ``"ffi"`` (the kernel or a ``RuntimeError``) or ``"xla"``.
      k_ndim, n_ndim: how many axes form K and N (``te_jax.primitives.gemm_groups``): lhs
        ``(M, *Kd)``, rhs ``(*Kd, *F)`` (transposed ``(*F, *Kd)``), out ``(M, *F)``, bias ``F``.

    Returns:
      ``GemmResult(out, aux, dbias, amax)``: out ``(B?, M, N)`` in out_dtype; aux (h, out's shape
      and dtype) with GELU_AUX; dbias with grad_bias; amax with output_amax; ``None`` otherwise.

    Raises:
      TypeError: a dtype te_jax's GEMM does not take (see the module docstring).
      ValueError: shapes, layouts or options that do not fit together.
      RuntimeError: ``implementation="ffi"`` on a backend without ``te_jax_gemm``.
    """
    lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
    lhs_trans, rhs_trans = bool(lhs_trans), bool(rhs_trans)
    if k_ndim == 1 and n_ndim == 1:
        batch, m, _, n, fp8 = _check_operands(lhs, rhs, lhs_trans, rhs_trans)
        f = (n,)
    else:
        g = _check_groups(lhs, rhs, lhs_trans, rhs_trans, k_ndim, n_ndim)
        # The dtype, rank and K / N rules on the folded (one-K, one-N) form.
        fl, fr, _ = arrange(g.batch, g.m, (g.k,), (g.n,), lhs_trans, rhs_trans, g.shared_rhs)
        sds = jax.ShapeDtypeStruct
        fl, fr = sds(tuple(fl), lhs.dtype), sds(tuple(fr), rhs.dtype)
        fp8 = _check_operands(fl, fr, lhs_trans, rhs_trans)[-1]
        batch, m, f = g.batch, g.m, g.f
    out_dt = _check_out_dtype(out_dtype, lhs.dtype, fp8)
    epilogue = _check_epilogue(epilogue, bias, aux, grad_bias, output_amax, fp8, lhs.dtype)
    absent = jnp.zeros((0,), out_dt)
    bias = absent if bias is None else _check_epilogue_input("bias", bias, f, out_dt)
    aux = absent if aux is None else _check_epilogue_input("aux", aux, batch + (m,) + f, out_dt)
    lhs_si = _check_scale_inv("lhs_scale_inv", lhs_scale_inv, fp8, lhs.dtype)
    rhs_si = _check_scale_inv("rhs_scale_inv", rhs_scale_inv, fp8, lhs.dtype)
    params = dict(
        lhs_trans=lhs_trans,
        rhs_trans=rhs_trans,
        epilogue=epilogue,
        out_dtype=out_dt,
        grad_bias=bool(grad_bias),
        output_amax=bool(output_amax),
        split_accumulator=bool(split_accumulator),
        k_ndim=int(k_ndim),
        n_ndim=int(n_ndim),
    )
    operands = (lhs, rhs, bias, aux, lhs_si, rhs_si)
    kernel = use_ffi("gemm", implementation, lhs.dtype, target=TARGET, kernel_dtypes=_KERNEL_DTYPES)
    # Without the kernel the primitive still runs where it can, its lowering the pure-JAX product
    # under the kernel's custom_partitioning (the same collectives on every platform); the pure
    # path asked for ("xla") and float64 skip it.
    pure = (implementation or environment_implementation()) == "xla" or lhs.dtype == _F64
    fn = functools.partial(bind, gemm_p) if kernel or not pure else grouped(reference_results)
    outs = iter(fn(*operands, **params))
    out = next(outs)
    return GemmResult(
        out,
        next(outs) if epilogue == GemmEpilogue.GELU_AUX else None,
        next(outs) if params["grad_bias"] else None,
        next(outs) if params["output_amax"] else None,
    )
