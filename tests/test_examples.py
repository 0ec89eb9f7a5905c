"""The demo and examples/train_mlp.py run and train (a few steps, small shapes)."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest

import te_jax.demo

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_demo_trains():
    assert (
        te_jax.demo.main(["--steps", "12", "--batch", "64", "--d-model", "32", "--d-ff", "64"]) == 0
    )


@pytest.mark.parametrize("family", ["linen", "nnx"])
def test_train_mlp_example(family, capsys):
    spec = importlib.util.spec_from_file_location(
        "train_mlp", os.path.join(ROOT, "examples", "train_mlp.py")
    )
    example = importlib.util.module_from_spec(spec)
    sys.modules["train_mlp"] = example  # Flax's dataclasses look their module up there
    spec.loader.exec_module(example)
    argv = [
        "--family",
        family,
        "--recipe",
        "delayed",
        "--layers",
        "2",
        "--hidden",
        "32",
        "--intermediate",
        "64",
        "--tokens",
        "64",
        "--steps",
        "15",
        "--log-every",
        "5",
    ]
    assert example.main(argv) == 0
    assert "summary" in capsys.readouterr().out
