"""Fused flash attention in Pallas: forward and backward kernels, tied by `jax.custom_vjp`.

Layout (DESIGN.md letters): q [B, L, N, H], k/v [B, L, K, H] -> out [B, L, N, H]. Grouped-query
attention maps q head n to kv head n // G (G = N / K), the mapping of the `xla` core's
`jnp.repeat`; the BlockSpecs index the kv head directly, so K/V are never repeated in memory.

Forward, grid (B, N, L/bq): one program owns a [bq, H] block of queries and sweeps the kv blocks
with the online-softmax recurrence, keeping per query row a running max m, a running sum l and
an fp32 accumulator, so no [L, L] score matrix ever exists (only [bq, bk] tiles):
    s = q k_j^T / sqrt(H);  m' = max(m, rowmax s);  p = exp(s - m')
    l' = exp(m - m') l + rowsum p;  acc' = exp(m - m') acc + p v_j;  out = acc / l
It saves lse = m + log l, fp32 [B, N, L]: the backward recomputes p = exp(s - lse) from it.
Backward (delta = rowsum(dO * out) fp32 [B, N, L], computed by XLA):
    dq kernel, grid (B, N, L/bq): sweeps kv blocks, dq = sum_j (p * (dO v_j^T - delta)) k_j
    dk/dv kernel, grid (B, K, L/bk): sweeps the G q heads of its kv head and their q blocks,
        dv = sum p^T dO, dk = sum (p * (dO v^T - delta))^T q (GQA sums happen in the kernel)
Memory: O(L·H) per head, never O(L²): q, k, v, out (and their padded copies), plus lse and
delta fp32 [B, N, L]; a program holds only O(bq·H + bq·bk) on chip. Inputs may be bf16 or fp32;
matmuls accumulate in fp32 and the softmax statistics are fp32.

Causal: the q block i only visits kv blocks that start before its last row (upper half of the
block grid skipped, about half the FLOPs); blocks wholly below the diagonal run without a mask,
only the diagonal blocks pay for it. The dk/dv sweep mirrors this (its q blocks start at the
diagonal).

Lengths: q, k, v are zero-padded to a multiple of the blocks. In full attention, padded keys
are masked in the forward and dq sweeps; in the dk/dv sweep they need no mask (only their own,
discarded, dk/dv rows see them). Padded query rows get dO = 0, so they add nothing to dk/dv.
Under the causal mask, padded keys lie after every real query and are masked already.

Backend (`_launch`): on CPU the kernels run with `interpret=True` (HLO loops; this is how the
tests run). On NVIDIA GPUs they compile with the Pallas Triton backend, chosen explicitly by its
CompilerParams (see `_launch` for why). Not yet compiled or measured on a GPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from configs.base import ConfigError
from model.kernels.flash_kernels import Plan, dkv_kernel, dq_kernel, forward_kernel


def default_blocks(head_dim: int) -> tuple[int, int]:
    """(block_q, block_k): larger heads take smaller kv tiles so a program's tiles stay in SRAM."""
    if head_dim <= 64:
        return 128, 128
    if head_dim <= 128:
        return 128, 64
    return 64, 32


def flash_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = True,
                    block_q: int | None = None, block_k: int | None = None) -> jax.Array:
    """Attention of q [B, L, N, H] over k/v [B, L, K, H] -> [B, L, N, H] (K divides N).

    Blocks default per head dim (`default_blocks`), are clamped to the length and must be powers
    of two; L needs no relation to them (it is padded).
    """
    plan = _plan(q, k, causal, block_q, block_k)
    return _attention(plan, *_pad(plan, q, k, v))[:, :plan.length]


def flash_block_forward(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool
                        ) -> tuple[jax.Array, jax.Array]:
    """The forward kernel alone, no custom_vjp: out [B, L, N, H] and lse fp32 [B, N, L], for
    callers that merge blocks of attention by their log-sum-exp (sharding/context_parallel.py)."""
    plan = _plan(q, k, causal, None, None)
    out, lse = _forward(plan, *_pad(plan, q, k, v))
    return out[:, :plan.length], lse[..., :plan.length]


