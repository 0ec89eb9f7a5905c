"""The GEMM primitive sharded on a CPU mesh of 8 devices (run by tests/test_sharding.py in its
own process). The partition is the one the CUDA kernel runs under (the CPU's local product is
the pure-JAX one): each layout gives the unsharded result and compiles to exactly the
collectives its strategy needs (te_jax.primitives.gemm.sharding's docstring):

    data parallel, column parallel       none
    row parallel (k split)               one all-reduce of the output
    FSDP forward (weight split on data)  one all-gather, of the weight
    wgrad over data-split rows           one all-reduce (DP) or one reduce-scatter (FSDP)
"""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from helpers import hlo_collectives, sharded_devices  # noqa: E402
from te_jax.primitives.gemm import GemmEpilogue, GemmScaleMode, bind_gemm  # noqa: E402
from te_jax.primitives.gemm.checks import block_scale_shape  # noqa: E402
from te_jax.quantize import formats  # noqa: E402

DEVICES = sharded_devices(8)
MESH_1D = Mesh(DEVICES, ("x",))
MESH_2D = Mesh(DEVICES.reshape(2, 4), ("data", "tensor"))
M, K, N = 64, 32, 48


def counts(text: str) -> dict[str, int]:
    """Collectives of a compiled module by kind."""
    out: dict[str, int] = {}
    for op, _ in hlo_collectives(text):
        out[op] = out.get(op, 0) + 1
    return out


def _run(mesh, specs, out_specs, fn, *args):
    """``fn`` jitted with the given operand and result shardings: (compiled text, results)."""
    shard = lambda s: NamedSharding(mesh, s)  # noqa: E731
    jitted = jax.jit(
        fn,
        in_shardings=tuple(shard(s) for s in specs),
        out_shardings=tuple(shard(s) for s in out_specs),
    )
    placed = [jax.device_put(a, shard(s)) for a, s in zip(args, specs, strict=True)]
    return jitted.lower(*args).compile().as_text(), jitted(*placed)


def _operands(rng, lhs_shape, rhs_shape, dtype=jnp.float32):
    lhs = jnp.asarray(rng.uniform(-1, 1, lhs_shape), dtype)
    rhs = jnp.asarray(rng.uniform(-1, 1, rhs_shape) / np.sqrt(K), dtype)
    return lhs, rhs


def _close(got, want):
    """float32 products: XLA:CPU's dot sums in an order that depends on the block shape, and
    a split k adds partial sums in another order: a few ulps of the result."""
    g, w = np.asarray(got, np.float64), np.asarray(want, np.float64)
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5 * np.abs(w).max())


@pytest.fixture
def rng(request):
    return np.random.default_rng(abs(hash(request.node.name)) % 2**32)


# (name, mesh, lhs spec, rhs spec, out spec, lhs_trans, expected collectives: kind -> count)
FORWARD = [
    ("dp", MESH_1D, P("x", None), P(None, None), P("x", None), {}),
    ("column", MESH_1D, P(None, None), P(None, "x"), P(None, "x"), {}),
    ("row", MESH_1D, P(None, "x"), P("x", None), P(None, None), {"all-reduce": 1}),
    ("fsdp", MESH_1D, P("x", None), P("x", None), P("x", None), {"all-gather": 1}),
    ("dp_tp_column", MESH_2D, P("data", None), P(None, "tensor"), P("data", "tensor"), {}),
    (
        "dp_tp_row",
        MESH_2D,
        P("data", "tensor"),
        P("tensor", None),
        P("data", None),
        {"all-reduce": 1},
    ),
    (
        "fsdp_tp_column",
        MESH_2D,
        P("data", None),
        P("data", "tensor"),
        P("data", "tensor"),
        {"all-gather": 1},
    ),
]


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("case", FORWARD, ids=[c[0] for c in FORWARD])
def test_forward_layouts(case, bias, rng):
    """x (M, K) · w (K, N) + b under each layout: the unsharded result, and only the expected
    collectives (an all-gather only ever of the weight, never of x)."""
    name, mesh, ls, rs, os_, want = case
    lhs, rhs = _operands(rng, (M, K), (K, N))
    b = jnp.asarray(rng.uniform(-1, 1, (N,)), jnp.float32) if bias else None
    b_spec = P(rs[1]) if bias else None

    def f(lhs, rhs, b):
        return (bind_gemm(lhs, rhs, b).out,)

    specs = (ls, rs, b_spec) if bias else (ls, rs)
    fn = f if bias else (lambda lhs, rhs: f(lhs, rhs, None))
    args = (lhs, rhs, b) if bias else (lhs, rhs)
    text, (out,) = _run(mesh, specs, (os_,), fn, *args)
    _close(out, bind_gemm(lhs, rhs, b, implementation="xla").out)
    assert counts(text) == want, hlo_collectives(text)
    for op, shape in hlo_collectives(text):  # the weight, whole (or its tensor-parallel slice)
        assert op != "all-gather" or shape[0] == K, (shape, "not the weight")


