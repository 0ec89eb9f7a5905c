"""Shared pieces of the quantization tests: the configurations, the input generator, one jitted
runner, and the comparisons against ``quantize_oracle`` (docs/numerics.md §7)."""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

import quantize_oracle as oracle
from te_jax.quantize import (
    CurrentScaleQuantizer,
    DelayedScaleQuantizer,
    MXFP8Quantizer,
    NVFP4Quantizer,
    QuantizeLayout,
    ScaledTensor,
    ScalingMode,
    reference,
)

E4M3, E5M2, E2M1 = oracle.E4M3, oracle.E5M2, oracle.E2M1
RC = QuantizeLayout.ROWWISE_COLWISE
FIELDS = ("data", "scale_inv", "colwise_data", "colwise_scale_inv", "amax", "global_scale_inv")


class Config(NamedTuple):
    mode: ScalingMode
    q_dtype: np.dtype

    def __str__(self):  # pytest ids
        short = {"DELAYED_TENSOR_SCALING": "delayed", "CURRENT_TENSOR_SCALING": "current"}
        return f"{short.get(self.mode.name, self.mode.name.split('_')[0].lower())}-{self.q_dtype}"

    def quantizer(self, layout=RC, scale=None):
        """The quantizer of this configuration (DELAYED: with ``scale``, history of 4)."""
        if self.mode is ScalingMode.DELAYED_TENSOR_SCALING:
            return DelayedScaleQuantizer(
                q_dtype=self.q_dtype,
                q_layout=layout,
                scale=jnp.asarray(1.0 if scale is None else scale, jnp.float32),
                amax_history=jnp.zeros((4,), jnp.float32),
            )
        cls = {
            ScalingMode.CURRENT_TENSOR_SCALING: CurrentScaleQuantizer,
            ScalingMode.MXFP8_1D_SCALING: MXFP8Quantizer,
            ScalingMode.NVFP4_1D_SCALING: NVFP4Quantizer,
        }[self.mode]
        return cls(self.q_dtype, layout)


DELAYED = ScalingMode.DELAYED_TENSOR_SCALING
CURRENT = ScalingMode.CURRENT_TENSOR_SCALING
MXFP8 = ScalingMode.MXFP8_1D_SCALING
NVFP4 = ScalingMode.NVFP4_1D_SCALING
CONFIGS = [
    Config(DELAYED, E4M3),
    Config(DELAYED, E5M2),
    Config(CURRENT, E4M3),
    Config(CURRENT, E5M2),
    Config(MXFP8, E4M3),
    Config(MXFP8, E5M2),
    Config(NVFP4, E2M1),
]
CONFIG_BY_MODE = {c.mode: c for c in reversed(CONFIGS)}  # the default (first) q_dtype per mode

DTYPES = [np.dtype(jnp.float32), np.dtype(jnp.bfloat16), np.dtype(jnp.float16)]
DTYPE_IDS = ["f32", "bf16", "f16"]


def shape_id(shape_nf) -> str:
    shape, nf = shape_nf
    return "x".join(map(str, shape)) + (f"-nf{nf}" if nf != 1 else "")


# --- inputs ---------------------------------------------------------------------------------------


@functools.cache
def grid(q_dtype) -> np.ndarray:
    """Every positive finite value of ``q_dtype`` and every midpoint between neighbours."""
    n = 16 if np.dtype(q_dtype) == E2M1 else 256
    vals = np.arange(n, dtype=np.uint8).view(q_dtype).astype(np.float64)
    vals = np.unique(vals[np.isfinite(vals) & (vals > 0)])
    return np.concatenate([vals, (vals[:-1] + vals[1:]) / 2])


def _tiny(dtype) -> float:
    """A magnitude at the bottom of ``dtype``'s normal range (or below it)."""
    return 1e-38 if np.dtype(dtype) != np.float16 else 2.0**-20


