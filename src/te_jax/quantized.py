"""TEMP-ALIAS: the old home of the standalone quantize op (now ``te_jax.quantize.quantize``), for
dense.py and benchmarks/mlp.py until they import the new name. Remove at the merge."""

from te_jax.quantize.op import quantize  # noqa: F401  # TEMP-ALIAS
