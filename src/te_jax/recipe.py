"""FP8 recipes, and the ``QuantizerSet`` of one GEMM built from them.

A recipe says how the three tensors of a dense layer are quantized for its GEMMs: the input
``x``, the ``kernel`` and the gradient ``dh`` that flows back into the layer
(docs/numerics.md §4, §8):

| recipe                | scaling mode           | x, kernel | grad: "HYBRID" | grad: "E4M3" |
|-----------------------|------------------------|-----------|----------------|--------------|
| ``DelayedScaling``    | DELAYED_TENSOR_SCALING | E4M3      | E5M2           | E4M3         |
| ``CurrentScaling``    | CURRENT_TENSOR_SCALING | E4M3      | E5M2           | E4M3         |
| ``MXFP8BlockScaling`` | MXFP8_1D_SCALING       | E4M3      | E5M2           | E4M3         |
| ``Float8BlockScaling``| FP8_BLOCK_1D / _2D_SCALING | E4M3  | E5M2           | E4M3         |

``Float8BlockScaling`` quantizes each tensor with the block dimensionality its
``*_block_scaling_dim`` gives (by default x and the gradient in 1×128 blocks, the kernel in
128×128 tiles), so its three quantizers have different scaling modes.

``fp8_format`` is a string or a ``Format`` member (TransformerEngine's enum: ``Format.HYBRID``,
``Format.E4M3``; ``Format.E5M2``, E5M2 for every tensor, has no te_jax recipe).
``Float8CurrentScaling`` is TransformerEngine's name for ``CurrentScaling``.

``QuantizerSet.create(recipe)`` makes the three quantizers; ``QuantizerSet.create(None)`` is the
empty set (no quantization, the GEMMs run in the input dtype).

**Delayed scaling's state** (each quantizer's ``scale`` and ``amax_history``) is functional and
comes back through the gradient: ``te_jax.dense`` is a ``custom_vjp`` whose cotangent for its
``quantizer_set`` argument is the *updated* set (x's and kernel's quantizers updated with the
amaxes the forward measured, grad's with the amax the backward measured, docs/numerics.md §4).
So a training step differentiates with respect to the quantizer sets too and takes that
"gradient" as the next state, never as something to descend along::

    (loss, (grads, new_qs)) = jax.value_and_grad(loss_fn, argnums=(0, 1))(params, qs)
    params = optimizer_update(params, grads)
    qs = new_qs                        # not qs - lr * new_qs

This is the convention of Flax's ``fp8_ops`` and of TransformerEngine's JAX side: the grad
quantizer's amax is only known in the backward, and the cotangent is the one value a
``custom_vjp`` backward can hand back. Quantizer sets of the stateless recipes have no leaves, so
their "gradient" is empty.

**Where uses meet, states combine by max** (docs/numerics.md §4): the next state is the one a
single use on all the data would give, whatever the step's structure:

* ``vmap`` with the set unbatched (shared by the batch): one update with the batch's largest
  amax. A stacked set (batched state) updates member by member.
* Sharded steps: amaxes are max-reduced over the mesh axes the tensors are split on.
* One set feeding several calls in one differentiated step (a layer applied twice, a layer
  inside ``lax.scan`` over steps): reverse-mode autodiff would *sum* the calls' next states.
  Take one handle per call from ``qs.share(n)`` (in a scan: ``a, b = qs.share()`` in the body,
  ``a`` for the call and ``b`` carried on), whose backward merges the calls' states by max.
* Gradient accumulation (separate ``grad`` calls on micro-batches, all from the same state):
  ``qs.merge_updates(new_qs_1, new_qs_2, ...)`` is the next state, never their sum.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import enum
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero

from te_jax import fp8_autodiff
from te_jax.quantize import formats
from te_jax.quantize.quantize_layout import QuantizeLayout
from te_jax.quantize.quantizers import (
    AMAX_COMPUTE_ALGOS,
    CurrentScaleQuantizer,
    DelayedScaleQuantizer,
    Float8Block1DQuantizer,
    Float8Block2DQuantizer,
    MXFP8Quantizer,
    Quantizer,
)
from te_jax.quantize.scale_math import BlockScaleOptions

__all__ = [
    "FP8_FORMATS",
    "Format",
    "MMParams",
    "Recipe",
    "DelayedScaling",
    "CurrentScaling",
    "Float8CurrentScaling",
    "MXFP8BlockScaling",
    "QParams",
    "Float8BlockScaling",
    "QuantizerSet",
    "autocast",
    "autocast_recipe",
]

# fp8_format -> (dtype of x and kernel, dtype of the gradient).
FP8_FORMATS = {
    "HYBRID": (formats.E4M3, formats.E5M2),
    "E4M3": (formats.E4M3, formats.E4M3),
}


class Format(enum.Enum):
    """TransformerEngine's FP8 formats, accepted as a recipe's ``fp8_format``: ``E4M3`` for
    every tensor, ``HYBRID`` (E4M3 forward, E5M2 gradient); ``E5M2`` for every tensor is
    TransformerEngine's too but no te_jax recipe takes it.

    Example:
      >>> from te_jax.recipe import DelayedScaling, Format
      >>> r = DelayedScaling(fp8_format=Format.E4M3)
      >>> r.fp8_format, r.forward_dtype, r.grad_dtype
      ('E4M3', dtype(float8_e4m3fn), dtype(float8_e4m3fn))
      >>> DelayedScaling(fp8_format=Format.HYBRID).grad_dtype
      dtype(float8_e5m2)
    """

    E4M3 = "E4M3"
    E5M2 = "E5M2"
    HYBRID = "HYBRID"


def _check_format(recipe: str, fp8_format) -> str:
    if isinstance(fp8_format, Format):
        if fp8_format is Format.E5M2:
            raise ValueError(
                f"te_jax.recipe.{recipe}: fp8_format=Format.E5M2 (E5M2 for x and the kernel "
                "too) is not supported: use Format.HYBRID (E4M3 forward, E5M2 gradient) or "
                "Format.E4M3"
            )
        fp8_format = fp8_format.value
    name = fp8_format.upper() if isinstance(fp8_format, str) else fp8_format
    if name not in FP8_FORMATS:
        raise ValueError(
            f"te_jax.recipe.{recipe}: fp8_format must be one of "
            + ", ".join(repr(f) for f in FP8_FORMATS)
            + f", got {fp8_format!r}"
        )
    return name


@dataclasses.dataclass(frozen=True)
class MMParams:
    """How one FP8 GEMM accumulates (TransformerEngine's name and field).

    Hopper's FP8 tensor cores sum products in a narrower accumulator; cuBLASLt promotes the
    partial sums to float32 every few K blocks. ``use_split_accumulator=True`` (te_jax's
    default for every GEMM) keeps that promotion (cuBLASLt ``FAST_ACCUM = 0``); ``False`` lets
    the tensor cores accumulate longer between promotions (``FAST_ACCUM = 1``, TransformerEngine's
    and XLA's choice for the forward GEMM): a larger rounding error (docs/numerics.md §8), a
    faster GEMM alone, no faster a training step held at the GPU's power limit
    (docs/performance.md). Only te_jax's cuBLASLt GEMM reads it; the pure-JAX path accumulates
    in float32 either way.

    Example:
      >>> import te_jax
      >>> r = te_jax.recipe.DelayedScaling()
      >>> r.fp8_gemm_fprop.use_split_accumulator, r.split_accumulator
      (True, (True, True, True))
      >>> r = te_jax.recipe.DelayedScaling(fp8_gemm_fprop=te_jax.recipe.MMParams(False))
      >>> te_jax.QuantizerSet.create(r).split_accumulator   # TransformerEngine's defaults
      (False, True, True)
    """

    use_split_accumulator: bool = True


# (fprop, dgrad, wgrad): float32 promotion in every FP8 GEMM.
DEFAULT_SPLIT_ACCUMULATOR = (True, True, True)


def _check_mm_params(where: str, recipe) -> None:
    for name in ("fp8_gemm_fprop", "fp8_gemm_dgrad", "fp8_gemm_wgrad"):
        v = getattr(recipe, name)
        if not isinstance(v, MMParams):
            raise TypeError(
                f"te_jax.recipe.{where}: {name} must be te_jax.recipe.MMParams("
                f"use_split_accumulator=...), got {v!r}"
            )


class Recipe:
    """Base class of the recipes: ``fp8_format`` and the quantizers it makes.

    ``make_quantizer(role)`` gives the quantizer of ``"x"`` / ``"kernel"`` (``forward_dtype``,
    E4M3) or ``"grad"`` (``grad_dtype``); ``QuantizerSet.create(recipe)`` calls it for the three.

    Example:
      >>> from te_jax import recipe
      >>> [r().grad_dtype.name for r in (recipe.DelayedScaling, recipe.CurrentScaling,
      ...                                 recipe.MXFP8BlockScaling)]
      ['float8_e5m2', 'float8_e5m2', 'float8_e4m3fn']
      >>> recipe.CurrentScaling().make_quantizer("grad")
      CurrentScaleQuantizer(q_dtype=dtype(float8_e5m2), q_layout=<QuantizeLayout.ROWWISE: 0>)
    """

    fp8_format: str

    @property
    def forward_dtype(self):
        """The FP8 dtype of x and the kernel (E4M3)."""
        return FP8_FORMATS[self.fp8_format][0]

    @property
    def grad_dtype(self):
        """The FP8 dtype of the gradient: E5M2 for ``"HYBRID"``, E4M3 for ``"E4M3"``."""
        return FP8_FORMATS[self.fp8_format][1]

    def make_quantizer(self, role: str) -> Quantizer:
        """A fresh quantizer for ``role`` (``"x"``, ``"kernel"`` or ``"grad"``)."""
        raise NotImplementedError

    @property
    def split_accumulator(self) -> tuple[bool, bool, bool]:
        """The FP8 GEMMs' ``use_split_accumulator`` (``MMParams``): (fprop, dgrad, wgrad).
        Recipes without ``fp8_gemm_*`` fields (block scaling) keep float32 accumulation."""
        params = [getattr(self, f"fp8_gemm_{g}", None) for g in ("fprop", "dgrad", "wgrad")]
        return tuple(True if p is None else bool(p.use_split_accumulator) for p in params)


@dataclasses.dataclass(frozen=True)
class DelayedScaling(Recipe):
    """Delayed tensor scaling (docs/numerics.md §4): each tensor is quantized with a scale taken
    from the amaxes of previous steps, ``scale = (Q / max(amax_history)) / 2^margin``.

    Args:
      fp8_format: ``"HYBRID"`` (E4M3 forward, E5M2 gradient; the default) or ``"E4M3"``.
      amax_history_len: the length ``L`` of each quantizer's amax history.
      margin: the ``2^-margin`` headroom of the scale.
      amax_compute_algo: ``"max"`` (the history's maximum) or ``"most_recent"``.
      fp8_gemm_fprop, fp8_gemm_dgrad, fp8_gemm_wgrad: ``MMParams`` of the forward, dgrad and
        wgrad GEMMs (all split by default; TransformerEngine's forward is
        ``MMParams(use_split_accumulator=False)``).

    ``Q`` is the format's largest value (448 for E4M3, 57344 for E5M2). The quantizers' state
    is float32: ``scale ()`` (1 at first) and ``amax_history (L,)`` (zeros at first).

    Example:
      >>> import te_jax
      >>> q = te_jax.recipe.DelayedScaling(amax_history_len=4, margin=1).make_quantizer("x")
      >>> float(q.scale), q.amax_history.shape
      (1.0, (4,))
      >>> float(q.update(2.0).scale)         # (448 / 2) / 2**1, after a step with amax 2
      112.0
    """

    fp8_format: str = "HYBRID"
    amax_history_len: int = 1024
    margin: int = 0
    amax_compute_algo: str = "max"
    fp8_gemm_fprop: MMParams = MMParams(use_split_accumulator=DEFAULT_SPLIT_ACCUMULATOR[0])
    fp8_gemm_dgrad: MMParams = MMParams(use_split_accumulator=DEFAULT_SPLIT_ACCUMULATOR[1])
    fp8_gemm_wgrad: MMParams = MMParams(use_split_accumulator=DEFAULT_SPLIT_ACCUMULATOR[2])

    def __post_init__(self):
        object.__setattr__(self, "fp8_format", _check_format("DelayedScaling", self.fp8_format))
        _check_mm_params("DelayedScaling", self)
        if self.amax_compute_algo not in AMAX_COMPUTE_ALGOS:
            raise ValueError(
                "te_jax.recipe.DelayedScaling: amax_compute_algo must be one of "
                + ", ".join(repr(a) for a in AMAX_COMPUTE_ALGOS)
                + f", got {self.amax_compute_algo!r}"
            )

    def make_quantizer(self, role: str) -> Quantizer:
        dtype = self.grad_dtype if role == "grad" else self.forward_dtype
        return DelayedScaleQuantizer.create(
            dtype,
            amax_history_len=self.amax_history_len,
            margin=self.margin,
            amax_compute_algo=self.amax_compute_algo,
        )


@dataclasses.dataclass(frozen=True)
class CurrentScaling(Recipe):
    """Current tensor scaling (docs/numerics.md §4): each tensor is quantized with
    ``scale = Q / max|tensor|`` of the tensor itself (two passes over it; no state).
    ``Float8CurrentScaling`` is the same class (TransformerEngine's name).

    Args:
      fp8_format: ``"HYBRID"`` (the default) or ``"E4M3"``.
      fp8_gemm_fprop, fp8_gemm_dgrad, fp8_gemm_wgrad: ``MMParams`` of the forward, dgrad and
        wgrad GEMMs (as ``DelayedScaling``'s).

    Example:
      >>> import jax.numpy as jnp, te_jax
      >>> q = te_jax.recipe.CurrentScaling().make_quantizer("x")
      >>> x = jnp.array([[1.0, -2.0, 4.0, 0.5]])
      >>> st = te_jax.quantize.quantize(x, q)       # scale = 448 / max|x| = 112
      >>> st.data.dtype, float(st.amax), float(st.data[0, 2].astype(jnp.float32))
      (dtype(float8_e4m3fn), 4.0, 448.0)
      >>> (st.data.astype(jnp.float32) * st.scale_inv).tolist()     # dequantized
      [[1.0, -2.0, 4.0, 0.5]]
    """

    fp8_format: str = "HYBRID"
    fp8_gemm_fprop: MMParams = MMParams(use_split_accumulator=DEFAULT_SPLIT_ACCUMULATOR[0])
    fp8_gemm_dgrad: MMParams = MMParams(use_split_accumulator=DEFAULT_SPLIT_ACCUMULATOR[1])
    fp8_gemm_wgrad: MMParams = MMParams(use_split_accumulator=DEFAULT_SPLIT_ACCUMULATOR[2])

    def __post_init__(self):
        object.__setattr__(self, "fp8_format", _check_format("CurrentScaling", self.fp8_format))
        _check_mm_params("CurrentScaling", self)

    def make_quantizer(self, role: str) -> Quantizer:
        dtype = self.grad_dtype if role == "grad" else self.forward_dtype
        return CurrentScaleQuantizer(dtype)


# TransformerEngine's name for it.
Float8CurrentScaling = CurrentScaling


@dataclasses.dataclass(frozen=True)
class MXFP8BlockScaling(Recipe):
    """MXFP8 block scaling (docs/numerics.md §4): an E8M0 power-of-two scale per 32 elements
    along the contracting dimension of each GEMM.

    On Hopper the quantized storage is real (the same bits as on Blackwell) but cuBLASLt has no
    MXFP8 GEMM there: te_jax dequantizes the operands and runs the GEMM in the input dtype. The
    contracting dimensions (K forward, N for dgrad, the rows M for wgrad) must be multiples of 32.

    Args:
      fp8_format: ``"E4M3"`` (the default: E4M3 throughout, as in TransformerEngine) or
        ``"HYBRID"`` (E5M2 gradient).

    Per block ``b`` of 32: ``scale_inv_b = 2^ceil(log2(amax_b / 448))`` (E8M0), and the data
    ``q = sat(y / scale_inv_b)`` (E4M3); ``(M, N)`` data has ``(M, N / 32)`` rowwise scales.

    Example:
      >>> import jax.numpy as jnp, te_jax
      >>> q = te_jax.recipe.MXFP8BlockScaling().make_quantizer("x")
      >>> st = te_jax.quantize.quantize(jnp.ones((4, 64), jnp.bfloat16), q)
      >>> st.data.shape, st.scale_inv.shape, st.scale_inv.dtype
      ((4, 64), (4, 2), dtype(float8_e8m0fnu))
      >>> float(st.scale_inv[0, 0].astype(jnp.float32))        # 2^ceil(log2(1 / 448))
      0.00390625
    """

    fp8_format: str = "E4M3"

    def __post_init__(self):
        object.__setattr__(self, "fp8_format", _check_format("MXFP8BlockScaling", self.fp8_format))

    def make_quantizer(self, role: str) -> Quantizer:
        dtype = self.grad_dtype if role == "grad" else self.forward_dtype
        return MXFP8Quantizer(dtype)


@dataclasses.dataclass(frozen=True)
class QParams:
    """How one tensor's block scales are chosen under ``Float8BlockScaling`` (TransformerEngine's
    name and fields).

    Args:
      power_2_scale: round each block's scale ``Q / amax`` down to a power of two.
      amax_epsilon: a floor on each block's amax (float, >= 0).

    Example:
      >>> from te_jax.recipe import Float8BlockScaling, QParams
      >>> r = Float8BlockScaling(fp8_quant_fwd_weight=QParams(power_2_scale=False))
      >>> r.make_quantizer("kernel").power_2_scale, r.make_quantizer("x").power_2_scale
      (False, True)
    """

    power_2_scale: bool = False
    amax_epsilon: float = 0.0

    def __post_init__(self):
        try:
            BlockScaleOptions(self.power_2_scale, self.amax_epsilon)
        except (TypeError, ValueError) as e:
            raise type(e)(f"te_jax.recipe.QParams: {e}") from None


# TransformerEngine's defaults: power-of-two scales (its NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1
# turns them off; here, pass QParams(power_2_scale=False)).
_BLOCK_QPARAMS = QParams(power_2_scale=True, amax_epsilon=0.0)


@dataclasses.dataclass(frozen=True)
class Float8BlockScaling(Recipe):
    """Blockwise FP8 (DeepSeek-V3's recipe; TransformerEngine's ``Float8BlockScaling``,
    docs/numerics.md §4): one float32 scale per block of each GEMM operand, 1×128 blocks for the
    activations and gradients and 128×128 tiles for the weights by default, E4M3 throughout.

    Each block's ``scale = Q / max(amax_b, amax_epsilon)`` (a power of two by default), the
    data ``q = sat(y · scale)``; the copies the backward GEMMs read are quantized from the
    high-precision tensor (1D blocks run along each GEMM's contracting dimension). Any shape:
    blocks at the edges are partial. No state. te_jax's GEMMs take the codes and block scales
    (``gemm_operands = "block_codes"``): cuBLASLt's block-scaled FP8 GEMM on CUDA, the product
    of the block-dequantized operands in float32 elsewhere (docs/numerics.md §8).

    Args:
      fp8_format: ``"E4M3"`` (the default) or ``"HYBRID"`` (E5M2 gradient).
      fp8_quant_fwd_inp, fp8_quant_fwd_weight, fp8_quant_bwd_grad: ``QParams`` of x, the
        kernel and the gradient (default: power-of-two scales, no epsilon).
      x_block_scaling_dim, w_block_scaling_dim, grad_block_scaling_dim: 1 (1×128 blocks) or 2
        (128×128 tiles); defaults 1, 2, 1. No GEMM may take two 2D operands.
      fp8_gemm_fprop, fp8_gemm_dgrad, fp8_gemm_wgrad: ``MMParams``; block scaling needs the
        split accumulator (``use_split_accumulator=True``), as in TransformerEngine.

    Example:
      >>> import te_jax
      >>> qs = te_jax.QuantizerSet.create(te_jax.recipe.Float8BlockScaling())
      >>> [q.scaling_mode.name for q in (qs.x, qs.kernel, qs.grad)]
      ['FP8_BLOCK_1D_SCALING', 'FP8_BLOCK_2D_SCALING', 'FP8_BLOCK_1D_SCALING']
      >>> qs.kernel.power_2_scale, qs.grad.q_dtype, qs.has_state
      (True, dtype(float8_e4m3fn), False)
    """

    fp8_format: str = "E4M3"
    fp8_quant_fwd_inp: QParams = _BLOCK_QPARAMS
    fp8_quant_fwd_weight: QParams = _BLOCK_QPARAMS
    fp8_quant_bwd_grad: QParams = _BLOCK_QPARAMS
    x_block_scaling_dim: int = 1
    w_block_scaling_dim: int = 2
    grad_block_scaling_dim: int = 1
    fp8_gemm_fprop: MMParams = MMParams(use_split_accumulator=True)
    fp8_gemm_dgrad: MMParams = MMParams(use_split_accumulator=True)
    fp8_gemm_wgrad: MMParams = MMParams(use_split_accumulator=True)

    def __post_init__(self):
        where = "te_jax.recipe.Float8BlockScaling"
        object.__setattr__(self, "fp8_format", _check_format("Float8BlockScaling", self.fp8_format))
        _check_mm_params("Float8BlockScaling", self)
        for name in ("fp8_quant_fwd_inp", "fp8_quant_fwd_weight", "fp8_quant_bwd_grad"):
            if not isinstance(getattr(self, name), QParams):
                raise TypeError(
                    f"{where}: {name} must be te_jax.recipe.QParams(power_2_scale=..., "
                    f"amax_epsilon=...), got {getattr(self, name)!r}"
                )
        dims = {r: getattr(self, f"{r}_block_scaling_dim") for r in ("x", "w", "grad")}
        for r, d in dims.items():
            if isinstance(d, bool) or d not in (1, 2):
                raise ValueError(f"{where}: {r}_block_scaling_dim must be 1 or 2, got {d!r}")
        for a, b, gemm in (("x", "w", "fprop"), ("grad", "w", "dgrad"), ("x", "grad", "wgrad")):
            if dims[a] == dims[b] == 2:
                raise ValueError(
                    f"{where}: the {gemm} GEMM would multiply two 128x128-tiled operands "
                    f"({a}_block_scaling_dim=2 and {b}_block_scaling_dim=2), which cuBLASLt's "
                    "block-scaled GEMM does not take: set one of them to 1"
                )
        for g in ("fprop", "dgrad", "wgrad"):
            if not getattr(self, f"fp8_gemm_{g}").use_split_accumulator:
                raise ValueError(
                    f"{where}: fp8_gemm_{g}=MMParams(use_split_accumulator=False): block "
                    "scaling needs the split accumulator (each block's scale multiplies its "
                    "partial sum in float32): use MMParams(use_split_accumulator=True)"
                )

    def make_quantizer(self, role: str) -> Quantizer:
        dtype = self.grad_dtype if role == "grad" else self.forward_dtype
        key = {"x": "x", "kernel": "w", "grad": "grad"}[role]
        params = {
            "x": self.fp8_quant_fwd_inp,
            "kernel": self.fp8_quant_fwd_weight,
            "grad": self.fp8_quant_bwd_grad,
        }[role]
        cls = {1: Float8Block1DQuantizer, 2: Float8Block2DQuantizer}[
            getattr(self, f"{key}_block_scaling_dim")
        ]
        return cls(dtype, power_2_scale=params.power_2_scale, amax_epsilon=params.amax_epsilon)


# The recipe of the innermost active ``autocast`` (None: none, or ``enabled=False``).
_AUTOCAST: contextvars.ContextVar[Recipe | None] = contextvars.ContextVar(
    "te_jax_autocast", default=None
)


@contextlib.contextmanager
def autocast(enabled: bool = True, recipe: Recipe | None = None):
    """A default recipe for the modules and ``ops.Sequential``s made or traced inside: those
    given ``recipe=None`` take ``recipe`` (``DelayedScaling()`` if ``None``), as under
    TransformerEngine's ``autocast``; ``enabled=False`` turns that default off inside an outer
    ``autocast``. A module's own ``recipe`` always wins.

    The recipe is fixed where it is read: an NNX module or ``Sequential`` when it is made (its
    FP8 state is created then), a Linen module whenever it is traced (``init``, and every
    ``apply`` under ``jit``: a jitted step traced outside the context keeps running without it,
    so enter it around the first call, or make the recipe a module field).

    Example:
      >>> import te_jax.nnx
      >>> from flax import nnx
      >>> with te_jax.autocast(recipe=te_jax.recipe.CurrentScaling()):
      ...     layer = te_jax.nnx.Linear(32, 16, rngs=nnx.Rngs(0))   # recipe=None: autocast's
      >>> type(layer.quantizers.recipe).__name__
      'CurrentScaling'
    """
    if recipe is not None and not isinstance(recipe, Recipe):
        raise TypeError(
            "te_jax.recipe.autocast: recipe must be a te_jax.recipe recipe (DelayedScaling(), "
            "CurrentScaling(), MXFP8BlockScaling(), Float8BlockScaling()) or None, got "
            f"{type(recipe).__name__}"
        )
    value = (recipe if recipe is not None else DelayedScaling()) if enabled else None
    token = _AUTOCAST.set(value)
    try:
        yield
    finally:
        _AUTOCAST.reset(token)


def autocast_recipe(recipe: Recipe | None = None) -> Recipe | None:
    """``recipe`` if given, else the innermost active ``autocast``'s (``None`` outside one).

    Example:
      >>> import te_jax
      >>> from te_jax.recipe import DelayedScaling, autocast_recipe
      >>> with te_jax.autocast():                      # recipe=None: DelayedScaling()
      ...     type(autocast_recipe()).__name__, autocast_recipe(DelayedScaling(margin=1)).margin
      ('DelayedScaling', 1)
      >>> autocast_recipe() is None
      True
    """
    return recipe if recipe is not None else _AUTOCAST.get()


_ROLES = ("x", "kernel", "grad")


@dataclasses.dataclass(frozen=True, eq=False)
class QuantizerSet:
    """The quantizers of one GEMM: ``x`` (its input), ``kernel`` and ``grad`` (the gradient of
    its output in the backward). All ``None`` for an unquantized GEMM.

    A pytree whose children are the three quantizers (delayed scaling's ``scale`` and
    ``amax_history`` are its leaves), so it passes through ``jit``, ``vmap``, ``lax.scan``
    (stack one per layer) and ``custom_vjp``. The layout each tensor needs (rowwise for the
    forward GEMM, colwise for the backward ones) is chosen by ``te_jax.dense``; the quantizers'
    own ``q_layout`` is not used.

    The recipes' dtypes: ``x`` and ``kernel`` E4M3, ``grad`` E5M2 (``"HYBRID"``) or E4M3.
    Delayed scaling's state, per quantizer: float32 ``scale ()`` and ``amax_history (L,)``.
    ``split_accumulator`` (static, the recipe's ``MMParams``): ``use_split_accumulator`` of the
    FP8 GEMMs (fprop, dgrad, wgrad).

    Example:
      >>> import te_jax
      >>> qs = te_jax.QuantizerSet.create(te_jax.recipe.DelayedScaling(amax_history_len=16))
      >>> qs.scaling_mode.name, qs.x.q_dtype, qs.grad.q_dtype
      ('DELAYED_TENSOR_SCALING', dtype(float8_e4m3fn), dtype(float8_e5m2))
      >>> {name: value.shape for name, value in qs.state().items() if name.startswith("x_")}
      {'x_scale': (), 'x_amax_history': (16,)}
      >>> te_jax.QuantizerSet.create(None).is_empty
      True
    """

    x: Any = None
    kernel: Any = None
    grad: Any = None
    split_accumulator: tuple[bool, bool, bool] = DEFAULT_SPLIT_ACCUMULATOR

    def __post_init__(self):
        sa = self.split_accumulator
        if not (isinstance(sa, tuple) and len(sa) == 3 and all(isinstance(b, bool) for b in sa)):
            raise TypeError(
                "te_jax.QuantizerSet: split_accumulator must be three bools (fprop, dgrad, "
                f"wgrad), got {sa!r}"
            )
        given = [getattr(self, r) is not None for r in _ROLES]
        if any(given) and not all(given):
            raise ValueError(
                "te_jax.QuantizerSet: give all three quantizers (x, kernel, grad) or none; got "
                + ", ".join(f"{r}={type(getattr(self, r)).__name__}" for r in _ROLES)
            )
        for r in _ROLES:
            q = getattr(self, r)
            if q is not None and not isinstance(q, Quantizer):
                raise TypeError(
                    f"te_jax.QuantizerSet: {r} must be a te_jax.quantize quantizer, got "
                    f"{type(q).__name__}"
                )

    @classmethod
    def create(cls, recipe: Recipe | None = None) -> QuantizerSet:
        """The quantizers ``recipe`` prescribes (fresh state for delayed scaling), or the empty
        set for ``recipe=None``."""
        if recipe is None:
            return cls()
        if not isinstance(recipe, Recipe):
            raise TypeError(
                "te_jax.QuantizerSet.create: recipe must be te_jax.recipe.DelayedScaling, "
                "CurrentScaling, MXFP8BlockScaling, Float8BlockScaling or None, got "
                f"{type(recipe).__name__}"
            )
        return cls(
            **{r: recipe.make_quantizer(r) for r in _ROLES},
            split_accumulator=recipe.split_accumulator,
        )

    @property
    def is_empty(self) -> bool:
        """True when nothing is quantized."""
        return self.x is None

    @property
    def scaling_mode(self):
        """The scaling mode of the set's x quantizer (``None`` for the empty set); under
        ``Float8BlockScaling`` the kernel's may differ (its own ``scaling_mode``)."""
        return None if self.x is None else self.x.scaling_mode

    def state(self) -> dict[str, jax.Array]:
        """The set's state arrays by name, ``"{role}_{field}"`` (``x_scale``,
        ``x_amax_history``, ..., ``grad_amax_history`` under delayed scaling; empty for the
        stateless recipes). The names the Flax modules give their FP8 variables."""
        out = {}
        for r in _ROLES:
            q = getattr(self, r)
            for f in () if q is None else type(q)._leaf_fields:
                out[f"{r}_{f}"] = getattr(q, f)
        return out

    def with_state(self, state) -> QuantizerSet:
        """This set with its state arrays replaced by ``state`` (a mapping as ``state()``
        returns; every name must be present)."""
        missing = sorted(set(self.state()) - set(state))
        if missing:
            raise ValueError(f"te_jax.QuantizerSet.with_state: no value for {', '.join(missing)}")
        return _unflatten(
            self.split_accumulator,
            [
                None
                if (q := getattr(self, r)) is None
                else dataclasses.replace(q, **{f: state[f"{r}_{f}"] for f in q._leaf_fields})
                for r in _ROLES
            ],
        )

    @property
    def has_state(self) -> bool:
        """True for delayed scaling, whose quantizers carry state from step to step."""
        return bool(jax.tree_util.tree_leaves(self))

    def merge_updates(self, *updated: QuantizerSet) -> QuantizerSet:
        """The next state when several uses of this set met in one step: each of ``updated``
        is the next state one use produced from this set (the "gradient" of ``dense`` or a
        step on one micro-batch). Each quantizer takes the largest of the uses' amaxes
        (``DelayedScaleQuantizer.merge_updates``): the state one use on all the data would
        give. Stateless sets return themselves.

        Gradient accumulation over micro-batches, all from the state ``qs``::

            for xb in micro_batches:
                (g, new_qs) = jax.grad(loss, argnums=(0, 1))(params, qs, xb)
                grads, news = grads + g, news + [new_qs]
            qs = qs.merge_updates(*news)        # not a sum of the new_qs
        """
        for u in updated:
            if not isinstance(u, QuantizerSet):
                raise TypeError(
                    "te_jax.QuantizerSet.merge_updates: each update must be a QuantizerSet (the "
                    f"next state a use of this set produced), got {type(u).__name__}"
                )
        if not self.has_state:
            return self
        return _unflatten(
            self.split_accumulator,
            [getattr(self, r).merge_updates(*(getattr(u, r) for u in updated)) for r in _ROLES],
        )

    def share(self, n: int = 2) -> tuple[QuantizerSet, ...]:
        """``n`` handles on this set for ``n`` uses in one differentiated step.

        The same quantizers in the forward; in the backward the handles' next states are
        merged by max (``merge_updates``) into this set's, where autodiff alone would add them.
        A layer applied twice::

            qa, qb = qs.share()
            y = te_jax.dense(te_jax.dense(x, w, quantizer_set=qa), w, quantizer_set=qb)

        In a ``lax.scan`` over steps with one set, share in the body and carry one handle on::

            def body(qs, x):
                q_now, q_next = qs.share()
                return q_next, te_jax.dense(x, w, quantizer_set=q_now)

        A handle left unused contributes nothing. Stateless sets return ``n`` copies of
        themselves.
        """
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"te_jax.QuantizerSet.share: n must be an int >= 1, got {n!r}")
        if not self.has_state:
            return (self,) * n
        return fp8_autodiff.reverse_mode_only("te_jax.QuantizerSet.share", _share, self, n)

    def with_layout(self, role: str, layout: QuantizeLayout) -> Quantizer:
        """The quantizer of ``role`` with ``q_layout`` replaced by ``layout`` (same state)."""
        return dataclasses.replace(getattr(self, role), q_layout=layout)


def merge_state_dicts(recipe: Recipe, state, *updated):
    """``QuantizerSet.merge_updates`` over nested mappings of state arrays named as the Flax
    modules name them (``{gemm}_{role}_{field}``, e.g. ``wi_grad_amax_history``): ``state`` the
    arrays the uses started from, each of ``updated`` one use's next state (same structure).
    Returns a nested ``dict`` of the merged next state."""
    if not isinstance(recipe, Recipe):
        raise TypeError(
            "te_jax: merging FP8 states needs the modules' recipe (te_jax.recipe.DelayedScaling"
            f"(...)), got {type(recipe).__name__}"
        )
    fresh = QuantizerSet.create(recipe)
    names = tuple(fresh.state())
    suffix = "_" + names[0] if names else None
    out = {}
    for key, value in state.items():
        ups = [u[key] for u in updated]
        if not hasattr(value, "items"):
            continue  # an array: merged with its quantizer set below
        out[key] = merge_state_dicts(recipe, value, *ups)
    gemms = sorted(k[: -len(suffix)] for k in state if suffix and k.endswith(suffix))
    for gemm in gemms:
        as_set = lambda d, g=gemm: fresh.with_state({n: d[f"{g}_{n}"] for n in names})
        merged = as_set(state).merge_updates(*(as_set(u) for u in updated))
        out.update({f"{gemm}_{n}": v for n, v in merged.state().items()})
    for key, value in state.items():
        out.setdefault(key, value)  # arrays of no quantizer set: as they were
    return out


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _share(qs: QuantizerSet, n: int):
    return (qs,) * n


def _share_fwd(qs, n):
    qs, _ = fp8_autodiff.unwrap_primals(qs)
    return (qs,) * n, qs


def _share_bwd(n, qs, cts):
    # Handles whose state reached no loss have symbolic-zero cotangents: they contributed
    # nothing. One contribution is already the next state (merging it alone is the identity).
    used = [
        jax.tree.map(fp8_autodiff.instantiate, ct, is_leaf=_zero)
        for ct in cts
        if not all(_zero(leaf) for leaf in jax.tree.leaves(ct, is_leaf=_zero))
    ]
    if not used:
        return (jax.tree.map(jnp.zeros_like, qs),)
    if len(used) == 1:
        return (used[0],)
    return (qs.merge_updates(*used),)


def _zero(leaf) -> bool:
    return isinstance(leaf, SymbolicZero)


_share.defvjp(_share_fwd, _share_bwd, symbolic_zeros=True)


def _flatten_with_keys(qs: QuantizerSet):
    keyed = tuple((jax.tree_util.GetAttrKey(r), getattr(qs, r)) for r in _ROLES)
    return keyed, qs.split_accumulator


def _flatten(qs: QuantizerSet):
    return tuple(getattr(qs, r) for r in _ROLES), qs.split_accumulator


def _unflatten(split_accumulator, children) -> QuantizerSet:
    # Bypasses __post_init__: JAX puts placeholders (None, batching specs) in the slots.
    qs = object.__new__(QuantizerSet)
    for r, c in zip(_ROLES, children, strict=True):
        object.__setattr__(qs, r, c)
    object.__setattr__(qs, "split_accumulator", split_accumulator)
    return qs


jax.tree_util.register_pytree_with_keys(
    QuantizerSet, _flatten_with_keys, _unflatten, flatten_func=_flatten
)
