"""NNX modules: ``Linear``, ``LayerNorm``, ``LayerNormLinear``, ``LayerNormMLP``.

The same computation and parameter names as the Linen modules of ``te_jax.flax``: each module
makes the spec (``te_jax.module_specs``) the Linen module of the same name makes, once, from
its constructor's arguments; owns the parameters it describes as typed Variables (``nnx.Param``
for the trained parameters, logical axis names as ``out_sharding`` metadata as
``nnx.with_partitioning`` gives; ``FP8Meta`` for delayed scaling's state), drawn from explicit
``rngs``; and calls the spec's ``apply``.

**Dtypes.** Parameters are stored in ``param_dtype`` (float32 by default); the computation runs
in ``dtype``, or in the input's dtype when ``dtype`` is ``None``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from te_jax import layers
from te_jax.activation_types import ActivationLike
from te_jax.linear.kernel_cache import quantize_kernel
from te_jax.module_specs import (
    KERNEL_INIT,
    DenseGeneralSpec,
    LayerNormDenseGeneralSpec,
    LayerNormMLPSpec,
    LayerNormSpec,
)
from te_jax.nnx.fp8_state import QuantizerState
from te_jax.recipe import Recipe
from te_jax.sharding import ACT, EMBED, MLP

__all__ = ["Linear", "LayerNorm", "LayerNormLinear", "LayerNormMLP", "quantize_kernels"]

Initializer = Callable[..., jax.Array]
_KERNEL_INIT = KERNEL_INIT


def param_with_axes(value, axes) -> nnx.Param:
    """``nnx.Param(value)`` with logical axis names ``axes`` (``None``: none). Inside a mesh
    context Flax shards the value as it is created (eager sharding); outside one the names are
    only recorded, for ``nnx.get_partition_spec`` later."""
    if axes is None:
        return nnx.Param(value)
    eager = None if not jax.sharding.get_abstract_mesh().empty else False
    return nnx.Param(value, out_sharding=tuple(axes), eager_sharding=eager)


# The attribute holding each GEMM's quantizers (its FP8Meta state), by the spec's GEMM name.
_QUANTIZERS = {"kernel": "quantizers", "wi": "wi_quantizers", "wo": "wo_quantizers"}


def _settings(spec_cls, arguments: dict) -> dict:
    """The constructor's ``arguments`` the spec is made from (``spec_cls.settings()``)."""
    return {name: arguments[name] for name in spec_cls.settings() if name in arguments}


def _own(module: nnx.Module, spec, rngs: nnx.Rngs, names: tuple[str, ...]) -> None:
    """Sets the parameters ``spec`` describes on ``module``, each drawn from ``rngs.params()``
    in the spec's order; the others of ``names`` (the module's optional ones) to ``None``.
    Delayed scaling's state: one ``QuantizerState`` per GEMM."""
    module.spec = spec
    params = spec.params()
    for p in params:
        setattr(module, p.name, param_with_axes(p.initial_value(rngs.params()), p.axes))
    for name in names:
        if name not in {p.name for p in params}:
            setattr(module, name, None)
    for gemm in spec.gemms:
        setattr(module, _QUANTIZERS[gemm], QuantizerState(spec.recipe))


def _values(module: nnx.Module) -> dict:
    """The module's parameters' values, by name."""
    return {p.name: getattr(module, p.name)[...] for p in module.spec.params()}


def _quantizer_sets(module: nnx.Module) -> dict:
    """One ``QuantizerSet`` per GEMM, by the spec's GEMM name."""
    return {g: getattr(module, _QUANTIZERS[g])() for g in module.spec.gemms}


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


