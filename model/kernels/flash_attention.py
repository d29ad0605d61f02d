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

Tiling: each of the three kernels has its own `Tile` (block_q, block_k, Triton's warps and
pipeline stages): the forward and dq own a q block and sweep kv blocks, dk/dv owns a kv block and
sweeps q blocks, so each may want its own shape. q, k, v are padded to a multiple of every block
of the call. `default_tiling` gives them by head dim, dtype and device: tiles timed by
`python -m bench.tune_attention` on a GPU, one kernel at a time, among those that ptxas assembles
for an H100 without spilling (`python -m tools.gpu_compile`, which compiles for a GPU on a CPU
machine).

Backend (`_launch`): on CPU the kernels run with `interpret=True` (HLO loops; this is how the
tests run; warps and stages are ignored). On NVIDIA GPUs the Triton tiles compile with the Pallas
Triton backend, chosen explicitly by its CompilerParams (see `_launch` for why).

Mosaic GPU: a `Tile(64, bk, stages=S, lowering="mosaic")` runs that kernel's Hopper form (TMA +
wgmma: flash_mosaic.py for the forward, flash_mosaic_backward.py for dq and dk/dv) with the same
inputs and outputs, so each kernel takes either lowering whatever the others take
(`mosaic_tiling`: all three). Interpreted and lowered on CPU by the tests, and all three
assemble for sm_90a (tools.gpu_compile); at H = 128 the dk/dv kernel spills 564 bytes a
thread at 255 registers (its fp32 dk and dv accumulators alone hold 128).

Measured on one H200 (jax 0.11.2, 2026-11-26; bench/results/gpu-nvidia-h200-20261126.json and
the tune-attention-nvidia-h200-* sweeps): both lowerings match xla on the GPU (bf16, causal GQA,
L = 1024, 4096 and a ragged 1500). The choice by measurement, at L = 4096, H = 128, causal:
the Mosaic forward (64 x 64, 2 slots) ran 367 and 401 TFLOP/s in two sweeps, the best Triton
forward 360 and 370 (and it spills); Mosaic's dq 331 / 351 fwd+bwd against Triton's best clean
316 / 340; Mosaic's dk/dv (spilling) 258 / 288 against Triton's 351 / 360. Hence on Hopper in
16 bits at H = 128 the default runs forward and dq in Mosaic and dk/dv in Triton: 364 TFLOP/s
forward and 360 forward + backward, 0.81x of cudnn's 443 in the same process. At H = 64 on one
H100 (tune-attention-nvidia-h100-80gb-hbm3-h64.json) the same split won: Mosaic forward and dq,
Triton dk/dv, 295 / 295 against the Triton tiles' 242 / 254 (cudnn 288 / 313). Before (H100,
2026-11-24, untuned Triton): forward 287, forward + backward 0.44x cudnn.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from configs.base import ConfigError
from model.kernels.flash_kernels import Plan, dkv_kernel, dq_kernel, forward_kernel
from model.kernels.flash_mosaic import mosaic_forward, mosaic_problem
from model.kernels.flash_mosaic_backward import mosaic_dkv, mosaic_dq
from sharding.cores import FUSED_DTYPES, core_problem, target


LOWERINGS = ("triton", "mosaic")


@dataclass(frozen=True)
class Tile:
    """One kernel's launch: its [block_q, block_k] score tile (powers of two, clamped to the
    padded length) and, on a GPU, Triton's num_warps and num_stages. lowering='mosaic' runs the
    kernel's Mosaic GPU form instead (flash_mosaic.py, flash_mosaic_backward.py): block_q 64,
    block_k a multiple of 64 (64 for dk/dv; not clamped), stages its pipeline depth, warps
    unused (one warpgroup)."""

    block_q: int
    block_k: int
    warps: int = 4
    stages: int = 2
    lowering: str = "triton"


@dataclass(frozen=True)
class Tiling:
    """The tiles of the forward, dq and dk/dv kernels."""

    forward: Tile
    dq: Tile
    dkv: Tile

    @classmethod
    def uniform(cls, block_q: int, block_k: int, warps: int = 4, stages: int = 2) -> Tiling:
        tile = Tile(block_q, block_k, warps, stages)
        return cls(tile, tile, tile)


