"""``te_jax.fused_mlp``: the transformer MLP's two GEMMs as one differentiable op.

``out = act(x · kernel_1 + bias_1) · kernel_2 + bias_2``: the math of two ``te_jax.dense``
calls (docs/numerics.md §8), with one ``custom_vjp`` over both GEMMs so that what lies between
them fuses across the GEMM boundary:

* **FP8** (a recipe): the first GEMM writes only ``h``; one ``act_lu`` kernel applies the
  activation and quantizes it for the second GEMM (rowwise and colwise copies, §6), where two
  ``dense`` calls would have the first GEMM write ``h`` and ``y`` and a quantize pass read ``y``
  back (the same codes: a quantized ``act_lu`` is ``quantize(act_lu(h))`` bit for bit,
  docs/numerics.md §4). Backward: the second GEMM's dgrad writes
  ``dy₂ · kernel_2ᵀ``; ``quantize_dact_dbias`` turns it into the first GEMM's quantized
  gradient and ``dbias_1`` in one pass, as in ``dense``.
* **Unquantized GELU**, with ``gelu_backward="dgelu"`` or
  ``"dgelu_bgrad"`` (the default ``"dact"`` is a separate dact pass, measured faster:
  ffi/gemm/NOTES.md): the backward's dgrad GEMM of ``kernel_2`` applies ``gelu'(h)`` in its
  epilogue (cuBLASLt's DGELU), and with ``"dgelu_bgrad"`` reduces ``dbias_1`` there too (BGRAD;
  with ``"dgelu"`` ``dbias_1`` is a float32 sum of ``dh``), so ``dy₂ · kernel_2ᵀ`` never reaches
  memory. Its float32 product is multiplied by ``gelu'(h)`` before the one rounding, where §8's
  order rounds it first (within §7's tolerance of it). Off a GPU the GEMM primitive's pure-JAX
  lowering computes the same epilogue (``implementation="xla"``: the dact pass).

Elsewhere (other activations unquantized, the CPU, ``implementation="xla"``) it computes
exactly what ``dense(dense(x, kernel_1, bias_1, act), kernel_2, bias_2)`` does.

Differentiation as ``dense``'s: unquantized a ``custom_jvp`` whose tangent (the two dense
tangents in a row) transposes to the backward above, so ``jvp`` / ``jacfwd`` work and ``grad``
runs that backward alone; under a recipe a ``custom_vjp``, reverse mode only.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import SymbolicZero

from te_jax import _varying, fp8_autodiff
from te_jax.activation_ops import act_lu
from te_jax.activation_types import ActivationLike, ActivationParams, ActivationType
from te_jax.dispatch import Path
from te_jax.linear import core
from te_jax.linear.dense import dense
from te_jax.linear.kernel_cache import check_quantized_kernel
from te_jax.linear.matmul import matmul
from te_jax.primitives.custom_linear import LinearRule, custom_linear
from te_jax.primitives.gemm import GemmEpilogue
from te_jax.quantize.quantize_layout import QuantizeLayout
from te_jax.recipe import QuantizerSet

__all__ = ["fused_mlp", "GELU_BACKWARDS", "MLPConfig", "configure", "forward", "backward"]

_WHERE = "te_jax.fused_mlp"
_LAST = ((-1,), (0,))
# Where an unquantized GELU MLP on te_jax's CUDA GEMM computes gelu'(h) and dbias_1 (module
# docstring): a dact pass; the DGELU epilogue of kernel_2's dgrad GEMM; DGELU + BGRAD.
GELU_BACKWARDS = ("dact", "dgelu", "dgelu_bgrad")


@dataclasses.dataclass(frozen=True)
class MLPConfig:
    """Everything static about one call: each GEMM's dense config, and whether the backward
    fuses gelu' (and dbias_1) into kernel_2's dgrad GEMM."""

    first: core.DenseConfig
    second: core.DenseConfig
    dgelu_epilogue: bool
    dgelu_bgrad: bool


def fused_mlp(
    x: jax.Array,
    kernel_1: jax.Array,
    kernel_2: jax.Array,
    bias_1: jax.Array | None = None,
    bias_2: jax.Array | None = None,
    activation_type: ActivationLike = ("gelu",),
    quantizer_sets: tuple[QuantizerSet | None, QuantizerSet | None] = (None, None),
    act_params: ActivationParams | None = None,
    implementation: str | None = None,
    kernel_axes: tuple[Sequence[str | None] | None, Sequence[str | None] | None] = (None, None),
    gelu_backward: str = "dact",
    quantized_kernels=(None, None),
) -> jax.Array:
    """The MLP block's GEMMs: ``out = act(x · kernel_1 + bias_1) · kernel_2 + bias_2``.

    Each GEMM follows ``te_jax.dense`` (docs/numerics.md §8): float32 accumulation, one
    rounding to x's dtype; ``jax.grad`` gives every input's gradient and, under a
    delayed-scaling recipe, each ``QuantizerSet``'s next state as its cotangent. Without
    quantizer sets ``jax.jvp`` / ``jax.jacfwd`` work too; FP8 is reverse-mode only.

    Args:
      x: ``(..., H)`` float32 / bfloat16 / float16 (the compute dtype).
      kernel_1: ``(H, I)``; for a gated activation ``(H, 2, I)`` (docs/numerics.md §1's layout).
      kernel_2: ``(I, *F)``, usually ``(I, H)``.
      bias_1: ``None``, ``(I,)`` or gated ``(2, I)``; bias_2: ``None`` or ``F``-shaped.
      activation_type: any te_jax activation or gated pair.
      quantizer_sets: one ``QuantizerSet`` (or ``None``) per GEMM, from one recipe.
      act_params: ``ActivationParams`` for clamped SwiGLU.
      implementation: ``None``, ``"ffi"`` or ``"xla"``, as for ``dense``.
      kernel_axes: each kernel's logical axis names (or ``None``), as ``dense``'s.
      gelu_backward: ``"dact"`` (default), ``"dgelu"`` or ``"dgelu_bgrad"``: where an unquantized
        GELU MLP computes ``gelu'(h)`` and ``dbias_1`` (module docstring); no effect under a
        recipe, for other activations or with ``implementation="xla"``.
      quantized_kernels: per GEMM ``None`` or ``te_jax.quantize_kernel(kernel, its set)``: the
        kernel's codes quantized once for several calls (``dense``'s ``quantized_kernel``).

    Returns:
      ``out (..., *F)`` in x's dtype.

    Example:
      >>> import jax.numpy as jnp, te_jax
      >>> x = jnp.ones((4, 32), jnp.bfloat16)
      >>> w1, w2 = jnp.ones((32, 64), jnp.bfloat16) / 32, jnp.ones((64, 32), jnp.bfloat16) / 64
      >>> te_jax.fused_mlp(x, w1, w2, activation_type="relu").shape
      (4, 32)
    """
    prepared = configure(
        x, kernel_1, kernel_2, bias_1, bias_2, activation_type, quantizer_sets, act_params,
        implementation, kernel_axes, gelu_backward, _WHERE,
    )
    if prepared is None:
        # float64 (pure JAX), or one GEMM quantized and not the other: nothing crosses the
        # boundary fused, so the two dense calls are the op.
        qs = _quantizer_sets(quantizer_sets)
        qk1, qk2 = _pair("quantized_kernels", quantized_kernels)
        h = dense(
            x, kernel_1, bias_1, activation_type, qs[0], act_params,
            implementation=implementation, kernel_axes=kernel_axes[0], quantized_kernel=qk1,
        )
        return dense(
            h, kernel_2, bias_2, None, qs[1], implementation=implementation,
            kernel_axes=kernel_axes[1], quantized_kernel=qk2,
        )
    cfg, (x, k1, b1, k2, b2, q1, q2) = prepared
    qk1, qk2 = (
        None if qk is None else check_quantized_kernel(_WHERE, qk, tuple(k.shape), 1, q)
        for qk, k, q in zip(
            _pair("quantized_kernels", quantized_kernels), (k1, k2), (q1, q2), strict=True
        )
    )
    x, k1, b1, k2, b2 = _varying.match(x, k1, b1, k2, b2)  # inside shard_map: te_jax._varying
    if q1 is None:
        return _mlp_unquantized(x, k1, b1, k2, b2, cfg)
    return fp8_autodiff.reverse_mode_only(
        _WHERE, _mlp, x, k1, b1, k2, b2, q1, q2, qk1, qk2, cfg
    )


def configure(
    x, kernel_1, kernel_2, bias_1, bias_2, activation_type, quantizer_sets, act_params,
    implementation, kernel_axes, gelu_backward="dact", where=_WHERE,
):
    """The checked ``MLPConfig`` of one call and its operands as the GEMMs take them
    (``(cfg, (x, kernel_1, bias_1, kernel_2, bias_2, q1, q2))``), or ``None`` where the call
    is two ``dense`` calls (float64, or one GEMM quantized and not the other). ``where`` names
    the public op in errors."""
    if activation_type is None:
        raise ValueError(f"{where}: activation_type is required (the MLP's activation)")
    if gelu_backward not in GELU_BACKWARDS:
        raise ValueError(
            f"{where}: gelu_backward must be one of {', '.join(map(repr, GELU_BACKWARDS))}, got "
            f"{gelu_backward!r}"
        )
    qs = _quantizer_sets(quantizer_sets)
    axes_1, axes_2 = kernel_axes
    c1, k1, b1, q1 = core.prepare(
        x, kernel_1, bias_1, activation_type, qs[0], act_params, _LAST, implementation, where,
        kernel_axes=axes_1,
    )
    if len(c1.out_features) != 1:
        raise ValueError(
            f"{where}: kernel_1 must be (H, I), or (H, 2, I) for a gated activation; got "
            f"shape {tuple(jnp.shape(kernel_1))}"
        )
    hidden = jax.ShapeDtypeStruct(tuple(jnp.shape(x))[:-1] + c1.out_features, c1.dtype)
    c2, k2, b2, q2 = core.prepare(
        hidden, kernel_2, bias_2, None, qs[1], None, _LAST, implementation, where, axes_2
    )
    if c1.dtype == np.float64 or (q1 is None) != (q2 is None):
        return None
    # The DGELU epilogue where the GEMM primitive runs: te_jax's kernel, or off a GPU its
    # pure-JAX lowering, which computes the same epilogue.
    dgelu = (
        gelu_backward != "dact"
        and q1 is None
        and c1.act is ActivationType.GELU
        and c1.path is not Path.XLA
    )
    cfg = MLPConfig(c1, c2, dgelu, gelu_backward == "dgelu_bgrad")
    return cfg, (x, k1, b1, k2, b2, q1, q2)


def _quantizer_sets(sets):
    return _pair("quantizer_sets", sets, "QuantizerSet")


def _pair(name: str, pair, what: str = "ScaledTensor"):
    try:
        a, b = pair
    except (TypeError, ValueError):
        raise ValueError(
            f"{_WHERE}: {name} must be a pair (first GEMM's, second GEMM's), each a "
            f"{what} or None; got {pair!r}"
        ) from None
    return a, b


# ---- unquantized: a custom_jvp whose tangent transposes to the fused backward ---------------


@functools.partial(jax.custom_jvp, nondiff_argnums=(5,))
def _mlp_unquantized(x, k1, b1, k2, b2, cfg: MLPConfig):
    return forward(x, k1, b1, k2, b2, None, None, cfg, residuals=False)[0]


@functools.partial(_mlp_unquantized.defjvp, symbolic_zeros=True)
def _mlp_unquantized_jvp(cfg: MLPConfig, primals, tangents):
    """``out`` from the forward that keeps the backward's residuals, and its tangent, the two
    dense tangents in a row (``te_jax.dense.tangent``), as a ``custom_linear`` whose transpose
    is ``backward``: forward mode evaluates the tangent, reverse mode runs the backward."""
    out, res = forward(*primals, None, None, cfg, residuals=True)
    res = named(res)
    present = tuple(t is not None and not isinstance(t, SymbolicZero) for t in tangents)
    if not any(present):
        return out, jnp.zeros_like(out)
    leaves, tree = jax.tree.flatten(res)
    rule = LinearRule(_tangent_apply, _tangent_transpose, (cfg, tree, present, out.shape))
    (out_dot,) = custom_linear(
        rule, leaves, [t for t, p in zip(tangents, present, strict=True) if p]
    )
    return out, out_dot


def _tangent_apply(static, leaves, tangents):
    """``ẏ₁ = act'(h)·(ẋ·W₁ + x·Ẇ₁ + ḃ₁)``, then ``ȯut = ẏ₁·W₂ + y₁·Ẇ₂ + ḃ₂`` (pure JAX)."""
    cfg, tree, present, out_shape = static
    res1, res2 = jax.tree.unflatten(tree, leaves)
    it = iter(tangents)
    x_dot, k1_dot, b1_dot, k2_dot, b2_dot = (next(it) if p else None for p in present)
    y1_dot = core.tangent(cfg.first, res1, x_dot, k1_dot, b1_dot)
    out_dot = core.tangent(cfg.second, res2, y1_dot, k2_dot, b2_dot)
    return (out_dot.reshape(out_shape),)


