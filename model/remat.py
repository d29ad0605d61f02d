"""Rematerialisation policies for the scanned layer, chosen by name (`model.remat`).

  none   keep every intermediate of every layer for the backward pass (fastest, most memory)
  full   keep only each layer's input [B, L, D]; recompute the whole layer in backward
         (about one extra forward: ~+33% FLOPs)
  dots   keep the outputs of matmuls without batch dimensions (the projections), recompute
         the elementwise work, norms and softmax
  attn   keep the tagged q, k, v and attention output (checkpoint_name tags in model/),
         recompute the MLP: a middle ground when the MLP hidden [B, L, F] dominates memory
"""

from __future__ import annotations

from typing import Callable

import jax

from configs.base import ConfigError

POLICIES: dict[str, Callable | None] = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "attn": jax.checkpoint_policies.save_only_these_names("query", "key", "value", "attn_core"),
}


def remat(fn: Callable, name: str) -> Callable:
    """`fn` wrapped in jax.checkpoint with the named policy ('none' returns fn unchanged)."""
    if name not in POLICIES:
        raise ConfigError(f"--set model.remat={name}: unknown policy; choose one of {', '.join(POLICIES)}")
    if name == "none":
        return fn
    return jax.checkpoint(fn, policy=POLICIES[name], prevent_cse=False)
