"""Incremental decoding with a KV cache: prefill the prompt, then one token per step.

Cache layout, one array each for keys and values, preallocated to the whole sequence, L =
prompt + new tokens, and written in place (the jitted step donates it):

  k, v [X, B, L, K, H]  ('layers', 'batch', -, 'kv_heads', -): B over (data, fsdp), K over tensor
  bytes = 2·X·K·H·L·B·bytes(compute dtype) in all; per device that / (dp·fsdp·tp), or
          / (dp·fsdp) when K < tp (the kv heads are then replicated, sharding/rules.py)

The step is the model's own forward (Transformer.decode): embed the new tokens, scan over the
stacked layers with each layer's cache as the scan's input and output (Attention.decode writes
the new keys and values at `position` and attends over the cache, later slots masked), final
norm and head, then `sample` picks the next token. Prefill is the same function on the whole
prompt at position 0: one compile for the prompt's length, one for a single token.

It runs under GSPMD (tensor impl gspmd, xla core, whatever the run trained with): the
parameters sit where the logical rules put them and XLA inserts the collectives. Per decode step
on a (data, fsdp, tensor) mesh, b = B/(dp·fsdp) rows per device (census of the compiled step on
dp=2,tp=2, tests/test_generate.py):
  per layer   2 all-reduces over tensor of [b, 1, D] (attention's and MLP's row-parallel outputs;
              a MoE layer's experts, dropless, all on every device, give the second: no
              all-to-all); with fsdp > 1 also the all-gather of the layer's weights over fsdp
  embedding   1 all-reduce of [b, 1, D] (the lookup from the vocab-split table)
  sampling    the argmax over the vocab-split logits: 2 all-gathers of b values and indices
              over tensor (temperature > 0: the logits' sort and cumsum, gathered by XLA)
"""

from __future__ import annotations

import time
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from configs.base import ModelConfig
from model.transformer import Transformer, compute_params
from sharding.rules import logical_to_spec
from sharding.strategies import Strategies
from sharding.tensor_parallel import TensorParallel

CACHE_NAMES = ("layers", "batch", None, "kv_heads", None)


def cache_shape(cfg: ModelConfig, batch: int, length: int) -> tuple[int, int, int, int, int]:
    """[X, B, L, K, H] of the key (and of the value) cache."""
    return cfg.n_layers, batch, length, cfg.n_kv_heads, cfg.head_dim


def cache_bytes(cfg: ModelConfig, batch: int, length: int) -> int:
    """2·X·K·H·L·B·bytes: keys and values of every layer, in the compute dtype."""
    return 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * length * batch * jnp.dtype(cfg.compute_dtype).itemsize


def sample(logits: jax.Array, key: jax.Array, temperature: float, top_p: float) -> jax.Array:
    """logits [B, V] -> next tokens [B] int32. temperature 0: argmax (greedy). Else softmax of
    logits / temperature restricted to the nucleus: the most likely tokens whose mass first
    reaches top_p (always at least the most likely one, so a tiny top_p is greedy)."""
    if temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / temperature
    if top_p < 1:
        ranked = jnp.sort(logits, axis=-1)[:, ::-1]  # [B, V] descending
        probs = jax.nn.softmax(ranked, axis=-1)
        kept = jnp.sum(jnp.cumsum(probs, axis=-1) - probs < top_p, axis=-1, keepdims=True)  # [B, 1] >= 1
        floor = jnp.take_along_axis(ranked, kept - 1, axis=-1)
        logits = jnp.where(logits >= floor, logits, -jnp.inf)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


class Generation(NamedTuple):
    tokens: np.ndarray  # [B, N] the new tokens
    cache: dict[str, jax.Array]  # k, v [X, B, L, K, H] as the last step left them
    prefill_s: float  # the prompt in, the first token out
    decode_s: float  # the N-1 single-token steps


