"""The GEMM primitive ``gemm_p``: one matrix product with a fused epilogue (FFI target
``te_jax_gemm``, cuBLASLt, bound in ffi/gemm/targets.h).

Row-major math, what JAX sees (``B`` is an optional batch of independent GEMMs)::

    L   = lhs  (B?, M, K),  or with lhs_trans the transpose of lhs stored (B?, K, M)
    R   = rhs  (B?, K, N),  or with rhs_trans the transpose of rhs stored (B?, N, K)
    acc = float32(L @ R) · lhs_scale_inv · rhs_scale_inv      (float32 accumulation)
    h   = (acc + addend) + bias        (addend (B?, M, N), out's; bias (N,), broadcast over B, M)
    out = epilogue(h), rounded once to out_dtype              (B?, M, N)

The addend (cuBLASLt's ``C``, ``beta = 1``: e.g. a residual added in the GEMM's own pass) is
taken with the ``DEFAULT`` epilogue only; absent, it is 0.

The epilogue (``GemmEpilogue``) runs on the float32 ``h``; gelu is the tanh form of
``te_jax.activation_reference`` (the same math as the activation ops):

* ``DEFAULT``:  ``out = h``.
* ``GELU_AUX``: ``out = gelu(h)``, and ``aux = h`` rounded to out_dtype (the backward's input).
* ``RELU``:     ``out = max(h, 0)``.
* ``DGELU``:    ``out = acc · gelu'(aux)`` for the given ``aux`` (the forward's ``h``, shape of
  out, in out_dtype); no bias. With ``grad_bias`` also ``dbias (N,)``, the float32 sum of the
  unrounded out over B and M, rounded to out_dtype.
* ``GELU``:     ``out = gelu(h)``, no aux (the inference forward).

Dtypes: lhs and rhs are both float32, both bfloat16 or both float16 (out_dtype is theirs), or FP8:
float8_e4m3fn × float8_e4m3fn, e4m3 × float8_e5m2 or e5m2 × e4m3 (not e5m2 × e5m2), with an
out_dtype of float32, bfloat16 or float16, ``lhs_trans=False`` and ``rhs_trans=True``. FP8
operands are dequantized by the float32 scale_invs (``(1,)`` or scalars). An FP8 GEMM whose K or N
cuBLASLt cannot take (not a multiple of 16) runs on the operands widened exactly to float32
(``kernel.py``: the one fallback). float64 operands take the pure-JAX path in float64.

The primitive's only parameter is a ``GemmConfig`` (``config.py``). Paths (``te_jax.dispatch``):
``gemm_p`` lowers to the kernel (``kernel.py``) on the platforms where ``te_jax_gemm`` is
registered (CUDA: there is no CPU handler) and to ``reference_results.py`` (pure JAX)
everywhere else, both under the same ``custom_partitioning`` (``sharding.py``);
``implementation="xla"`` (and float64) calls the pure-JAX results without the primitive.

vmap: a batched lhs with an unbatched rank-2 rhs (a shared weight) folds the vmapped axes into M,
one GEMM (with ``lhs_trans`` they cannot fold, and the rhs is repeated for a strided-batched
GEMM); any other batched lhs / rhs is the strided-batched form, the unbatched operand repeated. A
batched bias or scale_inv, ``grad_bias`` (one dbias per batch element) or an aux batched alone
run the GEMM without epilogue into float32 (16-bit operands widened exactly to float32 first, so
the accumulation is the same) and apply the scales and the epilogue in JAX: exact, and one GEMM.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import ShapedArray
from jax.interpreters import batching

from te_jax import _ffi
from te_jax._varying import bind
from te_jax.dispatch import Path, decide, deterministic_gemm
from te_jax.primitives import base
from te_jax.primitives.gemm import checks
from te_jax.primitives.gemm.config import GemmConfig, GemmResult
from te_jax.primitives.gemm.epilogue import GemmEpilogue, GemmScaleMode
from te_jax.primitives.gemm.groups import arrange, grouped, groups
from te_jax.primitives.gemm.kernel import TARGET, kernel_results
from te_jax.primitives.gemm.reference_results import F32, epilogue, reference_results
from te_jax.primitives.gemm.sharding import make_partitioned_gemm
from te_jax.quantize import formats

__all__ = ["gemm_p", "bind_gemm"]

_HALF = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16))

gemm_p = base.make_primitive("te_jax_gemm")


@gemm_p.def_abstract_eval
def _abstract(lhs, rhs, bias, aux, lhs_scale_inv, rhs_scale_inv, addend, *, config: GemmConfig):
    c = config
    g = groups(lhs.shape, rhs.shape, c.lhs_trans, c.rhs_trans, c.k_ndim, c.n_ndim)
    out = ShapedArray(g.batch + (g.m,) + g.f, c.out_dtype)
    return c.results(out, ShapedArray(g.f, c.out_dtype))


def _local(kernel_or_reference):
    """A lowering's local computation, with the primitive's keyword parameter."""
    fn = grouped(kernel_or_reference)
    return lambda *operands, config: fn(*operands, config)


def _partitioned(local):
    """``local`` under the GEMM's ``custom_partitioning`` (``sharding.py``)."""
    part = make_partitioned_gemm(grouped(local))
    return lambda *operands, config: part(*operands, config=config)


