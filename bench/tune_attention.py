"""Tune the Pallas flash attention kernel's tiles on a GPU, one kernel at a time, by measurement.

  python -m bench.tune_attention                  # GPU: H 128, L 4096, N 32, K 8, B 4, causal, bf16
  python -m bench.tune_attention --head-dim 64
  python -m bench.tune_attention --length 64 --head-dim 16 --heads 2 --kv-heads 1 --tokens 64 \\
      --blocks 16,32 --warps 4 --stages 2 --steps 1 --references none    # CPU: proves the script only

The forward, dq and dk/dv kernels are separate launches whose times add
(model/kernels/flash_attention.py), so each is tuned in turn over the grid of tiles: block_q x
block_k from --blocks, x --warps, x --stages (Triton's num_warps and num_stages):
  forward  the forward pass alone, timed per tile;
  dq       forward + backward, the tuned forward and the default dk/dv tile, dq's tile varied;
  dkv      forward + backward, the tuned forward and dq, dk/dv's tile varied.
Each kernel's sweep also runs its Mosaic GPU form (model/kernels/flash_mosaic.py,
flash_mosaic_backward.py): block_q 64, block_k from --mosaic-blocks (dk/dv: 64 only) x --stages
(its pipeline depth), so the tuned tiling picks the lowering kernel by kernel.
A tile that does not compile or run (Triton out of shared memory, a block above the length)
records its error and the sweep goes on. Each kernel's sweep starts from the tile it has now
and gets its share of --budget (default 480 s, so that the run fits a 10-minute slot with the
comparison); tiles past it are recorded as skipped. Then the default and the tuned tiling side by side
and, at the same shape, the references of bench.attention (cudnn, and jax's own Pallas
kernels: jax-triton, jax-mgpu), which say whether a gap to cudnn is this kernel's or its
lowering's (Triton against Mosaic GPU).

TFLOP/s as bench.attention counts them (forward 4·B·N·L²·H, halved for causal; forward +
backward 3.5x). Writes bench/results/tune-attention-<device>-h<H>.json: every row, the best
tile per kernel and the tiling to put in `default_tiling`. On CPU the kernels are interpreted
(warps and stages ignored): such a run proves the script, its figures mean nothing.
"""

from __future__ import annotations

import argparse
import itertools
import time

from bench.attention import REFERENCES, check_groups, core_fn, measure
from cli import run_cli
from sharding.mesh import check_backend
from configs import ConfigError
from configs.parser import Parser
from tools.measure import RESULTS, check_at_least, check_out, environment, file_path, int_list, run_record, write_report

KERNELS = ("forward", "dq", "dkv")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = Parser(__doc__)
    p.add_argument("--length", type=int, default=4096, help="L (default 4096)")
    p.add_argument("--head-dim", type=int, default=128, help="H (default 128)")
    p.add_argument("--heads", type=int, default=32, help="N query heads (default 32)")
    p.add_argument("--kv-heads", type=int, default=8, help="K kv heads (default 8)")
    p.add_argument("--tokens", type=int, default=16384, help="B·L per call (default 16384: B = 4 at L = 4096)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--full", action="store_true", help="full attention instead of causal")
    p.add_argument("--blocks", type=int_list, default=[32, 64, 128], help="block_q and block_k values (powers of two)")
    p.add_argument("--warps", type=int_list, default=[4, 8], help="Triton num_warps values")
    p.add_argument("--stages", type=int_list, default=[2, 3], help="Triton num_stages values")
    p.add_argument("--mosaic-blocks", default="64,128", help="block_k values of the Mosaic GPU kernels' tiles "
                   "(block_q 64; dk/dv 64 only; x --stages as the pipeline depth), or none (default 64,128)")
    p.add_argument("--steps", type=int, default=10, help="timed calls per measurement (default 10)")
    p.add_argument("--budget", type=float, default=480, help="seconds for the sweep; later tiles are "
                   "recorded as skipped, each kernel keeps its best so far (default 480)")
    p.add_argument("--references", default=",".join(("cudnn", *REFERENCES)),
                   help=f"comma-separated of cudnn,{','.join(REFERENCES)}, or none")
    p.add_argument("--out", type=file_path, help="JSON report (default bench/results/tune-attention-<device>-h<H>.json)")
    args = p.parse_args(argv)
    args.references = [r for r in args.references.split(",") if r and r != "none"]
    if set(args.references) - {"cudnn", *REFERENCES}:
        raise ConfigError(f"--references from cudnn,{','.join(REFERENCES)} or none")
    if any(b < 1 or b & (b - 1) for b in args.blocks) or min(args.warps + args.stages, default=0) < 1:
        raise ConfigError("--blocks must be powers of two, --warps and --stages positive")
    try:
        args.mosaic_blocks = [int(x) for x in args.mosaic_blocks.split(",") if x.strip() and x.strip() != "none"]
    except ValueError:
        raise ConfigError(f"--mosaic-blocks {args.mosaic_blocks!r}: expected integers, e.g. 64,128, or none") from None
    if any(b < 64 or b & (b - 1) for b in args.mosaic_blocks):
        raise ConfigError(f"--mosaic-blocks {','.join(map(str, args.mosaic_blocks))}: powers of two of 64 or more")
    check_at_least(args, 1, "--length", "--head-dim", "--heads", "--kv-heads", "--tokens", "--steps")
    check_groups(args.heads, args.kv_heads)
    check_out(args.out)
    return args


