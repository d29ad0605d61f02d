"""Llama-style decoder: embedding, X pre-norm blocks (attention + SwiGLU), final norm, head.

Layers are stacked: every block parameter has a leading X axis ('layers') and the forward pass
is one `jax.lax.scan` over it, so compile time does not grow with depth. The remat policy
(model/remat.py) wraps the scanned body. What the backward keeps of each layer (all of it under
remat none) the scan writes into [X, ...] stacks and the backward reads back by dynamic slices:
on a GPU copies around every cuBLAS output (the H100's 1b step under none spent 96 ms of 580 in
memcpy). `model.scan_layers=false` runs the layers as a Python loop instead, each on its slice
of the stacked parameters (`jnp.split`, whose transpose is one concatenate of the gradients):
each layer keeps its activations in its own buffers, with no stack to copy them into and out of,
for a compile that grows with the depth (MaxText's `scan_layers`); the remat policy wraps each
layer there too, its checkpoint preventing CSE (model/remat.py). Timed on one GPU, 1b under
remat none: 431 ms a step unrolled against the scan's 579 (H100), 414 against 513 (H200); the
1b preset runs unrolled.

  tokens [B, L] -> embed [B, L, D] -> X x (x + attn(norm(x)); x + mlp(norm(x))) -> norm
  -> head [D, V] ('embed', 'vocab') -> logits [B, L, V] (fp32)

With model.n_experts > 0 the mlp of every `moe_every`-th layer is a mixture of experts
(model/moe.py); the stack's unit is then a Group of moe_every layers, and the forward also
returns the router statistics, which the loss adds (training/step.py).

Activations are pinned at block boundaries to ('batch', 'length', 'act_embed') (L as
'sp_length' under sequence parallelism), logits to ('batch', 'length', 'vocab'); the mesh
placement comes from sharding/rules.py. How the tensor-parallel regions run (shard_map or
GSPMD, SP, overlap), the attention core and the remat policy are the `Strategies` passed in
(sharding/strategies.py decides them for a run; one device by default).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.typing import DTypeLike

from configs.base import ModelConfig
from model.attention import Attention
from model.layers import Embed, RMSNorm, param, rotary
from model.mlp import MLP
from model.moe import MoE
from model.remat import LAYER_INPUT, remat
from sharding.checks import check_model, moe_layers
from sharding.context_layout import zigzag_permutation
from sharding.rules import axis_size, constrain
from sharding.strategies import Strategies
from sharding.tensor_parallel import TensorParallel
from sharding.vocab_parallel import vocab_parallel_logits


class Block(nnx.Module):
    """One layer: x + attn(norm(x)), then x + ffn(norm(x)), the ffn a SwiGLU MLP, or a mixture of
    experts (model/moe.py) dispatching by `experts` (dropless | capacity). Returns the new x and
    the MoE's router statistics ({} for a dense layer)."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel, core: str, context: str | None, experts: str | None,
                 *, rngs: nnx.Rngs):
        dtype = jnp.dtype(cfg.param_dtype)
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps, dtype, rngs=rngs)
        self.attn = Attention(cfg, tp, core, context, rngs=rngs)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps, dtype, rngs=rngs)
        self.mlp = MoE(cfg, tp, experts, rngs=rngs) if experts else MLP(cfg, tp, rngs=rngs)
        self.act_names = tp.activation_names

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> tuple[jax.Array, dict]:
        with jax.named_scope("attention"):
            x = x + self.attn(self.attn_norm(x), cos, sin)
        moe = isinstance(self.mlp, MoE)
        with jax.named_scope("moe" if moe else "mlp"):
            y, stats = self.mlp(self.mlp_norm(x)) if moe else (self.mlp(self.mlp_norm(x)), {})
        return constrain(x + y, self.act_names), stats

    def decode(self, x: jax.Array, cos: jax.Array, sin: jax.Array, cache: tuple[jax.Array, jax.Array],
               position: jax.Array) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        """The same layer on x [B, l, D] at `position`, attending over (and writing) its KV cache
        (Attention.decode); a MoE layer routes as it was built to (model/decode.py builds
        dropless) and its router statistics are dropped."""
        a, cache = self.attn.decode(self.attn_norm(x), cos, sin, cache, position)
        x = x + a
        y = self.mlp(self.mlp_norm(x))
        return constrain(x + (y[0] if isinstance(self.mlp, MoE) else y), self.act_names), cache


