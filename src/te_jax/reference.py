"""TEMP-ALIAS: the old name of ``te_jax.activation_reference``, for te_jax/__init__.py,
dense.py, primitives/gemm.py and tests/test_forward_mode.py until they import the new name.
Remove at the merge."""

from te_jax.activation_reference import *  # noqa: F403  # TEMP-ALIAS
