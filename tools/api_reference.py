"""Writes docs/api.md: every public name of te_jax (each public module's ``__all__``) in an
autosummary table, constants as data entries. Run after changing a public ``__all__``:
``python tools/api_reference.py``; tests/test_docs.py fails while a name is missing."""

from __future__ import annotations

import importlib
import inspect
import pathlib
import types

# The public modules, in the reference's order, with their section titles.
MODULES = {
    "te_jax": "Ops: activations, GEMM, dense, MLP",
    "te_jax.recipe": "FP8 recipes and quantizer sets",
    "te_jax.quantize": "Quantization",
    "te_jax.flax": "Flax Linen modules and ops",
    "te_jax.nnx": "Flax NNX modules and ops",
    "te_jax.ops": "Fusible operations",
    "te_jax.sharding": "Sharding",
    "te_jax.activation_reference": "Pure-JAX references",
    "te_jax.testing": "Testing helpers",
}
OUT = pathlib.Path(__file__).resolve().parents[1] / "docs" / "api.md"


def public_names(module: str) -> tuple[list[str], list[str]]:
    """``(documented objects, constants)`` of ``module.__all__`` (submodules left out: each
    public one has its own section)."""
    mod = importlib.import_module(module)
    objects, constants = [], []
    for name in mod.__all__:
        value = getattr(mod, name)
        if isinstance(value, types.ModuleType):
            continue
        is_object = inspect.isclass(value) or callable(value)
        (objects if is_object else constants).append(name)
    return objects, constants


def render() -> str:
    out = [
        "# API reference",
        "",
        "Every public name of te_jax, by module (each module's `__all__`; written by",
        "`tools/api_reference.py`, and tests/test_docs.py fails while one is missing).",
        "",
    ]
    for module, title in MODULES.items():
        objects, constants = public_names(module)
        out += [f"## `{module}`: {title}", "", "```{eval-rst}", f".. currentmodule:: {module}", ""]
        if objects:
            out += [".. autosummary::", "   :toctree: _autosummary", ""]
            out += [f"   {n}" for n in objects] + [""]
        for name in constants:
            value = repr(getattr(importlib.import_module(module), name))
            value = value if len(value) <= 70 else value[:67] + "..."
            out += [f".. py:data:: {name}", f"   :value: {value}", ""]
        out += ["```", ""]
    return "\n".join(out)


if __name__ == "__main__":
    OUT.write_text(render())
    print(f"wrote {OUT}")
