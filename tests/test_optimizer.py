"""AdamW's weight decay reaches every weight but the norm scales, chosen by their logical names."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from configs import apply_overrides, get_preset
from model.transformer import Transformer
from training.optimizer import make_optimizer


def test_weight_decay_skips_exactly_the_norm_scales():
    cfg = apply_overrides(get_preset("tiny"), ["train.warmup_steps=0", "train.weight_decay=0.1", "train.grad_clip=0"])
    _, params = nnx.split(Transformer(cfg.model, rngs=nnx.Rngs(0)))
    tx = make_optimizer(cfg.train)
    zero = jax.tree.map(jnp.zeros_like, params)  # Adam moves nothing: any update is the decay
    updates, _ = tx.update(zero, tx.init(params), params)
    moved = {jax.tree_util.keystr(path, simple=True, separator="."): bool(np.any(np.asarray(u[...]) != 0))
             for path, u in jax.tree.leaves_with_path(updates, is_leaf=lambda x: isinstance(x, nnx.Variable))}
    assert {p for p, m in moved.items() if not m} == {
        "blocks.attn_norm.scale", "blocks.mlp_norm.scale", "final_norm.scale"}, moved
    assert {"embed.table", "head", "blocks.attn.wq", "blocks.mlp.w_down"} <= {p for p, m in moved.items() if m}
