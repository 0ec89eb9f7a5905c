"""Delayed scaling's state in a Linen module: one variable per state array of each GEMM's
``QuantizerSet``, in the ``"fp8_metas"`` collection, or (a module's ``fp8_collection``) in
Flax's ``"_overwrite_with_gradient"``, which ``flax.training.train_state.TrainState`` replaces by
its gradient in ``apply_gradients`` (the optimizer never sees it).

``te_jax.dense`` returns the updated set as the cotangent of its ``quantizer_set``, so the
gradient of the loss with respect to ``variables["fp8_metas"]`` *is* the next state (x's and the
kernel's quantizers updated with the forward's amaxes, the gradient's with the backward's:
docs/numerics.md §4). Where the collection is mutable the forward writes it with the same
values, as a second handle on the state (``quantizer_set``), so a module applied twice in one
step, or a scan that carries the collection, merges its uses' next states by max.
"""

from __future__ import annotations

from collections.abc import Mapping

import flax.linen as nn

from te_jax.recipe import QuantizerSet, Recipe, merge_state_dicts

__all__ = [
    "FP8_COLLECTION",
    "OVERWRITE_WITH_GRADIENT",
    "FP8_COLLECTIONS",
    "check_fp8_collection",
    "quantizer_set",
    "checked_quantizer_set",
    "update_fp8_metas",
    "merge_fp8_metas",
]

FP8_COLLECTION = "fp8_metas"
# Flax's collection for variables a training step replaces by their gradient (its fp8_ops' state;
# flax.core.meta's OVERWRITE_WITH_GRADIENT).
OVERWRITE_WITH_GRADIENT = "_overwrite_with_gradient"
FP8_COLLECTIONS = (FP8_COLLECTION, OVERWRITE_WITH_GRADIENT)


def check_fp8_collection(where: str, name) -> str:
    """``name`` if it is one of ``FP8_COLLECTIONS``, else a ValueError naming them."""
    if name not in FP8_COLLECTIONS:
        raise ValueError(
            f"{where}: fp8_collection must be {FP8_COLLECTION!r} (te_jax.flax.update_fp8_metas "
            f"advances it) or {OVERWRITE_WITH_GRADIENT!r} (flax TrainState.apply_gradients "
            f"does), got {name!r}"
        )
    return name


def quantizer_set(
    module: nn.Module, recipe: Recipe | None, gemm: str, collection: str = FP8_COLLECTION
) -> QuantizerSet:
    """The ``QuantizerSet`` of the GEMM named ``gemm`` in ``module`` under ``recipe``: fresh for
    the stateless recipes, built from ``module``'s variables ``{gemm}_{role}_{field}`` in
    ``collection`` (one of ``FP8_COLLECTIONS``; created at ``init``) for delayed scaling."""
    qs = QuantizerSet.create(recipe)
    variables = {
        name: module.variable(collection, f"{gemm}_{name}", lambda v=value: v)
        for name, value in qs.state().items()
    }
    if not variables:
        return qs
    qs = qs.with_state({name: v.value for name, v in variables.items()})
    if module.is_initializing() or not module.is_mutable_collection(collection):
        return qs
    # A mutable collection holds a second handle on the same state (QuantizerSet.share): a
    # module applied again in this step (or the next step of a scan carrying the collection)
    # reads it, and the uses' next states merge by max in the backward, never add.
    now, later = qs.share()
    for name, value in later.state().items():
        variables[name].value = value
    return now


def checked_quantizer_set(module: nn.Module, recipe: Recipe | None, gemm: str, where: str):
    """``quantizer_set`` in ``module.fp8_collection``, once delayed scaling's variables are known
    to be there (or creatable): their absence is a te_jax error naming the fix, not Flax's;
    ``where`` names the public module in it."""
    collection = check_fp8_collection(where, module.fp8_collection)
    names = [f"{gemm}_{n}" for n in QuantizerSet.create(recipe).state()]
    if (
        names
        and not module.has_variable(collection, names[0])
        and not module.is_mutable_collection(collection)
    ):
        raise ValueError(_missing_fp8_state(module, recipe, names[0], where, collection))
    return quantizer_set(module, recipe, gemm, collection)


