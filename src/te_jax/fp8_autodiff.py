"""How an FP8 op (``te_jax.dense`` / ``te_jax.fused_mlp`` under a recipe) takes part in autodiff.

**Reverse mode only.** Quantization has no derivative: an FP8 op is a ``custom_vjp`` whose
backward multiplies quantized operands as if quantization were the identity
(docs/numerics.md §8). Forward mode (``jax.jvp``, ``jax.jacfwd``, ``jax.hessian``, a
Hessian-vector product ``jvp(grad(f))``) is not defined for it. ``reverse_mode_only`` raises a
``TypeError`` that names the op and the way out, at trace time: where JAX raises its generic
error (an eager ``jvp``, ``jacfwd``), where the op's output carries a JVP tangent (a ``jvp``
under ``jit``, which JAX would only refuse when lowering), and in the forward of
forward-over-reverse. The unquantized ops support both modes.

**Delayed scaling's next state** comes back as the "gradient" of the op's ``QuantizerSet``
(``te_jax.recipe``). A step that differentiates the parameters only drops it, and every scale
then stays at its initial value, silently. The ops' ``custom_vjp`` forward sees which inputs are
differentiated (``symbolic_zeros``); ``check_state_differentiated`` warns with
``FP8StateNotUpdatedWarning`` when an op's operands are differentiated and its delayed-scaling
set is not, attributed to the user's line that calls the op (Python's default filter shows it
once per such line). With the environment variable ``TE_JAX_STRICT_FP8_STATE=1`` (or ``true``,
``yes``, ``on``) it raises ``FP8StateNotUpdatedError`` instead. The stateless recipes (current
scaling, MXFP8) have no state to drop and are not checked.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import inspect
import os
import warnings
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.custom_derivatives import CustomVJPPrimal, SymbolicZero
from jax.interpreters import ad

__all__ = [
    "STRICT_ENV",
    "FP8StateNotUpdatedError",
    "FP8StateNotUpdatedWarning",
    "check_state_differentiated",
    "forward_mode_message",
    "instantiate",
    "reverse_mode_only",
    "under_jvp",
    "unwrap_primals",
]

# The environment variable that makes an undifferentiated delayed-scaling state an error.
STRICT_ENV = "TE_JAX_STRICT_FP8_STATE"
_TRUE = ("1", "true", "yes", "on")
# The text of JAX's error for forward mode through a custom_vjp.
_JAX_JVP_ERROR = "forward-mode autodiff (jvp) to a custom_vjp"


class FP8StateNotUpdatedWarning(UserWarning):
    """A delayed-scaling quantizer set was used by a differentiated op without being
    differentiated itself: its next state is dropped and its scales never change."""


class FP8StateNotUpdatedError(RuntimeError):
    """``FP8StateNotUpdatedWarning`` as an error (``TE_JAX_STRICT_FP8_STATE=1``)."""


# ---- forward mode --------------------------------------------------------------------------------


def forward_mode_message(where: str) -> str:
    """The error for forward mode through the FP8 op ``where``."""
    return (
        f"{where}: forward-mode differentiation (jax.jvp, jax.jacfwd, jax.hessian, "
        "jvp of grad) of an FP8 op is not defined: quantization has no derivative. "
        "Differentiate it in reverse mode (jax.grad, jax.vjp, jax.jacrev), or run it without "
        "a quantizer set (quantizer_set=None, or a module without a recipe), which supports "
        "both modes"
    )


def under_jvp(tree) -> bool:
    """Whether an array of ``tree`` carries a forward-mode tangent: an FP8 op's output under
    ``jvp``, or its inputs in its ``custom_vjp`` forward under ``jvp`` of ``grad``. With JAX's
    direct linearization (its default) reverse mode has tracers of its own, so a JVP tracer
    means ``jax.jvp`` (or ``jacfwd``) is differentiating the op."""
    if not jax.config.jax_use_direct_linearize:
        return False
    return any(isinstance(leaf, ad.JVPTracer) for leaf in jax.tree.leaves(tree))


def reverse_mode_only(where: str, op: Callable, *args):
    """``op(*args)``, an FP8 op's ``custom_vjp``, with forward mode through it raised as a
    te_jax ``TypeError`` (``forward_mode_message``) rather than JAX's generic one."""
    try:
        out = op(*args)
    except TypeError as e:
        if _JAX_JVP_ERROR in str(e):
            raise TypeError(forward_mode_message(where)) from None
        raise
    if under_jvp(out):  # under jit JAX would only fail when lowering
        raise TypeError(forward_mode_message(where))
    return out


