"""Choosing between the FFI kernels and the pure-JAX path (``implementation=``).

* ``None`` (default): the FFI kernel where te_jax has one for the backend the op is lowered for,
  the pure-JAX path otherwise (and for float64 inputs);
* ``"ffi"``: the kernel; an error at trace time if there is none;
* ``"xla"``: the pure-JAX path.

The environment variable ``TE_JAX_IMPLEMENTATION=xla`` (read at trace time) forces the pure-JAX
path for every call that does not say ``implementation="ffi"``.

``decide`` is the one decision every op asks: ``Path.XLA`` (the pure-JAX functions, no
primitive), ``Path.PRIMITIVE`` (the op's primitive, which lowers to the kernel on the platforms
its FFI target is registered for and to its pure-JAX form elsewhere) or ``Path.KERNEL`` (the
primitive, and the default backend runs its kernel: what decides, e.g., whether an activation
runs in the GEMM's epilogue).

``deterministic_gemm`` says whether the GEMM kernel must give the same bits in every process:
``TE_JAX_DETERMINISTIC=1`` or XLA's ``--xla_gpu_deterministic_ops=true`` in ``XLA_FLAGS``.

Inputs are float32, bfloat16 or float16 (the kernels' dtypes) or float64 (with
``jax_enable_x64``), which always takes the pure-JAX path and computes in float64; anything else
is a ``TypeError`` at trace time (``check_input_dtype``).
"""

from __future__ import annotations

import enum
import os
import warnings

import jax
import jax.numpy as jnp

from te_jax import _ffi

__all__ = [
    "Path",
    "decide",
    "use_ffi",
    "check_input_dtype",
    "kernels_enabled",
    "environment_implementation",
    "deterministic_gemm",
]

_KERNEL_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_INPUT_DTYPES = _KERNEL_DTYPES + (jnp.dtype(jnp.float64),)
_IMPLEMENTATIONS = (None, "ffi", "xla")


def check_input_dtype(where: str, dtype, what: str = "x") -> jnp.dtype:
    """Returns ``dtype`` if te_jax takes it as an op's input; raises ``TypeError`` otherwise.

    ``where`` names the op (``"te_jax.act_lu"``), ``what`` the argument.
    """
    dt = jnp.dtype(dtype)
    if dt not in _INPUT_DTYPES:
        raise TypeError(
            f"{where}: {what} must be float32, bfloat16 or float16 (or float64, which takes the "
            f"pure-JAX path), got {dt.name}"
        )
    return dt


def environment_implementation() -> str | None:
    """``TE_JAX_IMPLEMENTATION`` (``"ffi"``, ``"xla"``) or ``None`` when unset."""
    env = os.environ.get("TE_JAX_IMPLEMENTATION", "").strip().lower()
    if env not in ("", "ffi", "xla"):
        raise ValueError(f"TE_JAX_IMPLEMENTATION must be 'ffi' or 'xla', got {env!r}")
    return env or None


def kernels_enabled(backend: str | None = None) -> bool:
    """Whether an op called with ``implementation=None`` runs te_jax's kernels on ``backend``.

    ``backend`` is ``"cpu"``, ``"cuda"`` / ``"gpu"``, or ``None`` for JAX's default backend (the
    device the op will run on). True when te_jax's extension for that platform is built and
    registered and ``TE_JAX_IMPLEMENTATION`` does not force the pure-JAX path. Unlike
    ``ffi_available``, which only says the targets are registered, this answers for a backend
    JAX can use: on a machine without a GPU, ``kernels_enabled()`` is about the CPU.

    Example:
      >>> import te_jax
      >>> te_jax.kernels_enabled("cpu") <= te_jax.ffi_available("cpu")   # kernels need it built
      True
      >>> te_jax.kernels_enabled()       # a CPU-only machine with the extension  # doctest: +SKIP
      True
    """
    if environment_implementation() == "xla":
        return False
    return _ffi.ffi_available(jax.default_backend() if backend is None else backend)


class Path(enum.Enum):
    """Where an op runs (``decide``)."""

    XLA = "xla"  # the pure-JAX functions, no te_jax primitive
    PRIMITIVE = "primitive"  # the primitive: the kernel where registered, pure JAX elsewhere
    KERNEL = "kernel"  # the primitive, and the default backend has its kernel