ADDEND_LAYOUTS = ["row", "dp_tp_row", "dp_tp_column", "fsdp"]


@pytest.mark.parametrize("case", [c for c in FORWARD if c[0] in ADDEND_LAYOUTS], ids=ADDEND_LAYOUTS)
def test_addend_layouts(case, rng):
    """x · w + c + b with c laid out as the output: the unsharded result and no collective
    beyond the layout's own (under a split k, c joins after the all-reduce, once)."""
    name, mesh, ls, rs, os_, want = case
    lhs, rhs = _operands(rng, (M, K), (K, N))
    b = jnp.asarray(rng.uniform(-1, 1, (N,)), jnp.float32)
    c = jnp.asarray(rng.uniform(-1, 1, (M, N)), jnp.float32)

    def f(lhs, rhs, b, c):
        return (bind_gemm(lhs, rhs, b, addend=c).out,)

    text, (out,) = _run(mesh, (ls, rs, P(rs[1]), os_), (os_,), f, lhs, rhs, b, c)
    _close(out, bind_gemm(lhs, rhs, b, addend=c, implementation="xla").out)
    assert counts(text) == want, hlo_collectives(text)


def test_addend_after_reduce_scatter(rng):
    """xᵀ · dh + c with the rows split and the result wanted split (FSDP's wgrad form): one
    reduce-scatter, then c's own shard added."""
    x, dh = _operands(rng, (M, K), (M, N))
    c = jnp.asarray(rng.uniform(-1, 1, (K, N)), jnp.float32)

    def f(x, dh, c):
        return (bind_gemm(x, dh, lhs_trans=True, addend=c).out,)

    specs = (P("x", None), P("x", None), P("x", None))
    text, (out,) = _run(MESH_1D, specs, (P("x", None),), f, x, dh, c)
    _close(out, bind_gemm(x, dh, lhs_trans=True, addend=c, implementation="xla").out)
    assert counts(text) == {"reduce-scatter": 1}, counts(text)


@pytest.mark.parametrize("fsdp", [False, True], ids=["dp", "fsdp"])
def test_wgrad_over_split_rows(fsdp, rng):
    """dkernel = xᵀ · dh with the rows split over the data axis: one all-reduce, or with the
    result wanted split (FSDP) one reduce-scatter, and no all-gather."""
    x, dh = _operands(rng, (M, K), (M, N))

    def f(x, dh):
        return (bind_gemm(x, dh, lhs_trans=True).out,)

    out_spec = P("x", None) if fsdp else P(None, None)
    text, (out,) = _run(MESH_1D, (P("x", None), P("x", None)), (out_spec,), f, x, dh)
    _close(out, bind_gemm(x, dh, lhs_trans=True, implementation="xla").out)
    got = counts(text)
    assert got == ({"reduce-scatter": 1} if fsdp else {"all-reduce": 1}), got


def test_nonlinear_epilogue_gathers_k(rng):
    """GELU in the epilogue is not linear in the product: a k split is gathered, not summed,
    and the result is the unsharded one."""
    lhs, rhs = _operands(rng, (M, K), (K, N))

    def f(lhs, rhs):
        r = bind_gemm(lhs, rhs, epilogue=GemmEpilogue.GELU_AUX)
        return r.out, r.aux

    text, (out, aux) = _run(
        MESH_1D, (P(None, "x"), P("x", None)), (P(None, None), P(None, None)), f, lhs, rhs
    )
    want = bind_gemm(lhs, rhs, epilogue=GemmEpilogue.GELU_AUX, implementation="xla")
    _close(out, want.out)
    _close(aux, want.aux)
    assert "all-reduce" not in counts(text)


def test_dgelu_dbias_over_split_rows(rng):
    """DGELU with grad_bias, rows split: dbias summed over the shards (one all-reduce)."""
    dy, w = _operands(rng, (M, K), (N, K))
    aux = jnp.asarray(rng.uniform(-2, 2, (M, N)), jnp.float32)

    opts = dict(rhs_trans=True, epilogue=GemmEpilogue.DGELU, grad_bias=True)

    def f(dy, w, aux):
        r = bind_gemm(dy, w, aux=aux, **opts)
        return r.out, r.dbias

    text, (out, db) = _run(
        MESH_1D, (P("x", None), P(None, None), P("x", None)), (P("x", None), P(None)), f, dy, w, aux
    )
    want = bind_gemm(dy, w, aux=aux, implementation="xla", **opts)
    _close(out, want.out)
    _close(db, want.dbias)
    assert counts(text) == {"all-reduce": 1}


