"""Linen modules: ``DenseGeneral``, ``LayerNorm``, ``LayerNormDenseGeneral``, ``LayerNormMLP``.

Each module makes its spec (``te_jax.module_specs``, the one the NNX module of the same name
makes) from its fields and its input's feature sizes, declares the parameters the spec
describes, with their logical axis names (``nn.with_logical_partitioning``, so a mesh and
logical axis rules shard them without touching the module), and calls the spec's ``apply``.

**Dtypes.** Parameters are stored in ``param_dtype`` (float32 by default). The computation runs
in ``dtype``, or, when ``dtype`` is ``None``, in the input's dtype (as TransformerEngine's
modules do; Flax's own layers would promote a bfloat16 input with float32 parameters to
float32): parameters are cast to it, and the output has it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from te_jax import layers
from te_jax.activation_types import ActivationLike
from te_jax.flax import kernel_cache, te_options
from te_jax.flax.fp8_state import FP8_COLLECTION, checked_quantizer_set
from te_jax.module_specs import (
    KERNEL_INIT,
    DenseGeneralSpec,
    LayerNormDenseGeneralSpec,
    LayerNormMLPSpec,
    LayerNormSpec,
    ParamSpec,
)
from te_jax.recipe import Recipe
from te_jax.sharding import ACT, EMBED, MLP, placed_initializer

__all__ = ["DenseGeneral", "LayerNorm", "LayerNormDenseGeneral", "LayerNormMLP"]

Initializer = Callable[..., jax.Array]
_KERNEL_INIT = KERNEL_INIT


# The fields' names in messages about sizes the input fixes (the NNX modules' arguments).
_FROM_INPUT = "the input's feature axes"


def _settings(module: nn.Module, spec_cls) -> dict:
    """The module's fields the spec is made from (``spec_cls.settings()``: the same names)."""
    return {name: getattr(module, name) for name in spec_cls.settings()}


def _param(module: nn.Module, spec: ParamSpec, where: str):
    """``module.param`` as ``spec`` describes it, with its logical axis names; variables given
    that do not fit this module (another shape, or none) are a te_jax error naming the fix."""
    name, shape = spec.name, spec.shape
    if module.has_variable("params", name):
        have = _stored_shape(module, name)
        if have != shape and _transformer_engine_layout(have, shape):
            raise ValueError(
                f"{where}: parameter {name!r} is {have} in the variables given, where this module "
                f"takes {shape}: TransformerEngine-JAX's non-gated layout (its axis of 1 for the "
                "gate); convert the variables with te_jax.flax.from_transformer_engine(module, "
                "variables)"
            )
        if have != shape:
            raise ValueError(
                f"{where}: parameter {name!r} is {have} in the variables given, but this module "
                f"and input make it {shape}: the variables come from a module with other fields "
                "(features, intermediate_dim, activation...) or another input size; build the "
                "module as it was when initialized, or initialize it again (module.init)"
            )
    elif not module.is_mutable_collection("params"):
        raise ValueError(
            f"{where}: the variables given have no parameter {name!r} (shape {shape}): they come "
            "from a module with other fields (use_bias, enable_layernorm, layernorm_type...); "
            "build the module as it was when initialized, or initialize it again (module.init)"
        )
    init = spec.init
    if spec.axes is not None:
        init = nn.with_logical_partitioning(placed_initializer(init, spec.axes), spec.axes)
    return module.param(name, init, shape, spec.dtype)


def _transformer_engine_layout(have: tuple, shape: tuple) -> bool:
    """``have`` is ``shape`` with TransformerEngine-JAX's axis of 1 before the last (its
    non-gated ``(H, 1, I)`` kernel, ``(1, I)`` bias)."""
    return len(have) == len(shape) + 1 and have[-2] == 1 and have[:-2] + have[-1:] == shape


def _declare(module: nn.Module, spec, where: str) -> dict:
    """Every parameter of ``spec`` declared in ``module``'s scope, by name."""
    return {p.name: _param(module, p, where) for p in spec.params()}


def _stored_shape(module: nn.Module, name: str) -> tuple[int, ...]:
    """The shape of the parameter ``name`` in the variables given (boxed or not)."""
    return tuple(nn.unbox(module.get_variable("params", name)).shape)


