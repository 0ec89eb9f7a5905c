"""The functional layers under the Flax modules (``te_jax.flax`` for Linen, ``te_jax.nnx``).

The math under the modules' specs (``te_jax.module_specs``, one per module, which both the
Linen and the NNX module call), so both compute the same thing from the same parameters:

* ``dense_general``: ``te_jax.dense`` over any set of x's axes and any output shape;
* ``layernorm_mlp``: ``norm → dense(kernel_1, bias_1, act) → dropout → dense(kernel_2, bias_2)``
  (``te_jax.fused_mlp``, one op over both GEMMs, where there is no dropout);
* the parameter shapes and logical axis names of a dense and of an MLP block, and the kernel
  initialisation (fan-in over the contracted axes; a gated kernel's two halves each initialised
  as a ``(K, N)`` kernel).

Kernel layouts (docs/numerics.md §1, §8): a dense kernel is ``(*in, *features)``; for a gated
activation it is ``(*in, 2, *features)`` (the activation's columns at index 0 of the ``2`` axis,
the linear ones at 1), which ``te_jax.dense`` takes straight into its GEMM. The MLP's first
kernel is ``(H, I)``, or ``(H, 2, I)`` for a gated pair; its second ``(I, H)``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

import te_jax
from te_jax.activation_types import ActivationLike, ActivationParams, ActivationType
from te_jax.normalization import layernorm
from te_jax.recipe import QuantizerSet, Recipe
from te_jax.sequence_parallel import gather_sequence, split_sequence

__all__ = [
    "resolve_activation",
    "check_recipe",
    "check_dtype",
    "compute_dtype",
    "check_sizes",
    "check_input_features",
    "dense_general",
    "layernorm_mlp",
    "normalize_axes",
    "dense_kernel_shape",
    "mlp_kernel_1_shape",
    "fit_axes",
    "init_kernel",
]


def resolve_activation(
    where: str, activations: ActivationLike | None, activation_params
) -> tuple[ActivationType | None, ActivationParams | None]:
    """A module's ``activations`` and ``activation_params`` as ``(ActivationType or None,
    ActivationParams or None)``. ``activation_params`` may be an ``ActivationParams``, a
    ``ClampedSwiGLUParams`` or a dict of clamped SwiGLU's fields (``{"limit": 7.0}``, as
    TE-JAX's modules take it)."""
    if activations is None:
        if activation_params:
            raise ValueError(f"{where}: activation_params given without an activation")
        return None, None
    try:
        act = ActivationType.parse(activations)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    if isinstance(activation_params, Mapping):
        try:
            return act, ActivationParams.create(act, **activation_params)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{where}: activation_params {dict(activation_params)}: {e}") from None
    return act, ActivationParams.resolve(act, activation_params)


def check_recipe(where: str, recipe) -> Recipe | None:
    """``recipe`` if it is a ``te_jax.recipe`` recipe or ``None``, else a TypeError."""
    if isinstance(recipe, type) and issubclass(recipe, Recipe):
        raise TypeError(
            f"{where}: recipe must be a recipe instance, got the class {recipe.__name__}: write "
            f"{recipe.__name__}() (with its options)"
        )
    if recipe is not None and not isinstance(recipe, Recipe):
        raise TypeError(
            f"{where}: recipe must be te_jax.recipe.DelayedScaling(), CurrentScaling(), "
            f"MXFP8BlockScaling(), Float8BlockScaling() or None, got {type(recipe).__name__}"
        )
    return recipe


_MODULE_DTYPES = tuple(jnp.dtype(d) for d in (jnp.float32, jnp.bfloat16, jnp.float16, jnp.float64))
_MODULE_DTYPE_NAMES = "float32, bfloat16 or float16 (or float64)"


def check_dtype(where: str, field: str, value) -> jnp.dtype:
    """A module's dtype field (``dtype``, ``param_dtype``) as a dtype the modules compute or
    store in, or a TypeError naming the field and the value."""
    try:
        dt = jnp.dtype(value)
    except TypeError:
        raise TypeError(
            f"{where}: {field}={value!r} is not a dtype; use jnp.float32, jnp.bfloat16 or "
            "jnp.float16"
        ) from None
    if dt not in _MODULE_DTYPES:
        raise TypeError(f"{where}: {field} must be {_MODULE_DTYPE_NAMES}, got {dt.name}")
    return dt


