"""Linen modules: ``DenseGeneral``, ``LayerNorm``, ``LayerNormDenseGeneral``, ``LayerNormMLP``.

Each wraps a function of ``te_jax.layers`` (the same one the NNX modules wrap) and declares its
parameters with logical axis names (``nn.with_logical_partitioning``), so a mesh and logical
axis rules shard them without touching the module.

**Dtypes.** Parameters are stored in ``param_dtype`` (float32 by default). The computation runs
in ``dtype``, or, when ``dtype`` is ``None``, in the input's dtype (as TransformerEngine's
modules do; Flax's own layers would promote a bfloat16 input with float32 parameters to
float32): parameters are cast to it, and the output has it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from te_jax import layers
from te_jax.activation_types import ActivationLike
from te_jax.flax.fp8_state import FP8_COLLECTION, quantizer_set
from te_jax.normalization import check_norm_type, layernorm
from te_jax.recipe import QuantizerSet, Recipe

__all__ = ["DenseGeneral", "LayerNorm", "LayerNormDenseGeneral", "LayerNormMLP"]

Initializer = Callable[..., jax.Array]
_KERNEL_INIT = nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal")


def _param(module: nn.Module, name: str, init: Initializer, axes, shape, dtype, where: str):
    """``module.param`` with logical axis names ``axes`` (``None``: no names); variables given
    that do not fit this module (another shape, or none) are a te_jax error naming the fix."""
    shape = tuple(shape)
    layers.check_dtype(where, "param_dtype", dtype)
    if module.has_variable("params", name):
        have = _stored_shape(module, name)
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
    if axes is not None:
        init = nn.with_logical_partitioning(init, axes)
    return module.param(name, init, shape, dtype)


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


def _compute_dtype(where: str, dtype, x):
    return layers.compute_dtype(where, dtype, x)


def _norm_input(module, where: str, inputs, param: str):
    """A normed module's input ``(..., H)`` in the compute dtype, its feature axis checked
    against ``param``'s (when the variables exist)."""
    x = jnp.asarray(inputs)
    x = x.astype(_compute_dtype(where, module.dtype, x))
    if x.ndim == 0:
        raise ValueError(f"{where}: the input must have a feature axis (..., H), got a scalar")
    _check_input(module, where, x.shape, (x.ndim - 1,), param)
    return x


def _quantizer_set(module: nn.Module, recipe: Recipe | None, gemm: str, where: str):
    """``fp8_state.quantizer_set``, once delayed scaling's variables are known to be there (or
    creatable): their absence is a te_jax error naming the fix, not Flax's."""
    names = [f"{gemm}_{n}" for n in QuantizerSet.create(recipe).state()]
    if (
        names
        and not module.has_variable(FP8_COLLECTION, names[0])
        and not module.is_mutable_collection(FP8_COLLECTION)
    ):
        raise ValueError(_missing_fp8_state(module, recipe, names[0], where))
    return quantizer_set(module, recipe, gemm)