def _check_input(module, where: str, x_shape, axes, param: str) -> None:
    """The input's feature axes ``axes`` against the sizes the variables were initialized for
    (the leading axes of ``param``), before Flax's own shape error could name the parameter
    only."""
    if module.has_variable("params", param):
        stored = _stored_shape(module, param)
        built = stored[: len(axes)]
        layers.check_input_features(
            where,
            x_shape,
            axes,
            built,
            f"the module's variables were initialized for {built[0] if len(built) == 1 else built}"
            f" ({param} of shape {stored})",
            "initialize the module (module.init) on inputs of this size",
        )


def _norm_input(where: str, inputs) -> jax.Array:
    """A normed module's input ``(..., H)`` as an array (the spec casts it)."""
    x = jnp.asarray(inputs)
    if x.ndim == 0:
        raise ValueError(f"{where}: the input must have a feature axis (..., H), got a scalar")
    return x


def _quantizer_sets(module: nn.Module, spec, where: str) -> dict:
    """One ``QuantizerSet`` per GEMM of ``spec``, by its name."""
    return {g: checked_quantizer_set(module, spec.recipe, g, where) for g in spec.gemms}


class LayerNorm(nn.Module):
    """LayerNorm or RMSNorm over the last axis (``te_jax.module_specs.LayerNormSpec``).

    Parameters: ``scale (H,)`` (``γ - 1`` with ``zero_centered_gamma``) and, for
    ``"layernorm"``, ``ln_bias (H,)``.

    ``"layernorm"``: ``y = (x - mean) / sqrt(var + epsilon) · γ + β``; ``"rmsnorm"``:
    ``y = x / sqrt(mean(x²) + epsilon) · γ``; statistics in float32, ``y`` in the compute dtype.

    Example:
      >>> import jax, jax.numpy as jnp, te_jax.flax
      >>> norm = te_jax.flax.LayerNorm(layernorm_type="rmsnorm")
      >>> x = jnp.linspace(-1.0, 1.0, 128).reshape(4, 32)
      >>> variables = norm.init(jax.random.key(0), x)
      >>> sorted(variables["params"])                          # no ln_bias for RMSNorm
      ['scale']
      >>> y = norm.apply(variables, x)
      >>> bool(jnp.allclose(y, x / jnp.sqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6)))
      True
    """

    layernorm_type: str = "layernorm"
    epsilon: float = 1e-6
    zero_centered_gamma: bool = False
    scale_init: Initializer | None = None
    scale_axes: Sequence[str] = (EMBED,)
    ln_bias_init: Initializer = nn.initializers.zeros
    ln_bias_axes: Sequence[str] = (EMBED,)
    dtype: Any = None
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        """``x (..., H)`` → ``(..., H)`` in the compute dtype."""
        where = "te_jax.flax.LayerNorm"
        x = _norm_input(where, x)
        spec = LayerNormSpec.create(
            where, x.shape[-1], _FROM_INPUT, **_settings(self, LayerNormSpec)
        )
        _check_input(self, where, x.shape, (x.ndim - 1,), "scale")
        return spec.apply(x, _declare(self, spec, where))


