"""The GEMM family: ``gemm_p`` (FFI target ``te_jax_gemm``, cuBLASLt on CUDA; pure JAX elsewhere).

Modules: ``config`` (``GemmConfig``, the primitive's one static parameter, and the FFI attributes
derived from it), ``epilogue`` (``GemmEpilogue``, ``GemmScaleMode``), ``groups`` (K and N as
groups of axes), ``checks`` (trace-time checks), ``reference`` (the pure-JAX lowering),
``kernel`` (the kernel lowering and its one float32 fallback), ``sharding`` (Shardy rule and
partition), ``primitive`` (abstract evaluation, vmap, ``bind_gemm``), ``autodiff`` (the JVP).
"""

from te_jax.primitives.gemm import autodiff  # noqa: F401 -- registers the JVP
from te_jax.primitives.gemm.config import GemmConfig, GemmResult
from te_jax.primitives.gemm.epilogue import GemmEpilogue, GemmScaleMode
from te_jax.primitives.gemm.kernel import FP8_ALIGNMENT, GEMM_WORKSPACE_BYTES, TARGET
from te_jax.primitives.gemm.primitive import bind_gemm, gemm_p
from te_jax.primitives.gemm.reference_results import reference_results

__all__ = [
    "FP8_ALIGNMENT",
    "GEMM_WORKSPACE_BYTES",
    "TARGET",
    "GemmConfig",
    "GemmEpilogue",
    "GemmResult",
    "GemmScaleMode",
    "bind_gemm",
    "gemm_p",
    "reference_results",
]
