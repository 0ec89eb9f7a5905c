"""Quantizers: what to quantize to, and (for delayed scaling) the state that picks the scale.

Every quantizer is an immutable JAX pytree. Its configuration (``q_dtype``, ``q_layout``, and for
delayed scaling ``margin`` and ``amax_compute_algo``) is static auxiliary data, hashable and
compared by value; its arrays (delayed scaling's ``scale`` and ``amax_history``) are leaves. So a
quantizer passes through ``jit``, ``vmap`` (a stack of delayed quantizers has ``scale`` ``(B,)``
and ``amax_history`` ``(B, L)``), a ``lax.scan`` carry and ``custom_vjp`` (as a residual, or as a
differentiable argument whose "cotangent" is the updated quantizer), and state updates are
functional: ``DelayedScaleQuantizer.update`` returns a new quantizer.

| quantizer               | scaling mode             | q_dtype (default first)         |
|-------------------------|--------------------------|---------------------------------|
| DelayedScaleQuantizer   | DELAYED_TENSOR_SCALING   | float8_e4m3fn, float8_e5m2      |
| CurrentScaleQuantizer   | CURRENT_TENSOR_SCALING   | float8_e4m3fn, float8_e5m2      |
| MXFP8Quantizer          | MXFP8_1D_SCALING         | float8_e4m3fn, float8_e5m2      |
| NVFP4Quantizer          | NVFP4_1D_SCALING         | float4_e2m1fn                   |
| Float8Block1DQuantizer  | FP8_BLOCK_1D_SCALING     | float8_e4m3fn, float8_e5m2      |
| Float8Block2DQuantizer  | FP8_BLOCK_2D_SCALING     | float8_e4m3fn, float8_e5m2      |
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_batching import custom_vmap

from te_jax import _varying
from te_jax.quantize import formats, ieee
from te_jax.quantize.quantize_layout import QuantizeLayout
from te_jax.quantize.scale_math import BlockScaleOptions
from te_jax.quantize.scaling_modes import ScalingMode

__all__ = [
    "Quantizer",
    "DelayedScaleQuantizer",
    "CurrentScaleQuantizer",
    "MXFP8Quantizer",
    "NVFP4Quantizer",
    "Float8Block1DQuantizer",
    "Float8Block2DQuantizer",
    "AMAX_COMPUTE_ALGOS",
]

AMAX_COMPUTE_ALGOS = ("max", "most_recent")


def _normalize_layout(q_layout) -> QuantizeLayout:
    if isinstance(q_layout, str):
        found = QuantizeLayout.__members__.get(q_layout.upper())
        if found is not None:
            return found
    elif isinstance(q_layout, (int, np.integer)) and not isinstance(q_layout, bool):
        try:
            return QuantizeLayout(int(q_layout))
        except ValueError:
            pass
    raise ValueError(
        f"q_layout={q_layout!r} is not a quantize layout; allowed: "
        + ", ".join(f"QuantizeLayout.{m.name}" for m in QuantizeLayout)
    )


class Quantizer:
    """Base class: ``q_dtype`` (an ``np.dtype``), ``q_layout`` and the class's ``scaling_mode``.

    Subclasses are frozen dataclasses; ``_leaf_fields`` names their array fields (pytree leaves),
    every other field is static. Unflattening bypasses ``__init__``, so the leaves may be any
    objects JAX puts there (tracers, batching specs, ``None``).

    Example:
      >>> import jax.numpy as jnp
      >>> from te_jax.quantize import Quantizer, ScalingMode
      >>> q = Quantizer.for_mode(ScalingMode.MXFP8_1D_SCALING, jnp.float8_e4m3fn, "rowwise")
      >>> q
      MXFP8Quantizer(q_dtype=dtype(float8_e4m3fn), q_layout=<QuantizeLayout.ROWWISE: 0>)
      >>> q.q_max
      448.0
    """

    scaling_mode: ClassVar[ScalingMode]
    _leaf_fields: ClassVar[tuple[str, ...]] = ()
    _static_fields: ClassVar[tuple[str, ...]] = ()  # set by _register

    q_dtype: np.dtype
    q_layout: QuantizeLayout

    def _normalize_config(self) -> None:
        object.__setattr__(
            self, "q_dtype", formats.normalize_q_dtype(self.q_dtype, self.scaling_mode)
        )
        object.__setattr__(self, "q_layout", _normalize_layout(self.q_layout))

    @classmethod
    def for_mode(cls, scaling_mode, q_dtype, q_layout, scale=None, scale_options=None) -> Quantizer:
        """A quantizer of ``scaling_mode`` with this configuration (delayed scaling: with
        ``scale`` as its state; blockwise FP8: with ``scale_options``, a
        ``BlockScaleOptions``, else the quantizer's defaults). Raises ValueError for a mode no
        quantizer has, and for ``scale_options`` given to a mode without options."""
        mode = ScalingMode(scaling_mode)
        if mode not in _BY_MODE:
            raise ValueError(f"{mode.name} has no quantizer (it does not quantize)")
        q = _BY_MODE[mode]._from_config(q_dtype, q_layout, scale)
        if scale_options is None:
            return q
        if q.scale_options is None:
            raise ValueError(f"{mode.name} takes no scale_options, got {scale_options!r}")
        return dataclasses.replace(
            q,
            power_2_scale=scale_options.power_2_scale,
            amax_epsilon=scale_options.amax_epsilon,
        )

    @classmethod
    def _from_config(cls, q_dtype, q_layout, scale) -> Quantizer:
        return cls(q_dtype=q_dtype, q_layout=q_layout)

    @property
    def q_max(self) -> float:
        """The largest finite value ``Q`` of ``q_dtype`` (448, 57344 or 6)."""
        return formats.q_max(self.q_dtype)

    @property
    def scale_options(self) -> BlockScaleOptions | None:
        """How block scales are chosen (blockwise FP8's ``BlockScaleOptions``); ``None`` for
        the modes without options."""
        return None

    def _flatten_with_keys(self):
        children = tuple(
            (jax.tree_util.GetAttrKey(name), getattr(self, name)) for name in self._leaf_fields
        )
        return children, tuple(getattr(self, name) for name in self._static_fields)

    def _flatten(self):
        children = tuple(getattr(self, name) for name in self._leaf_fields)
        return children, tuple(getattr(self, name) for name in self._static_fields)

    @classmethod
    def _unflatten(cls, aux, children):
        obj = object.__new__(cls)
        for name, value in zip(cls._static_fields, aux, strict=True):
            object.__setattr__(obj, name, value)
        for name, value in zip(cls._leaf_fields, children, strict=True):
            object.__setattr__(obj, name, value)
        return obj


_BY_MODE: dict[ScalingMode, type[Quantizer]] = {}


def _register(cls):
    """Registers a quantizer dataclass as a pytree (after the dataclass decorator has run), and
    as the quantizer of its scaling mode."""
    _BY_MODE[cls.scaling_mode] = cls
    cls._static_fields = tuple(
        f.name for f in dataclasses.fields(cls) if f.name not in cls._leaf_fields
    )
    jax.tree_util.register_pytree_with_keys(
        cls, cls._flatten_with_keys, cls._unflatten, flatten_func=cls._flatten
    )
    return cls


@_register
@dataclasses.dataclass(frozen=True)
class CurrentScaleQuantizer(Quantizer):
    """Current tensor scaling: the scale comes from this tensor's own amax (docs/numerics.md §4).

    ``scale = Q / max|y|`` (1 when the amax is 0, float32 max when the quotient overflows);
    ``q = sat(y · scale)``; ``scale_inv = 1 / scale``. Two passes over the data (amax, then
    quantize); no state. ``Q`` is ``q_max``: 448 (E4M3) or 57344 (E5M2).

    Example:
      >>> import jax.numpy as jnp
      >>> from te_jax.quantize import CurrentScaleQuantizer, quantize
      >>> q = CurrentScaleQuantizer(jnp.float8_e5m2)
      >>> st = quantize(jnp.array([[1.0, -2.0, 4.0, 0.5]]), q)
      >>> q.q_max, st.data.astype(jnp.float32).tolist()       # y · scale, scale = 57344 / 4
      (57344.0, [[14336.0, -28672.0, 57344.0, 7168.0]])
    """

    scaling_mode: ClassVar[ScalingMode] = ScalingMode.CURRENT_TENSOR_SCALING

    q_dtype: Any = formats.E4M3
    q_layout: QuantizeLayout = QuantizeLayout.ROWWISE

    def __post_init__(self):
        self._normalize_config()


@_register
@dataclasses.dataclass(frozen=True)
class MXFP8Quantizer(Quantizer):
    """MXFP8 block scaling: an E8M0 power-of-two scale per 32 elements (docs/numerics.md §4).

    Rowwise blocks run along the last axis, colwise blocks down the rows (32 consecutive rows
    of the flattened 2-D tensor). ``scale_inv = 2^e`` with ``e = ceil(log2(amax_block / Q))``;
    ``q = sat(y · 2^-e)``. No state. Data ``(M, N)`` has ``(M, N / 32)`` rowwise and
    ``(M / 32, N)`` colwise E8M0 scales.

    Example:
      >>> import jax.numpy as jnp
      >>> from te_jax.quantize import MXFP8Quantizer, quantize
      >>> x = jnp.ones((4, 64), jnp.bfloat16).at[:, 32:].set(16.0)   # two blocks per row
      >>> st = quantize(x, MXFP8Quantizer())
      >>> st.scale_inv.shape, st.scale_inv[0].astype(jnp.float32).tolist()
      ((4, 2), [0.00390625, 0.0625])
    """

    scaling_mode: ClassVar[ScalingMode] = ScalingMode.MXFP8_1D_SCALING

    q_dtype: Any = formats.E4M3
    q_layout: QuantizeLayout = QuantizeLayout.ROWWISE

    def __post_init__(self):
        self._normalize_config()


@_register
@dataclasses.dataclass(frozen=True)
class NVFP4Quantizer(Quantizer):
    """NVFP4: E2M1 data, an E4M3 scale per 16 elements and a float32 global scale
    (docs/numerics.md §4).

    ``S = 6·448 / max|y|``; ``block_scale = e4m3((amax_block / 6) · S)``;
    ``q = e2m1((y · S) / block_scale)``; ``y ≈ q · block_scale / S``. No state. Data
    ``(M, N)`` has ``(M, N / 16)`` block scales and a float32 ``global_scale_inv = 1 / S``.

    Example:
      >>> import jax.numpy as jnp
      >>> from te_jax.quantize import NVFP4Quantizer, quantize
      >>> st = quantize(jnp.ones((4, 64), jnp.bfloat16), NVFP4Quantizer())
      >>> st.data.dtype, st.scale_inv.shape, st.scale_inv.dtype
      (dtype(float4_e2m1fn), (4, 4), dtype(float8_e4m3fn))
      >>> float(1 / st.global_scale_inv)                       # S = 6 · 448 / max|y|
      2688.0
    """

    scaling_mode: ClassVar[ScalingMode] = ScalingMode.NVFP4_1D_SCALING

    q_dtype: Any = formats.E2M1
    q_layout: QuantizeLayout = QuantizeLayout.ROWWISE

    def __post_init__(self):
        self._normalize_config()


@dataclasses.dataclass(frozen=True)
class _Float8BlockQuantizer(Quantizer):
    """The blockwise FP8 quantizers' shared configuration: ``q_dtype``, ``q_layout``,
    ``power_2_scale`` and ``amax_epsilon`` (static, TransformerEngine's ``QParams``)."""

    q_dtype: Any = formats.E4M3
    q_layout: QuantizeLayout = QuantizeLayout.ROWWISE
    power_2_scale: bool = True
    amax_epsilon: float = 0.0

    def __post_init__(self):
        self._normalize_config()
        options = BlockScaleOptions(self.power_2_scale, self.amax_epsilon)
        object.__setattr__(self, "power_2_scale", options.power_2_scale)
        object.__setattr__(self, "amax_epsilon", options.amax_epsilon)

    @property
    def scale_options(self) -> BlockScaleOptions:
        return BlockScaleOptions(self.power_2_scale, self.amax_epsilon)


@_register
@dataclasses.dataclass(frozen=True)
class Float8Block1DQuantizer(_Float8BlockQuantizer):
    """Blockwise FP8, 1×128 blocks (activations and gradients in DeepSeek-V3's recipe;
    docs/numerics.md §4).

    Per block of 128 consecutive elements (the last one of a row partial where N is not a
    multiple of 128): ``a = max(amax_b, amax_epsilon)``, ``scale = Q / a`` (rounded down to a
    power of two with ``power_2_scale``; 1 for a zero, inf or NaN amax), ``q = sat(y · scale)``,
    float32 ``scale_inv = 1 / scale``. Rowwise blocks run along the rows of ``[M, N]``; the
    colwise copy is ``[N, M]`` (stored ``features + leading``) with blocks along its rows, i.e.
    down y's columns, quantized from y. Scales are stored as cuBLASLt reads them:
    ``(ceil(N/128), round_up(M, 4))`` rowwise, ``(ceil(M/128), round_up(N, 4))`` colwise.

    Example:
      >>> import jax.numpy as jnp
      >>> from te_jax.quantize import Float8Block1DQuantizer, quantize
      >>> x = jnp.ones((4, 200), jnp.float32).at[:, 128:].set(3.0)   # two blocks per row
      >>> st = quantize(x, Float8Block1DQuantizer(power_2_scale=False))
      >>> st.scale_inv.shape, [round(float(1 / s), 3) for s in st.scale_inv[:, 0]]  # 448 / amax
      ((2, 4), [448.0, 149.333])
      >>> st.dequantize().tolist() == x.tolist()
      True
    """

    scaling_mode: ClassVar[ScalingMode] = ScalingMode.FP8_BLOCK_1D_SCALING


@_register
@dataclasses.dataclass(frozen=True)
class Float8Block2DQuantizer(_Float8BlockQuantizer):
    """Blockwise FP8, 128×128 tiles (weights in DeepSeek-V3's recipe; docs/numerics.md §4).

    One scale per tile of ``[M, N]`` (partial tiles at the edges), chosen as
    ``Float8Block1DQuantizer``'s from the tile's amax. The colwise copy ``[N, M]`` and its
    scales are the transposes of the rowwise ones. Scales: ``(ceil(M/128),
    round_up(ceil(N/128), 4))`` rowwise, ``(ceil(N/128), round_up(ceil(M/128), 4))`` colwise.

    Example:
      >>> import jax.numpy as jnp
      >>> from te_jax.quantize import Float8Block2DQuantizer, QuantizeLayout, quantize
      >>> w = jnp.full((130, 300), 2.0, jnp.bfloat16)
      >>> st = quantize(w, Float8Block2DQuantizer(q_layout=QuantizeLayout.ROWWISE_COLWISE))
      >>> st.scale_inv.shape, st.colwise_data.shape, st.colwise_scale_inv.shape
      ((2, 4), (300, 130), (3, 4))
      >>> float(st.scale_inv[0, 0])             # 1 / 2^floor(log2(448 / 2))
      0.0078125
    """

    scaling_mode: ClassVar[ScalingMode] = ScalingMode.FP8_BLOCK_2D_SCALING


@_register
@dataclasses.dataclass(frozen=True, eq=False)
class DelayedScaleQuantizer(Quantizer):
    """Delayed tensor scaling: the scale comes from the amaxes of past steps (docs/numerics.md §4).

    State (pytree leaves): ``scale``, float32 ``()``, and ``amax_history``, float32 ``(L,)``.
    Quantizing uses ``scale`` as it is (``q = sat(y · scale)``, ``scale_inv = 1 / scale``) and
    reports the tensor's ``amax``; ``update(amax)`` then computes the next step's quantizer.

    Build one with ``DelayedScaleQuantizer.create(...)``. The constructor takes the same static
    fields plus ``scale`` and ``amax_history`` arrays (defaults: 1 and 1024 zeros).

    Equality and hashing are by identity (the state is arrays); the static configuration is
    what JAX compares when it matches pytree structures.

    Example:
      >>> import jax.numpy as jnp
      >>> from te_jax.quantize import DelayedScaleQuantizer, quantize
      >>> q = DelayedScaleQuantizer.create(amax_history_len=4)
      >>> st = quantize(jnp.array([[1.0, -3.0]]), q)          # with scale 1; measures the amax
      >>> float(st.amax)
      3.0
      >>> q2 = q.update(st.amax)                               # scale = Q / max(history)
      >>> round(float(q2.scale), 3), q2.amax_history.tolist()   # 448 / 3; the newest amax last
      (149.333, [0.0, 0.0, 0.0, 3.0])
    """

    scaling_mode: ClassVar[ScalingMode] = ScalingMode.DELAYED_TENSOR_SCALING
    _leaf_fields: ClassVar[tuple[str, ...]] = ("scale", "amax_history")

    q_dtype: Any = formats.E4M3
    q_layout: QuantizeLayout = QuantizeLayout.ROWWISE
    margin: int = 0
    amax_compute_algo: str = "max"
    scale: Any = None
    amax_history: Any = None

    def __post_init__(self):
        self._normalize_config()
        margin = self.margin
        if isinstance(margin, bool) or not isinstance(margin, (int, np.integer)) or margin < 0:
            raise ValueError(f"margin must be a non-negative int, got {margin!r}")
        object.__setattr__(self, "margin", int(margin))
        if self.amax_compute_algo not in AMAX_COMPUTE_ALGOS:
            raise ValueError(
                f"amax_compute_algo={self.amax_compute_algo!r} is not supported; allowed: "
                + ", ".join(repr(a) for a in AMAX_COMPUTE_ALGOS)
            )
        scale = jnp.ones((), jnp.float32) if self.scale is None else self.scale
        history = (
            jnp.zeros((1024,), jnp.float32) if self.amax_history is None else self.amax_history
        )
        object.__setattr__(self, "scale", jnp.asarray(scale, jnp.float32))
        object.__setattr__(self, "amax_history", jnp.asarray(history, jnp.float32))

    @classmethod
    def create(
        cls,
        q_dtype=formats.E4M3,
        amax_history_len: int = 1024,
        margin: int = 0,
        q_layout: QuantizeLayout = QuantizeLayout.ROWWISE,
        amax_compute_algo: str = "max",
    ) -> DelayedScaleQuantizer:
        """A fresh quantizer: ``scale = 1``, ``amax_history`` of ``amax_history_len`` zeros."""
        if (
            isinstance(amax_history_len, bool)
            or not isinstance(amax_history_len, (int, np.integer))
            or amax_history_len < 1
        ):
            raise ValueError(f"amax_history_len must be an int >= 1, got {amax_history_len!r}")
        return cls(
            q_dtype=q_dtype,
            q_layout=q_layout,
            margin=margin,
            amax_compute_algo=amax_compute_algo,
            scale=jnp.ones((), jnp.float32),
            amax_history=jnp.zeros((int(amax_history_len),), jnp.float32),
        )

    @classmethod
    def _from_config(cls, q_dtype, q_layout, scale) -> DelayedScaleQuantizer:
        if scale is None:
            raise ValueError("te_jax.quantize_with_scale: DELAYED_TENSOR_SCALING needs a scale")
        return cls(
            q_dtype=q_dtype,
            q_layout=q_layout,
            scale=scale,
            amax_history=jnp.zeros((1,), jnp.float32),  # not used to quantize
        )

    @property
    def amax_history_len(self) -> int:
        """``L``, the length of the history (the last axis of ``amax_history``)."""
        return self.amax_history.shape[-1]

    def update(self, amax) -> DelayedScaleQuantizer:
        """The quantizer for the next step, given the amax this step measured (docs/numerics.md §4).

        With ``h = amax_history`` and ``Q = q_max``::

            h[0] = amax
            a = max(h)              # or h[0] with amax_compute_algo="most_recent"
            scale = (Q / a) / 2^margin, unless a <= 0, a is not finite, or that scale is not
                    finite (a subnormal a): then unchanged (the last is te_jax's refinement of
                    docs/numerics.md, which would give an infinite scale)
            h = roll(h, -1); h[0] = 0   (for L > 1)

        so after the update the newest amax sits in the last slot (``h[-1]``) and slot 0 is free
        for the next one. Float32 arithmetic, exact whatever the backend's denormal mode.
        Jittable. Under ``vmap`` a stack of quantizers (batched state) is updated member by
        member; a quantizer shared by the batch (unbatched state) is updated once, with the
        batch's largest amax, as an unbatched call on the whole batch would be (never a sum of
        per-element states).

        Args:
          amax: float32 ``()`` or ``(1,)``, e.g. ``ScaledTensor.amax`` (max-reduced over the
            mesh axes the tensor is sharded on). Inside ``shard_map``, an amax that varies over
            a mesh axis the state does not is max-reduced over it here, so the state stays the
            same on every device.
        """
        amax = _varying.max_over_extra_axes(jnp.asarray(amax, jnp.float32), self.amax_history)
        if amax.shape not in ((), (1,)):
            raise ValueError(
                f"DelayedScaleQuantizer.update: amax must have shape () or (1,), got {amax.shape}"
            )
        hist = jnp.asarray(self.amax_history, jnp.float32)
        if hist.ndim != 1:
            raise ValueError(
                "DelayedScaleQuantizer.update: amax_history must have shape (L,), got "
                f"{hist.shape} (update a stack of quantizers under jax.vmap)"
            )
        scale, hist = _next_delayed_state(
            self.scale, hist, amax.reshape(()), self.q_max, self.margin, self.amax_compute_algo
        )
        return self._unflatten(self._flatten()[1], (scale, hist))

    def merge_updates(self, *updated: DelayedScaleQuantizer) -> DelayedScaleQuantizer:
        """The next state when several uses of this quantizer met in one step.

        Each of ``updated`` is ``self.update(a_i)`` for the amax ``a_i`` one use measured (its
        newest history slot holds ``a_i``), or all zeros for a use that contributed nothing (a
        zero cotangent). The result is ``self.update(max_i a_i)``: the state one use on all
        the data would give, combined by max, never by sum. NaN-propagating, as the tensor
        amax itself is. Under ``vmap`` the states may be stacks (leading axes of ``scale``).
        """
        if not updated:
            return self
        absent = functools.reduce(
            jnp.logical_and, [jnp.asarray(u.scale, jnp.float32) == 0 for u in updated]
        )
        newest = jnp.stack(
            [jnp.asarray(u.amax_history, jnp.float32)[..., -1] for u in updated], axis=0
        )
        amax = ieee.reduce_max(newest, axis=0)
        scale, hist = _next_delayed_state(
            self.scale,
            jnp.asarray(self.amax_history, jnp.float32),
            amax,
            self.q_max,
            self.margin,
            self.amax_compute_algo,
        )
        # No use contributed (every state zero, as a zero cotangent is): contribute nothing.
        scale = jnp.where(absent, jnp.zeros_like(scale), scale)
        hist = jnp.where(absent[..., None], jnp.zeros_like(hist), hist)
        return self._unflatten(self._flatten()[1], (scale, hist))


def _delayed_state_math(scale, hist, amax, q_max, margin, algo):
    """docs/numerics.md §4's update on arrays with any leading axes: ``scale (...)``,
    ``hist (..., L)``, ``amax (...)`` -> the next ``(scale, hist)``."""
    newest = jnp.asarray(amax, jnp.float32)[..., None]
    # h[0] = amax; a = max(h): the old slot 0 is never read.
    current = jnp.concatenate([newest, hist[..., 1:]], axis=-1)
    candidate = functools.partial(delayed_candidate_scale, q_max=q_max, margin=margin, algo=algo)
    new_scale, keep = jax.lax.platform_dependent(
        current, cpu=functools.partial(candidate, exact=False), default=candidate
    )
    scale = jnp.where(keep, scale, new_scale).astype(jnp.float32)
    if hist.shape[-1] == 1:  # L = 1 keeps the newest amax
        return scale, newest
    # roll(h, -1) with slot 0 zeroed, written as one concatenation (one fusion, no in-place
    # update after it): [0, h[2:], amax].
    zero = jnp.zeros_like(newest)
    return scale, jnp.concatenate([zero, hist[..., 2:], newest], axis=-1)


def delayed_candidate_scale(current, *, q_max, margin, algo, exact=True):
    """``(new, keep)`` of the update from the history with the newest amax in slot 0:
    ``new = RN(Q / a) · 2^-margin`` and whether the old scale stays (``a`` not positive or not
    finite, or ``new`` not finite).

    ``exact``: ``ieee``'s bit-pattern maximum and division, which no denormal mode affects
    (XLA:GPU's native float32 division is not correctly rounded). Otherwise XLA's native
    max, compare and division, for XLA:CPU, whose flushed denormals (``ieee``'s module
    docstring) change no result here: ``Q / a`` is normal for every normal ``a`` (``Q`` is at
    least 448, ``a`` at most float32 max), where the native division is correctly rounded; a
    subnormal ``a`` is read as 0, so the native path keeps the old scale where the exact one
    keeps it because ``Q / a`` overflows; and a subnormal read as 0 in the maximum changes ``a``
    only among values that keep the old scale. The native computation compiles to a few ops,
    the exact one to a few hundred per update (most of a delayed-scaling step's compile time on
    a CPU).
    """
    if exact:
        a = current[..., 0] if algo == "most_recent" else ieee.reduce_max(current, axis=-1)
        positive, new = ieee.is_positive(a), ieee.div(np.float32(q_max), a)
    else:
        a = current[..., 0] if algo == "most_recent" else jnp.max(current, axis=-1)
        positive, new = a > 0, np.float32(q_max) / a
    if margin:
        new = ieee.ldexp(new, -margin)  # rounds into the subnormal range under any mode
    return new, ~(positive & jnp.isfinite(a) & jnp.isfinite(new))


def _next_delayed_state(scale, hist, amax, q_max, margin, algo):
    """``_delayed_state_math`` with the batching rule of a shared state (``update``)."""
    return _delayed_update(float(q_max), int(margin), algo)(scale, hist, amax)


@functools.cache
def _delayed_update(q_max: float, margin: int, algo: str):
    """The update of one static configuration as a ``custom_vmap`` function: a state the batch
    shares (unbatched ``scale`` and ``hist``, batched ``amax``) takes the batch's largest amax
    and stays unbatched, so ``vmap``'s backward has no per-element states to sum."""

    # One traced (and lowered) function per shape that every update calls: the update's exact
    # division and maxima are a few hundred ops, which retraced at each update (and again at
    # each lowering) were most of the tracing time of a delayed-scaling step. XLA inlines the
    # call: the compiled program is the same.
    @jax.jit
    def delayed_state_update(scale, hist, amax):
        return _delayed_state_math(scale, hist, amax, q_max, margin, algo)

    @custom_vmap
    def next_state(scale, hist, amax):
        return delayed_state_update(scale, hist, amax)

    @next_state.def_vmap
    def _rule(axis_size, in_batched, scale, hist, amax):
        scale_b, hist_b, amax_b = in_batched
        if amax_b and not (scale_b or hist_b):
            # Re-enters next_state, so an enclosing vmap applies its own rule to the result.
            return next_state(scale, hist, ieee.reduce_max(amax, axis=0)), (False, False)
        stack = lambda v, b: v if b else jnp.broadcast_to(v, (axis_size,) + jnp.shape(v))
        out = next_state(stack(scale, scale_b), stack(hist, hist_b), stack(amax, amax_b))
        return out, (True, True)

    return next_state
