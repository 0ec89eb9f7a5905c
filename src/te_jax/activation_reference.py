"""The activation ops in pure JAX: ``act_lu``, ``dact_lu``, ``quantize_dact_dbias``,
``activation`` and the forward-mode tangent, plus TransformerEngine's jit-fusable bias helpers.

This is the ``implementation="xla"`` path of ``te_jax.activation``'s ops (and of the GEMM's
fused activation epilogues), the fallback on backends without kernels, and what the kernels are
tested against. Quantization's pure-JAX form is ``te_jax.quantize.reference``.

Each component function (``"gelu"``, ``"silu"``, ``"linear"``, ...: the names of
``ActivationType.names``) is defined here once, returning its value and derivative (the same
pairs as ``ffi/activation/activations.h``), so the derivative at ties follows docs/numerics.md
§1 (``relu'(0) = 0``, inclusive clamp masks) rather than autodiff's conventions. An activation
is its components: ``f`` alone, or ``f`` and a linear half.

Arithmetic is float32 (float64 for float64 inputs); results are rounded once to the input dtype.

Shapes: non-gated ``x (..., H) -> y (..., H)``; gated ``x (..., 2, H) -> y (..., H)`` with
``y = f(x[..., 0, :]) * lin(x[..., 1, :])``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from te_jax.activation_types import ActivationLike, ActivationParams, ActivationType
from te_jax.dispatch import check_input_dtype

__all__ = [
    "act_lu",
    "dact_lu",
    "quantize_dact_dbias",
    "activation",
    "act_lu_tangent",
    "component",
    "bias_gelu",
    "bgrad_dgelu",
    "bias_silu",
    "bgrad_dsilu",
    "bias_relu",
    "bgrad_drelu",
    "bias_quick_gelu",
    "bgrad_dquick_gelu",
    "bias_squared_relu",
    "bgrad_dsquared_relu",
    "bias_dropout_add",
    "get_bias_dropout_add",
]

_GELU_K = 0.7978845608028654  # sqrt(2/pi)
_GELU_C = 0.044715
_INV_SQRT2 = 0.7071067811865476
_INV_SQRT_2PI = 0.3989422804014327

# ---------------------------------------------------------------------------------------------
# Each activation once: x -> (f(x), f'(x)). Non-finite inputs as activations.h (docs/numerics.md
# §1): NaN gives NaN, value and derivative; at +-inf and where an intermediate overflows the
# smooth forms give the limit (the two helpers below), not the plain formula's inf * 0 = NaN.


def _times_weight(x, w):
    """``x * w`` for a weight ``w`` in [0, 1], or -0 where ``w == 0`` (x may be -inf there)."""
    return jnp.where(w == 0, jnp.asarray(-0.0, x.dtype), x * w)


def _plus_term(w, t, h):
    """``w + t * h``, or ``w`` where ``t == 0`` (h may be infinite there); NaN stays NaN."""
    return jnp.where(t == 0, w, w + t * h)


def _gelu(x, p):
    # 0.5*(1 + tanh(u)) == sigmoid(2u): one transcendental for value and derivative.
    x2 = x * x
    s = jax.nn.sigmoid(2.0 * _GELU_K * x * (1.0 + _GELU_C * x2))
    df = _plus_term(s, s * (1.0 - s), 2.0 * _GELU_K * x * (1.0 + 3.0 * _GELU_C * x2))
    return _times_weight(x, s), df


def _gelu_exact(x, p):
    cdf = 0.5 * (1.0 + lax.erf(x * _INV_SQRT2))
    return _times_weight(x, cdf), _plus_term(cdf, jnp.exp(-0.5 * x * x), x * _INV_SQRT_2PI)


def _sigmoid(x, p):
    s = jax.nn.sigmoid(x)
    return s, s * (1.0 - s)


def _swish(x, beta):
    bx = beta * x
    s = jax.nn.sigmoid(bx)
    return _times_weight(x, s), _plus_term(s, s * (1.0 - s), bx)


def _silu(x, p):
    return _swish(x, 1.0)


def _quick_gelu(x, p):
    return _swish(x, 1.702)


def _relu(x, p):
    # NaN fails both comparisons and stays NaN, value and derivative.
    f = jnp.where(x <= 0, jnp.zeros_like(x), x)
    df = jnp.where(x > 0, jnp.ones_like(x), jnp.where(x <= 0, jnp.zeros_like(x), x))
    return f, df


def _squared_relu(x, p):
    nonpos = x <= 0
    return jnp.where(nonpos, 0.0, x * x).astype(x.dtype), jnp.where(nonpos, 0.0, 2.0 * x).astype(
        x.dtype
    )


def _clamped_silu(x, p):
    c = p.clamped_swiglu
    above = x > c.limit  # False for NaN: m = NaN
    f, df = _swish(jnp.where(above, jnp.asarray(c.limit, x.dtype), x), c.alpha)
    return f, jnp.where(above, 0.0, df).astype(x.dtype)


def _nan_or(b, v):
    """``v``, or ``b`` where ``b`` is NaN."""
    return jnp.where(jnp.isnan(b), b, v)


def _identity(b, p):
    return b, _nan_or(b, jnp.ones_like(b))


def _clamped_linear(b, p):
    c = p.clamped_swiglu
    inside = (b >= -c.limit) & (b <= c.limit)
    return jnp.clip(b, -c.limit, c.limit) + c.glu_linear_offset, _nan_or(
        b, jnp.where(inside, 1.0, 0.0).astype(b.dtype)
    )


_Pair = Callable[..., tuple[jax.Array, jax.Array]]

# Component name (ActivationType.names) -> x -> (f(x), f'(x)).
_COMPONENTS: dict[str, _Pair] = {
    "gelu": _gelu,
    "gelu_exact": _gelu_exact,
    "sigmoid": _sigmoid,
    "silu": _silu,
    "quick_gelu": _quick_gelu,
    "relu": _relu,
    "squared_relu": _squared_relu,
    "clamped_silu": _clamped_silu,
    "linear": _identity,
    "clamped_linear": _clamped_linear,
}


def component(name: str) -> _Pair:
    """One component by name (``"gelu"``, ``"relu"``, ...): ``fn(x, params) -> (f(x), f'(x))``
    in x's dtype, the math every op uses (the GEMM's epilogues too). ``params`` is an
    ``ActivationParams`` (the clamped components) or ``None``.

    Example:
      >>> import jax.numpy as jnp
      >>> from te_jax import activation_reference as ref
      >>> f, df = ref.component("relu")(jnp.array([-1.0, 0.0, 2.0]), None)
      >>> f.tolist(), df.tolist()
      ([0.0, 0.0, 2.0], [0.0, 0.0, 1.0])
    """
    return _COMPONENTS[name]


def _components(act: ActivationType) -> list[_Pair]:
    """``[f]`` or, gated, ``[f, linear half]``."""
    return [_COMPONENTS[name] for name in act.names]


def _compute_dtype(dtype) -> jnp.dtype:
    """float32 for the 16-bit and 32-bit inputs, float64 for float64; other dtypes raise."""
    return jnp.promote_types(check_input_dtype("te_jax.activation_reference", dtype), jnp.float32)


def _resolve(activation_type, act_params) -> tuple[ActivationType, ActivationParams | None]:
    act = ActivationType.parse(activation_type)
    return act, ActivationParams.resolve(act, act_params)


# ---------------------------------------------------------------------------------------------
# The ops.


def act_lu(x: jax.Array, activation_type: ActivationLike = ("gelu",), act_params=None) -> jax.Array:
    """Activation forward: ``(..., H) -> (..., H)``, or gated ``(..., 2, H) -> (..., H)``.

    ``y = f(x)``, gated ``y = f(x[..., 0, :]) · lin(x[..., 1, :])``; float32 arithmetic
    (float64 for float64 x), rounded once to x's dtype.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from te_jax import activation_reference as ref
      >>> x = jnp.linspace(-3.0, 3.0, 8)
      >>> bool(jnp.allclose(ref.act_lu(x, "gelu"), jax.nn.gelu(x, approximate=True), atol=1e-6))
      True
    """
    act, params = _resolve(activation_type, act_params)
    xf = x.astype(_compute_dtype(x.dtype))
    if not act.is_gated:
        (fn,) = _components(act)
        y = fn(xf, params)[0]
    else:
        fn, lin = _components(act)
        y = fn(xf[..., 0, :], params)[0] * lin(xf[..., 1, :], params)[0]
    return y.astype(x.dtype)


def _dact_compute(dz, x, act, params):
    """The activation gradient in the compute dtype, with x's shape."""
    cdt = _compute_dtype(x.dtype)
    g = dz.astype(cdt)
    xf = x.astype(cdt)
    if not act.is_gated:
        (fn,) = _components(act)
        return fn(xf, params)[1] * g
    fn, lin = _components(act)
    f, df = fn(xf[..., 0, :], params)
    v, dv = lin(xf[..., 1, :], params)
    return jnp.stack([df * g * v, dv * g * f], axis=-2)


