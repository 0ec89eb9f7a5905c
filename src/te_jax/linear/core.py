"""The core of te_jax's GEMM + bias + activation ops, shared by ``dense``, ``fused_mlp`` and
``gemm`` (docs/numerics.md §8): the static description of a call (``DenseConfig``, built by
``prepare`` from checked arguments), the GEMM views of its operands (``GemmViews``), the forward
(``forward``: the GEMM, its epilogue or ``act_lu``, FP8 quantization of the operands), the
backward pieces (``dact``: dact + dbias + quantize in one pass; ``dgrad``, ``wgrad``,
``gemm_grads``) and the pure-JAX tangent of forward mode (``tangent``).

Every GEMM goes through ``te_jax.linear.matmul`` (arrays or quantized copies in their logical
layouts). The wrappers that make these differentiable live in ``dense.py`` and
``fused_mlp.py``: the functions here are plain forward / backward computations.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from te_jax import activation_reference
from te_jax.activation_ops import act_lu, quantize_dact_dbias
from te_jax.activation_types import ActivationParams, ActivationType
from te_jax.dispatch import Path, check_input_dtype, decide
from te_jax.linear.matmul import matmul
from te_jax.primitives.gemm import TARGET as GEMM_TARGET
from te_jax.primitives.gemm import GemmEpilogue
from te_jax.quantize import quantize
from te_jax.quantize.quantize_layout import QuantizeLayout
from te_jax.quantize.quantizers import DelayedScaleQuantizer
from te_jax.quantize.scaled_tensor import ScaledTensor, cotangent_from_gradient
from te_jax.recipe import QuantizerSet
from te_jax.sharding import (
    BATCH,
    check_explicit_mesh,
    check_logical_axes,
    logical_constraint,
    logical_shard_counts,
)

__all__ = [
    "EPILOGUE_ACTIVATIONS",
    "DenseConfig",
    "GemmViews",
    "Residuals",
    "prepare",
    "dense_float64",
    "views",
    "forward",
    "backward",
    "dact",
    "dgrad",
    "wgrad",
    "gemm_grads",
    "grad_quantizer",
    "bias_cotangent",
    "next_state",
    "tangent",
]

ROW = QuantizeLayout.ROWWISE
COL = QuantizeLayout.COLWISE
BOTH = QuantizeLayout.ROWWISE_COLWISE


@dataclasses.dataclass(frozen=True)
class DenseConfig:
    """Everything static about one GEMM + bias + activation call (``prepare`` builds it);
    hashable: the custom_jvp / custom_vjp static argument."""

    act: ActivationType | None
    params: ActivationParams | None
    has_bias: bool
    contract: tuple[int, ...]  # the contracting shape (trailing of x, leading of the kernel)
    features: tuple[int, ...]  # the kernel's non-contracting shape: (N...) or (2, N)
    dtype: np.dtype  # the compute dtype: x's
    implementation: str | None
    path: Path  # where the GEMMs run (te_jax.dispatch.decide)
    kernel_dtype: np.dtype  # the kernel's own: quantized from it under a recipe
    kernel_axes: tuple[str | None, ...] | None = None  # logical names: dkernel's sharding
    fold_rows: bool = False  # x's leading axes folded into one row axis (block scaling)
    where: str = "te_jax.dense"  # the public op, named in errors

    @property
    def out_features(self) -> tuple[int, ...]:
        return self.act.output_shape(self.features) if self.act else self.features

    @property
    def kernel_gemm(self) -> bool:
        """The GEMMs run on te_jax's CUDA handler (their epilogues then apply the activation)."""
        return self.path is Path.KERNEL