def sweep(kernel: str, base, args: argparse.Namespace, deadline: float) -> tuple[list[dict], object]:
    """Rows of the tiles of `kernel` in the grid, base's own tile first, the other kernels as in
    `base`; and the best tiling (base itself when no tile ran). Tiles left when time.perf_counter()
    passes `deadline` are recorded as skipped."""
    import dataclasses

    from model.kernels.flash_attention import Tile, flash_attention

    passes = ("forward",) if kernel == "forward" else ("forward_backward",)
    grid = [Tile(*t) for t in itertools.product(args.blocks, args.blocks, args.warps, args.stages)]
    # the Mosaic GPU form: one warpgroup of 64 rows, warps unused; dk/dv takes 64 x 64 only
    mosaic_blocks = [64] * bool(args.mosaic_blocks) if kernel == "dkv" else args.mosaic_blocks
    grid += [Tile(64, bk, 4, stages, "mosaic") for bk, stages in itertools.product(mosaic_blocks, args.stages)]
    first = getattr(base, kernel)
    rows, best, best_ms = [], base, float("inf")
    for tile in [first] * (first in grid) + [t for t in grid if t != first]:
        row = {"kernel": kernel, **dataclasses.asdict(tile)}
        if time.perf_counter() > deadline:
            rows.append(row | {"status": "skipped: past --budget"})
            continue
        tiling = dataclasses.replace(base, **{kernel: tile})
        fn = lambda q, k, v, t=tiling: flash_attention(q, k, v, causal=not args.full, tiling=t)  # noqa: E731
        row |= measure("pallas", lambda fn=fn: fn, not args.full, args.length, args.head_dim, args, passes)
        rows.append(row)
        ms = row.get(f"{passes[0]}_ms", float("inf"))
        if "error" not in row and ms < best_ms:
            best, best_ms = tiling, ms
        print(f"  {kernel:<8} {tile.lowering:<7}{tile.block_q:>4} x {tile.block_k:<4} warps {tile.warps} "
              f"stages {tile.stages}  " + (row["error"][:80] if "error" in row else f"{ms:9.3f} ms  {row[f'{passes[0]}_tflops']:7.1f} TFLOP/s"),
              flush=True)
    return rows, best


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    import dataclasses

    import jax

    check_backend()

    from model.kernels.flash_attention import default_tiling, flash_attention

    env, causal = environment(jax.devices()[:1]), not args.full
    name = "cpu-interpret-smoke" if env["backend"] != "gpu" else env["device_kind"].lower().replace(" ", "-")
    out = args.out or RESULTS / f"tune-attention-{name}-h{args.head_dim}.json"
    default = default_tiling(args.head_dim, args.dtype)
    report = run_record("bench.tune_attention", argv) | {
        "environment": env, "interpret_mode": env["backend"] != "gpu",
        "shape": {"length": args.length, "head_dim": args.head_dim, "heads": args.heads, "kv_heads": args.kv_heads,
                  "batch": max(1, args.tokens // args.length), "dtype": args.dtype, "causal": causal},
        "flops": "forward 4*B*N*L^2*H (halved if causal); forward+backward 3.5x forward",
        "default": {k: dataclasses.asdict(getattr(default, k)) for k in KERNELS}, "sweep": []}
    tuned, start = default, time.perf_counter()
    for kernel in KERNELS:  # the record is written after each kernel: a crash keeps what ran
        left = args.budget - (time.perf_counter() - start)  # shared by this kernel and those after it
        deadline = time.perf_counter() + left / (len(KERNELS) - KERNELS.index(kernel))
        rows, tuned = sweep(kernel, tuned, args, deadline)
        report["sweep"] += rows
        report["tuned"] = {k: dataclasses.asdict(getattr(tuned, k)) for k in KERNELS}
        write_report(report, out)
    compare = [("pallas-default", lambda: lambda q, k, v: flash_attention(q, k, v, causal=causal, tiling=default)),
               ("pallas-tuned", lambda: lambda q, k, v: flash_attention(q, k, v, causal=causal, tiling=tuned))]
    compare += [(core, lambda core=core: core_fn(core, causal)) for core in args.references]
    report["compare"] = [measure(core, make, causal, args.length, args.head_dim, args) for core, make in compare]
    for r in report["compare"]:
        print(f"  {r['core']:<15}" + (r["error"][:100] if "error" in r else
              f"forward {r['forward_tflops']:6.1f}  forward + backward {r['forward_backward_tflops']:6.1f} TFLOP/s"))
    mosaic = lambda t: f", lowering={t['lowering']!r}" if t["lowering"] != "triton" else ""  # noqa: E731
    report["tuned_line"] = "Tiling(" + ", ".join(f"Tile({t['block_q']}, {t['block_k']}, {t['warps']}, {t['stages']}{mosaic(t)})"
                                                 for t in report["tuned"].values()) + ")"
    print(f"\ntuned tiling for head_dim {args.head_dim}: {report['tuned_line']}")
    write_report(report, out)
    return 0


if __name__ == "__main__":
    run_cli(main)