def triton_tiling(head_dim: int) -> Tiling:
    """By head dim, each kernel's Triton tile. Every one assembles for sm_90a without spilling or
    serializing its wgmmas (bench/results/gpu-compile-h100.json). At H <= 64, the largest such
    tiles, not tuned: the one H = 64 sweep that counts ran on Hopper in bf16, where `default_tiling`
    takes `HOPPER_16BIT` (tune-attention-nvidia-h100-80gb-hbm3-h64.json; there Triton's best
    forward, 128 x 64 w8 s3, ran 289 TFLOP/s against this one's 240). At H = 128, the clean tile of
    each kernel that ran fastest in both H200 sweeps (tune-attention-nvidia-h200-h128.json and
    -h128-warmup.json, L = 4096, causal, bf16): forward 128 x 64, 8 warps, 3 stages (353 / 281
    TFLOP/s against 201 / 228 with the 2 stages it had), dq 128 x 64 w8 s3 (316 / 340 fwd+bwd,
    against 308 / 314), dk/dv 64 x 128 w8 s3 (351 / 360, against 326 / 354). Faster tiles that spill
    (forward 128 x 64 with 4 warps: 360 / 370, 8 bytes a thread) are left out: on Hopper in 16 bits
    `default_tiling` runs the Mosaic GPU forward instead, and elsewhere (fp32, an older GPU) no
    measurement says they win. Above H = 128: clean tiles, not timed."""
    if head_dim <= 64:
        return Tiling(Tile(128, 64, 4, 2), Tile(128, 64, 4, 2), Tile(128, 128, 8, 2))
    if head_dim <= 128:
        return Tiling(Tile(128, 64, 8, 3), Tile(128, 64, 8, 3), Tile(64, 128, 8, 3))
    return Tiling(Tile(128, 64, 8, 2), Tile(128, 32, 8, 2), Tile(128, 32, 8, 2))


# On Hopper (compute capability 9.0) in bf16/fp16, by head dim: each kernel's fastest tile in the
# sweeps of `default_tiling`'s docstring; forward and dq in Mosaic GPU, dk/dv in Triton.
HOPPER_16BIT = {
    64: Tiling(Tile(64, 64, stages=2, lowering="mosaic"), Tile(64, 64, stages=3, lowering="mosaic"),
               Tile(64, 64, 4, 3)),
    128: Tiling(Tile(64, 64, stages=2, lowering="mosaic"), Tile(64, 64, stages=2, lowering="mosaic"),
                Tile(64, 128, 8, 3)),
}


def default_tiling(head_dim: int, dtype: str = "bfloat16") -> Tiling:
    """The tiling a call without one runs, for the device programs are built for
    (sharding.cores.target): `HOPPER_16BIT` on Hopper with bf16/fp16 inputs at H = 64 and 128,
    the Triton tiles of `triton_tiling` everywhere else (fp32, other head dims, another GPU, CPU
    interpretation). All by `python -m bench.tune_attention` at L = 4096, causal, N 32, K 8:
    - H = 128: the forward and dq in Mosaic GPU (64 x 64, 2 pipeline slots), dk/dv in Triton
      (64 x 128, 8 warps, 3 stages): 364 TFLOP/s forward and 360 forward + backward on one H200
      (cudnn 429 and 443 in the same process: 0.81x), where the all-Triton default before it
      ran 231 and 288 (tune-attention-nvidia-h200-h128-warmup.json); on one H100 a sweep from
      this tiling found each kernel's fastest tile to be this one (373 / 377 against cudnn's
      417 / 421: 0.90x; tune-attention-nvidia-h100-80gb-hbm3-h128.json). Mosaic's dk/dv
      (64 x 64: 258 / 288 in the two H200 sweeps, 564 bytes a thread spilled) lost to Triton's.
    - H = 64: the H100 sweep's fastest tile of each kernel (tune-attention-nvidia-h100-80gb-
      hbm3-h64.json): Mosaic forward 64 x 64, 2 slots (303 TFLOP/s, against the Triton 128 x 64
      w4 s2 it replaced: 240, and Mosaic's 64 x 128: 283), Mosaic dq 64 x 64, 3 slots (290
      fwd+bwd, 2 slots 289, Triton's best 284), Triton dk/dv 64 x 64 w4 s3 (305, against
      128 x 128 w8 s2: 297). In one process: 295 forward and 295 forward + backward against
      the Triton tiles' 242 / 254 and cudnn's 288 / 313 (1.03x and 0.94x cudnn). The H200's
      H = 64 sweep, which ranked Triton's forward first (244 against Mosaic's 169 at most), ran
      before the tuner warmed the GPU up (tools.measure) and is not taken. All three tiles
      assemble for sm_90a without spilling (gpu-compile-h100.json)."""
    platform, capability = target()
    if platform == "gpu" and capability == (9, 0) and dtype in FUSED_DTYPES and head_dim in HOPPER_16BIT:
        return HOPPER_16BIT[head_dim]
    return triton_tiling(head_dim)


