"""Shared test helpers: the activation table, dtypes, docs/numerics.md §7 tolerances, random inputs
and comparisons against the float64 oracle. Imports nothing from te_jax (the sharded subprocess and
the oracle self-test use it too)."""

from __future__ import annotations

import contextlib
import re
from typing import NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

import float64_oracle as oracle


class Act(NamedTuple):
    enum: int  # docs/numerics.md §1 enum value
    name: str  # te_jax.ActivationType member name
    names: tuple[str, ...]  # TE's tuple form
    alias: str  # the single-string name
    gated: bool

    def __str__(self):  # pytest ids
        return self.alias


ACTS = [
    Act(0, "GELU", ("gelu",), "gelu", False),
    Act(1, "GEGLU", ("gelu", "linear"), "geglu", True),
    Act(2, "GLU", ("sigmoid", "linear"), "glu", True),
    Act(3, "SILU", ("silu",), "silu", False),
    Act(4, "SWIGLU", ("silu", "linear"), "swiglu", True),
    Act(5, "RELU", ("relu",), "relu", False),
    Act(6, "REGLU", ("relu", "linear"), "reglu", True),
    Act(7, "QGELU", ("quick_gelu",), "quick_gelu", False),
    Act(8, "QGEGLU", ("quick_gelu", "linear"), "qgeglu", True),
    Act(9, "SRELU", ("squared_relu",), "squared_relu", False),
    Act(10, "SREGLU", ("squared_relu", "linear"), "sreglu", True),
    Act(11, "CLAMPED_SWIGLU", ("clamped_silu", "clamped_linear"), "clamped_swiglu", True),
    Act(12, "GELU_EXACT", ("gelu_exact",), "gelu_exact", False),
    Act(13, "GEGLU_EXACT", ("gelu_exact", "linear"), "geglu_exact", True),
]
ACT_BY_ALIAS = {a.alias: a for a in ACTS}
assert all(oracle.is_gated(a.enum) == a.gated for a in ACTS)
assert all(oracle.ACTIVATIONS[a.enum][0] == a.name for a in ACTS)

# A small representative subset for the expensive transformation tests.
SOME_ACTS = [ACT_BY_ALIAS[n] for n in ("gelu", "swiglu", "clamped_swiglu", "squared_relu", "glu")]

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
DTYPE_IDS = ["f32", "bf16", "f16"]

# Non-multiples of any vector width, size-1 and empty axes, no leading axis at all.
NONGATED_SHAPES = [(3, 7, 33), (1, 1), (0, 16), (2, 0, 8), (33,), (4, 0)]
GATED_SHAPES = [(5, 2, 9), (4, 1, 2, 33), (1, 2, 1), (0, 2, 8), (2, 33), (3, 0, 2, 5)]


def shapes_for(act: Act):
    return GATED_SHAPES if act.gated else NONGATED_SHAPES


def shape_id(shape) -> str:
    return "x".join(map(str, shape)) if shape else "scalar"


def dz_shape(x_shape, act: Act):
    return tuple(x_shape[:-2]) + tuple(x_shape[-1:]) if act.gated else tuple(x_shape)


def np_dtype(dtype) -> np.dtype:
    return np.dtype(jnp.dtype(dtype))


# --- docs/numerics.md §7 tolerances ------------------------------------------------------------

_TRANSCENDENTAL_FORMS = {"GELU", "GEGLU", "GELU_EXACT", "GEGLU_EXACT"}


def tol(dtype, act: Act | None = None) -> float:
    """rtol == atol of docs/numerics.md §7 for an output of ``dtype``."""
    dt = jnp.dtype(dtype)
    if dt == jnp.float32:
        return 2e-5 if act is not None and act.name in _TRANSCENDENTAL_FORMS else 1e-5
    if dt == jnp.bfloat16:
        return 2.0**-7
    if dt == jnp.float16:
        return 2.0**-10
    if dt == jnp.float64:
        return 1e-10
    raise ValueError(dt)


def unit_roundoff(dtype) -> float:
    return float(ml_dtypes.finfo(np_dtype(dtype)).eps) / 2


def round_to(ref64, dtype) -> np.ndarray:
    """The float64 reference rounded to ``dtype`` (and back to float64 for comparison)."""
    return np.asarray(ref64, np.float64).astype(np_dtype(dtype)).astype(np.float64)


