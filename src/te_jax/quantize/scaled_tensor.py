"""``ScaledTensor``: quantized data with the scales that dequantize it (docs/numerics.md §4, §5).

``dequantized = data · scale_inv``, the scale broadcast over its tensor or block:

| mode     | data (dtype)          | scale_inv                    | also                         |
|----------|-----------------------|------------------------------|------------------------------|
| delayed  | E4M3/E5M2, y's shape  | float32 ``()``               | ``amax``                     |
| current  | E4M3/E5M2, y's shape  | float32 ``()``               | ``amax``                     |
| MXFP8    | E4M3/E5M2, y's shape  | E8M0, one per 32 (shapes.py) |                              |
| NVFP4    | E2M1, y's shape       | E4M3, one per 16             | ``amax``, ``global_scale_inv`` |

NVFP4 dequantizes to ``q · scale_inv · global_scale_inv``.

Colwise copies (``colwise_data``, ``colwise_scale_inv``): for tensor scaling the transpose of the
flattened 2-D tensor, ``features + leading``, with the same scale; for block scaling the rowwise
shape with blocks running down the rows and their own scales. A field that is not produced is
``None``: ``data`` and (block scaling) ``scale_inv`` without a rowwise layout, ``colwise_data``
and ``colwise_scale_inv`` without a colwise one.

A ``ScaledTensor`` is a pytree: the arrays are leaves; ``scaling_mode``, ``q_layout``,
``dq_dtype`` and ``n_feature_axes`` are static. Under ``vmap`` the leaves simply gain the batch
axis, so dequantize a batched tensor under ``vmap`` too (outside it, the per-example scales of
tensor scaling would not broadcast against the data).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from te_jax.quantize import formats
from te_jax.quantize.quantize_layout import QuantizeLayout
from te_jax.quantize.scaling_modes import ScalingMode

__all__ = ["ScaledTensor", "cotangent_from_gradient", "gradient_from_cotangent"]

_LEAVES = ("data", "scale_inv", "colwise_data", "colwise_scale_inv", "amax", "global_scale_inv")
_STATIC = ("scaling_mode", "q_layout", "dq_dtype", "n_feature_axes")


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True)
class ScaledTensor:
    """A quantized tensor (see the module doc for what each field holds in each mode).

    Attributes:
      data: rowwise quantized data, the logical shape; ``None`` for a colwise-only layout.
      scale_inv: its dequantization scale(s); for tensor scaling the one shared float32 scale.
      colwise_data: the colwise copy, or ``None``.
      colwise_scale_inv: its scale(s), or ``None``. Tensor scaling: the same float32 scale as
        ``scale_inv``, filled in from it when not given.
      amax: float32 ``()``: the amax the op measured or was given (tensor scaling, NVFP4).
      global_scale_inv: float32 ``()``: ``1/S`` (NVFP4 only).
      scaling_mode, q_layout: how it was quantized.
      dq_dtype: the dtype ``dequantize`` returns (the input's dtype).
      n_feature_axes: trailing axes folded into N for the colwise transpose (1, or 2 for gated
        ``dact`` outputs ``(..., 2, H)``).

    ``dequantize()`` is ``data · scale_inv`` (the scale broadcast over its tensor or block), in
    ``dq_dtype``. Made by ``te_jax.quantize.quantize`` and the ops given a ``quantizer``.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from te_jax.quantize import CurrentScaleQuantizer, quantize
      >>> st = quantize(jnp.array([[1.0, -2.0, 4.0, 0.5]]), CurrentScaleQuantizer())
      >>> st.scaling_mode.name, st.shape, st.q_dtype, st.dq_dtype, float(st.amax)
      ('CURRENT_TENSOR_SCALING', (1, 4), dtype(float8_e4m3fn), dtype('float32'), 4.0)
      >>> jax.jit(lambda t: t.dequantize())(st).tolist()     # a pytree: through jit
      [[1.0, -2.0, 4.0, 0.5]]
    """

    data: Any = None
    scale_inv: Any = None
    colwise_data: Any = None
    colwise_scale_inv: Any = None
    amax: Any = None
    global_scale_inv: Any = None
    scaling_mode: ScalingMode
    q_layout: QuantizeLayout
    dq_dtype: Any
    n_feature_axes: int = 1

    def __post_init__(self):
        object.__setattr__(self, "scaling_mode", ScalingMode(self.scaling_mode))
        object.__setattr__(self, "q_layout", QuantizeLayout(self.q_layout))
        object.__setattr__(self, "dq_dtype", np.dtype(self.dq_dtype))
        object.__setattr__(self, "n_feature_axes", int(self.n_feature_axes))
        # Catch wiring mistakes where the tensor is built (not on unflatten, which bypasses
        # __init__ and may carry placeholders instead of arrays).
        lay, spec = self.q_layout, self.scaling_mode.impl
        if not spec.quantizes:
            raise ValueError(
                f"ScaledTensor: {spec.name} output is a plain array, not a ScaledTensor"
            )
        if spec.is_tensor_scaling and lay.has_colwise and self.colwise_scale_inv is None:
            # One scale serves both copies; fill the colwise field so consumers need no case.
            object.__setattr__(self, "colwise_scale_inv", self.scale_inv)
        produced = spec.scaled_tensor_fields(lay)
        for name in ("data", "colwise_data", "colwise_scale_inv", "scale_inv", "global_scale_inv"):
            want = name in produced
            if (getattr(self, name) is not None) != want:
                raise ValueError(
                    f"ScaledTensor({spec.name}, {lay.name}): {name} must be "
                    + ("given" if want else "None")
                )

    # --- shape --------------------------------------------------------------------------------

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical (dequantized) shape, read off the data leaves."""
        if self.data is not None:
            return tuple(self.data.shape)
        return self.scaling_mode.impl.logical_shape_of_colwise(
            self.colwise_data.shape, self.n_feature_axes
        )

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def q_dtype(self) -> np.dtype:
        """The quantized data's dtype (E4M3, E5M2 or E2M1)."""
        d = self.data if self.data is not None else self.colwise_data
        return np.dtype(d.dtype)

    @property
    def dtype(self) -> np.dtype:
        """Same as ``q_dtype``: the dtype of what is stored (``dq_dtype`` is what it stands for)."""
        return self.q_dtype

    # --- dequantize ---------------------------------------------------------------------------

    def dequantize(self, copy: str | None = None, dtype=None) -> jax.Array:
        """The tensor in ``dq_dtype`` with the logical shape: ``data · scale_inv`` (NVFP4:
        ``q · block_scale · global_scale_inv``), float32 arithmetic rounded once to
        ``dq_dtype``.

        Uses the rowwise data when present, the colwise copy otherwise (transposed back for
        tensor scaling); ``copy="rowwise"`` or ``"colwise"`` picks one (for block scaling the
        two copies hold different blocks, so they dequantize to slightly different values).
        ``dtype`` overrides ``dq_dtype`` (e.g. float32, where the product is exact). Under
        ``vmap`` for a batched tensor.
        """
        if copy not in (None, "rowwise", "colwise"):
            raise ValueError(
                f"ScaledTensor.dequantize: copy must be None, 'rowwise' or 'colwise', got {copy!r}"
            )
        colwise = self.data is None if copy is None else copy == "colwise"
        if (self.colwise_data if colwise else self.data) is None:
            raise ValueError(
                f"ScaledTensor.dequantize: this tensor ({self.q_layout.name}) has "
                f"no {'colwise' if colwise else 'rowwise'} copy"
            )
        q = self.colwise_data if colwise else self.data
        s = self.colwise_scale_inv if colwise else self.scale_inv
        v = formats.to_float32(q)  # not astype: see formats.to_float32
        v = self.scaling_mode.impl.dequantize(
            v, s, self.global_scale_inv, colwise, self.n_feature_axes
        )
        return v.astype(self.dq_dtype if dtype is None else dtype)


def _flatten(t: ScaledTensor):
    return tuple(getattr(t, n) for n in _LEAVES), tuple(getattr(t, n) for n in _STATIC)


def _flatten_with_keys(t: ScaledTensor):
    return (
        tuple((jax.tree_util.GetAttrKey(n), getattr(t, n)) for n in _LEAVES),
        tuple(getattr(t, n) for n in _STATIC),
    )


def _unflatten(aux, children) -> ScaledTensor:
    t = object.__new__(ScaledTensor)
    for name, value in zip(_LEAVES, children, strict=True):
        object.__setattr__(t, name, value)
    for name, value in zip(_STATIC, aux, strict=True):
        object.__setattr__(t, name, value)
    return t


jax.tree_util.register_pytree_with_keys(
    ScaledTensor, _flatten_with_keys, _unflatten, flatten_func=_flatten
)


# ---- differentiation: the cotangent of a ScaledTensor ------------------------------------------
# A ScaledTensor stands for its dequantized value. An op that consumes one inside a custom_vjp
# (te_jax.dense) returns, as its cotangent, a ScaledTensor-shaped pytree whose `data` leaf holds
# dL/d(dequantized value) in dq_dtype (JAX lets a custom_vjp cotangent of a float8 leaf have
# another float dtype of the same shape) and whose other leaves are zeros. The op that produced
# it (te_jax.activation with a quantizer) reads the gradient back from `data`.


def cotangent_from_gradient(t: ScaledTensor, g: jax.Array) -> ScaledTensor:
    """The cotangent of ``t`` carrying ``g = dL/d t.dequantize()`` (``t``'s logical shape)."""
    if t.data is None:
        raise ValueError(
            "ScaledTensor: a colwise-only tensor cannot carry a gradient (quantize it with a "
            "rowwise layout where it is differentiated)"
        )
    ct = jax.tree.map(lambda a: jax.numpy.zeros(a.shape, a.dtype), t)
    object.__setattr__(ct, "data", g.astype(t.dq_dtype).reshape(t.data.shape))
    return ct


def gradient_from_cotangent(ct: ScaledTensor, dtype) -> jax.Array:
    """``dL/d(dequantized value)`` read back from a ScaledTensor cotangent, in ``dtype``."""
    g = ct.data
    return jax.numpy.asarray(g).astype(dtype)