# The kernel lowering goes to the platforms where te_jax_gemm is registered (CUDA, when the CUDA
# extension has it); elsewhere the pure-JAX results, under the same custom_partitioning.
base.register_outer_rules(
    gemm_p,
    local=_local(kernel_results),
    partitioned=_partitioned(kernel_results),
    reference=_local(reference_results),
    platforms=_ffi.target_platforms(TARGET),
    partitioned_reference=_partitioned(reference_results),
)


# ---- vmap -----------------------------------------------------------------------------------
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


def _batch(args, dims, *, config: GemmConfig):
    if config.block_scaled:
        # Block-scaled GEMMs are unbatched: each example's product of its dequantized blocks.
        outs = jax.vmap(lambda *a: reference_results(*a, config), in_axes=tuple(dims))(*args)
        return list(outs), [0] * len(outs)
    if not config.is_flat:
        # Groups fold per example (a reshape vmap batches), then the one-K, one-N rule.
        def one(*operands):
            return grouped(_bind)(*operands, config)

        outs = jax.vmap(one, in_axes=tuple(dims))(*args)
        return list(outs), [0] * len(outs)
    lhs, rhs, bias, aux, lhs_si, rhs_si, addend = args
    ld, rd, bd, ad, lsd, rsd, cd = dims
    size = next(a.shape[d] for a, d in zip(args, dims, strict=True) if d is not None)
    operands_batched = ld is not None or rd is not None
    if (
        bd is not None
        or lsd is not None
        or rsd is not None
        or config.grad_bias
        or (ad is not None and not operands_batched)
        or (cd is not None and not operands_batched)
    ):
        return _batch_epilogue_outside(args, dims, size, config)
    lhs, rhs = _batch_operands(lhs, ld, rhs, rd, size)
    if config.reads_aux:
        aux = batching.bdim_at_front(aux, ad, size)
    if config.addend:
        addend = batching.bdim_at_front(addend, cd, size)
    outs = list(bind(gemm_p, lhs, rhs, bias, aux, lhs_si, rhs_si, addend, config=config))
    return outs, [0] * len(outs)


def _bind(*operands):
    """``gemm_p`` on operands and a config given positionally (``grouped``'s convention)."""
    *operands, config = operands
    return bind(gemm_p, *operands, config=config)


