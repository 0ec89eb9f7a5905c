"""te_jax: fused transformer-MLP activation kernels for JAX, on CPU and NVIDIA GPUs.

Forward (``act_lu``), backward (``dact_lu``), backward + bias gradient (``quantize_dact_dbias``)
and the differentiable ``activation`` for GELU, GeGLU, GLU, SiLU, SwiGLU, ReLU, ReGLU, QuickGELU,
QGeGLU, squared ReLU, SReGLU, clamped SwiGLU and exact GELU/GeGLU, as XLA FFI kernels wrapped in
JAX primitives (jit, vmap, grad, sharding). ``te_jax.activation_reference`` holds the pure-JAX
forms.
With a quantizer from ``te_jax.quantize`` the outputs are FP8 / MXFP8 / NVFP4 ``ScaledTensor``s
quantized in the same kernels; ``te_jax.quantize.quantize(x, quantizer)`` quantizes on its own.
"""

from te_jax import activation_reference, quantize, recipe, sharding
from te_jax._ffi import ffi_available
from te_jax.activation_ops import act_lu, activation, dact_lu, quantize_dact_dbias
from te_jax.activation_types import ActivationParams, ActivationType, ClampedSwiGLUParams
from te_jax.dispatch import kernels_enabled
from te_jax.linear.dense import dense
from te_jax.linear.dot_general import dot_general
from te_jax.linear.fused_mlp import fused_mlp
from te_jax.linear.gemm import gemm
from te_jax.linear.kernel_cache import quantize_kernel
from te_jax.linear.normed import layernorm_dense, layernorm_mlp
from te_jax.recipe import QuantizerSet, autocast

__version__ = "0.1.0"

__all__ = [
    "act_lu",
    "dact_lu",
    "quantize_dact_dbias",
    "activation",
    "gemm",
    "dense",
    "dot_general",
    "fused_mlp",
    "quantize_kernel",
    "layernorm_dense",
    "layernorm_mlp",
    "recipe",
    "QuantizerSet",
    "autocast",
    "ActivationType",
    "ActivationParams",
    "ClampedSwiGLUParams",
    "ffi_available",
    "kernels_enabled",
    "activation_reference",
    "quantize",
    "sharding",
]
