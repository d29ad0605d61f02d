"""Pipeline schedules side by side: step time, XLA temp memory and the timetable's bubble.

  python -m bench.pipeline                          tiny preset, pp=4, M = 4 and 8, 3 steps
  python -m bench.pipeline --mesh pp=2,dp=2 --microbatches 2,4 --steps 2 --set model.d_model=64

For each schedule (gpipe, interleaved with V=2, 1f1b) and each M, on the --mesh (default pp=4;
its stage axis p must be given, 2 or more): the preset with p·2 layers and microbatches of 2
sequences (a global batch of 2·M, so the batch grows with M), then --set on top; compiled ahead
of time, run once, then `--steps` timed steps (median). Every case is checked before jax starts
(a bad one is one `error:` line). Writes bench/results/pipeline-<config>-<mesh>.json.
Fake CPU devices share the machine's cores: the step times compare the schedules' work on this
machine, not a GPU pipeline's overlap.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
from pathlib import Path
from typing import TYPE_CHECKING

from bench.common import bench_mesh, default_out, report_head
from cli import add_run_args, request_fake_devices, run_cli, run_config
from configs import ConfigError, RunConfig, apply_overrides, get_preset
from sharding.mesh import mesh_config, parse_mesh
from tools.measure import timed, write_report

if TYPE_CHECKING:
    import jax

SCHEDULES = {"gpipe": [], "interleaved": ["parallel.virtual_stages=2"], "1f1b": []}


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_args(p)
    p.set_defaults(mesh="pp=4")
    p.add_argument("--microbatches", default="4,8", metavar="M,M,...", help="microbatch counts (default 4,8)")
    p.add_argument("--steps", type=int, default=3, help="timed steps after the first (default 3)")
    p.add_argument("--out", type=Path, help="JSON report (default bench/results/pipeline-<config>-<mesh>.json)")
    return p.parse_args(argv)


def cases(args: argparse.Namespace) -> list[RunConfig]:
    """The checked config of every schedule and M; refuses bad flags before jax."""
    if args.steps < 1:
        raise ConfigError(f"--steps {args.steps}: time at least one step")
    try:
        ms = [int(m) for m in args.microbatches.split(",") if m.strip()]
    except ValueError:
        raise ConfigError(f"--microbatches {args.microbatches!r}: expected integers, e.g. 4,8") from None
    if not ms:
        raise ConfigError(f"--microbatches {args.microbatches!r}: name at least one count, e.g. 4,8")
    stages = parse_mesh(args.mesh).stage
    if stages < 2:
        raise ConfigError(f"--mesh {args.mesh}: the schedules need a stage axis of 2 or more, e.g. --mesh pp=4")
    preset = get_preset(args.config or "tiny")
    return [run_config(args, base=apply_overrides(preset, [
        f"model.n_layers={2 * stages}", f"parallel.schedule={schedule}", f"parallel.microbatches={m}",
        f"train.global_batch_size={2 * m}", *extra]))
        for schedule, extra in SCHEDULES.items() for m in ms]


def measure(cfg: RunConfig, mesh: jax.sharding.Mesh, steps: int) -> dict:
    """Compile one case, run it once, then time `steps` steps on the same batch."""
    import jax

    from pipeline.schedule import bubble, timetable
    from sharding.checks import microbatches
    from training.build import build, compile_step, xla_memory

    job = build(cfg, mesh)
    with jax.set_mesh(mesh):
        batch = job.batches(0)
        compiled, _, compile_s = compile_step(job.step_fn, mesh, job.state, batch)
        (state, _), _ = timed(compiled, job.state, batch)  # donates job.state
        times = []
        for _ in range(steps):
            (state, _), seconds = timed(compiled, state, batch)
            times.append(seconds)
    par = cfg.parallel
    m = microbatches(cfg, par.stage)
    return {"schedule": par.schedule, "stages": par.stage, "microbatches": m, "virtual_stages": par.virtual_stages,
            "bubble": bubble(timetable(par.schedule, par.stage, m, par.virtual_stages)),
            "compile_s": compile_s, "step_s_median": statistics.median(times),
            "temp_bytes": xla_memory(compiled)["temp"]}


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    todo = cases(args)
    mesh, mesh_text, _ = bench_mesh(todo[0], request_fake_devices(todo[0]))
    rows = []
    for cfg in todo:
        cfg = dataclasses.replace(cfg, parallel=mesh_config(mesh, cfg.parallel))
        row = measure(cfg, mesh, args.steps)
        rows.append(row)
        print(f"{row['schedule']:<12} M={row['microbatches']:<3} bubble {row['bubble']:.3f}  "
              f"step {row['step_s_median'] * 1e3:8.1f} ms  temp {row['temp_bytes'] / 2**20:7.2f} MiB  "
              f"compile {row['compile_s']:.1f} s", flush=True)
    report = report_head("bench.pipeline", argv, cfg, mesh, mesh_text) | {"schedules": rows}
    write_report(report, args.out or default_out("pipeline", cfg, mesh_text))
    return 0


if __name__ == "__main__":
    run_cli(main)
