"""One training step of a 2-layer LayerNormMLP stack (Linen and NNX) on a CPU mesh of 8 devices,
sharded by te_jax.sharding.MeshResource's logical axis rules, against the same step unsharded
(run by tests/test_sharding.py in its own processes: the tests carry ``pytest.mark.part``, one
process per part, each part holding the rows that share an unsharded step).

Under DP(8), FSDP(8), TP(8), DP×TP(2×4), FSDP×TP(2×4) and TP with sequence parallelism(8), bf16 and
FP8 delayed / current, a loss not linear in the output (a softmax cross-entropy over the hidden
axis) and the FP8 state an unsharded step left: the output and every gradient equal the unsharded
step's (within a few ulps where a contraction is split and summed in another order); the next FP8
state bitwise where every shard computes whole rows (DP, FSDP) and, under every strategy, for the
kernels and the first layer's input, elsewhere within STATE_BOUND of the compute dtype; and the
compiled step holds only the collectives the strategy needs: no all-gather of an activation outside
sequence parallelism; TP's data all-reduces exactly one per row-parallel GEMM per direction; FSDP's
gradients reduce-scattered; sequence parallelism's activations moved only by 2 all-gathers and 2
reduce-scatters per layer.
"""

from __future__ import annotations

import functools
import os
import re
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import te_jax  # noqa: E402
import te_jax.flax as tef  # noqa: E402
from helpers import hlo_collectives, sharded_devices  # noqa: E402
from te_jax import nnx as tnnx  # noqa: E402
from te_jax import sharding as tsh  # noqa: E402
from te_jax.sharding import MeshResource  # noqa: E402

DEVICES = sharded_devices(8)
# Sizes such that no activation (or shard of one) has the size of a parameter, of a shard of
# one, or of an FP8 amax history (1024); the sequence (8) splits over the 8-device tensor axis.
BATCH, SEQ, H, INTER = 8, 8, 48, 96
STRATEGIES = {
    "dp": ({"data": 8}, MeshResource(dp_resource="data")),
    "fsdp": ({"data": 8}, MeshResource(fsdp_resource="data")),
    "tp": ({"tensor": 8}, MeshResource(tp_resource="tensor")),
    "dp_tp": ({"data": 2, "tensor": 4}, MeshResource(dp_resource="data", tp_resource="tensor")),
    "fsdp_tp": (
        {"data": 2, "tensor": 4},
        MeshResource(fsdp_resource="data", tp_resource="tensor"),
    ),
    "tp_sp": ({"tensor": 8}, MeshResource(tpsp_resource="tensor")),
}
RECIPES = {
    "bf16": None,
    "delayed": te_jax.recipe.DelayedScaling(),
    "current": te_jax.recipe.CurrentScaling(),
}
ACTS = {"gelu": ("gelu",), "swiglu": ("silu", "linear")}
DTYPES = {"bf16": jnp.bfloat16, "f32": jnp.float32}
# How far the next FP8 state may be from the unsharded step's where a contraction is split
# (docs/sharding.md, "FP8 under sharding"): each shard rounds its partial sum to the compute
# dtype before the cross-shard sum, so every tensor downstream of a row-parallel GEMM moves.
STATE_BOUND = {"bf16": 2**-4, "f32": 2**-20}


def _mesh(axes: dict[str, int]) -> Mesh:
    return Mesh(DEVICES.reshape(tuple(axes.values())), tuple(axes))


# ---- the two families' steps -----------------------------------------------------------------


class LinenStack(nn.Module):
    recipe: object
    act: tuple[str, ...]

    @nn.compact
    def __call__(self, x):
        for i in range(2):
            y, _ = tef.LayerNormMLP(
                INTER, activations=self.act, use_bias=True, recipe=self.recipe, name=f"mlp{i}"
            )(x)
            x = x + y
        return x


class NNXStack(nnx.Module):
    def __init__(self, recipe, act, rngs):
        self.layers = nnx.List(
            [
                tnnx.LayerNormMLP(
                    H, INTER, activations=act, use_bias=True, recipe=recipe, rngs=rngs
                )
                for _ in range(2)
            ]
        )

    def __call__(self, x):
        for layer in self.layers:
            x = x + layer(x)[0]
        return x


