"""The three flash attention kernel bodies and their static plan (math in flash_attention.py).

Each kernel sees its refs as the blocks that flash_attention.py's BlockSpecs cut, with the
squeezed dimensions dropped: q, dO, out tiles [bq, H]; k, v rows [L, H] (forward, dq) or tiles
[bk, H] (dk/dv); the G q heads of one kv head [L, G, H] (dk/dv); lse, delta [bq] or [G, L].
Scores, softmax statistics and every accumulator are fp32; matmul inputs keep the input dtype.

Base 2 inside: the logits are q k^T log2(e) / sqrt(H) (`logit_scale`), so every exponential is
exp2(x) = e^(x ln 2). On NVIDIA GPUs the Triton lowering maps fp32 `exp` to libdevice's accurate
__nv_expf (a range reduction around the hardware's ex2) and `exp2` to __nv_exp2f (the ex2 unit
itself), and the exponentials of the [bq, bk] tiles, not the matmuls, bound these kernels' inner
loops; jax's own Pallas Triton attention makes the same move. The lse read and written stays in
natural-log units (context parallelism merges blocks by it); the kernels convert it per row.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl


@dataclass(frozen=True)
class Plan:
    """Static shape of one kernel launch: mask, real length, blocks, grouping, Triton's warps
    and stages on a GPU (Mosaic GPU's pipeline depth: stages), and the GPU lowering, triton or
    mosaic (flash_mosaic.py; hashable for custom_vjp)."""

    causal: bool
    length: int  # real L; arrays are padded to a multiple of every block of the call
    block_q: int
    block_k: int
    groups: int  # G = N / K
    warps: int
    stages: int
    lowering: str = "triton"


LOG2E, LN2 = math.log2(math.e), math.log(2.0)

NT = ((1,), (1,))  # a @ b.T
NN = ((1,), (0,))  # a @ b


def _dot(a: jax.Array, b: jax.Array, dims) -> jax.Array:
    return lax.dot_general(a, b, (dims, ((), ())), preferred_element_type=jnp.float32)


def logit_scale(h: int) -> float:
    """The factor that turns q k^T into base-2 logits: softmax(q k^T / sqrt(H)) = 2^x / sum 2^x
    with x = q k^T log2(e) / sqrt(H). Kernels apply it as x = s * scale - m, one fused multiply-add
    per score (the form of Triton's own tutorial), rather than scaling s and subtracting apart."""
    return LOG2E / math.sqrt(h)


def _scores(plan: Plan, q, k, q_start, k_start, masked: bool, keys_first: bool = False) -> jax.Array:
    """s = q k^T, fp32 [bq, bk], unscaled (keys_first: its transpose k q^T, [bk, bq]); -inf where
    a key is hidden (causal, or padding)."""
    s = _dot(k, q, NT) if keys_first else _dot(q, k, NT)
    if not masked:
        return s
    query = q_start + lax.broadcasted_iota(jnp.int32, s.shape, 1 if keys_first else 0)
    key = k_start + lax.broadcasted_iota(jnp.int32, s.shape, 0 if keys_first else 1)
    return jnp.where(visible(plan, query, key), s, -jnp.inf)


def visible(plan: Plan, query: jax.Array, key: jax.Array) -> jax.Array:
    """Whether a key position is seen by a query position: causal, not after it; full, not a
    padded key."""
    return key <= query if plan.causal else key < plan.length


def _sweep(step, ranges, carry):
    """Run step(index, carry, masked=...) over each (start, stop, masked) range in turn."""
    for start, stop, masked in ranges:
        carry = lax.fori_loop(start, stop, functools.partial(step, masked=masked), carry)
    return carry


def kv_ranges(plan: Plan, i, n_kv: int):
    """kv blocks that q block i visits: unmasked ones first, then those needing the mask.

    Causal: block j is wholly visible when its last key precedes row i*bq, and skipped when it
    starts after row i*bq + bq - 1. Full: only blocks holding padded keys are masked. The first
    block visited always holds key 0, which every row sees, so the running max turns finite.
    """
    bq, bk = plan.block_q, plan.block_k
    if plan.causal:
        whole = lax.div(i * bq, bk)  # lax.div truncates: = // for these ints >= 0, one op to lower
        return [(0, whole, False), (whole, lax.div(i * bq + bq + bk - 1, bk), True)]
    return [(0, plan.length // bk, False), (plan.length // bk, n_kv, True)]


def q_ranges(plan: Plan, j, n_q: int):
    """q blocks that see kv block j: causal skips those wholly before it and masks the diagonal."""
    if not plan.causal:
        return [(0, n_q, False)]  # padded keys only reach their own dk/dv rows (module docstring)
    bq, last_key = plan.block_q, j * plan.block_k + plan.block_k - 1
    first, whole = lax.div(j * plan.block_k, bq), lax.div(last_key + bq - 1, bq)  # whole: rows >= last_key
    return [(first, whole, True), (whole, n_q, False)]


def forward_kernel(q_ref, k_ref, v_ref, o_ref, lse_ref, *, plan: Plan):
    i, bq, bk = pl.program_id(2), plan.block_q, plan.block_k
    q, scale = q_ref[...], logit_scale(q_ref.shape[-1])

    def step(j, carry, masked):  # m: the running max of the base-2 logits
        m, l, acc = carry
        k, v = k_ref[pl.ds(j * bk, bk), :], v_ref[pl.ds(j * bk, bk), :]
        s = _scores(plan, q, k, i * bq, j * bk, masked)
        m_new = jnp.maximum(m, s.max(axis=1) * scale)
        p = jnp.exp2(s * scale - m_new[:, None])
        rescale = jnp.exp2(m - m_new)  # 0 on the first block (m = -inf), where acc and l are 0
        return m_new, rescale * l + p.sum(axis=1), rescale[:, None] * acc + _dot(p.astype(v.dtype), v, NN)

    init = (jnp.full((bq,), -jnp.inf, jnp.float32), jnp.zeros((bq,), jnp.float32),
            jnp.zeros(q.shape, jnp.float32))
    m, l, acc = _sweep(step, kv_ranges(plan, i, k_ref.shape[0] // bk), init)
    o_ref[...] = (acc / l[:, None]).astype(o_ref.dtype)
    lse_ref[...] = m * LN2 + jnp.log(l)  # m is base 2, lse natural


def dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, *, plan: Plan):
    i, bq, bk = pl.program_id(2), plan.block_q, plan.block_k
    q, do, scale = q_ref[...], do_ref[...], logit_scale(q_ref.shape[-1])
    lse, delta = lse_ref[...][:, None] * LOG2E, delta_ref[...][:, None]

    def step(j, dq, masked):
        k, v = k_ref[pl.ds(j * bk, bk), :], v_ref[pl.ds(j * bk, bk), :]
        p = jnp.exp2(_scores(plan, q, k, i * bq, j * bk, masked) * scale - lse)
        ds = p * (_dot(do, v, NT) - delta)
        return dq + _dot(ds.astype(k.dtype), k, NN)

    dq = _sweep(step, kv_ranges(plan, i, k_ref.shape[0] // bk), jnp.zeros(q.shape, jnp.float32))
    dq_ref[...] = (dq * (1.0 / math.sqrt(q.shape[-1]))).astype(dq_ref.dtype)


def dkv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref, *, plan: Plan):
    """Works on the transposed tiles [bk, bq] (keys on rows: p^T = exp(k q^T - lse), dp^T = v dO^T),
    so that dv += p^T dO and dk += ds^T q are plain products of a computed tile and a loaded one:
    the [bq, bk] tiles would need a transposed computed operand in both (a register transpose per
    step on a GPU). The formulation of Triton's fused-attention tutorial."""
    j, bq, bk = pl.program_id(2), plan.block_q, plan.block_k
    k, v, scale = k_ref[...], v_ref[...], logit_scale(k_ref.shape[-1])

    def step(i, carry, masked, g):
        dk, dv = carry
        rows = pl.ds(i * bq, bq)
        q, do = q_ref[rows, g, :], do_ref[rows, g, :]
        s_t = _scores(plan, q, k, i * bq, j * bk, masked, keys_first=True)
        p_t = jnp.exp2(s_t * scale - lse_ref[g, rows][None, :] * LOG2E)
        ds_t = p_t * (_dot(v, do, NT) - delta_ref[g, rows][None, :])
        return dk + _dot(ds_t.astype(q.dtype), q, NN), dv + _dot(p_t.astype(do.dtype), do, NN)

    def head(g, carry):  # the G q heads of this kv head add into the same dk, dv
        return _sweep(functools.partial(step, g=g), q_ranges(plan, j, q_ref.shape[0] // bq), carry)

    zeros = jnp.zeros(k.shape, jnp.float32)
    dk, dv = lax.fori_loop(0, plan.groups, head, (zeros, zeros))
    dk_ref[...] = (dk * (1.0 / math.sqrt(k.shape[-1]))).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)