def compute_dtype(where: str, dtype, x) -> jnp.dtype:
    """The dtype a module computes in: its ``dtype`` field, or (``None``) the input's, which must
    then be one the modules compute in."""
    if dtype is not None:
        return check_dtype(where, "dtype", dtype)
    dt = jnp.dtype(jnp.result_type(x))
    if dt not in _MODULE_DTYPES:
        raise TypeError(
            f"{where}: the input is {dt.name}; the module computes in {_MODULE_DTYPE_NAMES}: "
            "cast the input, or set the module's dtype= to one of them"
        )
    return dt


def check_sizes(where: str, field: str, value, sequence: bool = True) -> tuple[int, ...]:
    """A module's size field (``features``, ``hidden_size``...: a positive int, or where
    ``sequence`` a sequence of them) as a tuple; a TypeError / ValueError naming the field."""
    sizes = tuple(value) if sequence and isinstance(value, Sequence) else (value,)
    kind = "a positive int" + (" or a sequence of them" if sequence else "")
    # bool is an int subclass, never a size.
    if not sizes or any(isinstance(v, bool) or not isinstance(v, (int, np.integer)) for v in sizes):
        raise TypeError(f"{where}: {field} must be {kind}, got {value!r}")
    if any(v <= 0 for v in sizes):
        raise ValueError(f"{where}: {field} must be {kind}, got {value!r}")
    return tuple(int(v) for v in sizes)


def check_input_features(
    where: str, x_shape, axes: Sequence[int] | None, built: Sequence[int], built_for: str, fix: str
) -> None:
    """The input's feature axes (``axes``; ``None``: its trailing ``len(built)``) against the
    sizes ``built`` the module's parameters were made for: a ValueError naming the input's
    shape, ``built_for`` (what fixed ``built``) and ``fix`` (the other way out)."""
    x_shape, built = tuple(x_shape), tuple(built)
    n = len(built)
    want = f"(..., {', '.join(map(str, built))})"
    if axes is None:
        if len(x_shape) < n:
            axes_text = "no feature axis" if n == 1 else f"fewer than {n} axes"
            raise ValueError(
                f"{where}: the input (shape {x_shape}) has {axes_text}, but {built_for}: give it "
                f"inputs of shape {want}"
            )
        axes = tuple(range(len(x_shape) - n, len(x_shape)))
    got = tuple(x_shape[a] for a in axes)
    if got == built:
        return
    if tuple(axes) != tuple(range(len(x_shape) - n, len(x_shape))):
        which, want = f"axes {tuple(axes)} are {got}", f"axes {tuple(axes)} of sizes {built}"
    elif n == 1:
        which = f"last axis has size {got[0]}"
    else:
        which = f"last {n} axes are {got}"
    raise ValueError(
        f"{where}: the input's {which} (input shape {x_shape}), but {built_for}: give it "
        f"inputs of shape {want}, or {fix}"
    )


def normalize_axes(where: str, axis: int | Sequence[int], ndim: int) -> tuple[int, ...]:
    """``axis`` (an int or a sequence, negative allowed) as sorted non-negative axes of an
    ``ndim``-dimensional input; a ValueError for an axis out of range or given twice."""
    axes = (axis,) if isinstance(axis, int) else tuple(axis)
    out = []
    for a in axes:
        if not isinstance(a, int) or not -ndim <= a < ndim:
            raise ValueError(f"{where}: axis {a!r} is out of range for an input of rank {ndim}")
        out.append(a % ndim)
    if len(set(out)) != len(out):
        raise ValueError(f"{where}: axis {axis!r} names an axis twice")
    return tuple(sorted(out))


def dense_kernel_shape(
    in_shape: Sequence[int], features: Sequence[int], act: ActivationType | None
) -> tuple[int, ...]:
    """The kernel of a dense from ``in_shape`` (the contracted axes) to ``features``:
    ``(*in, *features)``, or ``(*in, 2, *features)`` for a gated activation."""
    gate = (2,) if act is not None and act.is_gated else ()
    return (*in_shape, *gate, *features)


