"""The cores of context parallelism (sharding/context_parallel.py): one piece of attention (the
local queries against one K/V block, or the part of it the causal mask leaves) -> its output and
log-sum-exp; its gradients given the whole row's statistics; and the merge of two pieces over the
same rows.

Layout: q [B, m, N, H], k/v [B, n, K, H] (GQA: query head n reads kv head n // (N/K)); out fp32
[B, m, N, H], lse and delta fp32 [B, N, m]. A diagonal piece carries the global positions of
its rows on both sides (`pos`) and is masked by them; other pieces are unmasked (None).

  "xla"       einsums with an fp32 softmax; the diagonal piece's mask from the global positions
              (the reference; it holds the piece's fp32 scores, [B, N, m, n])
  BlockCore   another layer's kernels (sharding/ imports no model code): our Pallas flash
              kernels, whose forward returns the lse and whose backward takes the row's lse and
              delta from outside; run on square parts of the piece (`_square`), tiles only

Merge, in fp32: lse = logaddexp(lse1, lse2), out = exp(lse1 - lse)·out1 + exp(lse2 - lse)·out2.
Every computed row sees at least one key (its own, on the diagonal piece at step 0), so lse
stays finite. The backward recomputes p = exp(s - lse) per piece from the saved global lse and
delta = rowsum(dO·out).
"""

from __future__ import annotations

import functools
import math
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

F32 = jnp.float32

_Positions = tuple[jax.Array, jax.Array] | None  # (query, key) global positions of a diagonal piece


def _xla_forward(q: jax.Array, k: jax.Array, v: jax.Array, pos: _Positions) -> tuple[jax.Array, jax.Array]:
    """q [B, m, N, H], k/v [B, n, K, H] -> out fp32 [B, m, N, H], lse fp32 [B, N, m]."""
    s = _scores(q, k, pos)  # [B, K, G, m, n]
    top = s.max(axis=-1)
    p = jnp.exp(s - top[..., None])
    total = p.sum(axis=-1)
    out = jnp.einsum("bkgmn,bnkh->bmkgh", p.astype(v.dtype), v, preferred_element_type=F32)
    out = out / jnp.moveaxis(total, -1, 1)[..., None]
    return out.reshape(q.shape), (top + jnp.log(total)).reshape(q.shape[0], q.shape[2], q.shape[1])