def flash_block_backward(q: jax.Array, k: jax.Array, v: jax.Array, d_out: jax.Array, lse: jax.Array,
                         delta: jax.Array, *, causal: bool) -> tuple[jax.Array, jax.Array, jax.Array]:
    """dq, dk, dv of one block given the softmax statistics of the whole row: lse and delta fp32
    [B, N, L] may come from more keys than this block's (p = exp(s - lse) is then the block's
    share of the row's probabilities). Padded rows get lse = delta = 0 and dO = 0: no effect."""
    plan = _plan(q, k, causal, None, None)
    stats = [(0, 0), (0, 0), (0, _padded(plan) - plan.length)]
    dq, dk, dv = _backward(plan, *_pad(plan, q, k, v, d_out), jnp.pad(lse, stats), jnp.pad(delta, stats))
    return dq[:, :plan.length], dk[:, :plan.length], dv[:, :plan.length]


def _plan(q: jax.Array, k: jax.Array, causal: bool, block_q: int | None, block_k: int | None) -> Plan:
    (_, length, n, h), kv_heads = q.shape, k.shape[2]
    if k.shape[1] != length:
        raise ValueError(f"flash attention: q has {length} rows, k and v {k.shape[1]}; they must be equal")
    if n % kv_heads:
        raise ConfigError(f"flash attention: n_heads={n} is not a multiple of n_kv_heads={kv_heads}")
    default_q, default_k = default_blocks(h)
    cap = pl.next_power_of_2(length)  # a block longer than the padded sequence is wasted work
    bq, bk = min(block_q or default_q, cap), min(block_k or default_k, cap)
    for name, size in (("block_q", bq), ("block_k", bk)):
        if size < 1 or size & (size - 1):
            raise ConfigError(f"flash attention: {name}={size} must be a power of two")
    return Plan(causal, length, bq, bk, n // kv_heads)


def _padded(plan: Plan) -> int:
    """L rounded up to a multiple of both blocks (powers of two: a multiple of the larger)."""
    block = max(plan.block_q, plan.block_k)
    return -(-plan.length // block) * block


def _pad(plan: Plan, *xs: jax.Array) -> list[jax.Array]:
    """[B, L, N or K, H] zero-padded along L to `_padded(plan)`."""
    return [jnp.pad(x, [(0, 0), (0, _padded(plan) - plan.length), (0, 0), (0, 0)]) for x in xs]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(plan: Plan, q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    return _forward(plan, q, k, v)[0]


def _attention_fwd(plan: Plan, q, k, v):
    out, lse = _forward(plan, q, k, v)
    return out, (q, k, v, out, lse)


def _attention_bwd(plan: Plan, residuals, d_out):
    q, k, v, out, lse = residuals
    # delta_i = sum_h dO_ih out_ih = sum_j p_ij dp_ij: the softmax Jacobian's row term.
    delta = jnp.einsum("blnh,blnh->bnl", d_out.astype(jnp.float32), out.astype(jnp.float32))
    return (*_backward(plan, q, k, v, d_out, lse, delta),)


_attention.defvjp(_attention_fwd, _attention_bwd)


# --- launch and block specs ---------------------------------------------------------------------

def _launch(kernel, plan: Plan, grid, in_specs, out_specs, out_shape):
    """pallas_call on this backend: interpret mode off GPU, the Triton lowering on NVIDIA GPUs.

    Triton, not Mosaic GPU, and named explicitly: Mosaic GPU is the default GPU lowering of
    `pl.pallas_call` in jax 0.10 and 0.11, but its pallas_call path is itself deprecated there
    (in favour of `plgpu.kernel`) and wants Hopper-specific kernels (TMA copies, wgmma, warpgroup
    layouts), unlike the grid + BlockSpec kernel that the CPU tests interpret. Triton lowers this
    kernel as written (ref slices, fori_loops with program-dependent bounds, fp32-accumulating
    dots), on A100 as on H100; it is deprecated, not removed, in 0.11, and its CompilerParams
    keep selecting it. Revisit this one function after measuring on a GPU.
    """
    if jax.default_backend() != "gpu":
        options = {"interpret": True}
    else:
        from jax.experimental.pallas import triton as pltriton

        head_dim = jax.tree.leaves(out_shape)[0].shape[-1]  # every first output is [B, L, heads, H]
        if head_dim < 16 or head_dim & (head_dim - 1):  # Triton: power-of-two tiles, dots >= 16
            raise ConfigError(f"flash attention on GPU: head_dim={head_dim} must be a power of two >= 16")
        warps = 4 if plan.block_q * plan.block_k <= 64 * 128 else 8
        options = {"compiler_params": pltriton.CompilerParams(num_warps=warps, num_stages=2)}
    return pl.pallas_call(functools.partial(kernel, plan=plan), grid=grid, in_specs=in_specs,
                          out_specs=out_specs, out_shape=out_shape, **options)


# Grids are (B, heads, blocks) and every index map takes (b, x, i): x is the q head (forward,
# dq) or the kv head (dk/dv), i the row block.

def _tile(block: int, h: int) -> pl.BlockSpec:
    """[B, L, heads, H] -> the [block, H] tile of row block i of head x."""
    return pl.BlockSpec((pl.squeezed, block, pl.squeezed, h), lambda b, x, i: (b, i, x, 0))


def _kv_of_head(padded: int, h: int, groups: int) -> pl.BlockSpec:
    """[B, L, K, H] -> all [L, H] rows of kv head x // G, the one that q head x reads."""
    return pl.BlockSpec((pl.squeezed, padded, pl.squeezed, h), lambda b, x, i: (b, 0, x // groups, 0))


def _heads_of_kv(padded: int, h: int, groups: int) -> pl.BlockSpec:
    """[B, L, N, H] -> [L, G, H]: all rows of the G q heads xG..xG+G-1 that kv head x serves."""
    return pl.BlockSpec((pl.squeezed, padded, groups, h), lambda b, x, i: (b, 0, x, 0))


def _stat_tile(block: int) -> pl.BlockSpec:
    """[B, N, L] fp32 -> the [block] slice of row block i of head x."""
    return pl.BlockSpec((pl.squeezed, pl.squeezed, block), lambda b, x, i: (b, x, i))


def _stat_heads_of_kv(padded: int, groups: int) -> pl.BlockSpec:
    """[B, N, L] fp32 -> [G, L]: the statistics of the q heads that kv head x serves."""
    return pl.BlockSpec((pl.squeezed, groups, padded), lambda b, x, i: (b, x, 0))


def _forward(plan: Plan, q, k, v) -> tuple[jax.Array, jax.Array]:
    b, padded, n, h = q.shape
    out_shape = (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((b, n, padded), jnp.float32))
    kv = _kv_of_head(padded, h, plan.groups)
    return _launch(forward_kernel, plan, (b, n, padded // plan.block_q),
                   [_tile(plan.block_q, h), kv, kv], [_tile(plan.block_q, h), _stat_tile(plan.block_q)],
                   out_shape)(q, k, v)


def _backward(plan: Plan, q, k, v, d_out, lse, delta) -> tuple[jax.Array, jax.Array, jax.Array]:
    b, padded, n, h = q.shape
    tile_q, tile_k, stat = _tile(plan.block_q, h), _tile(plan.block_k, h), _stat_tile(plan.block_q)
    kv = _kv_of_head(padded, h, plan.groups)
    dq = _launch(dq_kernel, plan, (b, n, padded // plan.block_q),
                 [tile_q, kv, kv, tile_q, stat, stat], tile_q,
                 jax.ShapeDtypeStruct(q.shape, q.dtype))(q, k, v, d_out, lse, delta)
    heads, stats = _heads_of_kv(padded, h, plan.groups), _stat_heads_of_kv(padded, plan.groups)
    kv_shapes = (jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype))
    dk, dv = _launch(dkv_kernel, plan, (b, k.shape[2], padded // plan.block_k),
                     [heads, tile_k, tile_k, heads, stats, stats], [tile_k, tile_k], kv_shapes,
                     )(q, k, v, d_out, lse, delta)
    return dq, dk, dv
