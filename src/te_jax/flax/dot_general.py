"""te_jax's GEMM in stock Linen layers: ``DotGeneral`` for their ``dot_general_cls`` hook and
``EinsumOp`` for model code that calls an einsum op (as with Flax's ``fp8_ops.Fp8Einsum``).

    dense = nn.Dense(1024, dot_general_cls=te_jax.flax.DotGeneral)          # under autocast
    dense = nn.DenseGeneral((8, 128), dot_general_cls=functools.partial(
        te_jax.flax.DotGeneral, recipe=te_jax.recipe.DelayedScaling()))

Both run ``te_jax.dot_general`` (te_jax's quantize kernels and GEMM; any dimension numbers).
Delayed scaling's state lives in Flax's ``"_overwrite_with_gradient"`` collection by default,
which ``flax.training.train_state.TrainState.apply_gradients`` replaces by its gradient (the
next state) when the train state's params are the whole variable tree and the gradient is
taken with respect to it, as with Flax's own FP8 ops; ``fp8_collection="fp8_metas"`` keeps it
with te_jax's modules' state instead (``te_jax.flax.update_fp8_metas``).
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from te_jax.flax.fp8_state import OVERWRITE_WITH_GRADIENT, checked_quantizer_set
from te_jax.layers import check_recipe
from te_jax.linear.dot_general import dot_general
from te_jax.recipe import Recipe, autocast_recipe

__all__ = ["DotGeneral", "EinsumOp"]


class _QuantizedOp(nn.Module):
    """The settings both ops share: the recipe (``None``: ``te_jax.autocast``'s, where one is
    active at init and apply; else no quantization), where its state lives, the path."""

    recipe: Recipe | None = None
    fp8_collection: str = OVERWRITE_WITH_GRADIENT
    implementation: str | None = None

    def _dot_general(self, where: str):
        recipe = autocast_recipe(check_recipe(where, self.recipe))
        qs = checked_quantizer_set(self, recipe, "dot", where)

        def fn(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, **kw):
            return dot_general(
                lhs,
                rhs,
                dimension_numbers,
                precision,
                preferred_element_type,
                quantizer_set=qs,
                implementation=self.implementation,
                **kw,
            )

        return fn


class DotGeneral(_QuantizedOp):
    """``lax.dot_general`` on te_jax's kernels, quantized under ``recipe``: the op class of
    ``nn.Dense`` / ``nn.DenseGeneral``'s ``dot_general_cls`` (one FP8 state per layer).

    Example:
      >>> import functools, jax, jax.numpy as jnp, flax.linen as nn, te_jax
      >>> fp8 = functools.partial(te_jax.flax.DotGeneral, recipe=te_jax.recipe.DelayedScaling())
      >>> layer = nn.Dense(16, dtype=jnp.bfloat16, dot_general_cls=fp8)
      >>> variables = layer.init(jax.random.PRNGKey(0), jnp.ones((4, 32), jnp.bfloat16))
      >>> sorted(variables)
      ['_overwrite_with_gradient', 'params']
    """

    @nn.compact
    def __call__(
        self,
        lhs: jax.Array,
        rhs: jax.Array,
        dimension_numbers,
        precision=None,
        preferred_element_type=None,
        out_sharding=None,
    ) -> jax.Array:
        fn = self._dot_general("te_jax.flax.DotGeneral")
        kw = dict(out_sharding=out_sharding)
        return fn(lhs, rhs, dimension_numbers, precision, preferred_element_type, **kw)


class EinsumOp(_QuantizedOp):
    """``jnp.einsum(eqn, lhs, rhs)`` with its contraction on te_jax's kernels, quantized under
    ``recipe``: lhs the activation, rhs the weight (as Flax's ``fp8_ops.Fp8Einsum``). lhs is cast
    to rhs's dtype, the compute dtype.

    Call it as ``EinsumOp(recipe=...)(eqn, lhs, rhs)``: the output has ``jnp.einsum``'s shape,
    in rhs's dtype.

    Example:
      >>> import jax, jax.numpy as jnp, flax.linen as nn, te_jax.flax
      >>> class Proj(nn.Module):
      ...     @nn.compact
      ...     def __call__(self, x):
      ...         w = self.param("w", nn.initializers.lecun_normal(), (32, 16), jnp.bfloat16)
      ...         einsum = te_jax.flax.EinsumOp(recipe=te_jax.recipe.CurrentScaling())
      ...         return einsum("bd,df->bf", x, w)
      >>> x = jnp.ones((4, 32), jnp.bfloat16)
      >>> variables = Proj().init(jax.random.key(0), x)
      >>> y = Proj().apply(variables, x)
      >>> y.shape, y.dtype
      ((4, 16), dtype(bfloat16))
    """

    @nn.compact
    def __call__(
        self,
        eqn: str,
        lhs: jax.Array,
        rhs: jax.Array,
        precision=None,
        preferred_element_type: Any = None,
    ) -> jax.Array:
        fn = self._dot_general("te_jax.flax.EinsumOp")
        lhs = jnp.asarray(lhs).astype(jnp.asarray(rhs).dtype)
        return jnp.einsum(
            eqn,
            lhs,
            rhs,
            precision=precision,
            preferred_element_type=preferred_element_type,
            _dot_general=fn,
        )
