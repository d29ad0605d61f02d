"""Collective matmul: sequence parallelism's all-gather and reduce-scatter as rings that hide
behind the matmuls they feed (`parallel.tp_overlap=true`; sharding/tensor_parallel.py's
`Sharded` calls these inside its shard_map, T = the axis size, t = this device's index).

  gather_ring   x [B, L/T, D] -> fn(x) on the whole L, one chunk at a time. At step s device t
                applies fn to the chunk of L it holds, (t+s) mod T, while it passes that chunk
                on to device t-1 with a collective-permute, so the next chunk's transfer hides
                behind this chunk's matmul. Replaces all-gather(x) then fn.
  scatter_ring  h [B, L, F/T] -> the sum over the axis of fn(h)'s chunk t, [B, L/T, D]. At step
                s device t computes its partial of chunk (t-1-s) mod T, adds the running sum
                received from t-1 and sends it to t+1; after T steps it holds the full sum of
                chunk t. Replaces fn then reduce-scatter.

Each ring is T-1 collective-permutes of S/T elements (S = B·L·D), (T-1)·S/T in all: the bytes
of the all-gather or reduce-scatter it replaces. Autodiff turns each ring into the opposite
ring. Memory: the gather ring writes fn's outputs for the whole L into one buffer, as fn on the
gathered x would, and autodiff keeps every chunk of x for the weight gradient, as it keeps the
gathered x. The rings are unrolled (T steps in the program) so that XLA's scheduler can overlap
each permute with the neighbouring step's matmul.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax


def gather_ring(x: jax.Array, fn: Callable, axis: str, size: int) -> tuple:
    """fn (L-local: [B, l, D] -> arrays [B, l, ...]) over the whole sequence, x [B, L/T, D]
    arriving one chunk per step from the next device on `axis` (`size` T devices)."""
    t, chunk = lax.axis_index(axis), x.shape[1]
    to_left = [(i, (i - 1) % size) for i in range(size)]
    outs = None
    for s in range(size):
        incoming = lax.ppermute(x, axis, to_left) if s < size - 1 else None  # chunk (t+s+1) mod T
        parts = fn(x)
        if outs is None:  # [B, l, ...] -> zeros [B, L, ...]
            outs = jax.tree.map(lambda a: jnp.zeros((a.shape[0], size * chunk, *a.shape[2:]), a.dtype), parts)
        start = (t + s) % size * chunk
        outs = jax.tree.map(lambda o, a: lax.dynamic_update_slice_in_dim(o, a, start, axis=1), outs, parts)
        x = incoming
    return outs


def scatter_ring(h: jax.Array, fn: Callable, axis: str, size: int) -> jax.Array:
    """fn(h) ([B, L, F/T] -> partial [B, L, D]) summed over `axis`, this device's chunk of L
    [B, L/T, D] only, each partial sum passed on to the next device."""
    t = lax.axis_index(axis)
    chunk = h.shape[1] // size
    to_right = [(i, (i + 1) % size) for i in range(size)]
    acc = None
    for s in range(size):
        part = fn(lax.dynamic_slice_in_dim(h, (t - 1 - s) % size * chunk, chunk, axis=1))
        acc = part if acc is None else acc + part
        if s < size - 1:
            acc = lax.ppermute(acc, axis, to_right)
    return acc  # [B, L/T, D]: the sum of chunk t