def assert_matches(actual, ref64, dtype, act: Act | None = None, *, scale: float = 1.0, what=""):
    """``actual`` (an array of ``dtype``) against the float64 reference, docs/numerics.md §7."""
    actual = np.asarray(actual)
    ref64 = np.asarray(ref64, np.float64)
    assert actual.dtype == np_dtype(dtype), f"{what}: dtype {actual.dtype}, want {np_dtype(dtype)}"
    assert actual.shape == ref64.shape, f"{what}: shape {actual.shape}, want {ref64.shape}"
    got = actual.astype(np.float64)
    assert not np.isnan(ref64).any(), f"{what}: the reference has NaN (bad test input)"
    assert not np.isnan(got).any(), f"{what}: NaN in the result"
    t = tol(dtype, act) * scale
    np.testing.assert_allclose(got, round_to(ref64, dtype), rtol=t, atol=t, err_msg=what)


def dbias_bound(dx64, gated: bool, dtype, act: Act | None = None, scale: float = 1.0):
    """Allowed |dbias - Σdx| per feature column, for a float32 sum returned in ``dtype``.

    The final rounding to ``dtype`` (tol·|ref|), the error of each summed term (each dx term is
    within tol of the exact value: tol·Σ|dx|), and float32 accumulation over the ``n`` summed rows
    (n·2^-24·Σ|dx|, a worst-case bound).
    """
    dx64 = np.asarray(dx64, np.float64)
    n_feature = 2 if gated else 1
    ref = oracle.dbias(dx64, gated)
    mag = oracle.dbias_abs(dx64, gated)
    n = int(np.prod(dx64.shape[:-n_feature], dtype=np.int64))
    t = tol(dtype, act)
    return scale * (t * np.abs(ref) + (t + n * 2.0**-24) * mag + t)


def assert_dbias_matches(dbias, dx64, gated: bool, dtype, act: Act | None = None, what="dbias"):
    """dbias (the float32 sum of dx, returned in ``dtype``) against the float64 sum of dx64."""
    dbias = np.asarray(dbias)
    dx64 = np.asarray(dx64, np.float64)
    want_shape = dx64.shape[-(2 if gated else 1) :]
    assert dbias.shape == want_shape, f"{what}: shape {dbias.shape}, want {want_shape}"
    assert dbias.dtype == np_dtype(dtype), f"{what}: dtype {dbias.dtype}, want {np_dtype(dtype)}"
    got = dbias.astype(np.float64)
    assert not np.isnan(got).any(), f"{what}: NaN"
    assert_within(got, oracle.dbias(dx64, gated), dbias_bound(dx64, gated, dtype, act), what)


def assert_within(got, want, bound, what=""):
    err = np.abs(np.asarray(got, np.float64) - np.asarray(want, np.float64))
    bound = np.broadcast_to(np.asarray(bound, np.float64), err.shape)
    bad = ~(err <= bound)
    if bad.any():
        i = np.unravel_index(np.argmax(np.where(bad, err - bound, -np.inf)), err.shape)
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {bad.size} elements off; worst at {i}: got "
            f"{np.asarray(got)[i]}, want {np.asarray(want)[i]}, allowed error {bound[i]}"
        )


# --- random inputs --------------------------------------------------------------------------------


def input_range(act: Act, params=None) -> float:
    if act.name == "CLAMPED_SWIGLU":
        return oracle.clamped_params(params).limit + 2.0  # both sides of both clamps
    return 4.0


def edge_values(act: Act, params=None) -> list[float]:
    edges = [0.0, 1.0, -1.0, 0.5, -0.5, 2.0, -3.0]
    edges += [float(k) for k in oracle.kinks(act.enum, params)]
    return edges


def make_x(rng, shape, dtype, act: Act, params=None, *, edges=True, kink_margin=0.0):
    """A fresh input of ``shape``: uniform over both signs, beyond the clamps for clamped SwiGLU,
    with exact edge values (0, ±limit, ...) sprinkled in unless ``edges`` is False.

    ``kink_margin`` > 0 keeps every element at least that far from each kink of ``act`` (for
    finite differences and comparisons with ``jax.grad`` of ``minimum``/``clip``, which give half
    gradients at ties)."""
    r = input_range(act, params)
    x = rng.uniform(-r, r, size=shape)
    if x.size:
        if edges:
            mask = rng.random(shape) < 0.15
            x[mask] = rng.choice(edge_values(act, params), size=int(mask.sum()))
        flat = x.reshape(-1)
        flat[0] = 1.25  # never all zeros (nor all negative: relu would be all zeros)
        if flat.size > 1:
            flat[-1] = -0.75
    if kink_margin > 0:
        for k in oracle.kinks(act.enum, params):
            near = np.abs(x - k) < kink_margin
            side = np.where(x >= k, 1.0, -1.0)
            x = np.where(near, k + side * 3 * kink_margin, x)
    out = x.astype(np_dtype(dtype))
    if kink_margin > 0:
        for k in oracle.kinks(act.enum, params):
            assert (np.abs(out.astype(np.float64) - k) >= kink_margin / 2).all()
    return out


