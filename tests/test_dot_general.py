"""te_jax.dot_general against lax.dot_general: every layout of contracting and batch axes the
Flax layers and einsums produce, values and gradients (against the float64 product of the same
operands), under FP8 the quantize kernels in the program and the quantized product, and the
errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import te_jax
from helpers import te_jax_custom_calls
from te_jax import QuantizerSet

# name: (lhs shape, rhs shape, dimension_numbers)
CASES = {
    # nn.Dense / nnx.Linear: x (b, s, d) · kernel (d, f)
    "dense": ((2, 3, 32), (32, 16), (((2,), (0,)), ((), ()))),
    # nn.DenseGeneral over two input axes, kernel (h, d, f)
    "dense_general_2axes": ((2, 4, 8, 16), (8, 16, 24), (((2, 3), (0, 1)), ((), ()))),
    # "bsd,fd->bsf": the weight contracts its trailing axis (transposed to (d, f))
    "rhs_trailing": ((2, 3, 32), (16, 32), (((2,), (1,)), ((), ()))),
    # "dbs,df->bsf": the activation contracts its leading axis
    "lhs_leading": ((32, 2, 3), (32, 16), (((0,), (0,)), ((), ()))),
    # "ebd,edf->ebf": per-expert weights (a batch axis)
    "experts": ((3, 4, 32), (3, 32, 16), (((2,), (1,)), ((0,), (0,)))),
    # "bhsd,bhtd->bhst": two batch axes, no weight-like operand
    "two_batch_axes": ((2, 3, 5, 16), (2, 3, 7, 16), (((3,), (3,)), ((0, 1), (0, 1)))),
}


def _operands(name, seed=0):
    ls, rs, _ = CASES[name]
    rng = np.random.default_rng(seed)
    lhs = jnp.asarray(rng.normal(size=ls), jnp.bfloat16)
    rhs = jnp.asarray(rng.normal(size=rs) / np.sqrt(32), jnp.bfloat16)
    return lhs, rhs


def _weights(shape):
    return jax.random.normal(jax.random.PRNGKey(7), shape, jnp.float32)


def _loss(fn, dn):
    """Quadratic in the output, weighted: the gradient reaches every rounding."""

    def loss(lhs, rhs):
        y = fn(lhs, rhs, dn).astype(jnp.float32)
        return jnp.sum(_weights(y.shape) * y * y)

    return loss


def test_matches_lax_dot_general():
    """bf16: output within float32 accumulation + one bf16 rounding of the float64 product; the
    gradients within one bf16 rounding of lax.dot_general's float32 ones. Every case in one
    program."""

    @jax.jit
    def run(ops):
        out = {}
        for name, (lhs, rhs) in ops.items():
            dn = CASES[name][2]
            y = te_jax.dot_general(lhs, rhs, dn)
            g = jax.grad(_loss(te_jax.dot_general, dn), argnums=(0, 1))(lhs, rhs)
            f32 = lambda a, b, dn: lax.dot_general(  # noqa: E731
                a.astype(jnp.float32), b.astype(jnp.float32), dn, precision="highest"
            )
            g_ref = jax.grad(_loss(f32, dn), argnums=(0, 1))(lhs, rhs)
            out[name] = (y, g, g_ref)
        return out

    ops = {name: _operands(name) for name in CASES}
    for name, (y, g, g_ref) in run(ops).items():
        lhs, rhs = (np.asarray(a, np.float64) for a in ops[name])
        dn = CASES[name][2]
        ref = np.asarray(lax.dot_general(lhs, rhs, dn, precision="highest"))
        mag = np.asarray(lax.dot_general(np.abs(lhs), np.abs(rhs), dn, precision="highest"))
        assert y.shape == ref.shape and y.dtype == jnp.bfloat16, (name, y.shape, ref.shape)
        bound = 2.0**-8 * np.abs(ref) + 64 * 2.0**-23 * mag + 2.0**-133
        err = np.abs(np.asarray(y, np.float64) - ref)
        assert np.all(err <= bound), (name, float(np.max(err / bound)))
        for got, want, what in zip(g, g_ref, ("dlhs", "drhs"), strict=True):
            got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
            assert got.shape == want.shape, (name, what)
            rel = np.max(np.abs(got - want)) / np.max(np.abs(want))
            assert rel <= 2.0**-6, (name, what, rel)


@pytest.mark.parametrize("recipe", ["delayed", "current"])
def test_fp8_runs_the_quantized_product(recipe):
    """Under a recipe: the dense case equals te_jax.dense with the same set (the same op), the
    experts case the per-expert dense products, the next FP8 state comes back as the set's
    cotangent, and (with the kernels) the program holds te_jax's quantize kernels."""
    r = {"delayed": te_jax.recipe.DelayedScaling(), "current": te_jax.recipe.CurrentScaling()}
    qs = QuantizerSet.create(r[recipe])
    lhs, rhs = _operands("dense")
    dn = CASES["dense"][2]
    fn = jax.jit(lambda a, b, q: te_jax.dot_general(a, b, dn, quantizer_set=q))
    want = jax.jit(lambda a, b, q: te_jax.dense(a, b, quantizer_set=q))(lhs, rhs, qs)
    np.testing.assert_array_equal(np.asarray(fn(lhs, rhs, qs)), np.asarray(want))
    el, er = _operands("experts")
    edn = CASES["experts"][2]
    got = jax.jit(lambda a, b, q: te_jax.dot_general(a, b, edn, quantizer_set=q))(el, er, qs)
    per = jax.jit(jax.vmap(lambda a, b, q: te_jax.dense(a, b, quantizer_set=q), (0, 0, None)))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(per(el, er, qs)))
    ref = np.asarray(lax.dot_general(np.float64(el), np.float64(er), edn))
    assert np.linalg.norm(np.float64(got) - ref) / np.linalg.norm(ref) <= 2.0**-4
    loss = lambda a, b, q: jnp.sum(  # noqa: E731
        te_jax.dot_general(a, b, edn, quantizer_set=q).astype(jnp.float32) ** 2
    )
    nxt = jax.jit(jax.grad(loss, argnums=2))(el, er, qs)
    if recipe == "delayed":
        assert float(nxt.grad.amax_history[-1]) > 0 and float(nxt.x.amax_history[-1]) > 0
    hlo = fn.lower(lhs, rhs, qs).compile().as_text()
    if te_jax.ffi_available():
        assert any("quantize" in c for c in te_jax_custom_calls(hlo)), te_jax_custom_calls(hlo)


ERRORS = {
    "not_pairs": ((((2,), (0,)),), "dimension_numbers must be"),
    "count": ((((2,), (0, 1)), ((), ())), "as many contracting"),
    "range": ((((3,), (0,)), ((), ())), "lhs contracting axis 3 is out of range"),
    "repeat": ((((2, 2), (0, 0)), ((), ())), "repeat an axis"),
    "both": ((((0,), (0,)), ((0,), (0,))), "both contracting and batch"),
}


@pytest.mark.parametrize("name", list(ERRORS))
def test_errors(name):
    dn, match = ERRORS[name]
    lhs, rhs = _operands("dense")
    with pytest.raises(ValueError, match=r"te_jax.dot_general: .*" + match):
        jax.eval_shape(lambda a, b: te_jax.dot_general(a, b, dn), lhs, rhs)


def test_batch_sizes_must_agree():
    lhs, rhs = _operands("experts")
    with pytest.raises(ValueError, match="batch axes differ in size"):
        te_jax.dot_general(lhs, rhs[:2], CASES["experts"][2])
