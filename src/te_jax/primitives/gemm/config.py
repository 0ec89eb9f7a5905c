"""``GemmConfig``: everything static about one GEMM, the primitive's only parameter.

The primitive ``gemm_p`` (``primitive.py``), its sharding rule (``sharding.py``), its pure-JAX
lowering (``reference_results.py``), its kernel lowering (``kernel.py``) and its JVP
(``autodiff.py``) all read this one description; the FFI attributes of ``te_jax_gemm`` are
derived from it in ``ffi_attributes`` and nowhere else.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import NamedTuple

import jax
import numpy as np

from te_jax.primitives.gemm.epilogue import GemmEpilogue, GemmScaleMode

__all__ = ["GemmConfig", "GemmResult"]


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    """The static settings of one GEMM (hashable: a jit cache key and a primitive parameter).

    Attributes:
      lhs_trans: lhs is stored transposed, ``(B?, *K, M)`` instead of ``(B?, M, *K)``.
      rhs_trans: rhs is stored transposed, ``(B?, *N, *K)`` instead of ``(B?, *K, *N)``.
      epilogue: the ``GemmEpilogue`` applied to the float32 ``h``.
      out_dtype: the output's dtype (the operands' for 16/32-bit operands).
      grad_bias: with ``DGELU``, also return ``dbias``, the sum of out over every row.
      split_accumulator: FP8 only: False lets cuBLASLt accumulate in its faster, less precise
        mode; ignored otherwise and by the pure-JAX path.
      deterministic: the kernel takes cuBLASLt's first heuristic algorithm, untimed, and only
        reductions that are bitwise reproducible (``te_jax.dispatch.deterministic_gemm``).
      k_ndim, n_ndim: how many axes form the contraction K and the output's columns N
        (``groups.py``).
      addend: an addend of out's shape is added to the scaled product before the bias
        (cuBLASLt's ``C`` with ``beta = 1``; the ``DEFAULT`` epilogue only).
      lhs_scale_mode, rhs_scale_mode: how each FP8 operand's ``scale_inv`` applies
        (``GemmScaleMode``: per tensor, or cuBLASLt's 1x128 / 128x128 block layouts).
    """

    lhs_trans: bool = False
    rhs_trans: bool = False
    epilogue: GemmEpilogue = GemmEpilogue.DEFAULT
    out_dtype: np.dtype = np.dtype(np.float32)
    grad_bias: bool = False
    split_accumulator: bool = True
    deterministic: bool = False
    k_ndim: int = 1
    n_ndim: int = 1
    addend: bool = False
    lhs_scale_mode: GemmScaleMode = GemmScaleMode.TENSOR
    rhs_scale_mode: GemmScaleMode = GemmScaleMode.TENSOR

    def replace(self, **changes) -> GemmConfig:
        return dataclasses.replace(self, **changes)

    @property
    def flat(self) -> GemmConfig:
        """This GEMM on its folded operands: one K axis, one N axis."""
        return self.replace(k_ndim=1, n_ndim=1)

    @property
    def is_flat(self) -> bool:
        return self.k_ndim == 1 and self.n_ndim == 1

    @property
    def block_scaled(self) -> bool:
        """An operand is scaled in blocks (``GemmScaleMode.BLOCK_1D`` / ``BLOCK_2D``)."""
        tensor = GemmScaleMode.TENSOR
        return self.lhs_scale_mode != tensor or self.rhs_scale_mode != tensor

    @property
    def gelu_after_gemm(self) -> bool:
        """A GELU epilogue (GELU, GELU_AUX, DGELU; no addend) of block-scaled operands, which
        cuBLASLt's block-scaled GEMM does not run: the GEMM's output is rounded to the output
        dtype and the GELU applied to that (te_jax's activation kernels; two roundings), on the
        kernel and the pure-JAX path alike (docs/numerics.md §8)."""
        gelus = (GemmEpilogue.GELU, GemmEpilogue.GELU_AUX, GemmEpilogue.DGELU)
        return self.block_scaled and self.epilogue in gelus and not self.addend

    @property
    def writes_aux(self) -> bool:
        """``GELU_AUX`` also returns h, the pre-activation, beside ``out``."""
        return self.epilogue == GemmEpilogue.GELU_AUX

    @property
    def reads_aux(self) -> bool:
        """``DGELU`` reads the forward's h (``aux``, out's shape)."""
        return self.epilogue == GemmEpilogue.DGELU

    @property
    def is_linear(self) -> bool:
        """out is linear in the product (a split contraction may be summed afterwards)."""
        return self.epilogue == GemmEpilogue.DEFAULT and not self.grad_bias

    def results(self, out, f) -> list:
        """The primitive's results in order: ``out``, ``aux`` (``GELU_AUX``), ``dbias``
        (``grad_bias``); ``out`` is whatever describes the output (a shape, an aval, a spec),
        ``f`` what describes the feature axes."""
        return [out] + ([out] if self.writes_aux else []) + ([f] if self.grad_bias else [])

    def unpack(self, outs: Iterable) -> GemmResult:
        """``GemmResult`` from the primitive's results (``None`` for what was not asked for)."""
        it = iter(outs)
        out = next(it)
        aux = next(it) if self.writes_aux else None
        dbias = next(it) if self.grad_bias else None
        return GemmResult(out, aux, dbias)

    def ffi_attributes(self) -> dict:
        """The ``te_jax_gemm`` attributes (ffi/gemm/targets.h)."""
        return dict(
            lhs_trans=np.bool_(self.lhs_trans),
            rhs_trans=np.bool_(self.rhs_trans),
            epilogue=np.int64(self.epilogue),
            grad_bias=np.bool_(self.grad_bias),
            split_accumulator=np.bool_(self.split_accumulator),
            deterministic=np.bool_(self.deterministic),
            lhs_scale_mode=np.int64(self.lhs_scale_mode),
            rhs_scale_mode=np.int64(self.rhs_scale_mode),
        )


class GemmResult(NamedTuple):
    """What a GEMM returns; ``None`` for what was not asked for."""

    out: jax.Array
    aux: jax.Array | None = None  # GELU_AUX: h, the pre-activation
    dbias: jax.Array | None = None  # grad_bias: the bias gradient, F-shaped