def prepare(
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
    """Checks one call's arguments (each error names ``where``, the public op) and returns
    ``(DenseConfig, kernel, bias, quantizer_set)``: the kernel cast to x's dtype (quantized from
    its own under a recipe), the bias cast to x's dtype, an empty set as ``None``."""
    if impl not in (None, "ffi", "xla"):
        raise ValueError(f"{where}: implementation must be None, 'ffi' or 'xla', got {impl!r}")
    quantized_x = isinstance(x, ScaledTensor)
    check_explicit_mesh(where, x=None if quantized_x else x, kernel=kernel)
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
        if mode.impl.gemm_operands is None:
            raise ValueError(
                f"{where}: {mode.name} GEMMs are not supported (recipes: DelayedScaling, "
                "CurrentScaling, MXFP8BlockScaling, Float8BlockScaling)"
            )
    if quantized_x:
        _check_quantized_x(where, x, qs, n_c, contracting_dims)
    if qs is not None and qs.scaling_mode.block_size and not qs.scaling_mode.impl.partial_blocks:
        kernel = _check_block_shapes(where, qs.scaling_mode, x, x_shape, k_shape, n_c, act, kernel)
    if qs is not None and any(getattr(qs, r).scaling_mode.impl.partial_blocks for r in _ROLES):
        _check_block_shards(where, qs, x_shape, k_shape, n_c, kernel_axes)
    if dtype == jnp.float64 and qs is not None:
        raise TypeError(f"{where}: FP8 recipes take float32/bfloat16/float16 x, got float64")
    # Unquantized, the kernel is cast to x's dtype; under a recipe it is quantized from its own
    # (one rounding from float32 parameters, one pass over them), float64 excepted.
    if qs is None or k_dtype == jnp.float64:
        kernel = kernel.astype(dtype)

    # float64 takes its own pure-JAX path (dense_float64), before any GEMM primitive.
    path = (
        Path.XLA
        if dtype == jnp.float64
        else decide(where.removeprefix("te_jax."), impl, dtype, target=GEMM_TARGET)
    )
    cfg = DenseConfig(
        act,
        params,
        bias is not None,
        k_shape[:n_c],
        features,
        np.dtype(dtype),
        impl,
        path,
        np.dtype(kernel.dtype),
        check_logical_axes(where, "kernel_axes", kernel_axes, jnp.ndim(kernel)),
        qs is not None and qs.scaling_mode.impl.gemm_folds_rows,
        where,
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


_ROLES = ("x", "kernel", "grad")


def _check_block_shards(where, qs, x_shape, k_shape, n_c, kernel_axes):
    """Blockwise FP8 under the active logical axis rules and mesh: no block may straddle two
    shards. The kernel is blocked along K and N (1×128 blocks one way or the other, or 128×128
    tiles); x and the gradient down the rows (the wgrad GEMM's 1D blocks), split as the
    ``batch`` logical axis. Each split axis must leave every shard a run of whole blocks: its
    shard extent times the extents of the axes inside it in the flattened dimension a multiple
    of the block. ``ValueError`` naming the axis and the fix otherwise (trace time)."""
    block = qs.x.scaling_mode.block_size
    fix = (
        f"use sizes whose shards are multiples of {block}, split that axis over fewer devices, "
        "or train this layer with DelayedScaling() / CurrentScaling(), which take any split"
    )
    lead = x_shape[: len(x_shape) - n_c]
    groups = []  # (what, shape of the flattened dimension, logical names)
    if kernel_axes is not None:
        groups.append(("the kernel's contracting axes", k_shape[:n_c], kernel_axes[:n_c], 0))
        groups.append(("the kernel's output axes", k_shape[n_c:], kernel_axes[n_c:], n_c))
    if lead:
        groups.append(("x's rows", lead, (BATCH,) + (None,) * (len(lead) - 1), 0))
    for what, shape, names, offset in groups:
        counts = logical_shard_counts(names)
        for i, (size, n, name) in enumerate(zip(shape, counts, names, strict=True)):
            if n == 1:
                continue
            run = size // n * math.prod(shape[i + 1 :])
            if size % n or run % block:
                array = "kernel" if what.startswith("the kernel") else "x"
                raise ValueError(
                    f"{where}: {qs.x.scaling_mode.name} (Float8BlockScaling) quantizes in blocks "
                    f"of {block}, which must not straddle two shards: {what} ({array} axis "
                    f"{offset + i}, logical {name!r}, size {size}, of shape {tuple(shape)}) are "
                    f"split {n} ways by the mesh, leaving runs of {size / n:g} x "
                    f"{math.prod(shape[i + 1 :])} = {size * math.prod(shape[i + 1 :]) / n:g} "
                    f"elements per shard, not a multiple of {block}; {fix}"
                )


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


def dense_float64(x, kernel, bias, cfg: DenseConfig):
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
    return h if cfg.act is None else activation_reference.activation(h, cfg.act, cfg.params)


def tangent(cfg: DenseConfig, res, x_dot=None, kernel_dot=None, bias_dot=None):
    """The tangent of the unquantized dense op, in pure JAX (its forward mode).

    ``ḣ = ẋ·kernel + x·k̇ + ḃ``, accumulated in float32 and rounded once to the compute dtype
    (docs/numerics.md §8's rule for ``h``), then ``ẏ = act'(h)·ḣ`` by
    ``te_jax.activation_reference.act_lu_tangent`` (gated: docs/numerics.md §1's product rule).
    ``act'`` is taken at what the backward's dact reads (h, or y for the ReLU epilogue: the same
    sign).

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
        y_dot = activation_reference.act_lu_tangent(h_dot, res.act_in, cfg.act, cfg.params)
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


# ---- the GEMM views -------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class GemmViews:
    """The GEMM views of one call: ``M`` rows (in the row axes ``rows``), ``K`` contracting,
    ``F`` output columns."""

    m: int
    k: int
    f: int
    lead: tuple[int, ...]  # x's leading axes
    contract: tuple[int, ...]  # the contracting axes (folded into k)
    rows: tuple[int, ...]  # the GEMMs' row axes: lead, or (m,) where they are folded

    @property
    def x_shape(self) -> tuple[int, ...]:
        return self.lead + self.contract


def views(lead: tuple[int, ...], cfg: DenseConfig) -> GemmViews:
    """The GEMM views. x's leading axes stay apart as the GEMMs' row axes (a sequence split
    under an unsplit batch stays a split of its own axis), except where the scaling mode folds
    them into M (``ScalingModeImpl.gemm_folds_rows``)."""
    m = math.prod(lead)
    rows = (m,) if cfg.fold_rows or not lead else tuple(lead)
    return GemmViews(m, math.prod(cfg.contract), math.prod(cfg.features), lead, cfg.contract, rows)


# The activations te_jax's GEMM can apply in its epilogue (on its CUDA handler).
EPILOGUE_ACTIVATIONS = (ActivationType.GELU, ActivationType.RELU)


def epilogue_for(cfg: DenseConfig, residuals: bool = True) -> GemmEpilogue:
    """The activation the GEMM's epilogue applies (te_jax's CUDA handler only: elsewhere the
    activation is act_lu on the rounded h, docs/numerics.md §8's exact order). GELU writes h
    beside y only where a backward will read it."""
    if cfg.kernel_gemm and cfg.act is ActivationType.GELU:
        return GemmEpilogue.GELU_AUX if residuals else GemmEpilogue.GELU
    if cfg.kernel_gemm and cfg.act is ActivationType.RELU:
        return GemmEpilogue.RELU
    return GemmEpilogue.DEFAULT


def _activate(h2, cfg: DenseConfig, ep: GemmEpilogue, aux, v: GemmViews):
    """``y`` from the GEMM's output (h, or y where the epilogue applied the activation), and the
    array the backward's dact reads: h, or for ReLU y, whose sign is h's (relu'(h) = [y > 0])."""
    if ep in (GemmEpilogue.GELU_AUX, GemmEpilogue.GELU):
        return h2, aux
    if ep is GemmEpilogue.RELU:
        return h2, h2
    if cfg.act is None:
        return h2, None
    # Explicit sizes, not -1: reshape cannot infer a -1 beside a 0 (an empty batch, M = 0).
    h = h2.reshape(v.rows + cfg.features)
    return act_lu(h, cfg.act, act_params=cfg.params, implementation=cfg.implementation), h2


class Residuals(NamedTuple):
    """What the forward keeps for the backward."""

    x: jax.Array | ScaledTensor  # (M, K), or x's quantized copies
    kernel: jax.Array | ScaledTensor  # (K, *F), or the kernel's quantized copies of (K, F)
    act_in: jax.Array | None  # what dact reads: h (M, *F), y for the ReLU epilogue; None
    quantized_x: ScaledTensor | None  # x as given, where it came quantized (its cotangent)
    new_qs: QuantizerSet | None  # the forward quantizers' next state
    qs: QuantizerSet | None  # the quantizer set used


def named_residuals(res: Residuals, name: str) -> Residuals:
    """``res`` with remat checkpoint names (``jax.ad_checkpoint.checkpoint_name``): the GEMM's
    input as the backward keeps it (quantized copies under a recipe) ``{name}_input``, its
    kernel's ``{name}_kernel``, what dact reads (h) ``name`` itself, and the quantizers (the
    set used and its next state: scales and amax histories, a few numbers)
    ``{name}_quantizers``. A remat policy that saves them
    (``jax.checkpoint_policies.save_only_these_names``) recomputes none of them, so no tensor is
    quantized twice."""

    def tag(tree, label):
        return None if tree is None else jax.tree.map(lambda a: checkpoint_name(a, label), tree)

    return res._replace(
        x=tag(res.x, f"{name}_input"),
        kernel=tag(res.kernel, f"{name}_kernel"),
        act_in=tag(res.act_in, name),
        new_qs=tag(res.new_qs, f"{name}_quantizers"),
        qs=tag(res.qs, f"{name}_quantizers"),
    )


# ---- forward --------------------------------------------------------------------------------


def forward(
    x, kernel, bias, qs, cfg: DenseConfig, residuals: bool, addend=None, quantized_kernel=None
):
    """``y (*lead, *out_features)``, and with ``residuals`` the ``Residuals`` of the backward.

    ``addend`` (``y``'s shape, no activation): added in the GEMM's pass, ``y = x·k + addend +
    bias`` with one rounding (its gradient is the caller's: ``dy`` itself).
    ``quantized_kernel``: the kernel's codes quantized ahead with ``qs`` (``kernel_cache``),
    used in place of quantizing ``kernel`` here."""
    v = views(tuple(x.shape)[: len(x.shape) - len(cfg.contract)], cfg)
    ep = epilogue_for(cfg, residuals)
    if addend is not None:
        if cfg.act is not None:
            raise ValueError(f"{cfg.where}: an addend is added only without an activation")
        addend = addend.astype(cfg.dtype).reshape(v.rows + cfg.features)
    if qs is None:
        # The kernel's output axes stay apart ((K, 2, N) for a gated kernel: a mesh axis can
        # split N with both halves on each shard); the GEMM folds them locally.
        x2 = x.reshape(v.rows + (v.k,))
        k2 = kernel.reshape((v.k,) + cfg.features)
        r = matmul(x2, k2, bias=bias, addend=addend, epilogue=ep, implementation=cfg.implementation)
        y, act_in = _activate(r.out, cfg, ep, r.aux, v)
        res = Residuals(x2, k2, act_in, None, None, None) if residuals else None
        return _unflatten_y(y, v, cfg), res

    kf = fp8_features(cfg, v)
    k2 = kernel.reshape((v.k,) + kf)
    b1 = None if bias is None else bias.reshape(kf)
    qx, qk, new_x, new_k = _quantize_operands(x, k2, qs, v, cfg, residuals, quantized_kernel)
    r = matmul(
        qx,
        qk,
        lhs_shape=v.rows + (v.k,),
        rhs_shape=(v.k,) + kf,
        bias=b1,
        addend=None if addend is None else addend.reshape(v.rows + kf),
        epilogue=ep,
        out_dtype=cfg.dtype,
        split_accumulator=qs.split_accumulator[0],
        implementation=cfg.implementation,
    )
    y, act_in = _activate(r.out, cfg, ep, r.aux, v)
    if not residuals:
        return _unflatten_y(y, v, cfg), None
    new_qs = dataclasses.replace(qs, x=new_x, kernel=new_k)
    return _unflatten_y(y, v, cfg), Residuals(
        qx, qk, act_in, x if isinstance(x, ScaledTensor) else None, new_qs, qs
    )


def _unflatten_y(y, v: GemmViews, cfg: DenseConfig):
    return y.reshape(v.lead + cfg.out_features)


def _quantize_operands(
    x, k2, qs: QuantizerSet, v: GemmViews, cfg: DenseConfig, residuals, quantized_kernel=None
):
    """x's and the kernel's quantized copies (the forward GEMM reads x rowwise and the kernel
    colwise; the backward's GEMMs the other copies), and their quantizers' next states."""
    impl = cfg.implementation
    if isinstance(x, ScaledTensor):
        if residuals and x.colwise_data is None:
            raise ValueError(
                f"{cfg.where}: differentiating with a quantized x needs its colwise copy (wgrad "
                "reads it): quantize it with q_layout ROWWISE_COLWISE"
            )
        # x was quantized upstream (te_jax.activation), whose backward returns the x
        # quantizer's next state: this use contributes nothing (a zero cotangent).
        qx, new_x = x, jax.tree.map(jnp.zeros_like, qs.x)
    else:
        qx = quantize(
            x.reshape(v.rows + (v.k,)),
            qs.with_layout("x", BOTH if residuals else ROW),
            implementation=impl,
        )
        new_x = next_state(qs.x, qx)
    if quantized_kernel is not None:  # the (K, F) codes: every view the GEMMs take
        qk = quantized_kernel
    else:
        qk = quantize(
            k2,
            qs.with_layout("kernel", BOTH if residuals else COL),
            implementation=impl,
            n_feature_axes=k2.ndim - 1,
        )
    return qx, qk, new_x, next_state(qs.kernel, qk)


def fp8_features(cfg: DenseConfig, v: GemmViews) -> tuple[int, ...]:
    """The kernel's output axes as the quantized GEMMs take them: apart (a gated ``(2, N)``: a
    mesh axis can split N with both halves on each shard), except under a non-gated activation,
    whose quantized gradient (elementwise dact) folds them into one."""
    if cfg.act is None or cfg.act.is_gated:
        return cfg.features
    return (v.f,)


def next_state(q, st: ScaledTensor):
    """The quantizer's state for the next step: delayed scaling's from ``st``'s amax; the
    other quantizers have none."""
    return q.update(st.amax) if isinstance(q, DelayedScaleQuantizer) else q


# ---- backward -------------------------------------------------------------------------------


def backward(cfg: DenseConfig, res: Residuals, dy):
    """``(x's cotangent, dkernel, dbias, the quantizer set's cotangent)`` from ``dy``."""
    quantized_x = res.quantized_x
    v = views(tuple(dy.shape)[: dy.ndim - len(cfg.out_features)], cfg)
    dy2 = dy.reshape(v.rows + cfg.out_features)
    dh, dbias = dact(dy2, res.act_in, cfg, v, quantizer=grad_quantizer(res))
    dx, dk, dbias, new_qs = gemm_grads(cfg, res, v, dh, dbias)
    if quantized_x is not None:
        x_ct = cotangent_from_gradient(quantized_x, dx)
    else:
        x_ct = dx.reshape(v.x_shape)
    return x_ct, dk, dbias, new_qs


def grad_quantizer(res: Residuals):
    """The grad quantizer with both copies (dgrad reads the rowwise, wgrad the colwise);
    ``None`` unquantized."""
    return None if res.qs is None else res.qs.with_layout("grad", BOTH)


def gemm_grads(cfg: DenseConfig, res: Residuals, v: GemmViews, dh, dbias):
    """The backward's two GEMMs from ``dh (M, F)`` (a ScaledTensor of the grad quantizer under
    a recipe): ``(dx (M, K), dkernel, the bias cotangent, the quantizer set's cotangent)``."""
    return (
        dgrad(cfg, res, v, dh),
        wgrad(cfg, res, v, dh),
        bias_cotangent(dbias, cfg),
        _next_set(res, dh),
    )


def dgrad(cfg: DenseConfig, res: Residuals, v: GemmViews, dh):
    """``dx (M, K) = dh · kernelᵀ``."""
    kf = cfg.features if res.qs is None else fp8_features(cfg, v)
    return matmul(
        dh,
        res.kernel,
        k_ndim=len(kf),
        lhs_shape=v.rows + kf,
        rhs_shape=(v.k,) + kf,
        rhs_contracts_trailing=True,
        out_dtype=None if res.qs is None else cfg.dtype,
        split_accumulator=True if res.qs is None else res.qs.split_accumulator[1],
        implementation=cfg.implementation,
    ).out


def wgrad(cfg: DenseConfig, res: Residuals, v: GemmViews, dh):
    """``dkernel = xᵀ · dh`` in the kernel's shape (and, under a recipe, its dtype: an FP8 GEMM
    writes it straight from its float32 accumulator, one rounding or none for float32
    parameters)."""
    kf = cfg.features if res.qs is None else fp8_features(cfg, v)
    dk = matmul(
        res.x,
        dh,
        k_ndim=len(v.rows),
        lhs_shape=v.rows + (v.k,),
        rhs_shape=v.rows + kf,
        lhs_contracts_leading=True,
        out_dtype=_wgrad_dtype(cfg, res.qs),
        split_accumulator=True if res.qs is None else res.qs.split_accumulator[2],
        implementation=cfg.implementation,
    ).out
    dk = logical_constraint(dk.reshape(v.contract + cfg.features), cfg.kernel_axes)
    return dk if res.qs is None else dk.astype(cfg.kernel_dtype)


def _wgrad_dtype(cfg: DenseConfig, qs: QuantizerSet | None):
    """The wgrad GEMM's output dtype: the operands' unquantized; the kernel's own where the GEMM
    multiplies FP8 codes, per tensor or in blocks (no cast pass behind it); the compute dtype
    where it multiplies dequantized operands (MXFP8 without an MXFP8 GEMM: a float32 GEMM would
    be slower)."""
    if qs is None:
        return None
    codes = qs.scaling_mode.impl.gemm_operands in ("codes", "block_codes")
    return cfg.kernel_dtype if codes else cfg.dtype


def _next_set(res: Residuals, dh):
    """The quantizer set's cotangent: its next state (the forward's, and the grad quantizer's
    from dh's amax); ``None`` unquantized."""
    if res.qs is None:
        return None
    new = res.new_qs
    return dataclasses.replace(new, grad=next_state(res.qs.grad, dh))


def bias_cotangent(dbias, cfg: DenseConfig):
    return None if not cfg.has_bias else dbias.reshape(cfg.features)


def dact(dy2, act_in, cfg: DenseConfig, v: GemmViews, quantizer):
    """``dh (M, *F)`` (with ``quantizer`` a ScaledTensor of ``(M, F)``) and ``dbias`` or None,
    from one fused ``quantize_dact_dbias`` where there is an activation."""
    impl = cfg.implementation
    if cfg.act is None:
        dbias = None
        if cfg.has_bias:
            rows = tuple(range(len(v.rows)))
            dbias = jnp.sum(dy2.astype(jnp.float32), axis=rows).astype(cfg.dtype)
        if quantizer is None:
            return dy2, dbias
        dy_f = dy2.reshape(v.rows + cfg.features)
        return quantize(
            dy_f, quantizer, implementation=impl, n_feature_axes=len(cfg.features)
        ), dbias
    # act_in is h, or for the ReLU epilogue y, whose sign is h's: relu'(y) == relu'(h). A
    # non-gated activation is elementwise: h as (M, F) whatever the kernel's output axes.
    x_act = act_in.reshape(v.rows + (cfg.features if cfg.act.is_gated else (v.f,)))
    dh, dbias = quantize_dact_dbias(
        dy2.reshape(v.rows + cfg.act.output_shape(x_act.shape[len(v.rows) :])),
        x_act,
        cfg.act,
        is_dbias=cfg.has_bias,
        quantizer=quantizer,
        act_params=cfg.params,
        implementation=impl,
    )
    if quantizer is None:
        dh = dh.reshape(v.rows + cfg.features)
    return dh, dbias
