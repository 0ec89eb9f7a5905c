"""Delayed scaling's state in an NNX module: ``FP8Meta`` variables, one per state array of each
GEMM's ``QuantizerSet`` (``x_scale``, ``x_amax_history``, ..., ``grad_amax_history``).

``te_jax.dense`` returns the updated set as the cotangent of its ``quantizer_set``, so the
gradient of the loss with respect to the ``FP8Meta`` variables *is* the next state (x's and the
kernel's quantizers updated with the forward's amaxes, the gradient's with the backward's:
docs/numerics.md §4). The forward writes the variables only with the same values, as a second
handle on the state (``QuantizerState.__call__``): a module called twice in a step gets the
calls' next states merged by max.
"""

from __future__ import annotations

from flax import nnx

from te_jax.flax.fp8_state import FP8_COLLECTION
from te_jax.recipe import QuantizerSet, Recipe

__all__ = ["FP8Meta", "QuantizerState", "update_fp8_state", "merge_fp8_state"]


class FP8Meta(nnx.Variable):
    """FP8 scaling state (delayed scaling's scales and amax histories): not a parameter, never
    trained; replaced by its gradient (the next state) each step.

    Per GEMM: float32 ``x_scale``, ``kernel_scale``, ``grad_scale`` ``()`` and
    ``x_amax_history``, ... ``(L,)``.

    Example:
      >>> import jax, te_jax.nnx
      >>> from flax import nnx
      >>> recipe = te_jax.recipe.DelayedScaling(amax_history_len=4)
      >>> layer = te_jax.nnx.Linear(32, 16, recipe=recipe, rngs=nnx.Rngs(0))
      >>> isinstance(layer.quantizers.x_amax_history, te_jax.nnx.FP8Meta)
      True
      >>> len(jax.tree.leaves(nnx.state(layer, te_jax.nnx.FP8Meta)))   # 3 scales, 3 histories
      6
    """


# Under Flax's Linen bridge an FP8Meta lives in the te_jax Linen modules' collection.
nnx.register_variable_name(FP8_COLLECTION, FP8Meta)


class QuantizerState(nnx.Module):
    """The quantizers of one GEMM under ``recipe``; delayed scaling's state as ``FP8Meta``
    attributes named as ``QuantizerSet.state()`` names them. Calling it gives the
    ``QuantizerSet`` (fresh for the stateless recipes, ``None`` without a recipe).

    Example:
      >>> import te_jax.nnx
      >>> state = te_jax.nnx.QuantizerState(te_jax.recipe.DelayedScaling(amax_history_len=4))
      >>> state.x_amax_history.shape
      (4,)
      >>> qs = state()                                   # the set for one use
      >>> qs.scaling_mode.name, qs.x.amax_history.shape
      ('DELAYED_TENSOR_SCALING', (4,))
      >>> te_jax.nnx.QuantizerState(None)() is None
      True
    """

    def __init__(self, recipe: Recipe | None):
        self.recipe = recipe
        for name, value in QuantizerSet.create(recipe).state().items():
            setattr(self, name, FP8Meta(value))

    def current(self) -> QuantizerSet | None:
        """The set with this step's state, read without a use's handle (``__call__``'s
        ``share``): for quantizing a kernel ahead (``te_jax.nnx.quantize_kernels``)."""
        if self.recipe is None:
            return None
        qs = QuantizerSet.create(self.recipe)
        return qs.with_state({name: getattr(self, name)[...] for name in qs.state()})

    def __call__(self) -> QuantizerSet | None:
        """The set for one use. Delayed scaling's variables then hold a second handle on the
        same state (``QuantizerSet.share``), so a module called again in the same step reads
        that one and the calls' next states merge by max in the backward, never add."""
        if self.recipe is None:
            return None
        qs = QuantizerSet.create(self.recipe)
        state = {name: getattr(self, name)[...] for name in qs.state()}
        if not state:
            return qs
        now, later = qs.with_state(state).share()
        for name, value in later.state().items():
            getattr(self, name).set_value(value)  # rebinds: a restored value may be read-only
        return now


def update_fp8_state(model: nnx.Module, grads) -> None:
    """Set every ``FP8Meta`` variable of ``model`` to its gradient in ``grads`` (the next FP8
    state), in place; a no-op where ``grads`` holds none (e.g. taken with respect to
    ``nnx.Param`` only).

    Example:
      >>> import jax, jax.numpy as jnp, te_jax.nnx
      >>> from flax import nnx
      >>> recipe = te_jax.recipe.DelayedScaling(amax_history_len=4)
      >>> layer = te_jax.nnx.Linear(32, 16, recipe=recipe, rngs=nnx.Rngs(0))
      >>> x = jnp.ones((4, 32), jnp.bfloat16)
      >>> wrt = nnx.DiffState(0, (nnx.Param, te_jax.nnx.FP8Meta))
      >>> grads = nnx.jit(nnx.grad(lambda m: m(x).astype(jnp.float32).sum(), argnums=wrt))(layer)
      >>> te_jax.nnx.update_fp8_state(layer, grads)      # the parameters: the optimizer's
      >>> layer.quantizers.x_amax_history[...].tolist()   # x's amax, newest last
      [0.0, 0.0, 0.0, 1.0]
    """
    nnx.update(model, nnx.state(grads, FP8Meta))


def merge_fp8_state(model: nnx.Module, *grads) -> None:
    """Set every ``FP8Meta`` variable of ``model`` to the merge of several uses' next states, in
    place: gradient accumulation, each of ``grads`` the gradient (with respect to the
    ``FP8Meta`` variables) of one micro-batch's loss, all taken from ``model``'s current state.
    Each quantizer takes the largest of the micro-batches' amaxes
    (``QuantizerSet.merge_updates``), the state one step on the whole batch gives; a sum of the
    gradients would add the states.

    Example:
      >>> import jax, jax.numpy as jnp, te_jax.nnx
      >>> from flax import nnx
      >>> recipe = te_jax.recipe.DelayedScaling(amax_history_len=4)
      >>> layer = te_jax.nnx.Linear(32, 16, recipe=recipe, rngs=nnx.Rngs(0))
      >>> wrt = nnx.DiffState(0, te_jax.nnx.FP8Meta)
      >>> step = nnx.jit(nnx.grad(lambda m, x: m(x).astype(jnp.float32).sum(), argnums=wrt))
      >>> micro = [step(layer, jnp.full((4, 32), a, jnp.bfloat16)) for a in (2, 3)]
      >>> te_jax.nnx.merge_fp8_state(layer, *micro)
      >>> layer.quantizers.x_amax_history[...].tolist()   # the larger amax, not a sum
      [0.0, 0.0, 0.0, 3.0]
    """
    for path, module in nnx.iter_modules(model):
        if not isinstance(module, QuantizerState) or module.recipe is None:
            continue
        qs = QuantizerSet.create(module.recipe)
        names = tuple(qs.state())
        if not names:
            continue
        current = qs.with_state({n: getattr(module, n)[...] for n in names})
        ups = []
        for g in grads:
            node = g
            for key in path:
                node = node[key]
            ups.append(qs.with_state({n: node[n][...] for n in names}))
        for name, value in current.merge_updates(*ups).state().items():
            getattr(module, name).set_value(value)