def _missing_fp8_state(module: nn.Module, recipe: Recipe, name: str, where: str) -> str:
    """Why delayed scaling's variable ``name`` is missing here, and the fix."""
    recipe_name, path = type(recipe).__name__, module.scope.path_text
    head = (
        f"{where}: recipe={recipe_name}() keeps its FP8 state in the {FP8_COLLECTION!r} "
        f"collection, but"
    )
    lifted_fix = (
        f'list "{FP8_COLLECTION}" beside "params" in the nn.scan (or nn.vmap, another Flax lifted '
        f'transform) around the module: variable_axes={{"params": 0, "{FP8_COLLECTION}": 0}} '
        "(or in variable_broadcast / variable_carry)"
    )
    no_recipe = (
        "the module was initialized without a delayed-scaling recipe (recipe=None, or a "
        f"stateless one): initialize it again with recipe={recipe_name}(...), or add the state "
        f'to these variables: _, state = module.apply(variables, x, mutable=["{FP8_COLLECTION}"]); '
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


def _kernel(module, name, init, axes, shape, n_in, gated, param_dtype, where):
    """A kernel parameter initialised by ``layers.init_kernel`` (fan-in over the contracted
    axes, gated halves separately)."""

    def kernel_init(key, shape, dtype):
        return layers.init_kernel(init, key, shape, n_in, gated, dtype)

    return _param(module, name, kernel_init, axes, shape, param_dtype, where)


class _NormParams:
    """The norm's parameters of a Linen module with the norm fields (``scale``, ``ln_bias``)."""

    @staticmethod
    def create(module, hidden: int, where: str):
        kind = check_norm_type(where, module.layernorm_type)
        scale_init = module.scale_init or (
            nn.initializers.zeros if module.zero_centered_gamma else nn.initializers.ones
        )
        gamma = _param(
            module,
            "scale",
            scale_init,
            layers.fit_axes(where, module.scale_axes, (hidden,), False),
            (hidden,),
            module.param_dtype,
            where,
        )
        beta = None
        if kind == "layernorm":
            beta = _param(
                module,
                "ln_bias",
                module.ln_bias_init,
                layers.fit_axes(where, module.ln_bias_axes, (hidden,), False),
                (hidden,),
                module.param_dtype,
                where,
            )
        return gamma, beta


class LayerNorm(nn.Module):
    """LayerNorm or RMSNorm over the last axis (``te_jax.normalization.layernorm``).

    Parameters: ``scale (H,)`` (``γ - 1`` with ``zero_centered_gamma``) and, for
    ``"layernorm"``, ``ln_bias (H,)``.
    """

    layernorm_type: str = "layernorm"
    epsilon: float = 1e-6
    zero_centered_gamma: bool = False
    scale_init: Initializer | None = None
    scale_axes: Sequence[str] = ("embed",)
    ln_bias_init: Initializer = nn.initializers.zeros
    ln_bias_axes: Sequence[str] = ("embed",)
    dtype: Any = None
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        """``x (..., H)`` → ``(..., H)`` in the compute dtype."""
        where = "te_jax.flax.LayerNorm"
        x = _norm_input(self, where, x, "scale")
        gamma, beta = _NormParams.create(self, x.shape[-1], where)
        return layernorm(
            x,
            gamma,
            beta,
            layernorm_type=self.layernorm_type,
            zero_centered_gamma=self.zero_centered_gamma,
            epsilon=self.epsilon,
        )


class DenseGeneral(nn.Module):
    """``y = act(x · kernel + bias)`` over x's axes ``axis`` (``te_jax.layers.dense_general``).

    Parameters: ``kernel (*in, *features)`` (gated activation: ``(*in, 2, *features)``) and,
    with ``use_bias``, ``bias (*features)`` (gated: ``(2, *features)``). Under a ``recipe`` the
    GEMMs run in FP8; delayed scaling's state is in ``"fp8_metas"``.
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
    implementation: str | None = None

    @nn.compact
    def __call__(self, inputs: jax.Array) -> jax.Array:
        """``inputs (..., *in)`` → ``(..., *features)`` in the compute dtype."""
        where = "te_jax.flax.DenseGeneral"
        x = jnp.asarray(inputs)
        x = x.astype(_compute_dtype(where, self.dtype, x))
        return _dense_general(self, x, self.axis, where)


def _dense_general(module, x, axis, where: str):
    """The dense of ``DenseGeneral`` / ``LayerNormDenseGeneral``: its parameters (``kernel``,
    ``bias``) declared in ``module``'s scope, from ``module``'s fields."""
    act, params = layers.resolve_activation(where, module.activation, module.activation_params)
    recipe = layers.check_recipe(where, module.recipe)
    axes = layers.normalize_axes(where, axis, x.ndim)
    features = layers.check_sizes(where, "features", module.features)
    _check_input(module, where, x.shape, axes, "kernel")
    gated = act is not None and act.is_gated
    k_shape = layers.dense_kernel_shape([x.shape[a] for a in axes], features, act)
    kernel_axes = layers.fit_axes(where, module.kernel_axes, k_shape, False)
    kernel = _kernel(
        module,
        "kernel",
        module.kernel_init,
        kernel_axes,
        k_shape,
        len(axes),
        gated,
        module.param_dtype,
        where,
    )
    bias = None
    if module.use_bias:
        b_shape = k_shape[len(axes) :]
        bias = _param(
            module,
            "bias",
            module.bias_init,
            layers.fit_axes(where, module.bias_axes, b_shape, False),
            b_shape,
            module.param_dtype,
            where,
        )
    return layers.dense_general(
        x,
        kernel,
        bias,
        axis=axes,
        activation_type=act,
        act_params=params,
        quantizer_set=_quantizer_set(module, recipe, "kernel", where),
        implementation=module.implementation,
        kernel_axes=kernel_axes,
    )


class LayerNormDenseGeneral(nn.Module):
    """Norm, then ``DenseGeneral`` over the last axis: ``y = act(norm(x) · kernel + bias)``.

    Returns ``(y, ln_out)``; ``ln_out`` (the GEMM's input) is ``None`` unless
    ``return_layernorm_output``. Parameters: ``scale``, ``ln_bias`` (``"layernorm"``),
    ``kernel``, ``bias`` (with ``use_bias``), named as in ``LayerNorm`` and ``DenseGeneral``.
    """

    features: int | Sequence[int]
    enable_layernorm: bool = True
    layernorm_type: str = "layernorm"
    epsilon: float = 1e-6
    zero_centered_gamma: bool = False
    scale_init: Initializer | None = None
    scale_axes: Sequence[str] = ("embed",)
    ln_bias_init: Initializer = nn.initializers.zeros
    ln_bias_axes: Sequence[str] = ("embed",)
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
    implementation: str | None = None

    @nn.compact
    def __call__(self, inputs: jax.Array):
        """``inputs (..., H)`` → ``(y (..., *features), ln_out (..., H) or None)``."""
        where = "te_jax.flax.LayerNormDenseGeneral"
        x = _norm_input(self, where, inputs, "kernel")
        ln_out = x
        if self.enable_layernorm:
            gamma, beta = _NormParams.create(self, x.shape[-1], where)
            ln_out = layernorm(
                x,
                gamma,
                beta,
                layernorm_type=self.layernorm_type,
                zero_centered_gamma=self.zero_centered_gamma,
                epsilon=self.epsilon,
            )
        out = _dense_general(self, ln_out, -1, where)
        return out, (ln_out if self.return_layernorm_output else None)


class LayerNormMLP(nn.Module):
    """The transformer MLP block (``te_jax.layers.layernorm_mlp``):
    ``out = drop(act(norm(x) · wi_kernel + wi_bias)) · wo_kernel + wo_bias``.

    Parameters: ``scale`` and ``ln_bias`` (the norm, when ``enable_layernorm``), ``wi_kernel``
    ``(H, I)`` or, for a gated pair, ``(H, 2, I)`` (straight into the GEMM), ``wo_kernel (I,
    H)``, and with ``use_bias`` ``wi_bias`` ``(I,)`` / ``(2, I)`` and ``wo_bias (H,)``. Logical
    axes default to TE-JAX's; for a non-gated activation the ``"act"`` name is dropped.

    Returns ``(out, ln_out)``: ``ln_out`` is the first GEMM's input (``None`` unless
    ``return_layernorm_output``). Dropout on the intermediate activation takes the
    ``dropout_rng_name`` rng (``"dropout"``) unless ``deterministic``.
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
    scale_axes: Sequence[str] = ("embed",)
    ln_bias_init: Initializer = nn.initializers.zeros
    ln_bias_axes: Sequence[str] = ("embed",)
    kernel_init: Initializer = _KERNEL_INIT
    kernel_axes_1: Sequence[str | None] = ("embed", "act", "mlp")
    kernel_axes_2: Sequence[str | None] = ("mlp", "embed")
    bias_init: Initializer = nn.initializers.zeros
    bias_axes_1: Sequence[str | None] = ("act", "mlp")
    bias_axes_2: Sequence[str | None] = ("embed",)
    intermediate_dropout_rate: float = 0.0
    intermediate_hidden_dropout_dims: Sequence[int] = ()
    dropout_rng_name: str = "dropout"
    return_layernorm_output: bool = True
    dtype: Any = None
    param_dtype: Any = jnp.float32
    recipe: Recipe | None = None
    implementation: str | None = None

    @nn.compact
    def __call__(self, inputs: jax.Array, deterministic: bool = False):
        """``inputs (..., H)`` → ``(out (..., H), ln_out (..., H) or None)``."""
        where = "te_jax.flax.LayerNormMLP"
        act, params = layers.resolve_activation(where, self.activations, self.activation_params)
        if act is None:
            raise ValueError(f"{where}: activations must name an activation, got None")
        recipe = layers.check_recipe(where, self.recipe)
        if not 0.0 <= self.intermediate_dropout_rate < 1.0:
            raise ValueError(
                f"{where}: intermediate_dropout_rate must be in [0, 1), got "
                f"{self.intermediate_dropout_rate}"
            )
        inter = layers.check_sizes(where, "intermediate_dim", self.intermediate_dim, False)[0]
        x = _norm_input(self, where, inputs, "wi_kernel")
        hidden, gated = x.shape[-1], act.is_gated
        gamma = beta = None
        if self.enable_layernorm:
            gamma, beta = _NormParams.create(self, hidden, where)
        k1_shape = layers.mlp_kernel_1_shape(hidden, inter, act)
        axes_1 = layers.fit_axes(where, self.kernel_axes_1, k1_shape, not gated)
        axes_2 = layers.fit_axes(where, self.kernel_axes_2, (inter, hidden), False)
        k1 = _kernel(
            self,
            "wi_kernel",
            self.kernel_init,
            axes_1,
            k1_shape,
            1,
            gated,
            self.param_dtype,
            where,
        )
        k2 = _kernel(
            self,
            "wo_kernel",
            self.kernel_init,
            axes_2,
            (inter, hidden),
            1,
            False,
            self.param_dtype,
            where,
        )
        b1 = b2 = None
        if self.use_bias:
            b1 = _param(
                self,
                "wi_bias",
                self.bias_init,
                layers.fit_axes(where, self.bias_axes_1, k1_shape[1:], not gated),
                k1_shape[1:],
                self.param_dtype,
                where,
            )
            b2 = _param(
                self,
                "wo_bias",
                self.bias_init,
                layers.fit_axes(where, self.bias_axes_2, (hidden,), False),
                (hidden,),
                self.param_dtype,
                where,
            )
        dropout = None
        if self.intermediate_dropout_rate > 0.0 and not deterministic:
            # Flax falls back to the "params" rng for a missing stream.
            if not self.has_rng(self.dropout_rng_name) and not self.has_rng("params"):
                raise ValueError(
                    f"{where}: intermediate_dropout_rate={self.intermediate_dropout_rate} draws "
                    f"from the {self.dropout_rng_name!r} rng, which apply was not given: pass "
                    f"rngs={{{self.dropout_rng_name!r}: key}}, or deterministic=True for no "
                    "dropout"
                )
            drop = nn.Dropout(
                rate=self.intermediate_dropout_rate,
                broadcast_dims=tuple(self.intermediate_hidden_dropout_dims),
                rng_collection=self.dropout_rng_name,
            )

            def dropout(h):
                return drop(h, deterministic=False)

        out, ln_out = layers.layernorm_mlp(
            x,
            k1,
            k2,
            b1,
            b2,
            gamma,
            beta,
            activation_type=act,
            act_params=params,
            layernorm_type=self.layernorm_type,
            zero_centered_gamma=self.zero_centered_gamma,
            epsilon=self.epsilon,
            quantizer_sets=(
                _quantizer_set(self, recipe, "wi", where),
                _quantizer_set(self, recipe, "wo", where),
            ),
            dropout=dropout,
            implementation=self.implementation,
            kernel_axes=(axes_1, axes_2),
        )
        return out, (ln_out if self.return_layernorm_output else None)
