"""Quantized te_jax ops on a CPU mesh of 8 devices (run by tests/test_sharding.py in its own
process, like sharded_checks.py).

Sharded results equal the unsharded ones bit for bit: current scaling and NVFP4 quantize every
shard with the global amax (max-reduced across the mesh axes the tensor is split on), delayed
scaling returns the global amax, MXFP8 / NVFP4 block scales stay sharded with their data, and the
data is never all-gathered (the only collectives are the scalar amax max-reduction and the dbias
sum).
"""

from __future__ import annotations

import os
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import te_jax  # noqa: E402
import te_jax.flax as tef  # noqa: E402
from helpers import sharded_devices, te_jax_custom_calls  # noqa: E402
from te_jax.quantize import (  # noqa: E402
    CurrentScaleQuantizer,
    DelayedScaleQuantizer,
    Float8Block1DQuantizer,
    Float8Block2DQuantizer,
    MXFP8Quantizer,
    NVFP4Quantizer,
    QuantizeLayout,
)

DEVICES = sharded_devices(8)
MESH_1D = Mesh(DEVICES, ("x",))
MESH_2D = Mesh(DEVICES.reshape(4, 2), ("a", "b"))
BOTH = QuantizeLayout.ROWWISE_COLWISE

QUANTIZERS = {
    "delayed": lambda: DelayedScaleQuantizer.create(q_layout=BOTH),
    "current": lambda: CurrentScaleQuantizer(jnp.float8_e5m2, BOTH),
    "mxfp8": lambda: MXFP8Quantizer(jnp.float8_e4m3fn, BOTH),
    "nvfp4": lambda: NVFP4Quantizer(q_layout=BOTH),
}
FIELDS = ("data", "colwise_data", "scale_inv", "colwise_scale_inv", "amax", "global_scale_inv")


def _bits(a):
    a = np.asarray(a)
    return a.view(np.uint8) if a.dtype.itemsize == 1 and a.dtype != np.uint8 else a


def _assert_same(sharded, unsharded):
    for f in FIELDS:
        s, u = getattr(sharded, f), getattr(unsharded, f)
        assert (s is None) == (u is None), f
        if s is not None:
            s = np.asarray(s.astype(jnp.float32)) if s.dtype == jnp.float4_e2m1fn else _bits(s)
            u = np.asarray(u.astype(jnp.float32)) if u.dtype == jnp.float4_e2m1fn else _bits(u)
            np.testing.assert_array_equal(s, u, err_msg=f)


def _check_hlo(text, quantizer):
    assert "all-gather" not in text, "a sharded input was all-gathered"
    assert te_jax_custom_calls(text), "the te_jax kernel is not in the compiled module"
    if isinstance(quantizer, MXFP8Quantizer):
        assert "all-reduce" not in text, "MXFP8 needs no cross-shard reduction"


def _run(fn, mesh, spec, *args):
    shard = NamedSharding(mesh, spec)
    jitted = jax.jit(fn, in_shardings=(shard,) * len(args))
    text = jitted.lower(*args).compile().as_text()
    out = jitted(*(jax.device_put(a, shard) for a in args))
    return out, text


# (activation, global x shape, x spec, mesh)
ACT_CASES = [
    ("gelu", (16, 64, 64), P("x", None, None), MESH_1D),
    ("gelu", (4, 64, 256), P(None, None, "x"), MESH_1D),  # over H: 32 columns per shard
    ("swiglu", (8, 32, 2, 128), P("a", None, None, "b"), MESH_2D),
    ("silu", (2, 256, 64), P(None, "x", None), MESH_1D),  # rows split inside a batch
]


def _ids(cases):
    return [f"{c[0]}-{'x'.join(map(str, c[1]))}-{c[2]}" for c in cases]


@pytest.mark.parametrize("name", list(QUANTIZERS))
@pytest.mark.parametrize(("act", "shape", "spec", "mesh"), ACT_CASES, ids=_ids(ACT_CASES))
def test_act_lu_quantized_sharded(act, shape, spec, mesh, name):
    q = QUANTIZERS[name]()
    x = jax.random.normal(jax.random.key(0), shape, jnp.bfloat16) * 3
    fn = lambda x: te_jax.act_lu(x, act, quantizer=q)  # noqa: E731
    out, text = _run(fn, mesh, spec, x)
    _check_hlo(text, q)
    _assert_same(out, jax.jit(fn)(x))