class DenseGeneral(nn.Module):
    """``y = act(x · kernel + bias)`` over x's axes ``axis``
    (``te_jax.module_specs.DenseGeneralSpec``).

    Parameters: ``kernel (*in, *features)`` (gated activation: ``(*in, 2, *features)``) and,
    with ``use_bias``, ``bias (*features)`` (gated: ``(2, *features)``). Under a ``recipe`` the
    GEMMs run in FP8; delayed scaling's state is in ``"fp8_metas"`` (``fp8_collection``:
    ``"_overwrite_with_gradient"`` for Flax's ``TrainState.apply_gradients``).

    ``inputs (..., *in)`` → ``(..., *features)`` in the compute dtype (``dtype``, else the
    input's); the GEMM accumulates in float32 (``te_jax.dense``).

    Example:
      >>> import jax, jax.numpy as jnp, te_jax.flax
      >>> layer = te_jax.flax.DenseGeneral(16)
      >>> x = jnp.linspace(-1.0, 1.0, 128).reshape(4, 32)
      >>> variables = layer.init(jax.random.key(0), x)
      >>> jax.tree.map(jnp.shape, variables["params"])
      {'bias': (16,), 'kernel': (32, 16)}
      >>> y, p = layer.apply(variables, x), variables["params"]
      >>> hi = lambda a, b: jnp.dot(a, b, precision="highest")  # float32 on any GPU
      >>> bool(jnp.allclose(y, hi(x, p["kernel"]) + p["bias"], atol=1e-5))
      True
    """

    features: int | Sequence[int]
    axis: int | Sequence[int] = -1
    use_bias: bool = True
    activation: ActivationLike | None = None
    activation_params: Any = None
    kernel_init: Initializer = _KERNEL_INIT
    bias_init: Initializer = nn.initializers.zeros
    kernel_axes: Sequence[str | None] = ()
    bias_axes: Sequence[str | None] = ()
    dtype: Any = None
    param_dtype: Any = jnp.float32
    recipe: Recipe | None = None
    # Where delayed scaling's state lives: te_jax.flax.FP8_COLLECTIONS.
    fp8_collection: str = FP8_COLLECTION
    implementation: str | None = None
    # TransformerEngine-JAX's options (te_jax.flax.te_options): honoured, or refused clearly.
    input_axes: Sequence[str | None] | None = None
    transpose_batch_sequence: bool = False
    enable_low_rank_adaptation: bool = False

    def kernel_contractions(self) -> dict:
        """``{gemm: (kernel parameter, contracted axes)}`` (``te_jax.flax.quantize_kernels``)."""
        return {"kernel": ("kernel", 1 if isinstance(self.axis, int) else len(self.axis))}

    @nn.compact
    def __call__(self, inputs: jax.Array) -> jax.Array:
        """``inputs (..., *in)`` → ``(..., *features)`` in the compute dtype."""
        where = "te_jax.flax.DenseGeneral"
        te_options.check_unsupported(self, where)
        x = te_options.constrain_input(jnp.asarray(inputs), self.input_axes, where, "input_axes")
        axes = layers.normalize_axes(where, self.axis, x.ndim)
        spec = DenseGeneralSpec.create(
            where,
            tuple(x.shape[a] for a in axes),
            axes,
            {"in_features": _FROM_INPUT},
            **_settings(self, DenseGeneralSpec),
        )
        _check_input(self, where, x.shape, axes, "kernel")
        params = _declare(self, spec, where)
        sets = _quantizer_sets(self, spec, where)
        return spec.apply(x, params, sets, kernel_cache.cached(self, spec, params, sets))


