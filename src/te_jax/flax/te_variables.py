"""TransformerEngine-JAX's Linen variables loaded into te_jax's Linen modules.

TE-JAX's ``DenseGeneral``, ``LayerNormDenseGeneral`` and ``LayerNormMLP`` name their parameters
as te_jax's do; what differs:

==================== ============================================ ===============================
what                 TransformerEngine-JAX                        te_jax
==================== ============================================ ===============================
non-gated MLP kernel ``wi_kernel (H, 1, I)``, ``wi_bias (1, I)``  ``(H, I)``, ``(I,)``
gated MLP kernel     ``wi_kernel (H, 2, I)``, ``wi_bias (2, I)``  the same
FP8 variable names   ``{role}{postfix}_{field}``: postfix ``""``  ``{gemm}_{role}_{field}``:
                     (dense), ``"_0"`` / ``"_1"`` (MLP's GEMMs)   gemm ``kernel``, ``wi``, ``wo``
FP8 scale            ``(1,)``                                     ``()``
==================== ============================================ ===============================

``role`` is ``x``, ``kernel`` or ``grad``, ``field`` ``scale`` or ``amax_history``; the amax
history has the same layout in both (the newest amax last, slot 0 cleared after each update).
"""

from __future__ import annotations

from collections.abc import Mapping

import flax.linen as nn
import jax.numpy as jnp

from te_jax.activation_types import ActivationType
from te_jax.flax.fp8_state import FP8_COLLECTIONS, check_fp8_collection
from te_jax.flax.modules import DenseGeneral, LayerNormDenseGeneral, LayerNormMLP
from te_jax.recipe import DelayedScaling

__all__ = ["from_transformer_engine"]

_WHERE = "te_jax.flax.from_transformer_engine"
# TE-JAX's postfix of each GEMM's FP8 variables, by the te_jax module's GEMM names.
_POSTFIX = {"kernel": "", "wi": "_0", "wo": "_1"}
_GEMMS = {DenseGeneral: ("kernel",), LayerNormDenseGeneral: ("kernel",), LayerNormMLP: ("wi", "wo")}
_STATE = tuple(
    f"{role}_{field}" for role in ("x", "kernel", "grad") for field in ("scale", "amax_history")
)


def from_transformer_engine(module: nn.Module, variables: Mapping) -> dict:
    """The variables of te_jax's ``module`` from those of TE-JAX's module of the same name.

    Args:
      module: a ``te_jax.flax.DenseGeneral``, ``LayerNormDenseGeneral`` or ``LayerNormMLP``
        built as the TE-JAX module was (its activations, bias, norm); its ``fp8_collection``
        names the collection the FP8 state goes to, and a ``DelayedScaling`` recipe's
        ``amax_history_len`` must be the history's length.
      variables: the TE-JAX module's ``{"params": ..., "fp8_metas": ...}`` (the FP8 collection
        may be ``"_overwrite_with_gradient"`` instead, or absent); parameters boxed or not.

    Returns:
      ``{"params": ..., module.fp8_collection: ...}`` for ``module.apply``: parameters unboxed,
      the non-gated MLP kernel and bias without their axis of 1, the FP8 state renamed with
      scalar scales.

    Example:
      >>> import jax.numpy as jnp, te_jax.flax
      >>> mlp = te_jax.flax.LayerNormMLP(intermediate_dim=64)           # GELU, no bias
      >>> te_vars = {"params": {"scale": jnp.ones((32,)), "ln_bias": jnp.zeros((32,)),
      ...                       "wi_kernel": jnp.zeros((32, 1, 64)),    # TE-JAX's (H, 1, I)
      ...                       "wo_kernel": jnp.zeros((64, 32))}}
      >>> te_jax.flax.from_transformer_engine(mlp, te_vars)["params"]["wi_kernel"].shape
      (32, 64)
      >>> recipe = te_jax.recipe.DelayedScaling(amax_history_len=8)
      >>> dense = te_jax.flax.DenseGeneral(16, recipe=recipe)
      >>> fp8 = {f"{role}_{field}": jnp.ones((1,) if field == "scale" else (8,))
      ...        for role in ("x", "kernel", "grad") for field in ("scale", "amax_history")}
      >>> params = {"kernel": jnp.zeros((32, 16)), "bias": jnp.zeros((16,))}
      >>> state = te_jax.flax.from_transformer_engine(dense, {"params": params, "fp8_metas": fp8})
      >>> state["fp8_metas"]["kernel_x_scale"].shape, sorted(state["fp8_metas"])[:2]
      ((), ['kernel_grad_amax_history', 'kernel_grad_scale'])
    """
    gemms = _GEMMS.get(type(module))
    if gemms is None:
        raise TypeError(
            f"{_WHERE}: module must be a te_jax.flax DenseGeneral, LayerNormDenseGeneral or "
            f"LayerNormMLP, got {type(module).__name__}"
        )
    if "params" not in variables:
        raise ValueError(f"{_WHERE}: the variables have no 'params' (keys {sorted(variables)})")
    extra = sorted(set(variables) - {"params", *FP8_COLLECTIONS})
    if extra:
        raise ValueError(
            f"{_WHERE}: collections te_jax's module has no counterpart for: {extra} "
            "(LoRA and other TE-JAX options are not supported)"
        )
    params = dict(nn.unbox(variables["params"]))
    if isinstance(module, LayerNormMLP):
        params = _mlp_params(module, params)
    out = {"params": params}
    found = [c for c in FP8_COLLECTIONS if c in variables]
    if len(found) > 1:
        raise ValueError(f"{_WHERE}: FP8 state in both {found[0]!r} and {found[1]!r}")
    if found:
        target = check_fp8_collection(_WHERE, module.fp8_collection)
        out[target] = _fp8_state(module, gemms, dict(variables[found[0]]))
    return out


