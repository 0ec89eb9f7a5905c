"""One description of each Flax module, shared by the Linen (``te_jax.flax``) and NNX
(``te_jax.nnx``) families.

A spec is a frozen dataclass made by its ``create`` from a module's settings (the Linen
module's fields, the NNX constructor's arguments: the same names) and the sizes of its input's
feature axes. ``create`` validates the settings once, raising a ValueError / TypeError that
names the module, what was written and the fix. The spec then gives:

* ``params()``: each parameter as a ``ParamSpec`` (name, shape, logical axis names,
  initializer, dtype), in the order the modules create them;
* ``gemms``: the names of the module's GEMMs, one ``QuantizerSet`` each (``"kernel"``, or the
  MLP's ``"wi"`` and ``"wo"``), which prefix the names of delayed scaling's state;
* ``apply(x, params, quantizer_sets, ...)``: the forward on ``te_jax.layers``, from the input
  (cast to the compute dtype here) and the parameters by name.

A module of either family stores what its spec describes (Linen: ``module.param`` and the
``"fp8_metas"`` collection; NNX: ``nnx.Param`` and ``FP8Meta`` attributes) and calls
``apply``: from the same parameters both trace the same program.

| module (Linen / NNX) | spec | parameters |
|---|---|---|
| ``LayerNorm`` | ``LayerNormSpec`` | ``scale``, ``ln_bias`` |
| ``DenseGeneral`` / ``Linear`` | ``DenseGeneralSpec`` | ``kernel``, ``bias`` |
| ``LayerNormDenseGeneral`` / ``LayerNormLinear`` | ``LayerNormDenseGeneralSpec`` | both |
| ``LayerNormMLP`` | ``LayerNormMLPSpec`` | ``scale``, ``ln_bias``, ``wi_*``, ``wo_*`` |
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from te_jax import layers
from te_jax.activation_types import ActivationParams, ActivationType
from te_jax.linear.fused_mlp import GELU_BACKWARDS
from te_jax.normalization import check_norm_type, layernorm
from te_jax.recipe import QuantizerSet, Recipe, autocast_recipe

__all__ = [
    "KERNEL_INIT",
    "ParamSpec",
    "NormSpec",
    "DenseSpec",
    "LayerNormSpec",
    "DenseGeneralSpec",
    "LayerNormDenseGeneralSpec",
    "LayerNormMLPSpec",
]

Initializer = Callable[..., jax.Array]
# The modules' default kernel_init, one object for both families (specs compare equal).
KERNEL_INIT = jax.nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal")
Params = Mapping[str, jax.Array]
QuantizerSets = Mapping[str, QuantizerSet | None]


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    """One parameter of a module.

    Attributes:
      name: its name (the Linen ``params`` key, the NNX attribute).
      shape: its shape.
      axes: its logical axis names, one per axis; ``None`` for none.
      init: ``init(key, shape, dtype) -> array``.
      dtype: the dtype it is stored in (the module's ``param_dtype``).
    """

    name: str
    shape: tuple[int, ...]
    axes: tuple[str | None, ...] | None
    init: Initializer
    dtype: jnp.dtype

    def initial_value(self, key: jax.Array) -> jax.Array:
        """The parameter ``init`` draws from ``key``: ``shape`` in ``dtype``."""
        return self.init(key, self.shape, self.dtype)


@dataclasses.dataclass(frozen=True)
class _KernelInit:
    """``init`` applied as ``layers.init_kernel`` does: on the ``(K, N)`` matrix of the ``n_in``
    contracted axes (fan-in ``K``), a gated kernel's halves separately. A dataclass, so two
    specs from the same settings compare equal (NNX keeps the spec in the graph definition)."""

    init: Initializer
    n_in: int
    gated: bool

    def __call__(self, key, shape, dtype):
        return layers.init_kernel(self.init, key, shape, self.n_in, self.gated, dtype)


def _value(params: Params, spec: ParamSpec | None):
    return None if spec is None else params[spec.name]


# ---- the pieces: a norm, a dense -------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class NormSpec:
    """LayerNorm or RMSNorm over the last axis (``te_jax.normalization.layernorm``):
    ``scale (H,)`` (``γ - 1`` with ``zero_centered_gamma``) and, for ``"layernorm"``,
    ``ln_bias (H,)``, both in ``param_dtype``; the output has x's dtype."""

    layernorm_type: str
    epsilon: float
    zero_centered_gamma: bool
    scale: ParamSpec
    ln_bias: ParamSpec | None

    @classmethod
    def create(
        cls,
        where: str,
        hidden: int,
        *,
        layernorm_type,
        epsilon,
        zero_centered_gamma,
        scale_init,
        scale_axes,
        ln_bias_init,
        ln_bias_axes,
        param_dtype,
    ) -> NormSpec:
        kind = check_norm_type(where, layernorm_type)
        ones_or_zeros = (
            jax.nn.initializers.zeros if zero_centered_gamma else jax.nn.initializers.ones
        )
        shape = (hidden,)
        scale = ParamSpec(
            "scale",
            shape,
            layers.fit_axes(where, scale_axes, shape, False),
            scale_init or ones_or_zeros,
            param_dtype,
        )
        ln_bias = None
        if kind == "layernorm":
            axes = layers.fit_axes(where, ln_bias_axes, shape, False)
            ln_bias = ParamSpec("ln_bias", shape, axes, ln_bias_init, param_dtype)
        return cls(kind, epsilon, zero_centered_gamma, scale, ln_bias)

    def params(self) -> tuple[ParamSpec, ...]:
        return (self.scale,) if self.ln_bias is None else (self.scale, self.ln_bias)

    def options(self) -> dict[str, Any]:
        """The norm's keyword arguments of ``layernorm`` / ``layers.layernorm_mlp``."""
        return dict(
            layernorm_type=self.layernorm_type,
            zero_centered_gamma=self.zero_centered_gamma,
            epsilon=self.epsilon,
        )

    def apply(self, x: jax.Array, params: Params) -> jax.Array:
        """``x (..., H)`` normalized over its last axis, in x's dtype."""
        return layernorm(x, params["scale"], _value(params, self.ln_bias), **self.options())


@dataclasses.dataclass(frozen=True)
class DenseSpec:
    """``y = act(x · kernel + bias)`` contracting x's axes ``axis`` with the kernel's leading
    axes (``te_jax.layers.dense_general``): ``kernel (*in, *F)`` (gated: ``(*in, 2, *F)``),
    ``bias (*F)`` (gated ``(2, *F)``) with ``use_bias``."""

    axis: tuple[int, ...]
    act: ActivationType | None
    act_params: ActivationParams | None
    recipe: Recipe | None
    implementation: str | None
    kernel: ParamSpec
    bias: ParamSpec | None

    @classmethod
    def create(
        cls,
        where: str,
        in_shape: Sequence[int],
        axis: Sequence[int],
        *,
        features,
        features_field: str,
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
    ) -> DenseSpec:
        act, act_params = layers.resolve_activation(where, activation, activation_params)
        recipe = autocast_recipe(layers.check_recipe(where, recipe))
        features = layers.check_sizes(where, features_field, features)
        n_in, gated = len(in_shape), act is not None and act.is_gated
        k_shape = layers.dense_kernel_shape(in_shape, features, act)
        kernel = ParamSpec(
            "kernel",
            k_shape,
            layers.fit_axes(where, kernel_axes, k_shape, False),
            _KernelInit(kernel_init, n_in, gated),
            param_dtype,
        )
        bias = None
        if use_bias:
            b_shape = k_shape[n_in:]
            axes = layers.fit_axes(where, bias_axes, b_shape, False)
            bias = ParamSpec("bias", b_shape, axes, bias_init, param_dtype)
        return cls(tuple(axis), act, act_params, recipe, implementation, kernel, bias)

    def params(self) -> tuple[ParamSpec, ...]:
        return (self.kernel,) if self.bias is None else (self.kernel, self.bias)

    def apply(
        self,
        x: jax.Array,
        params: Params,
        quantizer_set: QuantizerSet | None,
        quantized_kernel=None,
    ):
        """``x (..., *in)`` → ``(..., *F)`` in x's dtype (FP8 GEMM under a quantizer set;
        ``quantized_kernel``: the kernel's codes quantized ahead, ``te_jax.quantize_kernel``)."""
        return layers.dense_general(
            x,
            params["kernel"],
            _value(params, self.bias),
            axis=self.axis,
            activation_type=self.act,
            act_params=self.act_params,
            quantizer_set=quantizer_set,
            implementation=self.implementation,
            kernel_axes=self.kernel.axes,
            quantized_kernel=quantized_kernel,
        )


# ---- the modules -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _ModuleSpec:
    """What every module spec has: the name errors start with and the compute dtype."""

    where: str
    dtype: jnp.dtype | None  # None: the input's

    # The module's GEMMs, one QuantizerSet each under its ``recipe``.
    gemms: ClassVar[tuple[str, ...]] = ()

    def kernel_contractions(self) -> dict[str, tuple[str, int]]:
        """``{gemm: (its kernel parameter's name, how many leading kernel axes it contracts)}``:
        what ``te_jax.quantize_kernel`` needs to quantize the module's kernels ahead."""
        return {}

    @classmethod
    def settings(cls) -> tuple[str, ...]:
        """The names of the settings ``create`` takes (its keyword-only arguments): the Linen
        module's fields and the NNX constructor's arguments of the same name."""
        sig = inspect.signature(cls.create)
        return tuple(n for n, p in sig.parameters.items() if p.kind is p.KEYWORD_ONLY)

    def input(self, x) -> jax.Array:
        """``x`` as an array in the compute dtype (``dtype``, or x's own when ``None``)."""
        x = jnp.asarray(x)
        return x.astype(layers.compute_dtype(self.where, self.dtype, x))


def _dtypes(where: str, dtype, param_dtype) -> tuple[jnp.dtype | None, jnp.dtype]:
    """The module's ``dtype`` (``None`` kept) and ``param_dtype``, checked."""
    if dtype is not None:
        dtype = layers.check_dtype(where, "dtype", dtype)
    return dtype, layers.check_dtype(where, "param_dtype", param_dtype)


def _size(where: str, field: str, value) -> int:
    return layers.check_sizes(where, field, value, False)[0]


@dataclasses.dataclass(frozen=True)
class LayerNormSpec(_ModuleSpec):
    """``LayerNorm``: ``x (..., H)`` → ``norm(x) (..., H)`` in the compute dtype."""

    norm: NormSpec

    @classmethod
    def create(
        cls,
        where: str,
        hidden,
        hidden_field: str = "num_features",
        *,
        layernorm_type,
        epsilon,
        zero_centered_gamma,
        scale_init,
        scale_axes,
        ln_bias_init,
        ln_bias_axes,
        dtype,
        param_dtype,
    ) -> LayerNormSpec:
        dtype, param_dtype = _dtypes(where, dtype, param_dtype)
        norm = NormSpec.create(
            where,
            _size(where, hidden_field, hidden),
            layernorm_type=layernorm_type,
            epsilon=epsilon,
            zero_centered_gamma=zero_centered_gamma,
            scale_init=scale_init,
            scale_axes=scale_axes,
            ln_bias_init=ln_bias_init,
            ln_bias_axes=ln_bias_axes,
            param_dtype=param_dtype,
        )
        return cls(where, dtype, norm)

    def params(self) -> tuple[ParamSpec, ...]:
        return self.norm.params()

    def apply(self, x, params: Params) -> jax.Array:
        return self.norm.apply(self.input(x), params)


@dataclasses.dataclass(frozen=True)
class DenseGeneralSpec(_ModuleSpec):
    """``DenseGeneral`` / ``Linear``: ``x (..., *in)`` → ``act(x · kernel + bias) (...,
    *features)`` in the compute dtype, contracting x's axes ``axis``."""

    dense: DenseSpec

    gemms: ClassVar[tuple[str, ...]] = ("kernel",)

    def kernel_contractions(self) -> dict[str, tuple[str, int]]:
        return {"kernel": (self.dense.kernel.name, len(self.dense.axis))}

    @classmethod
    def create(
        cls,
        where: str,
        in_features,
        axis: Sequence[int] | None = None,
        names: Mapping[str, str] | None = None,
        *,
        features,
        use_bias,
        activation,
        activation_params,
        kernel_init,
        bias_init,
        kernel_axes,
        bias_axes,
        dtype,
        param_dtype,
        recipe,
        implementation,
    ) -> DenseGeneralSpec:
        """``in_features``: the contracted axes' sizes (an int or a sequence); ``axis``: which
        of x's axes they are (``None``: the trailing ones); ``names``: the fields' names where
        the module calls them otherwise (NNX's ``{"features": "out_features"}``)."""
        names = names or {}
        dtype, param_dtype = _dtypes(where, dtype, param_dtype)
        in_shape = layers.check_sizes(where, names.get("in_features", "in_features"), in_features)
        if axis is None:
            axis = tuple(range(-len(in_shape), 0))
        dense = DenseSpec.create(
            where,
            in_shape,
            axis,
            features=features,
            features_field=names.get("features", "features"),
            use_bias=use_bias,
            activation=activation,
            activation_params=activation_params,
            kernel_init=kernel_init,
            bias_init=bias_init,
            kernel_axes=kernel_axes,
            bias_axes=bias_axes,
            param_dtype=param_dtype,
            recipe=recipe,
            implementation=implementation,
        )
        return cls(where, dtype, dense)

    @property
    def recipe(self) -> Recipe | None:
        return self.dense.recipe

    def params(self) -> tuple[ParamSpec, ...]:
        return self.dense.params()

    def apply(
        self, x, params: Params, quantizer_sets: QuantizerSets, quantized_kernels=None
    ) -> jax.Array:
        """``quantized_kernels``: ``{gemm: codes}`` quantized ahead (``te_jax.quantize_kernel``)."""
        qk = (quantized_kernels or {}).get("kernel")
        return self.dense.apply(self.input(x), params, quantizer_sets["kernel"], qk)


@dataclasses.dataclass(frozen=True)
class LayerNormDenseGeneralSpec(_ModuleSpec):
    """``LayerNormDenseGeneral`` / ``LayerNormLinear``: ``x (..., H)`` → ``(y, ln_out)``,
    ``ln_out = norm(x)`` (x itself without ``enable_layernorm``; ``None`` unless
    ``return_layernorm_output``) and ``y = act(ln_out · kernel + bias) (..., *features)``."""

    norm: NormSpec | None
    dense: DenseSpec
    return_layernorm_output: bool

    gemms: ClassVar[tuple[str, ...]] = ("kernel",)

    def kernel_contractions(self) -> dict[str, tuple[str, int]]:
        return {"kernel": (self.dense.kernel.name, len(self.dense.axis))}

    @classmethod
    def create(
        cls,
        where: str,
        in_features,
        names: Mapping[str, str] | None = None,
        *,
        features,
        enable_layernorm,
        layernorm_type,
        epsilon,
        zero_centered_gamma,
        scale_init,
        scale_axes,
        ln_bias_init,
        ln_bias_axes,
        use_bias,
        activation,
        activation_params,
        kernel_init,
        bias_init,
        kernel_axes,
        bias_axes,
        return_layernorm_output,
        dtype,
        param_dtype,
        recipe,
        implementation,
    ) -> LayerNormDenseGeneralSpec:
        """``in_features``: the size of x's last axis (without the norm, NNX also takes a
        sequence: x's trailing axes); ``names`` as ``DenseGeneralSpec.create``'s."""
        names = names or {}
        dtype, param_dtype = _dtypes(where, dtype, param_dtype)
        in_field = names.get("in_features", "in_features")
        # The norm is over one axis; without it the dense contracts x's trailing in_features.
        in_shape = layers.check_sizes(where, in_field, in_features, not enable_layernorm)
        norm = None
        if enable_layernorm:
            norm = NormSpec.create(
                where,
                in_shape[0],
                layernorm_type=layernorm_type,
                epsilon=epsilon,
                zero_centered_gamma=zero_centered_gamma,
                scale_init=scale_init,
                scale_axes=scale_axes,
                ln_bias_init=ln_bias_init,
                ln_bias_axes=ln_bias_axes,
                param_dtype=param_dtype,
            )
        else:
            check_norm_type(where, layernorm_type)
        dense = DenseSpec.create(
            where,
            in_shape,
            tuple(range(-len(in_shape), 0)),
            features=features,
            features_field=names.get("features", "features"),
            use_bias=use_bias,
            activation=activation,
            activation_params=activation_params,
            kernel_init=kernel_init,
            bias_init=bias_init,
            kernel_axes=kernel_axes,
            bias_axes=bias_axes,
            param_dtype=param_dtype,
            recipe=recipe,
            implementation=implementation,
        )
        return cls(where, dtype, norm, dense, return_layernorm_output)

    @property
    def recipe(self) -> Recipe | None:
        return self.dense.recipe

    def params(self) -> tuple[ParamSpec, ...]:
        return (() if self.norm is None else self.norm.params()) + self.dense.params()

    def apply(self, x, params: Params, quantizer_sets: QuantizerSets, quantized_kernels=None):
        """``quantized_kernels``: ``{gemm: codes}`` quantized ahead (``te_jax.quantize_kernel``)."""
        x = self.input(x)
        ln_out = x if self.norm is None else self.norm.apply(x, params)
        qk = (quantized_kernels or {}).get("kernel")
        y = self.dense.apply(ln_out, params, quantizer_sets["kernel"], qk)
        return y, (ln_out if self.return_layernorm_output else None)


@dataclasses.dataclass(frozen=True)
class LayerNormMLPSpec(_ModuleSpec):
    """``LayerNormMLP``: ``x (..., H)`` → ``(out, ln_out)`` with
    ``out = drop(act(ln_out · wi_kernel + wi_bias)) · wo_kernel + wo_bias`` and
    ``ln_out = norm(x)`` (``te_jax.layers.layernorm_mlp``). ``wi_kernel`` is ``(H, I)`` (gated
    ``(H, 2, I)``), ``wo_kernel`` ``(I, H)``; ``wi_bias`` ``(I,)`` (gated ``(2, I)``) and
    ``wo_bias (H,)`` with ``use_bias``. The default logical axis names are TE-JAX's; a
    non-gated activation drops the ``"act"`` name."""

    norm: NormSpec | None
    act: ActivationType
    act_params: ActivationParams | None
    recipe: Recipe | None
    implementation: str | None
    wi_kernel: ParamSpec
    wo_kernel: ParamSpec
    wi_bias: ParamSpec | None
    wo_bias: ParamSpec | None
    dropout_rate: float
    dropout_dims: tuple[int, ...]
    return_layernorm_output: bool
    gelu_backward: str

    gemms: ClassVar[tuple[str, ...]] = ("wi", "wo")

    def kernel_contractions(self) -> dict[str, tuple[str, int]]:
        return {"wi": (self.wi_kernel.name, 1), "wo": (self.wo_kernel.name, 1)}

    @classmethod
    def create(
        cls,
        where: str,
        hidden,
        hidden_field: str = "hidden_size",
        *,
        intermediate_dim,
        activations,
        activation_params,
        use_bias,
        enable_layernorm,
        layernorm_type,
        epsilon,
        zero_centered_gamma,
        scale_init,
        scale_axes,
        ln_bias_init,
        ln_bias_axes,
        kernel_init,
        kernel_axes_1,
        kernel_axes_2,
        bias_init,
        bias_axes_1,
        bias_axes_2,
        intermediate_dropout_rate,
        intermediate_hidden_dropout_dims,
        return_layernorm_output,
        dtype,
        param_dtype,
        recipe,
        implementation,
        gelu_backward,
    ) -> LayerNormMLPSpec:
        act, act_params = layers.resolve_activation(where, activations, activation_params)
        if act is None:
            raise ValueError(f"{where}: activations must name an activation, got None")
        recipe = autocast_recipe(layers.check_recipe(where, recipe))
        if not 0.0 <= intermediate_dropout_rate < 1.0:
            raise ValueError(
                f"{where}: intermediate_dropout_rate must be in [0, 1), got "
                f"{intermediate_dropout_rate}"
            )
        if gelu_backward not in GELU_BACKWARDS:
            raise ValueError(
                f"{where}: gelu_backward must be one of "
                f"{', '.join(map(repr, GELU_BACKWARDS))}, got {gelu_backward!r}"
            )
        dtype, param_dtype = _dtypes(where, dtype, param_dtype)
        hidden = _size(where, hidden_field, hidden)
        inter = _size(where, "intermediate_dim", intermediate_dim)
        norm = None
        if enable_layernorm:
            norm = NormSpec.create(
                where,
                hidden,
                layernorm_type=layernorm_type,
                epsilon=epsilon,
                zero_centered_gamma=zero_centered_gamma,
                scale_init=scale_init,
                scale_axes=scale_axes,
                ln_bias_init=ln_bias_init,
                ln_bias_axes=ln_bias_axes,
                param_dtype=param_dtype,
            )
        else:
            check_norm_type(where, layernorm_type)
        gated = act.is_gated
        k1_shape, k2_shape = layers.mlp_kernel_1_shape(hidden, inter, act), (inter, hidden)

        def param(name, shape, axes, init, drop_gate=False):
            fit = layers.fit_axes(where, axes, shape, drop_gate)
            return ParamSpec(name, shape, fit, init, param_dtype)

        wi_kernel = param(
            "wi_kernel", k1_shape, kernel_axes_1, _KernelInit(kernel_init, 1, gated), not gated
        )
        wo_kernel = param("wo_kernel", k2_shape, kernel_axes_2, _KernelInit(kernel_init, 1, False))
        wi_bias = wo_bias = None
        if use_bias:
            wi_bias = param("wi_bias", k1_shape[1:], bias_axes_1, bias_init, not gated)
            wo_bias = param("wo_bias", (hidden,), bias_axes_2, bias_init)
        return cls(
            where,
            dtype,
            norm,
            act,
            act_params,
            recipe,
            implementation,
            wi_kernel,
            wo_kernel,
            wi_bias,
            wo_bias,
            float(intermediate_dropout_rate),
            tuple(intermediate_hidden_dropout_dims),
            return_layernorm_output,
            gelu_backward,
        )

    def params(self) -> tuple[ParamSpec, ...]:
        own = (self.wi_kernel, self.wo_kernel, self.wi_bias, self.wo_bias)
        return (() if self.norm is None else self.norm.params()) + tuple(
            p for p in own if p is not None
        )

    def dropout_active(self, deterministic: bool) -> bool:
        """Whether a call drops anything: a rate above 0 and not ``deterministic``. Otherwise
        the two GEMMs are one ``te_jax.fused_mlp``."""
        return self.dropout_rate > 0.0 and not deterministic

    def apply(
        self,
        x,
        params: Params,
        quantizer_sets: QuantizerSets,
        dropout: Callable[[jax.Array], jax.Array] | None = None,
        quantized_kernels=None,
    ):
        """``dropout``: applied to the activation's output (``None``: none; the modules pass
        one only where ``dropout_active``). ``quantized_kernels``: ``{gemm: codes}`` quantized
        ahead (``te_jax.quantize_kernel``)."""
        qks = quantized_kernels or {}
        norm = {} if self.norm is None else self.norm.options()
        out, ln_out = layers.layernorm_mlp(
            self.input(x),
            params["wi_kernel"],
            params["wo_kernel"],
            _value(params, self.wi_bias),
            _value(params, self.wo_bias),
            None if self.norm is None else params["scale"],
            None if self.norm is None else _value(params, self.norm.ln_bias),
            activation_type=self.act,
            act_params=self.act_params,
            quantizer_sets=(quantizer_sets["wi"], quantizer_sets["wo"]),
            dropout=dropout,
            implementation=self.implementation,
            kernel_axes=(self.wi_kernel.axes, self.wo_kernel.axes),
            gelu_backward=self.gelu_backward,
            quantized_kernels=(qks.get("wi"), qks.get("wo")),
            **norm,
        )
        return out, (ln_out if self.return_layernorm_output else None)