def dact_lu(
    dz: jax.Array, x: jax.Array, activation_type: ActivationLike = ("gelu",), act_params=None
) -> jax.Array:
    """Activation gradient: ``dz (..., H)``, ``x`` as for ``act_lu`` -> ``dx`` of x's shape.

    Gated: ``dx[..., 0, :] = f'(a)·dz·lin(b)``, ``dx[..., 1, :] = lin'(b)·dz·f(a)``.
    In x's dtype (float32 arithmetic); ``dz`` in any float dtype.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from te_jax import activation_reference as ref
      >>> x = jnp.linspace(-1.0, 1.0, 16).reshape(2, 8)      # gated: a = x[0], b = x[1]
      >>> dx = ref.dact_lu(jnp.ones((8,)), x, "swiglu")
      >>> silu, dsilu = jax.nn.silu(x[0]), jax.vmap(jax.grad(jax.nn.silu))(x[0])
      >>> dx.shape, bool(jnp.allclose(dx[0], dsilu * x[1])), bool(jnp.allclose(dx[1], silu))
      ((2, 8), True, True)
    """
    act, params = _resolve(activation_type, act_params)
    return _dact_compute(dz, x, act, params).astype(x.dtype)


def quantize_dact_dbias(
    dz: jax.Array,
    x: jax.Array,
    activation_type: ActivationLike = ("gelu",),
    is_dbias: bool = True,
    act_params=None,
) -> tuple[jax.Array, jax.Array | None]:
    """``dact_lu`` and ``dbias``: the float32 sum of dx over every axis but the feature axes.

    ``dbias`` has shape ``(H,)`` (non-gated) or ``(2, H)`` (gated), in x's dtype.

    Example:
      >>> import jax.numpy as jnp
      >>> from te_jax import activation_reference as ref
      >>> x = jnp.tile(jnp.linspace(-1.0, 1.0, 8), (4, 1))  # columns 0-3 negative
      >>> dx, dbias = ref.quantize_dact_dbias(jnp.ones((4, 8)), x, "relu")
      >>> dbias.tolist()                                   # relu'(x) summed over the rows
      [0.0, 0.0, 0.0, 0.0, 4.0, 4.0, 4.0, 4.0]
    """
    act, params = _resolve(activation_type, act_params)
    dxf = _dact_compute(dz, x, act, params)
    if not is_dbias:
        return dxf.astype(x.dtype), None
    dbias = jnp.sum(dxf, axis=tuple(range(dxf.ndim - act.act_len)))
    return dxf.astype(x.dtype), dbias.astype(x.dtype)