def _xent(out, labels):
    """A softmax cross-entropy over the hidden axis: a loss not linear in the output."""
    logp = jax.nn.log_softmax(out.astype(jnp.float32), axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, labels[..., None], axis=-1))


def _linen(recipe, act, x):
    model = LinenStack(recipe, act)
    variables = jax.jit(model.init)(jax.random.key(0), x)  # one program, not one per eager op

    def step(variables, x, labels):
        def loss(v, x):
            out = model.apply(v, x)
            return _xent(out, labels), out

        (_, out), grads = jax.value_and_grad(loss, has_aux=True)(variables, x)
        return out, grads

    def specs(variables, rules):  # Flax's own API: logical names, then the rules
        return nn.logical_to_mesh(nn.get_partition_spec(variables), rules)

    return variables, step, specs


def _nnx(recipe, act, x):
    model = NNXStack(recipe, act, nnx.Rngs(0))
    graphdef, state = nnx.split(model)

    def step(state, x, labels):
        def loss(s, x):
            out = nnx.merge(graphdef, s)(x)
            return _xent(out, labels), out

        (_, out), grads = jax.value_and_grad(loss, has_aux=True)(state, x)
        return out, grads

    def specs(state, rules):  # Flax's own API: the rules applied to the names
        with nnx.logical_axis_rules(rules):
            return nnx.get_partition_spec(state)

    return state, step, specs


FAMILIES = {"linen": _linen, "nnx": _nnx}


def _inputs(dtype="bf16"):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((BATCH, SEQ, H)), DTYPES[dtype])
    labels = jnp.asarray(rng.integers(0, H, (BATCH, SEQ)), jnp.int32)
    return x, labels


def _leaves(tree):
    return jax.tree_util.tree_leaves_with_path(tree)


# The FP8 state (Linen's fp8_metas, NNX's FP8Meta variables): its "gradient" is the next state.
_FP8_STATE = re.compile(r"amax_history'|_scale'\]")
# FP8 state that is a maximum of the same values sharded or not: every kernel's, and the first
# layer's input's (Linen's fp8_metas names and NNX's FP8Meta paths).
_BITWISE = re.compile(
    r"kernel_(amax_history|scale)'\]|mlp0'\]\['wi_x_|\[0\]\['wi_quantizers'\]\['x_"
)


@functools.cache
def _unsharded(family, recipe, act, dtype="bf16"):
    """(state, step, partition_spec, unsharded (out, grads)) of one stack, its FP8 state the one
    an unsharded step left (so the step quantizes with scales from a past step): the
    strategies of a (family, recipe, act, dtype) share it, and the FP8 rows' noise reads the
    bf16 one. One compiled program: the step that leaves the state is the one compared."""
    x, labels = _inputs(dtype)
    state, step, partition_spec = FAMILIES[family](RECIPES[recipe], ACTS[act], x)
    jitted = jax.jit(step)
    if recipe == "delayed":
        _, grads = jitted(state, x, labels)
        state = jax.tree_util.tree_map_with_path(
            lambda p, s, g: g if _FP8_STATE.search(jax.tree_util.keystr(p)) else s, state, grads
        )
    return state, step, partition_spec, jitted(state, x, labels)


def _sharded_step(family, recipe, strategy, act, dtype):
    """(unsharded (out, grads), sharded (out, grads), compiled text, state)."""
    x, labels = _inputs(dtype)
    state, cached_step, partition_spec, want = _unsharded(family, recipe, act, dtype)
    # A new function: jax's trace cache, keyed on the function, does not see Flax's logical
    # axis rules, and a trace under another strategy's rules would be reused.
    step = lambda *args: cached_step(*args)  # noqa: E731
    axes, resource = STRATEGIES[strategy]
    mesh = _mesh(axes)
    resource.check_mesh(mesh)
    specs = partition_spec(state, resource.logical_axis_rules())
    shard = lambda spec: NamedSharding(mesh, spec)  # noqa: E731
    state_sh = jax.tree.map(shard, specs, is_leaf=lambda s: isinstance(s, P))
    batch = resource.batch_axes
    batch = batch[0] if len(batch) == 1 else (batch or None)
    act_sh = shard(P(batch, resource.sp_resource, None))  # (batch, sequence, hidden)
    labels_sh = shard(P(batch, resource.sp_resource))
    jitted = jax.jit(
        step,
        in_shardings=(state_sh, act_sh, labels_sh),
        out_shardings=(act_sh, state_sh),
    )
    placed = (
        jax.device_put(state, state_sh),
        jax.device_put(x, act_sh),
        jax.device_put(labels, labels_sh),
    )
    # The Flax pattern: a mesh and the logical axis rules around the step (te_jax constrains
    # each kernel's gradient to the kernel's sharding with them).
    with jax.set_mesh(mesh), nn.logical_axis_rules(resource.logical_axis_rules()):
        compiled = jitted.lower(state, x, labels).compile()
    # The executable whose text is checked runs the step (jitted(...) would compile it again).
    return want, compiled(*placed), compiled.as_text(), state


