"""Run a fused attention core per device: `shard_map` over batch and heads. The Pallas flash
kernel (`sharded_flash_attention`) and cuDNN's (`per_device(cudnn_attention, "cudnn")`, from
model/attention.py) both run this way.

Only the mesh axes that are still automatic here are mapped: inside the tensor-parallel regions
(sharding/tensor_parallel.py) `tensor` (and under sequence parallelism the batch axes) are
already manual and q, k, v are this device's heads (kv heads picked by the region), so the
core sees them as they are.

Why per device: a Pallas call is opaque to GSPMD, and cuDNN's call is partitioned by jax's
custom partitioning, which fails to compile inside a partly manual shard_map (an assertion in
`custom_partitioning`, seen compiling for H100s with tools.gpu_target at any tp > 1; pure
data/fsdp meshes compiled). So under a mesh the core runs inside `jax.shard_map` on each
device's block: q [B/(data·fsdp), L, N/tensor, H], k/v [B/(data·fsdp), L, K/tensor, H] (the
specs come from the logical rules: `batch`, `heads`, `kv_heads`; model code never names a mesh
axis). Attention is independent per batch row and per head, so the body needs no collective. L
is not split inside the core: under `sequence` sharding shard_map all-gathers q at entry (K and
V are already gathered by the attention layer) and each device returns the full length.

kv heads fewer than the tensor axis are replicated by the rules (each device holds all K). A
device's N/tensor q heads then all read one kv head when K divides the tensor size, so the body
slices that head (index: first local q head // G); K neither a multiple nor a divisor of the
tensor size is refused. Pallas inside shard_map needs check_vma=False; cuDNN's call runs the same.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
from jax import lax

from configs.base import ConfigError
from model.kernels.flash_attention import flash_attention
from sharding.rules import auto_axes, logical_to_spec
from sharding.tensor_parallel import own_kv_head


def per_device(core: Callable, name: str) -> Callable:
    """`core` (causal, q [B, L, N, H], k/v [B, L, K, H] -> [B, L, N, H]) on any mesh, one
    device's block at a time; name: its model.attention value, for errors."""

    def attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        mesh, auto = jax.sharding.get_abstract_mesh(), auto_axes()
        q_spec = logical_to_spec(("batch", None, "heads", None), q.shape, mesh, within=auto)
        kv_spec = logical_to_spec(("batch", None, "kv_heads", None), k.shape, mesh, within=auto)
        if not auto or (all(axes is None for axes in q_spec) and not mesh.manual_axes):
            return core(q, k, v)  # one device's block, outside any region (or no mesh)
        heads_axes, body = q_spec[2], core
        if heads_axes is not None and kv_spec[2] is None:  # q heads split, kv heads replicated
            axes = (heads_axes,) if isinstance(heads_axes, str) else heads_axes
            split = math.prod(dict(mesh.shape)[a] for a in axes)
            body = _one_kv_head_per_device(core, name, axes, q.shape[2], k.shape[2], q.shape[2] // split)
        return jax.shard_map(body, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec), out_specs=q_spec,
                             axis_names=set(auto), check_vma=False)(q, k, v)

    return attention


def _one_kv_head_per_device(core: Callable, name: str, axes: tuple[str, ...], n_heads: int, kv_heads: int,
                            local_heads: int) -> Callable:
    """Body for replicated K/V: keep only the kv head that this device's q heads read."""
    groups = n_heads // kv_heads
    if groups % local_heads:
        raise ConfigError(
            f"model.n_kv_heads={kv_heads}: with attention={name} the tensor axis "
            f"({n_heads // local_heads}) must be a multiple or a divisor of n_kv_heads"
        )

    def body(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        head = own_kv_head(axes, n_heads // local_heads, kv_heads)
        k, v = (lax.dynamic_slice_in_dim(x, head, 1, axis=2) for x in (k, v))  # [b, L, 1, H]
        return core(q, k, v)

    return body


sharded_flash_attention = per_device(flash_attention, "pallas")
