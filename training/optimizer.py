"""AdamW with linear warmup, cosine decay and global-norm clipping (optax).

Memory: AdamW keeps two moments (mu, nu) in the parameter dtype (fp32 by default), so with fp32
parameters the state is 8 bytes per parameter on top of the 4 of the parameters; it inherits
the parameters' shardings (1/N per device under FSDP). Weight decay skips the norm scales.
"""

from __future__ import annotations

import jax
import optax

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


def _decay_mask(params):
    """True for weights that get weight decay: everything but RMSNorm scales."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: "scale" not in jax.tree_util.keystr(path), params
    )


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    adamw = optax.adamw(
        lr_schedule(cfg), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
        weight_decay=cfg.weight_decay, mask=_decay_mask,
    )
    if cfg.grad_clip > 0:
        return optax.chain(optax.clip_by_global_norm(cfg.grad_clip), adamw)
    return adamw