def _assert_step_equal(got, want, recipe, noise=None, *, whole_rows=False, dtype="bf16"):
    """out and every gradient against the unsharded step: bf16 within a bf16 rounding of
    float32 sums taken in another order; FP8 within the FP8 step's own quantization noise
    (``noise``: its distance from the bf16 step, leaf by leaf: a split sum can move a value
    across an FP8 rounding boundary, one code step). The next FP8 state: bitwise where it is a
    maximum of the same values (the kernels', the first layer's input's; every one where each
    shard computes whole rows, ``whole_rows``), each other value within STATE_BOUND[dtype]."""
    noise = noise or {}
    for (path, g), (_, w) in zip(_leaves(got), _leaves(want), strict=True):
        name = jax.tree_util.keystr(path)
        g64, w64 = np.asarray(g, np.float64), np.asarray(w, np.float64)
        assert g64.shape == w64.shape, name
        if _FP8_STATE.search(name):
            assert g.sharding.is_fully_replicated, name
            if whole_rows or _BITWISE.search(name):
                np.testing.assert_array_equal(g64, w64, err_msg=name)
            else:
                err = np.max(np.abs(g64 - w64) / np.maximum(np.abs(w64), 1e-30))
                assert err <= STATE_BOUND[dtype], f"{name}: relative difference {err:.3g}"
            continue
        rtol = 2**-7 if recipe == "bf16" else max(2**-6, noise.get(name, 2**-4))
        err = np.linalg.norm(g64 - w64) / max(np.linalg.norm(w64), 1e-30)
        assert err <= rtol, f"{name}: relative error {err:.3g} > {rtol:.3g}"


def _fp8_noise(fp8, bf16) -> dict[str, float]:
    """Per leaf of the (out, grads) pair present in both: ||fp8 - bf16|| / ||fp8||."""
    ref = {jax.tree_util.keystr(p): v for p, v in _leaves(bf16)}
    out = {}
    for p, v in _leaves(fp8):
        name = jax.tree_util.keystr(p)
        if name in ref and np.shape(ref[name]) == np.shape(v):
            a, b = np.asarray(v, np.float64), np.asarray(ref[name], np.float64)
            out[name] = float(np.linalg.norm(a - b) / max(np.linalg.norm(a), 1e-30))
    return out


# (family, recipe, strategy, act, x dtype), pairwise rather than the product (each row compiles
# a step; an FP8 delayed one costs three bf16 ones). Every strategy meets bf16 (its collective
# checks without FP8); each FP8 recipe meets the data, FSDP and tensor axis roles (the 2-D
# meshes hold every role the 1-D ones do) and delayed scaling sequence parallelism, a whole-rows
# strategy (every FP8 state bitwise) and the float32 compute dtype. NNX computes what Linen does
# (tests/test_module_parity.py): its rows on the 2-D meshes only, bf16 and delayed (its FP8
# state; current scaling holds none). The gated MLP, wi (H, 2, I) split on I with each shard
# holding both halves of its columns, meets the tensor axis in bf16 and delayed.
CASES = [
    ("linen", "bf16", "dp", "gelu", "bf16"),
    ("linen", "bf16", "fsdp", "gelu", "bf16"),
    ("linen", "bf16", "tp", "gelu", "bf16"),
    ("linen", "bf16", "tp_sp", "gelu", "bf16"),
    ("linen", "current", "tp", "gelu", "bf16"),
    ("linen", "current", "fsdp_tp", "gelu", "bf16"),
    ("linen", "delayed", "dp", "gelu", "bf16"),
    ("linen", "delayed", "tp_sp", "gelu", "bf16"),
    ("nnx", "bf16", "dp_tp", "swiglu", "bf16"),
    ("nnx", "bf16", "fsdp_tp", "swiglu", "bf16"),
    ("nnx", "delayed", "fsdp_tp", "swiglu", "bf16"),
    ("linen", "delayed", "dp_tp", "gelu", "f32"),
]


