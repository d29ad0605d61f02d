"""AdamW with linear warmup, cosine decay and global-norm clipping (optax).

Memory: AdamW keeps two moments (mu, nu) in the parameter dtype (fp32 by default), so with fp32
parameters the state is 8 bytes per parameter on top of the 4 of the parameters; it inherits
the parameters' shardings (1/N per device under FSDP). Weight decay skips the norm scales,
known by their logical axis names (model/layers.py `param`: RMSNorm's scale is ('norm',), or
('layers', 'norm') in the stacked blocks), not by their place in the tree.
"""

from __future__ import annotations

import jax
import optax
from flax import nnx

from configs.base import TrainConfig


def lr_schedule(cfg: TrainConfig) -> optax.Schedule:
    """0 -> lr over warmup_steps, then cosine down to lr * min_lr_ratio at `steps`."""
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=cfg.lr,
        warmup_steps=cfg.warmup_steps,
        decay_steps=max(cfg.steps, cfg.warmup_steps + 1),
        end_value=cfg.lr * cfg.min_lr_ratio,
    )


def _decay_mask(params: nnx.State) -> nnx.State:
    """True for the parameters that get weight decay: all but those named 'norm' on an axis."""
    return jax.tree.map(lambda var: "norm" not in (var.get_metadata().get("out_sharding") or ()), params,
                        is_leaf=lambda x: isinstance(x, nnx.Variable))


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    adamw = optax.adamw(
        lr_schedule(cfg), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
        weight_decay=cfg.weight_decay, mask=_decay_mask,
    )
    if cfg.grad_clip > 0:
        return optax.chain(optax.clip_by_global_norm(cfg.grad_clip), adamw)
    return adamw
