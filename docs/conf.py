"""Sphinx configuration of te_jax's documentation site (MyST Markdown pages, an autosummary API
reference). Build: ``pip install ".[docs]"`` then
``python -m sphinx -W --keep-going -b html docs docs/_build/html``."""

import importlib.metadata

project = "te_jax"
author = "the te_jax authors"
copyright = "the te_jax authors"
try:
    release = importlib.metadata.version("te_jax")
except importlib.metadata.PackageNotFoundError:
    release = "unknown"

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
exclude_patterns = ["_build", "README.md"]

# The docstrings are Google style (Args / Returns / Raises), math and code in double backticks.
napoleon_google_docstring = True
napoleon_numpy_docstring = False
autosummary_generate = True
templates_path = ["_templates"]  # a class page: its docstring and its documented members
autodoc_default_options = {"members": False}
autodoc_typehints = "description"

myst_enable_extensions = ["dollarmath"]
myst_heading_anchors = 3

html_theme = "furo"
html_title = "te_jax"