def make_dz(rng, shape, dtype):
    dz = rng.uniform(-2.0, 2.0, size=shape)
    if dz.size:
        dz.reshape(-1)[0] = 1.5
    return dz.astype(np_dtype(dtype))


# --- misc -----------------------------------------------------------------------------------------

TE_CALL_RE = re.compile(r'custom_call_target="(te_jax_[A-Za-z0-9_]+)"')


def te_jax_custom_calls(compiled_text: str) -> list[str]:
    """te_jax FFI targets called in an optimized HLO module's text."""
    return TE_CALL_RE.findall(compiled_text)


def sharded_devices(n: int = 8) -> np.ndarray:
    """The first ``n`` devices for tests/sharded's checks; skips the module without them, or
    fails where tests/test_sharding.py asked for them (TE_JAX_SHARDED_SUBPROCESS)."""
    import os

    import pytest

    if len(jax.devices()) < n:
        if os.environ.get("TE_JAX_SHARDED_SUBPROCESS"):
            raise RuntimeError(f"{n} devices were asked for, jax has {jax.devices()}")
        pytest.skip(
            f"needs {n} devices (XLA_FLAGS=--xla_force_host_platform_device_count={n})",
            allow_module_level=True,
        )
    return np.array(jax.devices()[:n])


_ARRAY_RE = re.compile(r"[a-z0-9]+\[([0-9,]*)\]")


def hlo_collectives(text: str) -> list[tuple[str, tuple[int, ...]]]:
    """``(kind, result shape)`` of each collective in a compiled HLO module's text, a combined
    (tuple) collective once per element."""
    from te_jax.testing import hlo_collectives as parse  # here: this module imports no te_jax

    out = []
    for op, result_type, _ in parse(text):
        for dims in _ARRAY_RE.findall(result_type):
            out.append((op, tuple(int(d) for d in dims.split(",") if d)))
    return out


@contextlib.contextmanager
def enable_x64():
    """float64 enabled inside the block, restored after (across jax versions)."""
    if hasattr(jax, "enable_x64"):
        with jax.enable_x64(True):
            yield
        return
    try:
        from jax.experimental import enable_x64 as _ctx  # older jax
    except ImportError:  # pragma: no cover
        old = jax.config.jax_enable_x64
        jax.config.update("jax_enable_x64", True)
        try:
            yield
        finally:
            jax.config.update("jax_enable_x64", old)
        return
    with _ctx():
        yield


# --- quantized outputs --------------------------------------------------------------------------

# (mode, q_dtype) of every scaled format the kernels emit.
QUANT_MODES = [
    ("delayed", jnp.float8_e4m3fn),
    ("delayed", jnp.float8_e5m2),
    ("current", jnp.float8_e4m3fn),
    ("current", jnp.float8_e5m2),
    ("mxfp8", jnp.float8_e4m3fn),
    ("mxfp8", jnp.float8_e5m2),
    ("nvfp4", jnp.float4_e2m1fn),
]

# The array fields of a ScaledTensor (None where the mode / layout has none).
SCALED_TENSOR_FIELDS = (
    "data",
    "colwise_data",
    "scale_inv",
    "colwise_scale_inv",
    "amax",
    "global_scale_inv",
)


def _ffi_header(path: str) -> str:
    import pathlib

    return (pathlib.Path(__file__).parents[1] / "ffi" / path).read_text()


def cpp_enum(header: str, name: str) -> dict[str, int]:
    """``{member: value}`` of ``enum class name`` in ``ffi/<header>``, parsed as text (the
    extension exposes no enum tables): the declarations the Python enums must agree with."""
    import re

    body = re.search(r"enum class " + name + r"\b[^{]*\{(.*?)\};", _ffi_header(header), re.S)
    assert body, f"enum class {name} not found in {header}"
    return {m: int(v) for m, v in re.findall(r"^\s*(\w+)\s*=\s*(\d+)\s*,", body.group(1), re.M)}


def cpp_activations() -> dict[str, tuple[int, bool]]:
    """``{name: (act_enum, gated)}`` of the C++ activation list ``TE_JAX_ACTIVATIONS`` in
    ``ffi/activation/activations.h`` (its ``X(name, value, Act, Lin, gated)`` entries)."""
    import re

    text = _ffi_header("activation/activations.h")
    entries = re.findall(r"X\((\w+),\s*(\d+),\s*\w+,\s*\w+,\s*(true|false)\)", text)
    assert entries, "TE_JAX_ACTIVATIONS not found in ffi/activation/activations.h"
    return {n: (int(v), g == "true") for n, v, g in entries}