class Group(nnx.Module):
    """`model.moe_every` layers in a row, the last a MoE layer: the unit of the layer stack when
    only every k-th layer is MoE (k > 1), so that the stack stays one homogeneous scan."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel, core: str, context: str | None, experts: str, *,
                 rngs: nnx.Rngs):
        k = cfg.moe_every
        self.layers = nnx.List([Block(cfg, tp, core, context, experts if i == k - 1 else None, rngs=rngs)
                                for i in range(k)])

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> tuple[jax.Array, dict]:
        stats: dict = {}
        for layer in self.layers:
            x, more = layer(x, cos, sin)
            stats = stats or more
        return x, stats

    def decode(self, x: jax.Array, cos: jax.Array, sin: jax.Array, cache: tuple[jax.Array, jax.Array],
               position: jax.Array) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        """Block.decode through the k layers; cache k, v [k, B, L, K, H], one slab per layer."""
        keys, values = [], []
        for i, layer in enumerate(self.layers):
            x, (k, v) = layer.decode(x, cos, sin, (cache[0][i], cache[1][i]), position)
            keys.append(k)
            values.append(v)
        return x, (jnp.stack(keys), jnp.stack(values))


class Transformer(nnx.Module):
    def __init__(self, cfg: ModelConfig, strategies: Strategies | None = None, *, rngs: nnx.Rngs):
        check_model(cfg)
        strategies = strategies or Strategies.single_device(cfg)
        dtype = jnp.dtype(cfg.param_dtype)
        self.cfg = cfg
        self.tp, self.remat, self.context = strategies.tensor, strategies.remat, strategies.context
        self.act_names = self.tp.activation_names
        self.embed = Embed(cfg.vocab_size, cfg.d_model, cfg.init_std, dtype, rngs=rngs)
        self.blocks = self._stacked_blocks(cfg, strategies, rngs)
        self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps, dtype, rngs=rngs)
        self.head = param(rngs, (cfg.d_model, cfg.vocab_size), ("embed", "vocab"), cfg.init_std, dtype)

    @staticmethod
    def _stacked_blocks(cfg: ModelConfig, strategies: Strategies, rngs: nnx.Rngs) -> Block | Group:
        """The layer stack: X Blocks (dense, or all MoE), or X/k Groups of k (moe_every = k > 1)."""
        experts = strategies.experts
        grouped = experts and cfg.moe_every > 1
        t, core, context = strategies.tensor, strategies.attention, strategies.context

        @nnx.split_rngs(splits=cfg.n_layers // cfg.moe_every if grouped else cfg.n_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def make(rngs: nnx.Rngs) -> Block | Group:
            if grouped:
                return Group(cfg, t, core, context, experts, rngs=rngs)
            return Block(cfg, t, core, context, experts, rngs=rngs)

        return make(rngs)

    def __call__(self, tokens: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
        """tokens [B, L] int -> logits [B, L, V] fp32, and the MoE layers' router statistics
        (model/moe.py STATS, each the mean over the MoE layers; {} for a dense model)."""
        x, stats = self.run_layers(self.embed_tokens(tokens), nnx.state(self.blocks))
        return self.logits(x), {name: v / moe_layers(self.cfg) for name, v in stats.items()}

    def decode(self, tokens: jax.Array, cache: dict[str, jax.Array],
               position: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
        """tokens [B, l] at positions position..position+l-1 -> logits [B, l, V] fp32 and the KV
        cache {'k', 'v'} [X, B, L, K, H] with their keys and values written (model/decode.py):
        l = the prompt at position 0 (prefill), then l = 1 per generated token. The scan over
        the stacked layers carries x and takes each layer's cache as its scanned input/output
        (a Group's k layers' caches as one [k, B, L, K, H] slab of it)."""
        x = self.embed_tokens(tokens)
        cos, sin = (jax.lax.dynamic_slice_in_dim(t, position, tokens.shape[1])
                    for t in rotary(cache["k"].shape[2], self.cfg.head_dim, self.cfg.rope_theta))
        graphdef = nnx.graphdef(self.blocks)
        x_layers = cache["k"].shape[0]
        units = jax.tree.leaves(nnx.state(self.blocks))[0].shape[0]  # X, or X/k Groups of k layers

        def layer(x, inputs):
            layer_state, k, v = inputs
            return nnx.merge(graphdef, layer_state).decode(x, cos, sin, (k, v), position)

        per_unit = [c.reshape(units, x_layers // units, *c.shape[1:]) if units < x_layers else c
                    for c in (cache["k"], cache["v"])]
        x, (k, v) = jax.lax.scan(layer, x, (nnx.state(self.blocks), *per_unit))
        return self.logits(x), {"k": k.reshape(cache["k"].shape), "v": v.reshape(cache["v"].shape)}

    # The pieces below let pipeline/ run the layers in stages, embedding and head apart.

    def embed_tokens(self, tokens: jax.Array, vocab_parallel: bool = False,
                     dtype: DTypeLike | None = None) -> jax.Array:
        """tokens [B, L] int -> x [B, L, D] in `dtype` (default the table's); the lookup is the
        tensor axis's explicit region (Embed.vocab_parallel, which casts the rows before its
        collective) when the regions are explicit (tp_impl=shard_map) or when `vocab_parallel`
        asks for it, else XLA's."""
        with jax.named_scope("embedding"):
            if vocab_parallel or self.tp.impl == "shard_map":
                x = self.embed.vocab_parallel(tokens, self.tp.sequence_parallel, dtype)
            else:
                x = self.embed(tokens) if dtype is None else self.embed(tokens).astype(dtype)
            return constrain(x, self.act_names)

    def rotary_tables(self, rows: int) -> tuple[jax.Array, jax.Array]:
        """cos, sin [rows, H/2] for x's rows. Under context parallelism the batch's columns are in
        zigzag order (training/data.py), and so are the tables; inside a region already manual
        over `sequence` (the step's accumulation region) x holds this device's L/sp of them."""
        sp = axis_size("sequence")
        local = self.context and "sequence" in jax.sharding.get_abstract_mesh().manual_axes
        length = rows * sp if local else rows
        cos, sin = rotary(length, self.cfg.head_dim, self.cfg.rope_theta)
        if not self.context:
            return cos, sin
        order, _ = zigzag_permutation(length, sp)
        cos, sin = cos[order], sin[order]
        if not local:
            return cos, sin
        start = jax.lax.axis_index("sequence") * rows
        return tuple(jax.lax.dynamic_slice_in_dim(t, start, rows) for t in (cos, sin))

    def run_layers(self, x: jax.Array, layers: nnx.State) -> tuple[jax.Array, dict[str, jax.Array]]:
        """x [B, L, D] through the stacked block states `layers` ([n, ...] leaves, any n); the
        router statistics summed over the MoE layers."""
        cos, sin = self.rotary_tables(x.shape[1])
        graphdef = nnx.graphdef(self.blocks)

        def layer(x, layer_state):
            return nnx.merge(graphdef, layer_state)(x, cos, sin)

        checkpointed = remat(layer, self.remat, prevent_cse=not self.cfg.scan_layers)

        def body(x, layer_state):  # the input named for a pipeline chunk's policy (model.remat.stash_policy)
            return checkpointed(checkpoint_name(x, LAYER_INPUT), layer_state)

        if self.cfg.scan_layers:
            x, stats = jax.lax.scan(body, x, layers)  # over the n stacked layers
            return x, {name: jnp.sum(v) for name, v in stats.items()}
        totals: dict[str, jax.Array] = {}
        for layer_state in unstacked(layers):
            x, stats = body(x, layer_state)
            totals = {name: totals.get(name, 0) + jnp.sum(v) for name, v in stats.items()}
        return x, totals

    def logits(self, x: jax.Array) -> jax.Array:
        """x [B, L, D] -> final norm -> logits [B, L, V] fp32."""
        with jax.named_scope("head"):
            logits = vocab_parallel_logits(self.tp, self.final_norm(x), self.head[...])
        return constrain(logits, ("batch", "length", "vocab"))


def unstacked(layers: nnx.State) -> list[nnx.State]:
    """The [n, ...] stacked layer states as n states, one per layer. `jnp.split` rather than
    indexing: the gradient of n slices is n zero-padded copies summed, that of a split one
    concatenate."""
    leaves, treedef = jax.tree.flatten(layers)
    n = leaves[0].shape[0]
    parts = [jnp.split(a, n) for a in leaves]
    return [treedef.unflatten([jnp.squeeze(p[i], 0) for p in parts]) for i in range(n)]


def compute_params(params: nnx.State, dtype: DTypeLike) -> nnx.State:
    """The parameter tree cast to the compute dtype (bf16 by default; parameters stay fp32): XLA
    moves and multiplies the cast copy, and gradients come back through the cast in the
    parameters' own dtype."""
    return jax.tree.map(lambda p: p.astype(dtype), params)


def count_params(params: nnx.State) -> int:
    """Number of scalars in a (possibly abstract) parameter tree."""
    return sum(x.size for x in jax.tree.leaves(params))