# The processes (tests/test_sharding.py) the rows run in: a family's rows, which share its
# unsharded steps (an FP8 row reads the bf16 one's), in one; each part under a minute.
def _case_part(case):
    return {"linen": 0, "nnx": 1}[case[0]]


@pytest.mark.parametrize(
    "family, recipe, strategy, act, dtype",
    [pytest.param(*c, id="-".join(c), marks=pytest.mark.part(_case_part(c))) for c in CASES],
)
def test_step_equals_unsharded(family, recipe, strategy, act, dtype):
    want, got, text, state = _sharded_step(family, recipe, strategy, act, dtype)
    noise = None
    if recipe != "bf16":
        noise = _fp8_noise(want, _unsharded(family, "bf16", act, dtype)[3])
    _assert_step_equal(got, want, recipe, noise, whole_rows="tp" not in strategy, dtype=dtype)

    # Parameters and their shards by size (dense folds a gated kernel's (2, I) into 2I).
    param_sizes = {int(np.prod(a.shape)) // d for a in jax.tree.leaves(state) for d in (1, 2, 4, 8)}
    colls = hlo_collectives(text)
    data = [(op, s) for op, s in colls if s not in ((), (1,))]  # not an amax / scalar
    kinds = {op for op, _ in data}
    assert kinds <= {"all-gather", "all-reduce", "reduce-scatter"}, kinds
    act_size = BATCH * SEQ * H  # the block's activations (B, S, H), whole
    if strategy == "tp_sp":
        # The block's input all-gathered forward and its output gradient backward, its output
        # reduce-scattered forward and its input gradient backward: 2 and 2 per layer, and
        # never an all-reduce of an activation.
        moved = [(op, s) for op, s in data if int(np.prod(s)) in (act_size, act_size // 8)]
        kinds = sorted(op for op, _ in moved)
        assert kinds == ["all-gather"] * 4 + ["reduce-scatter"] * 4, moved
        return
    # No activation is ever all-gathered: every all-gather result is a parameter's shape.
    for op, s in data:
        if op == "all-gather":
            assert int(np.prod(s)) in param_sizes, f"all-gather of an activation {s}"
    if strategy == "tp":
        # Row-parallel wo: one all-reduce of the output forward, one of dx backward, per layer.
        assert [op for op, _ in data] == ["all-reduce"] * 4, data
        assert all(s == (BATCH * SEQ, H) or s == (BATCH, SEQ, H) for _, s in data), data
    if strategy == "dp":
        assert "all-gather" not in kinds and "reduce-scatter" not in kinds, data
    if strategy.startswith("fsdp"):
        assert "reduce-scatter" in kinds, data


@pytest.mark.part(0)
def test_bad_mesh_is_refused():
    """A mesh axis that does not divide the dimension it splits (a sequence of 5 over 8): a
    ValueError naming the dimension when the step is compiled, never a wrong result."""
    x, labels = _inputs()
    state, step, _, _ = _unsharded("linen", "bf16", "gelu")  # parameters of any sequence
    x, labels = x[:, :5], labels[:, :5]
    bad = NamedSharding(_mesh({"tensor": 8}), P(None, "tensor", None))
    with pytest.raises(ValueError, match="evenly divide"):
        jax.jit(step, in_shardings=(None, bad, None)).lower(state, x, labels).compile()


@pytest.mark.part(1)
@pytest.mark.parametrize("recipe", ["bf16", "delayed", "current"])
def test_shard_map_on_local_shards(recipe):
    """A Megatron MLP written with shard_map (its default check_vma=True: te_jax's ops carry
    varying-axes types): each device runs te_jax.dense on its local shards (column parallel,
    then row parallel and an explicit psum). The sharded function and its gradients (taken
    outside shard_map; the replicated weights' gradients summed over the data axis by JAX)
    equal the unsharded MLP's. Delayed scaling: the next FP8 state (the quantizer sets'
    cotangent) comes out replicated (each amax max-reduced over the axes its tensor varies
    on), the kernels' and x's bitwise the unsharded step's, the rest within STATE_BOUND."""
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((16, H)), jnp.bfloat16)
    w1 = jnp.asarray(rng.standard_normal((H, INTER)) / np.sqrt(H), jnp.bfloat16)
    w2 = jnp.asarray(rng.standard_normal((INTER, H)) / np.sqrt(INTER), jnp.bfloat16)
    qs = tuple(te_jax.QuantizerSet.create(RECIPES[recipe]) for _ in range(2))
    if recipe == "delayed":  # scales from a past step, so the state's scale is used
        qs = tuple(
            te_jax.QuantizerSet(
                x=s.x.update(jnp.float32(3.0)),
                kernel=s.kernel.update(jnp.float32(0.5)),
                grad=s.grad.update(jnp.float32(40.0)),
            )
            for s in qs
        )
    mesh = _mesh({"data": 2, "tensor": 4})

    def mlp(x, w1, w2, qs):
        h = te_jax.dense(x, w1, activation_type="gelu", quantizer_set=qs[0])
        return te_jax.dense(h, w2, quantizer_set=qs[1])

    def local(x, w1, w2, qs):
        return jax.lax.psum(mlp(x, w1, w2, qs), "tensor")  # the row-parallel GEMM's all-reduce

    specs = (P("data", None), P(None, "tensor"), P("tensor", None), P())
    sharded = jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=P("data", None))

    @functools.partial(jax.jit, static_argnums=0)
    def out_and_grads(fn, w1, w2, qs):  # one program for the output and the gradients
        def loss(w1, w2, qs):
            out = fn(x, w1, w2, qs)
            return jnp.sum(out.astype(jnp.float32) ** 2), out

        (_, out), grads = jax.value_and_grad(loss, (0, 1, 2), has_aux=True)(w1, w2, qs)
        return out, grads

    out, grads = out_and_grads(sharded, w1, w2, qs)
    want_out, want = out_and_grads(mlp, w1, w2, qs)
    rtol = 2**-6 if recipe == "bf16" else 2**-3
    for g, w in [(out, want_out), *zip(grads[:2], want[:2], strict=True)]:
        g64, w64 = np.asarray(g, np.float64), np.asarray(w, np.float64)
        err = np.linalg.norm(g64 - w64) / np.linalg.norm(w64)
        assert err <= rtol, err
    states = _leaves(grads[2]), _leaves(want[2])
    assert len(states[0]) == len(states[1]) == (12 if recipe == "delayed" else 0)
    for (path, g), (_, w) in zip(*states, strict=True):
        assert g.sharding.is_fully_replicated
        g64, w64 = np.asarray(g, np.float64), np.asarray(w, np.float64)
        name = jax.tree_util.keystr(path)
        # the kernels' and the first GEMM's input: maxima of the same values
        if ".kernel." in name or name.startswith("[0].x."):
            np.testing.assert_array_equal(g64, w64, err_msg=name)
        else:  # downstream of the bf16 partial sums each shard rounds before the psum
            err = np.max(np.abs(g64 - w64) / np.maximum(np.abs(w64), 1e-30))
            assert err <= STATE_BOUND["bf16"], f"{name}: relative difference {err:.3g}"


# Each option once: the norm with bf16, and FP8 (current scaling: its gradient quantized, with the
# amax of every shard, before the dgrad GEMM) without the norm, the case only the gather's own
# backward holds to the sequence split. (The whole step under delayed scaling and sequence
# parallelism is a row of test_step_equals_unsharded.)
@pytest.mark.part(1)
@pytest.mark.parametrize(
    "norm, recipe", [(True, "bf16"), (False, "current")], ids=["norm-bf16", "no_norm-current"]
)
def test_sequence_parallel_backward_alone(norm, recipe):
    """The backward of one sequence-parallel LayerNormMLP block compiled on its own (jax.vjp's
    backward function, its residuals taken from a sharded forward): it all-gathers the output
    gradient once and reduce-scatters the input gradient once (the transposes of the block's
    own all-gather / reduce-scatter), never all-reduces an activation, and returns dx split
    along the sequence and equal to the unsharded backward's. Without the norm nothing else
    holds the input gradient to the sequence split, so only the gather's own backward asks
    for the reduce-scatter (the whole step's count hides its absence)."""
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((BATCH, SEQ, H)), jnp.bfloat16)
    dy = jnp.asarray(rng.standard_normal((BATCH, SEQ, H)), jnp.bfloat16)

    def block(recipe):
        m = tef.LayerNormMLP(
            INTER,
            activations=ACTS["swiglu"],
            use_bias=True,
            enable_layernorm=norm,
            recipe=RECIPES[recipe],
        )
        return m, jax.jit(m.init)(jax.random.key(0), x)

    def vjp(m):
        return jax.jit(lambda v, x: jax.vjp(lambda v, x: m.apply(v, x)[0], v, x)[1])

    backward = jax.jit(lambda vjp_fn, g: vjp_fn(g))
    m, variables = block(recipe)
    want = backward(vjp(m)(variables, x), dy)
    mesh = _mesh({"tensor": 8})
    rules = MeshResource(tpsp_resource="tensor").logical_axis_rules()
    shard = lambda spec: NamedSharding(mesh, spec)  # noqa: E731
    specs = nn.logical_to_mesh(nn.get_partition_spec(variables), rules)
    var_sh = jax.tree.map(shard, specs, is_leaf=lambda s: isinstance(s, P))
    act_sh = shard(P(None, "tensor", None))
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        vjp_fn = vjp(m)(jax.device_put(variables, var_sh), jax.device_put(x, act_sh))
        dy_sh = jax.device_put(dy, act_sh)
        compiled = backward.lower(vjp_fn, dy_sh).compile()
    text = compiled.as_text()
    got = compiled(vjp_fn, dy_sh)
    moved = [(op, s) for op, s in hlo_collectives(text) if int(np.prod(s)) in (x.size, x.size // 8)]
    assert sorted(op for op, _ in moved) == ["all-gather", "reduce-scatter"], moved
    assert got[1].sharding.is_equivalent_to(act_sh, x.ndim), got[1].sharding
    noise = None
    if recipe != "bf16":
        m16, v16 = block("bf16")
        noise = _fp8_noise(want, backward(vjp(m16)(v16, x), dy))
    _assert_step_equal(got, want, recipe, noise)


LOGICAL_CASES = {
    "dp_tp": (
        MeshResource(dp_resource="data", tp_resource="tensor"),
        (tsh.BATCH, None, tsh.MLP),
        P("data", None, "tensor"),
    ),
    "dp_sp": (
        MeshResource(dp_resource="data", tp_resource="tensor", sp_resource="tensor"),
        (tsh.BATCH, tsh.LENGTH, tsh.EMBED),
        P("data", "tensor", None),
    ),
    "fsdp": (
        MeshResource(fsdp_resource="data"),
        (tsh.LENGTH, None, tsh.EMBED),
        P(None, None, "data"),
    ),
}


@pytest.mark.part(0)
@pytest.mark.parametrize("case", list(LOGICAL_CASES))
def test_logical_constraint_shards_by_the_rules(case):
    """te_jax.sharding.logical_constraint under a mesh and MeshResource's rules: a replicated
    input comes out of the jitted function with the sharding its logical names map to (and the
    names the rules leave unmapped replicated), its values unchanged."""
    resource, axes, spec = LOGICAL_CASES[case]
    mesh = _mesh({"data": 2, "tensor": 4})
    x = jnp.arange(8 * 4 * 16, dtype=jnp.float32).reshape(8, 4, 16)
    with jax.set_mesh(mesh), nn.logical_axis_rules(resource.logical_axis_rules()):
        y = jax.jit(lambda x: te_jax.sharding.logical_constraint(x * 2, axes))(x)
    assert y.sharding.is_equivalent_to(NamedSharding(mesh, spec), x.ndim), y.sharding
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x) * 2)
