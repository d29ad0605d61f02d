"""SwiGLU feed-forward: down(silu(x @ gate) * (x @ up)).

Layout: w_gate, w_up [D, F] ('embed', 'mlp') column-parallel; w_down [F, D] ('mlp', 'embed')
row-parallel, as one tensor-parallel region (sharding/tensor_parallel.py): the hidden
[B, L, F] stays split over `tensor` and the down projection ends in one all-reduce of
[B, L, D] (forward; one more in backward), or a reduce-scatter under sequence parallelism.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from configs.base import ModelConfig
from model.layers import param
from sharding.rules import constrain
from sharding.tensor_parallel import Local, Sharded, TensorParallel

NAMES = {"w_gate": ("embed", "mlp"), "w_up": ("embed", "mlp"), "w_down": ("mlp", "embed")}


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel, *, rngs: nnx.Rngs):
        d, f = cfg.d_model, cfg.d_ff
        dtype = jnp.dtype(cfg.param_dtype)
        out_std = cfg.init_std / (2 * cfg.n_layers) ** 0.5
        self.w_gate = param(rngs, (d, f), NAMES["w_gate"], cfg.init_std, dtype)
        self.w_up = param(rngs, (d, f), NAMES["w_up"], cfg.init_std, dtype)
        self.w_down = param(rngs, (f, d), NAMES["w_down"], out_std, dtype)
        self.tp = tp

    def __call__(self, x: jax.Array) -> jax.Array:
        weights = {name: (getattr(self, name)[...], names) for name, names in NAMES.items()}
        return self.tp.region(self._local, x, weights)

    @staticmethod
    def _local(ops: Local | Sharded, x: jax.Array, w: dict) -> jax.Array:
        """One device's F/T columns: x [B, L, D] (or L/T rows under SP) -> [B, L, D] (or L/T)."""
        gate, up = ops.column(x, lambda x: (jnp.einsum("bld,df->blf", x, w["w_gate"]),
                                            jnp.einsum("bld,df->blf", x, w["w_up"])))
        hidden = constrain(jax.nn.silu(gate) * up, ("batch", "length", "mlp"))
        hidden = checkpoint_name(hidden, "mlp_hidden")
        return ops.row(hidden, lambda h: jnp.einsum("blf,fd->bld", h, w["w_down"]))
