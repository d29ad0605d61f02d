"""Context parallelism's layout: which positions of the sequence each device of the `sequence`
axis holds (sharding/context_parallel.py attends over them).

sp = size of the sequence axis, d = a device's index on it, L the full length, l = L/sp the
local rows. Contiguous split: device d holds positions [d·l, (d+1)·l). Zigzag (the default for
causal attention): L is cut into 2·sp chunks of c = L/(2sp) and device d holds chunks d and
2sp-1-d, one early and one late, so every device sees the same number of visible (query, key)
pairs: `causal_block_work` counts them (contiguous: device sp-1 does about 2sp-1 times the work
of device 0). The caller lays the sequence out once, at the input: `tokens[:, perm]` with
`perm, inverse = zigzag_permutation(L, sp)`, then a contiguous split over `sequence` gives the
zigzag; rotary tables are indexed by the same perm (`positions(L, sp, zigzag)[d]` are device
d's rows). The loss is a mean over tokens, so it needs no un-permuting. No collective and no
memory beyond the [L] index arrays.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def zigzag_permutation(length: int, sp: int) -> tuple[np.ndarray, np.ndarray]:
    """(perm, inverse) over L: `x[:, perm]` puts chunks (d, 2sp-1-d) in the d-th of sp contiguous
    slices; `y[:, inverse]` puts the natural order back."""
    if length % (2 * sp):
        raise ValueError(f"zigzag layout: length {length} is not divisible by 2·sp = {2 * sp}")
    chunks = np.arange(length).reshape(2 * sp, length // (2 * sp))
    perm = chunks[[i for d in range(sp) for i in (d, 2 * sp - 1 - d)]].reshape(-1)
    return perm, np.argsort(perm)


def positions(length: int, sp: int, zigzag: bool) -> np.ndarray:
    """[sp, L/sp]: the global position of each local row of each device (rotary tables, masks)."""
    if length % sp:
        raise ValueError(f"context parallelism: length {length} is not divisible by sp = {sp}")
    order = zigzag_permutation(length, sp)[0] if zigzag else np.arange(length)
    return order.reshape(sp, length // sp)


def device_positions(device: jax.Array, sp: int, rows: int, zigzag: bool) -> jax.Array:
    """[rows]: the global positions of `device`'s rows, traced (inside a region manual over the
    sequence axis, `device` its axis_index): a row of `positions`."""
    if not zigzag:
        return device * rows + jnp.arange(rows)
    c = rows // 2
    return jnp.concatenate([device * c + jnp.arange(c), (2 * sp - 1 - device) * c + jnp.arange(c)])


def causal_block_work(length: int, sp: int, zigzag: bool) -> np.ndarray:
    """[sp]: visible (query, key) pairs of causal attention per device; a row at position p sees
    p + 1 keys. Zigzag makes them equal; the ring's schedule computes exactly these (plus the
    masked halves of its diagonal pieces, the same count on every device)."""
    return (positions(length, sp, zigzag) + 1).sum(axis=1)
