"""ActivationType and its names (docs/numerics.md §1), ActivationParams / ClampedSwiGLUParams
(frozen, hashable, static under jit), and clamped SwiGLU with default and non-default parameters."""

from __future__ import annotations

import dataclasses
import enum
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import float64_oracle as oracle
import te_jax
from helpers import (
    ACT_BY_ALIAS,
    ACTS,
    DTYPE_IDS,
    DTYPES,
    Act,
    assert_dbias_matches,
    assert_matches,
    cpp_activations,
    dz_shape,
    make_dz,
    make_x,
    tol,
)

CLAMPED = ACT_BY_ALIAS["clamped_swiglu"]


def test_enum_values_and_order():
    assert issubclass(te_jax.ActivationType, enum.IntEnum)
    assert [(m.name, int(m)) for m in te_jax.ActivationType] == [(a.name, a.enum) for a in ACTS]


def _spellings(act: Act):
    spellings = [act.names, act.alias, getattr(te_jax.ActivationType, act.name)]
    if not act.gated:
        spellings.append(act.names[0])  # ("gelu",) and "gelu"
    return spellings


@pytest.mark.parametrize("act", ACTS, ids=str)
def test_every_spelling_names_the_same_activation(act, rng):
    """The tuple, the single-string name and the enum select the same kernel (same bits)."""
    shape = (3, 2, 17) if act.gated else (3, 17)
    x = jnp.asarray(make_x(rng, shape, jnp.float32, act))
    dz = jnp.asarray(make_dz(rng, dz_shape(shape, act), jnp.float32))
    outs = []
    for spelling in _spellings(act):
        y = te_jax.act_lu(x, activation_type=spelling)
        dx, dbias = te_jax.quantize_dact_dbias(dz, x, activation_type=spelling)
        outs.append((spelling, np.asarray(y), np.asarray(dx), np.asarray(dbias)))
    first = outs[0]
    assert first[1].shape == dz_shape(shape, act)  # gated (..., 2, H) -> (..., H)
    assert_matches(first[1], oracle.act_lu(x, act.enum), jnp.float32, act)
    for spelling, y, dx, dbias in outs[1:]:
        for a, b in zip(first[1:], (y, dx, dbias), strict=True):
            np.testing.assert_array_equal(a, b, err_msg=f"{spelling!r} vs {first[0]!r}")


@pytest.mark.parametrize(
    "spelling",
    [
        "SiLU",
        "GELU",
        "Squared_ReLU",
        "SwiGLU",
        ("SiLU", "Linear"),
        ("CLAMPED_SILU", "Clamped_Linear"),
    ],
    ids=str,
)
def test_names_are_case_insensitive(spelling):
    """docs/numerics.md §1: names are case-insensitive; a mixed-case name is the lower-case
    one's activation (the same member, the same bits)."""
    lower = spelling.lower() if isinstance(spelling, str) else tuple(n.lower() for n in spelling)
    act = te_jax.ActivationType.parse(spelling)
    assert act is te_jax.ActivationType.parse(lower)
    shape = (3, 2, 8) if act.is_gated else (3, 8)
    x = jnp.linspace(-3, 3, math.prod(shape), dtype=jnp.float32).reshape(shape)
    y = te_jax.act_lu(x, activation_type=spelling)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(te_jax.act_lu(x, lower)))
    with pytest.raises(ValueError, match="silu"):  # a misspelling is not another activation
        te_jax.ActivationType.parse("SiLUx")


# --- ActivationParams ----------------------------------------------------------------------------


