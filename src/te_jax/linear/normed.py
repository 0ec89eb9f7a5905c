"""``te_jax.layernorm_dense`` and ``te_jax.layernorm_mlp``: a norm followed by te_jax's dense /
MLP, in TransformerEngine-JAX's functional signatures (its argument order, names and defaults),
so code written against ``transformer_engine.jax.layernorm_dense`` / ``layernorm_mlp`` runs
unchanged once the import changes.

Beside TE-JAX's: a kernel of TE-JAX's non-gated ``(H, 1, I)`` layout (and its ``(1, I)`` bias) is
taken as te_jax's ``(H, I)``; ``quantizer_set(s)`` are te_jax ``QuantizerSet``s or ``None`` (TE's
no-op set); the logical ``*_input_axes`` are sharding constraints on the tensors they name, except
``dot_2_input_axes`` (the intermediate lives inside the fused MLP op, split as ``kernel_1_axes``
says), which must be ``None``; ``ffn2_ckpt_name`` names the output for remat policies
(``jax.checkpoint_policies.save_only_these_names``) and ``ffn1_ckpt_name`` must be ``"ffn1"``,
the name ``te_jax.fused_mlp`` gives h (beside ``ffn1_input``, ``ffn1_kernel``, ``ffn2_input``,
``ffn2_kernel``: the GEMMs' saved operands); ``batch_first`` has no effect (every leading axis is
treated alike).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from te_jax import sharding
from te_jax.layers import layernorm_mlp as _mlp_block
from te_jax.linear.dense import dense
from te_jax.linear.fused_mlp import CHECKPOINT_NAMES
from te_jax.normalization import layernorm
from te_jax.recipe import QuantizerSet

__all__ = ["layernorm_dense", "layernorm_mlp"]


def _constrain(x, axes, where: str, field: str):
    if axes is None:
        return x
    if len(tuple(axes)) != x.ndim:
        raise ValueError(
            f"{where}: {field} must name one logical axis (or None) per axis of its tensor "
            f"{tuple(x.shape)}, got {tuple(axes)}"
        )
    return sharding.logical_constraint(x, tuple(axes))


def _norm(x, gamma, beta, norm_type, zero_centered_gamma, epsilon):
    beta = None if norm_type == "rmsnorm" else beta
    return layernorm(
        x,
        gamma,
        beta,
        layernorm_type=norm_type,
        zero_centered_gamma=zero_centered_gamma,
        epsilon=epsilon,
    )


def layernorm_dense(
    x: jax.Array,
    kernel: jax.Array,
    gamma: jax.Array,
    beta: jax.Array | None,
    bias: jax.Array | None = None,
    norm_type: str = "layernorm",
    zero_centered_gamma: bool = False,
    epsilon: float = 1e-6,
    layernorm_input_axes: Sequence[str | None] | None = None,
    dot_input_axes: Sequence[str | None] | None = None,
    kernel_axes: Sequence[str | None] | None = None,
    batch_first: bool = True,
    quantizer_set: QuantizerSet | None = None,
) -> jax.Array:
    """``y = norm(x) · kernel + bias`` (TE-JAX's ``layernorm_dense``).

    ``norm`` is ``(x - mean) / sqrt(var + epsilon) · gamma + beta`` (``"layernorm"``) or
    ``x / sqrt(mean(x²) + epsilon) · gamma`` (``"rmsnorm"``) over the last axis, in float32.

    Args:
      x: ``(..., H)`` in the compute dtype.
      kernel: ``(H, *F)``.
      gamma, beta: the norm's ``(H,)`` scale and shift (``beta`` unused by ``"rmsnorm"``).
      bias: ``None`` or ``F``-shaped.
      norm_type: ``"layernorm"`` or ``"rmsnorm"``.
      layernorm_input_axes, dot_input_axes: logical axis names of x and of the norm's output
        (sharding constraints), or ``None``.
      kernel_axes: the kernel's logical axis names (its gradient's sharding under a mesh).
      batch_first: no effect (module docstring).
      quantizer_set: ``None`` or ``te_jax.QuantizerSet.create(recipe)``.

    Returns:
      ``(..., *F)`` in x's dtype.

    Example:
      >>> import jax.numpy as jnp, te_jax
      >>> x = jnp.linspace(-1.0, 1.0, 128).reshape(4, 32)
      >>> kernel, gamma = jnp.full((32, 16), 0.1), jnp.ones((32,))
      >>> y = te_jax.layernorm_dense(x, kernel, gamma, None, norm_type="rmsnorm")
      >>> y.shape, y.dtype
      ((4, 16), dtype('float32'))
      >>> rms = jnp.sqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)
      >>> hi = lambda a, b: jnp.dot(a, b, precision="highest")  # float32 on any GPU
      >>> bool(jnp.allclose(y, hi(x / rms, kernel), atol=1e-5))
      True
    """
    del batch_first
    where = "te_jax.layernorm_dense"
    x = _constrain(jnp.asarray(x), layernorm_input_axes, where, "layernorm_input_axes")
    h = _norm(x, gamma, beta, norm_type, zero_centered_gamma, epsilon)
    h = _constrain(h, dot_input_axes, where, "dot_input_axes")
    return dense(h, kernel, bias, quantizer_set=quantizer_set, kernel_axes=kernel_axes)


def layernorm_mlp(
    x: jax.Array,
    gamma: jax.Array,
    beta: jax.Array | None,
    kernels: Sequence[jax.Array],
    biases: Sequence[jax.Array | None],
    norm_type: str = "layernorm",
    zero_centered_gamma: bool = False,
    epsilon: float = 1e-6,
    norm_input_axes: Sequence[str | None] | None = None,
    dot_1_input_axes: Sequence[str | None] | None = None,
    dot_2_input_axes: Sequence[str | None] | None = None,
    kernel_1_axes: Sequence[str | None] | None = None,
    kernel_2_axes: Sequence[str | None] | None = None,
    ffn1_ckpt_name: str = "ffn1",
    ffn2_ckpt_name: str = "ffn2",
    activation_type: Sequence[str] = ("gelu",),
    batch_first: bool = True,
    quantizer_sets: tuple[QuantizerSet | None, QuantizerSet | None] = (None, None),
) -> jax.Array:
    """``out = act(norm(x) · W1 + b1) · W2 + b2`` (TE-JAX's ``layernorm_mlp``; the two GEMMs one
    ``te_jax.fused_mlp``).

    Args:
      x: ``(..., H)`` in the compute dtype.
      gamma, beta: the norm's ``(H,)`` scale and shift (``beta`` unused by ``"rmsnorm"``).
      kernels: ``[W1, W2]``: W1 ``(H, I)``, TE-JAX's ``(H, 1, I)``, or gated ``(H, 2, I)``; W2
        ``(I, H)``.
      biases: ``[b1, b2]``, each ``None`` or of its GEMM's output shape (``(1, I)`` taken as
        ``(I,)``).
      activation_type: an activation or gated pair, e.g. ``("gelu",)``, ``("silu", "linear")``.
      quantizer_sets: one ``QuantizerSet`` (or ``None``) per GEMM.
      The other arguments: the module docstring.

    Returns:
      ``(..., H)`` in x's dtype.

    Example:
      >>> import jax.numpy as jnp, te_jax
      >>> x = jnp.ones((4, 32), jnp.bfloat16)
      >>> w1, w2 = jnp.full((32, 2, 64), 0.01), jnp.full((64, 32), 0.01)   # gated W1 (H, 2, I)
      >>> out = te_jax.layernorm_mlp(x, jnp.ones((32,)), jnp.zeros((32,)), [w1, w2],
      ...                            [None, None], activation_type=("silu", "linear"))
      >>> out.shape, out.dtype
      ((4, 32), dtype(bfloat16))
    """
    del batch_first
    where = "te_jax.layernorm_mlp"
    if ffn1_ckpt_name != CHECKPOINT_NAMES[0]:
        raise ValueError(
            f"{where}: ffn1_ckpt_name={ffn1_ckpt_name!r} is not supported: the first GEMM's "
            f"residuals are named {CHECKPOINT_NAMES[0]!r} (h), 'ffn1_input' and 'ffn1_kernel' "
            "inside te_jax.fused_mlp; name them so in the remat policy"
        )
    if dot_2_input_axes is not None:
        raise ValueError(
            f"{where}: dot_2_input_axes={tuple(dot_2_input_axes)!r} is not supported: the "
            "intermediate activation lives inside the fused MLP op, split as kernel_1_axes's "
            "'mlp' name says under the logical axis rules"
        )
    if len(kernels) != 2 or len(biases) != 2:
        raise ValueError(
            f"{where}: kernels and biases must each hold the two GEMMs' [first, second], got "
            f"{len(kernels)} kernels and {len(biases)} biases"
        )
    k1, k2 = (jnp.asarray(k) for k in kernels)
    b1, b2 = biases
    if k1.ndim == 3 and k1.shape[1] == 1:  # TE-JAX's non-gated (H, 1, I)
        k1 = k1.reshape(k1.shape[0], k1.shape[2])
        kernel_1_axes = None if kernel_1_axes is None else tuple(kernel_1_axes)[::2]
        if b1 is not None and jnp.ndim(b1) == 2 and jnp.shape(b1)[0] == 1:
            b1 = jnp.reshape(b1, jnp.shape(b1)[1:])
    x = _constrain(jnp.asarray(x), norm_input_axes, where, "norm_input_axes")
    h = _norm(x, gamma, beta, norm_type, zero_centered_gamma, epsilon)
    h = _constrain(h, dot_1_input_axes, where, "dot_1_input_axes")
    out, _ = _mlp_block(
        h,
        k1,
        k2,
        b1,
        b2,
        activation_type=activation_type,
        quantizer_sets=tuple(quantizer_sets),
        kernel_axes=(kernel_1_axes, kernel_2_axes),
        ckpt_name=ffn2_ckpt_name,
    )
    return out
