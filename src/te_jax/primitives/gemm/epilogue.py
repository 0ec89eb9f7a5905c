"""The GEMM's fused epilogues and its operands' scale modes (``te_jax.primitives.gemm``; the FFI
attributes ``epilogue``, ``lhs_scale_mode`` and ``rhs_scale_mode``)."""

from te_jax._enum import NamedIntEnum

__all__ = ["GemmEpilogue", "GemmScaleMode"]


class GemmEpilogue(NamedIntEnum):
    """The fused epilogue of ``bind_gemm``; the value is the FFI attribute ``epilogue``."""

    DEFAULT = 0  # out = h
    GELU_AUX = 1  # out = gelu(h), aux = h
    RELU = 2  # out = max(h, 0)
    DGELU = 3  # out = acc * gelu'(aux); with grad_bias, dbias = sum over B, M of out
    GELU = 4  # out = gelu(h), no aux


class GemmScaleMode(NamedIntEnum):
    """How an FP8 operand's ``scale_inv`` applies; the value is the FFI attribute
    ``lhs_scale_mode`` / ``rhs_scale_mode`` (ffi/gemm/problem.h: the block layouts)."""

    TENSOR = 0  # one float32 per tensor, (1,)
    BLOCK_1D = 1  # one per 1x128 block along K: (ceil(K/128), round_up(rows, 4))
    BLOCK_2D = 2  # one per 128x128 tile: (ceil(rows/128), round_up(ceil(K/128), 4))