def _xla_backward(q, k, v, d_out, lse, delta, pos: _Positions) -> tuple[jax.Array, jax.Array, jax.Array]:
    """dq [B, m, N, H], dk/dv [B, n, K, H] (fp32) of one piece; lse, delta fp32 [B, N, m]."""
    b, m, heads, h = q.shape
    kv = k.shape[2]
    grouped = (b, m, kv, heads // kv, h)  # query head j·G + g reads kv head j
    qg, dog = q.reshape(grouped), d_out.reshape(grouped)

    def row(x: jax.Array) -> jax.Array:  # a statistic per query row, [B, N, m] -> [B, K, G, m, 1]
        return x.reshape(b, kv, heads // kv, m)[..., None]

    p = jnp.exp(_scores(q, k, pos) - row(lse))
    dv = jnp.einsum("bkgmn,bmkgh->bnkh", p.astype(d_out.dtype), dog, preferred_element_type=F32)
    dp = jnp.einsum("bmkgh,bnkh->bkgmn", dog, v, preferred_element_type=F32)
    ds = p * (dp - row(delta)) / math.sqrt(h)
    dq = jnp.einsum("bkgmn,bnkh->bmkgh", ds.astype(k.dtype), k, preferred_element_type=F32)
    dk = jnp.einsum("bkgmn,bmkgh->bnkh", ds.astype(q.dtype), qg, preferred_element_type=F32)
    return dq.reshape(q.shape), dk, dv


def _scores(q: jax.Array, k: jax.Array, pos: _Positions) -> jax.Array:
    """q k^T / sqrt(H), fp32 [B, K, G, m, n]; -inf where the key's position follows the query's."""
    b, m, heads, h = q.shape
    kv = k.shape[2]
    s = jnp.einsum("bmkgh,bnkh->bkgmn", q.reshape(b, m, kv, heads // kv, h), k, preferred_element_type=F32)
    s = s / math.sqrt(h)
    if pos is None:
        return s
    q_pos, k_pos = pos
    return jnp.where(k_pos[None, :] <= q_pos[:, None], s, -jnp.inf)


class BlockCore(NamedTuple):
    """A core from another layer (sharding/ imports no model code): our Pallas flash kernels are
    `BlockCore(flash_block_forward, flash_block_backward)` from model/kernels/flash_attention.py.

    forward(q, k, v, *, causal) -> out [B, m, N, H], lse fp32 [B, N, m]
    backward(q, k, v, d_out, lse, delta, *, causal) -> dq, dk, dv
    Called with q and k of equal length (`_square` cuts the pieces); causal=True only on the
    diagonal piece, whose rows are the same on both sides in increasing position order, so a
    causal mask on local indices is the mask of the global positions.
    """

    forward: Callable
    backward: Callable


def piece_core(core: str | BlockCore) -> tuple[Callable, Callable]:
    """(forward, backward) of one piece given its global positions (None: unmasked), fp32."""
    return (_xla_forward, _xla_backward) if core == "xla" else _square(core)


def _square(core: BlockCore) -> tuple[Callable, Callable]:
    """`core` on pieces whose longer side is a multiple of the shorter, cut into square parts.
    More query rows: the parts are separate rows, side by side (dk, dv summed). More keys: the
    parts are partial attentions of the same rows, merged by lse (dq summed)."""

    def cut(x: jax.Array, parts: int, axis: int = 1) -> list[jax.Array]:
        return jnp.split(x, parts, axis=axis)

    def forward(q, k, v, pos: _Positions):
        causal, m, n = pos is not None, q.shape[1], k.shape[1]
        if m > n:
            outs, lses = zip(*(core.forward(part, k, v, causal=causal) for part in cut(q, m // n)))
            return jnp.concatenate(outs, axis=1).astype(F32), jnp.concatenate(lses, axis=-1)
        parts = [core.forward(q, kp, vp, causal=causal) for kp, vp in zip(cut(k, n // m), cut(v, n // m))]
        return functools.reduce(merge, [(out.astype(F32), lse) for out, lse in parts])

    def backward(q, k, v, d_out, lse, delta, pos: _Positions):
        causal, m, n = pos is not None, q.shape[1], k.shape[1]
        if m > n:
            rows = zip(cut(q, m // n), cut(d_out, m // n), cut(lse, m // n, -1), cut(delta, m // n, -1))
            dq, dk, dv = zip(*(core.backward(qp, k, v, dp, lp, ep, causal=causal) for qp, dp, lp, ep in rows))
            return jnp.concatenate(dq, axis=1).astype(F32), sum(g.astype(F32) for g in dk), sum(g.astype(F32) for g in dv)
        keys = zip(cut(k, n // m), cut(v, n // m))
        dq, dk, dv = zip(*(core.backward(q, kp, vp, d_out, lse, delta, causal=causal) for kp, vp in keys))
        return sum(g.astype(F32) for g in dq), jnp.concatenate(dk, axis=1).astype(F32), jnp.concatenate(dv, axis=1).astype(F32)

    return forward, backward


def merge(a: tuple[jax.Array, jax.Array], b: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
    """Two partial attentions of the same rows, (out [B, m, N, H], lse [B, N, m]) fp32, as one."""
    (out_a, lse_a), (out_b, lse_b) = a, b
    lse = jnp.logaddexp(lse_a, lse_b)

    def share(out: jax.Array, part: jax.Array) -> jax.Array:  # out · exp(part - lse), [B, N, m] -> [B, m, N, 1]
        return out * jnp.moveaxis(jnp.exp(part - lse), -1, 1)[..., None]

    return share(out_a, lse_a) + share(out_b, lse_b), lse
