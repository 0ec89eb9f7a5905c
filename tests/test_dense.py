"""te_jax.dense: forward and every gradient (dx, dkernel, dbias) against the float64 reference of
tests/dense_oracle.py (SPEC §8: ``h = x·kernel + bias`` with float32 accumulation rounded once to
x's dtype, ``y = act(h)``), within the bound that module derives from docs/numerics.md §7, the
float32 accumulation error ``K·2^-23·Σ|x||w|`` and the rounding of h; the default path against
the pure-JAX one (``implementation="xla"``) within twice that bound; under jit, vmap, lax.scan and
jax.checkpoint; the trace-time errors.

FP8 (the second half): each recipe within the FP8 bound of the unquantized reference, SPEC §8's
exact-math rule (dense equals the float64 product of the operands it quantized, which makes the
CPU path an oracle for the GPU's), delayed scaling's state over several steps, current scaling's
statelessness, and the FP8 MLP ``dense -> activation(quantizer) -> dense``.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dense_oracle as do
import te_jax
from helpers import ACT_BY_ALIAS, ACTS, DTYPE_IDS, DTYPES, Act, input_range, make_dz, np_dtype
from te_jax.dispatch import environment_implementation
from te_jax.quantize import (
    CurrentScaleQuantizer,
    DelayedScaleQuantizer,
    MXFP8Quantizer,
    QuantizeLayout,
)
from te_jax.recipe import (
    CurrentScaling,
    DelayedScaling,
    Float8BlockScaling,
    MXFP8BlockScaling,
    QuantizerSet,
)
from test_activation import CLAMPED, CUSTOM

# Where te_jax's CUDA GEMM runs, the oracle takes its measured rounding (dense_oracle.KERNEL_GEMM).
do.KERNEL_GEMM = (
    jax.default_backend() == "gpu"
    and te_jax._ffi.target_available("te_jax_gemm", "cuda")
    and environment_implementation() != "xla"
)

IMPLS = (None, "xla")  # te_jax's kernels where there are some (CPU: act_lu), and pure JAX
BOTH = QuantizeLayout.ROWWISE_COLWISE


# ---- inputs ---------------------------------------------------------------------------------


def kernel_shape(k: int, n: int, act: Act | None) -> tuple[int, ...]:
    return (k, 2, n) if act is not None and act.gated else (k, n)


def make_operands(rng, x_shape, n, dtype, act: Act | None, bias=True, params=None, spread=None):
    """x (uniform in [-1, 1]), a kernel scaled so that h spreads over both signs of the
    activation's interesting range (beyond the clamps of clamped SwiGLU), a bias, and dy; in
    ``dtype``, never all zeros."""
    k = x_shape[-1]
    ks = kernel_shape(k, n, act)
    if spread is None:
        spread = 2.0 if act is None else input_range(act, params) / 2
    x = rng.uniform(-1.0, 1.0, x_shape)
    w = rng.uniform(-1.0, 1.0, ks) * 3.0 * spread / math.sqrt(max(k, 1))  # std(h) = spread
    if x.size:
        x.reshape(-1)[0] = 0.875
    w.reshape(-1)[-1] = -0.625
    b = rng.uniform(-0.5, 0.5, ks[1:]) if bias else None
    y_shape = tuple(x_shape[:-1]) + (n,)
    dy = make_dz(rng, y_shape, dtype)
    cast = lambda a: None if a is None else a.astype(np_dtype(dtype))  # noqa: E731
    return cast(x), cast(w), cast(b), dy


def spread_magnitudes(rng, a, lo=-16):
    """``a`` (``(..., n)``, viewed as 2-D) with each row and each column scaled by its own power
    of two in ``[2^lo, 1]``: MXFP8's rowwise blocks (along rows) and colwise blocks (down
    columns) then get different scales, and values far below their block's amax (E4M3
    subnormals in one copy, not the other) make the two copies differ."""
    a2 = a.reshape(-1, a.shape[-1]).astype(np.float64)
    rows = np.exp2(rng.integers(lo, 1, size=(a2.shape[0], 1)))
    cols = np.exp2(rng.integers(lo, 1, size=(1, a2.shape[1])))
    rows[0], cols[0, 0] = 1.0, 1.0  # keep the tensor's largest values
    return (a2 * rows * cols).reshape(a.shape).astype(a.dtype)


def names(act: Act | None):
    return None if act is None else act.names


@functools.partial(jax.jit, static_argnames=("act", "params", "impls"))
def value_and_grads(x, kernel, bias, dy, act, params=None, impls=IMPLS):
    """``(y, dx, dkernel, dbias)`` of dense for each implementation, in one program."""
    out = []
    for impl in impls:
        f = functools.partial(
            te_jax.dense, activation_type=act, act_params=params, implementation=impl
        )
        y, vjp = jax.vjp(f, x, kernel, bias)
        out.append((y, *vjp(dy)))
    return out


def reference(x, kernel, bias, dy, act: Act | None, dtype, params=None):
    """The oracle's ``(y, dx, dkernel, dbias)`` in the op's shapes."""
    fwd = do.forward(x, kernel, bias, act, dtype, params)
    g = do.backward(fwd, dy)
    lead = tuple(np.shape(x)[:-1])
    return (
        fwd.y.reshape(lead + fwd.y.v.shape[1:]),
        g.dx.reshape(np.shape(x)),
        g.dk,
        None if bias is None else g.db,
    )


OUTPUTS = ("y", "dx", "dkernel", "dbias")


def check_outputs(outs, refs, dtype, label="", labels=("default", "xla")):
    """Each run within the reference bound; two runs within twice that of each other."""
    for impl, got in zip(labels, outs, strict=False):
        for name, g, r in zip(OUTPUTS, got, refs, strict=True):
            if r is None:
                assert g is None, f"{label} {name}: want None"
                continue
            do.assert_bounded(g, r, dtype, f"{label} impl={impl} {name}")
    if len(outs) == 1:
        return
    for name, a, b, r in zip(OUTPUTS, outs[0], outs[1], refs, strict=True):
        if r is not None:
            do.assert_agree(a, b, r, f"{label} {name}: {labels[0]} vs {labels[1]}")


def run_and_check(rng, x_shape, n, dtype, act, bias=True, params=None, label=""):
    x, w, b, dy = make_operands(rng, x_shape, n, dtype, act, bias, params)
    outs = value_and_grads(
        jnp.asarray(x),
        jnp.asarray(w),
        None if b is None else jnp.asarray(b),
        jnp.asarray(dy),
        names(act),
        params,
    )
    check_outputs(outs, reference(x, w, b, dy, act, dtype, params), dtype, label)


# ---- unquantized: every activation, then dtype x shape x bias ---------------------------------

ALL_CASES = [(None, None)] + [(a, None) for a in ACTS] + [(CLAMPED, CUSTOM)]


def case_id(case) -> str:
    act, params = case
    return "gemm" if act is None else f"{act}-custom" if params is not None else str(act)


@pytest.mark.parametrize("case", ALL_CASES, ids=case_id)
def test_every_activation_matches_float64(case, rng):
    """Forward and dx, dkernel, dbias for every activation (gated ones with (K, 2, N) kernels)
    and the plain GEMM: float32, leading axes, odd K and N."""
    act, params = case
    run_and_check(rng, (2, 3, 7), 33, jnp.float32, act, params=params, label=case_id(case))


SOME = [None, ACT_BY_ALIAS["gelu"], ACT_BY_ALIAS["swiglu"], ACT_BY_ALIAS["relu"]]
# (x shape, N): leading axes with odd K and N; a size-1 batch; an empty batch (M = 0).
SHAPES = [((2, 3, 7), 33), ((1, 33), 7), ((0, 7), 33)]


# Pairwise: every (activation, dtype) once, the shape turning with both so that each
# activation and each dtype meets every shape; the bias on in every other case, so that each
# of the three options meets both with and without a bias.
def _matrix():
    shape_ids = ["2x3x7-33", "1x33-7", "0x7-33"]
    for i, act in enumerate(SOME):
        for j, (dtype, did) in enumerate(zip(DTYPES, DTYPE_IDS, strict=True)):
            k = (i + j) % len(SHAPES)
            (x_shape, n), sid = SHAPES[k], shape_ids[k]
            bias = (i + j) % 2 == 0
            id_ = f"{act or 'gemm'}-{did}-{sid}-{'bias' if bias else 'nobias'}"
            yield pytest.param(act, dtype, x_shape, n, bias, id=id_)


MATRIX = list(_matrix())


@pytest.mark.parametrize("act, dtype, x_shape, n, bias", MATRIX)
def test_dtype_shape_bias_matrix(act, dtype, x_shape, n, bias, rng):
    run_and_check(rng, x_shape, n, dtype, act, bias, label=f"{act} {x_shape} {n}")


def test_x_without_leading_axes(rng):
    """x of shape (K,): y of shape (N,), dx of shape (K,)."""
    run_and_check(rng, (7,), 33, jnp.bfloat16, ACT_BY_ALIAS["gelu"], label="1-D x")


@pytest.mark.parametrize(
    "act", [None, ACT_BY_ALIAS["gelu"], ACT_BY_ALIAS["relu"]], ids=["gemm", "gelu", "relu"]
)
def test_several_output_axes(act, rng):
    """A kernel (K, N1, N2) with a non-gated activation is the (K, N1·N2) dense, reshaped:
    the same y and gradients, bit for bit."""
    x, w, b, dy = make_operands(rng, (2, 3, 8), 12, jnp.float32, act)
    name = None if act is None else names(act)

    def grads(w_shape, b_shape, dy_shape):
        f = lambda x, w, b: te_jax.dense(x, w.reshape(w_shape), b.reshape(b_shape), name)  # noqa: E731
        y, vjp = jax.vjp(f, x, w, b)
        return (y.reshape(2, 3, 12), *vjp(dy.reshape(dy_shape)))

    for a, c in zip(
        grads((8, 3, 4), (3, 4), (2, 3, 3, 4)), grads((8, 12), (12,), (2, 3, 12)), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(c))


def test_several_contracting_axes(rng):
    """contracting_dims ((-2, -1), (0, 1)): x (..., K1, K2) with kernel (K1, K2, N) is the GEMM
    over K = K1·K2."""
    dtype, act = jnp.bfloat16, ACT_BY_ALIAS["swiglu"]
    x, w, b, dy = make_operands(rng, (2, 3, 20), 9, dtype, act)
    x4, w4 = x.reshape(2, 3, 4, 5), w.reshape(4, 5, 2, 9)
    refs = reference(x, w, b, dy, act, dtype)
    refs = (refs[0], refs[1].reshape(x4.shape), refs[2].reshape(w4.shape), refs[3])

    @jax.jit
    def f(x, w, b, dy):
        out = []
        for impl, dims in zip(IMPLS, [((-2, -1), (0, 1)), ((2, 3), (0, 1))], strict=True):
            y, vjp = jax.vjp(
                lambda x, w, b, dims=dims, impl=impl: te_jax.dense(
                    x, w, b, "swiglu", contracting_dims=dims, implementation=impl
                ),
                x,
                w,
                b,
            )
            out.append((y, *vjp(dy)))
        return out

    check_outputs(f(x4, w4, b, dy), refs, dtype, "two contracting axes")


def test_empty_quantizer_set_is_unquantized(rng):
    x, w, b, _ = make_operands(rng, (4, 16), 8, jnp.bfloat16, ACT_BY_ALIAS["gelu"])
    f = jax.jit(lambda x, w, b, qs: te_jax.dense(x, w, b, "gelu", quantizer_set=qs))
    np.testing.assert_array_equal(
        np.asarray(f(x, w, b, QuantizerSet.create(None)), np.float32),
        np.asarray(f(x, w, b, None), np.float32),
    )


# ---- transformations ------------------------------------------------------------------------

TRANSFORM_ACTS = [ACT_BY_ALIAS["gelu"], ACT_BY_ALIAS["swiglu"], None]
T_IDS = ["gelu", "swiglu", "gemm"]


def _vjp_one(x, w, b, dy, act, impl=None):
    y, vjp = jax.vjp(lambda x, w, b: te_jax.dense(x, w, b, act, implementation=impl), x, w, b)
    return (y, *vjp(dy))


def test_eager_matches_jit(rng):
    act, dtype = ACT_BY_ALIAS["swiglu"], jnp.bfloat16
    x, w, b, dy = make_operands(rng, (3, 7), 5, dtype, act)
    refs = reference(x, w, b, dy, act, dtype)
    eager = _vjp_one(jnp.asarray(x), jnp.asarray(w), jnp.asarray(b), jnp.asarray(dy), act.names)
    jitted = value_and_grads(
        jnp.asarray(x), jnp.asarray(w), jnp.asarray(b), jnp.asarray(dy), act.names, impls=(None,)
    )[0]
    check_outputs([eager, jitted], refs, dtype, "", labels=("eager", "jit"))


@pytest.mark.parametrize("batched_kernel", [False, True], ids=["x", "x-and-kernel"])
@pytest.mark.parametrize("act", TRANSFORM_ACTS, ids=T_IDS)
def test_vmap(act, batched_kernel, rng):
    """vmap over x (kernel shared: per-example dkernel) or over x, kernel and bias together:
    each example equals its own unbatched reference."""
    dtype, batch = jnp.bfloat16, 3
    per = [make_operands(rng, (4, 7), 9, dtype, act) for _ in range(batch)]
    xs, ws, bs, dys = (np.stack([p[i] for p in per]) for i in range(4))
    if not batched_kernel:
        ws, bs = ws[0], bs[0]
    axes = (0, 0 if batched_kernel else None, 0 if batched_kernel else None, 0)

    @jax.jit
    def f(xs, ws, bs, dys):
        return [
            jax.vmap(functools.partial(_vjp_one, act=names(act), impl=impl), in_axes=axes)(
                xs, ws, bs, dys
            )
            for impl in IMPLS
        ]

    outs = f(xs, ws, bs, dys)
    for i in range(batch):
        w, b = (ws[i], bs[i]) if batched_kernel else (ws, bs)
        refs = reference(xs[i], w, b, dys[i], act, dtype)
        one = [tuple(o[i] for o in impl_out) for impl_out in outs]
        check_outputs(one, refs, dtype, f"vmap element {i}")


def _chained_reference(x, ws, bs, dy, act, dtype):
    """The oracle through the layers (each layer's input carrying the previous one's bound),
    then back."""
    fwds, h = [], x
    for w, b in zip(ws, bs, strict=True):
        fwds.append(do.forward(h, w, b, act, dtype))
        h = fwds[-1].y
    g = dy
    dks, dbs = [], []
    for fwd in reversed(fwds):
        grads = do.backward(fwd, g)
        g = grads.dx
        dks.append(grads.dk)
        dbs.append(grads.db)
    stack = lambda bs: do.Bounded(np.stack([b.v for b in bs]), np.stack([b.e for b in bs]))  # noqa: E731
    return h, g, stack(dks[::-1]), stack(dbs[::-1])


@pytest.mark.parametrize("remat", [False, True], ids=["plain", "checkpoint"])
@pytest.mark.parametrize("act", TRANSFORM_ACTS[:2], ids=T_IDS[:2])
def test_scan_over_layers(act, remat, rng):
    """lax.scan over 3 layers with stacked kernels and biases (the body under jax.checkpoint
    or not): values and gradients against the chained reference and an unrolled loop."""
    dtype, layers, width = jnp.bfloat16, 3, 16
    per = [make_operands(rng, (4, width), width, dtype, act) for _ in range(layers)]
    x, dy = per[0][0], per[-1][3]
    ws, bs = np.stack([p[1] for p in per]), np.stack([p[2] for p in per])

    def layer(h, wb, impl):
        return te_jax.dense(h, wb[0], wb[1], names(act), implementation=impl), None

    @jax.jit
    def f(x, ws, bs, dy):
        out = []
        for impl in IMPLS:
            body = functools.partial(layer, impl=impl)
            body = jax.checkpoint(body) if remat else body
            run = lambda x, ws, bs, body=body: jax.lax.scan(body, x, (ws, bs))[0]  # noqa: E731
            y, vjp = jax.vjp(run, x, ws, bs)
            out.append((y, *vjp(dy)))
        return out

    @jax.jit
    def unrolled(x, ws, bs, dy):
        def run(x, ws, bs):
            for i in range(layers):
                x = layer(x, (ws[i], bs[i]), None)[0]
            return x

        y, vjp = jax.vjp(run, x, ws, bs)
        return (y, *vjp(dy))

    outs = f(x, ws, bs, dy)
    refs = _chained_reference(x, ws, bs, dy, act, dtype)
    check_outputs(outs, refs, dtype, f"scan remat={remat}")
    check_outputs([outs[0], unrolled(x, ws, bs, dy)], refs, dtype, "", labels=("scan", "unrolled"))


@pytest.mark.parametrize("act", TRANSFORM_ACTS, ids=T_IDS)
def test_checkpoint(act, rng):
    """jax.grad through jax.checkpoint (the forward recomputed in the backward) gives the
    reference gradients, and those of the plain function."""
    dtype = jnp.float16
    x, w, b, dy = make_operands(rng, (2, 5, 7), 9, dtype, act)
    refs = reference(x, w, b, dy, act, dtype)

    @jax.jit
    def f(x, w, b, dy):
        out = []
        for fn in (jax.checkpoint, lambda g: g):
            loss = fn(
                lambda x, w, b: jnp.vdot(
                    te_jax.dense(x, w, b, names(act)).astype(jnp.float32), dy.astype(jnp.float32)
                )
            )
            grads = jax.grad(loss, argnums=(0, 1, 2))(x, w, b)
            y = fn(lambda x, w, b: te_jax.dense(x, w, b, names(act)))(x, w, b)
            out.append((y, *grads))
        return out

    check_outputs(f(x, w, b, dy), refs, dtype, "", labels=("checkpoint", "plain"))


# ---- trace-time errors ----------------------------------------------------------------------

S = jax.ShapeDtypeStruct
F32 = jnp.float32


X47, K75 = S((4, 7), F32), S((7, 5), F32)


def _call(x=X47, kernel=K75, bias=None, **kw):
    """Traces dense on abstract inputs (no computation): the errors come at trace time."""
    return lambda: jax.eval_shape(lambda x, k, b: te_jax.dense(x, k, b, **kw), x, kernel, bias)


ERRORS = {
    "K mismatch": (_call(kernel=S((8, 5), F32)), ValueError, r"contracting axes \(7,\).*\(8,\)"),
    "gated kernel (K, 3, N)": (
        _call(kernel=S((7, 3, 5), F32), activation_type="swiglu"),
        ValueError,
        r"swiglu is gated: the kernel must be \(K, 2, N\)",
    ),
    "gated kernel (K, N)": (
        _call(kernel=S((7, 10), F32), activation_type=("silu", "linear")),
        ValueError,
        r"is gated: the kernel must be \(K, 2, N\)",
    ),
    "kernel without output axis": (
        _call(kernel=S((7,), F32), activation_type="gelu"),
        ValueError,
        "no output axis",
    ),
    "bias shape": (
        _call(bias=S((6,), F32)),
        ValueError,
        r"bias must have the kernel's output shape \(5,\), got \(6,\)",
    ),
    "gated bias shape": (
        _call(kernel=S((7, 2, 5), F32), bias=S((5,), F32), activation_type="geglu"),
        ValueError,
        r"bias must have the kernel's output shape \(2, 5\)",
    ),
    "integer x": (_call(x=S((4, 7), jnp.int32)), TypeError, "float32, bfloat16 or float16"),
    "integer kernel": (
        _call(kernel=S((7, 5), jnp.int8)),
        TypeError,
        "kernel must be a float array, got int8",
    ),
    "integer bias": (_call(bias=S((5,), jnp.int32)), TypeError, "bias must be a float array"),
    "unknown activation": (
        _call(activation_type="gelu2"),
        ValueError,
        "unknown activation_type 'gelu2'",
    ),
    "unknown implementation": (
        _call(implementation="cuda"),
        ValueError,
        "implementation must be None, 'ffi' or 'xla', got 'cuda'",
    ),
    "quantizer_set type": (
        _call(quantizer_set=CurrentScaleQuantizer()),
        TypeError,
        "quantizer_set must be a te_jax.QuantizerSet",
    ),
    "quantizer_set recipe": (
        _call(quantizer_set=DelayedScaling()),
        TypeError,
        "quantizer_set must be a te_jax.QuantizerSet.*got DelayedScaling",
    ),
    "contracting_dims leading x axis": (
        _call(x=S((7, 7), F32), contracting_dims=((0,), (0,))),
        ValueError,
        "contracting_dims must be x's trailing axes and the kernel's leading axes",
    ),
    "contracting_dims trailing kernel axis": (
        _call(kernel=S((7, 7), F32), contracting_dims=((-1,), (1,))),
        ValueError,
        "contracting_dims must be x's trailing axes and the kernel's leading axes",
    ),
    "contracting_dims out of order": (
        _call(x=S((4, 7, 7), F32), kernel=S((7, 7, 5), F32), contracting_dims=((2, 1), (0, 1))),
        ValueError,
        "contracting_dims must be x's trailing axes",
    ),
    "contracting_dims counts differ": (
        _call(contracting_dims=((-1,), (0, 1))),
        ValueError,
        r"must name the same number \(>= 1\) of x and kernel axes",
    ),
    "contracting_dims not axes": (
        _call(contracting_dims="last"),
        ValueError,
        r"contracting_dims must be \(x_axes, kernel_axes\)",
    ),
    "unknown recipe": (
        lambda: QuantizerSet.create("delayed"),
        TypeError,
        "recipe must be te_jax.recipe.DelayedScaling, CurrentScaling, "
        "MXFP8BlockScaling, Float8BlockScaling or None, got str",
    ),
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_bad_input_raises_at_trace_time(case):
    call, exc, match = ERRORS[case]
    with pytest.raises(exc, match=match):
        call()


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="the GEMM kernel runs on CUDA")
def test_ffi_without_cuda_raises():
    with pytest.raises(RuntimeError, match=r"has no te_jax_gemm kernel for the 'cpu' backend"):
        _call(implementation="ffi")()


def test_quantized_x_errors():
    """A ScaledTensor x: without a quantizer set, with another recipe's, and (differentiated)
    without the colwise copy wgrad reads."""
    w = S((32, 32), jnp.bfloat16)
    row = jax.eval_shape(
        lambda x: te_jax.quantize.quantize(x, CurrentScaleQuantizer()), S((32, 32), jnp.bfloat16)
    )
    dense = lambda qs: lambda x, w: te_jax.dense(x, w, quantizer_set=qs)  # noqa: E731
    with pytest.raises(ValueError, match="x is a ScaledTensor .* but no quantizer_set"):
        jax.eval_shape(dense(None), row, w)
    with pytest.raises(
        ValueError,
        match="x is quantized with CURRENT_TENSOR_SCALING but the "
        "quantizer_set is MXFP8_1D_SCALING",
    ):
        jax.eval_shape(dense(QuantizerSet.create(MXFP8BlockScaling())), row, w)
    qs = QuantizerSet.create(CurrentScaling())
    jax.eval_shape(dense(qs), row, w)  # the forward needs only the rowwise copy
    with pytest.raises(ValueError, match="needs its colwise copy"):
        jax.eval_shape(jax.grad(lambda w, x: dense(qs)(x, w).astype(F32).sum()), w, row)


# ==== FP8 =====================================================================================
#
# Shapes: M = K = N = 32 (multiples of MXFP8's block of 32 along every contracting dimension:
# K forward, N for dgrad, M for wgrad).

FP8_ACTS = [None, ACT_BY_ALIAS["gelu"], ACT_BY_ALIAS["swiglu"]]
FP8_ACT_IDS = ["gemm", "gelu", "swiglu"]


def _recipe_spec(recipe, headroom):
    return do.Fp8(np.dtype(recipe.forward_dtype), np.dtype(recipe.grad_dtype), headroom)


@functools.partial(jax.jit, static_argnames=("act", "impls"))
def fp8_value_and_grads(x, w, b, qs, dy, act, impls=IMPLS):
    """``(y, dx, dkernel, dbias, new_quantizer_set)`` for each implementation."""
    out = []
    for impl in impls:
        f = functools.partial(te_jax.dense, activation_type=act, implementation=impl)
        y, vjp = jax.vjp(lambda x, w, b, qs, f=f: f(x, w, b, quantizer_set=qs), x, w, b, qs)
        out.append((y, *vjp(dy)))
    return out


# (recipe, the dequantization scale as the bounds see it: see dense_oracle.Fp8)
FP8_RECIPES = {
    "delayed": DelayedScaling(amax_history_len=4, margin=1),
    "current": CurrentScaling(),
    "current-e4m3": CurrentScaling(fp8_format="E4M3"),
    "mxfp8": MXFP8BlockScaling(),
}


def _fp8_tolerance_cases():
    # Pairwise over (recipe, activation, dtype): every recipe meets every activation and every
    # dtype, every activation every dtype (the dtype turning with both); current-e4m3, whose
    # gradient dtype alone differs from current's, once.
    dtypes = [(jnp.bfloat16, "bf16"), (jnp.float32, "f32"), (jnp.float16, "f16")]
    for i, name in enumerate(["delayed", "current", "mxfp8"]):
        for j, (act, act_id) in enumerate(zip(FP8_ACTS, FP8_ACT_IDS, strict=True)):
            dtype, did = dtypes[(i + j) % 3]
            yield pytest.param(name, act, dtype, id=f"{name}-{act_id}-{did}")
    yield pytest.param("current-e4m3", FP8_ACTS[1], jnp.bfloat16, id="current-e4m3-gelu-bf16")


@pytest.mark.parametrize("name, act, dtype", list(_fp8_tolerance_cases()))
def test_fp8_within_fp8_tolerance(name, act, dtype, rng):
    """y, dx, dkernel, dbias under each recipe against the unquantized float64 reference, within
    the FP8 bound of dense_oracle (x and kernel E4M3: half a relative step of 2^-3 each; the
    gradient E5M2 (HYBRID): half of 2^-2; subnormals; then the unquantized op's own bound).
    Delayed scaling: two steps on the same inputs, the first with the fresh scale 1, the second
    with the returned set's scales (2^-margin of Q / amax). The default path only: the pure-JAX
    one is held to the exact product below (its compilation is what costs time)."""
    recipe = FP8_RECIPES[name]
    x, w, b, dy = make_operands(rng, (2, 16, 32), 32, dtype, act)
    qs = QuantizerSet.create(recipe)
    headrooms = {"delayed": [None, 4.0], "mxfp8": [2.0]}.get(name, [1.0])
    for step, headroom in enumerate(headrooms):
        outs = fp8_value_and_grads(x, w, b, qs, dy, names(act), (None,))
        fwd = do.forward(x, w, b, act, dtype, fp8=_recipe_spec(recipe, headroom))
        g = do.backward(fwd, dy)
        refs = (fwd.y.reshape(2, 16, 32), g.dx.reshape(x.shape), g.dk, g.db)
        check_outputs([o[:4] for o in outs], refs, dtype, f"{name} step {step}")
        qs = outs[0][4]


@jax.jit
def quantize_xla(a, quantizer):
    """``te_jax.quantize`` on the pure-JAX path (one compiled program, not op by op)."""
    return te_jax.quantize.quantize(a, quantizer, implementation="xla")


@functools.partial(jax.jit, static_argnames=("copy",))
def _dequantize_f32(st, copy):
    return st.dequantize(copy, jnp.float32)


def _exact_dequantized(st, copy: str) -> np.ndarray:
    """The dequantized value of one copy of a 2-D ScaledTensor, exactly, in float64 (logical
    shape)."""
    if st.scaling_mode.is_tensor_scaling:
        data = st.data if copy == "rowwise" else st.colwise_data.T
        sinv = st.scale_inv if copy == "rowwise" else st.colwise_scale_inv
        return np.asarray(data).astype(np.float64) * np.float64(np.asarray(sinv))
    # MXFP8: an E4M3/E5M2 value times a power of two is exact in float32.
    return np.asarray(_dequantize_f32(st, copy), np.float64)


@jax.jit
def _updated(quantizer, amax):
    """``quantizer.update(amax)`` in one compiled program (per quantizer structure), not op by
    op."""
    return quantizer.update(amax)


def _primed(recipe):
    """The recipe's quantizer set, delayed scales set by a previous step's amaxes (not 1)."""
    qs = QuantizerSet.create(recipe)
    if isinstance(recipe, DelayedScaling):
        qs = QuantizerSet(
            x=_updated(qs.x, jnp.float32(1.3)),
            kernel=_updated(qs.kernel, 2.7),
            grad=_updated(qs.grad, jnp.float32(2.1)),
        )
    return qs


EXACT_RECIPES = {
    "delayed": DelayedScaling(amax_history_len=2),
    "current": CurrentScaling(),
    "mxfp8": MXFP8BlockScaling(),
    "mxfp8-hybrid": MXFP8BlockScaling(fp8_format="HYBRID"),
    "blockwise": Float8BlockScaling(),
}


EXACT_CONFIGS = {
    "gemm-f32": (None, jnp.float32, jnp.float32),
    "relu-bf16": (ACT_BY_ALIAS["relu"], jnp.bfloat16, jnp.bfloat16),
    # float32 parameters under a bfloat16 step: quantized from float32, dkernel in float32
    "gemm-bf16-f32kernel": (None, jnp.bfloat16, jnp.float32),
}
ALIGNED, MISALIGNED = ((2, 16), 32, 32), ((2, 5), 7, 33)


def _exact_cases():
    """Pairwise: every recipe meets the float32 kernel in a bfloat16 step or ReLU's exact dh
    where it has its own rule, every configuration meets tensor and block scaling.
    - delayed / current (tensor scaling, the same GEMMs; current's own scale is checked in every
      case): delayed with ReLU and the float32 kernel, current with float32 and the float32
      kernel (its scale taken from float32);
    - mxfp8: every configuration (the float32 kernel takes the dequantized path there);
    - mxfp8-hybrid (only the gradient's dtype differs): ReLU, where dh goes through it;
    - blockwise (x and grad in 1×128 blocks, the kernel in 128×128 tiles, power-of-two scales:
      dequantized exactly): the float32 kernel, K and N not multiples of 16 (partial blocks);
    - K, N not multiples of 16 (MXFP8 needs multiples of 32: tensor scaling only; one recipe,
      since the fallback GEMM is the same for both and the aligned cases check each one's
      scale): ReLU and the float32 kernel."""
    pick = {
        "delayed": ["relu-bf16", "gemm-bf16-f32kernel"],
        "current": ["gemm-f32", "gemm-bf16-f32kernel"],
        "mxfp8": list(EXACT_CONFIGS),
        "mxfp8-hybrid": ["relu-bf16"],
    }
    for name, configs in pick.items():
        for c in configs:
            impls = IMPLS if (name, c) in WITH_XLA else (None,)
            yield pytest.param(name, *EXACT_CONFIGS[c], *ALIGNED, impls, id=f"{name}-{c}")
    for c in ["relu-bf16", "gemm-bf16-f32kernel"]:
        impls = IMPLS if ("delayed-7x33", c) in WITH_XLA else (None,)
        yield pytest.param("delayed", *EXACT_CONFIGS[c], *MISALIGNED, impls, id=f"delayed-7x33-{c}")
    c = "gemm-bf16-f32kernel"
    blockwise = EXACT_CONFIGS[c], MISALIGNED
    yield pytest.param("blockwise", *blockwise[0], *blockwise[1], (None,), id=f"blockwise-7x33-{c}")


# The pure-JAX path too (its program costs more than the default's) where tensor and block
# scaling, the misaligned shape and every configuration meet it once.
WITH_XLA = {
    ("current", "gemm-f32"),
    ("mxfp8-hybrid", "relu-bf16"),
    ("delayed-7x33", "gemm-bf16-f32kernel"),
}


@pytest.mark.parametrize("name, act, dtype, kernel_dtype, lead, k, n, impls", list(_exact_cases()))
def test_fp8_is_the_product_of_the_dequantized_operands(
    name, act, dtype, kernel_dtype, lead, k, n, impls, rng
):
    """SPEC §8: with the operands quantized here (te_jax.quantize, pure JAX) by the same
    quantizers, dense's y, dx and dkernel equal the float64 products of the dequantized operands
    (forward: x rowwise · kernel colwise; dgrad: grad rowwise · kernel rowwise; wgrad: x colwise
    · grad colwise) within K·2^-23·Σ|a||b| plus one ulp of the output. With ReLU, dh = dy·[h > 0]
    is exact too. Current scaling's scale is Q / max|x| of the tensor itself. The operands'
    magnitudes spread over 2^16 so that MXFP8's rowwise and colwise copies differ (using one for
    the other fails). K and N not multiples of 16 (tensor scaling; MXFP8 needs multiples of 32)
    take the float32 GEMM on the same dequantized operands, on every platform. A float32 kernel
    in a bfloat16 step is quantized from float32, and its wgrad GEMM writes dkernel in float32
    from the accumulator (no bfloat16 rounding: its bound is float32's), except MXFP8 on the
    dequantized path (the GEMM in the compute dtype). The default path in every case, the
    pure-JAX one too in WITH_XLA's."""
    recipe = EXACT_RECIPES[name]
    qs = _primed(recipe)
    x, w, b, dy = (
        a if a is None else spread_magnitudes(rng, a)
        for a in make_operands(rng, (*lead, k), n, kernel_dtype, act)
    )
    x, b, dy = (a if a is None else a.astype(np_dtype(dtype)) for a in (x, b, dy))
    x2, dy2 = x.reshape(-1, k), dy.reshape(-1, n)
    quant = lambda a, role: quantize_xla(jnp.asarray(a), qs.with_layout(role, BOTH))  # noqa: E731
    qx, qk = quant(x2, "x"), quant(w, "kernel")
    if name == "current":  # scale = RN(Q / amax), scale_inv = RN(1 / scale)
        for st, a in ((qx, x2), (qk, w)):
            scale = np.float32(448.0) / np.float32(np.abs(a.astype(np.float32)).max())
            assert np.float32(np.asarray(st.scale_inv)) == np.float32(1) / scale

    h = do.dequantized_product(
        _exact_dequantized(qx, "rowwise"), _exact_dequantized(qk, "colwise"), b, dtype
    )
    y = h
    dh = dy2
    if act is not None:  # relu: exact in both directions, given the sign of every h
        if do.KERNEL_GEMM and not (np.abs(h.v) > h.e).all():
            pytest.skip("relu's sign is undecidable within the FP8 tensor cores' bound here")
        assert (np.abs(h.v) > h.e).all(), "test input: some h is within its bound of 0"
        y = do.Bounded(np.maximum(h.v, 0.0), h.e)
        dh = np.where(h.v > 0, dy2.astype(np.float64), 0.0).astype(dy2.dtype)
    qg = quant(dh, "grad")
    dx = do.dequantized_product(
        _exact_dequantized(qg, "rowwise"), _exact_dequantized(qk, "rowwise").T, None, dtype
    )
    codes = qx.scaling_mode.impl.gemm_operands == "codes"
    dk = do.dequantized_product(
        _exact_dequantized(qx, "colwise").T,
        _exact_dequantized(qg, "colwise"),
        None,
        kernel_dtype if codes else dtype,
    )
    db = do.rounded(do.colsum(do.exact(dh)), dtype)
    outs = fp8_value_and_grads(x, w, b, qs, dy, names(act), impls)
    refs = (y.reshape(*lead, n), dx.reshape(*lead, k), None, db)
    check_outputs([(*o[:2], None, o[3]) for o in outs], refs, dtype, f"{name} exact")
    for impl, o in zip(("default", "xla"), outs, strict=False):
        do.assert_bounded(o[2], dk, kernel_dtype, f"{name} exact impl={impl} dkernel")
    if len(outs) == 2:
        do.assert_agree(outs[0][2], outs[1][2], dk, f"{name} exact dkernel: default vs xla")


def _same_quantizer(got, want, what):
    assert type(got) is type(want), what
    assert got.q_dtype == want.q_dtype and got.q_layout == want.q_layout, what
    for f in ("margin", "amax_compute_algo"):
        assert getattr(got, f) == getattr(want, f), (what, f)
    np.testing.assert_array_equal(np.asarray(got.scale), np.asarray(want.scale), err_msg=what)
    np.testing.assert_array_equal(
        np.asarray(got.amax_history), np.asarray(want.amax_history), err_msg=what
    )


DELAYED_VARIANTS = {
    "max": DelayedScaling(amax_history_len=3),
    "most_recent-margin1": DelayedScaling(
        amax_history_len=3, margin=1, amax_compute_algo="most_recent"
    ),
}


# Each variant once, with and without an activation (the gradient's amax then is dh's).
@pytest.mark.parametrize(
    "variant, act",
    [("max", ACT_BY_ALIAS["gelu"]), ("most_recent-margin1", None)],
    ids=["max-gelu", "most_recent-margin1-gemm"],
)
def test_delayed_scaling_state_over_steps(variant, act, rng):
    """Four training steps (the history of 3 wraps): the cotangent of the quantizer set is the
    set updated (DelayedScaleQuantizer.update) with max|x|, max|kernel| (the kernel is given in
    float32, x in bfloat16: docs/numerics.md §8 quantizes the kernel from float32, not through
    bfloat16) and the gradient's amax max|dh|,
    dh = dact(dy, h), computed here independently; each step quantizes with the state the
    previous one returned (y against the product of operands quantized with it)."""
    recipe, dtype = DELAYED_VARIANTS[variant], jnp.bfloat16
    qs = QuantizerSet.create(recipe)
    want = qs
    for step, mag in enumerate([1.0, 3.0, 0.5, 2.0]):
        x, w, b, dy = make_operands(rng, (32, 32), 32, dtype, act)
        x = (x.astype(np.float32) * mag).astype(x.dtype)
        w32 = w.astype(np.float32) / mag + rng.uniform(-1e-3, 1e-3, w.shape)  # not bf16 values
        dy = (dy.astype(np.float32) * mag**2).astype(dy.dtype)
        y, dx, dk, db, got = fp8_value_and_grads(x, w32, b, qs, dy, names(act), (None,))[0]
        assert isinstance(got, QuantizerSet)

        assert dk.dtype == jnp.float32  # the kernel's dtype
        qx = quantize_xla(jnp.asarray(x), want.x)
        qk = quantize_xla(jnp.asarray(w32, jnp.float32), want.with_layout("kernel", BOTH))
        h = do.dequantized_product(
            _exact_dequantized(qx, "rowwise"), _exact_dequantized(qk, "colwise"), b, dtype
        )
        do.assert_bounded(y, do.activation(h, act, dtype), dtype, f"step {step} y")

        amax = lambda a: jnp.float32(np.abs(np.asarray(a, np.float32)).max())  # noqa: E731
        want_x = _updated(want.x, amax(x))
        want_k = _updated(want.kernel, amax(w32))
        _same_quantizer(got.x, want_x, f"step {step} x")
        _same_quantizer(got.kernel, want_k, f"step {step} kernel")
        if act is None:
            want_g = _updated(want.grad, amax(dy))
            _same_quantizer(got.grad, want_g, f"step {step} grad")
        else:
            dh = do.dact(do.exact(dy), h, act, dtype)
            g_amax = do.Bounded(np.abs(dh.v).max(), dh.e.max())
            want_g = _updated(want.grad, jnp.float32(g_amax.v))
            # The newest amax sits in the last slot; the rest is the history shifted.
            hist, want_hist = np.asarray(got.grad.amax_history), np.asarray(want_g.amax_history)
            np.testing.assert_array_equal(hist[:-1], want_hist[:-1], err_msg=f"step {step}")
            do.assert_within(hist[-1], g_amax.v, g_amax.e, f"step {step} grad amax")
            # update() takes the max over the history before it drops the oldest entry.
            a = hist[-1]
            if recipe.amax_compute_algo == "max":
                a = max(a, np.asarray(want.grad.amax_history).max())
            want_scale = np.float32(57344.0) / np.float32(a) / 2.0**recipe.margin
            np.testing.assert_allclose(float(got.grad.scale), want_scale, rtol=2e-7)
            want_g = got.grad  # the measured amax goes on (it is within its bound)
        want = QuantizerSet(x=want_x, kernel=want_k, grad=want_g)
        qs = got


@pytest.mark.parametrize(
    "recipe", [CurrentScaling(), MXFP8BlockScaling()], ids=["current", "mxfp8"]
)
def test_stateless_recipes_return_the_set_unchanged(recipe, rng):
    qs = QuantizerSet.create(recipe)
    x, w, b, dy = make_operands(rng, (32, 32), 32, jnp.bfloat16, ACT_BY_ALIAS["gelu"])
    for out in fp8_value_and_grads(x, w, b, qs, dy, "gelu", (None,)):
        got = out[4]
        assert isinstance(got, QuantizerSet) and jax.tree.leaves(got) == []
        for role in ("x", "kernel", "grad"):
            assert getattr(got, role) == getattr(qs, role), role


# ---- the FP8 MLP: dense -> activation(quantizer) -> dense -----------------------------------

MLP_RECIPES = {
    "delayed": (DelayedScaling(amax_history_len=4), None),
    "current": (CurrentScaling(), 1.0),
    "mxfp8": (MXFP8BlockScaling(), 2.0),
}


def _act_quantizer(recipe):
    """The quantizer of the activation's output (the second GEMM's x), rowwise and colwise."""
    if isinstance(recipe, DelayedScaling):
        return DelayedScaleQuantizer.create(recipe.forward_dtype, amax_history_len=4, q_layout=BOTH)
    if isinstance(recipe, CurrentScaling):
        return CurrentScaleQuantizer(recipe.forward_dtype, BOTH)
    return MXFP8Quantizer(recipe.forward_dtype, BOTH)


@functools.partial(jax.jit, static_argnames=("act", "impls"))
def fp8_mlp(x, w1, b1, w2, b2, qs1, q_act, qs2, dy, act, impls=IMPLS):
    """``dense(activation(dense(x, w1, b1), act, quantizer=q_act), w2, b2)`` per implementation:
    ``(out, act(h1), grads of (x, w1, b1, w2, b2, qs1, q_act, qs2))``."""
    out = []
    for impl in impls:

        def mlp(x, w1, b1, w2, b2, qs1, q_act, qs2, impl=impl):
            h1 = te_jax.dense(x, w1, b1, quantizer_set=qs1, implementation=impl)
            a = te_jax.activation(h1, act, quantizer=q_act, implementation=impl)
            act_out = te_jax.act_lu(h1, act, implementation=impl)  # what q_act quantized
            return te_jax.dense(a, w2, b2, quantizer_set=qs2, implementation=impl), (h1, act_out)

        y, vjp, aux = jax.vjp(mlp, x, w1, b1, w2, b2, qs1, q_act, qs2, has_aux=True)
        out.append((y, aux[1], vjp(dy)))
    return out


@pytest.mark.parametrize(
    "name, act, impls",
    [
        ("delayed", ACT_BY_ALIAS["swiglu"], IMPLS),
        # the default path only (the pure-JAX path's MLP once, with delayed scaling's state;
        # its block scaling in test_fp8_is_the_product_of_the_dequantized_operands)
        ("current", ACT_BY_ALIAS["gelu"], (None,)),
        ("mxfp8", ACT_BY_ALIAS["swiglu"], (None,)),
    ],
    ids=["delayed-swiglu", "current-gelu", "mxfp8-swiglu"],
)
def test_fp8_mlp(name, act, impls, rng):
    """The MLP with the activation quantizing for the second GEMM (no second quantize pass):
    values and all gradients against the unquantized float64 MLP within the FP8 bound, and the
    cotangents of the quantizers: the activation's is q.update(max|act(h1)|) (delayed), the
    second set's x quantizer gets a zero cotangent (its x arrived quantized: this call measured
    nothing for it, so a quantizer shared with the activation gets the activation's update
    alone), the kernels' and the outer gradient's are updated with their exact amaxes."""
    recipe, headroom = MLP_RECIPES[name]
    dtype, m, k, n = jnp.bfloat16, 32, 32, 32
    x, w1, b1, _ = make_operands(rng, (m, k), n, dtype, act)
    _, w2, b2, dy = make_operands(rng, (m, n), n, dtype, None)
    qs1, qs2, q_act = (
        QuantizerSet.create(recipe),
        QuantizerSet.create(recipe),
        _act_quantizer(recipe),
    )
    outs = fp8_mlp(x, w1, b1, w2, b2, qs1, q_act, qs2, dy, act.names, impls)

    spec = _recipe_spec(recipe, headroom)
    features = kernel_shape(k, n, act)[1:]
    f1 = do.forward(x, w1.reshape(k, -1), b1.reshape(-1), None, dtype, fp8=spec)
    a = do.activation(f1.y.reshape(m, *features), act, dtype)
    f2 = do.forward(spec.quantize(a, spec.fwd), w2, b2, None, dtype, fp8=spec, x_quantized=True)
    g2 = do.backward(f2, dy)
    dh1 = do.dact(g2.dx, f1.y.reshape(m, *features), act, dtype)
    g1 = do.backward(f1, dh1.reshape(m, -1))
    refs = [f2.y, g1.dx, g1.dk.reshape(w1.shape), g1.db.reshape(b1.shape), g2.dk, g2.db]
    names_ = ["out", "dx", "dw1", "db1", "dw2", "db2"]
    values = []
    for impl, (y, act_out, grads) in zip(impls, outs, strict=True):
        got = [y, *grads[:5]]
        values.append(got)
        for nm, g, r in zip(names_, got, refs, strict=True):
            do.assert_bounded(g, r, dtype, f"{name} impl={impl} {nm}")
        gq1, gq_act, gq2 = grads[5:]
        amax = lambda a: jnp.float32(np.abs(np.asarray(a, np.float32)).max())  # noqa: E731
        if isinstance(recipe, DelayedScaling):
            _same_quantizer(gq_act, _updated(q_act, amax(act_out)), f"{impl} activation quantizer")
            _same_quantizer(
                gq2.x, jax.tree.map(jnp.zeros_like, qs2.x), f"{impl} second x (no contribution)"
            )
            _same_quantizer(gq2.kernel, _updated(qs2.kernel, amax(w2)), f"{impl} second kernel")
            _same_quantizer(gq2.grad, _updated(qs2.grad, amax(dy)), f"{impl} second grad")
            _same_quantizer(gq1.x, _updated(qs1.x, amax(x)), f"{impl} first x")
            _same_quantizer(gq1.kernel, _updated(qs1.kernel, amax(w1)), f"{impl} first kernel")
            do.assert_within(
                np.asarray(gq1.grad.amax_history)[-1],
                np.abs(dh1.v).max(),
                dh1.e.max(),
                f"{impl} first grad amax",
            )
        else:
            assert jax.tree.leaves((gq1, gq_act, gq2)) == []
            assert gq_act == q_act
    if len(values) == 2:
        for nm, a, b, r in zip(names_, *values, refs, strict=True):
            do.assert_agree(a, b, r, f"{name} {nm}: default vs xla")


def test_fp8_scan_over_layers_with_stacked_quantizer_sets(rng):
    """lax.scan over 2 layers, each with its own delayed-scaling set (stacked leaf by leaf):
    the cotangent is the stack of each layer's updated set. The kernels' and the first input's
    amaxes are exact; each layer's input comes out of the scan; the gradients' amaxes are those
    of the unrolled loop."""
    dtype, layers, width, act = jnp.bfloat16, 2, 32, ACT_BY_ALIAS["gelu"]
    per = [make_operands(rng, (32, width), width, dtype, act) for _ in range(layers)]
    x, dy = per[0][0], per[-1][3]
    ws, bs = np.stack([p[1] for p in per]), np.stack([p[2] for p in per])
    recipe = DelayedScaling(amax_history_len=4)
    sets = [_primed(recipe) for _ in range(layers)]
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *sets)

    def layer(h, p):
        w, b, qs = p
        return te_jax.dense(h, w, b, "gelu", quantizer_set=qs), h

    @jax.jit
    def scanned(x, ws, bs, stacked, dy):
        y, vjp, inputs = jax.vjp(
            lambda x, p: jax.lax.scan(layer, x, p), x, (ws, bs, stacked), has_aux=True
        )
        return y, inputs, vjp(dy)[1][2]

    @jax.jit
    def unrolled(x, ws, bs, sets, dy):
        def run(x, ws, bs, sets):
            for i in range(layers):
                x = layer(x, (ws[i], bs[i], sets[i]))[0]
            return x

        y, vjp = jax.vjp(run, x, ws, bs, sets)
        return y, vjp(dy)[3]

    y, inputs, got = scanned(x, ws, bs, stacked, dy)
    y_unrolled, got_unrolled = unrolled(x, ws, bs, sets, dy)
    np.testing.assert_allclose(
        np.asarray(y, np.float32), np.asarray(y_unrolled, np.float32), rtol=2.0**-7, atol=2.0**-7
    )
    amax = lambda a: jnp.float32(np.abs(np.asarray(a, np.float32)).max())  # noqa: E731
    np.testing.assert_array_equal(np.asarray(inputs[0], np.float32), x.astype(np.float32))
    for i in range(layers):
        one = jax.tree.map(lambda a, i=i: a[i], got)
        _same_quantizer(one.x, _updated(sets[i].x, amax(inputs[i])), f"layer {i} x")
        _same_quantizer(one.kernel, _updated(sets[i].kernel, amax(ws[i])), f"layer {i} kernel")
        want_g = got_unrolled[i].grad
        np.testing.assert_allclose(
            np.asarray(one.grad.amax_history), np.asarray(want_g.amax_history), rtol=2.0**-8
        )
        np.testing.assert_allclose(float(one.grad.scale), float(want_g.scale), rtol=2.0**-8)
        assert float(one.grad.amax_history[-1]) > 0, f"layer {i}: no grad amax recorded"