@pytest.mark.parametrize("layout", ["dp", "row"])
def test_fp8_operands(layout, rng):
    """FP8 operands in the TN form with their scales (replicated): data parallel needs nothing,
    row parallel one all-reduce; the unsharded product either way."""
    lhs32, rhs32 = _operands(rng, (M, K), (N, K))
    lhs = lhs32.astype(formats.E4M3)
    rhs = (rhs32 * 8).astype(formats.E4M3)
    ls, rs = jnp.full((1,), 0.5, jnp.float32), jnp.full((1,), 0.125, jnp.float32)

    opts = dict(rhs_trans=True, out_dtype=jnp.float32)

    def f(lhs, rhs, ls, rs):
        return (bind_gemm(lhs, rhs, lhs_scale_inv=ls, rhs_scale_inv=rs, **opts).out,)

    specs = {
        "dp": (P("x", None), P(None, None)),
        "row": (P(None, "x"), P(None, "x")),
    }[layout]
    out_spec = P("x", None) if layout == "dp" else P(None, None)
    text, (out,) = _run(MESH_1D, specs + (P(None), P(None)), (out_spec,), f, lhs, rhs, ls, rs)
    want = bind_gemm(lhs, rhs, lhs_scale_inv=ls, rhs_scale_inv=rs, implementation="xla", **opts)
    _close(out, want.out)
    got = counts(text)
    # dp: each shard's rows are whole; row: the product's sum over the split K.
    assert got == ({} if layout == "dp" else {"all-reduce": 1}), got


def test_uneven_split_is_refused(rng):
    """A sharding that splits a GEMM dimension unevenly (12 rows over 8 devices, which XLA
    would pad) reaches the partition only through a constraint: an error naming the dimension,
    never a computation on padding."""
    lhs, rhs = _operands(rng, (12, K), (K, N))

    def f(lhs, rhs):
        lhs = jax.lax.with_sharding_constraint(lhs, NamedSharding(MESH_1D, P("x", None)))
        return bind_gemm(lhs, rhs).out

    with pytest.raises(Exception, match=r"M \(rows\) has size 12, which mesh axes \('x',\)"):
        jax.jit(f)(lhs, rhs)


BLOCK_MODES = (GemmScaleMode.BLOCK_1D, GemmScaleMode.BLOCK_2D)  # x's 1x128, a kernel's 128x128


def _block_gemm(lhs, rhs, sl, sr):
    """The block-scaled FP8 GEMM of lhs (M, K) and rhs stored (N, K), float32 out."""
    out = bind_gemm(
        lhs,
        rhs,
        lhs_scale_inv=sl,
        rhs_scale_inv=sr,
        rhs_trans=True,
        out_dtype=jnp.float32,
        lhs_scale_mode=BLOCK_MODES[0],
        rhs_scale_mode=BLOCK_MODES[1],
    ).out
    return (out,)


@pytest.mark.parametrize(
    "lhs_spec, rhs_spec",
    [
        (P("data", None), P(None, None)),  # rows split (130 each: re-padded to 4)
        (P(None, None), P(("data", "tensor"), None)),  # the 2D operand's rows split 8 ways
        (P("data", "tensor"), P(None, "tensor")),  # K split: a reduction of partial products
    ],
    ids=["rows", "n_8way", "rows_and_k"],
)
def test_block_scaled_operands_take_their_shards_scales(lhs_spec, rhs_spec, rng):
    """Each shard multiplies its blocks by its own block scales (cut from the whole layout and
    re-padded): the unsharded product, within float32 accumulation where K is split."""
    m, k, n = 260, 512, 1024
    lhs = jnp.asarray(rng.normal(size=(m, k)), jnp.float32).astype(formats.E4M3)
    rhs = jnp.asarray(rng.normal(size=(n, k)), jnp.float32).astype(formats.E4M3)
    sl, sr = (
        jnp.asarray(rng.uniform(0.5, 2, size=block_scale_shape(mode, rows, k)), jnp.float32)
        for mode, rows in zip(BLOCK_MODES, (m, n), strict=True)
    )

    (want,) = jax.jit(_block_gemm)(lhs, rhs, sl, sr)
    specs = (lhs_spec, rhs_spec, P(None, None), P(None, None))
    _, (got,) = _run(MESH_2D, specs, (P(None, None),), _block_gemm, lhs, rhs, sl, sr)
    if lhs_spec[1] is None:
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    else:  # partial products reduced: float32 accumulation in another order
        mags = np.abs(np.asarray(lhs.astype(jnp.float32), np.float64)) * 2.0
        bound = k * 2.0**-23 * (mags @ (np.abs(np.asarray(rhs.astype(jnp.float32))) * 2.0).T)
        assert np.all(np.abs(np.asarray(got, np.float64) - np.asarray(want)) <= 2 * bound)


def test_block_scaled_split_must_leave_whole_blocks(rng):
    m, k, n = 128, 256, 256  # the 2D rhs's rows split 8 ways: 32-row shards
    lhs = jnp.ones((m, k), formats.E4M3)
    rhs = jnp.ones((n, k), formats.E4M3)
    sl, sr = (
        jnp.ones(block_scale_shape(md, r, k), jnp.float32)
        for md, r in zip(BLOCK_MODES, (m, n), strict=True)
    )

    specs = (P(None, None), P(("data", "tensor"), None), P(None, None), P(None, None))
    with pytest.raises(Exception, match="not a multiple of its 128-element blocks"):
        _run(MESH_2D, specs, (P(None, None),), _block_gemm, lhs, rhs, sl, sr)
