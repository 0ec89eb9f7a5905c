"""te_jax performance harness.

``python -m benchmarks.activations --help`` times every activation op against its XLA-native
equivalent on the current JAX backend (see ``benchmarks/activations.py`` and DESIGN.md,
"Performance method").
"""