def _tangent_transpose(static, leaves, cotangents):
    """Reverse mode: ``backward``, the cotangents of the tangents present."""
    cfg, tree, present, _ = static
    (dy,) = cotangents
    cts = backward(cfg, jax.tree.unflatten(tree, leaves), dy)[:5]
    return tuple(ct for ct, p in zip(cts, present, strict=True) if p)


# ---- FP8 (and one GEMM quantized): the custom_vjp -------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(9,))
def _mlp(x, k1, b1, k2, b2, q1, q2, qk1, qk2, cfg: MLPConfig):
    return forward(x, k1, b1, k2, b2, q1, q2, cfg, residuals=False, quantized=(qk1, qk2))[0]


def _mlp_fwd(x, k1, b1, k2, b2, q1, q2, qk1, qk2, cfg):
    """The forward with residuals; ``symbolic_zeros`` tells which inputs are differentiated
    (te_jax.fp8_autodiff: forward mode over it, a delayed-scaling set not differentiated)."""
    operands, perturbed = fp8_autodiff.unwrap_primals((x, k1, b1, k2, b2))
    (q1, s1), (q2, s2) = fp8_autodiff.unwrap_primals(q1), fp8_autodiff.unwrap_primals(q2)
    if fp8_autodiff.under_jvp((operands, q1, q2)):  # jvp of grad: forward over this op
        raise TypeError(fp8_autodiff.forward_mode_message(_WHERE))
    fp8_autodiff.check_state_differentiated(_WHERE, perturbed, [s1, s2])
    quantized, _ = fp8_autodiff.unwrap_primals((qk1, qk2))
    out, res = forward(*operands, q1, q2, cfg, residuals=True, quantized=quantized)
    return out, named(res)


