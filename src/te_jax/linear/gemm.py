"""``te_jax.gemm``: one GEMM with its fused bias and epilogue, as a differentiable op.

``out = epilogue(lhs · rhs + bias)``, contracting lhs's trailing axes with rhs's leading axes:
``lhs (*M, *K)``, ``rhs (*K, *N)``, ``bias N``, ``out (*M, *N)``. It is te_jax's GEMM layer
(``te_jax.linear.matmul``: arrays or quantized ``ScaledTensor`` operands, the FP8 "TN" operand
rule, the one float32 fallback of the primitive) with the differentiation ``dense`` has, which
is the same op with any activation: both run ``te_jax.linear.core``.

* ``epilogue``: ``None``, ``"gelu"`` (tanh GELU) or ``"relu"``: on te_jax's CUDA GEMM applied
  in its epilogue to the float32 ``h``; elsewhere by ``act_lu`` on ``h`` rounded to the compute
  dtype (docs/numerics.md §8).
* ``quantizer_set`` (``QuantizerSet.create(recipe)``): lhs and rhs are quantized by te_jax's
  kernels, the gradient by the set's grad quantizer; under delayed scaling the set's
  cotangent is its next state, as for ``dense``.
* A ``ScaledTensor`` lhs (already quantized for this GEMM) is used as it is; the
  ``quantizer_set`` supplies rhs's and the gradient's quantizers.

Sharding: the GEMM primitive's rules (``te_jax.primitives.gemm.sharding``): rows split (data
parallel), N split (column parallel), K split (row parallel: partial sums reduced), the weight
gathered where FSDP splits it, never the activation.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax

from te_jax.activation_types import ActivationType
from te_jax.linear import dense
from te_jax.recipe import QuantizerSet

__all__ = ["gemm", "EPILOGUES"]

# The activations the GEMM's epilogue applies, by the name ``gemm`` takes.
EPILOGUES = {None: None, "gelu": ActivationType.GELU, "relu": ActivationType.RELU}


def gemm(
    lhs,
    rhs: jax.Array,
    bias: jax.Array | None = None,
    *,
    contracting_dims: tuple[Sequence[int], Sequence[int]] = ((-1,), (0,)),
    epilogue: str | None = None,
    quantizer_set: QuantizerSet | None = None,
    implementation: str | None = None,
):
    """``out = epilogue(lhs · rhs + bias)``: float32 accumulation, one rounding (module docstring).

    Args:
      lhs: ``(*M, *K)`` float32 / bfloat16 / float16 (the compute dtype), or a ``ScaledTensor``
        quantized for this GEMM (its rowwise copy; with the colwise one where differentiated).
      rhs: ``(*K, *N)``; cast to lhs's dtype, or under a recipe quantized from its own.
      bias: ``None`` or ``N``-shaped; cast to lhs's dtype.
      contracting_dims: ``(lhs_axes, rhs_axes)``: lhs's trailing axes and rhs's leading axes,
        in order (the default: the last of lhs, the first of rhs).
      epilogue: ``None``, ``"gelu"`` or ``"relu"``.
      quantizer_set: ``None`` or ``te_jax.QuantizerSet.create(recipe)`` (FP8).
      implementation: ``None`` (te_jax's kernels where there are some), ``"ffi"`` or ``"xla"``.

    Returns:
      ``out (*M, *N)`` in lhs's (compute) dtype. ``jax.grad`` gives lhs's, rhs's and bias's
      gradients (and the quantizer set's next state); without a recipe ``jax.jvp`` works too.

    Example:
      >>> import jax.numpy as jnp, te_jax
      >>> a, b = jnp.ones((8, 32), jnp.bfloat16), jnp.ones((32, 16), jnp.bfloat16)
      >>> out = te_jax.gemm(a, b, jnp.zeros((16,), jnp.bfloat16), epilogue="relu")
      >>> out.shape, float(out[0, 0])
      ((8, 16), 32.0)
    """
    name = epilogue.lower() if isinstance(epilogue, str) else epilogue
    if not (name is None or isinstance(name, str)) or name not in EPILOGUES:
        raise ValueError(
            f"te_jax.gemm: epilogue must be None, 'gelu' or 'relu', got {epilogue!r} (other "
            "activations: te_jax.dense(x, kernel, bias, activation_type=...))"
        )
    act = EPILOGUES[name]
    return dense.apply(
        "te_jax.gemm",
        lhs,
        rhs,
        bias,
        act,
        quantizer_set,
        None,
        contracting_dims,
        implementation,
    )
