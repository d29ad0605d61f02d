"""`make gpu-check`: one command that says what this NVIDIA GPU machine does with meshtrain.

  python -m bench.gpu                      # GPU: all stages, budgeted at 8 minutes on one H100
  python -m bench.gpu --stages ceilings,attention --out /tmp/g.json
  python -m bench.gpu --cpu-smoke          # CPU: the same pipeline at tiny shapes (a test)

Stages, in order (GPU shapes; --cpu-smoke shrinks every shape: bench/gpu_sizes.py):
  environment  device name/count, driver/CUDA/cuDNN as jax reports them, jax/jaxlib/flax
               versions, XLA/JAX/NCCL/CUDA env vars, jax.print_environment_info()   (~5 s)
  ceilings     bf16 8192^3 matmul TFLOP/s, and a 1 GiB fp32 `x + 1` pass as the copy
               bandwidth (GB/s, read + write counted); both as fractions of the datasheet
               peak (training/metrics.py)                                         (~15 s)
  correctness  pallas, pallas-mosaic (its kernels in Mosaic GPU) and cudnn cores against the
               xla core, out and dq/dk/dv, causal GQA (N=8, K=2, H=128): bf16 at L = 1024,
               4096 and a ragged 1500, fp32 at 1500, bf16 at 1500 with H = 64 (the 1b
               preset's head dim, whose Hopper tiles differ), with the tolerances of
               tests/test_flash_attention.py; fp32 runs under
               jax.default_matmul_precision('highest') so TF32 does not stand in for fp32
               (cuDNN and the Mosaic kernels take fp16/bf16 only: their fp32 cases are 'n/a').
               Pallas in fp32 at that precision compiles for about 2 minutes on an H100
               (measured: 115-124 s at each L), hence one fp32 length. Then one train step
               of the tiny preset per core, loss against xla's                    (~3 min)
  attention    bench/attention.py `measure` for pallas, pallas-mosaic, cudnn, xla at H=128,
               N=32, K=8, L = 2k, 4k, 8k, and at H = 64 (the 1b preset's) at L = 4k, causal,
               bf16: forward and forward+backward TFLOP/s (causal FLOPs halved), also as
               fractions of the matmul ceiling and the peak (~90 s)
  training     bench/step.py `measure_steps` for 125m and 1b (model.attention=auto: the
               core it takes is recorded, cudnn on an H100), remat full,
               dots, then none, dp over every GPU, with the layer scan
               (model.scan_layers=true): tokens/s, TFLOP/s per device, MFU, peak
               memory; an out-of-memory case is recorded as "oom" and the run goes on (~70 s);
               then each under none unrolled, the presets' default (model.scan_layers=false: no
               stacks of activations, model/transformer.py): 1b 431 ms against the scan's 579 on
               one H100, 414 against 513 on one H200; and 1b under full unrolled, beside the
               scan's full (its checkpoints hold unrolled since 2026-11-27: model/remat.py;
               compiled for one H100, 22.69 GiB against 23.80 scanned, its step not yet timed)
  moe          one MoE layer's experts alone (bench/moe_ffn.py), mixtral-8x7b's (E = 8, k = 2,
               D = 4096, F = 14336), 4096 tokens, bf16: first jax's Hopper grouped matmul
               (model.expert_matmul=mosaic) against ragged_dot, values and gradients with a
               quarter of the rows padding; then forward + backward timed for ragged_dot
               (what XLA makes of it: dense on the cuDNN 9.19 of the GPUs lent so far), mosaic
               at its default tile and three others, a dense loop over the experts and the
               capacity layout's batched einsum: ms, routed TFLOP/s, XLA's temporaries.
               Never yet run on a GPU (added 2026-11-28)
  mesh         with several GPUs only (bench/gpu_mesh.py): the collectives' busbw over all of
               them (tools.collectives over dp=n, 1 MiB to 256 MiB, its record written beside
               this one for `tools.plan --bandwidth`), and 125m under remat full on dp=n,
               fsdp=n, fsdp=n/2,tp=2 (and with SP) and pp=2,dp=n/2 (1f1b): tokens/s, MFU, peak memory, and
               each mesh axis's compiled collective bytes beside tools.traffic's contract;
               one GPU: skipped, said so (no multi-GPU machine has run it yet)
  flags        XLA options on and off, each compiled for the same training case in this process
               (compile options over XLA_FLAGS): 1b under remat none, layer scan, with
               xla_gpu_enable_dynamic_slice_fusion (XLA's default from jax 0.11: GEMMs write into
               the layer scan's stacks; on in the H100 record, whose 1b profile under none still
               spent 96 ms of a step in memcpy and 32 ms in dynamic-update-slice, against 12 and
               0 under full); step time off / on (0.998 on one H200, 1.002 on
               one H100: no effect)
  profile      three steps of 1b with steps 2..3 traced (training/profiling.py), summed by
               tools/trace_summary.py (scopes) and tools/op_kinds.py (op kinds): top ops, and the
               fractions in attention kernels, matmuls, collectives, copies, elementwise/other;
               a kernel run inside a CUDA graph is kinded by its name (trace_summary) (~15 s);
               1b's default remat is none: profiled with the layer scan, then unrolled
               (its default), so the two copy fractions sit side by side

Stage times above were measured on one H100 (2026-11-24, bench/results/gpu-nvidia-h100-*.json);
on one H200 the first five stages without fp32 took 134 s (gpu-nvidia-h200-20261126.json); on
one H100 all seven without fp32 took 237 s (gpu-nvidia-h100-80gb-hbm3-20261126.json). The
--budget (default 480 s) is checked before each stage: a stage that would start after it is
recorded as skipped.
Each stage runs inside try/except: an error is recorded as {"error": ...} under its name and
the next stage runs; the JSON is rewritten after every stage, so a run cut short keeps what it
measured. A kernel that hangs is not caught: --cores drops a core from the correctness and
attention stages (give a new kernel its own short first call, as pallas-mosaic had before its
first GPU run on an H200, e.g. `timeout 120 python -m bench.attention --cores pallas-mosaic
--lengths 2048 --head-dims 128`). --fp32-lengths none leaves out the fp32 correctness cases
(Pallas Triton's fp32 compile, about 2 minutes per length). Timing (tools.measure.median_seconds):
compile and run once, on a GPU 0.3 s more of calls, then the median of several timed runs, each
waited for with jax.block_until_ready. All stages share one process, so `peak_memory_bytes_per_device`
(memory_stats) is the process's peak so far: training cases run smallest first, and XLA's
static memory analysis of each step is recorded beside it.

On a GPU, with the ceilings, attention and training stages run, the record then holds
`estimate`: each training case's (and mesh strategy's, on its mesh) step time as
tools/roofline.py plans it at this record's own measured rates, beside the measured one
(tools/calibration.py; tests/test_calibration.py holds them within 15% once a GPU record is
committed).

Without a GPU (and without --cpu-smoke) it prints one line and exits 0. --cpu-smoke runs on
CPU, pallas interpreted, cudnn recorded as "unavailable on cpu": its figures prove the script,
not any hardware.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import time
import traceback
from pathlib import Path

from bench import gpu_device, gpu_training
from bench.gpu_mesh import mesh_stage
from bench.gpu_sizes import GPU, SMOKE, Sizes
from bench.attention import CORES as ATTENTION_CORES
from bench.common import error_text
from bench.gpu_correctness import correctness
from bench.gpu_summary import summary_lines
from bench.moe_ffn import ffn_bench, mosaic_check
from cli import run_cli
from configs import ConfigError, get_preset
from configs.parser import Parser
from sharding.mesh import check_backend
from sharding.xla_flags import with_flags
from tools.calibration import estimate_vs_measured
from tools.measure import RESULTS, check_at_least, check_out, file_path, int_list, run_record, write_report

STAGES = ("environment", "ceilings", "correctness", "attention", "training", "moe", "mesh", "flags", "profile")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = Parser(__doc__)
    p.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated, of {','.join(STAGES)}")
    p.add_argument("--out", type=file_path, help="JSON report (default bench/results/gpu-<device>-<date>.json)")
    p.add_argument("--profile-dir", type=Path,
                   help="where the profile stage's run goes (default runs/<out stem>-profile)")
    p.add_argument("--budget", type=float, default=480, help="seconds; later stages are skipped (default 480)")
    p.add_argument("--cpu-smoke", action="store_true", help="run every stage on CPU at tiny shapes (proves the script)")
    p.add_argument("--cores", default=",".join(ATTENTION_CORES),
                   help=f"attention cores of the correctness and attention stages, xla among them (default "
                   f"{','.join(ATTENTION_CORES)}); e.g. leave pallas-mosaic out after a first run found it hangs")
    p.add_argument("--fp32-lengths", type=lambda s: [] if s.strip().lower() == "none" else int_list(s),
                   help="L values of the correctness stage's fp32 cases, or none (default: the sizes' own; "
                   "Pallas Triton in fp32 compiles for about 2 minutes per length on an H100)")
    args = p.parse_args(argv)
    args.stages = [s for s in args.stages.split(",") if s]
    if not args.stages or set(args.stages) - set(STAGES):
        raise ConfigError(f"--stages {','.join(args.stages)!r}: choose from {','.join(STAGES)}")
    given = [c for c in args.cores.split(",") if c]
    if set(given) - set(ATTENTION_CORES) or "xla" not in given:
        raise ConfigError(f"--cores {args.cores!r}: choose from {','.join(ATTENTION_CORES)}, xla among them "
                          "(the correctness stage's reference)")
    args.cores = tuple(c for c in ATTENTION_CORES if c in given)
    check_at_least(args, 1, "--budget", "--fp32-lengths")
    check_out(args.out)
    return args


# --- stages 1-4: environment, ceilings (bench/gpu_device.py), correctness (bench/gpu_correctness.py),
# attention speed (bench/gpu_device.py) ------------------------------------------------------------

def stage_environment(sizes: Sizes) -> dict:
    return gpu_device.environment_info()


def stage_ceilings(sizes: Sizes) -> dict:
    return gpu_device.ceilings(sizes.matmul_n, sizes.copy_bytes, sizes.timed_runs)


def stage_correctness(sizes: Sizes) -> dict:
    return correctness(sizes.check_lengths, sizes.check_fp32_lengths, sizes.check_heads, sizes.check_more,
                       sizes.tiny_sets, sizes.cores)


def stage_attention(sizes: Sizes) -> dict:
    return gpu_device.attention_speed(sizes.bench_lengths, sizes.bench_heads, sizes.bench_more, sizes.bench_tokens,
                                      sizes.timed_runs, sizes.cores)


# --- stages 5-9: training speed, the experts' matmul (bench/moe_ffn.py), several GPUs
# (bench/gpu_mesh.py), XLA options on and off, profile (bench/gpu_training.py) ----------------------

def stage_training(sizes: Sizes) -> dict:
    return gpu_training.training(sizes.train_cases, sizes.train_steps)


def stage_moe(sizes: Sizes) -> dict:
    preset, tokens, tiles = sizes.moe_case
    cfg = get_preset(preset)
    return {"preset": preset, "check": mosaic_check(cfg, tokens), "ffn": ffn_bench(cfg, tokens, sizes.timed_runs, tiles)}


def stage_mesh(sizes: Sizes, record_dir: Path) -> dict:
    preset, overrides = sizes.mesh_case
    return mesh_stage(preset, overrides, sizes.train_steps, sizes.message_bounds, sizes.timed_runs, record_dir)


def stage_flags(sizes: Sizes) -> dict:
    return gpu_training.flags(sizes.flag_cases, sizes.train_steps)


def stage_profile(sizes: Sizes, run_dir: Path) -> dict:
    return gpu_training.profile(sizes.profile_cases, run_dir)


# --- the run ------------------------------------------------------------------------------------

def run_stage(name: str, sizes: Sizes, args: argparse.Namespace) -> dict:
    """One stage's result, or {"error": ...}; never raises (but for KeyboardInterrupt)."""
    start = time.perf_counter()
    try:
        if name == "profile":
            result = stage_profile(sizes, args.profile_dir)
        elif name == "mesh":
            result = stage_mesh(sizes, args.out.parent)
        else:
            result = globals()[f"stage_{name}"](sizes)
    except Exception as err:  # noqa: BLE001 -- one stage's failure is a result; the next runs
        result = {"error": error_text(err), "traceback": traceback.format_exc()[-3000:]}
    return result | {"elapsed_s": time.perf_counter() - start}


