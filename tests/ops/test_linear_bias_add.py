"""``ForwardLinearBiasAdd``: ``[Linear, Bias, AddResidual]`` (and ``AddExtraInput``, with or
without the Bias) as one GEMM whose pass adds the bias and the residual: the plans, the sum
rounded once (against a float64 reference), the fused step against the unfused one under each
recipe, a residual in another dtype, and a row-parallel Linear left alone."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from te_jax import ops
from te_jax.nnx import FP8Meta

from .test_sequential import RECIPES, D, _rel, loss, x_of

RECIPE_NAMES = ["bf16", "delayed", "current", "mxfp8"]


def block(recipe="bf16", fuse=True, bias=True, add=ops.AddResidual, bias_init=None):
    bias_init = bias_init or nnx.initializers.normal(0.5)
    mid = (ops.Bias(D, bias_init=bias_init),) if bias else ()
    return ops.Sequential(
        ops.Linear(D, D), *mid, add(), recipe=RECIPES[recipe], fuse=fuse, rngs=nnx.Rngs(3)
    )


def test_plans():
    assert [repr(op) for op in block().fused_plan()] == [
        "ForwardLinearBiasAdd(Linear, Bias, AddResidual)"
    ]
    assert [repr(op) for op in block(bias=False, add=ops.AddExtraInput).fused_plan()] == [
        "ForwardLinearBiasAdd(Linear, AddExtraInput)"
    ]
    # The backward is the basic ops' own.
    assert [repr(op) for op in block().fused_plan("backward")] == [
        "Linear",
        "Bias",
        "AddResidual",
    ]
    row = ops.Sequential(
        ops.Linear(D, D, parallel_mode="row"), ops.Bias(D), ops.AddResidual(), rngs=nnx.Rngs(0)
    )
    assert [repr(op) for op in row.fused_plan()] == ["Linear", "Bias", "AddResidual"]


def test_the_sum_is_rounded_once():
    """bf16: ``y = x·k + x + b`` within half a bf16 ulp of the float64 sum of the same inputs
    (plus the float32 accumulation's error; on te_jax's CUDA GEMM, half an ulp of the product
    more, which cuBLASLt may round before its epilogue adds). The unfused plan rounds
    ``x·k + b`` first and lands up to a full ulp away."""
    seq = block()
    x = x_of()
    y = np.asarray(nnx.jit(lambda m, x: m(x))(seq, x), np.float64)
    xf = np.asarray(x, np.float64)
    k = np.asarray(seq.ops[0].kernel[...].astype(jnp.bfloat16), np.float64)  # x's dtype
    b = np.asarray(seq.ops[1].bias[...].astype(jnp.bfloat16), np.float64)
    acc = xf @ k
    ref = acc + xf + b
    mag = np.abs(xf) @ np.abs(k) + np.abs(xf) + np.abs(b)
    bound = 2.0**-8 * np.abs(ref) + (D + 2) * 2.0**-23 * mag + 2.0**-133
    if jax.default_backend() == "gpu":
        bound = bound + 2.0**-8 * np.abs(acc)
    err = np.abs(y - ref)
    assert np.all(err <= bound), float(np.max(err / bound))


@nnx.jit
def _steps(models, x, e):
    """One step of each model (the extra input ``e`` to those that take one), in one program."""
    diff = nnx.DiffState(0, (nnx.Param, FP8Meta))

    def with_extra(m, x):
        w = jax.random.normal(jax.random.PRNGKey(9), x.shape)
        y = m(x, e)
        yf = y.astype(jnp.float32)
        return jnp.sum(w * yf * yf) / y.size * 64.0, y

    out = []
    for m in models:
        extra = isinstance(m.ops[-1], ops.AddExtraInput)
        out.append(nnx.grad(with_extra if extra else loss, argnums=diff, has_aux=True)(m, x))
    return out


def test_fused_equals_unfused():
    """Each recipe: the fused step's output within one bf16 rounding of the unfused one's (the
    unfused plan rounds once more), its gradients and FP8 state within what that rounding moves
    through a quadratic loss: a bf16 rounding of dy, or under FP8 one E5M2 code of the quantized
    dy (2^-3 relative) that it can flip. A float32 extra input (not the GEMM's output dtype) is
    added after the GEMM, as the unfused op does: bit for bit (with a zero bias, which the
    unfused Bias adds to the rounded product: one rounding more, as for
    ForwardLinearBiasActivation's [Linear, Bias])."""
    cases = [(r, ops.AddResidual) for r in RECIPE_NAMES] + [("bf16", ops.AddExtraInput)]
    models = []
    for recipe, add in cases:
        kw = dict(add=add)
        if add is ops.AddExtraInput:
            kw["bias_init"] = nnx.initializers.zeros
        models += [block(recipe, **kw), block(recipe, fuse=False, **kw)]
    e = jax.random.normal(jax.random.PRNGKey(4), x_of().shape, jnp.float32)
    results = _steps(models, x_of(), e)
    for i, (recipe, add) in enumerate(cases):
        (g1, y1), (g0, y0) = results[2 * i], results[2 * i + 1]
        what = f"{recipe}-{add.__name__}"
        if add is ops.AddExtraInput:
            np.testing.assert_array_equal(np.asarray(y1), np.asarray(y0), what)
            bound = 0.0
        else:
            assert _rel(y1, y0) <= 2.0**-7, what
            bound = 2.0**-5 if recipe == "bf16" else 2.0**-3
        for (path, a), (_, b) in zip(
            jax.tree_util.tree_leaves_with_path(nnx.state(g1, (nnx.Param, FP8Meta))),
            jax.tree_util.tree_leaves_with_path(nnx.state(g0, (nnx.Param, FP8Meta))),
            strict=True,
        ):
            assert _rel(a, b) <= bound, (what, jax.tree_util.keystr(path), _rel(a, b))


def test_shape_mismatch_names_the_op():
    seq = ops.Sequential(ops.Linear(D, 2 * D), ops.Bias(2 * D), ops.AddResidual(), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"AddResidual: the added input has shape \(2, 32, 32\)"):
        seq(x_of())
