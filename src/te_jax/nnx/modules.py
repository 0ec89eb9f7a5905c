"""NNX modules: ``Linear``, ``LayerNorm``, ``LayerNormLinear``, ``LayerNormMLP``.

The same computation and parameter names as the Linen modules of ``te_jax.flax`` (both wrap
``te_jax.layers``), with explicit ``rngs`` and typed Variables: ``nnx.Param`` for the trained
parameters (logical axis names as ``out_sharding`` metadata, as ``nnx.with_partitioning``
gives), ``FP8Meta`` for delayed scaling's state.

**Dtypes.** Parameters are stored in ``param_dtype`` (float32 by default); the computation runs
in ``dtype``, or in the input's dtype when ``dtype`` is ``None``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from te_jax import layers
from te_jax.activation_types import ActivationLike
from te_jax.nnx.fp8_state import QuantizerState
from te_jax.normalization import check_norm_type, layernorm
from te_jax.recipe import Recipe

__all__ = ["Linear", "LayerNorm", "LayerNormLinear", "LayerNormMLP"]

Initializer = Callable[..., jax.Array]
_KERNEL_INIT = nnx.initializers.variance_scaling(1.0, "fan_in", "truncated_normal")


def _param(value, axes) -> nnx.Param:
    """``nnx.Param(value)`` with logical axis names ``axes`` (``None``: none). Inside a mesh
    context Flax shards the value as it is created (eager sharding); outside one the names are
    only recorded, for ``nnx.get_partition_spec`` later."""
    if axes is None:
        return nnx.Param(value)
    eager = None if not jax.sharding.get_abstract_mesh().empty else False
    return nnx.Param(value, out_sharding=tuple(axes), eager_sharding=eager)


def _logical_axes(param: nnx.Param):
    """A parameter's logical axis names (``None``: none given)."""
    return param.get_metadata().get("out_sharding")


def _compute_dtype(where: str, dtype, x):
    return layers.compute_dtype(where, dtype, x)


def _check_dtypes(where: str, dtype, param_dtype) -> None:
    """The constructor's dtypes, checked where they are written rather than at the first call."""
    if dtype is not None:
        layers.check_dtype(where, "dtype", dtype)
    layers.check_dtype(where, "param_dtype", param_dtype)


def _check_input(where: str, x, field: str, built: tuple[int, ...]) -> None:
    """The input's trailing feature axes against the sizes the module was built for (its
    constructor's ``field``), before a lower layer names only its own operands."""
    shape, n = tuple(jnp.shape(x)), len(built)
    show = (lambda t: t[0]) if n == 1 else (lambda t: t)  # noqa: E731
    got = shape[len(shape) - n :] if len(shape) >= n else None
    layers.check_input_features(
        where,
        shape,
        None,
        built,
        f"the module was built with {field}={show(built)}",
        f"build it with {field}={show(got)}" if got is not None else "",
    )


class _Norm:
    """The norm's parameters (``scale``, ``ln_bias``) set on a module, and its application."""

    @staticmethod
    def setup(
        module,
        hidden,
        layernorm_type,
        epsilon,
        zero_centered_gamma,
        scale_init,
        scale_axes,
        ln_bias_init,
        ln_bias_axes,
        param_dtype,
        rngs,
        where,
    ):
        module.layernorm_type = check_norm_type(where, layernorm_type)
        module.epsilon = epsilon
        module.zero_centered_gamma = zero_centered_gamma
        init = scale_init or (
            nnx.initializers.zeros if zero_centered_gamma else nnx.initializers.ones
        )
        module.scale = _param(
            init(rngs.params(), (hidden,), param_dtype),
            layers.fit_axes(where, scale_axes, (hidden,), False),
        )
        module.ln_bias = (
            None
            if module.layernorm_type != "layernorm"
            else _param(
                ln_bias_init(rngs.params(), (hidden,), param_dtype),
                layers.fit_axes(where, ln_bias_axes, (hidden,), False),
            )
        )

    @staticmethod
    def apply(module, x):
        return layernorm(
            x,
            module.scale[...],
            None if module.ln_bias is None else module.ln_bias[...],
            layernorm_type=module.layernorm_type,
            zero_centered_gamma=module.zero_centered_gamma,
            epsilon=module.epsilon,
        )


