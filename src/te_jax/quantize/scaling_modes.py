"""Scaling modes: the public ``ScalingMode`` enum and one description object per mode.

Everything that depends on the mode is said once, in its description (``ScalingMode.X.impl``):
the FFI ``scaling_mode`` value, the quantized dtypes it allows, its block size and block-scale
dtype, the results it produces and their shapes, which per-tensor input the quantizing kernel
reads (delayed scaling's ``scale`` or the two-pass modes' ``amax``), its Shardy factors, and
its quantize / dequantize arithmetic (docs/numerics.md §4, §5).

| mode                   | class                 | data        | scale_inv                 | block |
|------------------------|-----------------------|-------------|---------------------------|-------|
| NO_SCALING             | NoScaling             | input dtype | -                         | -     |
| DELAYED_TENSOR_SCALING | DelayedTensorScaling  | E4M3, E5M2  | float32, one per tensor   | -     |
| MXFP8_1D_SCALING       | MXFP8BlockScaling     | E4M3, E5M2  | E8M0, one per block       | 32    |
| CURRENT_TENSOR_SCALING | CurrentTensorScaling  | E4M3, E5M2  | float32, one per tensor   | -     |
| NVFP4_1D_SCALING       | NVFP4BlockScaling     | E2M1        | E4M3, one per block (+1/S)| 16    |
| FP8_BLOCK_1D_SCALING   | Float8Block1DScaling  | E4M3, E5M2  | float32, one per 1×128    | 128   |
| FP8_BLOCK_2D_SCALING   | Float8Block2DScaling  | E4M3, E5M2  | float32, one per 128×128  | 128   |

Adding a mode is one subclass here, its enum value, and its kernels.

Shapes are those of ``B`` independent tensors ``batch + lead + feat`` (``geometry.Geometry``);
"per tensor" results (a tensor scale, ``amax``, ``global_scale_inv``) have shape
``batch + per_tensor``, with ``per_tensor = ()`` in a ``ScaledTensor`` and ``(1,)`` as a
primitive result.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from te_jax._enum import NamedIntEnum
from te_jax.quantize import formats, ieee, scale_math
from te_jax.quantize.geometry import Geometry, block_axis, colwise_perm, split_blocks

__all__ = [
    "ScalingMode",
    "ScalingModeImpl",
    "NoScaling",
    "DelayedTensorScaling",
    "CurrentTensorScaling",
    "MXFP8BlockScaling",
    "NVFP4BlockScaling",
    "Float8Block1DScaling",
    "Float8Block2DScaling",
    "FFI_RESULT_SLOTS",
    "ffi_result_list",
]


class ScalingMode(NamedIntEnum):
    """How a quantized tensor is scaled (docs/numerics.md §4); the value is the FFI
    ``scaling_mode``, so it must not be renumbered.

    * ``NO_SCALING``: no quantization (output in the input dtype).
    * ``DELAYED_TENSOR_SCALING``: one float32 scale per tensor, taken from the quantizer's state
      (updated from past amaxes after the step).
    * ``MXFP8_1D_SCALING``: one E8M0 (power-of-two) scale per block of 32 elements.
    * ``CURRENT_TENSOR_SCALING``: one float32 scale per tensor, from this tensor's amax.
    * ``NVFP4_1D_SCALING``: one E4M3 scale per block of 16 elements and a float32 global scale.
    * ``FP8_BLOCK_1D_SCALING``: one float32 scale per 128 consecutive elements of a row
      (rowwise) or of a column (colwise) of the flattened ``[M, N]`` (DeepSeek-V3's activations
      and gradients).
    * ``FP8_BLOCK_2D_SCALING``: one float32 scale per 128×128 tile of ``[M, N]`` (its weights).

    Example:
      >>> from te_jax.quantize import ScalingMode
      >>> m = ScalingMode.MXFP8_1D_SCALING
      >>> m.block_size, m.is_block_scaling, m.is_two_pass
      (32, True, False)
      >>> [mode.name for mode in ScalingMode if mode.is_tensor_scaling]
      ['DELAYED_TENSOR_SCALING', 'CURRENT_TENSOR_SCALING']
    """

    NO_SCALING = 0
    DELAYED_TENSOR_SCALING = 1
    MXFP8_1D_SCALING = 2
    CURRENT_TENSOR_SCALING = 3
    NVFP4_1D_SCALING = 4
    FP8_BLOCK_1D_SCALING = 5
    FP8_BLOCK_2D_SCALING = 6

    @property
    def impl(self) -> ScalingModeImpl:
        """The mode's description (shapes, dtypes, kernel inputs, arithmetic)."""
        return _IMPLS[self]

    @property
    def is_tensor_scaling(self) -> bool:
        """One float32 scale for the whole tensor (delayed, current)."""
        return self.impl.is_tensor_scaling

    @property
    def is_block_scaling(self) -> bool:
        """One scale per block of consecutive elements (MXFP8, NVFP4)."""
        return self.impl.block_size is not None

    @property
    def block_size(self) -> int | None:
        """Elements per scale block along each blocked axis: 32 (MXFP8), 16 (NVFP4), 128
        (blockwise FP8), ``None`` otherwise."""
        return self.impl.block_size

    @property
    def is_two_pass(self) -> bool:
        """Whether quantizing needs the tensor's global amax first (current scaling, NVFP4).

        Under sharding that amax is the max over every shard, so these modes take it from
        outside (``reference.quantize_from_amax``).
        """
        return self.impl.two_pass


# The result slots of every FFI target that can quantize, in order (the FFI contract): the dact
# targets append dbias and the dbias workspace.
FFI_RESULT_SLOTS = (
    "output",
    "colwise_output",
    "scale_inv",
    "colwise_scale_inv",
    "amax",
    "global_scale_inv",
)
# The ScaledTensor field each quantized FFI slot holds.
_FIELD_OF_SLOT = dict(
    zip(FFI_RESULT_SLOTS, ("data", "colwise_data") + FFI_RESULT_SLOTS[2:], strict=True)
)