def make_y(rng, shape, dtype, q_dtype, n_feature_axes=1, unit_exp=None):
    """A fresh input for quantization tests, returned in ``dtype`` with the unit ``u = 2^k``.

    Viewed as ``[M, N]``: a mix of exact grid points and midpoints of ``q_dtype`` times ``u``
    (exact ties once scaled by ``1/u``), continuous values over 20 octaves below ``Q·u``,
    zeros, and values in ``dtype``'s subnormal range. ``±Q·u`` sits in every 32nd row and
    column, so every 16/32-block along either direction has amax ``Q·u`` (MXFP8 exponent ``k``,
    current scale ``1/u``) except: one all-zero row and one all-zero column (zero blocks both
    ways), one row and one column of tiny values (tiny-amax blocks both ways).
    """
    dtype = np.dtype(dtype)
    q = oracle.Q_MAX[np.dtype(q_dtype)]
    k = int(rng.integers(-6, 1)) if unit_exp is None else unit_exp
    u = 2.0**k
    lead = shape[: len(shape) - n_feature_axes]
    m, n = math.prod(lead), math.prod(shape[len(shape) - n_feature_axes :])
    size = m * n
    sign = rng.choice([-1.0, 1.0], size)
    kind = rng.choice(4, size, p=[0.35, 0.35, 0.15, 0.15])
    fin = ml_dtypes.finfo(dtype)
    sub_lo, sub_hi = np.log2(float(fin.smallest_subnormal)), np.log2(float(fin.smallest_normal))
    y = np.select(
        [kind == 0, kind == 1, kind == 2],
        [
            rng.choice(grid(q_dtype), size) * u,
            q * u * 2.0 ** rng.uniform(-20, 0, size),
            0.0,
        ],
        2.0 ** rng.uniform(sub_lo, sub_hi, size),
    )
    y = (sign * y).reshape(m, n)
    y[:, ::32] = rng.choice([-q * u, q * u], (m, len(range(0, n, 32))))
    y[::32, :] = rng.choice([-q * u, q * u], (len(range(0, m, 32)), n))
    tiny = _tiny(dtype)
    if m > 2:
        y[1, :] = 0.0
        y[2, :] = rng.choice([-1, 1], n) * tiny * rng.uniform(0.5, 1.0, n)
    if n > 2:
        y[:, 1] = 0.0
        y[:, 2] = rng.choice([-1, 1], m) * tiny * rng.uniform(0.5, 1.0, m)
    y.reshape(-1)[0] = q * u  # never all zeros
    out = y.reshape(shape).astype(dtype)
    assert np.isfinite(out.astype(np.float64)).all()
    assert np.abs(out.astype(np.float64)).max() == q * u
    return out, u


# --- the runner -----------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames="n_feature_axes")
def quantize_batch(ys, quantizers, n_feature_axes=1):
    """``reference.quantize`` mapped over a stack of inputs (and of quantizers), then each
    result dequantized: one compilation per configuration and shape."""

    def one(y, q):
        t = reference.quantize(y, q, n_feature_axes=n_feature_axes)
        return t, t.dequantize()

    return jax.vmap(one)(ys, quantizers)


def stack(quantizers):
    return jax.tree.map(lambda *a: jnp.stack(a), *quantizers)


def unstack(tree, i):
    return jax.tree.map(lambda a: a[i], tree)


# --- comparisons ----------------------------------------------------------------------------------


def to_np(a):
    return None if a is None else np.asarray(a)


def assert_same_bits(got: ScaledTensor, want: dict, what=""):
    """Every field of ``got`` bit-identical to the oracle's (NaN patterns included)."""
    for name in FIELDS:
        g, w = to_np(getattr(got, name)), want[name]
        if w is None:
            assert g is None, f"{what}: {name} should be None"
            continue
        assert g is not None, f"{what}: {name} missing"
        assert g.dtype == w.dtype, f"{what}: {name} dtype {g.dtype}, want {w.dtype}"
        assert g.shape == w.shape, f"{what}: {name} shape {g.shape}, want {w.shape}"
        gb, wb = oracle.raw_bits(g), oracle.raw_bits(w)
        if not np.array_equal(gb, wb):
            bad = np.argwhere(gb != wb)
            i = tuple(bad[0])
            raise AssertionError(
                f"{what}: {name}: {len(bad)} of {gb.size} differ; first at {i}: got "
                f"{g[i]!r} (bits {gb[i]:#x}), want {w[i]!r} (bits {wb[i]:#x})"
            )


def format_ulp(v, q_dtype) -> np.ndarray:
    """The spacing of ``q_dtype`` at magnitude ``|v|`` (its subnormal spacing below normal)."""
    fi = ml_dtypes.finfo(q_dtype)
    a = np.abs(np.asarray(v, np.float64))
    with np.errstate(divide="ignore"):
        ex = np.floor(np.log2(np.where(a > 0, a, 1.0)))
    ex = np.maximum(np.where(a > 0, ex, fi.minexp), fi.minexp)
    return 2.0 ** (ex - fi.nmant)


def dq_tol(dtype) -> float:
    """One rounding to ``dtype`` (relative)."""
    return float(ml_dtypes.finfo(dtype).eps)
