"""Kernels quantized once per optimizer step for a Linen module (``te_jax.quantize_kernel``).

Gradient accumulation runs a module on several micro-batches from the same parameters and FP8
state. ``quantize_kernels(module, variables)`` quantizes each of the module's kernels once, into
the ``"quantized_kernels"`` collection; applied with that collection, the module's GEMMs take
those codes instead of quantizing the kernels again (the same bits; XLA:GPU does not hoist the
loop-invariant quantizes out of a ``lax.scan`` over the micro-batches by itself)::

    cache = te_jax.flax.quantize_kernels(mlp, variables)            # once per step

    def body(acc, xb):
        g = jax.grad(loss)(params, fp8, cache, xb)   # loss applies {"params", "fp8_metas",
        ...                                          #  **cache}

For a model with te_jax modules anywhere inside it, apply it on the first micro-batch with the
collection mutable: each module quantizes its kernels there and stores them
(``model.apply(variables, x0, mutable=["quantized_kernels"])``), and the other micro-batches
read them.
"""

from __future__ import annotations

from collections.abc import Mapping

import flax.linen as nn

from te_jax import layers
from te_jax.flax.fp8_state import check_fp8_collection
from te_jax.linear.kernel_cache import quantize_kernel
from te_jax.recipe import QuantizerSet, autocast_recipe

__all__ = ["QUANTIZED_KERNELS", "quantize_kernels", "cached"]

QUANTIZED_KERNELS = "quantized_kernels"


def quantize_kernels(module: nn.Module, variables: Mapping) -> dict:
    """``{"quantized_kernels": {gemm: codes}}``: each kernel of the te_jax Linen ``module``
    (``DenseGeneral``, ``LayerNormDenseGeneral``, ``LayerNormMLP``) quantized with its GEMM's
    quantizer set from ``variables`` (the state of this step), as ``te_jax.quantize_kernel``
    does. Apply the module with ``{**variables, **quantize_kernels(module, variables)}``.

    Tensor-scaling recipes only (``DelayedScaling``, ``CurrentScaling``); the codes are valid
    for the parameters and FP8 state they were made from (quantize again after the optimizer
    step).

    Example:
      >>> import jax, jax.numpy as jnp, te_jax, te_jax.flax
      >>> mlp = te_jax.flax.LayerNormMLP(64, recipe=te_jax.recipe.DelayedScaling())
      >>> x = jnp.ones((8, 32), jnp.bfloat16)
      >>> variables = mlp.init(jax.random.key(0), x)
      >>> cache = te_jax.flax.quantize_kernels(mlp, variables)
      >>> {g: st.data.shape for g, st in cache["quantized_kernels"].items()}
      {'wi': (32, 64), 'wo': (64, 32)}
      >>> out, _ = mlp.apply({**variables, **cache}, x)
      >>> bool((out == mlp.apply(variables, x)[0]).all())
      True
    """
    layout = getattr(module, "kernel_contractions", None)
    if layout is None:
        raise TypeError(
            "te_jax.flax.quantize_kernels: module must be a te_jax.flax DenseGeneral, "
            f"LayerNormDenseGeneral or LayerNormMLP, got {type(module).__name__}"
        )
    return {QUANTIZED_KERNELS: module.apply(variables, method=_quantize_own)}


def _quantize_own(module: nn.Module) -> dict:
    where = f"te_jax.flax.quantize_kernels({type(module).__name__})"
    recipe = autocast_recipe(layers.check_recipe(where, module.recipe))
    if recipe is None:
        raise ValueError(f"{where}: the module has no recipe: its GEMMs quantize nothing")
    out = {}
    collection = check_fp8_collection(where, module.fp8_collection)
    for gemm, (param, n_c) in module.kernel_contractions().items():
        qs = QuantizerSet.create(recipe)
        names = [f"{gemm}_{name}" for name in qs.state()]
        missing = [n for n in names if not module.has_variable(collection, n)]
        if missing:
            raise ValueError(
                f"{where}: variables[{collection!r}] has no {', '.join(missing)}: pass the "
                "variables module.init returned (with the FP8 state of this step)"
            )
        state = {n: nn.unbox(module.get_variable(collection, f"{gemm}_{n}")) for n in qs.state()}
        kernel = nn.unbox(module.get_variable("params", param))
        out[gemm] = quantize_kernel(kernel, qs.with_state(state), n_c)
    return out


def cached(module: nn.Module, spec, params: Mapping, quantizer_sets: Mapping) -> dict:
    """The codes ``module``'s GEMMs take, ``{gemm: codes}``: those in the
    ``"quantized_kernels"`` collection; where the apply names that collection mutable and it
    holds none for a quantized GEMM, the kernel quantized now and stored there (so
    ``apply(..., mutable=["quantized_kernels"])`` on the first micro-batch fills it for every
    te_jax module of a model, TransformerEngine's ``is_first_microbatch``). Empty otherwise."""
    out = {}
    fill = _asked_for(module)
    for gemm, (param, n_c) in spec.kernel_contractions().items():
        qs = quantizer_sets[gemm]
        if module.has_variable(QUANTIZED_KERNELS, gemm):
            out[gemm] = module.get_variable(QUANTIZED_KERNELS, gemm)
        elif fill and qs is not None and not qs.is_empty:
            out[gemm] = quantize_kernel(params[param], qs, n_c)
            module.put_variable(QUANTIZED_KERNELS, gemm, out[gemm])
    return out


def _asked_for(module: nn.Module) -> bool:
    """Whether this apply names the collection among its mutable ones. Not under ``init`` or
    ``mutable=True`` / a deny list, which make every collection mutable: codes stored there
    unasked could be carried into a later step, after the parameters they came from changed."""
    if module.is_initializing() or not module.is_mutable_collection(QUANTIZED_KERNELS):
        return False
    named = module.scope.mutable
    if isinstance(named, str):
        return named == QUANTIZED_KERNELS
    return isinstance(named, (list, tuple, set, frozenset)) and QUANTIZED_KERNELS in named