class Decoder:
    """The prefill and decode steps of `cfg`'s model on `mesh` for B rows of a P-token prompt and
    N new tokens (cache length L = P + N), compiled ahead of time with the shardings of the
    logical rules."""

    def __init__(self, cfg: ModelConfig, mesh: Mesh, batch: int, prompt_len: int, new_tokens: int,
                 temperature: float = 0.0, top_p: float = 1.0):
        # xla core, no remat; a MoE layer dropless: a token's output is its own, whoever shares its step
        strategies = Strategies(tensor=TensorParallel(impl="gspmd"), experts="dropless" if cfg.n_experts else None)
        self.graphdef = nnx.eval_shape(lambda: nnx.split(Transformer(cfg, strategies, rngs=nnx.Rngs(0))))[0]
        self.cfg, self.mesh, self.prompt_len, self.new_tokens = cfg, mesh, prompt_len, new_tokens
        self.shape = cache_shape(cfg, batch, prompt_len + new_tokens)
        self.cache_sharding = NamedSharding(mesh, logical_to_spec(CACHE_NAMES, self.shape, mesh))
        self.token_sharding = NamedSharding(mesh, logical_to_spec(("batch", None), (batch, 1), mesh))
        caches = {"k": self.cache_sharding, "v": self.cache_sharding}
        self.zeros = jax.jit(lambda: jnp.zeros(self.shape, cfg.compute_dtype), out_shardings=self.cache_sharding)
        self.step = jax.jit(self._step(temperature, top_p), donate_argnums=2, out_shardings=(self.token_sharding, caches))

    def _step(self, temperature: float, top_p: float) -> Callable:
        graphdef, dtype = self.graphdef, self.cfg.compute_dtype

        def step(params: nnx.State, tokens: jax.Array, cache: dict, position: jax.Array,
                 key: jax.Array) -> tuple[jax.Array, dict]:
            """tokens [B, l] at `position` -> the token after them [B, 1], and the cache."""
            logits, cache = nnx.merge(graphdef, compute_params(params, dtype)).decode(tokens, cache, position)
            return sample(logits[:, -1], jax.random.fold_in(key, position), temperature, top_p)[:, None], cache

        return step

    def compile(self, params: nnx.State) -> float:
        """Compile the prefill (l = P) and the decode step (l = 1); returns the seconds taken."""
        start = time.perf_counter()
        cache = jax.ShapeDtypeStruct(self.shape, self.cfg.compute_dtype, sharding=self.cache_sharding)
        scalar = jax.ShapeDtypeStruct((), jnp.int32)
        with jax.set_mesh(self.mesh):
            self.prefill, self.decode = (
                self.step.lower(params, jax.ShapeDtypeStruct((self.shape[1], length), jnp.int32,
                                                             sharding=self.token_sharding),
                                {"k": cache, "v": cache}, scalar, jax.random.key(0)).compile()
                for length in (self.prompt_len, 1))
        return time.perf_counter() - start

    def new_cache(self) -> dict[str, jax.Array]:
        """Zeroed k and v caches [X, B, L, K, H] in the compute dtype, each device its shard."""
        return {"k": self.zeros(), "v": self.zeros()}

    def generate(self, params: nnx.State, prompt: np.ndarray, seed: int = 0) -> Generation:
        """prompt [B, P] -> the next N tokens of every row (after `compile`)."""
        key, cache = jax.random.key(seed), self.new_cache()
        token = jax.device_put(np.asarray(prompt, np.int32), self.token_sharding)
        start = time.perf_counter()
        token, cache = self.prefill(params, token, cache, jnp.int32(0), key)
        out = [token.block_until_ready()]
        prefilled = time.perf_counter()
        for position in range(self.prompt_len, self.prompt_len + self.new_tokens - 1):
            token, cache = self.decode(params, token, cache, jnp.int32(position), key)
            out.append(token)
        tokens = np.concatenate(jax.device_get(out), axis=1)
        return Generation(tokens, cache, prefilled - start, time.perf_counter() - prefilled)
