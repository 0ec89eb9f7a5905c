"""te_jax's GEMM in stock NNX layers: ``DotGeneral`` for their ``dot_general`` argument
(``nnx.Linear``, ``nnx.LinearGeneral``) and ``EinsumOp`` for ``nnx.Einsum``'s ``einsum_op``.

    layer = nnx.Linear(1024, 4096, dot_general=te_jax.nnx.DotGeneral(recipe), rngs=rngs)
    out = nnx.Einsum("bhsd,hdf->bsf", (8, 128, 1024),
                     einsum_op=te_jax.nnx.EinsumOp(recipe), rngs=rngs)

Both run ``te_jax.dot_general`` (te_jax's quantize kernels and GEMM; any dimension numbers) and,
as ``nnx.Module``s held by the layer, keep delayed scaling's state in ``FP8Meta`` variables,
which ``nnx.Optimizer(..., wrt=nnx.Param)`` leaves alone: the step differentiates with respect
to ``(nnx.Param, FP8Meta)`` and applies ``update_fp8_state(model, grads)`` beside the
optimizer's update (docs/flax.md). Stateless recipes (current scaling, MXFP8) need neither.
One instance per layer: it holds that layer's state.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from te_jax.layers import check_recipe
from te_jax.linear.dot_general import dot_general
from te_jax.nnx.fp8_state import QuantizerState
from te_jax.recipe import Recipe, autocast_recipe

__all__ = ["DotGeneral", "EinsumOp"]


class _QuantizedOp(nnx.Module):
    """``recipe`` (``None``: the active ``te_jax.autocast``'s at construction, else no
    quantization), its quantizers' state and the path."""

    def __init__(self, recipe: Recipe | None = None, *, implementation: str | None = None):
        where = f"te_jax.nnx.{type(self).__name__}"
        self.quantizers = QuantizerState(autocast_recipe(check_recipe(where, recipe)))
        self.implementation = implementation

    def _dot_general(self):
        return functools.partial(
            dot_general, quantizer_set=self.quantizers(), implementation=self.implementation
        )


class DotGeneral(_QuantizedOp):
    """``lax.dot_general`` on te_jax's kernels, quantized under ``recipe``; lhs the activation,
    rhs the weight.

    Example:
      >>> import jax.numpy as jnp, te_jax.nnx
      >>> from flax import nnx
      >>> dg = te_jax.nnx.DotGeneral(te_jax.recipe.CurrentScaling())
      >>> layer = nnx.Linear(32, 16, dtype=jnp.bfloat16, dot_general=dg, rngs=nnx.Rngs(0))
      >>> layer(jnp.ones((4, 32), jnp.bfloat16)).shape
      (4, 16)
    """

    def __call__(
        self,
        lhs: jax.Array,
        rhs: jax.Array,
        dimension_numbers,
        precision=None,
        preferred_element_type=None,
        out_sharding=None,
    ) -> jax.Array:
        fn = self._dot_general()
        kw = dict(out_sharding=out_sharding)
        return fn(lhs, rhs, dimension_numbers, precision, preferred_element_type, **kw)


class EinsumOp(_QuantizedOp):
    """``jnp.einsum(eqn, lhs, rhs)`` with its contraction on te_jax's kernels, quantized under
    ``recipe``; lhs the activation, rhs the weight. The output has ``jnp.einsum``'s shape and
    dtype.

    Example:
      >>> import jax.numpy as jnp, te_jax.nnx
      >>> from flax import nnx
      >>> op = te_jax.nnx.EinsumOp(te_jax.recipe.CurrentScaling())
      >>> layer = nnx.Einsum("bd,df->bf", (32, 16), einsum_op=op, dtype=jnp.bfloat16,
      ...                    rngs=nnx.Rngs(0))
      >>> layer(jnp.ones((4, 32), jnp.bfloat16)).shape
      (4, 16)
    """

    def __call__(
        self,
        eqn: str,
        lhs: jax.Array,
        rhs: jax.Array,
        precision=None,
        preferred_element_type=None,
        out_sharding=None,
    ) -> jax.Array:
        out = jnp.einsum(
            eqn,
            lhs,
            rhs,
            precision=precision,
            preferred_element_type=preferred_element_type,
            _dot_general=self._dot_general(),
        )
        return out if out_sharding is None else lax.with_sharding_constraint(out, out_sharding)