def _batch_epilogue_outside(args, dims, size, config: GemmConfig):
    """A batched bias / scale_inv, a per-batch dbias or an aux or addend batched alone: the GEMM
    writes the unscaled float32 accumulator (16-bit operands widened exactly: the same products
    and float32 sums), and the scales and the epilogue run in JAX, vmapped, as in the
    reference."""
    lhs, rhs, bias, aux, lhs_si, rhs_si, addend = args
    ld, rd, bd, ad, lsd, rsd, cd = dims
    acc_dim = None
    if ld is not None or rd is not None:
        lhs, rhs = _batch_operands(lhs, ld, rhs, rd, size)
        acc_dim = 0
    if np.dtype(lhs.dtype) in _HALF:  # the kernel writes float32 only from float32 operands
        lhs, rhs = formats.to_float32(lhs), formats.to_float32(rhs)
    one, absent = jnp.ones((1,), F32), jnp.zeros((0,), F32)
    plain = config.replace(
        epilogue=GemmEpilogue.DEFAULT,
        out_dtype=F32,
        grad_bias=False,
        k_ndim=1,
        n_ndim=1,
        addend=False,
    )
    (acc,) = bind(gemm_p, lhs, rhs, absent, absent, one, one, absent, config=plain)

    def finish(acc, bias, aux, lhs_si, rhs_si, addend):
        return epilogue(acc, bias, aux, lhs_si, rhs_si, addend, config)

    in_axes = (acc_dim, bd, ad, lsd, rsd, cd)
    outs = jax.vmap(finish, in_axes=in_axes, axis_size=size)(
        acc, bias, aux, lhs_si, rhs_si, addend
    )
    return list(outs), [0] * len(outs)


batching.primitive_batchers[gemm_p] = _batch


# ---- the entry point: checks, then the primitive or the pure-JAX path ---------------------------


