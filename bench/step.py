"""Benchmark the train step: compile time, step time, throughput, memory; compile time vs depth.

  python -m bench.step --config tiny --mesh dp=2,tp=2
  python -m bench.step --config 125m --mesh fsdp=8 --set train.global_batch_size=32 --steps 20
  python -m bench.step --config tiny --compile-layers 2,8,32 --out bench/results/scan.json

Throughput: the job is built as train.py builds it (`training.build.build`); the step is lowered
and compiled ahead of time (lower and compile timed separately), run once (the first step), then
run --steps more times, each waited for with `jax.block_until_ready`. Step times exclude the
host's batch assembly (each batch is made and waited for before its step's clock starts). The
report gives the median step time, tokens/s, TFLOP/s per device and MFU (model FLOPs,
`training.metrics`), the peak device memory (None where the backend does not report it, e.g.
CPU) and XLA's static memory analysis of the compiled step (per device; works on CPU).

Compile scaling (--compile-layers): the same step for each model.n_layers, lowered and compiled
on abstract inputs (nothing allocated, so large presets work), timed wall clock. Layers are one
`lax.scan`, so the time should stay nearly flat; the ratio largest/smallest says how flat.

The persistent compilation cache is switched off so that every compile is timed from scratch.
On CPU (fake host devices sharing a few cores) absolute times say nothing about a GPU: compare
only ratios within one run.
"""

from __future__ import annotations

import argparse
import os
import statistics
from typing import TYPE_CHECKING

from bench.common import attempt, bench_mesh, default_out, failures, report_head
from cli import add_run_args, request_fake_devices, run_cli, run_config
from configs import ConfigError, RunConfig, apply_overrides
from configs.parser import Parser
from tools.measure import check_at_least, check_out, file_path, timed, write_report

if TYPE_CHECKING:
    import jax


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = Parser(__doc__)
    add_run_args(p)
    p.add_argument("--steps", type=int, default=10, help="timed steps after the first (default 10)")
    p.add_argument("--compile-layers", default="", metavar="X,X,...",
                   help="also time lower+compile for these model.n_layers, e.g. 2,8,32")
    p.add_argument("--out", type=file_path, help="JSON report (default bench/results/step-<config>-<mesh>.json)")
    args = p.parse_args(argv)
    check_out(args.out)
    return args


def resolve(args: argparse.Namespace) -> tuple[RunConfig, list[int]]:
    """The run config (before the mesh is built) and the layer counts to compile."""
    check_at_least(args, 1, "--steps")
    cfg = run_config(args)
    try:
        layers = sorted({int(x) for x in args.compile_layers.split(",") if x.strip()})
    except ValueError:
        raise ConfigError(f"--compile-layers {args.compile_layers!r}: expected integers, e.g. 2,8,32") from None
    if layers and layers[0] < 1:
        raise ConfigError(f"--compile-layers {args.compile_layers!r}: layer counts must be positive")
    for n in layers:  # each count against the mesh's rules now, not after the throughput run
        try:
            run_config(args, [f"model.n_layers={n}"])
        except ConfigError as e:
            raise ConfigError(f"--compile-layers {args.compile_layers}: {n} layers on this run: {e}") from None
    return cfg, layers


def measure_steps(cfg: RunConfig, mesh: jax.sharding.Mesh, steps: int, compiler_options: dict | None = None,
                  census: bool = False) -> dict:
    """Compile, first step and `steps` timed steps of the real job (`compiler_options`: XLA options
    for this compile, training.build.compile_step); `census`: also the compiled step's collectives
    (tools.hlo.compiled_census, under "census")."""
    import jax

    from tools.hlo import compiled_census
    from training.build import build, compile_step, xla_memory
    from training.metrics import peak_memory_bytes, step_figures

    job = build(cfg, mesh)
    k, b, length = job.batches.shape
    with jax.set_mesh(mesh):
        batch = jax.block_until_ready(job.batches(0))
        compiled, lower_s, compile_s = compile_step(job.step_fn, mesh, job.state, batch, compiler_options)
        (state, metrics), first_run_s = timed(compiled, job.state, batch)  # donates job.state
        first_loss, times = float(metrics["loss"]), []
        for step in range(1, steps + 1):
            batch = jax.block_until_ready(job.batches(step))
            (state, metrics), seconds = timed(compiled, state, batch)
            times.append(seconds)
    median = statistics.median(times)
    peaks = [peak_memory_bytes(d) for d in mesh.devices.flat if d.process_index == jax.process_index()]
    return {
        "n_params": job.n_params,
        "batch_shape": [k, b, length],
        "tokens_per_step": k * b * length,
        "lower_s": lower_s,
        "compile_s": compile_s,
        "first_step_run_s": first_run_s,
        "steps_timed": steps,
        "step_time_median_s": median,
        "step_time_min_s": min(times),
        "step_time_max_s": max(times),
        "step_times_s": times,
        **step_figures(cfg.model, length, k * b * length, median, mesh.size, mesh.devices.flat[0]),
        "peak_memory_bytes_per_device": max((p for p in peaks if p is not None), default=None),
        "memory_analysis": xla_memory(compiled),
        "loss_first": first_loss,
        "loss_last": float(metrics["loss"]),
    } | ({"census": compiled_census(compiled, cfg, mesh)} if census else {})


