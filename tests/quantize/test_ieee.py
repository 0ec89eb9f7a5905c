"""te_jax.quantize.ieee: float32 arithmetic bit-identical to NumPy's IEEE float32 (which keeps
subnormals), although XLA:CPU flushes them in compiled code."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from te_jax.quantize import ieee

F32 = np.float32


def random_floats(rng, n):
    """Random bit patterns, a third of them subnormal and a third near the bottom of the normal
    range, plus the special values."""
    u = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)
    kind = rng.integers(0, 3, n)
    u = np.where(kind == 0, u & np.uint32(0x807FFFFF), u)  # subnormal (or zero)
    u = np.where(kind == 1, u & np.uint32(0x81FFFFFF), u)  # exponent field 0..3
    special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-45, -1e-45], F32)
    return np.concatenate([u.view(F32), special])


def same_bits(got, want):
    got, want = np.asarray(got, F32), np.asarray(want, F32)
    return (got.view(np.uint32) == want.view(np.uint32)) | (np.isnan(got) & np.isnan(want))


def assert_same(got, want, a, b=None):
    ok = same_bits(got, want)
    if not ok.all():
        i = int(np.argmin(ok))
        extra = "" if b is None else f", {b[i]!r}"
        raise AssertionError(
            f"{int((~ok).sum())} differ; e.g. ({a[i]!r}{extra}): got {np.asarray(got)[i]!r}, "
            f"want {want[i]!r}"
        )


def test_subnormal_products_survive_xla_flushing():
    """Why this module exists: XLA:CPU reads subnormal operands as zero (``1e-40 * 1e30`` gives
    0 in plain jnp), ``ieee.mul`` does not."""
    x = np.array([1e-40, -3e-41], F32)
    want = x * F32(1e30)
    assert_same(jax.jit(lambda v: ieee.mul(v, F32(1e30)))(x), want, x)


def test_div_is_correctly_rounded(rng):
    a, b = random_floats(rng, 60000), random_floats(rng, 60000)[::-1].copy()
    with np.errstate(all="ignore"):
        want = a / b
    assert_same(jax.jit(ieee.div)(a, b), want, a, b)


@pytest.mark.parametrize("platform, barriers", [("cpu", 5), ("cuda", 0)])
def test_div_fusion_barriers_only_on_cpu(platform, barriers):
    """The long division's optimisation barriers hold XLA:CPU's compile time down; on the GPU
    each would be a kernel launch, so a CUDA lowering has none."""
    x = jnp.ones((4,), jnp.float32)
    text = jax.jit(ieee.div).trace(x, x).lower(lowering_platforms=(platform,)).as_text()
    assert text.count("stablehlo.optimization_barrier") == barriers


@pytest.mark.parametrize("divisor", [2.0, -4.0, 0.5, 6.0, 3.0, 1.5, 448.0])
def test_div_ties_in_the_subnormal_range(divisor):
    """Odd multiples of 2^-149 halved are exact ties of the subnormal grid: ties to even."""
    odd = np.arange(1, 2**13, 2, dtype=np.uint32).view(F32)
    near = (np.arange(1, 2**12, dtype=np.uint32) | np.uint32(0x00780000)).view(F32)
    a = np.concatenate([odd, near, np.array([1.1754942e-38, 1.1754944e-38, 7e-38], F32)])
    b = np.full_like(a, divisor)
    assert_same(jax.jit(ieee.div)(a, b), a / b, a, b)


@pytest.mark.parametrize("c", [6, 1, 3, 127])
def test_div_by_int_is_correctly_rounded(c, rng):
    x = np.concatenate([random_floats(rng, 30000), np.arange(1, 4000, dtype=np.uint32).view(F32)])
    with np.errstate(all="ignore"):
        want = x / F32(c)
    assert_same(jax.jit(lambda x: ieee.div_by_int(x, c))(x), want, x)


@pytest.mark.parametrize("divisor", [6.0, 1.5, 0.7])
def test_division_by_a_broadcast_value_is_rounded_once(divisor, rng):
    """XLA turns ``x / c`` (c a scalar or a broadcast) into ``x * (1/c)``: ieee does not."""
    a = rng.standard_normal(20000).astype(F32)
    want = a / F32(divisor)
    assert_same(jax.jit(lambda a: ieee.div(a, F32(divisor)))(a), want, a)  # a constant
    assert_same(jax.jit(ieee.div)(a, F32(divisor)), want, a)  # a traced scalar
    assert_same(jax.jit(ieee.true_divide)(a, F32(divisor)), want, a)
    blocks = jax.jit(lambda a, c: ieee.true_divide(a.reshape(-1, 16), c[:, None]))
    c = rng.uniform(0.5, 3.0, a.size // 16).astype(F32)
    assert_same(blocks(a, c).reshape(-1), (a.reshape(-1, 16) / c[:, None]).reshape(-1), a)


def test_mul_is_exact_for_normal_results(rng):
    a, b = random_floats(rng, 60000), random_floats(rng, 60000)[::-1].copy()
    b[::3] = F32(2.0) ** rng.integers(-20, 127, b[::3].size).astype(F32)  # large scales
    with np.errstate(all="ignore"):
        want = a * b
    got = np.asarray(jax.jit(ieee.mul)(a, b))
    tiny = np.abs(want) < F32(2.0**-126)
    assert_same(got[~tiny], want[~tiny], a[~tiny], b[~tiny])
    # Below the normal range: the sign and the order of magnitude (possibly rounded twice).
    np.testing.assert_array_equal(np.signbit(got[tiny]), np.signbit(want[tiny]))
    np.testing.assert_allclose(got[tiny], want[tiny], rtol=0, atol=2.0**-149)


def test_ldexp_is_exact(rng):
    x = random_floats(rng, 60000)
    k = rng.integers(-300, 300, x.size).astype(np.int32)
    with np.errstate(all="ignore"):
        want = np.ldexp(x.astype(np.float64), k).astype(F32)
    assert_same(jax.jit(ieee.ldexp)(x, k), want, x, k)


def test_reductions_and_predicates(rng):
    x = random_floats(rng, 6000)
    x = x[~np.isnan(x)][:4000].reshape(40, 100)  # NaN payloads may differ: see below
    np.testing.assert_array_equal(
        jax.jit(lambda v: ieee.abs_max(v, axis=1))(x).view(np.uint32),
        np.max(np.abs(x), axis=1).view(np.uint32),
    )
    np.testing.assert_array_equal(
        jax.jit(lambda v: ieee.reduce_max(v, axis=0))(x).view(np.uint32),
        np.max(x, axis=0).view(np.uint32),
    )
    both = jax.jit(lambda v: (ieee.abs_max(v), ieee.reduce_max(v)))
    assert np.isnan(both(np.array([1.0, np.nan, 2.0], F32))).all()
    assert [float(r) for r in both(np.zeros((0,), F32))] == [0.0, -np.inf]
    v = np.array([1e-45, -1e-45, 0.0, -0.0, 1.0, -2.0, np.nan, np.inf], F32)
    zero, pos = jax.jit(lambda v: (ieee.is_zero(v), ieee.is_positive(v)))(v)
    np.testing.assert_array_equal(zero, [False, False, True, True, False, False, False, False])
    np.testing.assert_array_equal(pos, [True, False, False, False, True, False, False, True])


def test_bit_tests_survive_fusion_with_float_ops():
    """LLVM turns a bit test next to a float use of the same value into a float compare, which
    XLA:CPU then runs with subnormals read as zero; the barrier in ieee prevents that."""
    v = np.array([3.2e-39, -1e-45, 0.0, 1.0, np.nan], F32)
    f = jax.jit(lambda v: (ieee.is_zero(v) | jnp.isnan(v), jnp.where(ieee.is_zero(v), 5.0, v)))
    either, picked = f(v)
    np.testing.assert_array_equal(either, [False, False, True, False, True])
    np.testing.assert_array_equal(picked.view(np.uint32)[:2], v.view(np.uint32)[:2])


def test_split():
    v = np.array([1.0, 1e-45, 3e-39, -448.0], F32)
    sign, m, e = jax.jit(ieee.split)(v)
    np.testing.assert_array_equal(np.asarray(sign) >> 31, [0, 0, 0, 1])
    np.testing.assert_array_equal(np.asarray(m) >> 23, [1, 1, 1, 1])  # normalised
    back = np.asarray(m, np.float64) * 2.0 ** (np.asarray(e, np.float64) - 23)
    np.testing.assert_array_equal(back, np.abs(v.astype(np.float64)))


def test_rejects_other_dtypes():
    with pytest.raises(TypeError, match="expects float32, got bfloat16"):
        ieee.mul(jnp.ones(2, jnp.bfloat16), jnp.float32(1))