def act_lu_tangent(
    t: jax.Array, x: jax.Array, activation_type: ActivationLike = ("gelu",), act_params=None
) -> jax.Array:
    """The JVP of ``act_lu`` at ``x`` along ``t`` (linear in ``t``), with §1's derivatives.

    Non-gated: ``ẏ = f'(x)·t``. Gated: ``ẏ = f'(a)·(lin(b)·t_a) + lin'(b)·(f(a)·t_b)``, shape
    ``(..., H)``. Its transpose is ``dact_lu``; the products are nested so that the transpose
    multiplies in ``dact_lu``'s order (``(f'(a)·dz)·lin(b)``), giving the same float32 values.
    ``t`` has x's shape; the result has ``act_lu``'s shape, in x's dtype.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from te_jax import activation_reference as ref
      >>> x, t = jnp.linspace(-2.0, 2.0, 8), jnp.ones(8)
      >>> tangent = ref.act_lu_tangent(t, x, "silu")                    # silu'(x) · t
      >>> bool(jnp.allclose(tangent, jax.jvp(jax.nn.silu, (x,), (t,))[1], atol=1e-6))
      True
    """
    act, params = _resolve(activation_type, act_params)
    cdt = _compute_dtype(x.dtype)
    xf, tf = x.astype(cdt), t.astype(cdt)
    if not act.is_gated:
        (fn,) = _components(act)
        return (fn(xf, params)[1] * tf).astype(x.dtype)
    fn, lin = _components(act)
    f, df = fn(xf[..., 0, :], params)
    v, dv = lin(xf[..., 1, :], params)
    return (df * (v * tf[..., 0, :]) + dv * (f * tf[..., 1, :])).astype(x.dtype)