def _mlp_params(module: LayerNormMLP, params: dict) -> dict:
    """The MLP's first kernel and bias: TE-JAX's ``(H, 1, I)`` / ``(1, I)`` without the axis
    of 1 for a non-gated activation; a gated pair's ``(H, 2, I)`` as it is."""
    gated = ActivationType.parse(module.activations).is_gated
    kernel = params.get("wi_kernel")
    if kernel is None or kernel.ndim != 3 or kernel.shape[1] != (2 if gated else 1):
        want = "(H, 2, I)" if gated else "(H, 1, I)"
        have = None if kernel is None else tuple(kernel.shape)
        raise ValueError(
            f"{_WHERE}: the module's activations {module.activations!r} take a TE-JAX wi_kernel "
            f"of shape {want}, got {have}: build the module with the TE-JAX module's activations"
        )
    if not gated:
        params["wi_kernel"] = kernel[:, 0]
        if "wi_bias" in params:
            params["wi_bias"] = params["wi_bias"][0]
    return params


def _fp8_state(module, gemms, state: dict) -> dict:
    """TE-JAX's FP8 variables renamed for te_jax's ``gemms``, scales as scalars."""
    out, used = {}, set()
    for gemm in gemms:
        for name in _STATE:
            role, field = name.split("_", 1)
            te_name = f"{role}{_POSTFIX[gemm]}_{field}"
            if te_name not in state:
                raise ValueError(
                    f"{_WHERE}: the FP8 state has no {te_name!r} (TE-JAX's name of te_jax's "
                    f"{gemm}_{name}); it holds {sorted(state)}"
                )
            value = jnp.asarray(state[te_name], jnp.float32)
            out[f"{gemm}_{name}"] = value.reshape(()) if field == "scale" else value
            used.add(te_name)
    left = sorted(set(state) - used)
    if left:
        raise ValueError(f"{_WHERE}: FP8 variables with no te_jax counterpart: {left}")
    recipe = module.recipe
    if isinstance(recipe, DelayedScaling):
        length = out[f"{gemms[0]}_x_amax_history"].shape[-1]
        if length != recipe.amax_history_len:
            raise ValueError(
                f"{_WHERE}: the amax histories hold {length} steps, the module's recipe "
                f"{recipe.amax_history_len}: give it DelayedScaling(amax_history_len={length})"
            )
    return out
