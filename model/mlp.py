"""SwiGLU feed-forward: down(silu(x @ gate) * (x @ up)).

Layout: w_gate, w_up [D, F] ('embed', 'mlp') column-parallel; w_down [F, D] ('mlp', 'embed')
row-parallel. Under tensor parallelism the hidden [B, L, F] stays split over `tensor` and the
down projection ends in one all-reduce of [B, L, D] (forward; one more in backward).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from configs.base import ModelConfig
from model.layers import param
from sharding.rules import constrain


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        d, f = cfg.d_model, cfg.d_ff
        dtype = jnp.dtype(cfg.param_dtype)
        out_std = cfg.init_std / (2 * cfg.n_layers) ** 0.5
        self.w_gate = param(rngs, (d, f), ("embed", "mlp"), cfg.init_std, dtype)
        self.w_up = param(rngs, (d, f), ("embed", "mlp"), cfg.init_std, dtype)
        self.w_down = param(rngs, (f, d), ("mlp", "embed"), out_std, dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        gate = jnp.einsum("bld,df->blf", x, self.w_gate[...])
        up = jnp.einsum("bld,df->blf", x, self.w_up[...])
        hidden = constrain(jax.nn.silu(gate) * up, ("batch", "length", "mlp"))
        hidden = checkpoint_name(hidden, "mlp_hidden")
        return jnp.einsum("blf,fd->bld", hidden, self.w_down[...])