def test_params_defaults_frozen_hashable():
    p = te_jax.ClampedSwiGLUParams()
    assert (p.limit, p.alpha, p.glu_linear_offset) == (7.0, 1.702, 1.0)
    assert te_jax.ActivationParams().clamped_swiglu is None
    a = te_jax.ActivationParams(
        clamped_swiglu=te_jax.ClampedSwiGLUParams(limit=7.0, alpha=1.702, glu_linear_offset=1.0)
    )
    b = te_jax.ActivationParams(clamped_swiglu=te_jax.ClampedSwiGLUParams())
    assert a == b and hash(a) == hash(b)
    c = te_jax.ActivationParams(clamped_swiglu=te_jax.ClampedSwiGLUParams(limit=0.75))
    assert a != c
    assert len({a, b, c}) == 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.clamped_swiglu = None
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.limit = 1.0
    assert dataclasses.replace(p, limit=2.0).limit == 2.0 and p.limit == 7.0


def test_params_are_static_jit_arguments(rng):
    """ActivationParams is a static argument; different values recompile, equal ones do not."""
    traces = []

    @functools.partial(jax.jit, static_argnames="act_params")
    def f(x, act_params):
        traces.append(act_params)
        return te_jax.act_lu(x, activation_type="clamped_swiglu", act_params=act_params)

    x = make_x(rng, (4, 2, 16), jnp.float32, CLAMPED, te_jax.ClampedSwiGLUParams(limit=1.0))
    xj = jnp.asarray(x)
    p1 = te_jax.ActivationParams(clamped_swiglu=te_jax.ClampedSwiGLUParams(limit=1.0, alpha=1.5))
    p1_again = te_jax.ActivationParams(
        clamped_swiglu=te_jax.ClampedSwiGLUParams(limit=1.0, alpha=1.5)
    )
    p2 = te_jax.ActivationParams(clamped_swiglu=te_jax.ClampedSwiGLUParams(limit=2.0, alpha=1.5))
    y1 = f(xj, act_params=p1)
    y1_again = f(xj, act_params=p1_again)
    y2 = f(xj, act_params=p2)
    assert len(traces) == 2, traces
    np.testing.assert_array_equal(np.asarray(y1), np.asarray(y1_again))
    assert_matches(y1, oracle.act_lu(x, CLAMPED.enum, p1), jnp.float32, CLAMPED)
    assert_matches(y2, oracle.act_lu(x, CLAMPED.enum, p2), jnp.float32, CLAMPED)
    assert not np.array_equal(np.asarray(y1), np.asarray(y2))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_clamped_swiglu_none_means_defaults(dtype, rng):
    x = make_x(rng, (6, 2, 40), dtype, CLAMPED)  # ±9: beyond the default limit 7
    assert (np.abs(x.astype(np.float64)) > 7).any()
    dz = make_dz(rng, (6, 40), dtype)
    xj, dzj = jnp.asarray(x), jnp.asarray(dz)
    defaults = te_jax.ActivationParams(clamped_swiglu=te_jax.ClampedSwiGLUParams())
    y_none = te_jax.act_lu(xj, activation_type="clamped_swiglu")
    y_def = te_jax.act_lu(xj, activation_type="clamped_swiglu", act_params=defaults)
    np.testing.assert_array_equal(np.asarray(y_none), np.asarray(y_def))
    assert_matches(y_none, oracle.act_lu(x, CLAMPED.enum), dtype, CLAMPED)
    dx, dbias = te_jax.quantize_dact_dbias(dzj, xj, activation_type="clamped_swiglu")
    dx64 = oracle.dact_lu(dz, x, CLAMPED.enum)
    assert_matches(dx, dx64, dtype, CLAMPED)
    assert_dbias_matches(dbias, dx64, True, dtype, CLAMPED)


LIMIT, ALPHA, OFFSET = 0.75, 1.5, 0.5