# ---- the custom_vjp forward's view of its inputs -------------------------------------------------


def _is_primal(a) -> bool:
    return isinstance(a, CustomVJPPrimal)


def unwrap_primals(tree):
    """``(values, perturbed)`` of a ``custom_vjp`` forward's argument under
    ``symbolic_zeros=True``: the same tree with each ``CustomVJPPrimal`` leaf replaced by its
    value, and the list of its leaves' ``perturbed`` flags (True: being differentiated)."""
    leaves = jax.tree.leaves(tree, is_leaf=_is_primal)
    values = jax.tree.map(lambda p: p.value, tree, is_leaf=_is_primal)
    return values, [p.perturbed for p in leaves]


def instantiate(ct):
    """A cotangent with a ``SymbolicZero`` (an unused output) made an array of zeros."""
    if isinstance(ct, SymbolicZero):
        return jnp.zeros(ct.shape, ct.dtype)
    return ct


# ---- delayed scaling's state ---------------------------------------------------------------------


def _message(where: str) -> str:
    """The warning (error) for an FP8 op ``where`` whose delayed-scaling state is dropped."""
    return (
        f"{where}: its operands are differentiated but its delayed-scaling quantizer set is "
        "not, so the next FP8 state (returned as the gradient with respect to the set) is "
        "dropped and the scales never leave their initial value. Differentiate with respect "
        "to the quantizer sets too and take that gradient as the next state (not as a "
        "descent direction): jax.grad(loss, argnums=(0, 1))(params, quantizer_sets); Linen: "
        "the 'fp8_metas' collection, e.g. jax.grad(loss, argnums=(0, 1))(params, "
        "variables['fp8_metas']) or te_jax.flax.update_fp8_metas; NNX: "
        "nnx.grad(loss, argnums=nnx.DiffState(0, (nnx.Param, te_jax.nnx.FP8Meta))) and "
        "te_jax.nnx.update_fp8_state(model, grads). docs/flax.md shows the step. Set "
        f"{STRICT_ENV}=1 to make this an error"
    )


def check_state_differentiated(where: str, operands_perturbed, sets_perturbed) -> None:
    """Warn (or, under ``TE_JAX_STRICT_FP8_STATE=1``, raise) when an FP8 op's operands are
    differentiated and a delayed-scaling set of it is not.

    Args:
      where: the op's name, for the message.
      operands_perturbed: the ``perturbed`` flags of the op's differentiable operands' leaves.
      sets_perturbed: per quantizer set, the flags of its state leaves (empty for a stateless
        recipe or no set).

    Raises:
      FP8StateNotUpdatedError: under ``TE_JAX_STRICT_FP8_STATE=1``.
    """
    if not any(operands_perturbed):
        return
    if all(all(flags) for flags in sets_perturbed):  # each stateful set differentiated
        return
    if os.environ.get(STRICT_ENV, "").strip().lower() in _TRUE:
        raise FP8StateNotUpdatedError(_message(where))
    warnings.warn(_message(where), FP8StateNotUpdatedWarning, stacklevel=_user_stacklevel())


@functools.cache
def _library_paths() -> tuple[str, ...]:
    """Where the frames between the user's call and this check live: te_jax, JAX, Flax (a
    Linen ``apply``, an NNX transform), contextlib's wrappers."""
    paths = [os.path.dirname(os.path.abspath(__file__)) + os.sep, contextlib.__file__]
    for name in ("jax", "jaxlib", "flax", "optax"):
        spec = importlib.util.find_spec(name)
        for path in (spec.submodule_search_locations or []) if spec else []:
            paths.append(os.path.abspath(path) + os.sep)
    return tuple(paths)


def _user_stacklevel() -> int:
    """``warnings.warn``'s stacklevel that attributes the warning to the first frame outside
    those libraries: the user's line, so Python's filter shows it once per call site."""
    libs = _library_paths()
    frame, level = inspect.currentframe(), 0
    while frame is not None:
        level += 1
        if level > 2 and not os.path.abspath(frame.f_code.co_filename).startswith(libs):
            return level - 1  # levels counted from check_state_differentiated, the warn caller
        frame = frame.f_back
    return 1