@functools.partial(jax.custom_jvp, nondiff_argnums=(1, 2))
def _activation(x, act, params):
    return act_lu(x, act, params)


@_activation.defjvp
def _activation_jvp(act, params, primals, tangents):
    (x,), (t,) = primals, tangents
    return _activation(x, act, params), act_lu_tangent(t, x, act, params)


def activation(
    x: jax.Array, activation_type: ActivationLike = ("gelu",), act_params=None
) -> jax.Array:
    """Differentiable ``act_lu`` with docs/numerics.md §1's derivatives (``custom_jvp``).

    Its JVP is ``act_lu_tangent``, so ``jax.grad`` gives ``dact_lu`` (the transpose), at the kinks
    too (``relu'(0) = 0``, inclusive clamp masks) where autodiff of ``act_lu`` would halve;
    ``jax.jvp`` / ``jacfwd`` and every higher order work. Shapes and dtypes as ``act_lu``'s.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from te_jax import activation_reference as ref
      >>> x = jnp.array([-1.0, 0.0, 2.0])
      >>> jax.grad(lambda x: ref.activation(x, "relu").sum())(x).tolist()   # relu'(0) = 0
      [0.0, 0.0, 1.0]
    """
    act, params = _resolve(activation_type, act_params)
    return _activation(x, act, params)


# ---------------------------------------------------------------------------------------------
# TE's jit-fused bias helpers. bias_<act>(x, bias) = act(x + bias);
# bgrad_d<act>(grad, x, bias) = (bgrad, dact) with dact = grad * act'(x + bias) and bgrad the
# sum of dact over every leading axis (bias's shape). Elementwise jnp, so XLA fuses them.


def _bias_act(act: ActivationType):
    (fn,) = _components(act)

    def bias_act(x: jax.Array, bias: jax.Array) -> jax.Array:
        cdt = _compute_dtype(jnp.result_type(x, bias))
        return fn(x.astype(cdt) + bias.astype(cdt), None)[0].astype(x.dtype)

    name = act.names[0]
    bias_act.__name__ = f"bias_{name}"
    bias_act.__doc__ = f"""``{name}(x + bias)``, computed in float32, in x's dtype.

    ``x (..., H)``, ``bias (H,)`` (broadcast against x) -> ``(..., H)``.

    Example:
      >>> import jax.numpy as jnp
      >>> from te_jax import activation_reference as ref
      >>> x, bias = jnp.linspace(-1.0, 1.0, 32).reshape(4, 8), jnp.full((8,), 0.5)
      >>> y = ref.bias_{name}(x, bias)
      >>> y.shape, bool(jnp.allclose(y, ref.act_lu(x + bias, "{name}")))
      ((4, 8), True)
    """
    return bias_act