def _mlp_bwd(cfg: MLPConfig, res, dy):
    # The quantized kernels' codes get no cotangent (the kernels' gradients are dkernel).
    return (*backward(cfg, res, dy), None, None)


# The remat checkpoint names of the two GEMMs' residuals (TransformerEngine-JAX's ffn1 / ffn2).
CHECKPOINT_NAMES = ("ffn1", "ffn2")


def named(res):
    """Both GEMMs' residuals named for remat policies (``core.named_residuals``): ``ffn1`` (h),
    ``ffn1_input``, ``ffn1_kernel``, ``ffn1_quantizers``, ``ffn2_input`` (the activation,
    quantized under a recipe), ``ffn2_kernel`` and ``ffn2_quantizers``."""
    return tuple(core.named_residuals(r, n) for r, n in zip(res, CHECKPOINT_NAMES, strict=True))


def forward(x, k1, b1, k2, b2, q1, q2, cfg: MLPConfig, residuals: bool, quantized=(None, None)):
    """``(out, (res1, res2))``: the MLP's forward (with ``residuals``, each GEMM's
    ``core.Residuals``, the first's ``act_in`` holding h). ``quantized``: each kernel's codes
    quantized ahead (``kernel_cache``), or ``None``."""
    c1, c2 = cfg.first, cfg.second
    if q1 is None:
        y, res1 = core.forward(x, k1, b1, None, c1, residuals)
        out, res2 = core.forward(y, k2, b2, None, c2, residuals)
        return out, (res1, res2)
    # FP8: the first GEMM writes h, act_lu quantizes act(h) for the second in the same pass.
    h, res1 = core.forward(
        x, k1, b1, q1, dataclasses.replace(c1, act=None), residuals, quantized_kernel=quantized[0]
    )
    lead = tuple(jnp.shape(x))[:-1]
    ops = core.views(lead, c1)
    # In the row axes dense quantizes x with (folded into one under MXFP8: its colwise blocks).
    h = h.reshape(ops.rows + c1.features)
    layout = QuantizeLayout.ROWWISE_COLWISE if residuals else QuantizeLayout.ROWWISE
    y = act_lu(
        h,
        c1.act,
        quantizer=q2.with_layout("x", layout),
        act_params=c1.params,
        implementation=c1.implementation,
    )
    out, res2 = core.forward(y, k2, b2, q2, c2, residuals, quantized_kernel=quantized[1])
    out = out.reshape(lead + c2.out_features)
    if not residuals:
        return out, None
    res1 = res1._replace(act_in=h)
    # The second GEMM's x quantizer advances by the activation's amax (dense keeps the state
    # of an x quantized elsewhere as it is); its cotangent is computed here, not by dense.
    new2 = dataclasses.replace(res2.new_qs, x=core.next_state(q2.x, y))
    return out, (res1, res2._replace(quantized_x=None, new_qs=new2))


