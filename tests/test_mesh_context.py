"""te_jax's sharding constraints under both mesh contexts: ``jax.set_mesh(mesh)`` and JAX's older
``with mesh:`` block, whose mesh Flax's logical constraints alone do not see (they would be
dropped without a word). Checked in the traced program (one CPU device suffices: the
constraint is in the jaxpr whatever the mesh's size)."""

from __future__ import annotations

import warnings

import flax.linen as nn
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import te_jax
from te_jax.sharding import BATCH, EMBED, MLP, MeshResource, logical_constraint

MESH = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "tensor"))
RULES = MeshResource(fsdp_resource="data", tp_resource="tensor").logical_axis_rules()


def _enter(context):
    """The mesh context: ``set_mesh`` or the deprecated ``with mesh:`` (its warning muted)."""
    if context == "set_mesh":
        return jax.set_mesh(MESH)
    return MESH


def _constraints(fn, *args, context):
    """The ``PartitionSpec`` of each sharding constraint in ``fn``'s jaxpr, in order."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with _enter(context), nn.logical_axis_rules(RULES):
            jaxpr = jax.make_jaxpr(fn)(*args)
    specs = []

    def walk(jx):
        for eqn in jx.eqns:
            if eqn.primitive.name == "sharding_constraint":
                specs.append(eqn.params["sharding"].spec)
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                walk(sub)

    walk(jaxpr.jaxpr)
    return specs


@pytest.mark.parametrize("context", ["set_mesh", "with_mesh"])
def test_logical_constraint_sees_either_context(context):
    specs = _constraints(
        lambda x: logical_constraint(x * 2, (BATCH, EMBED)), jnp.ones((4, 8)), context=context
    )
    # batch -> the FSDP axis (data parallel too); embed's FSDP axis is then taken: unsplit.
    assert specs == [P("data", None)], specs


def test_no_mesh_no_constraint():
    """Without a mesh (rules alone) nothing is constrained, as with Flax's own."""
    with nn.logical_axis_rules(RULES):
        jaxpr = jax.make_jaxpr(lambda x: logical_constraint(x, (BATCH, EMBED)))(jnp.ones((4, 8)))
    assert all(e.primitive.name != "sharding_constraint" for e in jaxpr.eqns)


def test_dense_kernel_gradient_is_constrained_under_either_context():
    """The kernel gradient's constraint (te_jax.dense with ``kernel_axes``) is the same under
    ``with mesh:`` as under ``jax.set_mesh``."""
    x = jnp.ones((4, 8), jnp.bfloat16)
    k = jnp.ones((8, 16), jnp.float32)

    def grad_k(x, k):
        f = lambda k: jnp.sum(te_jax.dense(x, k, kernel_axes=(EMBED, MLP)).astype(jnp.float32))
        return jax.grad(f)(k)

    new = _constraints(grad_k, x, k, context="set_mesh")
    old = _constraints(grad_k, x, k, context="with_mesh")
    assert P("data", "tensor") in new
    assert old == new