class LayerNorm(nnx.Module):
    """LayerNorm or RMSNorm over the last axis (``te_jax.module_specs.LayerNormSpec``).

    Parameters: ``scale (H,)`` (``γ - 1`` with ``zero_centered_gamma``) and, for
    ``"layernorm"``, ``ln_bias (H,)``.

    ``"layernorm"``: ``y = (x - mean) / sqrt(var + epsilon) · γ + β``; ``"rmsnorm"``:
    ``y = x / sqrt(mean(x²) + epsilon) · γ``; statistics in float32, ``y (..., H)`` in the
    compute dtype.

    Example:
      >>> import jax.numpy as jnp, te_jax.nnx
      >>> from flax import nnx
      >>> norm = te_jax.nnx.LayerNorm(32, rngs=nnx.Rngs(0))
      >>> x = jnp.linspace(-1.0, 1.0, 128).reshape(4, 32)
      >>> mean, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
      >>> bool(jnp.allclose(norm(x), (x - mean) / jnp.sqrt(var + 1e-6), atol=1e-5))
      True
    """

    def __init__(
        self,
        num_features: int,
        *,
        layernorm_type: str = "layernorm",
        epsilon: float = 1e-6,
        zero_centered_gamma: bool = False,
        scale_init: Initializer | None = None,
        scale_axes: Sequence[str] = (EMBED,),
        ln_bias_init: Initializer = nnx.initializers.zeros,
        ln_bias_axes: Sequence[str] = (EMBED,),
        dtype: Any = None,
        param_dtype: Any = jnp.float32,
        rngs: nnx.Rngs,
    ):
        where = "te_jax.nnx.LayerNorm"
        spec = LayerNormSpec.create(
            where, num_features, "num_features", **_settings(LayerNormSpec, locals())
        )
        _own(self, spec, rngs, ("ln_bias",))

    def __call__(self, x: jax.Array) -> jax.Array:
        """``x (..., H)`` → ``(..., H)`` in the compute dtype."""
        _check_input(self.spec.where, x, "num_features", self.spec.norm.scale.shape)
        return self.spec.apply(x, _values(self))


class Linear(nnx.Module):
    """``y = act(x · kernel + bias)`` over x's trailing ``in_features`` axes
    (``te_jax.module_specs.DenseGeneralSpec``).

    Parameters: ``kernel (*in_features, *out_features)`` (gated activation: ``(*in, 2,
    *out)``) and, with ``use_bias``, ``bias (*out_features)`` (gated ``(2, *out)``). Under a
    ``recipe`` the GEMMs run in FP8; delayed scaling's state is in ``quantizers``.

    ``x (..., *in_features)`` → ``(..., *out_features)`` in the compute dtype (``dtype``, else
    x's); the GEMM accumulates in float32 (``te_jax.dense``).

    Example:
      >>> import jax.numpy as jnp, te_jax.nnx
      >>> from flax import nnx
      >>> layer = te_jax.nnx.Linear(32, 16, rngs=nnx.Rngs(0))
      >>> layer.kernel.shape, layer.bias.shape
      ((32, 16), (16,))
      >>> x = jnp.linspace(-1.0, 1.0, 128).reshape(4, 32)
      >>> hi = lambda a, b: jnp.dot(a, b, precision="highest")  # float32 on any GPU
      >>> bool(jnp.allclose(layer(x), hi(x, layer.kernel[...]) + layer.bias[...], atol=1e-5))
      True
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
        where = "te_jax.nnx.Linear"
        spec = DenseGeneralSpec.create(
            where,
            in_features,
            None,  # x's trailing axes
            {"features": "out_features"},
            features=out_features,
            **_settings(DenseGeneralSpec, locals()),
        )
        _own(self, spec, rngs, ("bias",))

    def __call__(self, x: jax.Array, quantized_kernels=None) -> jax.Array:
        """``x (..., *in_features)`` → ``(..., *out_features)`` in the compute dtype.
        ``quantized_kernels``: ``te_jax.nnx.quantize_kernels(self)``'s codes, or ``None``."""
        dense = self.spec.dense
        _check_input(self.spec.where, x, "in_features", dense.kernel.shape[: len(dense.axis)])
        return self.spec.apply(x, _values(self), _quantizer_sets(self), quantized_kernels)