@pytest.mark.parametrize("name", list(QUANTIZERS))
@pytest.mark.parametrize(("act", "shape", "spec", "mesh"), ACT_CASES, ids=_ids(ACT_CASES))
def test_quantize_dact_dbias_quantized_sharded(act, shape, spec, mesh, name):
    q = QUANTIZERS[name]()
    gated = act == "swiglu"
    x = jax.random.normal(jax.random.key(1), shape, jnp.bfloat16) * 3
    dz_shape = shape[:-2] + shape[-1:] if gated else shape
    dz = jax.random.normal(jax.random.key(2), dz_shape, jnp.bfloat16)
    dz_spec = P(*spec[:-2], spec[-1]) if gated else spec

    def fn(dz, x):
        return te_jax.quantize_dact_dbias(dz, x, act, is_dbias=True, quantizer=q)

    shard = lambda s: NamedSharding(mesh, s)  # noqa: E731
    jitted = jax.jit(fn, in_shardings=(shard(dz_spec), shard(spec)))
    text = jitted.lower(dz, x).compile().as_text()
    _check_hlo(text, None)
    (st, dbias) = jitted(jax.device_put(dz, shard(dz_spec)), jax.device_put(x, shard(spec)))
    st_u, dbias_u = jax.jit(fn)(dz, x)
    _assert_same(st, st_u)
    # dbias: float32 partial sums reduced across shards, then rounded once: within one ulp.
    np.testing.assert_allclose(
        np.asarray(dbias, np.float32), np.asarray(dbias_u, np.float32), rtol=2**-7, atol=1e-2
    )


@pytest.mark.parametrize("name", ["current", "nvfp4"])
def test_two_pass_uses_the_global_amax(name):
    """Each shard's values are far below the global max: a per-shard amax would differ."""
    q = QUANTIZERS[name]()
    x = jnp.linspace(0.01, 1.0, 16 * 64, dtype=jnp.float32).reshape(16, 64)
    x = x * jnp.arange(1, 17, dtype=jnp.float32)[:, None]
    out, _ = _run(lambda x: te_jax.quantize.quantize(x, q), MESH_1D, P("x", None), x)
    assert float(out.amax) == 16.0
    _assert_same(out, jax.jit(lambda x: te_jax.quantize.quantize(x, q))(x))


def test_vmapped_quantize_sharded_over_the_batch():
    """vmap: one tensor (scale, amax) per batch element, the batch axis sharded."""
    q = CurrentScaleQuantizer(jnp.float8_e4m3fn)
    x = jax.random.normal(jax.random.key(3), (8, 32, 64), jnp.float32)
    x = x * jnp.arange(1, 9, dtype=jnp.float32)[:, None, None]
    fn = jax.vmap(lambda x: te_jax.quantize.quantize(x, q))
    out, text = _run(fn, MESH_1D, P("x", None, None), x)
    assert "all-reduce" not in text  # each batch element lives on one shard
    _assert_same(out, jax.jit(fn)(x))
    assert out.amax.shape == (8,)


# ---- blockwise FP8 kernels on sharded inputs --------------------------------------------------

ROW, COL = QuantizeLayout.ROWWISE, QuantizeLayout.COLWISE
BLOCKWISE = {1: Float8Block1DQuantizer, 2: Float8Block2DQuantizer}

