"""The model layer's GEMM ops: ``te_jax.gemm``, ``te_jax.dense`` and ``te_jax.fused_mlp``.

Modules: ``matmul`` (one GEMM of arrays or quantized operands in their logical layouts: the FP8
"TN" operand rule, MXFP8 dequantized; above ``te_jax.primitives.gemm``), ``core`` (the shared
forward and backward of GEMM + bias + activation: config, argument checks, GEMM views,
quantized operands, dact + dbias, dgrad, wgrad, the forward-mode tangent), ``gemm`` (the public
GEMM op), ``dense`` (the public dense op), ``fused_mlp`` (the MLP's two GEMMs as one op). The
public functions are exported by ``te_jax`` itself; this package exports no names, so no
function shadows its module.
"""