def default_out(env: dict, smoke: bool) -> Path:
    device = "cpu-smoke" if smoke else re.sub(r"[^a-z0-9]+", "-", env.get("device_kind", "unknown").lower()).strip("-")
    return RESULTS / (f"gpu-{device}.json" if smoke else f"gpu-{device}-{time.strftime('%Y%m%d')}.json")


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    os.environ["XLA_FLAGS"] = with_flags(os.environ.get("XLA_FLAGS", ""))  # meshtrain's, as train.py sets them
    if args.cpu_smoke:
        os.environ["JAX_PLATFORMS"] = "cpu"  # before jax is imported
    import jax

    check_backend()
    backend = jax.default_backend()
    if backend != "gpu" and not args.cpu_smoke:
        print(f"gpu-check: no GPU found (jax backend is {backend}); nothing to measure (--cpu-smoke runs it on CPU)")
        return 0
    sizes = dataclasses.replace(SMOKE if args.cpu_smoke else GPU, cores=args.cores)
    if args.fp32_lengths is not None:
        sizes = dataclasses.replace(sizes, check_fp32_lengths=tuple(args.fp32_lengths))
    start = time.perf_counter()
    stages = ["environment"] + [s for s in args.stages if s != "environment"]  # the report's name needs it
    report = run_record("bench.gpu", argv) | {"smoke": args.cpu_smoke}
    if args.cpu_smoke:
        report["note"] = ("CPU smoke run (--cpu-smoke): tiny shapes, pallas interpreted, no cudnn; "
                          "proves the script works, its figures mean nothing about any GPU")
    report |= {"sizes": dataclasses.asdict(sizes), "stages": {}}
    out = args.out
    for name in stages:
        print(f"[{time.perf_counter() - start:6.1f} s] {name} ...", flush=True)
        if name == "profile" and args.profile_dir is None:
            args.profile_dir = Path("runs") / f"{out.stem}-profile"
        elapsed = time.perf_counter() - start
        if elapsed > args.budget:
            result = {"skipped": f"{elapsed:.0f} s elapsed, over the --budget of {args.budget:.0f} s", "elapsed_s": 0.0}
        else:
            result = run_stage(name, sizes, args)
        report["stages"][name] = result
        out = args.out = out or default_out(result, args.cpu_smoke)
        write_report(report, out, announce=False)
        print(f"[{time.perf_counter() - start:6.1f} s] {name} done in {result['elapsed_s']:.1f} s", flush=True)
        try:
            print("\n".join(summary_lines(name, result)), flush=True)
        except (KeyError, TypeError, ValueError) as err:  # a table bug must not stop the stages
            print(f"    (no table: {error_text(err)}; see {out})")
    if backend == "gpu" and {"ceilings", "attention", "training"} <= set(stages):
        report["estimate"] = estimate_rows(out)
        write_report(report, out, announce=False)
    print(f"wrote {out} ({time.perf_counter() - start:.0f} s)")
    return 0


def estimate_rows(out: Path) -> dict:
    """The planner's estimate of each training case and mesh strategy at this record's measured
    rates, beside the measured step (tools.calibration.estimate_vs_measured; the target is within 15%), printed."""
    try:
        rows = estimate_vs_measured(out)
    except (ConfigError, KeyError, TypeError, ValueError) as err:  # a stage that failed leaves no rates
        print(f"    estimate vs measured: none ({error_text(err)})")
        return {"error": error_text(err)}
    for r in rows:
        print(f"    estimate {r['preset']:<5} remat {r['remat']:<4}{'' if r['scan_layers'] else ' unrolled'} "
              f"{r['mesh']:<12}{r['estimate_s'] * 1e3:8.1f} ms vs measured "
              f"{r['measured_s'] * 1e3:8.1f} ms: {r['ratio']:.2f}x")
    return {"note": "tools.roofline at this record's measured rates (tools/calibration.py); target within 15%",
            "rows": rows}


if __name__ == "__main__":
    run_cli(main)