# (op, activation, x shape, x spec, mesh, block dims, layout, every split kept). A shard keeps
# its split where it holds whole blocks and its scales are a plain slice of the global ones
# (docs/numerics.md §4): only the outermost leading axis and the outermost feature axis, rows
# resp. features per shard a multiple of 4 (1D rowwise's rows, colwise's features), 128 (the
# blocked side of 1D, either side of 2D) or 512 (the padded side of 2D); else that axis is
# unsplit (the data replicated on it) and the results are still the unsharded ones.
BLOCK_CASES = [
    ("act", "gelu", (1024, 512), P("a", "b"), MESH_2D, 1, BOTH, True),
    ("act", "swiglu", (512, 2, 256), P("a", None, "b"), MESH_2D, 1, BOTH, True),
    ("act", "silu", (8, 12, 256), P("x", None, None), MESH_1D, 1, ROW, True),  # 12 rows each
    ("act", "silu", (8, 3, 256), P("x", None, None), MESH_1D, 1, ROW, False),  # 3 rows each
    ("act", "gelu", (2, 512, 256), P(None, "x", None), MESH_1D, 1, BOTH, False),  # inner rows
    ("act", "gelu", (512, 1024), P("a", "b"), MESH_2D, 2, ROW, True),
    ("act", "gelu", (512, 1024), P("a", "b"), MESH_2D, 2, BOTH, False),  # 128 rows each
    ("quantize", None, (2048, 256), P("a", "b"), MESH_2D, 2, COL, True),
    ("dact", "gelu", (1024, 512), P("a", "b"), MESH_2D, 1, BOTH, True),
    ("dact", "swiglu", (512, 2, 256), P("a", None, "b"), MESH_2D, 1, BOTH, False),  # (2, H)
    ("dact", "gelu", (512, 1024), P("a", "b"), MESH_2D, 2, ROW, True),
]


@pytest.mark.parametrize(
    ("op", "act", "shape", "spec", "mesh", "dims", "layout", "kept"),
    BLOCK_CASES,
    ids=[
        f"{c[0]}-{c[1]}-{'x'.join(map(str, c[2]))}-{c[5]}d-{c[6].name.lower()}" for c in BLOCK_CASES
    ],
)
def test_blockwise_kernels_sharded(op, act, shape, spec, mesh, dims, layout, kept):
    """Sharded blockwise FP8 equals the unsharded op bit for bit (dbias within float32
    summation order); where every split is kept, nothing is gathered."""
    q = BLOCKWISE[dims](q_layout=layout, power_2_scale=dims == 1)
    x = jax.random.normal(jax.random.key(4), shape, jnp.bfloat16) * 3
    if op == "dact":
        gated = act == "swiglu"
        dz = jax.random.normal(jax.random.key(5), shape[:-2] + shape[-1:] if gated else shape)
        args, specs = (
            (dz.astype(jnp.bfloat16), x),
            (P(*spec[:-2], spec[-1]) if gated else spec, spec),
        )

        def fn(dz, x):
            return te_jax.quantize_dact_dbias(dz, x, act, is_dbias=True, quantizer=q)

    else:
        args, specs = (x,), (spec,)

        def fn(x):
            if op == "quantize":
                return te_jax.quantize.quantize(x, q)
            return te_jax.act_lu(x, act, quantizer=q)

    shard = tuple(NamedSharding(mesh, s) for s in specs)
    jitted = jax.jit(fn, in_shardings=shard)
    text = jitted.lower(*args).compile().as_text()
    assert te_jax_custom_calls(text), "the te_jax kernel is not in the compiled module"
    if kept:
        assert "all-gather" not in text, "a split that leaves whole blocks was gathered"
    out = jitted(*(jax.device_put(a, s) for a, s in zip(args, shard, strict=True)))
    want = jax.jit(fn)(*args)
    if op != "dact":
        _assert_same(out, want)
        return
    _assert_same(out[0], want[0])
    np.testing.assert_allclose(
        np.asarray(out[1], np.float32), np.asarray(want[1], np.float32), rtol=2**-7, atol=1e-2
    )


@pytest.mark.parametrize("dims", [1, 2])
def test_vmapped_blockwise_sharded_over_the_batch(dims):
    """vmap: each batch element its own [M, N] (odd: 130 x 260), the batch axis sharded, no
    collective; the kernel's results are the pure-JAX path's."""
    q = BLOCKWISE[dims](q_layout=BOTH)
    x = jax.random.normal(jax.random.key(6), (8, 130, 260), jnp.float32)
    fn = jax.vmap(lambda x: te_jax.quantize.quantize(x, q))
    out, text = _run(fn, MESH_1D, P("x", None, None), x)
    assert te_jax_custom_calls(text) and "all-gather" not in text and "all-reduce" not in text
    _assert_same(out, jax.jit(fn)(x))
    ref = jax.vmap(lambda x: te_jax.quantize.quantize(x, q, implementation="xla"))
    _assert_same(out, jax.jit(ref)(x))