def decide(
    op: str,
    implementation: str | None,
    dtype,
    *,
    target: str | None = None,
    kernel_dtypes=_KERNEL_DTYPES,
    backends: frozenset[str] | None = None,
) -> Path:
    """The one decision between te_jax's kernel and the pure-JAX path (module docstring).

    Args:
      op: the op's name in messages (``"dense"`` for ``te_jax.dense``).
      implementation: ``None``, ``"ffi"`` or ``"xla"`` as the user gave it.
      dtype: the op's input dtype; float64 (and any dtype outside ``kernel_dtypes``) takes the
        pure-JAX path, and ``"ffi"`` then raises.
      target: the FFI target, when it is not registered on every platform te_jax builds
        (``te_jax_gemm`` has a CUDA handler only): ``"ffi"`` then needs that target on the
        default backend, not just te_jax's extension.
      kernel_dtypes: the input dtypes the kernel takes (float32, bfloat16, float16 unless said).
      backends: the backends whose kernel takes this call (a scaling mode the kernels of some
        backends do not quantize in: ``ScalingModeImpl.kernel_backends``); ``None``: every
        backend with the kernel. Elsewhere the call takes the pure-JAX path, and ``"ffi"``
        raises.

    Raises:
      ValueError: an unknown ``implementation``.
      TypeError: ``"ffi"`` with a dtype the kernel does not take.
      RuntimeError: ``"ffi"`` on a backend without the kernel.
    """
    if implementation not in _IMPLEMENTATIONS:
        raise ValueError(
            f"te_jax.{op}: implementation must be None, 'ffi' or 'xla', got {implementation!r}"
        )
    if implementation is None:
        implementation = environment_implementation()
    if implementation == "xla":
        return Path.XLA
    kernel_dtypes = tuple(jnp.dtype(d) for d in kernel_dtypes)
    kernel_dtype = jnp.dtype(dtype) in kernel_dtypes
    backend = jax.default_backend()
    if implementation == "ffi":
        if not kernel_dtype:
            *first, last = (d.name for d in kernel_dtypes)
            names = f"{', '.join(first)} or {last}" if first else last
            raise TypeError(
                f"te_jax.{op}: the FFI kernels take {names} inputs, got "
                f"{jnp.dtype(dtype).name}; use implementation=None or 'xla' for other dtypes"
            )
        if not _kernel_available(backend, target, backends):
            reason = _ffi.load_error(backend)
            if reason is None and target is not None and _ffi.ffi_available(backend):
                where = sorted(_ffi.target_platforms(target))
                reason = f"{target} is registered for: {', '.join(where) or 'no platform'}"
            if reason is None and backends is not None:
                where = ", ".join(sorted(backends)) or "no backend yet"
                reason = f"this configuration has kernels for: {where}"
            what = "kernels" if target is None else f"{target} kernel"
            raise RuntimeError(
                f"te_jax.{op}: implementation='ffi' but te_jax has no {what} for the "
                f"{backend!r} backend"
                + (f" ({reason})" if reason else "")
                + "; use implementation=None or 'xla'"
            )
        return Path.KERNEL
    # None: the primitive lowers to the kernel where one is registered and to its pure-JAX form
    # elsewhere, so only dtypes the kernels cannot take are routed away here.
    if not kernel_dtype:
        if jnp.dtype(dtype) == jnp.float64:
            _warn_float64(op, target)
        return Path.XLA
    if backends is not None and backend not in backends:
        # The primitive would lower to kernels that do not take this call.
        return Path.XLA
    return Path.KERNEL if _kernel_available(backend, target) else Path.PRIMITIVE


def use_ffi(
    op: str,
    implementation: str | None,
    dtype,
    *,
    target: str | None = None,
    kernel_dtypes=_KERNEL_DTYPES,
    backends: frozenset[str] | None = None,
) -> bool:
    """Whether the op binds its primitive: ``decide(...)`` is not ``Path.XLA``."""
    path = decide(
        op, implementation, dtype, target=target, kernel_dtypes=kernel_dtypes, backends=backends
    )
    return path is not Path.XLA


def deterministic_gemm() -> bool:
    """Whether the GEMM kernel must be bitwise reproducible across processes (read at trace
    time): ``TE_JAX_DETERMINISTIC=1`` (or ``true``), or ``--xla_gpu_deterministic_ops`` set true
    in ``XLA_FLAGS``. It then takes cuBLASLt's first heuristic algorithm instead of the fastest
    of several timed ones, and no algorithm whose reduction order can vary."""
    env = os.environ.get("TE_JAX_DETERMINISTIC", "").strip().lower()
    if env not in ("", "0", "1", "false", "true"):
        raise ValueError(f"TE_JAX_DETERMINISTIC must be 0 or 1, got {env!r}")
    if env in ("1", "true"):
        return True
    if env in ("0", "false"):
        return False
    for flag in os.environ.get("XLA_FLAGS", "").split():
        name, _, value = flag.partition("=")
        if name == "--xla_gpu_deterministic_ops":
            return value.strip().lower() in ("", "true", "1")
    return False


def _kernel_available(
    backend: str, target: str | None, backends: frozenset[str] | None = None
) -> bool:
    if backends is not None and backend not in backends:
        return False
    if target is None:
        return _ffi.ffi_available(backend)
    return _ffi.target_available(target, backend)


def _warn_float64(op: str, target: str | None = None) -> None:
    """Says once per call site (Python's default warning filter) that float64 skips the kernels,
    where kernels would otherwise run."""
    if not _kernel_available(jax.default_backend(), target):
        return
    warnings.warn(
        f"te_jax.{op}: float64 input takes the pure-JAX path (te_jax's kernels take float32, "
        "bfloat16 and float16) and computes in float64",
        stacklevel=3,
    )