def compile_scaling(cfg: RunConfig, mesh: jax.sharding.Mesh, layers: list[int]) -> dict:
    """Lower + compile wall clock of the step for each model.n_layers in `layers` (nothing allocated)."""
    from training.build import make_program, compile_step

    def one(n: int) -> dict:
        program = make_program(apply_overrides(cfg, [f"model.n_layers={n}"]), mesh)
        _, lower_s, compile_s = compile_step(program.step_fn, mesh, program.state, program.abstract_batch())
        return {"lower_s": lower_s, "compile_s": compile_s, "total_s": lower_s + compile_s}

    rows = [{"n_layers": n, **attempt(one, n)} for n in layers]
    done = [r for r in rows if "error" not in r]
    ratio = done[-1]["total_s"] / done[0]["total_s"] if len(done) > 1 else None
    return {"rows": rows, "ratio_largest_to_smallest": ratio}


def _seconds(s: float | None) -> str:
    return "n/a" if s is None else f"{s * 1e3:.2f} ms" if s < 1 else f"{s:.2f} s"


def _bytes(n: int | None) -> str:
    return "n/a" if n is None else f"{n / 2**20:.1f} MiB"


def print_report(report: dict) -> None:
    env, t = report["environment"], report["throughput"]
    if "error" in t:
        print(f"  step: {t['error']}")
    else:
        print_throughput(report["config"]["name"], report["mesh"], env, t)
    scaling = report.get("compile_scaling")
    if scaling:
        print(f"\n  {'n_layers':>8}  {'lower':>10}  {'compile':>10}  {'total':>10}")
        for r in scaling["rows"]:
            print(f"  {r['n_layers']:>8}  " + (r["error"] if "error" in r else f"{_seconds(r['lower_s']):>10}  "
                  f"{_seconds(r['compile_s']):>10}  {_seconds(r['total_s']):>10}"))
        if scaling["ratio_largest_to_smallest"] is not None:
            done = [r["n_layers"] for r in scaling["rows"] if "error" not in r]
            first, last = done[0], done[-1]
            print(f"  compile({last}) / compile({first}) = {scaling['ratio_largest_to_smallest']:.2f}")


def print_throughput(config: str, mesh: str, env: dict, t: dict) -> None:
    mfu = "n/a" if t["mfu"] is None else f"{100 * t['mfu']:.1f} %"
    mem = t["memory_analysis"] or {}
    rows = [
        ("config", f"{config}: {t['n_params'] / 1e6:.2f}M parameters"),
        ("mesh", f"{mesh} on {env['mesh_devices']} {env['backend']} device(s) ({env['device_kind']})"),
        ("batch k x b x L", " x ".join(map(str, t["batch_shape"])) + f" = {t['tokens_per_step']} tokens"),
        ("lower", _seconds(t["lower_s"])),
        ("compile", _seconds(t["compile_s"])),
        ("first step (run)", _seconds(t["first_step_run_s"])),
        (f"step, median of {t['steps_timed']}",
         f"{_seconds(t['step_time_median_s'])} (min {_seconds(t['step_time_min_s'])}, "
         f"max {_seconds(t['step_time_max_s'])})"),
        ("tokens/s", f"{t['tokens_per_s']:,.0f}"),
        ("TFLOP/s per device", f"{t['tflops_per_device']:.4g}"),
        ("MFU", mfu),
        ("peak memory / device", _bytes(t["peak_memory_bytes_per_device"])),
        ("XLA arguments / device", _bytes(mem.get("argument"))),
        ("XLA outputs / device", _bytes(mem.get("output"))),
        ("XLA aliased / device", _bytes(mem.get("alias"))),
        ("XLA temp / device", _bytes(mem.get("temp"))),
        ("XLA args+out-alias+temp", _bytes(mem.get("static_peak"))),
        ("loss first -> last", f"{t['loss_first']:.4f} -> {t['loss_last']:.4f}"),
    ]
    width = max(len(name) for name, _ in rows)
    print("\n".join(f"  {name:<{width}}  {value}" for name, value in rows))


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    cfg, layers = resolve(args)
    os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)  # time every compile from scratch
    fake = request_fake_devices(cfg)

    import jax  # noqa: E402 -- after XLA_FLAGS is final

    jax.config.update("jax_enable_compilation_cache", False)
    mesh, mesh_text, cfg = bench_mesh(cfg, fake)

    report = report_head("bench.step", argv, cfg, mesh, mesh_text)
    report["throughput"] = attempt(measure_steps, cfg, mesh, args.steps)
    if layers:
        report["compile_scaling"] = compile_scaling(cfg, mesh, layers)
    print_report(report)
    out = args.out or default_out("step", cfg, mesh_text)
    write_report(report, out)
    return failures([report["throughput"], *report.get("compile_scaling", {}).get("rows", [])], out)


if __name__ == "__main__":
    run_cli(main)