@pytest.mark.parametrize("impl", ["ffi", "xla"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_clamped_swiglu_across_the_clamps(dtype, impl):
    """Non-default parameters; a and b on every side of, and exactly at, ±limit."""
    params = te_jax.ActivationParams(
        clamped_swiglu=te_jax.ClampedSwiGLUParams(
            limit=LIMIT, alpha=ALPHA, glu_linear_offset=OFFSET
        )
    )
    grid = np.array([-3.0, -1.0, -0.75, -0.5, -0.125, 0.0, 0.25, 0.75, 0.875, 2.5])
    a, b = np.meshgrid(grid, grid, indexing="ij")  # every (a, b) pair
    x = np.stack([a.ravel(), b.ravel()], axis=-2)[None].astype(np.dtype(jnp.dtype(dtype)))
    dz = np.linspace(-1.5, 2.0, a.size)[None].astype(x.dtype)
    kw = dict(
        activation_type=("clamped_silu", "clamped_linear"), act_params=params, implementation=impl
    )
    y = te_jax.act_lu(jnp.asarray(x), **kw)
    dx, dbias = te_jax.quantize_dact_dbias(jnp.asarray(dz), jnp.asarray(x), **kw)
    assert_matches(y, oracle.act_lu(x, CLAMPED.enum, params), dtype, CLAMPED)
    dx64 = oracle.dact_lu(dz, x, CLAMPED.enum, params)
    assert_matches(dx, dx64, dtype, CLAMPED)
    assert_dbias_matches(dbias, dx64, True, dtype, CLAMPED)
    # The rules themselves, on the kernel's output: no gradient to a above the limit, none to b
    # outside [-limit, limit] (bounds inclusive), the offset applied to b.
    dxn = np.asarray(dx, np.float64)[0]
    a_in, b_in = x[0, 0].astype(np.float64), x[0, 1].astype(np.float64)
    assert (dxn[0][a_in > LIMIT] == 0).all()
    assert (dxn[1][np.abs(b_in) > LIMIT] == 0).all()
    inside = (a_in == LIMIT) & (b_in == -LIMIT)  # f(a) > 0, b' = -0.25: both gradients live
    assert (dxn[0][inside] != 0).all() and (dxn[1][inside] != 0).all()
    at_zero_b = (b_in == 0) & (a_in == 0.25)
    f025 = 0.25 / (1 + np.exp(-ALPHA * 0.25))
    t = tol(dtype, CLAMPED)
    np.testing.assert_allclose(
        np.asarray(y, np.float64)[0][at_zero_b], f025 * OFFSET, rtol=t, atol=t
    )


def test_declarations_match_the_cpp_list():
    """The Python declaration of each activation and the C++ list in
    ffi/activation/activations.h agree (the enum value is the FFI act_enum; gated or not), and
    so does the standalone quantize's IDENTITY."""
    from te_jax.activation_types import IDENTITY_ACT_ENUM

    cpp = cpp_activations()
    assert cpp.pop("IDENTITY") == (IDENTITY_ACT_ENUM, False)
    assert cpp == {a.name: (int(a), a.is_gated) for a in te_jax.ActivationType}


def test_names_derive_from_the_declarations():
    """Every component tuple and every single-string name parses back to its activation."""
    for act in te_jax.ActivationType:
        assert te_jax.ActivationType.parse(act.names) is act
        assert act.is_gated == (len(act.names) == 2) and act.act_len == len(act.names)
        for name in act._single_names:
            assert te_jax.ActivationType.parse(name) is act


def print_form(value) -> str:
    """What print(value) writes."""
    import io

    buf = io.StringIO()
    print(value, file=buf, end="")
    return buf.getvalue()


def test_enums_print_their_names():
    """print(ActivationType.SWIGLU) shows the name, not 4 (IntEnum's str since Python 3.11), in
    str, format and f-strings alike; the value still compares and converts as an integer."""
    from te_jax.quantize import QuantizeLayout, ScalingMode

    a = te_jax.ActivationType.SWIGLU
    assert str(a) == f"{a}" == "ActivationType.SWIGLU"
    assert print_form(a) == "ActivationType.SWIGLU"
    assert a == 4 and int(a) == 4 and np.int64(a) == 4
    assert str(ScalingMode.NVFP4_1D_SCALING) == "ScalingMode.NVFP4_1D_SCALING"
    assert f"{QuantizeLayout.ROWWISE:>25}" == "   QuantizeLayout.ROWWISE"