_F32 = np.dtype(np.float32)
_U8 = np.dtype(np.uint8)
_sds = jax.ShapeDtypeStruct


def ffi_result_list(empty: jax.ShapeDtypeStruct, **slots) -> list[jax.ShapeDtypeStruct]:
    """The six result buffers of the FFI contract, ``empty`` where a slot is not given."""
    unknown = set(slots) - set(FFI_RESULT_SLOTS)
    if unknown:
        raise ValueError(f"unknown FFI result slots {sorted(unknown)}")
    return [slots.get(name, empty) for name in FFI_RESULT_SLOTS]


class ScalingModeImpl:
    """What a scaling mode is: one subclass per mode, one instance each (``ScalingMode.impl``).

    Class attributes:
      mode: the ``ScalingMode`` it describes (``int(mode)`` is the FFI ``scaling_mode``).
      q_dtypes: the quantized data dtypes it allows, the default first.
      block_size: elements per block scale, ``None`` for the tensor-scaled modes.
      block_scale_dtype: the dtype of the block scales (``scale_inv``), or ``None``.
      two_pass: quantizing needs the tensor's amax first (a first pass over the input).
      batch_operand: the FFI operand, ``"scale"`` or ``"amax"`` (float32, one element per
        tensor), that the quantizing kernel reads its tensor count from, and its value where it
        needs one: delayed scaling's scale, the two-pass modes' amax from their first pass
        (MXFP8 reads only the count, from a scale of ones).
      uses_quantizer_scale: the quantizer's ``scale`` (its state) is the scale (delayed).
      kernel_writes_amax: the quantizing kernel fills its ``amax`` slot (delayed scaling).
      has_amax: the quantized tensor reports an amax (``ScaledTensor.amax``).
      has_global_scale_inv: the quantized tensor has ``global_scale_inv`` (NVFP4's ``1/S``).
      gemm_operands: what te_jax's GEMM (``te_jax.gemm``, ``dense``) does with this mode's
        tensors: ``"codes"`` (the quantized data and its per-tensor ``scale_inv`` go to the FP8
        GEMM, each operand in the "TN" form its colwise copy stores), ``"dequantized"`` (each
        copy dequantized exactly in the compute dtype and multiplied there: MXFP8 without an
        MXFP8 GEMM), ``"block_codes"`` (the codes and their block scales go to the block-scaled
        FP8 GEMM where each copy's ``[R, C]`` is the GEMM operand's own, else as
        ``"dequantized"``), or ``None`` (no GEMM takes it).
      gemm_folds_rows: the GEMM's rows are one axis (block scaling: a colwise block runs down
        one row axis, so a tensor's leading axes are folded before it is quantized).
      partial_blocks: any shape is taken, the blocks at the end of an axis covering what is
        left (blockwise FP8); otherwise the blocked axes must be multiples of the block.
      kernel_backends: the backends (``jax.default_backend()`` names) whose te_jax kernels
        quantize in this mode, ``None`` for every backend te_jax builds; elsewhere its ops take
        the pure-JAX path (``te_jax.dispatch.decide``).
    """

    mode: ClassVar[ScalingMode]
    q_dtypes: ClassVar[tuple[np.dtype, ...]] = ()
    block_size: ClassVar[int | None] = None
    block_scale_dtype: ClassVar[np.dtype | None] = None
    two_pass: ClassVar[bool] = False
    batch_operand: ClassVar[str] = "scale"
    uses_quantizer_scale: ClassVar[bool] = False
    kernel_writes_amax: ClassVar[bool] = False
    has_amax: ClassVar[bool] = False
    has_global_scale_inv: ClassVar[bool] = False
    is_tensor_scaling: ClassVar[bool] = False
    gemm_operands: ClassVar[str | None] = None
    gemm_folds_rows: ClassVar[bool] = False
    partial_blocks: ClassVar[bool] = False
    kernel_backends: ClassVar[frozenset[str] | None] = None

    @property
    def name(self) -> str:
        return self.mode.name

    @property
    def ffi_value(self) -> np.int64:
        """The ``scaling_mode`` attribute of the FFI targets."""
        return np.int64(self.mode)

    @property
    def quantizes(self) -> bool:
        return bool(self.q_dtypes)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    # --- results ------------------------------------------------------------------------------

    def scale_names(self, layout) -> tuple[str, ...]:
        """The scale results for ``layout``."""
        return ()

    def result_names(self, layout) -> tuple[str, ...]:
        """The quantized results of an op, in order: the ``ScaledTensor`` fields it returns."""
        names = []
        if layout.has_rowwise:
            names.append("data")
        if layout.has_colwise:
            names.append("colwise_data")
        names += self.scale_names(layout)
        if self.has_amax:
            names.append("amax")
        if self.has_global_scale_inv:
            names.append("global_scale_inv")
        return tuple(names)

    def scaled_tensor_fields(self, layout) -> tuple[str, ...]:
        """The ``ScaledTensor`` fields a tensor quantized with ``layout`` has (not ``None``)."""
        return self.result_names(layout)

    def per_tensor_names(self) -> tuple[str, ...]:
        """The results that hold one value per tensor (shape ``batch + per_tensor``)."""
        return (
            (("scale_inv",) if self.is_tensor_scaling else ())
            + (("amax",) if self.has_amax else ())
            + (("global_scale_inv",) if self.has_global_scale_inv else ())
        )

    def _arrange(self, layout, batch, lead, feat, per_tensor, lead_scale, last_scale) -> dict:
        """Every result of ``layout`` as a list of per-axis entries (sizes, PartitionSpec
        entries or Shardy factors): ``batch + lead + feat`` is the data, ``per_tensor`` the
        entries of a per-tensor result, ``lead_scale`` / ``last_scale`` the entries of the
        axes a block scale divides by the block size."""
        raise NotImplementedError(f"{self.name} produces no quantized tensor")

    def shapes(
        self, g: Geometry, layout, q_dtype, per_tensor: tuple = (1,)
    ) -> dict[str, jax.ShapeDtypeStruct]:
        """``{result name: ShapeDtypeStruct}`` of the results of ``layout`` (in order) for the
        data ``g`` (docs/numerics.md §4, §5)."""
        bs = self.block_size or 1
        lead_scale = list(g.lead[:-1]) + [g.lead[-1] // bs] if g.lead else list(g.lead)
        last_scale = g.feat[-1] // bs if g.feat else None
        parts = self._arrange(
            layout,
            list(g.batch),
            list(g.lead),
            list(g.feat),
            list(per_tensor),
            lead_scale,
            last_scale,
        )
        dtypes = {
            "data": q_dtype,
            "colwise_data": q_dtype,
            "scale_inv": _F32 if self.is_tensor_scaling else self.block_scale_dtype,
            "colwise_scale_inv": self.block_scale_dtype,
            "amax": _F32,
            "global_scale_inv": _F32,
        }
        return {n: _sds(tuple(parts[n]), np.dtype(dtypes[n])) for n in self.result_names(layout)}

    def ffi_results(self, g: Geometry, layout, q_dtype) -> list[jax.ShapeDtypeStruct]:
        """The six result buffers of the quantizing FFI call (``FFI_RESULT_SLOTS``), flattened to
        2-D per tensor; empty where the mode or layout produces nothing."""
        slots = self._ffi_data_and_scales(g, layout, np.dtype(q_dtype))
        # The per-tensor slots are float32 even where empty.
        slots["amax"] = _sds((g.b,) if self.kernel_writes_amax else (0,), _F32)
        slots["global_scale_inv"] = _sds((g.b,) if self.has_global_scale_inv else (0,), _F32)
        return ffi_result_list(_sds((0,), _U8), **slots)

    def _ffi_data_and_scales(self, g: Geometry, layout, q_dtype) -> dict:
        raise NotImplementedError(f"{self.name} produces no quantized tensor")

    @staticmethod
    def fields_of_ffi_results(buffers: Sequence) -> dict:
        """The quantizing call's six buffers by ``ScaledTensor`` field name."""
        return {_FIELD_OF_SLOT[s]: b for s, b in zip(FFI_RESULT_SLOTS, buffers, strict=True)}

    def check_kernel_shape(self, op: str, shape: tuple) -> None:
        """Raises ``ValueError`` when the kernels cannot take data of ``shape`` (trace time)."""

    # --- sharding -----------------------------------------------------------------------------

    def result_specs(self, layout, bspec: list, lspec: list, fspec: list) -> dict:
        """PartitionSpec entries of the results of the data sharded ``bspec + lspec + fspec``."""
        return self._arrange(
            layout, bspec, lspec, fspec, [None], lspec, fspec[-1] if fspec else None
        )

    def shardy_factors(
        self,
        layout,
        batch: list,
        lead: list,
        feat: list,
        last_extent: int,
        lead_extent,
        lead_extents: Sequence[int] = (),
        feat_extents: Sequence[int] = (),
    ) -> tuple[dict, list, str, dict]:
        """Shardy factors of the results (einsum-like ``sharding_rule`` pieces).

        ``batch``, ``lead``, ``feat`` are the data's factor names (``feat[-1]`` is the last axis,
        of extent ``last_extent``; the innermost leading axis has ``lead_extent``, ``None``
        without leading axes; ``lead_extents`` / ``feat_extents``: every leading / feature
        axis's extent). Returns ``(factors by result name, the data's leading factors,
        its last-axis factor, factor sizes)``: a block mode may write a data axis as the
        compound ``(outer, block)`` so that its block scale maps the outer factor alone.
        """
        parts = self._arrange(layout, batch, lead, feat, ["z"], lead, feat[-1])
        return parts, list(lead), feat[-1], {}

    def unsplit_for_blocks(self, layout, x_spec: list, extents: dict, shards) -> list:
        """``x_spec`` with the axes unsplit whose shards a block would straddle (``extents``:
        x's axes as ``(axis, size)``: ``"last"`` gives y's last axis, ``"lead"`` its innermost
        leading one (or ``None``), ``"leads"`` / ``"feats"`` all its leading / feature axes,
        outermost first; ``shards(entry)`` counts the shards of a PartitionSpec entry)."""
        return x_spec

    # --- arithmetic ---------------------------------------------------------------------------

    def quantize_fields(
        self, y32, q_dtype, layout, n_feature_axes, scale, amax, options=None
    ) -> dict:
        """The pure-JAX quantization of ``y32`` (float32): ``{ScaledTensor field: array}``.

        ``scale`` is the quantizer's scale (delayed scaling), ``amax`` the tensor amax (the
        modes with ``has_amax``); float32 ``()``. ``options``: the quantizer's
        ``scale_options`` (blockwise FP8's ``scale_math.BlockScaleOptions``), else ``None``.
        """
        raise ValueError(f"{self.name} produces no quantized tensor")

    def dequantize(self, v, s, global_scale_inv, colwise: bool, n_feature_axes: int):
        """Float32 ``v`` (the data decoded) times its scales ``s``: the logical tensor."""
        raise ValueError(f"{self.name} produces no quantized tensor")

    def logical_shape_of_colwise(self, colwise_shape: tuple, n_feature_axes: int) -> tuple:
        """The logical shape of a tensor whose colwise data has ``colwise_shape``."""
        return tuple(colwise_shape)


class NoScaling(ScalingModeImpl):
    """No quantization: the op's output in the input dtype, with ``amax = max|y|`` on request
    (``output_amax``)."""

    mode = ScalingMode.NO_SCALING

    @staticmethod
    def unquantized_ffi_results(output: jax.ShapeDtypeStruct, output_amax: bool) -> list:
        """The six result buffers of an unquantized FFI call: ``output`` and, with
        ``output_amax``, ``amax`` of shape ``(1,)``."""
        empty = _sds((0,), _F32)
        amax = _sds((1,), _F32) if output_amax else empty
        return ffi_result_list(empty, output=output, amax=amax)


class _TensorScaling(ScalingModeImpl):
    """One float32 scale per tensor; colwise data is the transpose of each flattened ``[M, N]``
    stored ``features + leading``, sharing the rowwise scale."""

    q_dtypes = (formats.E4M3, formats.E5M2)
    is_tensor_scaling = True
    has_amax = True
    gemm_operands = "codes"

    def scale_names(self, layout):
        return ("scale_inv",)

    def scaled_tensor_fields(self, layout):
        # The colwise copy shares the one scale: ScaledTensor holds it in both fields.
        shared = ("colwise_scale_inv",) if layout.has_colwise else ()
        return self.result_names(layout) + shared

    def _arrange(self, layout, batch, lead, feat, per_tensor, lead_scale, last_scale):
        return {
            "data": batch + lead + feat,
            "colwise_data": batch + feat + lead,
            "scale_inv": batch + per_tensor,
            "amax": batch + per_tensor,
        }

    def _ffi_data_and_scales(self, g, layout, q_dtype):
        slots = {"scale_inv": _sds((g.b,), _F32)}
        if layout.has_rowwise:
            slots["output"] = _sds((g.m, g.n), q_dtype)
        if layout.has_colwise:
            slots["colwise_output"] = _sds((g.b, g.n, g.m // g.b), q_dtype)
        return slots

    def tensor_scale(self, scale, amax, q_dtype) -> jax.Array:
        """The scale ``q = sat(y · scale)`` uses, float32 ``()``."""
        raise NotImplementedError

    def quantize_fields(self, y32, q_dtype, layout, n_feature_axes, scale, amax, options=None):
        scale = self.tensor_scale(scale, amax, q_dtype)
        q = formats.saturating_cast(ieee.mul(y32, scale), q_dtype)
        scale_inv = ieee.div(np.float32(1.0), scale)
        fields = {"scale_inv": scale_inv, "amax": amax}
        if layout.has_rowwise:
            fields["data"] = q
        if layout.has_colwise:
            fields["colwise_data"] = jnp.transpose(q, colwise_perm(q.ndim, n_feature_axes))
            fields["colwise_scale_inv"] = scale_inv
        return fields

    def dequantize(self, v, s, global_scale_inv, colwise, n_feature_axes):
        v = ieee.mul(v, jnp.asarray(s, jnp.float32).reshape(()))
        if colwise:
            perm = colwise_perm(v.ndim, n_feature_axes)
            v = jnp.transpose(v, np.argsort(perm))
        return v

    def logical_shape_of_colwise(self, colwise_shape, n_feature_axes):
        s = tuple(colwise_shape)  # features + leading -> leading + features
        return s[n_feature_axes:] + s[:n_feature_axes]


class DelayedTensorScaling(_TensorScaling):
    """Delayed tensor scaling: ``q = sat(y · scale)`` with the quantizer's ``scale`` (its state,
    updated from past amaxes); the kernel reports this tensor's amax for that update."""

    mode = ScalingMode.DELAYED_TENSOR_SCALING
    uses_quantizer_scale = True
    kernel_writes_amax = True

    def tensor_scale(self, scale, amax, q_dtype):
        scale = jnp.asarray(scale, jnp.float32)
        if scale.shape not in ((), (1,)):
            raise ValueError(
                "te_jax.quantize: DelayedScaleQuantizer.scale must have shape () or (1,), got "
                f"{scale.shape} (quantize with a stack of quantizers under jax.vmap)"
            )
        return scale.reshape(())


class CurrentTensorScaling(_TensorScaling):
    """Current tensor scaling: ``scale = Q / amax`` from this tensor's amax (two passes)."""

    mode = ScalingMode.CURRENT_TENSOR_SCALING
    two_pass = True
    batch_operand = "amax"

    def tensor_scale(self, scale, amax, q_dtype):
        return scale_math.current_scale(amax, formats.q_max(q_dtype))


class _BlockScaling(ScalingModeImpl):
    """One scale per ``block_size`` consecutive elements: along the last axis (rowwise) or the
    innermost leading axis (colwise); colwise data keeps the rowwise shape."""

    def scale_names(self, layout):
        return (("scale_inv",) if layout.has_rowwise else ()) + (
            ("colwise_scale_inv",) if layout.has_colwise else ()
        )

    def _arrange(self, layout, batch, lead, feat, per_tensor, lead_scale, last_scale):
        data = batch + lead + feat
        return {
            "data": data,
            "colwise_data": data,
            "scale_inv": batch + lead + feat[:-1] + [last_scale],
            "colwise_scale_inv": batch + lead_scale + feat,
            "amax": batch + per_tensor,
            "global_scale_inv": batch + per_tensor,
        }

    def _ffi_data_and_scales(self, g, layout, q_dtype):
        # NVFP4 data is float4_e2m1fn, which XLA stores two codes per byte as the kernels
        # write them (no unpacking pass).
        bs, slots = self.block_size, {}
        if layout.has_rowwise:
            slots["output"] = _sds((g.m, g.n), q_dtype)
            slots["scale_inv"] = _sds((g.m, g.n // bs), self.block_scale_dtype)
        if layout.has_colwise:
            slots["colwise_output"] = _sds((g.m, g.n), q_dtype)
            slots["colwise_scale_inv"] = _sds((g.m // bs, g.n), self.block_scale_dtype)
        return slots

    def shardy_factors(self, layout, batch, lead, feat, last_extent, lead_extent, **_):
        # A block scale has an axis `block` times shorter than the data's: the data's axis is
        # the compound factor (outer, block) and the scale's is the outer factor alone. A
        # compound factor may not have an outer part of size 1: an axis of exactly one block
        # gets a separate size-1 factor in the scale instead, and stays unsplit.
        bs, sizes = self.block_size, {}
        h, last_scale = feat[-1], feat[-1]
        lead_data, lead_scale = list(lead), list(lead)
        if layout.has_rowwise:
            if last_extent > bs:
                h = f"({h} hb)"
                sizes["hb"] = bs
            else:
                last_scale = "hs"
        if layout.has_colwise and lead:
            if lead_extent > bs:
                lead_data[-1] = f"({lead[-1]} rb)"
                sizes["rb"] = bs
            else:
                lead_scale[-1] = "rs"
        feat = feat[:-1] + [h]
        parts = self._arrange(layout, batch, lead_data, feat, ["z"], lead_scale, last_scale)
        return parts, lead_data, h, sizes

    def unsplit_for_blocks(self, layout, x_spec, extents, shards):
        x_spec, bs = list(x_spec), self.block_size
        last, size = extents["last"]
        if layout.has_rowwise and (size // shards(x_spec[last])) % bs:
            x_spec[last] = None
        if layout.has_colwise and extents["lead"] is not None:
            axis, size = extents["lead"]
            if (size // shards(x_spec[axis])) % bs:
                x_spec[axis] = None
        return x_spec

    def _prepare(self, y32, q_dtype, amax) -> tuple[dict, Callable]:
        """``(per-tensor fields, direction)``: ``direction(axis)`` quantizes ``y32`` with blocks
        along ``axis`` and returns ``(data, block scales)``."""
        raise NotImplementedError

    def quantize_fields(self, y32, q_dtype, layout, n_feature_axes, scale, amax, options=None):
        fields, direction = self._prepare(y32, q_dtype, amax)
        if layout.has_rowwise:
            axis = block_axis(y32.ndim, n_feature_axes, False)
            fields["data"], fields["scale_inv"] = direction(axis)
        if layout.has_colwise:
            axis = block_axis(y32.ndim, n_feature_axes, True)
            fields["colwise_data"], fields["colwise_scale_inv"] = direction(axis)
        return fields

    def _scale_blocks(self, blocks, s, global_scale_inv, axis):
        raise NotImplementedError

    def dequantize(self, v, s, global_scale_inv, colwise, n_feature_axes):
        axis = block_axis(v.ndim, n_feature_axes, colwise)
        blocks = split_blocks(v, axis, self.block_size)
        return self._scale_blocks(blocks, s, global_scale_inv, axis).reshape(v.shape)


class MXFP8BlockScaling(_BlockScaling):
    """MXFP8: per block of 32, ``e = ceil(log2(amax_b / Q))``, ``q = sat(y · 2^-e)``,
    ``scale_inv = 2^e`` as E8M0 (an all-zero block stores 2^-127, a NaN block 0xFF)."""

    mode = ScalingMode.MXFP8_1D_SCALING
    gemm_operands = "dequantized"
    gemm_folds_rows = True
    q_dtypes = (formats.E4M3, formats.E5M2)
    block_size = 32
    block_scale_dtype = formats.E8M0

    def _prepare(self, y32, q_dtype, amax):
        def direction(axis):
            blocks = split_blocks(y32, axis, 32)
            e = scale_math.mxfp8_exponent(
                ieee.abs_max(blocks, axis=axis + 1), formats.q_max(q_dtype)
            )
            e_b = jnp.expand_dims(e, axis + 1)
            scaled = ieee.ldexp(blocks, -e_b)  # y · 2^-e, exact (2^-e alone may be subnormal)
            scaled = jnp.where(e_b == 128, jnp.float32(jnp.nan), scaled)  # NaN block: NaN data
            q = formats.saturating_cast(scaled, q_dtype).reshape(y32.shape)
            scale_inv = lax.bitcast_convert_type((e + 127).astype(jnp.uint8), formats.E8M0)
            return q, scale_inv

        return {}, direction

    def _scale_blocks(self, blocks, s, global_scale_inv, axis):
        # 2^e from the E8M0 bits, applied exactly (2^-127 is subnormal in float32).
        e = lax.bitcast_convert_type(s, jnp.uint8).astype(jnp.int32) - 127
        out = ieee.ldexp(blocks, jnp.expand_dims(e, axis + 1))
        return jnp.where(jnp.expand_dims(e == 128, axis + 1), jnp.float32(jnp.nan), out)


class NVFP4BlockScaling(_BlockScaling):
    """NVFP4: ``S = 6·448 / amax``; per block of 16 ``block_scale = e4m3((amax_b / 6) · S)``,
    ``q = e2m1((y · S) / block_scale)`` (0 where ``block_scale`` is 0); ``scale_inv =
    block_scale``, ``global_scale_inv = 1 / S``. Two passes (the tensor amax first)."""

    mode = ScalingMode.NVFP4_1D_SCALING
    q_dtypes = (formats.E2M1,)
    block_size = 16
    block_scale_dtype = formats.E4M3
    two_pass = True
    batch_operand = "amax"
    has_amax = True
    has_global_scale_inv = True

    def check_kernel_shape(self, op, shape):
        if shape[-1] % 2:
            raise ValueError(
                f"te_jax.{op}: the NVFP4 kernels pack two E2M1 codes per byte along the last "
                f"axis, which must be even; got shape {shape} (implementation='xla' takes any "
                "shape)"
            )

    def _prepare(self, y32, q_dtype, amax):
        global_scale = scale_math.nvfp4_global_scale(amax)
        fields = {"amax": amax, "global_scale_inv": ieee.div(np.float32(1.0), global_scale)}
        y_s = ieee.mul(y32, global_scale)  # y · S, shared by both directions

        def direction(axis):
            amax_b = ieee.abs_max(split_blocks(y32, axis, 16), axis=axis + 1)
            block_scale = formats.saturating_cast(
                ieee.mul(ieee.div_by_int(amax_b, 6), global_scale), formats.E4M3
            )
            bs = jnp.expand_dims(formats.to_float32(block_scale), axis + 1)  # E4M3: normal
            # A native division (not a multiplication by 1/bs: see ieee.true_divide) is exact
            # here: bs is a normal float32 (or 0, masked below); an operand or result below
            # 2^-126 is at most 2^-117 in magnitude and becomes a signed zero in E2M1 whether or
            # not the backend flushes.
            scaled = ieee.true_divide(split_blocks(y_s, axis, 16), bs)
            q = jnp.where(bs == 0, jnp.float32(0.0), scaled)
            return formats.saturating_cast(q, formats.E2M1).reshape(y32.shape), block_scale

        return fields, direction

    def _scale_blocks(self, blocks, s, global_scale_inv, axis):
        bs = jnp.expand_dims(formats.to_float32(s), axis + 1)
        return ieee.mul(ieee.mul(blocks, bs), jnp.asarray(global_scale_inv, jnp.float32))


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _round_up(a: int, b: int) -> int:
    return _ceil_div(a, b) * b


def _pad_to(a, axis: int, size: int):
    """``a`` zero-padded at the end of ``axis`` to ``size``."""
    pad = [(0, 0)] * a.ndim
    pad[axis] = (0, size - a.shape[axis])
    return jnp.pad(a, pad)


class _Float8BlockScaling(ScalingModeImpl):
    """Blockwise FP8 (TransformerEngine's ``Float8BlockScaling``, DeepSeek-V3's recipe): E4M3 or
    E5M2 codes, one float32 scale per block of the flattened ``[M, N]``; any shape (the last
    block of an axis is partial). Per block, ``scale = fp8_block_scale(max|y_b|, Q, options)``,
    ``data = sat(RN(y · scale))``, ``scale_inv = RN(1 / scale)``.

    Each copy is a matrix ``[R, C]`` in the "TN" form cuBLASLt's FP8 GEMM reads: the rowwise
    copy is ``[M, N]`` (y's shape), the colwise copy its transpose ``[N, M]`` stored
    ``features + leading`` (as tensor scaling's). The scales of a copy ``[R, C]`` are in the
    layout cuBLASLt's block-scaled GEMM reads in place (docs/numerics.md §5): 1D blocks (1×128
    along C) ``(ceil(C/128), round_up(R, 4))``, R contiguous; 2D blocks (128×128)
    ``(ceil(R/128), round_up(ceil(C/128), 4))``; the padding is zeros.
    """

    q_dtypes = (formats.E4M3, formats.E5M2)
    block_size = 128
    block_scale_dtype = _F32
    gemm_operands = "block_codes"
    gemm_folds_rows = True
    partial_blocks = True
    kernel_backends = None
    block_dims: ClassVar[int]  # 1: 1×128 blocks, 2: 128×128 tiles

    def scale_names(self, layout):
        return (("scale_inv",) if layout.has_rowwise else ()) + (
            ("colwise_scale_inv",) if layout.has_colwise else ()
        )

    # --- the scale layouts (class doc) as two axes per copy -----------------------------------
    # A copy [R, C] stores its scales as two axes, each given by R or C as one of three kinds:
    # "blocks" (ceil(X/128)), "pad" (round_up(X, 4)) or "padded_blocks" (round_up(ceil(X/128),
    # 4)). The same arrangement gives the shapes, the PartitionSpecs and the Shardy factors.
    _SCALE_KINDS = ("blocks", "pad", "padded_blocks")

    def _scale_axes(self, r: dict, c: dict) -> list:
        """The two scale axes of a copy ``[R, C]`` from the entries (sizes, PartitionSpec
        entries, factors) that ``R`` and ``C`` give, by kind."""
        if self.block_dims == 1:  # (ceil(C/128), round_up(R, 4)), R contiguous
            return [c["blocks"], r["pad"]]
        return [r["blocks"], c["padded_blocks"]]  # (ceil(R/128), round_up(ceil(C/128), 4))

    def _sizes(self, x: int) -> dict:
        """The sizes an extent ``x`` gives a scale axis, by kind."""
        b = self.block_size
        return {
            "blocks": _ceil_div(x, b),
            "pad": _round_up(x, 4),
            "padded_blocks": _round_up(_ceil_div(x, b), 4),
        }

    def scale_shape(self, r: int, c: int) -> tuple[int, int]:
        """The stored scales of a copy ``[r, c]`` (class doc)."""
        return tuple(self._scale_axes(self._sizes(r), self._sizes(c)))

    def _arrange(self, layout, batch, lead, feat, per_tensor, lead_scale, last_scale):
        # lead_scale / last_scale: the entries that M resp. N give the scale axes, by kind. The
        # rowwise copy is [M, N], the colwise one [N, M] (stored features + leading).
        return {
            "data": batch + lead + feat,
            "colwise_data": batch + feat + lead,
            "scale_inv": batch + self._scale_axes(lead_scale, last_scale),
            "colwise_scale_inv": batch + self._scale_axes(last_scale, lead_scale),
        }

    def shapes(self, g, layout, q_dtype, per_tensor=(1,)):
        m, n = math.prod(g.lead), g.n
        parts = self._arrange(
            layout, list(g.batch), list(g.lead), list(g.feat), [], self._sizes(m), self._sizes(n)
        )
        q = np.dtype(q_dtype)
        dtypes = {"data": q, "colwise_data": q, "scale_inv": _F32, "colwise_scale_inv": _F32}
        return {n: _sds(tuple(parts[n]), dtypes[n]) for n in self.result_names(layout)}

    def _ffi_data_and_scales(self, g, layout, q_dtype):
        # Per batch element: the codes [M, N], their transpose [N, M], and each copy's scales
        # with scale_shape's element count (the FFI checks the counts), as (B * rows, cols).
        m, slots = g.m // max(g.b, 1), {}
        if layout.has_rowwise:
            rows, cols = self.scale_shape(m, g.n)
            slots["output"] = _sds((g.m, g.n), q_dtype)
            slots["scale_inv"] = _sds((g.b * rows, cols), _F32)
        if layout.has_colwise:
            rows, cols = self.scale_shape(g.n, m)
            slots["colwise_output"] = _sds((g.b, g.n, m), q_dtype)
            slots["colwise_scale_inv"] = _sds((g.b * rows, cols), _F32)
        return slots

    # --- sharding -----------------------------------------------------------------------------
    # A shard computes the blocks of its own [M_l, N_l] (no collective), so a split must leave
    # whole blocks, and each shard's scales must be a plain slice of the global ones: the split
    # runs of the flattened M and N must be contiguous (only the outermost axis of the leading
    # axes, resp. of the feature axes, stays split) and a multiple of `_split_unit`.

    def _kinds(self, layout) -> tuple[set, set]:
        """The kinds of scale axis that M resp. N give under ``layout``."""
        m, n = set(), set()
        copies = ([(m, n)] if layout.has_rowwise else []) + ([(n, m)] if layout.has_colwise else [])
        for r, c in copies:
            r.add("pad" if self.block_dims == 1 else "blocks")
            c.add("blocks" if self.block_dims == 1 else "padded_blocks")
        return m, n

    def _split_unit(self, kinds: set) -> int:
        """What a shard's extent of M (or N) must be a multiple of, for scale axes of these
        kinds: whole blocks for "blocks", whole padded runs of 4 scales for "pad" (4 rows) and
        "padded_blocks" (4 blocks, 512)."""
        b = self.block_size
        units = {"blocks": b, "pad": 4, "padded_blocks": 4 * b}
        return max((units[k] for k in kinds), default=1)

    def unsplit_for_blocks(self, layout, x_spec, extents, shards):
        x_spec = list(x_spec)
        for group, kinds in zip(("leads", "feats"), self._kinds(layout), strict=True):
            axes = [(a, size) for a, size in extents[group] if size != 1]
            if not axes:
                continue
            total = math.prod(size for _, size in axes)
            (outer, size), inner = axes[0], axes[1:]
            for axis, _ in inner:  # its shards would hold runs of M (N) that are not contiguous
                x_spec[axis] = None
            n = shards(x_spec[outer])
            if n > 1 and (size % n or (total // n) % self._split_unit(kinds)):
                x_spec[outer] = None
        return x_spec

    @staticmethod
    def _split_entry(entries: list):
        """The one PartitionSpec entry splitting a group of axes (``unsplit_for_blocks`` leaves
        at most one), or ``None``."""
        split = [e for e in entries if e is not None]
        if len(split) > 1:
            raise AssertionError(f"blockwise FP8: several split axes {entries} in one group")
        return split[0] if split else None

    def result_specs(self, layout, bspec, lspec, fspec):
        m, n = self._split_entry(lspec), self._split_entry(fspec)
        return self._arrange(
            layout,
            list(bspec),
            list(lspec),
            list(fspec),
            [],
            dict.fromkeys(self._SCALE_KINDS, m),
            dict.fromkeys(self._SCALE_KINDS, n),
        )

    def shardy_factors(
        self, layout, batch, lead, feat, last_extent, lead_extent, lead_extents=(), feat_extents=()
    ):
        sizes = {}
        m_kinds, n_kinds = self._kinds(layout)
        lead, m = self._group_factors("m", lead, lead_extents, m_kinds, sizes)
        feat, n = self._group_factors("n", feat, feat_extents, n_kinds, sizes, last_only=True)
        parts = self._arrange(layout, batch, lead, feat, [], m, n)
        return parts, lead, feat[-1], sizes

    def _group_factors(
        self, tag, names, extents, kinds, sizes, last_only=False
    ) -> tuple[list, dict]:
        """``(the data's factors of a group of axes, the factors of its scale axes by kind)``.

        Where the group's one axis of extent above 1 is ``g`` (the last one, with
        ``last_only``), of extent ``E``: a "blocks" axis is ``g``'s outer factor (the data axis
        the compound ``(g g_b)``, ``g_b`` = 128) where E is a multiple of 128 above 128, a
        "padded_blocks" axis likewise where E is a multiple of 512, a "pad" axis the data axis
        itself where E is a multiple of 4. Several axes above 1: a "pad" axis is their compound
        where their product is a multiple of 4. Every other scale axis has a factor of its own.
        """
        names = list(names)
        entries = {k: f"s{tag}_{k}" for k in self._SCALE_KINDS}
        big = [i for i, e in enumerate(extents) if e != 1]
        total = math.prod(extents)
        if len(big) > 1:
            if total % 4 == 0:
                entries["pad"] = "(" + " ".join(names[i] for i in big) + ")"
            return names, entries
        if not big or (last_only and big[0] != len(names) - 1):
            return names, entries
        i, b = big[0], self.block_size
        g = names[i]
        aligned = total % b == 0 and total > b
        four = aligned and (total // b) % 4 == 0
        if aligned and ("blocks" in kinds or ("padded_blocks" in kinds and four)):
            sizes[f"{g}_b"] = b
            names[i] = f"({g} {g}_b)"
            entries["blocks"] = g
            if four:
                entries["padded_blocks"] = g
        if total % 4 == 0:
            entries["pad"] = names[i]
        return names, entries

    def logical_shape_of_colwise(self, colwise_shape, n_feature_axes):
        s = tuple(colwise_shape)  # features + leading -> leading + features
        return s[n_feature_axes:] + s[:n_feature_axes]

    def _blocks(self, x2):
        """``[R, C]`` float32 zero-padded to whole blocks (which leaves every block's amax
        unchanged) and split: ``(blocks, amax per block)``, ``(R, ceil(C/128), 128)`` and
        ``(R, ceil(C/128))`` (1D) or ``(ceil(R/128), 128, ceil(C/128), 128)`` and
        ``(ceil(R/128), ceil(C/128))`` (2D)."""
        b, (r, c) = self.block_size, x2.shape
        rb = _round_up(r, b) if self.block_dims == 2 else r
        cb = _round_up(c, b)
        xp = _pad_to(_pad_to(x2, 0, rb), 1, cb)
        if self.block_dims == 1:
            blocks = xp.reshape(rb, cb // b, b)
            return blocks, ieee.abs_max(blocks, axis=2)
        blocks = xp.reshape(rb // b, b, cb // b, b)
        return blocks, ieee.abs_max(blocks, axis=(1, 3))

    @staticmethod
    def _scales(amaxes, q_dtype, options):
        """``[(scale, scale_inv)]`` of each amax array, computed together (one exact division
        for all of them: the pure-JAX path's cost is the number of its ops)."""
        flat = jnp.concatenate([a.reshape(-1) for a in amaxes])
        scale = scale_math.fp8_block_scale(flat, formats.q_max(q_dtype), options)
        if options.power_2_scale:  # 1 / 2^k = 2^-k exactly (2^-127 subnormal)
            k = (lax.bitcast_convert_type(scale, jnp.int32) >> 23) - 127
            inv = ieee.ldexp(jnp.ones_like(scale), -k)
        else:
            inv = ieee.div(np.float32(1.0), scale)
        out, start = [], 0
        for a in amaxes:
            part = slice(start, start + a.size)
            out.append((scale[part].reshape(a.shape), inv[part].reshape(a.shape)))
            start += a.size
        return out

    def _encode(self, blocks, scale, shape, q_dtype, options):
        """The codes ``sat(RN(y · scale))`` of ``blocks`` cut back to ``shape``: a power-of-two
        scale as an exponent shift (the same codes: a product below 2^-126 encodes to a signed
        zero either way)."""
        expand = (
            (slice(None), slice(None), None)
            if self.block_dims == 1
            else (slice(None), None, slice(None), None)
        )
        if options.power_2_scale:
            k = (lax.bitcast_convert_type(scale, jnp.int32) >> 23) - 127
            scaled = ieee.ldexp(blocks, k[expand])
            # ldexp passes a NaN through with its sign; a NaN product is +NaN (as ieee.mul's)
            scaled = jnp.where(jnp.isnan(scaled), jnp.float32(jnp.nan), scaled)
        else:
            scaled = ieee.mul(blocks, scale[expand])
        flat = scaled.reshape(-1, blocks.shape[-2] * blocks.shape[-1])
        return formats.saturating_cast(flat, q_dtype)[: shape[0], : shape[1]]

    def _stored(self, scale_inv, r: int, c: int):
        """The per-block ``scale_inv`` of a copy ``[r, c]`` in its stored layout (class doc)."""
        if self.block_dims == 1:  # (r, blocks) -> (blocks, round_up(r, 4))
            return _pad_to(scale_inv.T, 1, self.scale_shape(r, c)[1])
        return _pad_to(scale_inv, 1, self.scale_shape(r, c)[1])

    def quantize_fields(self, y32, q_dtype, layout, n_feature_axes, scale, amax, options=None):
        if options is None:
            raise ValueError(f"{self.name}: quantizing needs the quantizer's BlockScaleOptions")
        lead = y32.shape[: y32.ndim - n_feature_axes]
        feat = y32.shape[y32.ndim - n_feature_axes :]
        m, n = math.prod(lead), math.prod(feat)
        y2 = y32.reshape(m, n)
        if self.block_dims == 2:  # one grid: the colwise copy is the transpose, scales too
            blocks, amax_b = self._blocks(y2)
            [(s, inv)] = self._scales([amax_b], q_dtype, options)
            codes = self._encode(blocks, s, (m, n), q_dtype, options)
            fields = {}
            if layout.has_rowwise:
                fields["data"] = codes.reshape(y32.shape)
                fields["scale_inv"] = self._stored(inv, m, n)
            if layout.has_colwise:
                fields["colwise_data"] = codes.T.reshape(feat + lead)
                fields["colwise_scale_inv"] = self._stored(inv.T, n, m)
            return fields
        # 1D: each copy from the high-precision values, blocks along its own rows: the
        # rowwise copy [M, N], the colwise one [N, M].
        copies = []
        if layout.has_rowwise:
            copies.append(("data", "scale_inv", y2, y32.shape))
        if layout.has_colwise:
            copies.append(("colwise_data", "colwise_scale_inv", y2.T, feat + lead))
        split = [self._blocks(x) for _, _, x, _ in copies]
        scales = self._scales([a for _, a in split], q_dtype, options)
        fields = {}
        for (data, sinv, x, shape), (blocks, _), (s, inv) in zip(
            copies, split, scales, strict=True
        ):
            codes = self._encode(blocks, s, x.shape, q_dtype, options)
            fields[data] = codes.reshape(shape)
            fields[sinv] = self._stored(inv, *x.shape)
        return fields

    def dequantize(self, v, s, global_scale_inv, colwise, n_feature_axes):
        split = n_feature_axes if colwise else v.ndim - n_feature_axes
        r, c = math.prod(v.shape[:split]), math.prod(v.shape[split:])
        b, s = self.block_size, jnp.asarray(s, jnp.float32)
        if self.block_dims == 1:  # (blocks, round_up(r, 4)) -> one scale per element
            per = jnp.repeat(s[:, :r].T, b, axis=1)[:, :c]
        else:
            grid = s[:, : _ceil_div(c, b)]
            per = jnp.repeat(jnp.repeat(grid, b, axis=0), b, axis=1)[:r, :c]
        out = ieee.mul(v.reshape(r, c), per).reshape(v.shape)
        if colwise:
            out = jnp.transpose(out, np.argsort(colwise_perm(v.ndim, n_feature_axes)))
        return out


class Float8Block1DScaling(_Float8BlockScaling):
    """Blockwise FP8 with 1×128 blocks: rowwise along each row of ``[M, N]``, colwise down each
    column (the colwise copy ``[N, M]`` blocked along its rows), each copy quantized from y."""

    mode = ScalingMode.FP8_BLOCK_1D_SCALING
    block_dims = 1


class Float8Block2DScaling(_Float8BlockScaling):
    """Blockwise FP8 with 128×128 tiles: one scale per tile; the colwise copy and its scales are
    the transposes of the rowwise ones."""

    mode = ScalingMode.FP8_BLOCK_2D_SCALING
    block_dims = 2


_IMPLS: dict[ScalingMode, ScalingModeImpl] = {
    impl.mode: impl
    for impl in (
        NoScaling(),
        DelayedTensorScaling(),
        MXFP8BlockScaling(),
        CurrentTensorScaling(),
        NVFP4BlockScaling(),
        Float8Block1DScaling(),
        Float8Block2DScaling(),
    )
}
assert set(_IMPLS) == set(ScalingMode), "every ScalingMode needs its description"
