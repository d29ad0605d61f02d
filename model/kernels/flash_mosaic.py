"""The flash attention forward in Mosaic GPU: Hopper's TMA copies and wgmma, the other Pallas
GPU lowering (the Triton one is flash_kernels.forward_kernel's; flash_attention.py chooses per
kernel by its `Tile`'s `lowering`). Same math, same outputs: out [B, L, N, H] and lse fp32
[B, N, L] in natural-log units, so either lowering's dq and dk/dv kernels take its residuals
(the Mosaic ones: flash_mosaic_backward.py, built on the helpers here).

Why a second form: jax 0.12 deprecates the Pallas Triton backend (it says to move to Mosaic GPU),
and Triton's forward reached 287 TFLOP/s on one H100 at L = 4096, H = 128 against the issue's
350 (bench/results/gpu-nvidia-h100-80gb-hbm3-20261124.json). Measured on one H200 (2026-11-26,
bench/results/tune-attention-nvidia-h200-h128*.json): at H = 128 this forward (64 x 64, 2 slots)
ran 367 and 401 TFLOP/s in two sweeps against Triton's best 360 and 370, so on Hopper in 16 bits
at H = 128 `default_tiling` takes it (and the Mosaic dq). At H = 64 on one H100 (2026-11-26,
tune-attention-nvidia-h100-80gb-hbm3-h64.json) it ran 303 TFLOP/s (64 x 64, 2 slots) against
Triton's best 289, and the default takes it there too (an earlier H200 sweep ranked Triton
first, but ran before the tuner warmed the GPU up).

Kernel (`plgpu.kernel`, grid (B, N, L/64), one warpgroup of 128 threads per program):
  q       the program's [64, H] rows of head n, one TMA copy into shared memory;
  k, v    [bk, H] tiles of kv head n // G, streamed through `plgpu.emit_pipeline`: `stages`
          slots in shared memory, the TMA copy of tile j + stages issued once tile j is used;
  s       q k_j^T by wgmma into a [64, bk] fp32 register accumulator, then the online softmax
          of flash_kernels.py in base 2 (m, l per row in the accumulator's row layout);
  p v_j   p is stored to a [64, bk] shared-memory tile and multiplied by wgmma into a fresh
          accumulator, added to the rescaled running one (acc * alpha + p v_j, one FMA);
  out     acc / l through the q tile's shared memory (q is no longer read) by one TMA copy;
          lse = m ln 2 + ln l, [64] fp32, likewise.
wgmma needs M = 64 rows per warpgroup, K a multiple of 16 and swizzled tiles of 128 bytes: block_q
is 64, block_k a multiple of 64, H a multiple of 64, and bf16/fp16 inputs only.

P goes through shared memory, not registers (wgmma can read its left operand from registers, as
FlashAttention-3 does): jax's GPU interpret mode, which runs this kernel on CPU for the tests,
reads both wgmma operands from shared memory only, and one form that the tests cover beats a
faster one that they do not. Its cost (a 8-16 KiB store and a fence per kv tile) is part of what
the GPU measurement weighs.

Causal: as in flash_kernels.py, kv tiles wholly before the block's first row run unmasked and the
diagonal ones masked: two pipelines in turn, the second starting where the first stopped (its
first copies are not overlapped with the first's last tiles: one tile's latency per program).
Full attention masks the tiles that hold padded keys.

Shared memory per program: q/out 64·H, p 64·bk, k and v stages·bk·H each (2 bytes per element):
at H = 128, bk = 64, 2 stages, 88 KiB (two programs per SM); bk = 128, 160 KiB (one).

Backends: on NVIDIA GPUs of compute capability 9.0 (Hopper) and later; on CPU in jax's GPU
interpret mode (jax >= 0.11), which simulates the shared memory, the TMA copies, the barriers and
wgmma: the tests. It lowers on CPU too (`jax.jit(...).lower(lowering_platforms=("cuda",))`) down
to the Mosaic GPU custom call: the tests check that as well; compiling that to PTX needs the GPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from configs.base import ConfigError
from model.kernels.flash_kernels import LN2, Plan, kv_ranges, logit_scale, visible
from sharding.cores import FUSED_DTYPES, target

ROWS = 64  # wgmma's M per warpgroup: the one block_q of this kernel
SWIZZLE = 128  # bytes: 64 bf16 elements per swizzled row of a tile


def mosaic_problem(kernel: str, dtype: str, head_dim: int, block_q: int, block_k: int) -> str | None:
    """Why the Mosaic GPU form of `kernel` (forward, dq, dkv) cannot take these inputs or this
    tile (None if it can): wgmma's 64 rows per warpgroup and 128-byte swizzled 16-bit tiles."""
    name = {"forward": "forward", "dq": "dq kernel", "dkv": "dk/dv kernel"}[kernel]
    if dtype not in FUSED_DTYPES:
        return f"the Mosaic GPU {name} takes {'/'.join(FUSED_DTYPES)} inputs (got {dtype}); use the triton lowering"
    if head_dim % 64:
        return f"the Mosaic GPU {name} needs a head dim that is a multiple of 64 (got {head_dim})"
    if kernel == "dkv" and (block_q, block_k) != (ROWS, ROWS):
        return f"the Mosaic GPU {name} needs block_q={ROWS} and block_k={ROWS} (got {block_q}, {block_k})"
    if block_q != ROWS or block_k % 64:
        return f"the Mosaic GPU {name} needs block_q={ROWS} and block_k a multiple of 64 (got {block_q}, {block_k})"
    return None


