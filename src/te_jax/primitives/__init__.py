"""JAX primitives wrapping the te_jax FFI targets (one module per op family)."""

from te_jax.primitives.act_lu import bind_act_lu
from te_jax.primitives.dact_dbias import bind_dact_dbias, dbias_groups
from te_jax.primitives.quantized import bind_quantized

__all__ = ["bind_act_lu", "bind_dact_dbias", "bind_quantized", "dbias_groups"]
