"""Context parallelism's block schedule: which K/V block each device of the `sequence` axis
holds at each step, and which part of it its queries compute (sharding/context_parallel.py runs
the attention over it; the layout is sharding/context_layout.py's, c = L/(2sp) rows a chunk).

Schedule. At step s = 0..sp-1 device d holds the K/V block of device j = (d - s) mod sp. Under
the causal mask the part of that block its queries see is a corner, query rows [first:] against
key rows [:end] (later positions see more keys), and which corner depends only on whether
j = d, j < d or j > d; j < d exactly when s <= d:
  zigzag      j = d: the whole block, causal (the diagonal piece)
              j < d: both q chunks against the early kv chunk, [2c × c], unmasked
              j > d: the late q chunk against both kv chunks, [c × 2c], unmasked
  contiguous  j = d: the whole block, causal; j < d: the whole block, unmasked; j > d: nothing
Every step after the first costs 2c² pairs under zigzag, on every device. The diagonal piece
keeps the device's rows on both sides, in increasing position order: its mask is built from
the global positions (the xla core computes the fully masked (early q, late kv) quarter and
masks it; a flash kernel skips the tiles wholly above the diagonal). s is a Python int (the
ring is unrolled, sp is small) but d is traced (one SPMD program for all devices), so the
choice is a `lax.cond` on s <= d: XLA runs only the taken branch, and the piece has static
shapes in each. Masking
arithmetically instead would compute the masked half. The cond takes the held block and the
local accumulators only; what is in flight (the next block, the dK/dV arriving, which are added
after the branch) is no operand of it, so the transfer can run during the branch. Full
attention (causal=False) needs no cond: the whole block at every step.

Collectives: the ring's `blocks` sends K and V on to device d+1 at each step but the last
(2(sp-1) collective-permutes of one block, b·l·K·H elements each); the all-gather gathers both
once, [B, L, K, H] held while the layer runs (sharding/context_parallel.py counts both ways).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import jax
from jax import lax

from sharding.context_cores import BlockCore


@dataclass(frozen=True)
class Setup:
    """Static choices of one call (hashable: custom_vjp's non-differentiable argument)."""

    impl: str
    axis: str
    causal: bool
    zigzag: bool
    core: str | BlockCore


Piece = tuple[int, int, bool] | None  # (first query row, end of the key rows, diagonal); None: nothing


def piece(setup: Setup, case: str, rows: int) -> Piece:
    """What the local queries compute against the block of device j, case own (j = d), earlier
    (j < d) or later (j > d): rows [first:] of the queries against rows [:end] of the keys.
    Under the causal mask the visible part of a block is always such a corner: later positions
    see more keys (the module docstring's table)."""
    if not setup.causal:
        return 0, rows, False
    if case == "own":
        return 0, rows, True
    if setup.zigzag:
        return (0, rows // 2, False) if case == "earlier" else (rows // 2, rows, False)
    return (0, rows, False) if case == "earlier" else None


def visit(setup: Setup, s: int, device: jax.Array, rows: int, fn: Callable, *operands):
    """fn(piece, *operands) with the piece of step s (block of device j = (d - s) mod sp)."""
    if s == 0:
        return fn(piece(setup, "own", rows), *operands)
    earlier, later = piece(setup, "earlier", rows), piece(setup, "later", rows)
    if earlier == later:  # full attention: the whole block, every step
        return fn(earlier, *operands)
    return lax.cond(s <= device, functools.partial(fn, earlier), functools.partial(fn, later), *operands)


def to_right(sp: int) -> list[tuple[int, int]]:
    """The ring's permutation: device i sends to i+1 (mod sp)."""
    return [(i, (i + 1) % sp) for i in range(sp)]


def blocks(setup: Setup, k: jax.Array, v: jax.Array):
    """Yield (s, K block, V block) of device (d - s) mod sp for s = 0..sp-1. Ring: the send of
    the next block is issued before the current one is handed out to be computed on."""
    sp, rows = lax.axis_size(setup.axis), k.shape[1]
    if setup.impl == "allgather":
        d = lax.axis_index(setup.axis)
        k_all, v_all = (lax.all_gather(x, setup.axis, axis=1, tiled=True) for x in (k, v))  # [B, L, K, H]
        for s in range(sp):
            start = (d - s) % sp * rows
            yield s, *(lax.dynamic_slice_in_dim(x, start, rows, axis=1) for x in (k_all, v_all))
        return
    for s in range(sp):
        incoming = lax.ppermute((k, v), setup.axis, to_right(sp)) if s < sp - 1 else None
        yield s, k, v
        if incoming is not None:
            k, v = incoming