class LayerNormDenseGeneral(nn.Module):
    """Norm, then ``DenseGeneral`` over the last axis: ``y = act(norm(x) · kernel + bias)``
    (``te_jax.module_specs.LayerNormDenseGeneralSpec``).

    Returns ``(y, ln_out)``; ``ln_out`` (the GEMM's input) is ``None`` unless
    ``return_layernorm_output``. Parameters: ``scale``, ``ln_bias`` (``"layernorm"``),
    ``kernel``, ``bias`` (with ``use_bias``), named as in ``LayerNorm`` and ``DenseGeneral``.

    ``inputs (..., H)`` → ``y (..., *features)`` and ``ln_out (..., H)``, in the compute dtype.

    Example:
      >>> import jax, jax.numpy as jnp, te_jax.flax
      >>> layer = te_jax.flax.LayerNormDenseGeneral(16, activation="gelu")
      >>> x = jnp.ones((4, 32), jnp.bfloat16)
      >>> variables = layer.init(jax.random.key(0), x)
      >>> sorted(variables["params"])
      ['kernel', 'ln_bias', 'scale']
      >>> y, ln_out = layer.apply(variables, x)
      >>> y.shape, ln_out.shape, y.dtype
      ((4, 16), (4, 32), dtype(bfloat16))
    """

    features: int | Sequence[int]
    enable_layernorm: bool = True
    layernorm_type: str = "layernorm"
    epsilon: float = 1e-6
    zero_centered_gamma: bool = False
    scale_init: Initializer | None = None
    scale_axes: Sequence[str] = (EMBED,)
    ln_bias_init: Initializer = nn.initializers.zeros
    ln_bias_axes: Sequence[str] = (EMBED,)
    use_bias: bool = False
    activation: ActivationLike | None = None
    activation_params: Any = None
    kernel_init: Initializer = _KERNEL_INIT
    bias_init: Initializer = nn.initializers.zeros
    kernel_axes: Sequence[str | None] = ()
    bias_axes: Sequence[str | None] = ()
    return_layernorm_output: bool = True
    dtype: Any = None
    param_dtype: Any = jnp.float32
    recipe: Recipe | None = None
    # Where delayed scaling's state lives: te_jax.flax.FP8_COLLECTIONS.
    fp8_collection: str = FP8_COLLECTION
    implementation: str | None = None
    # TransformerEngine-JAX's options (te_jax.flax.te_options): honoured, or refused clearly.
    axis: int | Sequence[int] = -1
    layernorm_input_axes: Sequence[str | None] | None = None
    dot_input_axes: Sequence[str | None] | None = None
    transpose_batch_sequence: bool = False
    enable_low_rank_adaptation: bool = False

    def kernel_contractions(self) -> dict:
        """``{gemm: (kernel parameter, contracted axes)}`` (``te_jax.flax.quantize_kernels``)."""
        return {"kernel": ("kernel", 1)}

    @nn.compact
    def __call__(self, inputs: jax.Array):
        """``inputs (..., H)`` → ``(y (..., *features), ln_out (..., H) or None)``."""
        where = "te_jax.flax.LayerNormDenseGeneral"
        te_options.check_unsupported(self, where, normed=True)
        x = _norm_input(where, inputs)
        x = te_options.constrain_input(x, self.layernorm_input_axes, where, "layernorm_input_axes")
        spec = LayerNormDenseGeneralSpec.create(
            where,
            x.shape[-1],
            {"in_features": _FROM_INPUT},
            **_settings(self, LayerNormDenseGeneralSpec),
        )
        _check_input(self, where, x.shape, (x.ndim - 1,), "kernel")
        params = _declare(self, spec, where)
        sets = _quantizer_sets(self, spec, where)
        return spec.apply(x, params, sets, kernel_cache.cached(self, spec, params, sets))


