"""FP8 in a model written with stock Flax layers: a small transformer (Linen: ``nn.Dense``,
``nn.DenseGeneral`` and an einsum op; NNX: ``nnx.Linear``, ``nnx.LinearGeneral``,
``nnx.Einsum``) switched to te_jax's GEMM with one argument per layer, trained by an unmodified
optax loop (Linen: ``TrainState.apply_gradients``, the FP8 state in ``_overwrite_with_gradient``;
NNX: ``nnx.Optimizer`` plus ``update_fp8_state``), matching the bf16 run within FP8's
tolerance."""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from flax.training.train_state import TrainState

import te_jax
from te_jax.flax import OVERWRITE_WITH_GRADIENT
from te_jax.nnx import FP8Meta, update_fp8_state

VOCAB, D, HEADS, HD, SEQ, BATCH = 32, 32, 2, 16, 16, 8
STEPS, LR = 30, 3e-3
BF16 = jnp.bfloat16
RECIPES = {"bf16": None, "delayed": te_jax.recipe.DelayedScaling(amax_history_len=16)}


def _batches():
    """Next-token prediction of sequences that count up from a random start (mod VOCAB)."""
    start = jax.random.randint(jax.random.PRNGKey(3), (STEPS, BATCH, 1), 0, VOCAB)
    seq = (start + jnp.arange(SEQ + 1)) % VOCAB
    return seq[..., :-1], seq[..., 1:]


def _xent(logits, targets):
    logp = jax.nn.log_softmax(logits.astype(jnp.float32))
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], -1))


# ---- Linen ----------------------------------------------------------------------------------


class LinenBlock(nn.Module):
    dot_general_cls: object = None  # the one argument per layer
    einsum: object = None  # an einsum op class (te_jax.flax.EinsumOp), or jnp.einsum

    @nn.compact
    def __call__(self, x):
        dg = dict(dtype=BF16, dot_general_cls=self.dot_general_cls)
        h = nn.LayerNorm(dtype=BF16)(x)
        qkv = nn.DenseGeneral((3, HEADS, HD), **dg)(h)
        att = nn.dot_product_attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2])
        wo = self.param("wo", nn.initializers.lecun_normal(), (HEADS, HD, D)).astype(BF16)
        einsum = jnp.einsum if self.einsum is None else self.einsum()
        x = x + einsum("bshd,hdf->bsf", att, wo)
        h = nn.LayerNorm(dtype=BF16)(x)
        h = nn.gelu(nn.Dense(4 * D, **dg)(h))
        return x + nn.Dense(D, **dg)(h)


class LinenModel(nn.Module):
    dot_general_cls: object = None
    einsum: object = None

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(VOCAB, D)(tokens).astype(BF16)
        x = LinenBlock(self.dot_general_cls, self.einsum)(x)
        return nn.Dense(VOCAB, dtype=BF16, dot_general_cls=self.dot_general_cls)(x)


def _linen_model(recipe):
    if recipe is None:
        return LinenModel()
    part = functools.partial
    return LinenModel(
        part(te_jax.flax.DotGeneral, recipe=recipe), part(te_jax.flax.EinsumOp, recipe=recipe)
    )


def _train_linen(recipe):
    model = _linen_model(recipe)
    inputs, targets = _batches()
    variables = jax.jit(model.init)(jax.random.PRNGKey(0), inputs[0])
    state = TrainState.create(apply_fn=model.apply, params=variables, tx=optax.adam(LR))

    @jax.jit
    def step(state, batch):
        x, y = batch
        loss, grads = jax.value_and_grad(lambda v: _xent(model.apply(v, x), y))(state.params)
        return state.apply_gradients(grads=grads), loss  # the unmodified Flax step

    losses = []
    for i in range(STEPS):
        state, loss = step(state, (inputs[i], targets[i]))
        losses.append(loss)
    return state, np.asarray(losses)


