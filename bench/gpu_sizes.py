"""The shapes of every `make gpu-check` stage (bench/gpu.py): GPU for a GPU, SMOKE for --cpu-smoke.

GPU sizes each stage for one H100 within the 8-minute budget (the stage times in bench/gpu.py's
docstring); SMOKE shrinks every shape so the same pipeline runs on CPU in about a minute (a test,
tests/test_gpu_check.py). Training cases are listed smallest first: all stages share one process,
so the peak memory a case reports is the process's peak so far.
"""

from __future__ import annotations

import dataclasses

from bench.attention import CORES as ATTENTION_CORES
from model.kernels.grouped_matmul import TILE, Tile


@dataclasses.dataclass(frozen=True)
class Sizes:
    """Every shape the stages use; GPU and SMOKE below."""

    matmul_n: int
    copy_bytes: int
    timed_runs: int
    check_lengths: tuple[int, ...]  # bf16
    check_fp32_lengths: tuple[int, ...]
    check_heads: tuple[int, int, int]  # N, K, H
    check_more: tuple[tuple[int, int], ...]  # more bf16 (L, H) points, N and K as above
    tiny_sets: tuple[str, ...]  # overrides of the tiny preset for the per-core train step
    bench_lengths: tuple[int, ...]
    bench_heads: tuple[int, int, int]  # N, K, H
    bench_more: tuple[tuple[int, int], ...]  # more (L, H) points, N and K as above
    bench_tokens: int
    train_cases: tuple[tuple[str, str, tuple[str, ...]], ...]  # (preset, remat, overrides)
    train_steps: int
    flag_cases: tuple[tuple[str, str, tuple[str, ...], str], ...]  # (preset, remat, overrides, XLA option)
    profile_cases: tuple[tuple[str, tuple[str, ...]], ...]  # (preset, overrides)
    moe_case: tuple[str, int, tuple[Tile, ...]]  # (preset, tokens, mosaic tiles) of the moe stage
    mesh_case: tuple[str, tuple[str, ...]]  # (preset, overrides) of the mesh stage's strategies
    message_bounds: str  # the mesh stage's collective sizes, LO:HI (tools.collectives --sizes)
    cores: tuple[str, ...] = ATTENTION_CORES  # those the correctness and attention stages run (--cores)


def _batch(micro: int, accum: int, seq: int) -> tuple[str, ...]:
    """Overrides for `micro` sequences per device per microbatch, `accum` microbatches, weak
    scaling over the devices (the global batch is filled in per device count, see `case_config`)."""
    return (f"train.micro_batch_size={micro}", f"train.global_batch_size={micro * accum}",
            f"train.seq_len={seq}", "data.source=synthetic")


SCAN, UNROLLED = ("model.scan_layers=true",), ("model.scan_layers=false",)  # 125m's and 1b's default: unrolled

GPU = Sizes(
    matmul_n=8192, copy_bytes=2**30, timed_runs=10,
    check_lengths=(1024, 4096, 1500), check_fp32_lengths=(1500,), check_heads=(8, 2, 128),
    check_more=((1500, 64),), tiny_sets=(),
    bench_lengths=(2048, 4096, 8192), bench_heads=(32, 8, 128), bench_more=((4096, 64),), bench_tokens=16384,
    train_cases=tuple((preset, remat, batch + SCAN)
                      for preset, batch in (("125m", _batch(16, 2, 1024)), ("1b", _batch(8, 2, 2048)))
                      for remat in ("full", "dots", "none"))
    + (("125m", "none", _batch(16, 2, 1024) + UNROLLED), ("1b", "none", _batch(8, 2, 2048) + UNROLLED),
       ("1b", "full", _batch(8, 2, 2048) + UNROLLED)),
    train_steps=5,
    flag_cases=(("1b", "none", _batch(8, 2, 2048) + SCAN, "xla_gpu_enable_dynamic_slice_fusion"),),
    profile_cases=(("1b", _batch(8, 2, 2048) + SCAN), ("1b", _batch(8, 2, 2048) + UNROLLED)),
    moe_case=("mixtral-8x7b", 4096, (TILE, Tile(block_m=64), Tile(max_concurrent_steps=2), Tile(grid_block_n=4))),
    mesh_case=("125m", _batch(16, 2, 1024)), message_bounds="1M:256M",
)
_TINY = ("model.n_layers=2", "train.seq_len=64", "train.global_batch_size=8")
SMOKE = Sizes(
    matmul_n=256, copy_bytes=2**22, timed_runs=1,
    check_lengths=(128, 100), check_fp32_lengths=(100,), check_heads=(4, 2, 64), check_more=((100, 128),),
    tiny_sets=_TINY,
    bench_lengths=(128,), bench_heads=(4, 2, 64), bench_more=((128, 128),),  # H = 64: the Mosaic GPU kernels' least
    bench_tokens=128,
    train_cases=(("tiny", "full", _TINY + _batch(4, 2, 64)), ("tiny", "none", _TINY + _batch(4, 2, 64))),
    train_steps=2,
    flag_cases=(("tiny", "none", _TINY + _batch(4, 2, 64), "xla_gpu_enable_dynamic_slice_fusion"),),
    profile_cases=(("tiny", _TINY + _batch(4, 2, 64)),),
    moe_case=("moe-tiny", 32, (TILE,)),
    mesh_case=("tiny", _TINY + _batch(4, 2, 64) + ("model.compute_dtype=float32",)), message_bounds="4K:16K",
)