class LayerNormMLP(nn.Module):
    """The transformer MLP block (``te_jax.module_specs.LayerNormMLPSpec``):
    ``out = drop(act(norm(x) · wi_kernel + wi_bias)) · wo_kernel + wo_bias``.

    Parameters: ``scale`` and ``ln_bias`` (the norm, when ``enable_layernorm``), ``wi_kernel``
    ``(H, I)`` or, for a gated pair, ``(H, 2, I)`` (straight into the GEMM), ``wo_kernel (I,
    H)``, and with ``use_bias`` ``wi_bias`` ``(I,)`` / ``(2, I)`` and ``wo_bias (H,)``. Logical
    axes default to TE-JAX's; for a non-gated activation the ``"act"`` name is dropped.

    Returns ``(out, ln_out)``: ``ln_out`` is the first GEMM's input (``None`` unless
    ``return_layernorm_output``). Dropout on the intermediate activation takes the
    ``dropout_rng_name`` rng (``"dropout"``) unless ``deterministic``; without it (rate 0 or
    ``deterministic``) the two GEMMs are one ``te_jax.fused_mlp``, whose ``gelu_backward``
    (``"dact"``, ``"dgelu"``, ``"dgelu_bgrad"``) is this module's.

    ``inputs (..., H)`` → ``out (..., H)``, in the compute dtype.

    Example:
      >>> import jax, jax.numpy as jnp, flax.linen as nn, te_jax.flax
      >>> mlp = te_jax.flax.LayerNormMLP(intermediate_dim=64, activations=("silu", "linear"))
      >>> x = jnp.ones((4, 32), jnp.bfloat16)
      >>> variables = mlp.init(jax.random.key(0), x)
      >>> params = nn.unbox(variables["params"])
      >>> params["wi_kernel"].shape, params["wo_kernel"].shape     # gated (H, 2, I); (I, H)
      ((32, 2, 64), (64, 32))
      >>> out, ln_out = mlp.apply(variables, x, deterministic=True)
      >>> out.shape, out.dtype
      ((4, 32), dtype(bfloat16))
    """

    intermediate_dim: int = 2048
    activations: ActivationLike = ("gelu",)
    activation_params: Any = None
    use_bias: bool = False
    enable_layernorm: bool = True
    layernorm_type: str = "layernorm"
    epsilon: float = 1e-6
    zero_centered_gamma: bool = False
    scale_init: Initializer | None = None
    scale_axes: Sequence[str] = (EMBED,)
    ln_bias_init: Initializer = nn.initializers.zeros
    ln_bias_axes: Sequence[str] = (EMBED,)
    kernel_init: Initializer = _KERNEL_INIT
    kernel_axes_1: Sequence[str | None] = (EMBED, ACT, MLP)
    kernel_axes_2: Sequence[str | None] = (MLP, EMBED)
    bias_init: Initializer = nn.initializers.zeros
    bias_axes_1: Sequence[str | None] = (ACT, MLP)
    bias_axes_2: Sequence[str | None] = (EMBED,)
    intermediate_dropout_rate: float = 0.0
    intermediate_hidden_dropout_dims: Sequence[int] = ()
    dropout_rng_name: str = "dropout"
    return_layernorm_output: bool = True
    dtype: Any = None
    param_dtype: Any = jnp.float32
    recipe: Recipe | None = None
    # Where delayed scaling's state lives: te_jax.flax.FP8_COLLECTIONS.
    fp8_collection: str = FP8_COLLECTION
    implementation: str | None = None
    gelu_backward: str = "dact"
    # TransformerEngine-JAX's options (te_jax.flax.te_options): honoured, or refused clearly.
    intermediate_dropout_rng_name: str | None = None
    axis: int | Sequence[int] = -1
    layernorm_input_axes: Sequence[str | None] | None = None
    dot_1_input_axes: Sequence[str | None] | None = None
    dot_2_input_axes: Sequence[str | None] | None = None
    transpose_batch_sequence: bool = False
    enable_low_rank_adaptation: bool = False

    def kernel_contractions(self) -> dict:
        """``{gemm: (kernel parameter, contracted axes)}`` (``te_jax.flax.quantize_kernels``)."""
        return {"wi": ("wi_kernel", 1), "wo": ("wo_kernel", 1)}

    @nn.compact
    def __call__(self, inputs: jax.Array, deterministic: bool = False):
        """``inputs (..., H)`` → ``(out (..., H), ln_out (..., H) or None)``."""
        where = "te_jax.flax.LayerNormMLP"
        te_options.check_unsupported(self, where, normed=True)
        rng_name = te_options.dropout_rng_name(self, where)
        x = _norm_input(where, inputs)
        x = te_options.constrain_input(x, self.layernorm_input_axes, where, "layernorm_input_axes")
        spec = LayerNormMLPSpec.create(
            where, x.shape[-1], _FROM_INPUT, **_settings(self, LayerNormMLPSpec)
        )
        _check_input(self, where, x.shape, (x.ndim - 1,), "wi_kernel")
        params = _declare(self, spec, where)
        quantizer_sets = _quantizer_sets(self, spec, where)
        dropout = None
        if spec.dropout_active(deterministic):
            # Flax falls back to the "params" rng for a missing stream.
            if not self.has_rng(rng_name) and not self.has_rng("params"):
                raise ValueError(
                    f"{where}: intermediate_dropout_rate={self.intermediate_dropout_rate} draws "
                    f"from the {rng_name!r} rng, which apply was not given: pass "
                    f"rngs={{{rng_name!r}: key}}, or deterministic=True for no dropout"
                )
            drop = nn.Dropout(
                rate=spec.dropout_rate, broadcast_dims=spec.dropout_dims, rng_collection=rng_name
            )
            dropout = functools.partial(drop, deterministic=False)
        qks = kernel_cache.cached(self, spec, params, quantizer_sets)
        return spec.apply(x, params, quantizer_sets, dropout, quantized_kernels=qks)
