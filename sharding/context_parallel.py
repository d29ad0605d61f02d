"""Context parallelism: causal attention over a sequence split on the `sequence` axis, written
out per device (issue 13). Two ways to get the keys: a ring of collective-permutes, or one
all-gather (Llama 3's choice). Both share the block schedule, the cores and the merge.

Layout (sharding/context_layout.py). sp = size of the sequence axis, d = this device's index
on it, L the full length, l = L/sp the local rows. Each device holds its rows of q [B, l, N, H]
and k, v [B, l, K, H] (GQA: query head n reads kv head n // (N/K)) and keeps its queries. The
rows are contiguous, or zigzag (the default for causal attention: device d holds chunks d and
2sp-1-d of 2sp, c = L/(2sp) rows each), which gives every device the same causal work.

Schedule (sharding/context_schedule.py). At step s = 0..sp-1 device d holds the K/V block of
device (d - s) mod sp, and its queries compute the corner of it the causal mask leaves visible
(a `lax.cond` on whether that block is its own, earlier or later); under zigzag every step after
the first costs every device the same.

Cores (`core=`), per piece (sharding/context_cores.py): "xla", the reference, or a `BlockCore`
such as our Pallas flash kernels. Each piece returns its output and log-sum-exp; pieces over the
same query rows merge by it (`merge`, the flash recurrence across devices, in fp32). The
backward recomputes each piece's probabilities from the saved global lse and delta: dq stays
local, dk/dv belong to the block.

Collectives per layer, E = b·l·K·H elements (one local K or V block, b the local batch):

  impl       forward                               backward
  ring       2(sp-1) collective-permutes of E      2(sp-1) collective-permutes of E (K, V
             (K and V, to device d+1)              again) + 2(sp-1) of E in fp32 (dK, dV
                                                   travel with their block, summed) + 2 of E
                                                   in K's dtype (the last send takes them
                                                   home, cast before it)
  allgather  2 all-gathers, result sp·E (K, V)     2 all-gathers again + 2 reduce-scatters of
                                                   sp·E fp32 (dK, dV)

Elements each device sends: forward 2E(sp-1) for both, the ring in sp-1 steps of 2E each, one
per block computed, the all-gather at once. Backward: the ring 2E(sp-1) + 2E(sp-1) fp32 + 2E,
the all-gather 2E(sp-1) + 2E(sp-1) fp32. Gradient partial sums stay fp32 until their last
device has added its share; the ring sends them home in the compute dtype, which they are
cast to there anyway (XLA GPU had moved that cast ahead of the send by itself, for dV and not
always dK: 125m dp=2,sp=2 in bf16). XLA also sends a block's first hop in bf16 where the core
computed its own block's dK and dV in bf16 (the Pallas core, compiled for H100s), before their
cast to fp32: tools.traffic.context counts that hop in the compute dtype.

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
blocks from forward to backward: unrolled layers under remat none (XLA GPU too; the all-gather
impl's second gather likewise; tools.traffic.context counts one set there). The model's layer
scan keeps them apart (forward and backward are different loops); under remat the recomputed
forward shares the backward's loop body, where XLA can merge them the same way (one layer's
blocks then live through its backward).

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

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from sharding.context_cores import F32, BlockCore, merge, piece_core
from sharding.context_layout import device_positions
from sharding.context_schedule import Piece, Setup, blocks, to_right, visit

IMPLS = ("ring", "allgather")
# the checkpoint_name of what the forward keeps for the backward (out, lse): a remat policy keeps
# these rather than the blocks' scores they come from (model.remat.stash_policy)
KEPT_NAME = "attention_residual"
AXIS = "sequence"


# --- forward and backward ----------------------------------------------------------------------

def _forward(setup: Setup, q: jax.Array, k: jax.Array, v: jax.Array) -> tuple[jax.Array, jax.Array]:
    """out [B, l, N, H] (q's dtype) and lse fp32 [B, N, l] of the local queries over all keys."""
    forward = piece_core(setup.core)[0]
    sp, d, rows = lax.axis_size(setup.axis), lax.axis_index(setup.axis), q.shape[1]
    pos = device_positions(d, sp, rows, setup.zigzag)

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
    for s, kb, vb in blocks(setup, k, v):
        acc = visit(setup, s, d, rows, attend, kb, vb, acc)
    return acc[0].astype(q.dtype), acc[1]


def _backward(setup: Setup, residuals, d_out: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    q, k, v, out, lse = residuals
    backward = piece_core(setup.core)[1]
    sp, d, rows = lax.axis_size(setup.axis), lax.axis_index(setup.axis), q.shape[1]
    pos = device_positions(d, sp, rows, setup.zigzag)
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
        for s, kb, vb in blocks(setup, k, v):
            dq, gk, gv = visit(setup, s, d, rows, grads, kb, vb, dq)
            held = (gk, gv) if held is None else (held[0] + gk, held[1] + gv)  # added after the compute
            if s == sp - 1:  # the last send brings them home, in K's and V's dtype: summed, cast there anyway
                held = (held[0].astype(k.dtype), held[1].astype(v.dtype))
            held = lax.ppermute(held, setup.axis, to_right(sp))
        dk, dv = held
    else:
        full = [jnp.zeros((k.shape[0], sp * rows, *k.shape[2:]), F32) for _ in range(2)]  # dK, dV [B, L, K, H]
        for s, kb, vb in blocks(setup, k, v):
            dq, gk, gv = visit(setup, s, d, rows, grads, kb, vb, dq)
            start = (d - s) % sp * rows
            full = [lax.dynamic_update_slice_in_dim(x, lax.dynamic_slice_in_dim(x, start, rows, axis=1) + g,
                                                    start, axis=1) for x, g in zip(full, (gk, gv))]
        dk, dv = (lax.psum_scatter(x, setup.axis, scatter_dimension=1, tiled=True) for x in full)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(setup: Setup, q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    return _forward(setup, q, k, v)[0]


def _attention_fwd(setup: Setup, q, k, v):
    out, lse = (checkpoint_name(a, KEPT_NAME) for a in _forward(setup, q, k, v))
    return out, (q, k, v, out, lse)


_attention.defvjp(_attention_fwd, _backward)


# --- public API --------------------------------------------------------------------------------

def _checked(impl: str, axis: str, causal: bool, zigzag: bool, core: str | BlockCore, q: jax.Array,
             k: jax.Array) -> Setup:
    if not (core == "xla" or isinstance(core, BlockCore)):
        raise ValueError(f"context parallelism: core {core!r} is neither 'xla' nor a BlockCore")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"context parallelism: {q.shape[2]} query heads are not a multiple of {k.shape[2]} kv heads")
    if zigzag and q.shape[1] % 2:
        raise ValueError(f"zigzag layout: {q.shape[1]} local rows do not split into two chunks")
    return Setup(impl, axis, causal, zigzag, core)


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