def backward(cfg: MLPConfig, res, dy):
    """``(dx, dkernel_1, dbias_1, dkernel_2, dbias_2, next set 1, next set 2)`` from ``dy``."""
    dy = fp8_autodiff.instantiate(dy)
    c1, c2 = cfg.first, cfg.second
    res1, res2 = res
    lead = tuple(dy.shape)[: dy.ndim - len(c2.out_features)]
    ops1, ops2 = core.views(lead, c1), core.views(lead, c2)
    dy2 = dy.reshape(ops2.rows + c2.out_features)
    if cfg.dgelu_epilogue:
        # kernel_2's dgrad GEMM applies gelu'(h) (and sums dbias_1) in its epilogue.
        _, db2 = core.dact(dy2, None, c2, ops2, quantizer=None)
        dk2 = core.wgrad(c2, res2, ops2, dy2)
        bgrad = c1.has_bias and cfg.dgelu_bgrad
        r = matmul(
            dy2,
            res2.kernel,
            k_ndim=len(c2.features),
            rhs_contracts_trailing=True,
            aux=res1.act_in,
            epilogue=GemmEpilogue.DGELU,
            grad_bias=bgrad,
            implementation=c1.implementation,
        )
        db2, n2 = core.bias_cotangent(db2, c2), None
        dh1, db1 = r.out, r.dbias
        if c1.has_bias and not bgrad:  # dbias_1 = sum of dh over the rows, in float32
            _, db1 = core.dact(dh1, None, dataclasses.replace(c1, act=None), ops1, None)
    else:
        dh2, db2 = core.dact(dy2, None, c2, ops2, quantizer=core.grad_quantizer(res2))
        da, dk2, db2, n2 = core.gemm_grads(c2, res2, ops2, dh2, db2)
        dh1, db1 = core.dact(da, res1.act_in, c1, ops1, quantizer=core.grad_quantizer(res1))
    dx, dk1, db1, n1 = core.gemm_grads(c1, res1, ops1, dh1, db1)
    return dx.reshape(lead + c1.contract), dk1, db1, dk2, db2, n1, n2


_mlp.defvjp(_mlp_fwd, _mlp_bwd, symbolic_zeros=True)