class LayerNormLinear(nnx.Module):
    """Norm, then ``Linear`` over the last axis: ``y = act(norm(x) · kernel + bias)``
    (``te_jax.module_specs.LayerNormDenseGeneralSpec``).

    Returns ``(y, ln_out)`` (``ln_out``, the GEMM's input, ``None`` unless
    ``return_layernorm_output``). Parameters: ``scale``, ``ln_bias``, ``kernel``, ``bias``.

    ``x (..., H)`` → ``y (..., *out_features)`` and ``ln_out (..., H)``, in the compute dtype.

    Example:
      >>> import jax.numpy as jnp, te_jax.nnx
      >>> from flax import nnx
      >>> layer = te_jax.nnx.LayerNormLinear(32, 16, activation="gelu", rngs=nnx.Rngs(0))
      >>> y, ln_out = layer(jnp.ones((4, 32), jnp.bfloat16))
      >>> y.shape, ln_out.shape, y.dtype
      ((4, 16), (4, 32), dtype(bfloat16))
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
        scale_axes: Sequence[str] = (EMBED,),
        ln_bias_init: Initializer = nnx.initializers.zeros,
        ln_bias_axes: Sequence[str] = (EMBED,),
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
        spec = LayerNormDenseGeneralSpec.create(
            where,
            in_features,
            {"features": "out_features"},
            features=out_features,
            **_settings(LayerNormDenseGeneralSpec, locals()),
        )
        _own(self, spec, rngs, ("scale", "ln_bias", "bias"))

    def __call__(self, x: jax.Array, quantized_kernels=None):
        """``x (..., H)`` → ``(y (..., *out_features), ln_out (..., H) or None)``.
        ``quantized_kernels``: ``te_jax.nnx.quantize_kernels(self)``'s codes, or ``None``."""
        dense = self.spec.dense
        _check_input(self.spec.where, x, "in_features", dense.kernel.shape[: len(dense.axis)])
        return self.spec.apply(x, _values(self), _quantizer_sets(self), quantized_kernels)


