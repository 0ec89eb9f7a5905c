"""The unquantized activation primitives: ``act_lu`` (forward, ``te_jax_act_lu``) and
``dact_dbias`` (gradient and optional bias gradient, ``te_jax_dact_dbias_quantize``).

Modules, one job each: ``act_lu`` and ``dact_dbias`` (each primitive's kernel call, sharding
rule and partition, abstract evaluation, pure-JAX results, batching and ``bind_*``),
``autodiff`` (their JVP and transpose rules: reverse mode runs the two kernels and nothing
else). Importing this package registers those rules.
"""

from te_jax.primitives.activation import autodiff  # noqa: F401 -- registers the JVP / transpose
from te_jax.primitives.activation.act_lu import bind_act_lu
from te_jax.primitives.activation.dact_dbias import bind_dact_dbias

__all__ = ["bind_act_lu", "bind_dact_dbias"]