def mosaic_tiling(head_dim: int) -> Tiling:
    """All three kernels in Mosaic GPU (flash_mosaic.py, flash_mosaic_backward.py): 64 query
    rows (one warpgroup) everywhere; the forward's kv tiles 128 keys at H <= 64 and 64 above,
    dq's 64, dk/dv's 64 keys against q blocks of 64; 2 pipeline slots (at H = 128 on an H200,
    2 slots beat 3 in the forward, 401 against 260 TFLOP/s, and in dq, 351 against 312)."""
    return Tiling(Tile(64, 128 if head_dim <= 64 else 64, stages=2, lowering="mosaic"),
                  Tile(64, 64, stages=2, lowering="mosaic"), Tile(64, 64, stages=2, lowering="mosaic"))


def flash_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = True,
                    tiling: Tiling | None = None) -> jax.Array:
    """Attention of q [B, L, N, H] over k/v [B, L, K, H] -> [B, L, N, H] (K divides N).

    tiling: the three kernels' tiles, default `default_tiling(H, dtype)`; blocks must be powers of two
    and are clamped to the length, which needs no relation to them (it is padded).
    """
    plans = _plans(q, k, causal, tiling)
    return _attention(plans, *_pad(plans, q, k, v))[:, :plans[0].length]


def flash_block_forward(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool
                        ) -> tuple[jax.Array, jax.Array]:
    """The forward kernel alone, no custom_vjp: out [B, L, N, H] and lse fp32 [B, N, L], for
    callers that merge blocks of attention by their log-sum-exp (sharding/context_parallel.py)."""
    plans = _plans(q, k, causal, None)
    out, lse = _forward(plans[0], *_pad(plans, q, k, v))
    return out[:, :plans[0].length], lse[..., :plans[0].length]


def flash_block_backward(q: jax.Array, k: jax.Array, v: jax.Array, d_out: jax.Array, lse: jax.Array,
                         delta: jax.Array, *, causal: bool) -> tuple[jax.Array, jax.Array, jax.Array]:
    """dq, dk, dv of one block given the softmax statistics of the whole row: lse and delta fp32
    [B, N, L] may come from more keys than this block's (p = exp(s - lse) is then the block's
    share of the row's probabilities). Padded rows get lse = delta = 0 and dO = 0: no effect."""
    plans = _plans(q, k, causal, None)
    length = plans[0].length
    stats = [(0, 0), (0, 0), (0, _padded(plans) - length)]
    dq, dk, dv = _backward(plans, *_pad(plans, q, k, v, d_out), jnp.pad(lse, stats), jnp.pad(delta, stats))
    return dq[:, :length], dk[:, :length], dv[:, :length]


Plans = tuple[Plan, Plan, Plan]  # forward, dq, dk/dv


