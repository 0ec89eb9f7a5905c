"""The GEMM primitive's JVP, in the way ``dact_dbias``'s is given.

``gemm_p`` computes ``out = epilogue(L @ R · s_L · s_R + addend + bias)`` (``primitive.py``).
Its JVP runs the primitive for the primal (the kernel where there is one) and takes the tangent
of its pure-JAX results (``reference_results.py``): bilinear in ``(L, R)`` and linear in the
addend for the plain product, times ``gelu'(h)`` / ``[h > 0]`` through the GELU / ReLU epilogues
and with ``gelu''`` through DGELU's. That is what forward mode through a GEMM needs, and what a
second derivative of a te_jax op differentiates: its backward's GEMMs (a Hessian-vector
product, ``jvp`` of ``grad``) and its forward's. Reverse mode of a te_jax op never reaches this
rule: ``gemm``, ``dense`` and ``fused_mlp`` have their own backward
(``te_jax.primitives.custom_linear``).
"""

from __future__ import annotations

import jax
from jax.interpreters import ad

from te_jax._varying import bind
from te_jax.primitives.gemm.config import GemmConfig
from te_jax.primitives.gemm.groups import grouped
from te_jax.primitives.gemm.primitive import gemm_p
from te_jax.primitives.gemm.reference_results import reference_results

__all__ = []


def _gemm_jvp(primals, tangents, *, config: GemmConfig):
    outs = bind(gemm_p, *primals, config=config)
    tangents = tuple(map(ad.instantiate_zeros, tangents))
    ref = grouped(reference_results)
    return outs, jax.jvp(lambda *ops: ref(*ops, config), tuple(primals), tangents)[1]


ad.primitive_jvps[gemm_p] = _gemm_jvp