def _missing_fp8_state(
    module: nn.Module, recipe: Recipe, name: str, where: str, collection: str = FP8_COLLECTION
) -> str:
    """Why delayed scaling's variable ``name`` is missing from ``collection``, and the fix."""
    recipe_name, path = type(recipe).__name__, module.scope.path_text
    head = (
        f"{where}: recipe={recipe_name}() keeps its FP8 state in the {collection!r} collection, but"
    )
    lifted_fix = (
        f'list "{collection}" beside "params" in the nn.scan (or nn.vmap, another Flax lifted '
        f'transform) around the module: variable_axes={{"params": 0, "{collection}": 0}} '
        "(or in variable_broadcast / variable_carry)"
    )
    no_recipe = (
        "the module was initialized without a delayed-scaling recipe (recipe=None, or a "
        f"stateless one): initialize it again with recipe={recipe_name}(...), or add the state "
        f'to these variables: _, state = module.apply(variables, x, mutable=["{collection}"]); '
        "variables = {**variables, **state}"
    )
    if module.is_initializing():
        # At init the collection is always created, unless a lifted transform hides it.
        return f"{head} it cannot be created here ({name!r} at {path}): {lifted_fix}"
    if "(" in path:
        # A lifted transform shows in the scope path ("/scan(...)/..."): it may be the cause.
        return (
            f"{head} the variables seen here hold no {name!r} (at {path}). Either {lifted_fix}; "
            f"or {no_recipe}"
        )
    return f"{head} the variables given hold no {name!r} (at {path}): {no_recipe}"


def update_fp8_metas(variables: Mapping, grads: Mapping) -> dict:
    """``variables`` with its ``"fp8_metas"`` (and ``"_overwrite_with_gradient"``) collection
    replaced by the gradient with respect to it (the next FP8 state); unchanged where ``grads``
    has no such collection.

    Args:
      variables: a Linen variables dict (``{"params": ..., "fp8_metas": ...}``).
      grads: the gradient of the loss with respect to (a dict holding) ``variables``.

    Returns:
      A new variables dict: ``params`` as given (update them with the optimizer), the FP8
      collections from ``grads``.

    Example:
      >>> import jax, jax.numpy as jnp, te_jax.flax
      >>> recipe = te_jax.recipe.DelayedScaling(amax_history_len=4)
      >>> layer = te_jax.flax.DenseGeneral(16, recipe=recipe)
      >>> x = jnp.ones((4, 32), jnp.bfloat16)
      >>> variables = layer.init(jax.random.key(0), x)
      >>> loss = lambda v: layer.apply(v, x).astype(jnp.float32).sum()
      >>> grads = jax.jit(jax.grad(loss))(variables)
      >>> variables = te_jax.flax.update_fp8_metas(variables, grads)
      >>> variables["fp8_metas"]["kernel_x_amax_history"].tolist()   # x's amax, newest last
      [0.0, 0.0, 0.0, 1.0]
    """
    out = dict(variables)
    for collection in FP8_COLLECTIONS:
        if collection in grads:
            out[collection] = grads[collection]
    return out


def merge_fp8_metas(recipe: Recipe, fp8_metas: Mapping, *updated: Mapping) -> dict:
    """The next ``"fp8_metas"`` collection when several uses of ``fp8_metas`` met: gradient
    accumulation, each of ``updated`` the gradient with respect to ``fp8_metas`` of one
    micro-batch's loss, all taken from the same ``fp8_metas``. Each quantizer takes the largest
    of the micro-batches' amaxes (``QuantizerSet.merge_updates``), the state one step on the
    whole batch gives; a sum of the gradients would add the states.

    Args:
      recipe: the modules' recipe (its margin, amax algorithm and formats).
      fp8_metas: the collection the micro-batches started from.
      *updated: the micro-batches' gradients with respect to it (their next states).

    Returns:
      The next ``"fp8_metas"``, of ``fp8_metas``' structure: per quantizer
      ``update(max_i amax_i)`` (``DelayedScaleQuantizer.merge_updates``).

    Example:
      >>> import jax, jax.numpy as jnp, te_jax.flax
      >>> recipe = te_jax.recipe.DelayedScaling(amax_history_len=4)
      >>> layer = te_jax.flax.DenseGeneral(16, recipe=recipe)
      >>> variables = layer.init(jax.random.key(0), jnp.ones((4, 32), jnp.bfloat16))
      >>> loss = lambda metas, x: layer.apply({**variables, "fp8_metas": metas}, x).sum()
      >>> step = jax.jit(jax.grad(loss))
      >>> micro = [step(variables["fp8_metas"], jnp.full((4, 32), a, jnp.bfloat16)) for a in (2, 3)]
      >>> merged = te_jax.flax.merge_fp8_metas(recipe, variables["fp8_metas"], *micro)
      >>> merged["kernel_x_amax_history"].tolist()          # the larger amax, not a sum
      [0.0, 0.0, 0.0, 3.0]
    """
    return merge_state_dicts(recipe, fp8_metas, *updated)
