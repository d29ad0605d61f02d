"""Grouped-query self-attention with a choice of core.

Layout (dimension letters of DESIGN.md):
  wq [D, N, H] ('embed', 'heads', 'head_dim')     q = x @ wq   [B, L, N, H]
  wk [D, K, H] ('embed', 'kv_heads', 'head_dim')  k, v         [B, L, K, H]
  wv [D, K, H]
  wo [N, H, D] ('heads', 'head_dim', 'embed')     out          [B, L, D]
QKV are column-parallel over heads, wo is row-parallel: the projections and the core run as
one tensor-parallel region (sharding/tensor_parallel.py), each device on its own heads, and the
region ends in one all-reduce (or reduce-scatter under sequence parallelism). Under context
parallelism (sp > 1) the region is manual over `sequence` too: each device projects its L/sp
rows and the core is a ring of K/V blocks or one all-gather (sharding/context_parallel.py),
with the rotary tables in the same zigzag order as the rows; with context_impl=gspmd XLA
all-gathers K and V over `sequence` in every layer instead.

Cores (`model.attention`; auto, the default, picks one by device: sharding/cores.py):
  xla    plain einsum + fp32 softmax, the reference. It repeats K/V heads to N (G = N/K times)
         and materialises the [B, N, L, L] scores: memory O(L^2) per head.
  cudnn  jax.nn.dot_product_attention(implementation='cudnn'): fused, GQA without repeats;
         NVIDIA GPUs only.
  pallas our flash attention kernel (model/kernels/flash_attention.py): tiled online softmax,
         memory O(L·H) per head; run per device under shard_map (model/kernels/sharded.py).
         Interpreted on CPU (slow: for tests), compiled by Triton on NVIDIA GPUs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from configs.base import ConfigError, ModelConfig
from model.kernels.flash_attention import flash_block_backward, flash_block_forward
from model.kernels.sharded import per_device, sharded_flash_attention
from model.layers import apply_rotary, param, softmax
from sharding.context_parallel import BlockCore, allgather_attention, ring_attention
from sharding.cores import core_problem, target
from sharding.rules import constrain
from sharding.tensor_parallel import Local, Sharded, TensorParallel


def xla_attention(q: jax.Array, k: jax.Array, v: jax.Array, causal: bool = True,
                  offset: int | jax.Array = 0) -> jax.Array:
    """Causal (or full) attention. q [B, L, N, H], k/v [B, M, K, H] -> [B, L, N, H]; M = L in
    training. Causal: query i sits at position offset + i and sees keys 0..offset + i (decoding
    against a KV cache of M >= offset + L slots, model/decode.py; later slots are masked)."""
    groups = q.shape[2] // k.shape[2]
    k = jnp.repeat(k, groups, axis=2)  # [B, L, K, H] -> [B, L, N, H]; kv head j serves q heads jG..jG+G-1
    v = jnp.repeat(v, groups, axis=2)
    scores = jnp.einsum("blnh,bmnh->bnlm", q, k, preferred_element_type=jnp.float32)
    scores = scores / jnp.sqrt(jnp.float32(q.shape[-1]))
    if causal:
        visible = jnp.arange(k.shape[1])[None, :] <= jnp.arange(q.shape[1])[:, None] + offset  # [L, M]
        scores = jnp.where(visible, scores, jnp.finfo(jnp.float32).min)
    probs = softmax(scores, axis=-1).astype(v.dtype)
    return jnp.einsum("bnlm,bmnh->blnh", probs, v)


def cudnn_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")


def attention_core(name: str, cfg: ModelConfig, context: str | None = None):
    """The core function `name` (a concrete core: sharding/strategies.py resolves auto through
    sharding/cores.py), or a ConfigError saying why it cannot run here. Under context
    parallelism (`context` ring | allgather) the core runs per block of the sequence axis, inside
    the attention region (sharding/context_parallel.py): xla, or the Pallas kernel's block
    forward and backward."""
    problem = core_problem(name, *target(), cfg.compute_dtype, cfg.head_dim)
    if problem:
        raise ConfigError(f"--set model.attention={name}: {problem}")
    if context:
        block = "xla" if name == "xla" else BlockCore(flash_block_forward, flash_block_backward)
        impl = {"ring": ring_attention, "allgather": allgather_attention}[context]
        return functools.partial(impl, core=block)
    if name == "cudnn":
        return per_device(cudnn_attention, "cudnn")
    return {"xla": xla_attention, "pallas": sharded_flash_attention}[name]


NAMES = {
    "wq": ("embed", "heads", "head_dim"),
    "wk": ("embed", "kv_heads", "head_dim"),
    "wv": ("embed", "kv_heads", "head_dim"),
    "wo": ("heads", "head_dim", "embed"),
}


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel, core: str, context: str | None = None, *,
                 rngs: nnx.Rngs):
        d, n, k, h = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        dtype = jnp.dtype(cfg.param_dtype)
        out_std = cfg.init_std / (2 * cfg.n_layers) ** 0.5  # residual-branch scaling
        self.wq = param(rngs, (d, n, h), NAMES["wq"], cfg.init_std, dtype)
        self.wk = param(rngs, (d, k, h), NAMES["wk"], cfg.init_std, dtype)
        self.wv = param(rngs, (d, k, h), NAMES["wv"], cfg.init_std, dtype)
        self.wo = param(rngs, (n, h, d), NAMES["wo"], out_std, dtype)
        self.core = attention_core(core, cfg, context)
        self.n_kv_heads = k
        self.tp = tp

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
        weights = {name: (getattr(self, name)[...], names) for name, names in NAMES.items()}
        return self.tp.region(self._local, x, weights, cos, sin, kernel=True)

    def decode(self, x: jax.Array, cos: jax.Array, sin: jax.Array, cache: tuple[jax.Array, jax.Array],
               position: jax.Array) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        """x [B, l, D] at positions position..position+l-1 (cos/sin: their rows) against this
        layer's KV cache (k, v) [B, M, K, H]: writes the l new keys and values at `position`,
        attends over the cache with the xla core (slots after each query masked) and returns
        ([B, l, D], the updated cache). Plain per-device code: the decode path runs under GSPMD
        (model/decode.py), which splits the heads and the cache over the mesh."""
        w = {name: getattr(self, name)[...] for name in NAMES}
        q, k, v = self._qkv(Local(), x, w, cos, sin)
        k_cache, v_cache = (jax.lax.dynamic_update_slice_in_dim(c, new.astype(c.dtype), position, axis=1)
                            for c, new in zip(cache, (k, v)))
        out = xla_attention(q, k_cache, v_cache, offset=position)
        return jnp.einsum("blnh,nhd->bld", out, w["wo"]), (k_cache, v_cache)

    def _qkv(self, ops: Local | Sharded, x: jax.Array, w: dict, cos: jax.Array,
             sin: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """x [B, L, D] -> q [B, L, N', H], k and v [B, L, K', H] of this device's heads, rotated."""
        wk, wv = (ops.own_kv_heads(w[name], self.n_kv_heads) for name in ("wk", "wv"))

        def project(x):  # [B, l, D] -> q [B, l, N', H], k and v [B, l, K', H]
            return (jnp.einsum("bld,dnh->blnh", x, w["wq"]), jnp.einsum("bld,dkh->blkh", x, wk),
                    jnp.einsum("bld,dkh->blkh", x, wv))

        q, k, v = ops.column(x, project)
        q = constrain(apply_rotary(q, cos, sin), ("batch", "length", "heads", None))
        k = constrain(apply_rotary(k, cos, sin), ("batch", None, "kv_heads", None))
        v = constrain(v, ("batch", None, "kv_heads", None))
        return tuple(checkpoint_name(t, name) for t, name in ((q, "query"), (k, "key"), (v, "value")))

    def _local(self, ops: Local | Sharded, x: jax.Array, w: dict, cos: jax.Array, sin: jax.Array) -> jax.Array:
        """One device's heads: x [B, L, D] (or its L/T rows under SP) -> [B, L, D] (or L/T)."""
        q, k, v = self._qkv(ops, x, w, cos, sin)
        out = checkpoint_name(self.core(q, k, v), "attn_core")
        return ops.row(out, lambda o: jnp.einsum("blnh,nhd->bld", o, w["wo"]))
