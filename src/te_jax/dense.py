"""``te_jax.dense``: GEMM + bias + activation as one differentiable op (docs/numerics.md §8).

``x (..., K) · kernel (K, *F) + bias (*F) -> act -> y``. With a gated activation the kernel is
``(K, 2, N)``, so the GEMM already writes docs/numerics.md §1's ``(..., 2, N)`` layout and the
activation reads it in place: ``y (..., N)``. The leading axes of x are batch / sequence axes:
the GEMM's rows ``M``, handed to it as they are (one weight shared over them, still one GEMM;
under sharding each keeps its own split) and folded into one axis only under block scaling.

**Where each part runs.**

* CUDA (``implementation`` None or ``"ffi"`` on a GPU): te_jax's cuBLASLt handler runs the
  GEMMs; GELU (tanh) and ReLU run in the forward GEMM's epilogue, on its float32 accumulator;
  the other activations are ``act_lu`` on h (one more pass).
* CPU, and ``implementation="xla"`` anywhere: ``lax.dot_general`` with float32 accumulation,
  then ``act_lu`` on the rounded h (te_jax's CPU kernel; pure JAX for ``"xla"``).

Backward: ``dh = dact(dy, h)`` and ``dbias`` from one fused ``quantize_dact_dbias`` (quantized
to the grad quantizer's FP8 in the same pass under a recipe), then the dgrad GEMM
``dx = dh · kernelᵀ`` and the wgrad GEMM ``dkernel = xᵀ · dh`` (contracting every row axis).

**Differentiation.** Unquantized, the op is a ``custom_jvp`` whose tangent
``ẏ = act'(h)·(ẋ·kernel + x·k̇ + ḃ)`` is a ``te_jax.primitives.custom_linear`` with the backward
above as its transpose: reverse mode (``grad``) runs exactly that backward, forward mode (``jvp``,
``jacfwd``) evaluates the tangent in pure JAX (``tangent``), and second order (Hessian-vector
products) differentiates the kernels' JVPs. Under a recipe it is a ``custom_vjp``, reverse mode
only: forward mode raises a ``TypeError`` (``te_jax.fp8_autodiff``).

**FP8** (``quantizer_set`` from a ``te_jax.recipe``): x and the kernel are quantized (E4M3) by
te_jax's quantize kernels into rowwise and colwise (transposed) copies; the forward GEMM takes
x's rowwise and the kernel's colwise copy, dgrad the gradient's and the kernel's rowwise copies,
wgrad x's and the gradient's colwise copies, so no transpose pass sits in front of any FP8 GEMM.
The scales go to cuBLASLt as device pointers and are applied to the float32 accumulator once,
before the bias and the epilogue. On the CPU and with ``implementation="xla"`` the same
quantized operands are dequantized exactly and multiplied in float32: the same product, so the
CPU path is an oracle for the GPU's. Where a dimension cuBLASLt's FP8 GEMM cannot take (the
contracting one, or the output's columns, not a multiple of 16), that GEMM runs on the exactly
dequantized operands in float32 instead, on every platform (same math; on the GPU without FP8
tensor cores).
MXFP8 on Hopper: the quantized storage is real, the GEMMs run on the dequantized operands in the
input dtype (exact: an MXFP8 value is an E4M3/E5M2 number times a power of two).

**Delayed scaling's state** comes back as the cotangent of ``quantizer_set`` (the updated set;
see ``te_jax.recipe``). Differentiating the operands but not the set drops it: a warning says so
(an error under ``TE_JAX_STRICT_FP8_STATE=1``; ``te_jax.fp8_autodiff``).

**A quantized x** (a ``ScaledTensor``, e.g. from ``te_jax.activation(h, act, quantizer=qs.x)``)
is used as it is: no second quantize pass. This call measures nothing for ``quantizer_set.x``, so
its cotangent is zero: the quantizer that made x (normally ``qs.x`` itself, given to
``te_jax.activation``) gets its next state from the activation's backward alone. It must have the recipe's scaling mode, a rowwise copy,
and (where ``dense`` is differentiated) the colwise copy wgrad reads. Its cotangent is the
gradient of its dequantized value (``te_jax.quantize.scaled_tensor``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import SymbolicZero

from te_jax import _ffi, _varying, fp8_autodiff, reference
from te_jax.activation import act_lu, quantize_dact_dbias
from te_jax.activation_types import ActivationLike, ActivationParams, ActivationType
from te_jax.dispatch import check_input_dtype, environment_implementation
from te_jax.primitives import gemm_autodiff  # noqa: F401 -- registers the GEMM's JVP
from te_jax.primitives.custom_linear import LinearRule, custom_linear
from te_jax.primitives.gemm import FP8_ALIGNMENT, GemmEpilogue, bind_gemm
from te_jax.quantize import formats
from te_jax.quantize.quantize_layout import QuantizeLayout
from te_jax.quantize.scaled_tensor import ScaledTensor, cotangent_from_gradient
from te_jax.quantized import quantize
from te_jax.recipe import QuantizerSet
from te_jax.sharding import check_logical_axes, logical_constraint

__all__ = ["dense"]


_ROW = QuantizeLayout.ROWWISE
_COL = QuantizeLayout.COLWISE
_BOTH = QuantizeLayout.ROWWISE_COLWISE


@dataclasses.dataclass(frozen=True)
class _Config:
    """Everything static about one dense call."""

    act: ActivationType | None
    params: ActivationParams | None
    has_bias: bool
    contract: tuple[int, ...]  # the contracting shape (trailing of x, leading of the kernel)
    features: tuple[int, ...]  # the kernel's non-contracting shape: (N...) or (2, N)
    dtype: np.dtype  # the compute dtype: x's
    implementation: str | None
    kernel_gemm: bool  # the GEMMs run on te_jax's CUDA handler
    kernel_dtype: np.dtype  # the kernel's own: quantized from it under a recipe
    kernel_axes: tuple[str | None, ...] | None = None  # logical names: dkernel's sharding
    fold_rows: bool = False  # x's leading axes folded into one row axis (block scaling)

    @property
    def out_features(self) -> tuple[int, ...]:
        return self.act.output_shape(self.features) if self.act else self.features


# ---- public ---------------------------------------------------------------------------------


def dense(
    x,
    kernel: jax.Array,
    bias: jax.Array | None = None,
    activation_type: ActivationLike | None = None,
    quantizer_set: QuantizerSet | None = None,
    act_params: ActivationParams | None = None,
    contracting_dims: tuple[Sequence[int], Sequence[int]] = ((-1,), (0,)),
    implementation: str | None = None,
    kernel_axes: Sequence[str | None] | None = None,
):
    """Dense layer: ``y = act(x · kernel + bias)``, one differentiable op.

    ``h = x · kernel + bias`` accumulates in float32 and is rounded once to x's dtype; then
    ``y = act(h)`` (docs/numerics.md §1, §8). ``jax.grad`` gives ``dx``, ``dkernel``, ``dbias``
    (and, under a delayed-scaling recipe, the updated ``quantizer_set``). Without a quantizer set
    ``jax.jvp`` / ``jax.jacfwd`` work too; FP8 is reverse-mode only.

    Args:
      x: ``(..., K)`` float32 / bfloat16 / float16 (the compute dtype), or a ``ScaledTensor``
        (already quantized for this GEMM, see the module docstring).
      kernel: ``(K, *F)``; for a gated activation ``(K, 2, N)``. Cast to x's dtype; under a
        recipe quantized from its own dtype instead (float32 parameters: one rounding).
      bias: ``None`` or ``F``-shaped (``(N,)``, ``(2, N)`` for gated). Cast to x's dtype.
      activation_type: ``None`` (a plain GEMM), any te_jax activation (``("gelu",)``, ``"relu"``)
        or gated pair (``("silu", "linear")``).
      quantizer_set: ``None`` / an empty set (no quantization) or
        ``te_jax.QuantizerSet.create(recipe)``.
      act_params: ``ActivationParams`` for clamped SwiGLU.
      contracting_dims: ``(x_axes, kernel_axes)``; x's must be its trailing axes and the
        kernel's its leading ones, in the same order (the default: last of x, first of kernel).
      implementation: ``None`` (te_jax's kernels where there are some), ``"ffi"`` or ``"xla"``.
      kernel_axes: the kernel's logical axis names (one per axis, ``None`` for none), as the
        Flax modules give them: under a mesh and Flax logical axis rules the kernel's gradient
        is constrained to the kernel's sharding, so an FSDP-sharded kernel's gradient is
        reduce-scattered rather than all-reduced (``te_jax.sharding``). No effect otherwise.

    Returns:
      ``y``: ``(..., *F)`` (gated: ``(..., N)``) in x's dtype.
    """
    cfg, kernel, bias, quantizer_set = _prepare(
        x,
        kernel,
        bias,
        activation_type,
        quantizer_set,
        act_params,
        contracting_dims,
        implementation,
        kernel_axes=kernel_axes,
    )
    if cfg.dtype == np.float64:
        return _dense_float64(x, kernel, bias, cfg)
    # Inside shard_map: one varying-axes type for the differentiable operands (te_jax._varying).
    x, kernel, bias = _varying.match(x, kernel, bias)
    if quantizer_set is None:
        return _dense_unquantized(x, kernel, bias, cfg)
    return fp8_autodiff.reverse_mode_only(
        "te_jax.dense", _dense, x, kernel, bias, quantizer_set, cfg
    )


def _dense_float64(x, kernel, bias, cfg: _Config):
    """float64 (with ``jax_enable_x64``): the pure-JAX path in float64, differentiated by JAX."""
    n = len(cfg.contract)
    h = jax.lax.dot_general(
        x,
        kernel,
        ((tuple(range(x.ndim - n, x.ndim)), tuple(range(n))), ((), ())),
        precision=jax.lax.Precision.HIGHEST,
    )
    if bias is not None:
        h = h + bias
    return h if cfg.act is None else reference.activation(h, cfg.act, cfg.params)


def _prepare(
    x,
    kernel,
    bias,
    activation_type,
    qs,
    act_params,
    contracting_dims,
    impl,
    where="te_jax.dense",
    kernel_axes=None,
):
    if impl not in (None, "ffi", "xla"):
        raise ValueError(f"{where}: implementation must be None, 'ffi' or 'xla', got {impl!r}")
    quantized_x = isinstance(x, ScaledTensor)
    x_shape = tuple(x.shape) if quantized_x else tuple(jnp.shape(x))
    dtype = x.dq_dtype if quantized_x else check_input_dtype(where, jnp.result_type(x))
    k_dtype = jnp.result_type(kernel)
    if not jnp.issubdtype(k_dtype, jnp.floating):
        raise TypeError(f"{where}: kernel must be a float array, got {jnp.dtype(k_dtype).name}")
    act = None if activation_type is None else ActivationType.parse(activation_type)
    params = None if act is None else ActivationParams.resolve(act, act_params)

    n_c = _check_contracting(where, contracting_dims, len(x_shape), jnp.ndim(kernel))
    k_shape = tuple(jnp.shape(kernel))
    if x_shape[len(x_shape) - n_c :] != k_shape[:n_c]:
        raise ValueError(
            f"{where}: x's contracting axes {x_shape[len(x_shape) - n_c :]} (x shape {x_shape}) "
            f"must equal the kernel's {k_shape[:n_c]} (kernel shape {k_shape})"
        )
    features = k_shape[n_c:]
    if act is not None and act.is_gated and (len(features) != 2 or features[0] != 2):
        raise ValueError(
            f"{where}: {act.name.lower()} is gated: the kernel must be (K, 2, N) (activation "
            f"columns at index 0 of axis -2, linear at 1), got kernel shape {k_shape}"
        )
    if not features:
        # The contracting axes take the whole kernel: no output axis is left for N.
        k_axes = "(K, N...): K" if n_c == 1 else f"(K..., N...): {n_c} axes K..."
        raise ValueError(
            f"{where}: the kernel has no output axis: it must have at least {n_c + 1} axes "
            f"{k_axes} contracted with x's last {'axis' if n_c == 1 else f'{n_c} axes'}, then "
            f"the output axes N...; got kernel shape {k_shape} for x of shape {x_shape}. For "
            f"one output per row use kernel[..., None] (shape {k_shape + (1,)})"
        )
    if bias is not None:
        if not jnp.issubdtype(jnp.result_type(bias), jnp.floating):
            raise TypeError(
                f"{where}: bias must be a float array, got {jnp.dtype(jnp.result_type(bias)).name}"
            )
        if tuple(jnp.shape(bias)) != features:
            raise ValueError(
                f"{where}: bias must have the kernel's output shape {features}, got "
                f"{tuple(jnp.shape(bias))}"
            )
        bias = jnp.asarray(bias).astype(dtype)
    kernel = jnp.asarray(kernel)

    if qs is not None and not isinstance(qs, QuantizerSet):
        raise TypeError(
            f"{where}: quantizer_set must be a te_jax.QuantizerSet (QuantizerSet.create(recipe)) "
            f"or None, got {type(qs).__name__}"
        )
    if qs is not None and qs.is_empty:
        qs = None
    if qs is not None:
        mode = qs.scaling_mode
        if not (mode.is_tensor_scaling or mode.name == "MXFP8_1D_SCALING"):
            raise ValueError(
                f"{where}: {mode.name} GEMMs are not supported (recipes: DelayedScaling, "
                "CurrentScaling, MXFP8BlockScaling)"
            )
    if quantized_x:
        _check_quantized_x(where, x, qs, n_c, contracting_dims)
    if qs is not None and qs.scaling_mode.block_size is not None:
        kernel = _check_block_shapes(where, qs.scaling_mode, x, x_shape, k_shape, n_c, act, kernel)
    if dtype == jnp.float64 and qs is not None:
        raise TypeError(f"{where}: FP8 recipes take float32/bfloat16/float16 x, got float64")
    # Unquantized, the kernel is cast to x's dtype; under a recipe it is quantized from its own
    # (one rounding from float32 parameters, one pass over them), float64 excepted.
    if qs is None or k_dtype == jnp.float64:
        kernel = kernel.astype(dtype)

    kernel_gemm = _gemm_on_kernel(where, impl, dtype)
    cfg = _Config(
        act,
        params,
        bias is not None,
        k_shape[:n_c],
        features,
        np.dtype(dtype),
        impl,
        kernel_gemm,
        np.dtype(kernel.dtype),
        check_logical_axes(where, "kernel_axes", kernel_axes, jnp.ndim(kernel)),
        qs is not None and not qs.scaling_mode.is_tensor_scaling,
    )
    return cfg, kernel, bias, qs


def _check_contracting(where, contracting_dims, x_ndim, k_ndim) -> int:
    try:
        cx, ck = (tuple(int(a) for a in axes) for axes in contracting_dims)
    except (TypeError, ValueError):
        raise ValueError(
            f"{where}: contracting_dims must be (x_axes, kernel_axes), e.g. ((-1,), (0,)), got "
            f"{contracting_dims!r}"
        ) from None
    n = len(cx)
    if n == 0 or len(ck) != n:
        raise ValueError(
            f"{where}: contracting_dims must name the same number (>= 1) of x and kernel axes, "
            f"got {contracting_dims!r}"
        )
    if x_ndim < n or k_ndim < n:
        raise ValueError(
            f"{where}: x (rank {x_ndim}) and kernel (rank {k_ndim}) need at least {n} axes for "
            f"contracting_dims {contracting_dims!r}"
        )
    want_x = tuple(range(x_ndim - n, x_ndim))
    want_k = tuple(range(n))
    if tuple(a % x_ndim for a in cx) != want_x or tuple(a % k_ndim for a in ck) != want_k:
        raise ValueError(
            f"{where}: contracting_dims must be x's trailing axes and the kernel's leading axes "
            f"in order, here ({want_x}, {want_k}); got {contracting_dims!r} (move the axes with "
            "jnp.moveaxis first)"
        )
    return n


def _check_quantized_x(where, x: ScaledTensor, qs, n_c, contracting_dims):
    if qs is None:
        raise ValueError(
            f"{where}: x is a ScaledTensor ({x.scaling_mode.name}) but no quantizer_set was "
            "given: pass the recipe's QuantizerSet (its kernel and grad quantizers are used)"
        )
    if x.scaling_mode != qs.scaling_mode:
        raise ValueError(
            f"{where}: x is quantized with {x.scaling_mode.name} but the quantizer_set is "
            f"{qs.scaling_mode.name}"
        )
    if x.data is None:
        raise ValueError(
            f"{where}: x (a ScaledTensor) needs its rowwise copy, got {x.q_layout.name}"
        )
    if n_c != 1:
        raise ValueError(f"{where}: a quantized x contracts over its last axis only")


def _check_block_shapes(where, mode, x, x_shape, k_shape, n_c, act, kernel):
    """Block scaling's sizes at the dense level: K (the forward's contracting size) now; the
    tokens M (wgrad's) and the output size N (dgrad's) only where the call is differentiated,
    so a forward alone keeps taking any token count. Returns the kernel (guarded if needed)."""
    block, name = mode.block_size, f"{mode.name} (MXFP8BlockScaling)"
    lead, contract, features = x_shape[: len(x_shape) - n_c], k_shape[:n_c], k_shape[n_c:]
    k = math.prod(contract)
    if k % block:
        raise ValueError(
            f"{where}: {name} quantizes x and the kernel in blocks of {block} along K, the "
            f"contracted size: K = {k} (x's contracting axes {contract}, x shape {x_shape}, "
            f"kernel shape {k_shape}) is not a multiple of {block}. Use hidden / intermediate "
            f"sizes that are multiples of {block}, or DelayedScaling() / CurrentScaling(), which "
            "take any size"
        )
    # The kernel's rowwise blocks (dgrad) run along its last output axis; a non-gated
    # activation's dgrad folds the output axes into one.
    n = math.prod(features) if act is not None and not act.is_gated else features[-1]
    tokens = math.prod(lead)
    problems = []
    if tokens % block:
        problems.append(
            f"the tokens (batch × sequence: the product of x's leading axes {lead}) must be a "
            f"multiple of {block} (the wgrad GEMM contracts over them in blocks of {block}); x "
            f"of shape {x_shape} has {tokens}. Pad the batch or sequence so that batch × "
            f"sequence is a multiple of {block}"
        )
    if n % block:
        problems.append(
            f"the output size N must be a multiple of {block} (the dgrad GEMM contracts over it "
            f"in blocks of {block}); kernel shape {k_shape} has N = {n}. Use features / "
            f"intermediate sizes that are multiples of {block}"
        )
    if not problems:
        return kernel
    message = (
        f"{where}: differentiating under {name}: {'; and '.join(problems)}; or train with "
        "DelayedScaling() / CurrentScaling(), which take any size (the forward alone runs)"
    )
    return _raise_if_differentiated(kernel, x if isinstance(x, jax.Array) else None, message)


def _raise_if_differentiated(kernel, x, message: str):
    """``kernel`` unchanged; differentiating through it or ``x`` raises ``ValueError(message)``
    at trace time (the custom_vjp's forward rule runs only under differentiation)."""

    @jax.custom_vjp
    def guard(k, _):
        return k

    def fwd(k, _):
        raise ValueError(message)

    guard.defvjp(fwd, lambda res, g: (g, None))
    return guard(kernel, x)


def _gemm_on_kernel(where: str, impl: str | None, dtype) -> bool:
    """Whether the GEMMs run on te_jax's CUDA handler (the CUDA backend with te_jax_gemm
    registered); ``implementation="ffi"`` elsewhere is an error."""
    if impl is None:
        impl = environment_implementation()
    if impl == "xla" or jnp.dtype(dtype) == jnp.float64:
        return False
    available = jax.default_backend() == "gpu" and _ffi.ffi_available("cuda")
    if impl == "ffi" and not available:
        raise RuntimeError(
            f"{where}: implementation='ffi' but te_jax's GEMM kernel runs on CUDA only (backend "
            f"{jax.default_backend()!r}); use implementation=None or 'xla'"
        )
    return available


# ---- unquantized: a custom_jvp whose tangent transposes to the fused backward ---------------


@functools.partial(jax.custom_jvp, nondiff_argnums=(3,))
def _dense_unquantized(x, kernel, bias, cfg: _Config):
    return _forward(x, kernel, bias, None, cfg, residuals=False)[0]


@functools.partial(_dense_unquantized.defjvp, symbolic_zeros=True)
def _dense_unquantized_jvp(cfg: _Config, primals, tangents):
    """``y`` from the forward that keeps the backward's residuals (GELU_AUX on the GPU), and
    ``ẏ = act'(h)·(ẋ·kernel + x·k̇ + ḃ)`` as a ``custom_linear`` of the tangents present:
    ``tangent`` in forward mode, ``_backward`` (dact + dbias, dgrad, wgrad) when transposed."""
    x, kernel, bias = primals
    y, res = _forward(x, kernel, bias, None, cfg, residuals=True)
    present = tuple(_is_tangent(t) for t in tangents)
    if not any(present):
        return y, jnp.zeros_like(y)
    leaves, tree = jax.tree.flatten(res)
    rule = LinearRule(_tangent_apply, _tangent_transpose, (cfg, tree, present, y.shape))
    (y_dot,) = custom_linear(rule, leaves, [t for t, p in zip(tangents, present, strict=True) if p])
    return y, y_dot


def _is_tangent(t) -> bool:
    """A tangent that is there: not a symbolic zero (an input not differentiated), not the
    empty tangent of ``bias=None``."""
    return t is not None and not isinstance(t, SymbolicZero)


def _present(present, tangents) -> list:
    """The tangents of ``(x, kernel, bias)`` with ``None`` where absent."""
    it = iter(tangents)
    return [next(it) if p else None for p in present]


def _tangent_apply(static, leaves, tangents):
    """Forward mode: ``tangent`` of the tangents present, in y's shape."""
    cfg, tree, present, y_shape = static
    res = jax.tree.unflatten(tree, leaves)
    return (tangent(cfg, res, *_present(present, tangents)).reshape(y_shape),)


def _tangent_transpose(static, leaves, cotangents):
    """Reverse mode: the backward, the cotangents of the tangents present."""
    cfg, tree, present, _ = static
    (dy,) = cotangents
    x_ct, dk, dbias, _ = _backward(cfg, jax.tree.unflatten(tree, leaves), dy)
    return tuple(ct for ct, p in zip((x_ct, dk, dbias), present, strict=True) if p)


def tangent(cfg: _Config, res, x_dot=None, kernel_dot=None, bias_dot=None):
    """The tangent of the unquantized dense op, in pure JAX (its forward mode).

    ``ḣ = ẋ·kernel + x·k̇ + ḃ``, accumulated in float32 and rounded once to the compute dtype
    (docs/numerics.md §8's rule for ``h``), then ``ẏ = act'(h)·ḣ`` by
    ``te_jax.reference.act_lu_tangent`` (gated: docs/numerics.md §1's product rule). ``act'`` is
    taken at what the backward's dact reads (h, or y for the ReLU epilogue: the same sign).

    Args:
      cfg: the call's config.
      res: the forward's residuals: ``x (*rows, K)``, ``kernel (K, *F)``, ``act_in (*rows, *F)``
        (``None`` without an activation).
      x_dot: ``None`` (zero) or x's tangent, in x's shape ``(..., *contract)``.
      kernel_dot: ``None`` or the kernel's tangent ``(*contract, *F)``; bias_dot: ``None`` or ``F``.

    Returns:
      ``ẏ (*rows, *out_features)`` (the GEMM's rows: reshape to y's shape) in the compute dtype.
    """
    x2, k2 = res.x, res.kernel
    out = x2.shape[:-1] + tuple(k2.shape[1:])
    terms = [jnp.zeros(out, jnp.float32)]
    if x_dot is not None:
        terms.append(_dot(x_dot.reshape(x2.shape), k2))
    if kernel_dot is not None:
        terms.append(_dot(x2, kernel_dot.reshape(k2.shape)))
    if bias_dot is not None:
        terms.append(bias_dot.astype(jnp.float32))
    h_dot = functools.reduce(jnp.add, terms).astype(cfg.dtype)
    y_dot = h_dot
    if cfg.act is not None:
        y_dot = reference.act_lu_tangent(h_dot, res.act_in, cfg.act, cfg.params)
    return y_dot


def _dot(a, b):
    """``a (*rows, K) · b (K, *F)`` accumulated in float32."""
    return jax.lax.dot_general(
        a,
        b,
        (((a.ndim - 1,), (0,)), ((), ())),
        precision=jax.lax.Precision.HIGHEST,
        preferred_element_type=jnp.float32,
    )


# ---- FP8: the custom_vjp --------------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _dense(x, kernel, bias, qs, cfg: _Config):
    return _forward(x, kernel, bias, qs, cfg, residuals=False)[0]


def _dense_fwd(x, kernel, bias, qs, cfg):
    """The forward with residuals; ``symbolic_zeros`` tells which inputs are differentiated, so
    a delayed-scaling set left out of the differentiation is reported (te_jax.fp8_autodiff)."""
    (x, kernel, bias), operands = fp8_autodiff.unwrap_primals((x, kernel, bias))
    qs, state = fp8_autodiff.unwrap_primals(qs)
    if fp8_autodiff.under_jvp((x, kernel, bias, qs)):  # jvp of grad: forward over this op
        raise TypeError(fp8_autodiff.forward_mode_message("te_jax.dense"))
    fp8_autodiff.check_state_differentiated("te_jax.dense", operands, [state])
    return _forward(x, kernel, bias, qs, cfg, residuals=True)


def _dense_bwd(cfg, res, dy):
    return _backward(cfg, res, fp8_autodiff.instantiate(dy))


_dense.defvjp(_dense_fwd, _dense_bwd, symbolic_zeros=True)


@dataclasses.dataclass
class _Operands:
    """The GEMM views: ``M`` rows (in the row axes ``rows``), ``K`` contracting, ``F`` output
    columns."""

    m: int
    k: int
    f: int
    lead: tuple[int, ...]  # x's leading axes
    contract: tuple[int, ...]  # the contracting axes (folded into k)
    rows: tuple[int, ...]  # the GEMMs' row axes: lead, or (m,) where they are folded


def _shapes(lead: tuple[int, ...], cfg: _Config) -> _Operands:
    """The GEMM views. x's leading axes stay apart as the GEMMs' row axes (a sequence split
    under an unsplit batch stays a split of its own axis), except under block scaling, whose
    colwise blocks run down one row axis: there they fold into M."""
    c = cfg.contract
    m = math.prod(lead)
    rows = (m,) if cfg.fold_rows or not lead else tuple(lead)
    return _Operands(m, math.prod(c), math.prod(cfg.features), lead, c, rows)


def _epilogue(cfg: _Config, residuals: bool = True) -> GemmEpilogue:
    """The activation the GEMM's epilogue applies (te_jax's CUDA handler only: elsewhere the
    activation is act_lu on the rounded h, docs/numerics.md §8's exact order). GELU writes h
    beside y only where a backward will read it."""
    if cfg.kernel_gemm and cfg.act is ActivationType.GELU:
        return GemmEpilogue.GELU_AUX if residuals else GemmEpilogue.GELU
    if cfg.kernel_gemm and cfg.act is ActivationType.RELU:
        return GemmEpilogue.RELU
    return GemmEpilogue.DEFAULT


def _activate(h2, cfg: _Config, ep: GemmEpilogue, aux, ops: _Operands):
    """``y`` from the GEMM's output (h, or y where the epilogue applied the activation), and the
    array the backward's dact reads: h, or for ReLU y, whose sign is h's (relu'(h) = [y > 0])."""
    if ep in (GemmEpilogue.GELU_AUX, GemmEpilogue.GELU):
        return h2, aux
    if ep is GemmEpilogue.RELU:
        return h2, h2
    if cfg.act is None:
        return h2, None
    # Explicit sizes, not -1: reshape cannot infer a -1 beside a 0 (an empty batch, M = 0).
    h = h2.reshape(ops.rows + cfg.features)
    return act_lu(h, cfg.act, act_params=cfg.params, implementation=cfg.implementation), h2


class _Residuals(NamedTuple):
    """What the forward keeps for the backward."""

    x: jax.Array | ScaledTensor  # (M, K), or x's quantized copies
    kernel: jax.Array | ScaledTensor  # (K, *F), or the kernel's quantized copies of (K, F)
    act_in: jax.Array | None  # what dact reads: h (M, *F), y for the ReLU epilogue; None
    quantized_x: ScaledTensor | None  # x as given, where it came quantized (its cotangent)
    new_qs: QuantizerSet | None  # the forward quantizers' next state
    qs: QuantizerSet | None  # the quantizer set used


def _forward(x, kernel, bias, qs, cfg: _Config, residuals: bool):
    ops = _shapes(tuple(x.shape)[: len(x.shape) - len(cfg.contract)], cfg)
    ep = _epilogue(cfg, residuals)
    if qs is None:
        # The kernel's output axes stay apart ((K, 2, N) for a gated kernel: a mesh axis can
        # split N with both halves on each shard); the GEMM folds them locally.
        x2 = x.reshape(ops.rows + (ops.k,))
        k2 = kernel.reshape((ops.k,) + cfg.features)
        r = bind_gemm(
            x2,
            k2,
            bias,
            epilogue=ep,
            implementation=_gemm_impl(cfg),
            n_ndim=len(cfg.features),
        )
        y, act_in = _activate(r.out, cfg, ep, r.aux, ops)
        res = _Residuals(x2, k2, act_in, None, None, None) if residuals else None
        return _unflatten_y(y, ops, cfg), res

    kf = _fp8_features(cfg, ops)
    k2 = kernel.reshape((ops.k,) + kf)
    b1 = None if bias is None else bias.reshape(kf)
    qx, qk, new_x, new_k = _quantize_operands(x, k2, qs, ops, cfg, residuals)
    r = _quantized_gemm(
        qx, "rowwise", qk, "colwise", b1, ep, cfg, ops.rows + (ops.k,), kf + (ops.k,), 1, len(kf)
    )
    y, act_in = _activate(r.out, cfg, ep, r.aux, ops)
    if not residuals:
        return _unflatten_y(y, ops, cfg), None
    new_qs = QuantizerSet(x=new_x, kernel=new_k, grad=qs.grad)
    return _unflatten_y(y, ops, cfg), _Residuals(
        qx, qk, act_in, x if isinstance(x, ScaledTensor) else None, new_qs, qs
    )


def _unflatten_y(y, ops: _Operands, cfg: _Config):
    return y.reshape(ops.lead + cfg.out_features)


def _gemm_impl(cfg: _Config) -> str | None:
    """The GEMM primitive's implementation: the kernel where it runs; otherwise the primitive
    with its pure-JAX product (sharded by the same partition as the kernel), or pure JAX
    where that was asked for."""
    return "ffi" if cfg.kernel_gemm else cfg.implementation


def _quantize_operands(x, k2, qs: QuantizerSet, ops: _Operands, cfg: _Config, residuals: bool):
    """x's and the kernel's quantized copies (the forward GEMM reads x rowwise and the kernel
    colwise; the backward's GEMMs the other copies), and their quantizers' next states."""
    impl = cfg.implementation
    if isinstance(x, ScaledTensor):
        if residuals and x.colwise_data is None:
            raise ValueError(
                "te_jax.dense: differentiating with a quantized x needs its colwise copy (wgrad "
                "reads it): quantize it with q_layout ROWWISE_COLWISE"
            )
        # x was quantized upstream (te_jax.activation), whose backward returns the x
        # quantizer's next state: this use contributes nothing (a zero cotangent).
        qx, new_x = x, jax.tree.map(jnp.zeros_like, qs.x)
    else:
        qx = quantize(
            x.reshape(ops.rows + (ops.k,)),
            qs.with_layout("x", _BOTH if residuals else _ROW),
            implementation=impl,
        )
        new_x = _updated(qs.x, qx)
    qk = quantize(
        k2,
        qs.with_layout("kernel", _BOTH if residuals else _COL),
        implementation=impl,
        n_feature_axes=k2.ndim - 1,
    )
    return qx, qk, new_x, _updated(qs.kernel, qk)


def _fp8_features(cfg: _Config, ops: _Operands) -> tuple[int, ...]:
    """The kernel's output axes as the quantized GEMMs take them: apart (a gated ``(2, N)``: a
    mesh axis can split N with both halves on each shard), except under a non-gated activation,
    whose quantized gradient (elementwise dact) folds them into one."""
    if cfg.act is None or cfg.act.is_gated:
        return cfg.features
    return (ops.f,)


def _updated(q, st: ScaledTensor):
    """The quantizer's state for the next step (delayed scaling; the others have none)."""
    return q.update(st.amax) if hasattr(q, "update") else q


def _quantized_gemm(a, a_copy, b, b_copy, bias, ep, cfg, lhs_shape, rhs_shape, k_ndim, n_ndim):
    """``out = deq(a) · deq(b)ᵀ``, the product of two quantized tensors in the FP8 "TN" form:
    ``a``'s ``a_copy`` holds the lhs as ``lhs_shape = (*rows, *K)`` and ``b``'s ``b_copy`` the
    rhs as ``rhs_shape = (*N, *K)`` (``k_ndim`` / ``n_ndim`` axes each; MXFP8 has one row
    axis). Tensor scaling runs the FP8
    GEMM; MXFP8 the dequantized operands (module docstring). ``out (M, *N)`` in x's dtype."""
    out_dtype = cfg.dtype
    groups = dict(k_ndim=k_ndim, n_ndim=n_ndim, implementation=_gemm_impl(cfg))
    if a.scaling_mode.is_tensor_scaling:
        lhs, ls = _tn_operand(a, a_copy, lhs_shape)
        rhs, rs = _tn_operand(b, b_copy, rhs_shape)
        k = math.prod(lhs_shape[len(lhs_shape) - k_ndim :])
        n = math.prod(rhs_shape[:n_ndim])
        if k % FP8_ALIGNMENT or n % FP8_ALIGNMENT:
            # An FP8 GEMM (cuBLASLt's, and the primitive's contract) cannot take this shape:
            # the same product in float32.
            lhs = formats.to_float32(lhs) * ls[0]
            rhs = formats.to_float32(rhs) * rs[0]
            b32 = None if bias is None else bias.astype(jnp.float32)
            r = bind_gemm(lhs, rhs, b32, rhs_trans=True, epilogue=ep, **groups)
            return r._replace(
                out=r.out.astype(out_dtype), aux=None if r.aux is None else r.aux.astype(out_dtype)
            )
        return bind_gemm(
            lhs,
            rhs,
            bias,
            lhs_scale_inv=ls,
            rhs_scale_inv=rs,
            rhs_trans=True,
            epilogue=ep,
            out_dtype=out_dtype,
            **groups,
        )
    # MXFP8: dequantize each copy (exact in the input dtype) and multiply in it. A colwise copy
    # is in the tensor's logical layout, the transpose of its TN form: the GEMM reads it so.
    lhs_t, rhs_t = a_copy == "colwise", b_copy == "rowwise"
    lhs_logical = tuple(lhs_shape[1:]) + (lhs_shape[0],) if lhs_t else tuple(lhs_shape)
    rhs_logical = tuple(rhs_shape) if rhs_t else tuple(rhs_shape[n_ndim:] + rhs_shape[:n_ndim])
    lhs = a.dequantize(a_copy, out_dtype).reshape(lhs_logical)
    rhs = b.dequantize(b_copy, out_dtype).reshape(rhs_logical)
    return bind_gemm(lhs, rhs, bias, lhs_trans=lhs_t, rhs_trans=rhs_t, epilogue=ep, **groups)


def _tn_operand(st: ScaledTensor, copy: str, shape):
    """A tensor-scaled operand's data in its TN ``shape`` (the rowwise copy of a tensor of that
    shape, or the colwise, transposed, copy of its transpose) and its ``scale_inv`` ``(1,)``."""
    data = st.data if copy == "rowwise" else st.colwise_data
    sinv = st.scale_inv if copy == "rowwise" else st.colwise_scale_inv
    return data.reshape(shape), jnp.asarray(sinv, jnp.float32).reshape(1)


def _backward(cfg: _Config, res, dy):
    quantized_x = res.quantized_x
    ops = _shapes(tuple(dy.shape)[: dy.ndim - len(cfg.out_features)], cfg)
    dy2 = dy.reshape(ops.rows + cfg.out_features)
    dh, dbias = _dact(dy2, res.act_in, cfg, ops, quantizer=_grad_quantizer(res))
    dx, dk, dbias, new_qs = _gemm_grads(cfg, res, ops, dh, dbias)
    if quantized_x is not None:
        x_ct = cotangent_from_gradient(quantized_x, dx)
    else:
        x_ct = dx.reshape(_x_shape(ops, cfg))
    return x_ct, dk, dbias, new_qs


def _grad_quantizer(res):
    """The grad quantizer with both copies (dgrad reads the rowwise, wgrad the colwise);
    ``None`` unquantized."""
    return None if res.qs is None else res.qs.with_layout("grad", _BOTH)


def _gemm_grads(cfg: _Config, res, ops: _Operands, dh, dbias):
    """The backward's two GEMMs from ``dh (M, F)`` (a ScaledTensor of the grad quantizer under
    a recipe): ``(dx (M, K), dkernel, the bias cotangent, the quantizer set's cotangent)``."""
    return (
        _dgrad(cfg, res, ops, dh),
        _wgrad(cfg, res, ops, dh),
        _bias_ct(dbias, cfg),
        _next_set(res, dh),
    )


def _dgrad(cfg: _Config, res, ops: _Operands, dh):
    """``dx (M, K) = dh · kernelᵀ``."""
    k = res.kernel
    if res.qs is None:
        dh = dh.reshape(ops.rows + cfg.features)
        return bind_gemm(
            dh, k, rhs_trans=True, implementation=_gemm_impl(cfg), k_ndim=len(cfg.features)
        ).out
    kf = _fp8_features(cfg, ops)
    z = GemmEpilogue.DEFAULT
    return _quantized_gemm(
        dh, "rowwise", k, "rowwise", None, z, cfg, ops.rows + kf, (ops.k,) + kf, len(kf), 1
    ).out


def _wgrad(cfg: _Config, res, ops: _Operands, dh):
    """``dkernel = xᵀ · dh`` in the kernel's shape (and, under a recipe, its dtype)."""
    x = res.x
    if res.qs is None:
        dh = dh.reshape(ops.rows + cfg.features)
        dk = bind_gemm(
            x,
            dh,
            lhs_trans=True,
            implementation=_gemm_impl(cfg),
            k_ndim=len(ops.rows),
            n_ndim=len(cfg.features),
        ).out
        return logical_constraint(dk.reshape(_k_shape(ops, cfg)), cfg.kernel_axes)
    kf = _fp8_features(cfg, ops)
    z = GemmEpilogue.DEFAULT
    dk = _quantized_gemm(
        x,
        "colwise",
        dh,
        "colwise",
        None,
        z,
        cfg,
        (ops.k,) + ops.rows,
        kf + ops.rows,
        len(ops.rows),
        len(kf),
    )
    dk = logical_constraint(dk.out.reshape(_k_shape(ops, cfg)), cfg.kernel_axes)
    return dk.astype(cfg.kernel_dtype)


def _next_set(res, dh):
    """The quantizer set's cotangent: its next state (the forward's, and the grad quantizer's
    from dh's amax); ``None`` unquantized."""
    if res.qs is None:
        return None
    new = res.new_qs
    return QuantizerSet(x=new.x, kernel=new.kernel, grad=_updated(res.qs.grad, dh))


def _x_shape(ops: _Operands, cfg: _Config):
    return ops.lead + ops.contract


def _k_shape(ops: _Operands, cfg: _Config):
    return ops.contract + cfg.features


def _bias_ct(dbias, cfg: _Config):
    return None if not cfg.has_bias else dbias.reshape(cfg.features)


def _dact(dy2, act_in, cfg: _Config, ops: _Operands, quantizer):
    """``dh (M, *F)`` (with ``quantizer`` a ScaledTensor of ``(M, F)``) and ``dbias`` or None,
    from one fused ``quantize_dact_dbias`` where there is an activation."""
    impl = cfg.implementation
    if cfg.act is None:
        dbias = None
        if cfg.has_bias:
            rows = tuple(range(len(ops.rows)))
            dbias = jnp.sum(dy2.astype(jnp.float32), axis=rows).astype(cfg.dtype)
        if quantizer is None:
            return dy2, dbias
        dy_f = dy2.reshape(ops.rows + cfg.features)
        return quantize(
            dy_f, quantizer, implementation=impl, n_feature_axes=len(cfg.features)
        ), dbias
    # act_in is h, or for the ReLU epilogue y, whose sign is h's: relu'(y) == relu'(h). A
    # non-gated activation is elementwise: h as (M, F) whatever the kernel's output axes.
    x_act = act_in.reshape(ops.rows + (cfg.features if cfg.act.is_gated else (ops.f,)))
    dh, dbias = quantize_dact_dbias(
        dy2.reshape(ops.rows + cfg.act.output_shape(x_act.shape[len(ops.rows) :])),
        x_act,
        cfg.act,
        is_dbias=cfg.has_bias,
        quantizer=quantizer,
        act_params=cfg.params,
        implementation=impl,
    )
    if quantizer is None:
        dh = dh.reshape(ops.rows + cfg.features)
    return dh, dbias
