"""The documentation site: its API reference (docs/api.md) lists every public name (it is what
tools/api_reference.py writes from each public module's ``__all__``, so a name added to an
``__all__`` without rewriting the reference fails here), every page is in it, and the runnable
guides' code blocks run (one test per guide; sharding.md's in a process with 8 CPU devices)."""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _api_reference():
    path = ROOT / "tools" / "api_reference.py"
    spec = importlib.util.spec_from_file_location("api_reference", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_public_name_is_in_the_api_reference():
    ref = _api_reference()
    text = (ROOT / "docs" / "api.md").read_text()
    missing = []
    for module in ref.MODULES:
        objects, constants = ref.public_names(module)
        missing += [f"{module}.{n}" for n in objects if f"\n   {n}\n" not in text]
        missing += [f"{module}.{n}" for n in constants if f".. py:data:: {n}\n" not in text]
    assert not missing, f"not in docs/api.md (run python tools/api_reference.py): {missing}"
    assert text == ref.render(), "docs/api.md is stale: run python tools/api_reference.py"


def test_every_page_is_in_the_site():
    """Each Markdown page under docs/ is in a toctree of docs/index.md."""
    index = (ROOT / "docs" / "index.md").read_text()
    pages = sorted(p.stem for p in (ROOT / "docs").glob("*.md") if p.stem != "index")
    assert [p for p in pages if f"\n{p}\n" not in index] == []


# Guides whose ```python blocks run on a CPU, in order, in one namespace: in this process, or
# in a process of their own where the page needs JAX started with another environment
# (sharding.md: 8 CPU devices, set before JAX starts; this process's JAX has started already).
RUNNABLE = [
    "getting_started.md",
    "activations.md",
    "quantization.md",
    "sharding.md",
    "ops.md",
    "transformer_engine.md",
    "flax.md",
]
RUNNABLE_ENV = {
    "sharding.md": {"XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
}
# What the process of such a page runs: the blocks (a JSON list on stdin), in order, in one
# namespace, each compiled under its own name so that a traceback names the block.
_RUN_BLOCKS = """
import json, sys
namespace = {"__name__": "__main__"}
for i, block in enumerate(json.load(sys.stdin)):
    exec(compile(block, f"docs/{sys.argv[1]} block {i}", "exec"), namespace)
"""


def _python_blocks(page: str) -> list[str]:
    text = (ROOT / "docs" / page).read_text()
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


@pytest.mark.parametrize("page", RUNNABLE, ids=[p.removesuffix(".md") for p in RUNNABLE])
def test_runnable_guides_run(page):
    blocks = _python_blocks(page)
    assert blocks, page
    if page not in RUNNABLE_ENV:
        namespace: dict = {}
        for i, block in enumerate(blocks):
            exec(compile(block, f"docs/{page} block {i}", "exec"), namespace)  # noqa: S102
        return
    env = dict(os.environ)  # with the run's compile settings and cache (tests/conftest.py)
    for name, value in RUNNABLE_ENV[page].items():
        env[name] = f"{env[name]} {value}" if name == "XLA_FLAGS" and env.get(name) else value
    proc = subprocess.run(
        [sys.executable, "-c", _RUN_BLOCKS, page],
        input=json.dumps(blocks),
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, f"docs/{page}:\n{proc.stdout[-5000:]}\n{proc.stderr[-10000:]}"


# The public modules, in the reference's order: one docstring-examples test each (pytest-xdist
# spreads them over its workers).
MODULES = list(_api_reference().MODULES)
# At least this many public objects have a doctested Example section (100 when this was set).
MIN_EXAMPLES = 96


def _public_objects(module: str) -> list[tuple[str, object, bool]]:
    """``(qualified name, object, first)`` for each public function and class of ``module``:
    ``first`` where no earlier module of ``MODULES`` lists the same object (``te_jax.autocast`` is
    ``te_jax.recipe.autocast``; ``Float8CurrentScaling`` is ``CurrentScaling``), so each
    example runs once."""
    ref = _api_reference()
    seen = set()
    for earlier in MODULES[: MODULES.index(module)]:
        mod = importlib.import_module(earlier)
        seen |= {id(getattr(mod, n)) for n in ref.public_names(earlier)[0]}
    mod = importlib.import_module(module)
    out = []
    for name in ref.public_names(module)[0]:
        obj = getattr(mod, name)
        out.append((f"{module}.{name}", obj, id(obj) not in seen))
        seen.add(id(obj))
    return out


def _doctests(name: str, obj) -> list:
    """The doctests of ``obj``'s own docstring (its ``Example:`` section), with empty globals:
    an example imports what it uses, as a reader copying it would."""
    import doctest

    finder = doctest.DocTestFinder(recurse=False)
    return [t for t in finder.find(obj, name, globs={}) if t.examples]


@pytest.mark.parametrize("module", MODULES)
def test_docstring_examples_run(module):
    """The ``Example:`` sections of ``module``'s public names (doctest)."""
    import doctest

    runner = doctest.DocTestRunner()
    for name, obj, first in _public_objects(module):
        for test in _doctests(name, obj) if first else []:
            # Globals kept: a fusion an example registers stays registered (te_jax.ops's
            # registry is global) and reads its example's names whenever a plan is built.
            runner.run(test, clear_globs=False)
    assert runner.failures == 0, f"{runner.failures} docstring example(s) failed (output above)"


def test_every_public_name_has_an_example():
    """Every public function and class (constants and exception classes aside) has an
    ``Example:`` section that doctest runs."""
    missing, ran = [], 0
    for module in MODULES:
        for name, obj, first in _public_objects(module):
            if isinstance(obj, type) and issubclass(obj, BaseException):
                continue
            if "Example:" not in (obj.__doc__ or "") or not _doctests(name, obj):
                missing.append(name)
            elif first:
                ran += 1
    assert missing == [], f"public names without a doctested Example section: {missing}"
    assert ran >= MIN_EXAMPLES, ran


def test_performance_page_is_a_reference():
    """docs/performance.md is a reference page, not a lab notebook: at most 250 lines, every image
    it shows is under docs/, no commit hashes, issue numbers or dates (git keeps the history), and
    its first table, the headline, is the README's performance table."""
    text = (ROOT / "docs" / "performance.md").read_text()
    assert len(text.splitlines()) <= 250, len(text.splitlines())
    images = re.findall(r"!\[[^\]]*\]\(([^)\s]+)\)", text)
    assert images and [i for i in images if not (ROOT / "docs" / i).is_file()] == []
    hex_word = r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b"
    assert re.findall(hex_word, text) == [], "commit hashes"
    assert re.findall(r"\bissues?\b|(?<!\w)#\d+\b", text, flags=re.I) == [], "issue references"
    assert re.findall(r"\b\d{4}-\d{2}-\d{2}\b", text) == [], "dates"
    headline = re.search(r"^\|.*\|\n(?:\|.*\|\n)+", text, flags=re.M).group()
    assert headline in (ROOT / "README.md").read_text(), "README's table differs from the site's"
