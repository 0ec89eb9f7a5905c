"""te_jax.kernels_enabled and te_jax.ffi_available: what each says; te_jax.dispatch.decide, the
one kernel-or-pure-JAX decision, and deterministic_gemm."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import te_jax
from te_jax import _ffi
from te_jax.dispatch import Path, decide, deterministic_gemm, use_ffi
from te_jax.primitives.base import eager_backend


def test_kernels_enabled_answers_for_the_default_backend(monkeypatch):
    backend = jax.default_backend()
    monkeypatch.delenv("TE_JAX_IMPLEMENTATION", raising=False)
    assert te_jax.kernels_enabled() == te_jax.ffi_available(backend)
    assert te_jax.kernels_enabled(backend) == te_jax.ffi_available(backend)
    assert te_jax.kernels_enabled("cpu") == te_jax.ffi_available("cpu")


def test_kernels_enabled_is_false_when_the_pure_jax_path_is_forced(monkeypatch):
    monkeypatch.setenv("TE_JAX_IMPLEMENTATION", "xla")
    assert not te_jax.kernels_enabled()
    assert not te_jax.kernels_enabled("cpu")


def test_ffi_available_says_what_was_built_not_which_devices_exist():
    """ffi_available("cuda") may be True on a machine with no GPU (the extension loaded); the
    kernels run only where JAX's backend has them: kernels_enabled()."""
    if not any(d.platform == "gpu" for d in jax.devices()):
        assert te_jax.kernels_enabled() == te_jax.ffi_available("cpu")


# ---- decide: the one kernel-or-pure-JAX decision --------------------------------------------

GEMM = "te_jax_gemm"


@pytest.mark.parametrize("target", [None, GEMM], ids=["activation", "gemm"])
def test_decide_follows_the_implementation_rule(target, monkeypatch):
    """``None``: the kernel where the default backend has the op's target, the primitive (its
    pure-JAX lowering) elsewhere; ``"xla"`` and float64: pure JAX; ``"ffi"``: the kernel or a
    RuntimeError naming the target and the backend; the environment forces ``"xla"``."""
    monkeypatch.delenv("TE_JAX_IMPLEMENTATION", raising=False)
    backend = jax.default_backend()
    has = _ffi.target_available(target, backend) if target else _ffi.ffi_available(backend)
    assert decide("op", None, jnp.bfloat16, target=target) is (
        Path.KERNEL if has else Path.PRIMITIVE
    )
    assert decide("op", "xla", jnp.bfloat16, target=target) is Path.XLA
    if has:  # float64 skips a kernel that is there: said once per call site
        with pytest.warns(UserWarning, match=r"te_jax.op: float64 input takes the pure-JAX path"):
            assert decide("op", None, jnp.float64, target=target) is Path.XLA
    else:
        assert decide("op", None, jnp.float64, target=target) is Path.XLA
    if has:
        assert decide("op", "ffi", jnp.float32, target=target) is Path.KERNEL
    else:
        with pytest.raises(
            RuntimeError, match=rf"te_jax.op: implementation='ffi' but .*{backend!r}"
        ):
            decide("op", "ffi", jnp.float32, target=target)
    monkeypatch.setenv("TE_JAX_IMPLEMENTATION", "xla")
    assert decide("op", None, jnp.bfloat16, target=target) is Path.XLA
    assert use_ffi("op", None, jnp.bfloat16, target=target) is False


@pytest.mark.parametrize(
    "implementation, dtype, error, match",
    [
        (
            "cuda",
            jnp.float32,
            ValueError,
            r"te_jax.op: implementation must be None, 'ffi' or 'xla', got 'cuda'",
        ),
        (
            "ffi",
            jnp.int32,
            TypeError,
            r"te_jax.op: the FFI kernels take float32, bfloat16 or float16 inputs, got int32",
        ),
    ],
    ids=["unknown", "dtype"],
)
def test_decide_rejects_what_it_cannot_run(implementation, dtype, error, match):
    with pytest.raises(error, match=match):
        decide("op", implementation, dtype)


@pytest.mark.parametrize(
    "env, flags, want",
    [
        ("", "", False),
        ("1", "", True),
        ("true", "", True),
        ("0", "--xla_gpu_deterministic_ops=true", False),
        ("", "--xla_gpu_deterministic_ops=true", True),
        ("", "--xla_gpu_deterministic_ops", True),
        ("", "--xla_gpu_deterministic_ops=false --xla_foo=1", False),
    ],
)
def test_deterministic_gemm_reads_the_switch_and_xla_flags(env, flags, want, monkeypatch):
    monkeypatch.setenv("TE_JAX_DETERMINISTIC", env)
    monkeypatch.setenv("XLA_FLAGS", flags)
    assert deterministic_gemm() is want


def test_deterministic_gemm_rejects_other_values(monkeypatch):
    monkeypatch.setenv("TE_JAX_DETERMINISTIC", "yes")
    with pytest.raises(ValueError, match="TE_JAX_DETERMINISTIC must be 0 or 1, got 'yes'"):
        deterministic_gemm()


def test_eager_calls_run_where_jax_places_them():
    """An un-jitted op runs on the device JAX places it on: under jax.default_device(cpu) on a
    GPU machine, the CPU (whose GEMM is pure JAX), not the default backend's kernel."""
    cpu = jax.devices("cpu")[0]
    with jax.default_device(cpu):
        assert eager_backend([]) == "cpu"
        x = jnp.arange(32, dtype=jnp.float32).reshape(4, 8)
        w = jnp.ones((8, 16), jnp.float32)
        out = te_jax.gemm(x, w)
    assert out.devices() == {cpu}
    want = np.broadcast_to(np.asarray(x).sum(1, keepdims=True), (4, 16))
    np.testing.assert_array_equal(out, want)
    assert eager_backend([jax.device_put(np.ones(2), cpu)]) == "cpu"  # a committed operand's
