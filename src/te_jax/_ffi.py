"""Loads the te_jax extension modules and registers their FFI targets with XLA.

Each extension's ``registrations()`` returns ``{target_name: capsule | {stage: capsule}}``; the
same target names are registered for platform ``cpu`` (``_te_jax_cpu``) and ``CUDA``
(``_te_jax_cuda``), so one lowering rule serves both. A missing extension (a CPU-only build, or a
wheel built without the toolkit) is not an error: those ops then lower to the pure-JAX path.
"""

from __future__ import annotations

import importlib

import jax

__all__ = [
    "ffi_available",
    "registered_platforms",
    "target_available",
    "target_platforms",
    "load_error",
]

# JAX lowering platform name -> (extension module, XLA platform name for registration).
_EXTENSIONS = {"cpu": ("_te_jax_cpu", "cpu"), "cuda": ("_te_jax_cuda", "CUDA")}
_registered: set[str] = set()
_targets: dict[str, frozenset[str]] = {}  # platform -> the target names registered for it
_load_errors: dict[str, str] = {}


def _register_all() -> None:
    for platform, (module_name, xla_platform) in _EXTENSIONS.items():
        try:
            module = importlib.import_module(f"te_jax.{module_name}")
        except ImportError as e:
            _load_errors[platform] = str(e)
            continue
        if platform == "cuda":
            _point_to_cublaslt(module)
        registrations = module.registrations()
        for name, target in registrations.items():
            jax.ffi.register_ffi_target(name, target, platform=xla_platform, api_version=1)
        _registered.add(platform)
        _targets[platform] = frozenset(registrations)


def _point_to_cublaslt(module) -> None:
    """Tells te_jax_gemm where the nvidia-cublas wheel's libcublasLt is, in case jax's CUDA
    plugin has not loaded one when the first GEMM runs (it normally has: te_jax then uses that
    same copy). Nothing is loaded here: a CPU-only machine never touches cuBLASLt."""
    import importlib.util  # noqa: PLC0415
    import os  # noqa: PLC0415

    try:
        spec = importlib.util.find_spec("nvidia.cu13")
    except (ImportError, ValueError):
        return
    roots = (spec.submodule_search_locations or ()) if spec is not None else ()
    for root in roots:
        path = os.path.join(root, "lib", "libcublasLt.so.13")
        if os.path.exists(path):
            module.set_cublaslt_path(path)
            return


def _canonical(platform: str | None) -> str:
    if platform is None:
        platform = jax.default_backend()
    platform = platform.lower()
    return "cuda" if platform in ("gpu", "cuda") else platform


def ffi_available(platform: str | None = None) -> bool:
    """Whether te_jax's extension for ``platform`` is built and its targets registered with XLA.

    ``platform`` is ``"cpu"``, ``"cuda"`` (or ``"gpu"``), or ``None`` for JAX's default backend.
    This says what was built and loaded, not that such a device exists: ``ffi_available("cuda")``
    is True wherever the CUDA extension loaded, a machine without a GPU included. Whether the ops
    will run te_jax's kernels on the device JAX uses is ``te_jax.kernels_enabled()``.

    Example:
      >>> import te_jax
      >>> te_jax.ffi_available("gpu") == te_jax.ffi_available("cuda")     # the same platform
      True
      >>> te_jax.ffi_available("cpu")             # pip builds the CPU extension  # doctest: +SKIP
      True
    """
    return _canonical(platform) in _registered


def registered_platforms() -> frozenset[str]:
    """The JAX lowering platforms (``"cpu"``, ``"cuda"``) that have te_jax kernels."""
    return frozenset(_registered)


def target_platforms(target: str) -> frozenset[str]:
    """The JAX lowering platforms for which te_jax registered the FFI target ``target``.

    Not every target exists on every platform: ``te_jax_gemm`` (cuBLASLt) has a CUDA handler only.
    """
    return frozenset(p for p, names in _targets.items() if target in names)


def target_available(target: str, platform: str | None = None) -> bool:
    """Whether the FFI target ``target`` is registered for ``platform`` (as ``ffi_available``)."""
    return _canonical(platform) in target_platforms(target)


def load_error(platform: str) -> str | None:
    """Why the extension for ``platform`` did not load, if it did not."""
    return _load_errors.get(_canonical(platform))


_register_all()