def _plans(q: jax.Array, k: jax.Array, causal: bool, tiling: Tiling | None) -> Plans:
    (_, length, n, h), kv_heads = q.shape, k.shape[2]
    if k.shape[1] != length:
        raise ValueError(f"flash attention: q has {length} rows, k and v {k.shape[1]}; they must be equal")
    if n % kv_heads:
        raise ConfigError(f"flash attention: n_heads={n} is not a multiple of n_kv_heads={kv_heads}")
    tiling = tiling or default_tiling(h, str(q.dtype))
    cap = pl.next_power_of_2(length)  # a block longer than the padded sequence is wasted work
    plans = []
    for kernel, tile in (("forward", tiling.forward), ("dq", tiling.dq), ("dkv", tiling.dkv)):
        for name, size in (("block_q", tile.block_q), ("block_k", tile.block_k)):
            if size < 1 or size & (size - 1):
                raise ConfigError(f"flash attention: the {kernel} tile's {name}={size} must be a power of two")
        if tile.lowering not in LOWERINGS:
            raise ConfigError(f"flash attention: the {kernel} tile's lowering={tile.lowering!r}: choose "
                              f"{' or '.join(LOWERINGS)}")
        if tile.lowering == "mosaic":
            if problem := mosaic_problem(kernel, str(q.dtype), h, tile.block_q, tile.block_k):
                raise ConfigError(f"flash attention: {problem}")
            blocks = (tile.block_q, tile.block_k)  # fixed by wgmma: the length is padded to them
        else:
            blocks = (min(tile.block_q, cap), min(tile.block_k, cap))
        plans.append(Plan(causal, length, *blocks, n // kv_heads, tile.warps, tile.stages, tile.lowering))
    return tuple(plans)


def _padded(plans: Plans) -> int:
    """L rounded up to a multiple of every block (powers of two: a multiple of the largest)."""
    block = max(max(p.block_q, p.block_k) for p in plans)
    return -(-plans[0].length // block) * block


def _pad(plans: Plans, *xs: jax.Array) -> list[jax.Array]:
    """[B, L, N or K, H] zero-padded along L to `_padded(plans)`."""
    return [jnp.pad(x, [(0, 0), (0, _padded(plans) - plans[0].length), (0, 0), (0, 0)]) for x in xs]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(plans: Plans, q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    return _forward(plans[0], q, k, v)[0]


def _attention_fwd(plans: Plans, q, k, v):
    out, lse = _forward(plans[0], q, k, v)
    return out, (q, k, v, out, lse)


def _attention_bwd(plans: Plans, residuals, d_out):
    q, k, v, out, lse = residuals
    # delta_i = sum_h dO_ih out_ih = sum_j p_ij dp_ij: the softmax Jacobian's row term.
    delta = jnp.einsum("blnh,blnh->bnl", d_out.astype(jnp.float32), out.astype(jnp.float32))
    return (*_backward(plans, q, k, v, d_out, lse, delta),)


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
    platform, capability = target()
    if platform != "gpu":
        options = {"interpret": True}
    else:
        from jax.experimental.pallas import triton as pltriton

        first = jax.tree.leaves(out_shape)[0]  # every first output is [B, L, heads, H]
        if problem := core_problem("pallas", "gpu", capability, str(first.dtype), first.shape[-1]):
            raise ConfigError(f"flash attention on this GPU: {problem}")
        options = {"compiler_params": pltriton.CompilerParams(num_warps=plan.warps, num_stages=plan.stages)}
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
    if plan.lowering == "mosaic":
        return mosaic_forward(plan, q, k, v)
    b, padded, n, h = q.shape
    out_shape = (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((b, n, padded), jnp.float32))
    kv = _kv_of_head(padded, h, plan.groups)
    return _launch(forward_kernel, plan, (b, n, padded // plan.block_q),
                   [_tile(plan.block_q, h), kv, kv], [_tile(plan.block_q, h), _stat_tile(plan.block_q)],
                   out_shape)(q, k, v)


def _backward(plans: Plans, q, k, v, d_out, lse, delta) -> tuple[jax.Array, jax.Array, jax.Array]:
    _, dq_plan, dkv_plan = plans
    dq = (mosaic_dq if dq_plan.lowering == "mosaic" else _triton_dq)(dq_plan, q, k, v, d_out, lse, delta)
    dk, dv = (mosaic_dkv if dkv_plan.lowering == "mosaic" else _triton_dkv)(dkv_plan, q, k, v, d_out, lse, delta)
    return dq, dk, dv


def _triton_dq(dq_plan: Plan, q, k, v, d_out, lse, delta) -> jax.Array:
    b, padded, n, h = q.shape
    tile_q, stat = _tile(dq_plan.block_q, h), _stat_tile(dq_plan.block_q)
    kv = _kv_of_head(padded, h, dq_plan.groups)
    return _launch(dq_kernel, dq_plan, (b, n, padded // dq_plan.block_q),
                   [tile_q, kv, kv, tile_q, stat, stat], tile_q,
                   jax.ShapeDtypeStruct(q.shape, q.dtype))(q, k, v, d_out, lse, delta)


def _triton_dkv(dkv_plan: Plan, q, k, v, d_out, lse, delta) -> tuple[jax.Array, jax.Array]:
    padded, h = q.shape[1], q.shape[-1]
    tile_k = _tile(dkv_plan.block_k, h)
    heads, stats = _heads_of_kv(padded, h, dkv_plan.groups), _stat_heads_of_kv(padded, dkv_plan.groups)
    kv_shapes = (jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype))
    return _launch(dkv_kernel, dkv_plan, (q.shape[0], k.shape[2], padded // dkv_plan.block_k),
                   [heads, tile_k, tile_k, heads, stats, stats], [tile_k, tile_k], kv_shapes,
                   )(q, k, v, d_out, lse, delta)
