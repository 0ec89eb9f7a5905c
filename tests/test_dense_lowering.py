"""What te_jax.dense compiles to on a GPU: the bf16 GELU forward is ONE te_jax_gemm custom call
(GELU in cuBLASLt's epilogue, no separate activation kernel), and the FP8 forward + backward runs
three FP8 te_jax_gemm calls with no transpose or layout-changing copy of any operand in front of
them (the quantize kernels write the transposed copies). Read off the optimized HLO."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest

import te_jax

pytestmark = pytest.mark.skipif(
    jax.default_backend() != "gpu" or not te_jax.ffi_available("cuda"),
    reason="te_jax_gemm is a CUDA target",
)

_CALL = re.compile(
    r"^\s*%?\S+ = (?P<type>.*?) custom-call\((?P<args>[^)]*)\).*?"
    r"custom_call_target=\"(?P<target>[^\"]+)\"",
    re.M,
)
_RESHAPE_OPS = re.compile(r"^\s*%?\S+ = (?P<type>\S+) (?P<op>transpose|copy)\(", re.M)


_DEF = re.compile(r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+) = (?P<type>[^\s(]+)", re.M)


def _types(hlo: str) -> dict[str, str]:
    """HLO instruction (or parameter) name -> its result type, e.g. ``f8e4m3fn[256,512]{1,0}``."""
    return {m["name"]: m["type"] for m in _DEF.finditer(hlo)}


def _hlo(fn, *args) -> str:
    return jax.jit(fn).lower(*args).compile().as_text()


def _targets(hlo: str) -> list[str]:
    return [m["target"] for m in _CALL.finditer(hlo)]


def _inputs(m=256, k=512, n=1024, gated=False):
    ks = jax.random.split(jax.random.PRNGKey(0), 3)
    x = jax.random.normal(ks[0], (m, k), jnp.bfloat16)
    w = (jax.random.normal(ks[1], (k, 2, n) if gated else (k, n)) * 0.05).astype(jnp.bfloat16)
    b = jax.random.normal(ks[2], (2, n) if gated else (n,), jnp.bfloat16)
    return x, w, b


def test_bf16_gelu_forward_is_one_cublaslt_call():
    x, w, b = _inputs()
    hlo = _hlo(lambda x, w, b: te_jax.dense(x, w, b, "gelu"), x, w, b)
    targets = _targets(hlo)
    assert targets.count("te_jax_gemm") == 1, targets
    assert not [t for t in targets if t.startswith("te_jax_") and t != "te_jax_gemm"], targets
    assert "tanh" not in hlo, "a separate GELU computation is left in the HLO"


@pytest.mark.parametrize("recipe", ["delayed", "current"])
def test_fp8_gemms_take_quantized_operands_without_transposes(recipe):
    rec = {"delayed": te_jax.recipe.DelayedScaling(), "current": te_jax.recipe.CurrentScaling()}
    qs = te_jax.QuantizerSet.create(rec[recipe])
    x, w, b = _inputs()

    def loss(x, w, b, qs):
        return te_jax.dense(x, w, b, "gelu", quantizer_set=qs).astype(jnp.float32).sum()

    hlo = _hlo(jax.grad(loss, argnums=(0, 1, 2, 3)), x, w, b, qs)
    gemms = [m for m in _CALL.finditer(hlo) if m["target"] == "te_jax_gemm"]
    assert len(gemms) == 3, _targets(hlo)  # forward, dgrad, wgrad
    types = _types(hlo)
    for g in gemms:  # lhs and rhs are FP8 arrays
        operands = [a.strip().split()[-1].lstrip("%") for a in g["args"].split(",")[:2]]
        kinds = [types.get(o, "?") for o in operands]
        assert all(t.startswith("f8e") for t in kinds), f"not an FP8 GEMM: {operands} {kinds}"
    moved = [
        m.group(0)
        for m in _RESHAPE_OPS.finditer(hlo)
        if m["type"].startswith(("f8", "bf16"))
        and "[]" not in m["type"]
        and re.search(r"\[\d+,\d+", m["type"])
    ]
    assert not moved, "transposes / layout copies in the FP8 dense:\n" + "\n".join(moved)


@pytest.mark.parametrize("fprop_split", [None, False], ids=["default", "fprop_fast"])
def test_fp8_gemms_accumulate_as_the_recipe_says(fprop_split):
    """The recipe's MMParams reach cuBLASLt: every GEMM keeps the float32 promotion by default;
    MMParams(False) (TransformerEngine's forward) makes the forward accumulate fast."""
    kw = {} if fprop_split is None else {"fp8_gemm_fprop": te_jax.recipe.MMParams(fprop_split)}
    qs = te_jax.QuantizerSet.create(te_jax.recipe.DelayedScaling(**kw))
    x, w, b = _inputs()

    def loss(x, w, b, qs):
        return te_jax.dense(x, w, b, "gelu", quantizer_set=qs).astype(jnp.float32).sum()

    hlo = _hlo(jax.grad(loss, argnums=(0, 1, 2, 3)), x, w, b, qs)
    types = _types(hlo)
    split = {}
    for line in hlo.splitlines():
        m = _CALL.match(line)
        if m is None or m["target"] != "te_jax_gemm":
            continue
        operands = [a.strip().split()[-1].lstrip("%") for a in m["args"].split(",")[:2]]
        kinds = tuple(types.get(o, "?").split("[")[0] for o in operands)
        flag = re.search(r"split_accumulator = (true|false)", line)
        assert flag, line
        split[kinds] = flag.group(1) == "true"
    fwd, dgrad, wgrad = ("f8e4m3fn", "f8e4m3fn"), ("f8e5m2", "f8e4m3fn"), ("f8e4m3fn", "f8e5m2")
    assert split == {fwd: fprop_split is None, dgrad: True, wgrad: True}, split