def mlp_kernel_1_shape(hidden: int, intermediate: int, act: ActivationType) -> tuple[int, ...]:
    """The MLP's first kernel: ``(H, I)``, or ``(H, 2, I)`` for a gated pair."""
    return dense_kernel_shape((hidden,), (intermediate,), act)


def fit_axes(where: str, axes: Sequence[str | None], shape: Sequence[int], drop_gate: bool):
    """Logical axis names for a parameter of ``shape``: ``axes`` as given when their count
    matches; ``None`` for no names (``()``). With ``drop_gate`` (the MLP's first kernel or bias
    under a non-gated activation) one name too many drops the gate axis's (index ``-2`` of the
    kernel, ``0`` of the bias: TE-JAX's ``"act"``), so TE-JAX's default names fit both."""
    axes = tuple(axes)
    if not axes:
        return None
    if len(axes) == len(shape):
        return axes
    if drop_gate and len(axes) == len(shape) + 1:
        gate = len(axes) - 2 if len(shape) > 1 else 0
        return axes[:gate] + axes[gate + 1 :]
    raise ValueError(
        f"{where}: {len(axes)} logical axis names {axes} for a parameter of shape {tuple(shape)}"
    )


def init_kernel(init: Callable, key, shape: Sequence[int], n_in: int, gated: bool, dtype):
    """A kernel of ``shape`` from ``init``, which is called on the 2-D ``(K, N)`` matrix (``K``
    the product of the ``n_in`` contracted axes, ``N`` of the output axes) so its fan-in is
    ``K``; a gated kernel's two halves are initialised separately (each a ``(K, N)`` kernel)."""
    shape = tuple(shape)
    k = math.prod(shape[:n_in])
    if not gated:
        return jnp.reshape(init(key, (k, math.prod(shape[n_in:])), dtype), shape)
    n = math.prod(shape[n_in + 1 :])
    halves = [init(kk, (k, n), dtype) for kk in jax.random.split(key, 2)]
    return jnp.reshape(jnp.stack(halves, axis=1), shape)


def dense_general(
    x: jax.Array,
    kernel: jax.Array,
    bias: jax.Array | None = None,
    *,
    axis: int | Sequence[int] = -1,
    activation_type: ActivationLike | None = None,
    act_params: ActivationParams | None = None,
    quantizer_set: QuantizerSet | None = None,
    implementation: str | None = None,
    kernel_axes: Sequence[str | None] | None = None,
    quantized_kernel=None,
) -> jax.Array:
    """``y = act(x · kernel + bias)`` contracting x's axes ``axis`` (any of them, in order) with
    the kernel's leading axes.

    Args:
      x: ``(..., *in)`` with the contracted axes ``axis`` (moved to the end first where they are
        not already trailing).
      kernel: ``(*in, *F)``; gated: ``(*in, 2, *F)``.
      bias: ``None``, ``F`` or (gated) ``(2, *F)``.
      kernel_axes: the kernel's logical axis names (``te_jax.dense``'s ``kernel_axes``).
      quantized_kernel: ``te_jax.dense``'s (``te_jax.quantize_kernel(kernel, quantizer_set,
        n_contracting=len(axis))``).

    Returns:
      ``(*batch, *F)``: x's other axes in order, then the features.
    """
    where = "te_jax.layers.dense_general"
    act = None if activation_type is None else ActivationType.parse(activation_type)
    axes = normalize_axes(where, axis, jnp.ndim(x))
    n = len(axes)
    trailing = tuple(range(jnp.ndim(x) - n, jnp.ndim(x)))
    if axes != trailing:
        x = jnp.moveaxis(x, axes, trailing)
    gated = act is not None and act.is_gated
    features = jnp.shape(kernel)[n + 1 if gated else n :]
    if gated and len(features) != 1:
        # dense takes a gated kernel as (K..., 2, N): fold the feature axes into N.
        kernel = jnp.reshape(kernel, (*jnp.shape(kernel)[: n + 1], math.prod(features)))
        kernel_axes = None  # the folded axis has no single name
        if bias is not None:
            bias = jnp.reshape(bias, (2, math.prod(features)))
    y = te_jax.dense(
        x,
        kernel,
        bias,
        activation_type=act,
        quantizer_set=quantizer_set,
        act_params=act_params,
        contracting_dims=(trailing, tuple(range(n))),
        implementation=implementation,
        kernel_axes=kernel_axes,
        quantized_kernel=quantized_kernel,
    )
    return jnp.reshape(y, (*jnp.shape(y)[:-1], *features)) if gated else y