# ---- blockwise FP8 under Flax's logical axis rules ------------------------------------------

# FSDP x TP (2 x 4): wi (H, 2, I) split on H over "data" and on I over "tensor", x's batch over
# "data"; every shard a whole number of 128-blocks: H / 2, I / 4 and (batch / 2) x seq are 128.
BLOCK_MESH = Mesh(DEVICES.reshape(2, 4), ("data", "tensor"))
BLOCK_RULES = te_jax.sharding.MeshResource(fsdp_resource="data", tp_resource="tensor")


def _blockwise_mlp(x, inter):
    """A LayerNormMLP under Float8BlockScaling: ``(params, their logical specs, step)``, the
    step giving the output and the gradients of the parameters and of x."""
    model = tef.LayerNormMLP(
        inter,
        activations=("silu", "linear"),
        use_bias=True,
        recipe=te_jax.recipe.Float8BlockScaling(),
    )
    variables = jax.jit(model.init)(jax.random.key(0), x)

    def step(params, x):
        def loss(p, x):
            out, _ = model.apply({"params": p}, x)
            return jnp.sum(jnp.square(out.astype(jnp.float32))), out

        (_, out), grads = jax.value_and_grad(loss, (0, 1), has_aux=True)(params, x)
        return out, grads

    with nn.logical_axis_rules(BLOCK_RULES.logical_axis_rules()):
        specs = nn.logical_to_mesh(nn.get_partition_spec(variables))["params"]
    return nn.meta.unbox(variables["params"]), specs, step


def _sharded(step, params, specs, x):
    shard = lambda s: NamedSharding(BLOCK_MESH, s)  # noqa: E731
    p_sh = jax.tree.map(shard, specs, is_leaf=lambda s: isinstance(s, P))
    x_sh = shard(P("data", None, None))
    jitted = jax.jit(step, in_shardings=(p_sh, x_sh))
    with jax.set_mesh(BLOCK_MESH), nn.logical_axis_rules(BLOCK_RULES.logical_axis_rules()):
        compiled = jitted.lower(params, x).compile()
    return compiled(jax.device_put(params, p_sh), jax.device_put(x, x_sh))


def test_blockwise_step_under_fsdp_and_tp():
    """A blockwise FP8 LayerNormMLP step under FSDP x TP, every block within one shard: the
    output and every gradient equal the unsharded step's within 2^-5 (relative 2-norm; seen:
    0.3% for the output, up to 1.6% for dx). A split contraction (the row-parallel wo, the
    dgrad over I) sums in another order, which moves some values across an FP8 rounding
    boundary: one code step there, where the FP8 step's own distance from bf16 is ~2^-4."""
    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 128, 256)), jnp.bfloat16)
    params, specs, step = _blockwise_mlp(x, 512)
    want = jax.jit(step)(params, x)
    got = _sharded(step, params, specs, x)
    for (path, g), w in zip(
        jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want), strict=True
    ):
        g64, w64 = np.asarray(g, np.float64), np.asarray(w, np.float64)
        err = np.linalg.norm(g64 - w64) / max(np.linalg.norm(w64), 1e-30)
        assert err <= 2**-5, (jax.tree_util.keystr(path), err)


@pytest.mark.parametrize(
    ("shape", "inter", "match"),
    [
        ((2, 128, 256), 320, r"the kernel's output axes \(kernel axis 2, logical 'mlp', size 320"),
        ((2, 96, 256), 512, r"x's rows \(x axis 0, logical 'batch', size 2.* = 96 elements"),
        ((2, 128, 192), 512, r"contracting axes \(kernel axis 0, logical 'embed', size 192"),
    ],
    ids=["intermediate", "rows", "hidden"],
)
def test_blockwise_block_straddling_shards_is_refused(shape, inter, match):
    """A split that would put a 128-block across two shards is a ValueError naming the axis and
    the fix when the step is traced (te_jax's rules, not a silent gather)."""
    x = jnp.zeros(shape, jnp.bfloat16)
    params, specs, step = _blockwise_mlp(x, inter)
    with pytest.raises(ValueError, match=match + r".*split that axis over fewer devices"):
        _sharded(step, params, specs, x)
