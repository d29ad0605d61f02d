"""The flash attention backward in Mosaic GPU: the dq and the dk/dv kernels of flash_kernels.py
(same math, same inputs: q, k, v, dO, and lse, delta fp32 [B, N, L]) for Hopper, beside the
forward of flash_mosaic.py (whose docstring has the shared choices: one warpgroup per program,
tiles streamed by TMA through `plgpu.emit_pipeline`, products by wgmma from shared memory).

dq, grid (B, N, L/64): the program's q and dO rows [64, H] and their lse, delta [64] copied in
once; the kv tiles it sees stream by (flash_mosaic.kv_sweeps: causal or padded tiles masked):
    s = q k_j^T;  p = 2^(s·log2(e)/sqrt(H) - lse·log2(e));  dp = dO v_j^T;  ds = p (dp - delta)
    dq += ds k_j    (ds through a [64, bk] shared-memory tile; dq scaled by 1/sqrt(H) at the end)
dk/dv, grid (B, K, L/64): the program's 64 keys of kv head x, k and v [64, H] copied in once; the
q blocks of its G q heads that see them stream by, each with its dO, lse and delta (one pipeline
over (G, blocks): causal, the diagonal block masked, then those after it; full, all of them,
unmasked: a padded key only reaches its own, discarded, dk/dv rows):
    s = q k^T [64 q, 64 k] as in dq;  dv += p^T dO;  dk += ds^T q
p and ds go to shared memory and wgmma reads them transposed (wgmma transposes a 16-bit operand
in shared memory for free), so the tiles keep queries on rows and the row statistics in the
accumulator's row layout, as in the forward. Both kernels take block_q = block_k = 64 for dk/dv
(wgmma's 64 rows on both products) and block_q 64, block_k a multiple of 64 for dq.

Shared memory per program at H = 128, 2 stages: dq 16 (q) + 16 (dO) + 8 (ds) + 2·2·16 (k, v)
= 104 KiB; dk/dv 32 (k, v) + 16 (p, ds) + 2·2·16 (q, dO) + small = 112 KiB.
Registers: dk/dv holds two [64, H] fp32 accumulators (64 + 64 per thread at H = 128) beside
the [64, 64] score tiles; ptxas spills 564 bytes a thread there (gpu-compile-h100.json).
Measured at H = 128, L = 4096 on one H200 (tune-attention-nvidia-h200-h128*.json, two sweeps,
forward + backward TFLOP/s): dq 331 / 351 against Triton's best clean tile 316 / 340, so
`default_tiling` takes it on Hopper; dk/dv 258 / 288 against Triton's 351 / 360, so it does not.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from model.kernels.flash_kernels import LOG2E, Plan, logit_scale, q_ranges
from model.kernels.flash_mosaic import ROWS, kv_sweeps, launch, mask, product, swizzled


def mosaic_dq(plan: Plan, q, k, v, d_out, lse, delta) -> jax.Array:
    """dq [B, Lp, N, H] (inputs padded along L as flash_attention._pad pads them)."""
    b, padded, n, h = q.shape
    tiles = swizzled(q.dtype)
    scratch = [plgpu.SMEM((ROWS, h), q.dtype, transforms=tiles),  # q, then dq
               plgpu.SMEM((ROWS, h), q.dtype, transforms=tiles),  # dO
               plgpu.SMEM((ROWS, plan.block_k), q.dtype, transforms=tiles),  # ds
               plgpu.SMEM((ROWS,), jnp.float32), plgpu.SMEM((ROWS,), jnp.float32),  # lse, delta
               plgpu.Barrier(num_arrivals=4)]  # the four copies in
    return launch(functools.partial(_dq_body, plan=plan, tiles=tiles), (b, n, padded // ROWS),
                  jax.ShapeDtypeStruct(q.shape, q.dtype), scratch, q, k, v, d_out, lse, delta)


def mosaic_dkv(plan: Plan, q, k, v, d_out, lse, delta) -> tuple[jax.Array, jax.Array]:
    """dk, dv [B, Lp, K, H]."""
    b, padded, kv_heads, h = k.shape
    tiles = swizzled(q.dtype)
    scratch = [plgpu.SMEM((ROWS, h), k.dtype, transforms=tiles),  # k, then dk
               plgpu.SMEM((ROWS, h), k.dtype, transforms=tiles),  # v, then dv
               plgpu.SMEM((ROWS, ROWS), q.dtype, transforms=tiles),  # p
               plgpu.SMEM((ROWS, ROWS), q.dtype, transforms=tiles),  # ds
               plgpu.Barrier(num_arrivals=2)]
    out_type = (jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype))
    return launch(functools.partial(_dkv_body, plan=plan, tiles=tiles), (b, kv_heads, padded // ROWS), out_type,
                  scratch, q, k, v, d_out, lse, delta)


def _row(stat_smem) -> jax.Array:
    """A [64] fp32 statistic from shared memory in the wgmma accumulator's row layout."""
    return plgpu.layout_cast(stat_smem[...], plgpu.Layout.WGMMA.reduce(1))


