"""`make gpu-check`: one command that says what this NVIDIA GPU machine does with meshtrain.

  python -m bench.gpu                      # GPU: all stages, budgeted at 8 minutes on one H100
  python -m bench.gpu --stages ceilings,attention --out /tmp/g.json
  python -m bench.gpu --cpu-smoke          # CPU: the same pipeline at tiny shapes (a test)

Stages, in order (GPU shapes; --cpu-smoke shrinks every shape, see SMOKE):
  environment  device name/count, driver/CUDA/cuDNN as jax reports them, jax/jaxlib/flax
               versions, XLA/JAX/NCCL/CUDA env vars, jax.print_environment_info()   (~5 s)
  ceilings     bf16 8192^3 matmul TFLOP/s, and a 1 GiB fp32 `x + 1` pass as the copy
               bandwidth (GB/s, read + write counted); both as fractions of the datasheet
               peak (training/metrics.py)                                         (~15 s)
  correctness  pallas and cudnn cores against the xla core, out and dq/dk/dv, causal GQA
               (N=8, K=2, H=128): bf16 at L = 1024, 4096 and a ragged 1500, fp32 at 1500,
               with the tolerances of tests/test_flash_attention.py; fp32 runs under
               jax.default_matmul_precision('highest') so TF32 does not stand in for fp32
               (cuDNN's fused attention takes fp16/bf16 only: its fp32 cases are 'n/a').
               Pallas in fp32 at that precision compiles for about 2 minutes on an H100
               (measured: 115-124 s at each L), hence one fp32 length. Then one train step
               of the tiny preset per core, loss against xla's                    (~3 min)
  attention    bench/attention.py `measure` for pallas, cudnn, xla at H=128, N=32, K=8,
               L = 2k, 4k, 8k, causal, bf16: forward and forward+backward TFLOP/s (causal
               FLOPs halved), also as fractions of the matmul ceiling and the peak   (~50 s)
  training     bench/step.py `measure_steps` for 125m and 1b (model.attention=auto: the
               core it takes is recorded, cudnn on an H100), remat full,
               dots, then none, dp over every GPU: tokens/s, TFLOP/s per device, MFU, peak
               memory; an out-of-memory case is recorded as "oom" and the run goes on (~70 s);
               then 1b under none with model.scan_layers=false (the layers unrolled: no stacks
               of activations, model/transformer.py), not yet timed on a GPU
  flags        XLA options on and off, each compiled for the same training case in this process
               (compile options over XLA_FLAGS): 1b under remat none with
               xla_gpu_enable_dynamic_slice_fusion (XLA's default from jax 0.11: GEMMs write into
               the layer scan's stacks; on in the H100 record, whose 1b profile under none still
               spent 96 ms of a step in memcpy and 32 ms in dynamic-update-slice, against 12 and
               0 under full); step time off / on (not yet timed on a GPU)
  profile      three steps of 1b with steps 2..3 traced (training/profiling.py), summed by
               tools/trace_summary.py (scopes) and tools/op_kinds.py (op kinds): top ops, and the
               fractions in attention kernels, matmuls, collectives, copies, elementwise/other;
               a kernel run inside a CUDA graph is kinded by its name (trace_summary) (~15 s);
               1b's default remat is none: profiled with the layer scan, then unrolled
               (model.scan_layers=false), so the two copy fractions sit side by side

Stage times above were measured on one H100 (2026-11-24, bench/results/gpu-h100-*.json). The
--budget (default 480 s) is checked before each stage: a stage that would start after it is
recorded as skipped.
Each stage runs inside try/except: an error is recorded as {"error": ...} under its name and
the next stage runs; the JSON is rewritten after every stage, so a run cut short keeps what it
measured. Timing: compile and run once, then the median of several timed runs, each waited
for with jax.block_until_ready. All stages share one process, so `peak_memory_bytes_per_device`
(memory_stats) is the process's peak so far: training cases run smallest first, and XLA's
static memory analysis of each step is recorded beside it.

On a GPU, with the ceilings, attention and training stages run, the record then holds
`estimate`: each training case's step time as tools/roofline.py plans it at this record's own
measured rates, beside the measured one (tools/calibration.py; tests/test_calibration.py holds
them within 15% once a GPU record is committed).

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

from bench import gpu_training
from bench.common import error_text
from bench.gpu_correctness import correctness
from cli import run_cli
from configs import ConfigError
from sharding.xla_flags import with_flags
from tools.calibration import estimate_vs_measured
from tools.measure import RESULTS, check_at_least, check_out, environment, median_seconds, run_record, write_report

STAGES = ("environment", "ceilings", "correctness", "attention", "training", "flags", "profile")
CORES = ("pallas", "cudnn", "xla")
ENV_PREFIXES = ("XLA_", "JAX_", "NCCL_", "CUDA_", "TF_", "NVIDIA_")


@dataclasses.dataclass(frozen=True)
class Sizes:
    """Every shape the stages use; GPU and SMOKE below."""

    matmul_n: int
    copy_bytes: int
    timed_runs: int
    check_lengths: tuple[int, ...]  # bf16
    check_fp32_lengths: tuple[int, ...]
    check_heads: tuple[int, int, int]  # N, K, H
    tiny_sets: tuple[str, ...]  # overrides of the tiny preset for the per-core train step
    bench_lengths: tuple[int, ...]
    bench_heads: tuple[int, int, int]  # N, K, H
    bench_tokens: int
    train_cases: tuple[tuple[str, str, tuple[str, ...]], ...]  # (preset, remat, overrides)
    train_steps: int
    flag_cases: tuple[tuple[str, str, tuple[str, ...], str], ...]  # (preset, remat, overrides, XLA option)
    profile_cases: tuple[tuple[str, tuple[str, ...]], ...]  # (preset, overrides)


def _batch(micro: int, accum: int, seq: int) -> tuple[str, ...]:
    """Overrides for `micro` sequences per device per microbatch, `accum` microbatches, weak
    scaling over the devices (the global batch is filled in per device count, see `case_config`)."""
    return (f"train.micro_batch_size={micro}", f"train.global_batch_size={micro * accum}",
            f"train.seq_len={seq}", "data.source=synthetic")


GPU = Sizes(
    matmul_n=8192, copy_bytes=2**30, timed_runs=10,
    check_lengths=(1024, 4096, 1500), check_fp32_lengths=(1500,), check_heads=(8, 2, 128), tiny_sets=(),
    bench_lengths=(2048, 4096, 8192), bench_heads=(32, 8, 128), bench_tokens=16384,
    train_cases=tuple((preset, remat, batch)
                      for preset, batch in (("125m", _batch(16, 2, 1024)), ("1b", _batch(8, 2, 2048)))
                      for remat in ("full", "dots", "none"))
    + (("1b", "none", _batch(8, 2, 2048) + ("model.scan_layers=false",)),),
    train_steps=5,
    flag_cases=(("1b", "none", _batch(8, 2, 2048), "xla_gpu_enable_dynamic_slice_fusion"),),
    profile_cases=(("1b", _batch(8, 2, 2048)), ("1b", _batch(8, 2, 2048) + ("model.scan_layers=false",))),
)
_TINY = ("model.n_layers=2", "train.seq_len=64", "train.global_batch_size=8")
SMOKE = Sizes(
    matmul_n=256, copy_bytes=2**22, timed_runs=3,
    check_lengths=(128, 100), check_fp32_lengths=(128, 100), check_heads=(4, 2, 32), tiny_sets=_TINY,
    bench_lengths=(128,), bench_heads=(4, 2, 32), bench_tokens=256,
    train_cases=(("tiny", "full", _TINY + _batch(4, 2, 64)), ("tiny", "none", _TINY + _batch(4, 2, 64))),
    train_steps=2,
    flag_cases=(("tiny", "none", _TINY + _batch(4, 2, 64), "xla_gpu_enable_dynamic_slice_fusion"),),
    profile_cases=(("tiny", _TINY + _batch(4, 2, 64)),),
)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated, of {','.join(STAGES)}")
    p.add_argument("--out", type=Path, help="JSON report (default bench/results/gpu-<device>-<date>.json)")
    p.add_argument("--profile-dir", type=Path,
                   help="where the profile stage's run goes (default runs/<out stem>-profile)")
    p.add_argument("--budget", type=float, default=480, help="seconds; later stages are skipped (default 480)")
    p.add_argument("--cpu-smoke", action="store_true", help="run every stage on CPU at tiny shapes (proves the script)")
    args = p.parse_args(argv)
    args.stages = [s for s in args.stages.split(",") if s]
    if not args.stages or set(args.stages) - set(STAGES):
        raise ConfigError(f"--stages {','.join(args.stages)!r}: choose from {','.join(STAGES)}")
    check_at_least(args, 1, "--budget")
    check_out(args.out)
    return args


# --- stage 1: environment -----------------------------------------------------------------------

def _try(fn):
    try:
        return fn()
    except Exception as err:  # noqa: BLE001 -- a missing piece is reported, never fatal
        return f"unavailable: {error_text(err)}"


def cuda_versions() -> dict:
    """CUDA runtime/driver and cuDNN versions as jaxlib reports them (None off CUDA builds)."""
    from jax._src import lib

    cv = getattr(lib, "cuda_versions", None)
    if cv is None:
        return {"cuda": "unavailable: jaxlib has no CUDA plugin loaded"}
    names = ("cuda_runtime_get_version", "cuda_driver_get_version", "cudnn_get_version",
             "cufft_get_version", "cusolver_get_version", "cublas_get_version", "cusparse_get_version")
    return {n.removesuffix("_get_version"): _try(getattr(cv, n)) if hasattr(cv, n) else "unavailable"
            for n in names}


def stage_environment(sizes: Sizes) -> dict:
    import jax

    from training.metrics import peak_flops

    device = jax.devices()[0]
    peak = peak_flops(device)
    return environment(jax.devices()) | {
        "devices": [str(d) for d in jax.devices()],
        "compute_capability": getattr(device, "compute_capability", None),
        "datasheet_bf16_tflops": peak / 1e12 if peak else None,
        "cuda_versions": cuda_versions(),
        "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith(ENV_PREFIXES)},
        "jax_environment_info": _try(lambda: jax.print_environment_info(return_string=True)),
    }


# --- stage 2: ceilings --------------------------------------------------------------------------

def stage_ceilings(sizes: Sizes) -> dict:
    import jax
    import jax.numpy as jnp

    from training.metrics import peak_flops

    n = sizes.matmul_n
    a, b = (jax.random.normal(k, (n, n), jnp.float32).astype(jnp.bfloat16) for k in jax.random.split(jax.random.key(0)))
    matmul = jax.jit(jnp.matmul).lower(a, b).compile()
    matmul_s = median_seconds(matmul, (a, b), sizes.timed_runs, inner=10)
    x = jnp.zeros(sizes.copy_bytes // 4, jnp.float32)
    copy_s = median_seconds(jax.jit(lambda x: x + 1), (x,), sizes.timed_runs, inner=10)
    tflops, peak = 2 * n**3 / matmul_s / 1e12, peak_flops(jax.devices()[0])
    hlo = matmul.as_text()
    target = re.search(r'custom_call_target="([^"]+)"', hlo)
    return {
        "matmul": f"bf16 [{n},{n}] @ [{n},{n}], 2*n^3 FLOPs, random normal data",
        "matmul_kernel": target.group(1) if target else ("triton gemm" if "triton_gemm" in hlo else "xla fusion"),
        "matmul_ms": matmul_s * 1e3, "matmul_tflops": tflops,
        "matmul_fraction_of_peak": tflops * 1e12 / peak if peak else None,
        "copy": f"fp32 x + 1 over {sizes.copy_bytes} bytes: read + write counted",
        "copy_ms": copy_s * 1e3, "copy_gbps": 2 * sizes.copy_bytes / copy_s / 1e9,
    }


# --- stage 3: correctness (bench/gpu_correctness.py) ---------------------------------------------

def stage_correctness(sizes: Sizes) -> dict:
    return correctness(sizes.check_lengths, sizes.check_fp32_lengths, sizes.check_heads, sizes.tiny_sets)


# --- stage 4: attention speed -------------------------------------------------------------------

def stage_attention(sizes: Sizes) -> dict:
    import jax

    from bench.attention import core_fn, measure
    from training.metrics import peak_flops

    n, kv, h = sizes.bench_heads
    ns = argparse.Namespace(tokens=sizes.bench_tokens, heads=n, kv_heads=kv, dtype="bfloat16", steps=sizes.timed_runs)
    peak, rows = peak_flops(jax.devices()[0]), []
    for length in sizes.bench_lengths:
        for core in CORES:
            if core == "cudnn" and jax.default_backend() != "gpu":
                rows.append({"core": core, "causal": True, "length": length, "head_dim": h,
                             "status": "unavailable on cpu"})
                continue
            row = measure(core, lambda c=core: core_fn(c, True), True, length, h, ns)
            if peak and "forward_tflops" in row:
                row["forward_fraction_of_peak"] = row["forward_tflops"] * 1e12 / peak
                row["forward_backward_fraction_of_peak"] = row["forward_backward_tflops"] * 1e12 / peak
            rows.append(row)
    return {"flops": "forward 4*B*N*L^2*H halved (causal); forward+backward 3.5x forward", "rows": rows}


# --- stages 5-7: training speed, XLA options on and off, profile (bench/gpu_training.py) ---------

def stage_training(sizes: Sizes) -> dict:
    return gpu_training.training(sizes.train_cases, sizes.train_steps)


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
        else:
            result = globals()[f"stage_{name}"](sizes)
    except Exception as err:  # noqa: BLE001 -- one stage's failure is a result; the next runs
        result = {"error": error_text(err), "traceback": traceback.format_exc()[-3000:]}
    return result | {"elapsed_s": time.perf_counter() - start}


def summary_lines(name: str, r: dict) -> list[str]:
    """The short printed table of one stage."""
    if "error" in r or "skipped" in r:
        return [f"    error: {r['error']}" if "error" in r else f"    skipped: {r['skipped']}"]
    if name == "environment":
        return [f"    {r['device_count']} x {r['device_kind']} ({r['backend']}), jax {r['versions']['jax']}, "
                f"cuda {r['cuda_versions']}"]
    if name == "ceilings":
        frac = r["matmul_fraction_of_peak"]
        return [f"    matmul {r['matmul_tflops']:.4g} TFLOP/s" + (f" ({100 * frac:.0f}% of peak)" if frac else "")
                + f", copy {r['copy_gbps']:.4g} GB/s"]
    if name == "correctness":
        lines = [f"    {c['core']:<7}{c['dtype']:<9}L={c['length']:<6}" + (
            f"{c['status']:<5} max err {max(c['errors'].values()):.2e} (tol {c['tolerance']:g})"
            if "errors" in c else c["status"] + (f" {c['error']}" if "error" in c else "")) for c in r["cases"]]
        lines += [f"    step {s['core']:<7}" + (f"loss {s['loss']:.4f} {s['status']}" if "loss" in s else s["status"])
                  for s in r["train_step"]]
        return lines + [f"    verdict: {r['verdict']}"]
    if name == "attention":
        return [f"    {x['core']:<7}L={x['length']:<6}" + (
            f"fwd {x['forward_tflops']:8.4g}  fwd+bwd {x['forward_backward_tflops']:8.4g} TFLOP/s"
            if "forward_tflops" in x else x.get("status") or x.get("error", "")) for x in r["rows"]]
    if name == "training":
        return [f"    {x['preset']:<5}remat={x['remat']:<5}" + "".join(
            f"{o.split('=')[0].split('.')[-1]}={o.split('=')[1]} " for o in x["overrides"] if o.startswith("model.")) + (
            f"{x['tokens_per_s']:>12,.0f} tok/s {x['tflops_per_device']:8.4g} TFLOP/s/dev"
            + (f" MFU {100 * x['mfu']:.1f}%" if x["mfu"] else "")
            + (f" peak {x['peak_memory_bytes_per_device'] / 2**30:.1f} GiB"
               if x["peak_memory_bytes_per_device"] else "")
            if x["status"] == "ok" else f"{x['status']}: {x['error']}") for x in r["rows"]]
    if name == "flags":
        return [f"    {x['preset']:<5}remat={x['remat']:<5}{x['option']}: " + (
            f"off / on {x['ratio_off_to_on']:.3f} ({x['off']['step_time_median_s'] * 1e3:.1f} ms vs "
            f"{x['on']['step_time_median_s'] * 1e3:.1f} ms)" if "ratio_off_to_on" in x
            else f"on {x['on']['status']}, off {x['off']['status']}") for x in r["rows"]]
    if name == "profile":
        return [line for c in r["cases"] for line in (
            [f"    {c['preset']} remat={c['remat']}{'' if c['scan_layers'] else ' unrolled'}: {c['ops']['total_ms']:.1f} ms"]
            + [f"      {k:<18}{100 * v:5.1f}%" for k, v in sorted(c["ops"]["fractions"].items(), key=lambda kv: -kv[1])])]
    return []


def default_out(env: dict, smoke: bool) -> Path:
    device = "cpu-smoke" if smoke else re.sub(r"[^a-z0-9]+", "-", env.get("device_kind", "unknown").lower()).strip("-")
    return RESULTS / (f"gpu-{device}.json" if smoke else f"gpu-{device}-{time.strftime('%Y%m%d')}.json")


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    os.environ["XLA_FLAGS"] = with_flags(os.environ.get("XLA_FLAGS", ""))  # meshtrain's, as train.py sets them
    if args.cpu_smoke:
        os.environ["JAX_PLATFORMS"] = "cpu"  # before jax is imported
    import jax

    backend = jax.default_backend()
    if backend != "gpu" and not args.cpu_smoke:
        print(f"gpu-check: no GPU found (jax backend is {backend}); nothing to measure (--cpu-smoke runs it on CPU)")
        return 0
    sizes, start = (SMOKE if args.cpu_smoke else GPU), time.perf_counter()
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
        out = out or default_out(result, args.cpu_smoke)
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
    """The planner's estimate of each training case at this record's measured rates, beside the
    measured step (tools.calibration.estimate_vs_measured; the target is within 15%), printed."""
    try:
        rows = estimate_vs_measured(out)
    except (ConfigError, KeyError, TypeError, ValueError) as err:  # a stage that failed leaves no rates
        print(f"    estimate vs measured: none ({error_text(err)})")
        return {"error": error_text(err)}
    for r in rows:
        print(f"    estimate {r['preset']:<5} remat {r['remat']:<4}{'' if r['scan_layers'] else ' unrolled'}  "
              f"{r['estimate_s'] * 1e3:8.1f} ms vs measured "
              f"{r['measured_s'] * 1e3:8.1f} ms: {r['ratio']:.2f}x")
    return {"note": "tools.roofline at this record's measured rates (tools/calibration.py); target within 15%",
            "rows": rows}


if __name__ == "__main__":
    run_cli(main)