class LayerNormMLP(nnx.Module):
    """The transformer MLP block (``te_jax.module_specs.LayerNormMLPSpec``):
    ``out = drop(act(norm(x) · wi_kernel + wi_bias)) · wo_kernel + wo_bias``.

    Parameters as the Linen ``te_jax.flax.LayerNormMLP``'s: ``scale``, ``ln_bias``,
    ``wi_kernel`` ``(H, I)`` / gated ``(H, 2, I)``, ``wo_kernel (I, H)``, ``wi_bias``,
    ``wo_bias``; the GEMMs' quantizers in ``wi_quantizers`` / ``wo_quantizers``.

    Returns ``(out, ln_out)``. Dropout (``intermediate_dropout_rate``) draws from ``rngs``'
    ``dropout`` stream; it is off under ``deterministic=True`` or after ``model.eval()``, and
    then (as with a rate of 0) the two GEMMs are one ``te_jax.fused_mlp``, whose
    ``gelu_backward`` is this module's.

    Example:
      >>> import jax.numpy as jnp, te_jax.nnx
      >>> from flax import nnx
      >>> mlp = te_jax.nnx.LayerNormMLP(32, 64, activations="swiglu",
      ...                               recipe=te_jax.recipe.CurrentScaling(), rngs=nnx.Rngs(0))
      >>> out, ln_out = mlp(jnp.ones((4, 32), jnp.bfloat16))
      >>> out.shape
      (4, 32)
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
        scale_axes: Sequence[str] = (EMBED,),
        ln_bias_init: Initializer = nnx.initializers.zeros,
        ln_bias_axes: Sequence[str] = (EMBED,),
        kernel_init: Initializer = _KERNEL_INIT,
        kernel_axes_1: Sequence[str | None] = (EMBED, ACT, MLP),
        kernel_axes_2: Sequence[str | None] = (MLP, EMBED),
        bias_init: Initializer = nnx.initializers.zeros,
        bias_axes_1: Sequence[str | None] = (ACT, MLP),
        bias_axes_2: Sequence[str | None] = (EMBED,),
        intermediate_dropout_rate: float = 0.0,
        intermediate_hidden_dropout_dims: Sequence[int] = (),
        return_layernorm_output: bool = True,
        dtype: Any = None,
        param_dtype: Any = jnp.float32,
        recipe: Recipe | None = None,
        implementation: str | None = None,
        gelu_backward: str = "dact",
        rngs: nnx.Rngs,
    ):
        where = "te_jax.nnx.LayerNormMLP"
        spec = LayerNormMLPSpec.create(
            where, hidden_size, "hidden_size", **_settings(LayerNormMLPSpec, locals())
        )
        _own(self, spec, rngs, ("scale", "ln_bias", "wi_bias", "wo_bias"))
        self.dropout = (
            None
            if spec.dropout_rate == 0.0
            else nnx.Dropout(spec.dropout_rate, broadcast_dims=spec.dropout_dims, rngs=rngs)
        )

    def __call__(self, x: jax.Array, deterministic: bool | None = None, quantized_kernels=None):
        """``x (..., H)`` → ``(out (..., H), ln_out (..., H) or None)``. ``deterministic``:
        ``None`` takes the module's mode (``model.eval()`` / ``model.train()``).
        ``quantized_kernels``: ``te_jax.nnx.quantize_kernels(self)``'s codes, or ``None``."""
        spec = self.spec
        _check_input(spec.where, x, "hidden_size", spec.wi_kernel.shape[:1])
        dropout = None
        if self.dropout is not None:
            if deterministic is None:
                deterministic = self.dropout.deterministic
            if spec.dropout_active(deterministic):
                dropout = functools.partial(self.dropout, deterministic=False)
        return spec.apply(
            x, _values(self), _quantizer_sets(self), dropout, quantized_kernels=quantized_kernels
        )


def quantize_kernels(module: nnx.Module) -> dict:
    """``{gemm: codes}``: each kernel of the te_jax NNX ``module`` (``Linear``,
    ``LayerNormLinear``, ``LayerNormMLP``) quantized once with its GEMM's quantizer set as it
    is now (``te_jax.quantize_kernel``), for the module's ``quantized_kernels`` argument: the
    kernels of gradient accumulation's micro-batches quantized once per step (the same bits;
    docs/flax.md). Tensor-scaling recipes only; make them again after every optimizer step.

    Example:
      >>> import jax.numpy as jnp, te_jax, te_jax.nnx
      >>> from flax import nnx
      >>> mlp = te_jax.nnx.LayerNormMLP(32, 64, recipe=te_jax.recipe.DelayedScaling(),
      ...                               rngs=nnx.Rngs(0))
      >>> x = jnp.ones((8, 32), jnp.bfloat16)
      >>> cache = te_jax.nnx.quantize_kernels(mlp)
      >>> {g: st.data.shape for g, st in cache.items()}
      {'wi': (32, 64), 'wo': (64, 32)}
      >>> bool((mlp(x, quantized_kernels=cache)[0] == mlp(x)[0]).all())
      True
    """
    spec = getattr(module, "spec", None)
    gemms = {} if spec is None else spec.kernel_contractions()
    if not gemms:
        raise TypeError(
            "te_jax.nnx.quantize_kernels: module must be a te_jax.nnx Linear, LayerNormLinear or "
            f"LayerNormMLP, got {type(module).__name__}"
        )
    where = f"te_jax.nnx.quantize_kernels({type(module).__name__})"
    out = {}
    for gemm, (param, n_c) in gemms.items():
        qs = getattr(module, _QUANTIZERS[gemm]).current()
        if qs is None:
            raise ValueError(f"{where}: the module has no recipe: its GEMMs quantize nothing")
        out[gemm] = quantize_kernel(getattr(module, param)[...], qs, n_c)
    return out