def test_linen_stock_layers_train_as_bf16():
    _, bf16 = _train_linen(None)
    state, fp8 = _train_linen(RECIPES["delayed"])
    _check_losses(bf16, fp8)
    # Each layer's state in Flax's collection, advanced by TrainState.apply_gradients.
    owg = jax.tree_util.tree_leaves_with_path(state.params[OVERWRITE_WITH_GRADIENT])
    assert len(owg) == 6 * 5, len(owg)  # 5 GEMMs, 6 state arrays each
    for path, leaf in owg:
        if "scale" in jax.tree_util.keystr(path):
            assert float(leaf) != 1.0, jax.tree_util.keystr(path)
        else:  # the amax histories: full (15 recorded amaxes, the slot of the next zeroed)
            assert np.count_nonzero(np.asarray(leaf)) == 15, jax.tree_util.keystr(path)


# ---- NNX ------------------------------------------------------------------------------------


class NnxModel(nnx.Module):
    def __init__(self, recipe, rngs):
        def dg():  # the one argument per layer (a fresh op each: it holds that layer's state)
            return {} if recipe is None else {"dot_general": te_jax.nnx.DotGeneral(recipe)}

        ein = {} if recipe is None else {"einsum_op": te_jax.nnx.EinsumOp(recipe)}
        self.embed = nnx.Embed(VOCAB, D, rngs=rngs)
        self.ln1 = nnx.LayerNorm(D, dtype=BF16, rngs=rngs)
        self.qkv = nnx.LinearGeneral(D, (3, HEADS, HD), dtype=BF16, rngs=rngs, **dg())
        self.out = nnx.Einsum("bshd,hdf->bsf", (HEADS, HD, D), dtype=BF16, rngs=rngs, **ein)
        self.ln2 = nnx.LayerNorm(D, dtype=BF16, rngs=rngs)
        self.up = nnx.Linear(D, 4 * D, dtype=BF16, rngs=rngs, **dg())
        self.down = nnx.Linear(4 * D, D, dtype=BF16, rngs=rngs, **dg())
        self.head = nnx.Linear(D, VOCAB, dtype=BF16, rngs=rngs, **dg())

    def __call__(self, tokens):
        x = self.embed(tokens).astype(BF16)
        qkv = self.qkv(self.ln1(x))
        att = nnx.dot_product_attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2])
        x = x + self.out(att)
        x = x + self.down(nnx.gelu(self.up(self.ln2(x))))
        return self.head(x)


def _train_nnx(recipe):
    model = NnxModel(recipe, nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.adam(LR), wrt=nnx.Param)
    inputs, targets = _batches()
    diff = nnx.DiffState(0, (nnx.Param, FP8Meta))

    @nnx.jit
    def step(model, opt, x, y):
        loss, grads = nnx.value_and_grad(lambda m: _xent(m(x), y), argnums=diff)(model)
        opt.update(model, grads)
        update_fp8_state(model, grads)  # delayed scaling's next state; a no-op otherwise
        return loss

    losses = [step(model, opt, inputs[i], targets[i]) for i in range(STEPS)]
    return model, np.asarray(losses)


def test_nnx_stock_layers_train_as_bf16():
    _, bf16 = _train_nnx(None)
    model, fp8 = _train_nnx(RECIPES["delayed"])
    _check_losses(bf16, fp8)
    state = nnx.state(model, FP8Meta)
    assert len(jax.tree.leaves(state)) == 6 * 5  # 5 GEMMs, 6 state arrays each
    leaves = jax.tree_util.tree_leaves_with_path(state)
    hist = [leaf for path, leaf in leaves if "amax" in jax.tree_util.keystr(path)]
    assert len(hist) == 3 * 5 and all(np.count_nonzero(np.asarray(h)) == 15 for h in hist)


def _check_losses(bf16, fp8):
    """Both runs learn (the loss falls tenfold) and follow each other within FP8's tolerance:
    the mean loss over the run within 5% of bf16's."""
    assert bf16[-1] < 0.1 * bf16[0] and fp8[-1] < 0.1 * fp8[0], (bf16, fp8)
    gap = abs(float(np.mean(fp8) - np.mean(bf16))) / float(np.mean(bf16))
    assert gap <= 0.05, (gap, bf16, fp8)