def backend_options() -> dict:
    """plgpu.kernel's options on this backend: compiled on Hopper or later, interpreted on CPU;
    a ConfigError where neither is possible."""
    backend, capability = target()
    if backend == "gpu":
        if capability is None or capability < (9, 0):
            raise ConfigError(f"flash attention: the Mosaic GPU kernels need an NVIDIA GPU of compute capability "
                              f"9.0 or later (this one: {capability}); use the triton lowering")
        return {}
    interpret = getattr(plgpu, "InterpretGPUParams", None)
    if backend != "cpu" or interpret is None:
        raise ConfigError(f"flash attention: the Mosaic GPU kernels run on NVIDIA GPUs, or on CPU in jax's GPU "
                          f"interpret mode (jax >= 0.11; this is jax {jax.__version__} on {backend}); use the triton lowering")
    return {"interpret": interpret()}


def swizzled(dtype) -> tuple:
    """The transforms of a [rows, 64·k] 16-bit tile in shared memory that wgmma and TMA read:
    (8, 64) tiles, 128-byte swizzle."""
    return plgpu.TilingTransform((8, SWIZZLE // jnp.dtype(dtype).itemsize)), plgpu.SwizzleTransform(SWIZZLE)


def launch(body, grid: tuple[int, int, int], out_type, scratch: list, *args: jax.Array):
    """plgpu.kernel over grid (B, heads, blocks) named batch, head, block; one warpgroup."""
    return plgpu.kernel(body, out_type=out_type, scratch_types=scratch, grid=grid,
                        grid_names=("batch", "head", "block"), compiler_params=plgpu.CompilerParams(approx_math=True),
                        **backend_options())(*args)


def mosaic_forward(plan: Plan, q: jax.Array, k: jax.Array, v: jax.Array) -> tuple[jax.Array, jax.Array]:
    """out [B, Lp, N, H] and lse fp32 [B, N, Lp] of q [B, Lp, N, H] over k/v [B, Lp, K, H],
    padded along L to a multiple of the plan's blocks (flash_attention._pad)."""
    b, padded, n, h = q.shape  # the tile was checked by flash_attention._plans (mosaic_problem)
    tiles = swizzled(q.dtype)
    out_type = (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((b, n, padded), jnp.float32))
    scratch = [plgpu.SMEM((ROWS, h), q.dtype, transforms=tiles),  # q, then out
               plgpu.SMEM((ROWS, plan.block_k), q.dtype, transforms=tiles),  # p
               plgpu.SMEM((ROWS,), jnp.float32), plgpu.Barrier()]  # lse; q's copy done
    return launch(functools.partial(_forward_body, plan=plan, tiles=tiles), (b, n, padded // ROWS), out_type, scratch,
                  q, k, v)


def _forward_body(q_gmem, k_gmem, v_gmem, out_gmem, lse_gmem, qo_smem, p_smem, lse_smem, q_ready, *, plan: Plan,
                  tiles):
    batch, head, i = lax.axis_index("batch"), lax.axis_index("head"), lax.axis_index("block")
    rows, bk, h = pl.ds(i * ROWS, ROWS), plan.block_k, qo_smem.shape[-1]
    plgpu.copy_gmem_to_smem(q_gmem.at[batch, rows, head], qo_smem, q_ready)
    plgpu.barrier_wait(q_ready)
    factor, tile, row = logit_scale(h), plgpu.Layout.WGMMA, plgpu.Layout.WGMMA.reduce(1)

    def step(masked: bool, j, k_smem, v_smem, carry):  # m: the running max of base-2 logits
        m, l, acc = carry
        s = product(qo_smem, k_smem.T, (ROWS, bk))
        if masked:
            s = mask(plan, s, i * ROWS, j * bk)
        m_new = jnp.maximum(m, s.max(axis=1) * factor)
        p = jnp.exp2(s * factor - lax.broadcast_in_dim(m_new, s.shape, [0]))
        alpha = jnp.exp2(m - m_new)  # 0 on the first tile (m = -inf), where acc and l are 0
        p_smem[...] = p.astype(p_smem.dtype)
        plgpu.commit_smem()  # p's stores visible to wgmma's reads
        acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0]) + product(p_smem, v_smem, (ROWS, h))
        return m_new, l * alpha + p.sum(axis=1), acc

    carry = (plgpu.layout_cast(jnp.full((ROWS,), -jnp.inf, jnp.float32), row),
             plgpu.layout_cast(jnp.zeros((ROWS,), jnp.float32), row),
             plgpu.layout_cast(jnp.zeros((ROWS, h), jnp.float32), tile))
    kv_head = lax.div(head, plan.groups)
    carry = kv_sweeps(plan, i, step, carry, (k_gmem.at[batch, :, kv_head], v_gmem.at[batch, :, kv_head]), tiles)
    m, l, acc = carry
    qo_smem[...] = (acc / lax.broadcast_in_dim(l, acc.shape, [0])).astype(qo_smem.dtype)
    lse_smem[...] = m * LN2 + jnp.log(l)  # m is base 2, lse natural
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(qo_smem, out_gmem.at[batch, rows, head])
    plgpu.copy_smem_to_gmem(lse_smem, lse_gmem.at[batch, head, rows])
    plgpu.wait_smem_to_gmem(0)


def kv_sweeps(plan: Plan, i, step, carry, kv_gmem: tuple, tiles):
    """The kv tiles that q block i (64 rows) sees, streamed from the [Lp, H] refs kv_gmem by
    `plgpu.emit_pipeline` into step(masked, j, *tiles, carry) -> carry: causal, those wholly
    before row 64·i unmasked, then up to the one holding row 64·i + 63 masked; full, the tiles
    of real keys unmasked, then those holding padded keys masked."""
    bk = plan.block_k
    for start, stop, masked in kv_ranges(plan, i, kv_gmem[0].shape[0] // bk):  # flash_kernels.py's ranges
        if isinstance(stop, int) and stop == start:  # static and empty: no padded keys
            continue
        spec = plgpu.BlockSpec((bk, kv_gmem[0].shape[1]), lambda j, start=start: (start + j, 0), transforms=tiles)
        body = lambda index, *refs, start=start, masked=masked: step(masked, start + index[0], *refs)  # noqa: E731
        carry = plgpu.emit_pipeline(body, grid=(stop - start,), in_specs=[spec] * len(kv_gmem),
                                    max_concurrent_steps=plan.stages, init_carry=carry)(*kv_gmem)
    return carry


def mask(plan: Plan, s: jax.Array, first_query, first_key) -> jax.Array:
    """s [bq, bk] in the wgmma accumulator's layout with -inf where a key is hidden from a query
    (causal: the key after it; full: a padded key)."""
    query = first_query + plgpu.broadcasted_iota(jnp.int32, s.shape, 0, layout=plgpu.Layout.WGMMA)
    key = first_key + plgpu.broadcasted_iota(jnp.int32, s.shape, 1, layout=plgpu.Layout.WGMMA)
    return jnp.where(visible(plan, query, key), s, -jnp.inf)


def product(a_smem, b_smem, shape: tuple[int, int]) -> jax.Array:
    """a @ b of two shared-memory tiles by wgmma, into a fresh fp32 accumulator read back to
    registers (the read waits for the wgmma)."""

    def run(acc):
        plgpu.wgmma(acc, a_smem, b_smem)
        return acc[...]

    return pl.run_scoped(run, plgpu.ACC(shape, jnp.float32))