def _bgrad_dact(act: ActivationType):
    (fn,) = _components(act)

    def bgrad_dact(grad: jax.Array, x: jax.Array, bias: jax.Array):
        cdt = _compute_dtype(jnp.result_type(x, bias))
        dact = fn(x.astype(cdt) + bias.astype(cdt), None)[1] * grad.astype(cdt)
        bgrad = jnp.sum(dact, axis=tuple(range(dact.ndim - bias.ndim)))
        return bgrad.astype(bias.dtype), dact.astype(x.dtype)

    name = act.names[0]
    bgrad_dact.__name__ = f"bgrad_d{name}"
    bgrad_dact.__doc__ = f"""``(bgrad, dact)``: ``dact = grad * {name}'(x + bias)`` and
    ``bgrad`` its sum over the leading axes (bias's shape).

    ``grad`` and ``x`` ``(..., H)``, ``bias (H,)``; ``dact`` in x's dtype, ``bgrad`` in bias's.

    Example:
      >>> import jax.numpy as jnp
      >>> from te_jax import activation_reference as ref
      >>> x, bias = jnp.linspace(-1.0, 1.0, 32).reshape(4, 8), jnp.full((8,), 0.5)
      >>> bgrad, dact = ref.bgrad_d{name}(jnp.ones((4, 8)), x, bias)
      >>> bgrad.shape, bool(jnp.allclose(dact, ref.dact_lu(jnp.ones((4, 8)), x + bias, "{name}")))
      ((8,), True)
      >>> bool(jnp.allclose(bgrad, dact.sum(axis=0)))
      True
    """
    return bgrad_dact


bias_gelu = _bias_act(ActivationType.GELU)
bgrad_dgelu = _bgrad_dact(ActivationType.GELU)
bias_silu = _bias_act(ActivationType.SILU)
bgrad_dsilu = _bgrad_dact(ActivationType.SILU)
bias_relu = _bias_act(ActivationType.RELU)
bgrad_drelu = _bgrad_dact(ActivationType.RELU)
bias_quick_gelu = _bias_act(ActivationType.QGELU)
bgrad_dquick_gelu = _bgrad_dact(ActivationType.QGELU)
bias_squared_relu = _bias_act(ActivationType.SRELU)
bgrad_dsquared_relu = _bgrad_dact(ActivationType.SRELU)


def bias_dropout_add(
    x: jax.Array,
    bias: jax.Array | None,
    residual: jax.Array,
    prob: float,
    key: jax.Array | None,
    training: bool,
) -> jax.Array:
    """``residual + dropout(x + bias, prob)``; dropout keeps with probability ``1 - prob`` and
    scales kept values by ``1 / (1 - prob)``. With ``training=False`` or ``prob == 0`` it is
    ``residual + x + bias`` exactly and ``key`` may be ``None``. ``x`` and ``residual`` of one
    shape, ``bias`` broadcast against them; the result in residual's dtype.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from te_jax.activation_reference import bias_dropout_add
      >>> x, bias, residual = jnp.ones((2, 4)), jnp.ones((4,)), jnp.full((2, 4), 10.0)
      >>> bias_dropout_add(x, bias, residual, 0.5, None, training=False)[0].tolist()
      [12.0, 12.0, 12.0, 12.0]
      >>> y = bias_dropout_add(x, bias, residual, 0.5, jax.random.key(0), training=True)
      >>> sorted(set(y.ravel().tolist()))                     # dropped, or 10 + 2 / (1 - 0.5)
      [10.0, 14.0]
    """
    h = x if bias is None else x + bias
    if training and not (isinstance(prob, (int, float)) and prob == 0.0):
        if key is None:
            raise ValueError("bias_dropout_add: training with prob > 0 needs a PRNG key")
        if isinstance(prob, (int, float)) and not 0.0 <= prob < 1.0:
            raise ValueError(f"bias_dropout_add: prob must be in [0, 1), got {prob}")
        keep = jax.random.bernoulli(key, 1.0 - prob, h.shape)
        h = jnp.where(keep, h / (1.0 - prob), 0.0).astype(h.dtype)
    return (residual + h).astype(residual.dtype)


def get_bias_dropout_add(training: bool) -> Callable[..., jax.Array]:
    """``fn(x, bias, residual, prob, key)`` with ``training`` bound (TE's factory): the
    ``bias_dropout_add`` of training (``key`` needed for ``prob > 0``) or of evaluation.

    Example:
      >>> import jax.numpy as jnp
      >>> from te_jax.activation_reference import get_bias_dropout_add
      >>> fn = get_bias_dropout_add(training=False)
      >>> fn(jnp.ones((2, 4)), None, jnp.ones((2, 4)), 0.1)[0].tolist()   # residual + x
      [2.0, 2.0, 2.0, 2.0]
    """

    def fn(x, bias, residual, prob, key=None):
        return bias_dropout_add(x, bias, residual, prob, key, training)

    fn.__name__ = "bias_dropout_add_train" if training else "bias_dropout_add_eval"
    return fn
