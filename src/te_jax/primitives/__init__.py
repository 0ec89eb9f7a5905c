"""JAX primitives wrapping the te_jax FFI targets (one module per op family).

``act_lu`` and ``dact_dbias`` are the unquantized families, ``quantized`` (a package) the ops
with an FP8 / FP4 output; ``base`` is their shared machinery and ``dbias_policy`` the dbias
reduction's group count, ``autodiff`` the unquantized families' JVP and transpose rules. ``gemm``
(a package) is the GEMM with its fused epilogues (``te_jax_gemm``, CUDA only; pure JAX
elsewhere).
"""

from te_jax.primitives import autodiff  # noqa: F401 -- registers the JVP / transpose rules
from te_jax.primitives.act_lu import bind_act_lu
from te_jax.primitives.dact_dbias import bind_dact_dbias
from te_jax.primitives.gemm import (
    GEMM_WORKSPACE_BYTES,
    GemmConfig,
    GemmEpilogue,
    GemmResult,
    bind_gemm,
)
from te_jax.primitives.quantized import OpKind, QuantConfig, bind_quantized

__all__ = [
    "bind_act_lu",
    "bind_dact_dbias",
    "bind_gemm",
    "bind_quantized",
    "GemmConfig",
    "GemmEpilogue",
    "GemmResult",
    "GEMM_WORKSPACE_BYTES",
    "OpKind",
    "QuantConfig",
]
