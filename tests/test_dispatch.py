"""te_jax.kernels_enabled and te_jax.ffi_available: what each says."""

from __future__ import annotations

import jax

import te_jax


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
