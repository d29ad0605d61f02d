"""Context parallelism: causal attention over a sequence split on the `sequence` axis, written
out per device (issue 13). Two ways to get the keys: a ring of collective-permutes, or one
all-gather (Llama 3's choice). Both share the block schedule, the cores and the merge.

Layout. sp = size of the sequence axis, d = this device's index on it, L the full length,
l = L/sp the local rows. Each device holds its rows of q [B, l, N, H] and k, v [B, l, K, H]
(GQA: query head n reads kv head n // (N/K)) and keeps its queries. Contiguous split: device d
holds positions [d·l, (d+1)·l). Zigzag (the default for causal attention): L is cut into 2·sp
chunks of c = L/(2sp) and device d holds chunks d and 2sp-1-d, one early and one late, so every
device sees the same number of visible (query, key) pairs: `causal_block_work` counts them
(contiguous: device sp-1 does about 2sp-1 times the work of device 0). The caller lays the
sequence out once, at the input: `tokens[:, perm]` with `perm, inverse = zigzag_permutation(L,
sp)`, then a contiguous split over `sequence` gives the zigzag; rotary tables are indexed by the
same perm (`positions(L, sp, zigzag)[d]` are device d's rows). The loss is a mean over tokens,
so it needs no un-permuting.

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
masks it; a flash kernel skips the tiles wholly above the diagonal). s is a Python int (the ring is unrolled, sp is
small) but d is traced (one SPMD program for all devices), so the choice is a `lax.cond` on
s <= d: XLA runs only the taken branch, and the piece has static shapes in each. Masking
arithmetically instead would compute the masked half. The cond takes the held block and the
local accumulators only; what is in flight (the next block, the dK/dV arriving, which are added
after the branch) is no operand of it, so the transfer can run during the branch. Full
attention (causal=False) needs no cond: the whole block at every step.

Cores (`core=`), per piece (sharding/context_cores.py): "xla", the reference, or a `BlockCore`
such as our Pallas flash kernels. Each piece returns its output and log-sum-exp; pieces over the
same query rows merge by it (`merge`, the flash recurrence across devices, in fp32). The
backward recomputes each piece's probabilities from the saved global lse and delta: dq stays
local, dk/dv belong to the block.

Collectives per layer, E = b·l·K·H elements (one local K or V block, b the local batch):

  impl       forward                               backward
  ring       2(sp-1) collective-permutes of E      2(sp-1) collective-permutes of E (K, V
             (K and V, to device d+1)              again) + 2·sp of E in fp32 (dK, dV travel
                                                   with their block; the last send takes
                                                   them home)
  allgather  2 all-gathers, result sp·E (K, V)     2 all-gathers again + 2 reduce-scatters of
                                                   sp·E fp32 (dK, dV)

Elements each device sends: forward 2E(sp-1) for both, the ring in sp-1 steps of 2E each, one
per block computed, the all-gather at once. Backward: the ring 2E(sp-1) + 2E·sp fp32, the
all-gather 2E(sp-1) + 2E(sp-1) fp32. Gradient partial sums stay fp32 until they are home.

Memory per device. Saved for the backward (`jax.custom_vjp`): q, k, v, out and lse of the local
rows, O(l): no [L, L] scores and no full-length K/V outlive a layer. Ring: while running, two
K/V blocks (the one held, the one in flight), in the backward also two dK/dV blocks in fp32;
the xla core adds the fp32 scores of one piece ([b, N, 2c, 2c] at most), a flash core only
tiles. All-gather: the gathered K and V [b, L, K, H] while the layer's forward or backward runs
(the backward gathers again rather than keeping them), plus full-length fp32 dK/dV accumulators
in the backward: O(L·K·H), small under GQA, for one collective instead of sp-1 latencies. The ring is for
lengths where that L term does not fit, or where each step's transfer must hide behind a
block's compute. One caveat: when the forward and the backward are one program with no loop
between them, XLA merges the backward's K/V sends with the forward's identical ones (CSE; XLA
CPU does, an optimization_barrier on the residuals does not stop it), keeping the received
blocks from forward to backward. The model's layer scan keeps them apart (forward and backward
are different loops); under remat the recomputed forward shares the backward's loop body,
where XLA can merge them the same way (one layer's blocks then live through its backward).

The public functions run per device inside a `jax.shard_map` that is manual over `axis`
(they call axis_index, ppermute, all_gather); `context_parallel_attention` wraps one in such a
shard_map over a mesh, for tests and standalone use. A Pallas core needs check_vma=False
(interpret mode cannot type its loops), as in sharding/tensor_parallel.py. Inside the
tensor-parallel region, make that one region manual over `sequence` as well and call these
directly: a shard_map over `sequence` nested in one manual over `tensor` fails to lower on
jax 0.10 and 0.12 when the outer region checks vma, and aborts XLA on 0.12 when it does not.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from sharding.context_cores import F32, BlockCore, merge, piece_core

IMPLS = ("ring", "allgather")
# the checkpoint_name of what the forward keeps for the backward (out, lse): a remat policy keeps
# these rather than the blocks' scores they come from (model.remat.stash_policy)
KEPT_NAME = "attention_residual"
AXIS = "sequence"


# --- layout ---------------------------------------------------------------------------------

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


def causal_block_work(length: int, sp: int, zigzag: bool) -> np.ndarray:
    """[sp]: visible (query, key) pairs of causal attention per device; a row at position p sees
    p + 1 keys. Zigzag makes them equal; the ring's schedule computes exactly these (plus the
    masked halves of its diagonal pieces, the same count on every device)."""
    return (positions(length, sp, zigzag) + 1).sum(axis=1)


# --- the schedule ------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Setup:
    """Static choices of one call (hashable: custom_vjp's non-differentiable argument)."""

    impl: str
    axis: str
    causal: bool
    zigzag: bool
    core: str | BlockCore


Piece = tuple[int, int, bool] | None  # (first query row, end of the key rows, diagonal); None: nothing


def _piece(setup: _Setup, case: str, rows: int) -> Piece:
    """What the local queries compute against the block of device j, case own (j = d), earlier
    (j < d) or later (j > d): rows [first:] of the queries against rows [:end] of the keys.
    Under the causal mask the visible part of a block is always such a corner: later positions
    see more keys (module docstring's table)."""
    if not setup.causal:
        return 0, rows, False
    if case == "own":
        return 0, rows, True
    if setup.zigzag:
        return (0, rows // 2, False) if case == "earlier" else (rows // 2, rows, False)
    return (0, rows, False) if case == "earlier" else None


def _visit(setup: _Setup, s: int, device: jax.Array, rows: int, fn: Callable, *operands):
    """fn(piece, *operands) with the piece of step s (block of device j = (d - s) mod sp)."""
    if s == 0:
        return fn(_piece(setup, "own", rows), *operands)
    earlier, later = _piece(setup, "earlier", rows), _piece(setup, "later", rows)
    if earlier == later:  # full attention: the whole block, every step
        return fn(earlier, *operands)
    return lax.cond(s <= device, functools.partial(fn, earlier), functools.partial(fn, later), *operands)


def _device_positions(setup: _Setup, device: jax.Array, sp: int, rows: int) -> jax.Array:
    """[rows]: global positions of `device`'s rows, traced."""
    if not setup.zigzag:
        return device * rows + jnp.arange(rows)
    c = rows // 2
    return jnp.concatenate([device * c + jnp.arange(c), (2 * sp - 1 - device) * c + jnp.arange(c)])


def _to_right(sp: int) -> list[tuple[int, int]]:
    return [(i, (i + 1) % sp) for i in range(sp)]


def _blocks(setup: _Setup, k: jax.Array, v: jax.Array):
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
        incoming = lax.ppermute((k, v), setup.axis, _to_right(sp)) if s < sp - 1 else None
        yield s, k, v
        if incoming is not None:
            k, v = incoming


# --- forward and backward ----------------------------------------------------------------------

def _forward(setup: _Setup, q: jax.Array, k: jax.Array, v: jax.Array) -> tuple[jax.Array, jax.Array]:
    """out [B, l, N, H] (q's dtype) and lse fp32 [B, N, l] of the local queries over all keys."""
    forward = piece_core(setup.core)[0]
    sp, d, rows = lax.axis_size(setup.axis), lax.axis_index(setup.axis), q.shape[1]
    pos = _device_positions(setup, d, sp, rows)

    def attend(piece: Piece, kb, vb, acc):
        if piece is None:
            return acc
        first, end, diagonal = piece
        part = forward(q[:, first:], kb[:, :end], vb[:, :end], (pos[first:], pos[:end]) if diagonal else None)
        if acc is None:  # step 0: the own block covers every row
            return part
        out, lse = merge((acc[0][:, first:], acc[1][..., first:]), part)
        return (lax.dynamic_update_slice_in_dim(acc[0], out, first, axis=1),
                lax.dynamic_update_slice_in_dim(acc[1], lse, first, axis=2))

    acc = None
    for s, kb, vb in _blocks(setup, k, v):
        acc = _visit(setup, s, d, rows, attend, kb, vb, acc)
    return acc[0].astype(q.dtype), acc[1]


def _backward(setup: _Setup, residuals, d_out: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    q, k, v, out, lse = residuals
    backward = piece_core(setup.core)[1]
    sp, d, rows = lax.axis_size(setup.axis), lax.axis_index(setup.axis), q.shape[1]
    pos = _device_positions(setup, d, sp, rows)
    delta = jnp.einsum("blnh,blnh->bnl", d_out.astype(F32), out.astype(F32))  # rowsum(dO·out)

    def grads(piece: Piece, kb, vb, dq):
        """dq += this block's share; dk, dv of the block from this device's queries (fp32)."""
        dk, dv = jnp.zeros_like(kb, F32), jnp.zeros_like(vb, F32)
        if piece is None:
            return dq, dk, dv
        first, end, diagonal = piece
        gq, gk, gv = backward(q[:, first:], kb[:, :end], vb[:, :end], d_out[:, first:], lse[..., first:],
                              delta[..., first:], (pos[first:], pos[:end]) if diagonal else None)
        dq = lax.dynamic_update_slice_in_dim(dq, dq[:, first:] + gq, first, axis=1)
        return dq, lax.dynamic_update_slice_in_dim(dk, gk, 0, axis=1), lax.dynamic_update_slice_in_dim(dv, gv, 0, axis=1)

    dq = jnp.zeros_like(q, F32)
    if setup.impl == "ring":
        held = None  # dK, dV of the block this device holds, summed over the devices it visited
        for s, kb, vb in _blocks(setup, k, v):
            dq, gk, gv = _visit(setup, s, d, rows, grads, kb, vb, dq)
            held = (gk, gv) if held is None else (held[0] + gk, held[1] + gv)  # added after the compute
            held = lax.ppermute(held, setup.axis, _to_right(sp))  # the last send brings them home
        dk, dv = held
    else:
        full = [jnp.zeros((k.shape[0], sp * rows, *k.shape[2:]), F32) for _ in range(2)]  # dK, dV [B, L, K, H]
        for s, kb, vb in _blocks(setup, k, v):
            dq, gk, gv = _visit(setup, s, d, rows, grads, kb, vb, dq)
            start = (d - s) % sp * rows
            full = [lax.dynamic_update_slice_in_dim(x, lax.dynamic_slice_in_dim(x, start, rows, axis=1) + g,
                                                    start, axis=1) for x, g in zip(full, (gk, gv))]
        dk, dv = (lax.psum_scatter(x, setup.axis, scatter_dimension=1, tiled=True) for x in full)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(setup: _Setup, q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    return _forward(setup, q, k, v)[0]


def _attention_fwd(setup: _Setup, q, k, v):
    out, lse = (checkpoint_name(a, KEPT_NAME) for a in _forward(setup, q, k, v))
    return out, (q, k, v, out, lse)


_attention.defvjp(_attention_fwd, _backward)


# --- public API --------------------------------------------------------------------------------

def _checked(impl: str, axis: str, causal: bool, zigzag: bool, core: str | BlockCore, q: jax.Array,
             k: jax.Array) -> _Setup:
    if not (core == "xla" or isinstance(core, BlockCore)):
        raise ValueError(f"context parallelism: core {core!r} is neither 'xla' nor a BlockCore")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"context parallelism: {q.shape[2]} query heads are not a multiple of {k.shape[2]} kv heads")
    if zigzag and q.shape[1] % 2:
        raise ValueError(f"zigzag layout: {q.shape[1]} local rows do not split into two chunks")
    return _Setup(impl, axis, causal, zigzag, core)


def ring_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, axis: str = AXIS, causal: bool = True,
                   zigzag: bool = True, core: str | BlockCore = "xla") -> jax.Array:
    """Per device, inside a shard_map manual over `axis`: the local queries q [B, l, N, H] over
    the whole sequence, whose K/V blocks k, v [B, l, K, H] travel the ring -> [B, l, N, H]."""
    return _attention(_checked("ring", axis, causal, zigzag, core, q, k), q, k, v)


def allgather_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, axis: str = AXIS, causal: bool = True,
                        zigzag: bool = True, core: str | BlockCore = "xla") -> jax.Array:
    """As `ring_attention`, with K and V all-gathered over `axis` once per forward and backward
    and dK, dV reduce-scattered back."""
    return _attention(_checked("allgather", axis, causal, zigzag, core, q, k), q, k, v)


def context_parallel_attention(q: jax.Array, k: jax.Array, v: jax.Array, mesh: jax.sharding.Mesh, *,
                               impl: str = "ring", axis: str = AXIS, causal: bool = True,
                               zigzag: bool = True, core: str | BlockCore = "xla") -> jax.Array:
    """q [B, L, N, H], k/v [B, L, K, H] in the layout's order (`zigzag_permutation` applied when
    zigzag) -> [B, L, N, H] in the same order: one of the impls in a shard_map over `axis`."""
    if impl not in IMPLS:
        raise ValueError(f"context parallelism: unknown impl {impl!r}; choose one of {', '.join(IMPLS)}")
    fn = {"ring": ring_attention, "allgather": allgather_attention}[impl]
    spec = P(None, axis)
    return jax.shard_map(functools.partial(fn, axis=axis, causal=causal, zigzag=zigzag, core=core), mesh=mesh,
                         in_specs=(spec, spec, spec), out_specs=spec, axis_names={axis},
                         check_vma=core == "xla")(q, k, v)
