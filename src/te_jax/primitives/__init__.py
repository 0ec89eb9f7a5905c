"""JAX primitives wrapping the te_jax FFI targets (one package per op family).

``activation`` holds the unquantized activation primitives (``act_lu``, ``dact_dbias`` and their
JVP / transpose rules, ``autodiff``), ``quantized`` the ops with an FP8 / FP4 output, ``gemm``
the GEMM with its fused epilogues (``te_jax_gemm``, CUDA only; pure JAX elsewhere); each is a
package. ``base`` is the families' shared machinery, ``custom_linear`` the linear-in-its-cotangent
rule helper and ``dbias_policy`` the dbias reduction's group count (both activation families
use it).
"""

from te_jax.primitives.activation import bind_act_lu, bind_dact_dbias
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
