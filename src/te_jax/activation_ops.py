"""Public activation ops: ``act_lu``, ``dact_lu``, ``quantize_dact_dbias`` and the
differentiable ``activation``.

Every op takes ``implementation``:

* ``None`` (default): the FFI kernel where te_jax has one for the backend the op is lowered for,
  the pure-JAX ``te_jax.activation_reference`` path otherwise (and for float64 inputs);
* ``"ffi"``: the kernel; an error at trace time if there is none;
* ``"xla"``: the pure-JAX path.

The environment variable ``TE_JAX_IMPLEMENTATION=xla`` (read at trace time) forces the pure-JAX
path for every call that does not say ``implementation="ffi"``.

Differentiation (``jax.grad``, ``vjp``, ``jvp``, ``jacfwd``, ``hessian``, any order) works on every
path and gives the same values (docs/numerics.md §1's derivatives, §7's tolerances):

* ``act_lu`` (and ``activation``): reverse mode runs the forward kernel and the fused
  ``dact_lu`` kernel (the transpose of the primitive's tangent,
  ``te_jax.primitives.activation.autodiff``); forward mode evaluates ``f'(x)·ẋ`` in pure JAX.
  The pure-JAX path is ``te_jax.activation_reference.activation``, a ``custom_jvp`` with the
  same tangent.
* ``dact_lu`` / ``quantize_dact_dbias`` (dx and dbias): linear in ``dz``; their derivative in
  ``x`` (``f''``) is computed in pure JAX on every path.
* A quantized output (any op with a ``quantizer``, ``te_jax.quantize``) is not differentiable:
  a nonzero tangent reaching it raises ``TypeError`` at trace time (see
  ``te_jax.quantized_output``).

All checks below run at trace time, before any kernel, and raise ``TypeError`` / ``ValueError``
naming the argument, what was expected and what was received.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from te_jax import activation_reference, primitives
from te_jax.activation_types import ActivationLike, ActivationParams, ActivationType
from te_jax.dispatch import check_input_dtype, use_ffi
from te_jax.primitives.quantized import OpKind
from te_jax.quantize.quantizers import DelayedScaleQuantizer
from te_jax.quantize.scaled_tensor import gradient_from_cotangent
from te_jax.quantized_output import quantized_output

__all__ = ["act_lu", "dact_lu", "quantize_dact_dbias", "activation"]


def _check_x(op: str, x, act: ActivationType) -> None:
    check_input_dtype(f"te_jax.{op}", jnp.result_type(x))
    shape = jnp.shape(x)
    if act.is_gated:
        if len(shape) < 2 or shape[-2] != 2:
            raise ValueError(
                f"te_jax.{op}: {act.name.lower()} {act.names} is gated and takes x of shape "
                f"(..., 2, H) (activation input at index 0 of axis -2, linear input at index 1); "
                f"got shape {tuple(shape)}"
            )
    elif len(shape) < 1:
        raise ValueError(f"te_jax.{op}: x must have at least one axis (..., H), got a scalar")


def _check_dz(op: str, dz, x, act: ActivationType) -> None:
    want = act.output_shape(jnp.shape(x))
    if tuple(jnp.shape(dz)) != want:
        raise ValueError(
            f"te_jax.{op}: dz must have shape {want} (x's shape"
            + (" without the act axis" if act.is_gated else "")
            + f"), got {tuple(jnp.shape(dz))}"
        )
    if jnp.result_type(dz) != jnp.result_type(x):
        raise TypeError(
            f"te_jax.{op}: dz must have x's dtype {jnp.dtype(jnp.result_type(x)).name}, got "
            f"{jnp.dtype(jnp.result_type(dz)).name}"
        )


def _prepare(op, x, activation_type, act_params):
    act = ActivationType.parse(activation_type)
    params = ActivationParams.resolve(act, act_params)
    _check_x(op, x, act)
    return act, params


def act_lu(
    x: jax.Array,
    activation_type: ActivationLike = ("gelu",),
    quantizer=None,
    act_params: ActivationParams | None = None,
    implementation: str | None = None,
) -> jax.Array:
    """Activation forward, fused in one pass.

    Non-gated: ``y = f(x)``, ``(..., H) -> (..., H)``. Gated (``(act, "linear")``):
    ``y = f(x[..., 0, :]) * x[..., 1, :]``, ``(..., 2, H) -> (..., H)``. Computed in float32,
    rounded once to x's dtype.

    Args:
      x: float32, bfloat16 or float16 input (float64 is served by the pure-JAX path).
      activation_type: e.g. ``("gelu",)``, ``("silu", "linear")``, ``"swiglu"`` or an
        ``ActivationType``.
      quantizer: ``None``, or a ``te_jax.quantize`` quantizer: the output is then a
        ``ScaledTensor`` quantized in the same pass (two passes over x for current scaling and
        NVFP4), docs/numerics.md §4-§6.
      act_params: ``ActivationParams`` for clamped SwiGLU (defaults when ``None``).
      implementation: ``None``, ``"ffi"`` or ``"xla"`` (see the module docstring).

    Example:
      >>> import jax.numpy as jnp, te_jax
      >>> x = jnp.ones((4, 2, 8), jnp.bfloat16)            # gated: (..., 2, H)
      >>> y = te_jax.act_lu(x, "swiglu")
      >>> y.shape, y.dtype
      ((4, 8), dtype(bfloat16))
    """
    act, params = _prepare("act_lu", x, activation_type, act_params)
    if quantizer is not None:
        return quantized_output(
            "act_lu", OpKind.ACT, (x,), quantizer, act, params, implementation=implementation
        )
    if not use_ffi("act_lu", implementation, jnp.result_type(x)):
        return activation_reference.activation(x, act, params)  # act_lu with §1's derivatives
    return primitives.bind_act_lu(x, act, params)[0]


def quantize_dact_dbias(
    dz: jax.Array,
    x: jax.Array,
    activation_type: ActivationLike = ("gelu",),
    is_dbias: bool = True,
    quantizer=None,
    act_params: ActivationParams | None = None,
    implementation: str | None = None,
) -> tuple[jax.Array, jax.Array | None]:
    """Activation gradient and bias gradient, fused in one pass.

    ``dx = f'(x) * dz`` (gated: ``dx[..., 0, :] = f'(a)·dz·b``, ``dx[..., 1, :] = f(a)·dz``),
    with x's shape (a ``ScaledTensor`` with ``quantizer``); ``dbias`` is the float32 sum of dx
    over every axis but the feature axes, shape ``(H,)`` or ``(2, H)``, in x's dtype (``None``
    unless ``is_dbias``). Deterministic.

    Args:
      dz: upstream gradient, x's shape without the act axis, x's dtype.
      x: the activation's input.
      is_dbias: whether to compute dbias.
      Others as for ``act_lu``.

    Returns:
      ``(dx, dbias)``: dx ``(..., H)`` or gated ``(..., 2, H)`` in x's dtype; dbias ``(H,)`` /
      ``(2, H)`` in x's dtype, or ``None``.

    Example:
      >>> import jax.numpy as jnp, te_jax
      >>> x = jnp.linspace(-2.0, 2.0, 64).reshape(4, 2, 8)   # gated: (..., 2, H)
      >>> dz = jnp.ones((4, 8), jnp.float32)                  # x's shape without the 2
      >>> dx, dbias = te_jax.quantize_dact_dbias(dz, x, "swiglu")
      >>> dx.shape, dbias.shape
      ((4, 2, 8), (2, 8))
      >>> bool(jnp.allclose(dbias, dx.sum(axis=0)))
      True
    """
    op = "quantize_dact_dbias"
    act, params = _prepare(op, x, activation_type, act_params)
    _check_dz(op, dz, x, act)
    if quantizer is not None:
        return quantized_output(
            op, OpKind.DACT, (dz, x), quantizer, act, params, bool(is_dbias), implementation
        )
    if not use_ffi(op, implementation, jnp.result_type(x)):
        return activation_reference.quantize_dact_dbias(dz, x, act, is_dbias, params)
    outs = primitives.bind_dact_dbias(dz, x, act, params, bool(is_dbias))
    return outs[0], (outs[1] if is_dbias else None)


def dact_lu(
    dz: jax.Array,
    x: jax.Array,
    activation_type: ActivationLike = ("gelu",),
    quantizer=None,
    act_params: ActivationParams | None = None,
    implementation: str | None = None,
) -> jax.Array:
    """Activation gradient: ``quantize_dact_dbias(..., is_dbias=False)[0]``.

    ``dx = f'(x) · dz`` (gated: ``dx[..., 0, :] = f'(a)·dz·b``, ``dx[..., 1, :] = f(a)·dz``),
    computed in float32 and rounded once to x's dtype. ``dz`` has x's shape without the act
    axis and x's dtype; ``dx`` has x's shape and dtype (a ``ScaledTensor`` with
    ``quantizer``). Arguments as for ``quantize_dact_dbias``.

    Example:
      >>> import jax.numpy as jnp, te_jax
      >>> x, dy = jnp.ones((4, 8), jnp.float32), jnp.ones((4, 8), jnp.float32)
      >>> te_jax.dact_lu(dy, x, "gelu").shape
      (4, 8)
    """
    act, params = _prepare("dact_lu", x, activation_type, act_params)
    _check_dz("dact_lu", dz, x, act)
    if quantizer is not None:
        return quantized_output(
            "dact_lu", OpKind.DACT, (dz, x), quantizer, act, params, False, implementation
        )[0]
    if not use_ffi("dact_lu", implementation, jnp.result_type(x)):
        return activation_reference.dact_lu(dz, x, act, params)
    return primitives.bind_dact_dbias(dz, x, act, params, False)[0]


def activation(
    x: jax.Array,
    activation_type: ActivationLike = ("gelu",),
    act_params: ActivationParams | None = None,
    implementation: str | None = None,
    quantizer=None,
):
    """Differentiable activation: ``act_lu``, optionally quantized for the next FP8 GEMM.

    Without a quantizer: forward is the ``act_lu`` kernel; ``jax.grad`` runs the fused
    ``dact_lu`` kernel (the transpose of ``act_lu``'s tangent, no ``custom_vjp``), so ``jvp`` /
    ``jacfwd`` and second order work too (module docstring). Works under ``jit``, ``vmap``,
    ``grad``, ``checkpoint`` (and their compositions) and sharding.

    With a ``quantizer``: returns the ``ScaledTensor`` that ``act_lu(x, quantizer=quantizer)``
    gives (activation and quantization in one pass), for ``te_jax.dense`` to consume with no
    further quantize pass. It is differentiable in reverse mode (a ``custom_vjp``): the gradient
    arriving for the ScaledTensor is that of its dequantized value (``dense`` sends it, see
    ``te_jax.quantize.scaled_tensor``), and the backward is the fused ``dact_lu`` kernel on it
    (straight through the quantization). The cotangent of ``quantizer`` is the quantizer's next
    state (``quantizer.update(amax)`` for delayed scaling), the convention of ``te_jax.recipe``.
    Use a rowwise layout (``ROWWISE_COLWISE`` where ``dense`` is differentiated).

    Shapes and dtypes as for ``act_lu``: ``(..., H) -> (..., H)``, gated
    ``(..., 2, H) -> (..., H)``, in x's dtype. Its derivatives are docs/numerics.md §1's:
    ``relu'(0) = 0`` at the kink.

    Example:
      >>> import jax, jax.numpy as jnp, te_jax
      >>> x = jnp.array([-1.0, 0.0, 2.0])
      >>> jax.grad(lambda x: te_jax.activation(x, "relu").sum())(x).tolist()
      [0.0, 0.0, 1.0]
    """
    act, params = _prepare("activation", x, activation_type, act_params)
    if quantizer is None:
        return act_lu(x, act, act_params=params, implementation=implementation)
    return _quantized_activation(x, quantizer, act, params, implementation)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _quantized_activation(x, quantizer, act, params, implementation):
    return act_lu(x, act, quantizer, params, implementation)


def _quantized_activation_fwd(x, quantizer, act, params, implementation):
    st = act_lu(x, act, quantizer, params, implementation)
    amax = st.amax if isinstance(quantizer, DelayedScaleQuantizer) else None
    return st, (x, quantizer, amax)


def _quantized_activation_bwd(act, params, implementation, res, ct):
    x, quantizer, amax = res
    g = gradient_from_cotangent(ct, x.dtype)
    dx = dact_lu(g, x, act, act_params=params, implementation=implementation)
    return dx, (quantizer if amax is None else quantizer.update(amax))


_quantized_activation.defvjp(_quantized_activation_fwd, _quantized_activation_bwd)
