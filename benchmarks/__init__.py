"""te_jax performance harness.

``python -m benchmarks.activations --help`` times every activation op against its XLA-native
equivalent on the current JAX backend (see ``benchmarks/activations.py``; the timing method
is ``benchmarks/_timing.py``'s);
``python -m benchmarks.dense --help`` times ``te_jax.dense`` (GEMM +
bias + GELU, bf16 and FP8) against XLA's GEMMs (``benchmarks/README.md``).
"""