def layernorm_mlp(
    x: jax.Array,
    kernel_1: jax.Array,
    kernel_2: jax.Array,
    bias_1: jax.Array | None = None,
    bias_2: jax.Array | None = None,
    gamma: jax.Array | None = None,
    beta: jax.Array | None = None,
    *,
    activation_type: ActivationLike = ("gelu",),
    act_params: ActivationParams | None = None,
    layernorm_type: str = "layernorm",
    zero_centered_gamma: bool = False,
    epsilon: float = 1e-6,
    quantizer_sets: tuple[QuantizerSet | None, QuantizerSet | None] = (None, None),
    dropout: Callable[[jax.Array], jax.Array] | None = None,
    implementation: str | None = None,
    kernel_axes: tuple[Sequence[str | None] | None, Sequence[str | None] | None] = (None, None),
    gelu_backward: str = "dact",
    ckpt_name: str = "ffn2",
    quantized_kernels=(None, None),
) -> tuple[jax.Array, jax.Array]:
    """The transformer MLP block: ``out = dense(drop(act(norm(x) · W1 + b1)) · W2 + b2)``.

    Args:
      x: ``(..., H)``; the compute dtype.
      kernel_1: ``(H, I)``, gated ``(H, 2, I)``; kernel_2: ``(I, H)``.
      bias_1: ``None``, ``(I,)`` or gated ``(2, I)``; bias_2: ``None`` or ``(H,)``.
      gamma, beta: the norm's ``(H,)`` parameters; ``gamma=None`` skips the norm.
      quantizer_sets: one ``QuantizerSet`` (or ``None``) per GEMM.
      dropout: applied to the activation's output, ``None`` for none. Without it the two
        GEMMs are one ``te_jax.fused_mlp`` (fusions across the GEMM boundary, same math).
      kernel_axes: each kernel's logical axis names (``te_jax.dense``'s ``kernel_axes``).
      gelu_backward: ``te_jax.fused_mlp``'s (where the GELU backward runs; no dropout only).
      ckpt_name: the remat checkpoint name of ``out`` (TE-JAX's ``ffn2``); the GEMMs'
        residuals carry ``te_jax.fused_mlp``'s (``ffn1``, ``ffn1_input``, ...).
      quantized_kernels: ``te_jax.fused_mlp``'s (each kernel quantized once ahead, or ``None``).

    Returns:
      ``(out (..., H), ln_out (..., H))``: ``ln_out`` is the first GEMM's input (x itself
      without a norm).
    """
    ln_out = x
    if gamma is not None:
        ln_out = layernorm(
            x,
            gamma,
            beta,
            layernorm_type=layernorm_type,
            zero_centered_gamma=zero_centered_gamma,
            epsilon=epsilon,
        )
    # Sequence parallelism: the block's input arrives split along the sequence; the GEMMs take
    # it whole (all-gather) and give their output back split (reduce-scatter).
    h_in = gather_sequence(ln_out)
    if dropout is None:
        out = te_jax.fused_mlp(
            h_in,
            kernel_1,
            kernel_2,
            bias_1,
            bias_2,
            activation_type,
            quantizer_sets,
            act_params=act_params,
            implementation=implementation,
            kernel_axes=kernel_axes,
            gelu_backward=gelu_backward,
            quantized_kernels=quantized_kernels,
        )
        return checkpoint_name(split_sequence(out), ckpt_name), ln_out
    # Dropout sits between the GEMMs: two dense calls around it.
    h = te_jax.dense(
        h_in,
        kernel_1,
        bias_1,
        activation_type=activation_type,
        quantizer_set=quantizer_sets[0],
        act_params=act_params,
        implementation=implementation,
        kernel_axes=kernel_axes[0],
        quantized_kernel=quantized_kernels[0],
    )
    out = te_jax.dense(
        dropout(h),
        kernel_2,
        bias_2,
        quantizer_set=quantizer_sets[1],
        implementation=implementation,
        kernel_axes=kernel_axes[1],
        quantized_kernel=quantized_kernels[1],
    )
    return checkpoint_name(split_sequence(out), ckpt_name), ln_out