def _ds(plan: Plan, q_smem, do_smem, k_smem, v_smem, lse, delta, masked: bool, first_query, first_key):
    """p and ds = p (dO v^T - delta) of one [64, bk] tile, fp32, queries on rows."""
    s = product(q_smem, k_smem.T, (ROWS, k_smem.shape[0]))
    if masked:
        s = mask(plan, s, first_query, first_key)
    p = jnp.exp2(s * logit_scale(q_smem.shape[-1]) - lax.broadcast_in_dim(lse * LOG2E, s.shape, [0]))
    dp = product(do_smem, v_smem.T, s.shape)
    return p, p * (dp - lax.broadcast_in_dim(delta, s.shape, [0]))


def _dq_body(q_gmem, k_gmem, v_gmem, do_gmem, lse_gmem, delta_gmem, dq_gmem, q_smem, do_smem, ds_smem, lse_smem,
             delta_smem, ready, *, plan: Plan, tiles):
    batch, head, i = lax.axis_index("batch"), lax.axis_index("head"), lax.axis_index("block")
    rows, h = pl.ds(i * ROWS, ROWS), q_smem.shape[-1]
    for src, dst in ((q_gmem.at[batch, rows, head], q_smem), (do_gmem.at[batch, rows, head], do_smem),
                     (lse_gmem.at[batch, head, rows], lse_smem), (delta_gmem.at[batch, head, rows], delta_smem)):
        plgpu.copy_gmem_to_smem(src, dst, ready)
    plgpu.barrier_wait(ready)
    lse, delta = _row(lse_smem), _row(delta_smem)

    def step(masked: bool, j, k_smem, v_smem, dq):
        _, ds = _ds(plan, q_smem, do_smem, k_smem, v_smem, lse, delta, masked, i * ROWS, j * plan.block_k)
        ds_smem[...] = ds.astype(ds_smem.dtype)
        plgpu.commit_smem()
        return dq + product(ds_smem, k_smem, (ROWS, h))

    kv_head = lax.div(head, plan.groups)
    zeros = plgpu.layout_cast(jnp.zeros((ROWS, h), jnp.float32), plgpu.Layout.WGMMA)
    dq = kv_sweeps(plan, i, step, zeros, (k_gmem.at[batch, :, kv_head], v_gmem.at[batch, :, kv_head]), tiles)
    q_smem[...] = (dq * (1.0 / math.sqrt(h))).astype(q_smem.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(q_smem, dq_gmem.at[batch, rows, head])
    plgpu.wait_smem_to_gmem(0)


def _dkv_body(q_gmem, k_gmem, v_gmem, do_gmem, lse_gmem, delta_gmem, dk_gmem, dv_gmem, k_smem, v_smem, p_smem,
              ds_smem, ready, *, plan: Plan, tiles):
    batch, kv_head, j = lax.axis_index("batch"), lax.axis_index("head"), lax.axis_index("block")
    keys, h, n_q = pl.ds(j * ROWS, ROWS), k_smem.shape[-1], q_gmem.shape[1] // ROWS
    plgpu.copy_gmem_to_smem(k_gmem.at[batch, keys, kv_head], k_smem, ready)
    plgpu.copy_gmem_to_smem(v_gmem.at[batch, keys, kv_head], v_smem, ready)
    plgpu.barrier_wait(ready)
    first_head = kv_head * plan.groups

    def step(masked: bool, start, index, q_smem, do_smem, lse_smem, delta_smem, carry):
        dk, dv = carry
        p, ds = _ds(plan, q_smem, do_smem, k_smem, v_smem, _row(lse_smem), _row(delta_smem), masked,
                    (start + index[1]) * ROWS, j * ROWS)
        p_smem[...], ds_smem[...] = p.astype(p_smem.dtype), ds.astype(ds_smem.dtype)
        plgpu.commit_smem()
        return dk + product(ds_smem.T, q_smem, (ROWS, h)), dv + product(p_smem.T, do_smem, (ROWS, h))

    def sweep(start, stop, masked: bool, carry):  # q blocks start..stop-1 of each of the G heads
        rows = plgpu.BlockSpec((ROWS, pl.squeezed, h), lambda g, i: (start + i, first_head + g, 0), transforms=tiles)
        stats = plgpu.BlockSpec((pl.squeezed, ROWS), lambda g, i: (first_head + g, start + i))
        run = plgpu.emit_pipeline(functools.partial(step, masked, start), grid=(plan.groups, stop - start),
                                  in_specs=[rows, rows, stats, stats], max_concurrent_steps=plan.stages,
                                  init_carry=carry)
        return run(q_gmem.at[batch], do_gmem.at[batch], lse_gmem.at[batch], delta_gmem.at[batch])

    zeros = plgpu.layout_cast(jnp.zeros((ROWS, h), jnp.float32), plgpu.Layout.WGMMA)
    carry = (zeros, zeros)
    for start, stop, masked in q_ranges(plan, j, n_q):  # causal (bq = bk): the diagonal block masked, then the rest
        carry = sweep(start, stop, masked, carry)
    dk, dv = carry
    k_smem[...] = (dk * (1.0 / math.sqrt(h))).astype(k_smem.dtype)
    v_smem[...] = dv.astype(v_smem.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(k_smem, dk_gmem.at[batch, keys, kv_head])
    plgpu.copy_smem_to_gmem(v_smem, dv_gmem.at[batch, keys, kv_head])
    plgpu.wait_smem_to_gmem(0)
