"""Plan a run before renting the GPUs: does it fit, what does it communicate, how long a step takes.

  python -m tools.plan --config llama3-8b --mesh dp=8,tp=8 --gpu h100      (= train.py --dry-run)
  python -m tools.plan --config llama3-8b --mesh dp=8,tp=8 --json
  python -m tools.plan --config llama3-70b --gpus 512 --gpu h100 --global-batch-tokens 4M --search
  python -m tools.plan --config llama3-8b --mesh dp=8,tp=8 --bandwidth bench/results/collectives-gpu-dp8_tp8.json

Dry run: the real train step is compiled ahead of time for the mesh's device count, no
parameter allocated (tools/plan_compile.py: fake CPU devices on a laptop). One table puts XLA's
figures beside the analytic model's (tools/estimate.py, traffic.py, roofline.py; the report
itself: tools/plan_report.py): per-device memory (`memory_analysis()`: arguments, outputs,
temp, and args + outputs - aliased + temp, the static peak; XLA CPU's own peak_memory_in_bytes
counts about the arguments only), the collective census per mesh axis (tools/hlo.py) beside the
contract formulas, FLOPs per device (`cost_analysis()`, which on CPU counts the program as
compiled there) beside 6·N·tokens + attention, the roofline step time and MFU on `--gpu`, and a
verdict. Memory on CPU is not GPU memory: XLA CPU keeps bf16 matmuls in fp32 buffers, so its
temp is larger than a GPU's would be (compare under model.compute_dtype=float32); the verdict
weighs XLA's peak only when it was compiled for a GPU or in fp32.

--compile-for-gpu: the step is compiled by XLA GPU for --gpu (h100, h200) x the mesh's devices,
on this machine without a GPU (tools/gpu_target.py), so XLA's memory is the GPU's and is judged.
Where XLA GPU's latency-hiding scheduler holds more than the estimate, the step is compiled once
more without it and the report gives that peak too (`lhs_off`: tools/plan_compile.py).

A mesh with pp > 1 compiles the pipelined step of its `parallel.schedule`; the estimate models
that schedule's memory (gpipe holds M microbatches, 1f1b at most pp: the in-flight peak of its
table) and bubble (its table's, lock-step and weighted: pipeline/schedule.py).

Search (--search): tools/search.py ranks every mesh of --gpus analytically, choosing the
micro batch (or, under a pipeline, the schedule and microbatch count: every schedule is ranked
by its table's lock-step bubble and printed, the fastest the config accepts is chosen) of each;
the top 3 are compiled, XLA's memory printed beside each (--confirm N to change; 0 to skip):
on CPU, marked "not judged" where it is no GPU figure (as in the dry run's verdict); with
--compile-for-gpu by XLA GPU for --gpu's GPUs, judged against the GPU's memory (and without the
latency-hiding scheduler where it holds more than the estimate, as in the dry run). When no
mesh of --gpus splits the global batch, the error names the smallest batch that one does.

Links (--bandwidth FILE, the record `python -m tools.collectives` writes): each mesh axis the
record measures is timed with its fit, latency + bytes / busbw, the op per axis chosen in
tools/bandwidth.py; the others keep the datasheet (NVLink 450 GB/s inside a node of 8,
InfiniBand 50 GB/s across). The output names, per axis, which it used.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math

from configs import ConfigError, RunConfig, apply_overrides
from configs.parser import Parser
from sharding.mesh import AXES, format_mesh
from tools import roofline, traffic
from tools.bandwidth import Measured, add_bandwidth_arg, load
from tools.calibration import add_calibration_arg, rated_gpu
from tools.links import GPUS_PER_NODE, INFINIBAND, NVLINK
from tools.measure import check_at_least
from tools.plan_compile import compiled
from tools.plan_report import LHS_OFF_FLAG, above_best_mfu, format_plan, links_of, not_judged, plan
from tools.search import no_mesh_takes, reason, search, settings
from tools.shape import GiB


def parse_tokens(text: str) -> int:
    """'4M' -> 4·2^20, '512k' -> 512·2^10, '1000' -> 1000; a whole number of tokens, at least 1."""
    scale = {"k": 2**10, "m": 2**20, "g": 2**30}.get(text[-1:].lower(), 1)
    try:
        tokens = float(text[:-1] if scale > 1 else text) * scale
    except ValueError:
        tokens = math.nan
    if not math.isfinite(tokens) or tokens < 1 or tokens % 1:
        raise ConfigError(f"--global-batch-tokens {text!r}: expected a whole number of tokens, at least 1, "
                          "such as 4M or 512k")
    return int(tokens)


def with_batch_tokens(cfg: RunConfig, tokens: int | None) -> RunConfig:
    """cfg with train.global_batch_size = tokens / train.seq_len (cfg itself when tokens is None)."""
    if tokens is None:
        return cfg
    if tokens % cfg.train.seq_len:
        raise ConfigError(f"--global-batch-tokens {tokens} is not a multiple of train.seq_len={cfg.train.seq_len}")
    return apply_overrides(cfg, [f"train.global_batch_size={tokens // cfg.train.seq_len}"])


def dry_run(cfg: RunConfig, gpu: roofline.GPU, as_json: bool, measured: Measured | None = None,
            compile_for: str | None = None) -> int:
    """Compile cfg's step on its mesh (fake devices were requested by the caller; or, with
    `compile_for` a tools/gpu_target.py GPU, that GPU's compile-only devices) and print the plan,
    on the measured links where `measured` (tools/bandwidth.py) covers an axis."""
    from sharding.mesh import mesh_config

    xla, mesh = compiled(cfg, compile_for)
    cfg = dataclasses.replace(cfg, parallel=mesh_config(mesh, cfg.parallel))
    report = plan(cfg, dict(mesh.shape), gpu, xla, measured)
    print(json.dumps(report, indent=1, default=str) if as_json else format_plan(report))
    return 0


def run_search(cfg: RunConfig, gpus: int, gpu: roofline.GPU, confirm: int, as_json: bool,
               measured: Measured | None = None, compile_for: str | None = None) -> int:
    """Rank the meshes of `gpus` GPUs (on the measured links where `measured` covers an axis);
    compile the top `confirm`, pipelined ones too, to confirm memory: on this process's fake
    devices, or with `compile_for` (a tools/gpu_target.py GPU) by XLA GPU for that GPU."""
    ranked, rejected = search(cfg, gpus, gpu, links_of(cfg, measured))
    found = measured.links(cfg.parallel.context_impl) if measured else {}
    links = {a: measured.label(link) for a, link in found.items()} | {
        "other axes" if found else "every axis": f"datasheet NVLink {NVLINK / 1e9:.0f} GB/s inside a node of {GPUS_PER_NODE}, "
                      f"InfiniBand {INFINIBAND / 1e9:.0f} GB/s across"}
    if not ranked and not rejected:
        raise ConfigError(no_mesh_takes(cfg, gpus))
    if not ranked:
        raise ConfigError(f"no mesh of {gpus} GPUs fits {cfg.name} on {gpu.name}: add GPUs or use "
                          "--set model.remat=full")
    rows = []
    for i, c in enumerate(ranked[:5]):
        rows.append({"mesh": format_mesh(c["sizes"]), "set": settings(c),
                     "step_s_overlap": c["time"]["overlap_s"], "step_s_no_overlap": c["time"]["no_overlap_s"],
                     "mfu_overlap": c["time"]["mfu_overlap"], "memory_gib": c["memory"]["peak"] / GiB,
                     "all_to_all_gib": traffic.expert(c["cfg"], c["sizes"]) / GiB,
                     "reason": reason(c, ranked[0]),
                     "schedules": [{k: v for k, v in row.items() if k != "cfg"} for row in c["schedules"]]})
        if i < confirm:
            trial = dataclasses.replace(c["cfg"], parallel=dataclasses.replace(c["cfg"].parallel, **c["sizes"]))
            rows[-1] |= confirmed(trial, c["sizes"], compiled(trial, compile_for)[0], gpu)
    piped = next(((i, c) for i, c in enumerate(ranked, 1) if c["sizes"]["stage"] > 1), None)
    best_pipeline = piped and {"rank": piped[0], "mesh": format_mesh(piped[1]["sizes"]),
                               "schedules": [{k: v for k, v in row.items() if k != "cfg"}
                                             for row in piped[1]["schedules"]]}
    if as_json:
        print(json.dumps({"config": cfg.name, "gpus": gpus, "gpu": gpu.name, "compiled_for": compile_for or "cpu",
                          "rates": gpu.rates,
                          "best_mfu": gpu.best_mfu, "candidates": len(ranked) + rejected,
                          "rejected": rejected, "links": links, "top": rows, "best_pipeline": best_pipeline},
                         indent=1))
        return 0
    print(f"search: {cfg.name}, {gpus} x {gpu.name}, {cfg.train.global_batch_size} x {cfg.train.seq_len} tokens "
          f"per step; {len(ranked) + rejected} meshes, {rejected} do not fit\nlinks: "
          + "; ".join(f"{a} {src}" for a, src in links.items()) + f"\nrates: {gpu.rates}")
    if any(r["mfu_overlap"] > gpu.best_mfu for r in rows):
        print(f"* {above_best_mfu(max(r['mfu_overlap'] for r in rows), gpu)}")
    for i, r in enumerate(rows, 1):
        print(f"{i}. {r['mesh']:<24} {r['step_s_overlap']:.2f} s/step overlapped ({r['step_s_no_overlap']:.2f} s "
              f"not), MFU {100 * r['mfu_overlap']:.0f}%{'*' if r['mfu_overlap'] > gpu.best_mfu else ''}{confirmed_text(r, gpu)}"
              f"\n   --set {' --set '.join(r['set'])}\n"
              f"   {r['reason']}")
        if r["schedules"]:
            print("   schedules: " + ", ".join(schedule_summary(row) for row in r["schedules"]))
    if best_pipeline and best_pipeline["rank"] > len(rows):
        print(f"best pipeline: {best_pipeline['mesh']} (rank {best_pipeline['rank']}), schedules: "
              + ", ".join(schedule_summary(row) for row in best_pipeline["schedules"]))
    return 0


def confirmed(cfg: RunConfig, sizes: dict[str, int], xla: dict, gpu: roofline.GPU) -> dict:
    """A searched mesh's compile (tools.plan_compile.compiled): XLA's peak, its peak without the
    latency-hiding scheduler where it was compiled again, why it is not judged (a CPU compile of
    a 16-bit program), and, judged, whether it fits the GPU."""
    row = {"xla_memory_gib": xla["memory"]["peak"] / GiB, "xla_not_judged": not_judged(cfg, sizes, xla)}
    if "lhs_off" in xla:
        row["xla_lhs_off_gib"] = xla["lhs_off"]["peak"] / GiB
    if not row["xla_not_judged"]:
        row["xla_fits"] = xla["memory"]["peak"] <= gpu.memory
    return row


def confirmed_text(row: dict, gpu: roofline.GPU) -> str:
    """', XLA 24.6 GiB (11.2 without its latency-hiding scheduler)': a row's `confirmed` figures,
    with the verdict where they are judged ('' for a row not compiled)."""
    if "xla_memory_gib" not in row:
        return ""
    text = f", XLA {row['xla_memory_gib']:.1f} GiB"
    if "xla_lhs_off_gib" in row:
        text += f" ({row['xla_lhs_off_gib']:.1f} without its latency-hiding scheduler)"
    if row["xla_not_judged"]:
        return text + f" ({' and '.join(row['xla_not_judged'])}: not judged)"
    if row["xla_fits"]:
        return text + f", fits {gpu.name}"
    rescue = row.get("xla_lhs_off_gib", math.inf) * GiB <= gpu.memory
    return text + f": does NOT fit {gpu.name}'s {gpu.memory / GiB:.1f} GiB" + (
        f" ({LHS_OFF_FLAG} fits)" if rescue else "")


def schedule_summary(row: dict) -> str:
    """'zb-h1 M=16 1.23 s (bubble 4%)': one ranked schedule."""
    v = f" V={row['virtual_stages']}" if row["virtual_stages"] > 1 else ""
    return f"{row['schedule']}{v} M={row['microbatches']} {row['step_s']:.2f} s (bubble {100 * row['bubble']:.0f}%)"


def main(argv: list[str]) -> int:
    from cli import add_run_args, request_fake_devices, run_config

    p = Parser(__doc__)
    add_run_args(p)
    p.add_argument("--gpu", default="h100", help=f"GPU to estimate for: {', '.join(roofline.GPUS)} (default h100)")
    p.add_argument("--gpus", type=int, help="GPU count to search meshes for (--search)")
    p.add_argument("--global-batch-tokens", help="tokens per step, e.g. 4M (sets train.global_batch_size)")
    p.add_argument("--search", action="store_true", help="rank the meshes of --gpus instead of planning --mesh")
    p.add_argument("--confirm", type=int, default=3, help="with --search: compile this many of the top meshes")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    p.add_argument("--compile-for-gpu", action="store_true",
                   help="compile the dry run for --gpu's GPUs (h100, h200) on this machine, no GPU needed "
                   "(jax's CUDA plugin: pip install -e '.[gpu-compile]'), not for fake CPU devices")
    add_bandwidth_arg(p)
    add_calibration_arg(p)
    args = p.parse_args(argv)
    check_at_least(args, 1, "--gpus")
    check_at_least(args, 0, "--confirm")
    if args.search and args.mesh:
        raise ConfigError(f"--mesh {args.mesh} with --search: the search chooses the mesh of --gpus; drop --mesh, "
                          "or drop --search to plan that mesh")
    if args.gpus and not args.search:
        raise ConfigError(f"--gpus {args.gpus} without --search: a plan compiles --mesh; add --search to rank "
                          f"the meshes of {args.gpus} GPUs")
    tokens = None if args.global_batch_tokens is None else parse_tokens(args.global_batch_tokens)
    cfg = with_batch_tokens(run_config(args), tokens)
    measured = load(args.bandwidth) if args.bandwidth else None
    gpu = rated_gpu(args.gpu, args.calibration)
    compile_for = check_compile_for_gpu(cfg, args) if args.compile_for_gpu else None
    if args.search:
        if not args.gpus:
            raise ConfigError("--search needs --gpus N, the GPU count to plan for")
        if compile_for is None:
            request_fake_devices(dataclasses.replace(cfg, parallel=dataclasses.replace(
                cfg.parallel, **({a: 1 for a in AXES} | {"data": args.gpus}))))
        return run_search(cfg, args.gpus, gpu, args.confirm, args.json, measured, compile_for)
    if compile_for is None:
        request_fake_devices(cfg)
    return dry_run(cfg, gpu, args.json, measured, compile_for)


def check_compile_for_gpu(cfg: RunConfig, args: argparse.Namespace) -> str:
    """--compile-for-gpu: the GPU XLA GPU compiles for (tools/gpu_target.py), once the request is
    one it can compile: --gpu h100 or h200, every axis of a planned --mesh sized (the GPU count),
    and jax's CUDA plugin installed. The dry run's memory is then judged against the GPU and its
    census is of the GPU program (NCCL collectives as XLA GPU combines and schedules them); so
    too the searched meshes' memory (--search --confirm)."""
    from sharding.mesh import requested_devices
    from tools.gpu_target import GPUS, check_plugin

    if args.gpu not in GPUS:
        raise ConfigError(f"--compile-for-gpu with --gpu {args.gpu}: it compiles for {' or '.join(GPUS)}")
    if not args.search and requested_devices(cfg.parallel) is None:
        raise ConfigError(f"--compile-for-gpu with --mesh {args.mesh or '(none)'}: name every axis's size "
                          "(no -1), the GPU count it compiles for")
    check_plugin("tools.plan --compile-for-gpu")
    return args.gpu


if __name__ == "__main__":
    from cli import run_cli

    run_cli(main)
