"""Choosing between the FFI kernels and the pure-JAX path (``implementation=``).

* ``None`` (default): the FFI kernel where te_jax has one for the backend the op is lowered for,
  the pure-JAX path otherwise (and for float64 inputs);
* ``"ffi"``: the kernel; an error at trace time if there is none;
* ``"xla"``: the pure-JAX path.

The environment variable ``TE_JAX_IMPLEMENTATION=xla`` (read at trace time) forces the pure-JAX
path for every call that does not say ``implementation="ffi"``.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp

from te_jax import _ffi

__all__ = ["use_ffi"]

_KERNEL_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_IMPLEMENTATIONS = (None, "ffi", "xla")


def use_ffi(op: str, implementation: str | None, dtype) -> bool:
    """Decides between the kernel and the pure-JAX path (see the module docstring)."""
    if implementation not in _IMPLEMENTATIONS:
        raise ValueError(
            f"te_jax.{op}: implementation must be None, 'ffi' or 'xla', got {implementation!r}"
        )
    if implementation is None:
        env = os.environ.get("TE_JAX_IMPLEMENTATION", "").strip().lower()
        if env not in ("", "ffi", "xla"):
            raise ValueError(f"TE_JAX_IMPLEMENTATION must be 'ffi' or 'xla', got {env!r}")
        implementation = env or None
    if implementation == "xla":
        return False
    kernel_dtype = jnp.dtype(dtype) in _KERNEL_DTYPES
    if implementation == "ffi":
        if not kernel_dtype:
            raise TypeError(
                f"te_jax.{op}: the FFI kernels take float32, bfloat16 or float16 inputs, got "
                f"{jnp.dtype(dtype).name}; use implementation=None or 'xla' for other dtypes"
            )
        backend = jax.default_backend()
        if not _ffi.ffi_available(backend):
            reason = _ffi.load_error(backend)
            raise RuntimeError(
                f"te_jax.{op}: implementation='ffi' but te_jax has no kernels for the "
                f"{backend!r} backend" + (f" ({reason})" if reason else "")
            )
        return True
    # None: the outer primitive lowers to the kernel where one is registered, to the reference
    # elsewhere, so only dtypes the kernels cannot take are routed away here.
    return kernel_dtype
