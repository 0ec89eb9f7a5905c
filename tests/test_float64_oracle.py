"""Self-checks of the float64 oracle (no te_jax): its derivatives are the derivatives of its
forwards, a few values by hand, and the gated rule and clamps exactly as docs/numerics.md §1
writes them."""

from __future__ import annotations

import math

import numpy as np
import pytest

import float64_oracle as oracle
from helpers import ACTS, Act


@pytest.mark.parametrize("act", ACTS, ids=str)
def test_derivative_is_derivative_of_forward(act: Act, rng):
    params = oracle.ClampedParams(limit=0.75, alpha=1.5, glu_linear_offset=0.5)
    _, fn, lin = oracle.ACTIVATIONS[act.enum]
    x = rng.uniform(-4, 4, size=2000)
    for k in oracle.kinks(act.enum, params):
        x = x[np.abs(x - k) > 1e-3]
    h = 1e-6
    for half in [fn] + ([lin] if lin is not None else []):
        f_plus, _ = half(x + h, params)
        f_minus, _ = half(x - h, params)
        _, df = half(x, params)
        np.testing.assert_allclose((f_plus - f_minus) / (2 * h), df, rtol=1e-6, atol=1e-8)


def test_values_by_hand():
    x = np.array([1.0])
    t = math.tanh(0.7978845608028654 * (1 + 0.044715))
    assert oracle.gelu(x)[0][0] == pytest.approx(0.5 * (1 + t), rel=1e-15)
    assert oracle.gelu_exact(x)[0][0] == pytest.approx(0.8413447460685429, rel=1e-14)
    assert oracle.silu(x)[0][0] == pytest.approx(1 / (1 + math.exp(-1)), rel=1e-15)
    assert oracle.quick_gelu(x)[0][0] == pytest.approx(1 / (1 + math.exp(-1.702)), rel=1e-7)
    assert oracle.sigmoid_act(np.array([0.0]))[0][0] == 0.5
    assert oracle.sigmoid_act(np.array([0.0]))[1][0] == 0.25
    np.testing.assert_array_equal(oracle.relu(np.array([-1.0, 0.0, 2.0]))[1], [0, 0, 1])
    np.testing.assert_array_equal(oracle.squared_relu(np.array([-1.0, 0.0, 3.0]))[0], [0, 0, 9])
    np.testing.assert_array_equal(oracle.squared_relu(np.array([-1.0, 0.0, 3.0]))[1], [0, 0, 6])
    # Large |x| stays finite.
    for fn in (oracle.gelu, oracle.silu, oracle.quick_gelu, oracle.sigmoid_act, oracle.gelu_exact):
        f, df = fn(np.array([-1e4, 1e4]))
        assert np.isfinite(f).all() and np.isfinite(df).all()


def test_gated_rule_and_layout():
    # x of shape (1, 2, 3): a = x[..., 0, :], b = x[..., 1, :]
    a = np.array([0.5, -1.0, 2.0])
    b = np.array([3.0, 0.25, -2.0])
    x = np.stack([a, b])[None]
    g = np.array([[1.0, -2.0, 0.5]])
    f, df = oracle.silu(a)
    np.testing.assert_allclose(oracle.act_lu(x, 4), (f * b)[None])
    dx = oracle.dact_lu(g, x, 4)
    assert dx.shape == x.shape
    np.testing.assert_allclose(dx[0, 0], df * g[0] * b)
    np.testing.assert_allclose(dx[0, 1], f * g[0])
    np.testing.assert_allclose(oracle.dbias(dx, True), dx[0])


def test_clamped_swiglu_edges():
    p = oracle.ClampedParams(limit=0.75, alpha=1.5, glu_linear_offset=0.5)
    a = np.array([-2.0, 0.75, 0.8, 5.0])
    f, df = oracle.clamped_silu(a, p)
    s = 1 / (1 + np.exp(-1.5 * 0.75))
    assert f[1] == pytest.approx(0.75 * s) and f[2] == f[1] and f[3] == f[1]  # clamped above
    assert f[0] == pytest.approx(-2.0 / (1 + math.exp(3.0)))  # not clamped below
    assert df[1] > 0 and df[2] == 0 and df[3] == 0  # a == limit still has the gradient
    b = np.array([-1.0, -0.75, 0.0, 0.75, 1.0])
    v, dv = oracle.clamped_linear(b, p)
    np.testing.assert_allclose(v, [-0.25, -0.25, 0.5, 1.25, 1.25])
    np.testing.assert_array_equal(dv, [0, 1, 1, 1, 0])  # inclusive bounds
    # Defaults: limit 7, alpha 1.702, offset 1.
    assert oracle.clamped_params(None) == (7.0, float(np.float32(1.702)), 1.0)


def test_non_finite_rules():
    """docs/numerics.md §1: every half is NaN at NaN (value and derivative) and gives its limit at
    +-inf."""
    p = oracle.ClampedParams()
    x = np.array([np.nan, np.inf, -np.inf])
    halves = [fn for _, fn, _ in oracle.ACTIVATIONS.values()] + [
        oracle.identity,
        oracle.clamped_linear,
    ]
    for half in halves:
        f, df = half(x, p)
        assert np.isnan(f[0]) and np.isnan(df[0]), half.__name__
        assert not np.isnan(f[1:]).any() and not np.isnan(df[1:]).any(), half.__name__
    s7 = 1 / (1 + math.exp(-p.alpha * p.limit))
    limits = {  # half: (f(+inf), f'(+inf), f(-inf), f'(-inf))
        oracle.gelu: (np.inf, 1, 0, 0),
        oracle.gelu_exact: (np.inf, 1, 0, 0),
        oracle.sigmoid_act: (1, 0, 0, 0),
        oracle.silu: (np.inf, 1, 0, 0),
        oracle.quick_gelu: (np.inf, 1, 0, 0),
        oracle.relu: (np.inf, 1, 0, 0),
        oracle.squared_relu: (np.inf, np.inf, 0, 0),
        oracle.clamped_silu: (p.limit * s7, 0, 0, 0),
        oracle.identity: (np.inf, 1, -np.inf, 1),
        oracle.clamped_linear: (8, 0, -6, 0),
    }
    for half, (fp, dfp, fn_, dfn) in limits.items():
        f, df = half(x[1:], p)
        np.testing.assert_allclose([f[0], df[0], f[1], df[1]], [fp, dfp, fn_, dfn], rtol=1e-12)
