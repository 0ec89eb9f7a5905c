"""JAX primitives wrapping the te_jax FFI targets (one module per op family)."""

from te_jax.primitives.act_lu import act_lu
from te_jax.primitives.dact_dbias import dact_dbias, dbias_groups

__all__ = ["act_lu", "dact_dbias", "dbias_groups"]