def bind_gemm(
    lhs: jax.Array,
    rhs: jax.Array,
    bias: jax.Array | None = None,
    aux: jax.Array | None = None,
    lhs_scale_inv: jax.Array | None = None,
    rhs_scale_inv: jax.Array | None = None,
    addend: jax.Array | None = None,
    *,
    lhs_trans: bool = False,
    rhs_trans: bool = False,
    epilogue: GemmEpilogue = GemmEpilogue.DEFAULT,
    out_dtype=None,
    grad_bias: bool = False,
    split_accumulator: bool = True,
    implementation: str | None = None,
    k_ndim: int = 1,
    n_ndim: int = 1,
    lhs_scale_mode: GemmScaleMode = GemmScaleMode.TENSOR,
    rhs_scale_mode: GemmScaleMode = GemmScaleMode.TENSOR,
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
        accumulator (dequantization); 1 when ``None``. Or an operand's block scales, as its
        scale mode lays them out.
      addend: out's shape, in out_dtype, added to the scaled product before the bias (one
        rounding for the sum); ``DEFAULT`` epilogue only.
      lhs_trans, rhs_trans: whether lhs / rhs are stored transposed (FP8: False and True).
      epilogue: a ``GemmEpilogue`` (or its value or name, e.g. ``"gelu_aux"``).
      out_dtype: the operands' dtype (the default) for non-FP8 operands; float32, bfloat16 or
        float16, required, for FP8 operands.
      grad_bias: with DGELU, also return ``dbias (N,)``.
      split_accumulator: FP8 only: False lets cuBLASLt accumulate in its faster, less precise
        mode; ignored otherwise and by the pure-JAX path.
      implementation: ``None`` (the kernel where ``te_jax_gemm`` is registered, the CUDA backend;
        the pure-JAX path elsewhere), ``"ffi"`` (the kernel or a ``RuntimeError``) or ``"xla"``.
      k_ndim, n_ndim: how many axes form K and N (``groups.py``): lhs ``(M, *Kd)``, rhs
        ``(*Kd, *F)`` (transposed ``(*F, *Kd)``), out ``(M, *F)``, bias ``F``.
      lhs_scale_mode, rhs_scale_mode: ``GemmScaleMode``: ``TENSOR``, or FP8 operands scaled
        in 1x128 (``BLOCK_1D``) or 128x128 (``BLOCK_2D``) blocks, unbatched, in the TN form,
        one K axis, with their scales in cuBLASLt's layouts (ffi/gemm/problem.h).

    Returns:
      ``GemmResult(out, aux, dbias)``: out ``(B?, M, *F)`` in out_dtype; aux (h, out's shape and
      dtype) with GELU_AUX; dbias with grad_bias; ``None`` otherwise.

    Raises:
      TypeError: a dtype te_jax's GEMM does not take (see the module docstring).
      ValueError: shapes, layouts or options that do not fit together.
      RuntimeError: ``implementation="ffi"`` on a backend without ``te_jax_gemm``.
    """
    lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
    lhs_trans, rhs_trans = bool(lhs_trans), bool(rhs_trans)
    if k_ndim == 1 and n_ndim == 1:
        batch, m, _, n, fp8 = checks.check_operands(lhs, rhs, lhs_trans, rhs_trans)
        f = (n,)
    else:
        g = checks.check_groups(lhs, rhs, lhs_trans, rhs_trans, k_ndim, n_ndim)
        # The dtype, rank and K / N rules on the folded (one-K, one-N) form.
        fl, fr, _ = arrange(g.batch, g.m, (g.k,), (g.n,), lhs_trans, rhs_trans, g.shared_rhs)
        sds = jax.ShapeDtypeStruct
        fl, fr = sds(tuple(fl), lhs.dtype), sds(tuple(fr), rhs.dtype)
        fp8 = checks.check_operands(fl, fr, lhs_trans, rhs_trans)[-1]
        batch, m, f = g.batch, g.m, g.f
    out_dt = checks.check_out_dtype(out_dtype, lhs.dtype, fp8)
    epilogue = checks.check_epilogue(epilogue, bias, aux, grad_bias)
    checks.check_addend_epilogue(addend, epilogue)
    absent = jnp.zeros((0,), out_dt)
    bias = absent if bias is None else checks.check_epilogue_input("bias", bias, f, out_dt)
    if aux is None:
        aux = absent
    else:
        aux = checks.check_epilogue_input("aux", aux, batch + (m,) + f, out_dt)
    if addend is None:
        addend = absent
    else:
        addend = checks.check_epilogue_input("addend", addend, batch + (m,) + f, out_dt)
    modes = GemmScaleMode(lhs_scale_mode), GemmScaleMode(rhs_scale_mode)
    checks.check_block_operands(modes, fp8, batch, lhs_trans, rhs_trans, k_ndim)
    lhs_si, rhs_si = (
        checks.check_scale_inv(what, si, fp8, lhs.dtype, mode, shape)
        for what, si, mode, shape in zip(
            ("lhs_scale_inv", "rhs_scale_inv"),
            (lhs_scale_inv, rhs_scale_inv),
            modes,
            (lhs.shape, rhs.shape),
            strict=True,
        )
    )
    config = GemmConfig(
        lhs_trans=lhs_trans,
        rhs_trans=rhs_trans,
        epilogue=epilogue,
        out_dtype=out_dt,
        grad_bias=bool(grad_bias),
        split_accumulator=bool(split_accumulator),
        deterministic=deterministic_gemm(),
        k_ndim=int(k_ndim),
        n_ndim=int(n_ndim),
        addend=addend.ndim > 1,
        lhs_scale_mode=modes[0],
        rhs_scale_mode=modes[1],
    )
    path = decide(
        "gemm", implementation, lhs.dtype, target=TARGET, kernel_dtypes=checks.KERNEL_DTYPES
    )
    operands = (lhs, rhs, bias, aux, lhs_si, rhs_si, addend)
    if path is Path.XLA:
        return config.unpack(grouped(reference_results)(*operands, config))
    return config.unpack(_bind(*operands, config))
