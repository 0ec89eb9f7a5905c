"""The GEMM's fused epilogues (``te_jax.primitives.gemm``; its FFI attribute ``epilogue``)."""

from te_jax._enum import NamedIntEnum

__all__ = ["GemmEpilogue"]


class GemmEpilogue(NamedIntEnum):
    """The fused epilogue of ``bind_gemm``; the value is the FFI attribute ``epilogue``."""

    DEFAULT = 0  # out = h
    GELU_AUX = 1  # out = gelu(h), aux = h
    RELU = 2  # out = max(h, 0)
    DGELU = 3  # out = acc * gelu'(aux); with grad_bias, dbias = sum over B, M of out
    GELU = 4  # out = gelu(h), no aux
