"""SwiGLU feed-forward: down(silu(x @ gate) * (x @ up)).

Layout: w_gate, w_up [D, F] ('embed', 'mlp') column-parallel; w_down [F, D] ('mlp', 'embed')
row-parallel, as one tensor-parallel region (sharding/tensor_parallel.py): the hidden
[B, L, F] stays split over `tensor` and the down projection ends in one all-reduce of
[B, L, D] (forward; one more in backward), or a reduce-scatter under sequence parallelism.

Memory: the backward needs gate, up and the hidden (the down projection's weight gradient),
three [B, L, F/T] arrays a layer under remat none. Left to autodiff it also keeps silu(gate),
the product's other operand: XLA GPU on jax 0.12.1 wrote it out of the forward's fusion as a
fourth array (1b compiled for one H100, 8 x 2048 tokens, remat none: 39.98 GiB peak, 16 GiB of
it F-wide), where 0.12.0.1 had recomputed it (bench/results/memory-terms-1b-h100-compiled.json).
`swiglu` recomputes silu(gate) from gate in the backward's elementwise fusion: a
jax.checkpoint of the gating alone, whose CSE barrier keeps XLA from merging the recomputation
back into the forward's (without it the peak was unchanged): 36.16 GiB
(bench/results/swiglu-recompute-h100-compiled.json). The MoE experts' hidden goes through it
too (model/moe.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from configs.base import ModelConfig
from model.layers import param
from sharding.rules import constrain
from sharding.tensor_parallel import Local, Sharded, TensorParallel


@functools.partial(jax.checkpoint, prevent_cse=True)
def swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    """silu(gate) * up, keeping only gate and up for the backward (module docstring)."""
    return jax.nn.silu(gate) * up


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
        hidden = constrain(swiglu(gate, up), ("batch", "length", "mlp"))
        hidden = checkpoint_name(hidden, "mlp_hidden")
        return ops.row(hidden, lambda h: jnp.einsum("blf,fd->bld", h, w["w_down"]))
