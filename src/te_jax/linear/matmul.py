"""``matmul``: one GEMM of two operands, arrays or quantized ``ScaledTensor``s, in the layout the
caller names; the layer every te_jax op with a GEMM calls (``te_jax.gemm``, ``dense``,
``fused_mlp``), between them and the primitive (``te_jax.primitives.gemm``).

Operands are given in their **logical** layout::

    lhs  (*free_l, *K)   or, contracting its leading axes,  (*K, *free_l)
    rhs  (*K, *N)        or, contracting its trailing axes, (*N, *K)
    out  (*free_l, *N)   (lhs contracting its leading axes: free_l is one axis)

It owns what a quantized operand means for the GEMM, which its scaling mode states
(``ScalingModeImpl.gemm_operands``):

* ``"codes"`` (tensor scaling): the FP8 GEMM's "TN" form, lhs ``(M, K)`` and rhs ``(N, K)``. An
  operand contracting its trailing axes gives its rowwise copy, one contracting its leading
  axes its colwise copy (stored transposed: free axes first), so no transpose pass sits in front
  of any FP8 GEMM; the per-tensor ``scale_inv``s multiply the float32 accumulator. Shapes
  cuBLASLt's FP8 GEMM cannot take run the primitive's one float32 fallback.
* ``"dequantized"`` (MXFP8 without an MXFP8 GEMM): the same copies, dequantized exactly in the
  output dtype (an MXFP8 value is an E4M3 / E5M2 number times a power of two), multiplied there.
* ``"block_codes"`` (blockwise FP8): the same copies as ``"codes"``, each viewed as the
  ``[R, C]`` matrix its block scales describe, to the block-scaled FP8 GEMM
  (``GemmScaleMode.BLOCK_1D`` / ``BLOCK_2D``) where those views are the GEMM's operands
  (free axes × contracted axes, unbatched, not two 128×128-scaled operands); else as
  ``"dequantized"``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from te_jax.primitives.gemm import GemmEpilogue, GemmResult, GemmScaleMode, bind_gemm
from te_jax.primitives.gemm.checks import block_scale_shape
from te_jax.quantize.scaled_tensor import ScaledTensor

__all__ = ["matmul"]


def _operand_copy(contracts_leading: bool) -> str:
    """The copy of a quantized operand the GEMM reads: ``"colwise"`` where it contracts its
    leading axes (the colwise copy stores them last), ``"rowwise"`` where its trailing."""
    return "colwise" if contracts_leading else "rowwise"


def matmul(
    lhs,
    rhs,
    *,
    k_ndim: int = 1,
    lhs_shape: Sequence[int] | None = None,
    rhs_shape: Sequence[int] | None = None,
    lhs_contracts_leading: bool = False,
    rhs_contracts_trailing: bool = False,
    bias: jax.Array | None = None,
    aux: jax.Array | None = None,
    addend: jax.Array | None = None,
    epilogue: GemmEpilogue = GemmEpilogue.DEFAULT,
    grad_bias: bool = False,
    out_dtype=None,
    split_accumulator: bool = True,
    implementation: str | None = None,
) -> GemmResult:
    """``epilogue(lhs · rhs + addend + bias)`` over ``k_ndim`` contracted axes (module
    docstring).

    Args:
      lhs, rhs: arrays of one dtype, or two ``ScaledTensor``s of one scaling mode holding the
        copies this product reads (``_operand_copy``).
      k_ndim: how many axes are contracted.
      lhs_shape, rhs_shape: the logical shapes to view the operands as (reshapes of their own
        shapes; default: their shapes).
      lhs_contracts_leading, rhs_contracts_trailing: the layout (module docstring).
      bias, aux, addend, epilogue, grad_bias: as ``te_jax.primitives.gemm.bind_gemm``'s
        (addend in out's logical shape ``(*free_l, *N)``).
      out_dtype: the output dtype; default: the array operands' dtype, the quantized operands'
        ``dq_dtype``.
      split_accumulator: FP8 codes only: cuBLASLt's float32 promotion of the partial sums
        (``te_jax.recipe.MMParams``); ignored otherwise.
      implementation: ``None``, ``"ffi"`` or ``"xla"``.

    Returns:
      ``GemmResult``: out ``(*free_l, *N)``, and aux / dbias where asked for.
    """
    quantized = isinstance(lhs, ScaledTensor)
    if quantized != isinstance(rhs, ScaledTensor):
        raise TypeError(
            "te_jax.gemm: lhs and rhs must both be arrays or both be ScaledTensors (quantize the "
            f"other one, or pass a quantizer_set), got {type(lhs).__name__} and "
            f"{type(rhs).__name__}"
        )
    lhs_shape = tuple(lhs.shape if lhs_shape is None else lhs_shape)
    rhs_shape = tuple(rhs.shape if rhs_shape is None else rhs_shape)
    n_ndim = len(rhs_shape) - k_ndim
    opts = dict(
        bias=bias,
        aux=aux,
        addend=addend,
        epilogue=epilogue,
        grad_bias=grad_bias,
        implementation=implementation,
        k_ndim=k_ndim,
        n_ndim=n_ndim,
    )
    copies = _operand_copy(lhs_contracts_leading), _operand_copy(not rhs_contracts_trailing)
    route = lhs.scaling_mode.impl.gemm_operands if quantized else None
    if route in ("codes", "block_codes"):
        # The TN form: each copy holds its free axes first, then the contracted ones.
        lhs_tn = _free_first(lhs_shape, k_ndim, lhs_contracts_leading)
        rhs_tn = _free_first(rhs_shape, k_ndim, not rhs_contracts_trailing)
        tn = (lhs_tn, rhs_tn)
        out_dtype = lhs.dq_dtype if out_dtype is None else out_dtype
        codes = dict(rhs_trans=True, out_dtype=out_dtype, split_accumulator=split_accumulator)
    if route == "codes":
        (l_data, l_sinv), (r_data, r_sinv) = (
            _codes(t, copy, shape) for t, copy, shape in zip((lhs, rhs), copies, tn, strict=True)
        )
        return bind_gemm(
            l_data, r_data, lhs_scale_inv=l_sinv, rhs_scale_inv=r_sinv, **codes, **opts
        )
    if route == "block_codes":
        blocks = [
            _block_codes(t, copy, shape, k_ndim)
            for t, copy, shape in zip((lhs, rhs), copies, tn, strict=True)
        ]
        modes = tuple(b[2] for b in blocks if b is not None)
        if len(modes) == 2 and modes != (GemmScaleMode.BLOCK_2D,) * 2:
            (l_data, l_sinv, _), (r_data, r_sinv, _) = blocks
            # One K axis, one N axis: the copies' [R, C] matrices; the output takes its axes back.
            n_shape = rhs_tn[: len(rhs_tn) - k_ndim]
            flat = dict(opts, k_ndim=1, n_ndim=1)
            if bias is not None:
                flat["bias"] = bias.reshape(-1)
            for name in ("aux", "addend"):
                if opts[name] is not None:
                    flat[name] = opts[name].reshape(l_data.shape[0], r_data.shape[0])
            r = bind_gemm(
                l_data,
                r_data,
                lhs_scale_inv=l_sinv,
                rhs_scale_inv=r_sinv,
                lhs_scale_mode=modes[0],
                rhs_scale_mode=modes[1],
                **codes,
                **flat,
            )
            out_shape = lhs_tn[: len(lhs_tn) - k_ndim] + n_shape
            return GemmResult(
                r.out.reshape(out_shape),
                None if r.aux is None else r.aux.reshape(out_shape),
                None if r.dbias is None else r.dbias.reshape(n_shape),
            )
    if quantized:  # "dequantized": each copy exactly in the output dtype, in its logical layout
        out_dtype = lhs.dq_dtype if out_dtype is None else out_dtype
        lhs = lhs.dequantize(copies[0], out_dtype)
        rhs = rhs.dequantize(copies[1], out_dtype)
    return bind_gemm(
        jnp.reshape(lhs, lhs_shape),
        jnp.reshape(rhs, rhs_shape),
        lhs_trans=lhs_contracts_leading,
        rhs_trans=rhs_contracts_trailing,
        out_dtype=out_dtype,
        **opts,
    )


def _free_first(shape: tuple, k_ndim: int, contracts_leading: bool) -> tuple:
    """A logical shape with its free axes first, then its ``k_ndim`` contracted ones."""
    return shape[k_ndim:] + shape[:k_ndim] if contracts_leading else shape


def _codes(st: ScaledTensor, copy: str, shape: tuple):
    """A tensor-scaled operand's ``copy`` in ``shape`` and its ``scale_inv`` ``(1,)``."""
    data = st.data if copy == "rowwise" else st.colwise_data
    sinv = st.scale_inv if copy == "rowwise" else st.colwise_scale_inv
    if data is None:
        raise ValueError(
            f"te_jax.gemm: this product reads the operand's {copy} copy, which the ScaledTensor "
            f"({st.q_layout.name}) does not have: quantize it with a q_layout that has it"
        )
    return data.reshape(shape), jnp.asarray(sinv, jnp.float32).reshape(1)


def _block_codes(st: ScaledTensor, copy: str, shape: tuple, k_ndim: int):
    """A blockwise operand's ``copy`` as the GEMM's ``(rows, K)`` matrix (``shape``: its free
    axes, then its ``k_ndim`` contracted ones), its block scales and ``GemmScaleMode``; ``None``
    where the copy's blocks are not the GEMM operand's (another grouping of the axes, a batch)."""
    data = st.data if copy == "rowwise" else st.colwise_data
    sinv = st.scale_inv if copy == "rowwise" else st.colwise_scale_inv
    if data is None or sinv is None or sinv.ndim != 2:
        return None
    mode = GemmScaleMode(st.scaling_mode.impl.block_dims)
    rows = math.prod(shape[: len(shape) - k_ndim])
    k = math.prod(shape[len(shape) - k_ndim :])
    # The copy's blocked columns C: the features (rowwise) or the leading axes (colwise, stored
    # features first); its blocks are the GEMM's where C is the GEMM's K.
    nf = st.n_feature_axes
    cols = math.prod(data.shape[-nf:] if copy == "rowwise" else data.shape[nf:])
    if cols != k or tuple(sinv.shape) != block_scale_shape(mode, rows, k):
        return None
    return data.reshape(rows, k), sinv, mode