class LayerNorm(nnx.Module):
    """LayerNorm or RMSNorm over the last axis (``te_jax.normalization.layernorm``).

    Parameters: ``scale (H,)`` (``γ - 1`` with ``zero_centered_gamma``) and, for
    ``"layernorm"``, ``ln_bias (H,)``.
    """

    def __init__(
        self,
        num_features: int,
        *,
        layernorm_type: str = "layernorm",
        epsilon: float = 1e-6,
        zero_centered_gamma: bool = False,
        scale_init: Initializer | None = None,
        scale_axes: Sequence[str] = ("embed",),
        ln_bias_init: Initializer = nnx.initializers.zeros,
        ln_bias_axes: Sequence[str] = ("embed",),
        dtype: Any = None,
        param_dtype: Any = jnp.float32,
        rngs: nnx.Rngs,
    ):
        where = "te_jax.nnx.LayerNorm"
        _check_dtypes(where, dtype, param_dtype)
        num_features = layers.check_sizes(where, "num_features", num_features, False)[0]
        self.dtype = dtype
        _Norm.setup(
            self,
            num_features,
            layernorm_type,
            epsilon,
            zero_centered_gamma,
            scale_init,
            scale_axes,
            ln_bias_init,
            ln_bias_axes,
            param_dtype,
            rngs,
            where,
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        """``x (..., H)`` → ``(..., H)`` in the compute dtype."""
        where = "te_jax.nnx.LayerNorm"
        x = jnp.asarray(x)
        _check_input(where, x, "num_features", self.scale.shape)
        return _Norm.apply(self, x.astype(_compute_dtype(where, self.dtype, x)))


class _Dense:
    """A dense's parameters (``kernel``, ``bias``) and quantizers set on a module, and its
    application (``te_jax.layers.dense_general`` over x's trailing ``in_features`` axes)."""

    @staticmethod
    def setup(
        module,
        in_features,
        out_features,
        use_bias,
        activation,
        activation_params,
        kernel_init,
        bias_init,
        kernel_axes,
        bias_axes,
        param_dtype,
        recipe,
        implementation,
        rngs,
        where,
    ):
        module.act, module.act_params = layers.resolve_activation(
            where, activation, activation_params
        )
        module.implementation = implementation
        in_shape = layers.check_sizes(where, "in_features", in_features)
        features = layers.check_sizes(where, "out_features", out_features)
        gated = module.act is not None and module.act.is_gated
        k_shape = layers.dense_kernel_shape(in_shape, features, module.act)
        module.n_in = len(in_shape)
        module.kernel = _param(
            layers.init_kernel(
                kernel_init, rngs.params(), k_shape, len(in_shape), gated, param_dtype
            ),
            layers.fit_axes(where, kernel_axes, k_shape, False),
        )
        b_shape = k_shape[len(in_shape) :]
        module.bias = (
            None
            if not use_bias
            else _param(
                bias_init(rngs.params(), b_shape, param_dtype),
                layers.fit_axes(where, bias_axes, b_shape, False),
            )
        )
        module.quantizers = QuantizerState(layers.check_recipe(where, recipe))

    @staticmethod
    def apply(module, x):
        return layers.dense_general(
            x,
            module.kernel[...],
            None if module.bias is None else module.bias[...],
            axis=tuple(range(-module.n_in, 0)),
            activation_type=module.act,
            act_params=module.act_params,
            quantizer_set=module.quantizers(),
            implementation=module.implementation,
            kernel_axes=_logical_axes(module.kernel),
        )


class Linear(nnx.Module):
    """``y = act(x · kernel + bias)`` over x's trailing ``in_features`` axes.

    Parameters: ``kernel (*in_features, *out_features)`` (gated activation: ``(*in, 2,
    *out)``) and, with ``use_bias``, ``bias (*out_features)`` (gated ``(2, *out)``). Under a
    ``recipe`` the GEMMs run in FP8; delayed scaling's state is in ``quantizers``.
    """

    def __init__(
        self,
        in_features: int | Sequence[int],
        out_features: int | Sequence[int],
        *,
        use_bias: bool = True,
        activation: ActivationLike | None = None,
        activation_params: Any = None,
        kernel_init: Initializer = _KERNEL_INIT,
        bias_init: Initializer = nnx.initializers.zeros,
        kernel_axes: Sequence[str | None] = (),
        bias_axes: Sequence[str | None] = (),
        dtype: Any = None,
        param_dtype: Any = jnp.float32,
        recipe: Recipe | None = None,
        implementation: str | None = None,
        rngs: nnx.Rngs,
    ):
        _check_dtypes("te_jax.nnx.Linear", dtype, param_dtype)
        self.dtype = dtype
        _Dense.setup(
            self,
            in_features,
            out_features,
            use_bias,
            activation,
            activation_params,
            kernel_init,
            bias_init,
            kernel_axes,
            bias_axes,
            param_dtype,
            recipe,
            implementation,
            rngs,
            "te_jax.nnx.Linear",
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        """``x (..., *in_features)`` → ``(..., *out_features)`` in the compute dtype."""
        where = "te_jax.nnx.Linear"
        x = jnp.asarray(x)
        _check_input(where, x, "in_features", self.kernel.shape[: self.n_in])
        return _Dense.apply(self, x.astype(_compute_dtype(where, self.dtype, x)))


class LayerNormLinear(nnx.Module):
    """Norm, then ``Linear`` over the last axis: ``y = act(norm(x) · kernel + bias)``.

    Returns ``(y, ln_out)`` (``ln_out``, the GEMM's input, ``None`` unless
    ``return_layernorm_output``). Parameters: ``scale``, ``ln_bias``, ``kernel``, ``bias``.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int | Sequence[int],
        *,
        enable_layernorm: bool = True,
        layernorm_type: str = "layernorm",
        epsilon: float = 1e-6,
        zero_centered_gamma: bool = False,
        scale_init: Initializer | None = None,
        scale_axes: Sequence[str] = ("embed",),
        ln_bias_init: Initializer = nnx.initializers.zeros,
        ln_bias_axes: Sequence[str] = ("embed",),
        use_bias: bool = False,
        activation: ActivationLike | None = None,
        activation_params: Any = None,
        kernel_init: Initializer = _KERNEL_INIT,
        bias_init: Initializer = nnx.initializers.zeros,
        kernel_axes: Sequence[str | None] = (),
        bias_axes: Sequence[str | None] = (),
        return_layernorm_output: bool = True,
        dtype: Any = None,
        param_dtype: Any = jnp.float32,
        recipe: Recipe | None = None,
        implementation: str | None = None,
        rngs: nnx.Rngs,
    ):
        where = "te_jax.nnx.LayerNormLinear"
        _check_dtypes(where, dtype, param_dtype)
        if enable_layernorm:  # the norm is over one axis
            in_features = layers.check_sizes(where, "in_features", in_features, False)[0]
        self.dtype = dtype
        self.enable_layernorm = enable_layernorm
        self.return_layernorm_output = return_layernorm_output
        if enable_layernorm:
            _Norm.setup(
                self,
                in_features,
                layernorm_type,
                epsilon,
                zero_centered_gamma,
                scale_init,
                scale_axes,
                ln_bias_init,
                ln_bias_axes,
                param_dtype,
                rngs,
                where,
            )
        _Dense.setup(
            self,
            in_features,
            out_features,
            use_bias,
            activation,
            activation_params,
            kernel_init,
            bias_init,
            kernel_axes,
            bias_axes,
            param_dtype,
            recipe,
            implementation,
            rngs,
            where,
        )

    def __call__(self, x: jax.Array):
        """``x (..., H)`` → ``(y (..., *out_features), ln_out (..., H) or None)``."""
        where = "te_jax.nnx.LayerNormLinear"
        x = jnp.asarray(x)
        _check_input(where, x, "in_features", self.kernel.shape[: self.n_in])
        x = x.astype(_compute_dtype(where, self.dtype, x))
        ln_out = _Norm.apply(self, x) if self.enable_layernorm else x
        return _Dense.apply(self, ln_out), (ln_out if self.return_layernorm_output else None)


class LayerNormMLP(nnx.Module):
    """The transformer MLP block (``te_jax.layers.layernorm_mlp``):
    ``out = drop(act(norm(x) · wi_kernel + wi_bias)) · wo_kernel + wo_bias``.

    Parameters as the Linen ``te_jax.flax.LayerNormMLP``'s: ``scale``, ``ln_bias``,
    ``wi_kernel`` ``(H, I)`` / gated ``(H, 2, I)``, ``wo_kernel (I, H)``, ``wi_bias``,
    ``wo_bias``; the GEMMs' quantizers in ``wi_quantizers`` / ``wo_quantizers``.

    Returns ``(out, ln_out)``. Dropout (``intermediate_dropout_rate``) draws from ``rngs``'
    ``dropout`` stream; it is off under ``deterministic=True`` or after ``model.eval()``.
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_dim: int,
        *,
        activations: ActivationLike = ("gelu",),
        activation_params: Any = None,
        use_bias: bool = False,
        enable_layernorm: bool = True,
        layernorm_type: str = "layernorm",
        epsilon: float = 1e-6,
        zero_centered_gamma: bool = False,
        scale_init: Initializer | None = None,
        scale_axes: Sequence[str] = ("embed",),
        ln_bias_init: Initializer = nnx.initializers.zeros,
        ln_bias_axes: Sequence[str] = ("embed",),
        kernel_init: Initializer = _KERNEL_INIT,
        kernel_axes_1: Sequence[str | None] = ("embed", "act", "mlp"),
        kernel_axes_2: Sequence[str | None] = ("mlp", "embed"),
        bias_init: Initializer = nnx.initializers.zeros,
        bias_axes_1: Sequence[str | None] = ("act", "mlp"),
        bias_axes_2: Sequence[str | None] = ("embed",),
        intermediate_dropout_rate: float = 0.0,
        intermediate_hidden_dropout_dims: Sequence[int] = (),
        return_layernorm_output: bool = True,
        dtype: Any = None,
        param_dtype: Any = jnp.float32,
        recipe: Recipe | None = None,
        implementation: str | None = None,
        rngs: nnx.Rngs,
    ):
        where = "te_jax.nnx.LayerNormMLP"
        act, self.act_params = layers.resolve_activation(where, activations, activation_params)
        if act is None:
            raise ValueError(f"{where}: activations must name an activation, got None")
        if not 0.0 <= intermediate_dropout_rate < 1.0:
            raise ValueError(
                f"{where}: intermediate_dropout_rate must be in [0, 1), got "
                f"{intermediate_dropout_rate}"
            )
        recipe = layers.check_recipe(where, recipe)
        _check_dtypes(where, dtype, param_dtype)
        hidden_size = layers.check_sizes(where, "hidden_size", hidden_size, False)[0]
        intermediate_dim = layers.check_sizes(where, "intermediate_dim", intermediate_dim, False)[0]
        self.act, self.dtype, self.implementation = act, dtype, implementation
        self.enable_layernorm = enable_layernorm
        self.return_layernorm_output = return_layernorm_output
        self.layernorm_type = check_norm_type(where, layernorm_type)
        self.epsilon, self.zero_centered_gamma = epsilon, zero_centered_gamma
        if enable_layernorm:
            _Norm.setup(
                self,
                hidden_size,
                layernorm_type,
                epsilon,
                zero_centered_gamma,
                scale_init,
                scale_axes,
                ln_bias_init,
                ln_bias_axes,
                param_dtype,
                rngs,
                where,
            )
        else:
            self.scale = self.ln_bias = None
        gated = act.is_gated
        k1_shape = layers.mlp_kernel_1_shape(hidden_size, intermediate_dim, act)
        k2_shape = (intermediate_dim, hidden_size)
        self.wi_kernel = _param(
            layers.init_kernel(kernel_init, rngs.params(), k1_shape, 1, gated, param_dtype),
            layers.fit_axes(where, kernel_axes_1, k1_shape, not gated),
        )
        self.wo_kernel = _param(
            layers.init_kernel(kernel_init, rngs.params(), k2_shape, 1, False, param_dtype),
            layers.fit_axes(where, kernel_axes_2, k2_shape, False),
        )
        if use_bias:
            self.wi_bias = _param(
                bias_init(rngs.params(), k1_shape[1:], param_dtype),
                layers.fit_axes(where, bias_axes_1, k1_shape[1:], not gated),
            )
            self.wo_bias = _param(
                bias_init(rngs.params(), (hidden_size,), param_dtype),
                layers.fit_axes(where, bias_axes_2, (hidden_size,), False),
            )
        else:
            self.wi_bias = self.wo_bias = None
        self.dropout = (
            None
            if intermediate_dropout_rate == 0.0
            else nnx.Dropout(
                intermediate_dropout_rate,
                broadcast_dims=tuple(intermediate_hidden_dropout_dims),
                rngs=rngs,
            )
        )
        self.wi_quantizers = QuantizerState(recipe)
        self.wo_quantizers = QuantizerState(recipe)

    def __call__(self, x: jax.Array, deterministic: bool | None = None):
        """``x (..., H)`` → ``(out (..., H), ln_out (..., H) or None)``."""
        where = "te_jax.nnx.LayerNormMLP"
        x = jnp.asarray(x)
        _check_input(where, x, "hidden_size", self.wi_kernel.shape[:1])
        x = x.astype(_compute_dtype(where, self.dtype, x))
        value = lambda v: None if v is None else v[...]  # noqa: E731
        dropout = None
        if self.dropout is not None:

            def dropout(h):
                return self.dropout(h, deterministic=deterministic)

        out, ln_out = layers.layernorm_mlp(
            x,
            self.wi_kernel[...],
            self.wo_kernel[...],
            value(self.wi_bias),
            value(self.wo_bias),
            value(self.scale),
            value(self.ln_bias),
            activation_type=self.act,
            act_params=self.act_params,
            layernorm_type=self.layernorm_type,
            zero_centered_gamma=self.zero_centered_gamma,
            epsilon=self.epsilon,
            quantizer_sets=(self.wi_quantizers(), self.wo_quantizers()),
            dropout=dropout,
            implementation=self.implementation,
            kernel_axes=(_logical_axes(self.wi_kernel), _logical_axes(self.wo_kernel)),
        )
        return out, (ln_out if self.return_layernorm_output else None)
