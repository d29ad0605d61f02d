"""Pipeline schedules side by side: the timetable's bubble next to the measured one.

  python -m bench.pipeline                          tiny preset, pp=4, M = p, 2p, 4p, 3 steps
  python -m bench.pipeline --profile                also trace one step per case: idle per stage
  python -m bench.pipeline --mesh pp=2 --microbatches 2,4 --steps 2 --set model.d_model=64

Cases: each schedule of `SCHEDULES` (gpipe, interleaved V=2, 1f1b, interleaved-1f1b V=2, zb-h1, zbv; one
line each; --schedules picks some) and each M of --microbatches (default p,2p,4p, resolved from the --mesh,
whose stage axis p must be 2 or more), on the --mesh (default pp=4): the preset with p·2 layers
and microbatches of 2 sequences (a global batch of 2·M), then --set on top. Every case is
checked before jax starts (a bad one is one `error:` line).

Per case, compiled ahead of time, run once, then `--steps` timed steps (median, `step_s`;
`step_cpu_s` the process's CPU time over the step, all threads):
  bubble           the timetable's idle cells (pipeline.tables.bubble); ticks its length
  lockstep_bubble  the timetable weighted by cell cost (F 1, B 2, split B = W = 1, and the
  async_bubble     head's cells: tools.pipeline_figures.cell_costs, as the planner weighs them;
                   pipeline.schedule.weighted): lock-step = what this SPMD tick program
                   pays, asynchronous = stages running free
  one_device_s     the reference: the same work (model, global batch, the same M microbatches
                   as gradient accumulation, train.micro_batch_size = batch/M) on a mesh of ONE
                   device, measured in the same run, once per M (rows of `one_device`)
  ideal_s          one_device_s / n (n = the mesh's devices; p on a pp-only mesh)
  measured_bubble  1 - ideal_s / step_s: on n accelerators of their own, the fraction of the
                   step lost to the bubble plus every pipeline overhead (transfers, re-layout,
                   idle cells that compute on zeros, the outputs dealt to the heads)
  measured_bubble_min  the same from the fastest step of each (step_min_s): the least disturbed
                   by other processes on a shared machine
  work_ratio       step_s / one_device_s; cpu_work_ratio the same in CPU time;
                   step_per_tick_s = step_s / ticks
  compile_s, temp_bytes   XLA's compile time and temporaries per device
  profile          with --profile, from a jax.profiler trace of one more step
                   (tools/trace_summary.stage_idle), per stage: `idle`, the fraction of the step
                   it runs none of its own compute ops, and `waiting`, the part of it spent in
                   collectives (the ticks' collective-permutes, the gradient all-reduces)

What the figures mean on fake CPU devices (XLA_FLAGS host platform device count). The n
"devices" are threads of one process on the host's `cores`, shared with whatever else runs.
The bench runs every XLA op on one thread (ONE_THREAD_PER_OP, unless XLA_FLAGS sets it), so the
one-device reference uses one core and the devices do not fight over one intra-op pool. With
n > cores the stages cannot all run at once: a pipeline without any bubble would still take
about one_device_s · n / cores, so measured_bubble has a floor of about 1 - cores/n
(`core_floor`, 0.5 at n = 4 on 2 cores), and a lock-step tick waits for its slowest thread, which
the load of other processes stretches: on such a machine measured_bubble is an upper bound that
mixes the bubble, the core sharing and the overheads, NOT the bubble. Nor is any other figure
here: cpu_work_ratio ~ (CPU all device threads burn) / (the one-device run's), which the load
moves less, counts the work the devices execute (gpipe's and interleaved's idle cells run the
layers on zeros: about (M+p-1)/M of the layers; a 1F1B-family stage
whose cell is idle runs nothing, lax.switch) and also what the threads burn at every tick's
synchronisation and the pipeline's other overheads (tiny, seq 64, on the 2 shared cores: at pp=4
1.5 to 2.7 for every schedule and M, where the masked cells alone would give 1.2 to 1.75 for
gpipe and 1 for 1f1b; at pp=2 1f1b 1.1 to 1.2, gpipe 1.55 to 1.9, growing with M where the
masked cells would shrink: some per-tick cost grows with M there).
The profile's `idle` and `waiting` are wall-clock spans of a thread that the core sharing
stretches too; they show where a stage waits (a 1F1B-family stage with an idle cell waits in the
tick's collective-permute; gpipe's masked cells count as compute). With n devices of their own
(GPUs, or n <= cores on an otherwise idle host) the timetable can be checked: measured_bubble is
then the real bubble plus the overheads.
Writes bench/results/pipeline-<config>-<mesh>.json (every row, the machine, versions, command).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time
from pathlib import Path
from typing import TYPE_CHECKING

from bench.common import attempt, bench_mesh, failures, default_out, report_head
from cli import add_run_args, check_creatable, request_fake_devices, run_cli, run_config
from configs import ConfigError, RunConfig, apply_overrides, get_preset
from configs.checks import check_values
from configs.parser import Parser
from sharding.checks import check_run
from sharding.mesh import AXES, mesh_config, parse_mesh
from tools.measure import check_at_least, check_out, file_path, timed, write_report

if TYPE_CHECKING:
    import jax

# The schedules compared, one line each: name -> --set it needs besides parallel.schedule.
SCHEDULES = {
    "gpipe": [],
    "interleaved": ["parallel.virtual_stages=2"],
    "1f1b": [],
    "interleaved-1f1b": ["parallel.virtual_stages=2"],
    "zb-h1": [],
    "zbv": ["parallel.virtual_stages=2"],
}
SEQUENCES_PER_MICROBATCH = 2
# Each op on one thread (XLA CPU; ignored by other backends) unless XLA_FLAGS says otherwise: with
# Eigen's multi-threading the n fake devices fight over one intra-op pool (steps 3x longer in wall
# time than in CPU time at pp=4 on 2 cores), and the one-device reference would get every core.
ONE_THREAD_PER_OP = "--xla_cpu_multi_thread_eigen=false"


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = Parser(__doc__)
    add_run_args(p)
    p.set_defaults(mesh="pp=4")
    p.add_argument("--microbatches", default="p,2p,4p", metavar="M,M,...",
                   help="microbatch counts: integers or multiples of the stage count p (default p,2p,4p)")
    p.add_argument("--schedules", default=",".join(SCHEDULES), metavar="NAME,...",
                   help=f"schedules to run (default {','.join(SCHEDULES)})")
    p.add_argument("--steps", type=int, default=3, help="timed steps after the first (default 3)")
    p.add_argument("--profile", nargs="?", type=Path, const=True, default=None, metavar="DIR",
                   help="trace one more step per case under DIR (default: beside --out, <out>-profile/) "
                        "and report each stage's idle fraction")
    p.add_argument("--out", type=file_path, help="JSON report (default bench/results/pipeline-<config>-<mesh>.json)")
    args = p.parse_args(argv)
    check_out(args.out)
    if isinstance(args.profile, Path):
        check_creatable(args.profile, f"--profile {args.profile}", "--profile")
    return args


def microbatch_counts(text: str, stages: int) -> list[int]:
    """'p,2p,4p' (or integers, e.g. '4,8') -> [p, 2p, 4p]."""
    counts = []
    for part in filter(None, (t.strip() for t in text.split(","))):
        factor = part[:-1] if part.endswith("p") else part
        try:
            n = (int(factor) if factor else 1) * (stages if part.endswith("p") else 1)
        except ValueError:
            raise ConfigError(f"--microbatches {text!r}: expected integers or multiples of p, e.g. p,2p,4p") from None
        if n < 1:
            raise ConfigError(f"--microbatches {text!r}: a count must be 1 or more")
        counts.append(n)
    if not counts:
        raise ConfigError(f"--microbatches {text!r}: name at least one count, e.g. p,2p,4p")
    return counts


def chosen_schedules(text: str) -> list[str]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    unknown = [n for n in names if n not in SCHEDULES]
    if unknown or not names:
        raise ConfigError(f"--schedules {text!r}: choose from {', '.join(SCHEDULES)}")
    return names


def cases(args: argparse.Namespace) -> tuple[list[RunConfig], dict[int, RunConfig]]:
    """The checked config of every schedule and M, and the one-device reference of every M;
    refuses bad flags before jax."""
    check_at_least(args, 1, "--steps")
    stages = parse_mesh(args.mesh).stage
    if stages < 2:
        raise ConfigError(f"--mesh {args.mesh}: the schedules need a stage axis of 2 or more, e.g. --mesh pp=4")
    ms = microbatch_counts(args.microbatches, stages)
    names = chosen_schedules(args.schedules)
    preset = get_preset(args.config or "tiny")
    todo = [_case(args, preset, stages, schedule, m) for schedule in names for m in ms]
    return todo, {m: reference(todo[i], m) for i, m in enumerate(ms)}


def _case(args: argparse.Namespace, preset: RunConfig, stages: int, schedule: str, m: int) -> RunConfig:
    """One checked case: a refusal names the bench's flags that made it (the schedule, the M)."""
    try:
        return run_config(args, base=apply_overrides(preset, [
            f"model.n_layers={2 * stages}", f"parallel.schedule={schedule}", f"parallel.microbatches={m}",
            f"train.global_batch_size={SEQUENCES_PER_MICROBATCH * m}", *SCHEDULES[schedule]]))
    except ConfigError as e:
        raise ConfigError(f"--schedules {schedule} --microbatches {m} (--mesh {args.mesh}): {e}") from None


def reference(cfg: RunConfig, m: int) -> RunConfig:
    """`cfg` on one device: no pipeline, its M microbatches as gradient accumulation."""
    one = dataclasses.replace(cfg.parallel, schedule="gpipe", microbatches=0, virtual_stages=1,
                              **{a: 1 for a in AXES})
    ref = dataclasses.replace(cfg, parallel=one,
                              train=dataclasses.replace(cfg.train, micro_batch_size=cfg.train.global_batch_size // m))
    check_values(ref)
    check_run(ref, {a: 1 for a in AXES})
    return ref


def run_steps(cfg: RunConfig, mesh: jax.sharding.Mesh, steps: int, trace: Path | None = None) -> dict:
    """Compile one case, run it once, then time `steps` steps on the same batch; with `trace`,
    one more step under jax.profiler (its HLO beside it, as tools/trace_summary reads it)."""
    import jax

    from training.build import build, compile_step, xla_memory

    job = build(cfg, mesh)
    with jax.set_mesh(mesh):
        batch = job.batches(0)
        compiled, _, compile_s = compile_step(job.step_fn, mesh, job.state, batch)
        (state, _), _ = timed(compiled, job.state, batch)  # donates job.state
        times, cpu = [], []
        for _ in range(steps):
            start = time.process_time()
            (state, _), seconds = timed(compiled, state, batch)
            cpu.append(time.process_time() - start)
            times.append(seconds)
        traced_s = None
        if trace is not None:
            hlo = trace / "plugins" / "profile" / "train_step.hlo.txt"
            hlo.parent.mkdir(parents=True, exist_ok=True)
            hlo.write_text(compiled.as_text())
            jax.profiler.start_trace(str(trace), create_perfetto_trace=True)
            try:
                (state, _), traced_s = timed(compiled, state, batch)
            finally:
                jax.profiler.stop_trace()
    return {"compile_s": compile_s, "step_s": statistics.median(times), "step_times_s": times,
            "step_min_s": min(times), "step_cpu_s": statistics.median(cpu),
            "traced_step_s": traced_s, "temp_bytes": xla_memory(compiled)["temp"]}


def timetable_figures(cfg: RunConfig) -> dict:
    """The table's bubble and ticks, and its weighted bubbles."""
    from pipeline import schedule as tables
    from sharding.checks import microbatches
    from tools.pipeline_figures import cell_costs

    par = cfg.parallel
    table = tables.timetable(par.schedule, par.stage, microbatches(cfg, par.stage), par.virtual_stages)
    cost = cell_costs(cfg, {"stage": par.stage})  # F 1, B 2 (3 recomputing), the head from the FLOPs
    w = tables.weighted(table, cost)
    return {"bubble": tables.bubble(table), "ticks": len(table), "lockstep_bubble": w.bubble,
            "async_bubble": w.async_bubble, "costs": cost}


def cores() -> int:
    """The host cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def stage_of(mesh: jax.sharding.Mesh) -> dict[int, int]:
    """{device id: its coordinate on the stage axis}."""
    import numpy as np

    axis = mesh.axis_names.index("stage")
    return {int(d.id): int(i[axis]) for i, d in np.ndenumerate(mesh.devices)}


def row_line(row: dict) -> str:
    idle = row.get("profile", {}).get("idle")
    return (f"{row['schedule']:<17}{row['microbatches']:>3}{row['ticks']:>6}{row['bubble']:>8.3f}"
            + (f"{row['lockstep_bubble']:>9.3f}" if "lockstep_bubble" in row else f"{'-':>9}")
            + f"{row['step_s'] * 1e3:>9.1f}{row['one_device_s'] * 1e3:>9.1f}{row['measured_bubble']:>9.3f}"
            + f"{row['work_ratio']:>7.2f}{row['cpu_work_ratio']:>6.2f}{row['compile_s']:>8.1f}"
            + f"{row['temp_bytes'] / 2**20:>9.2f}"
            + ("  " + " ".join(f"{x:.2f}" for x in idle) if idle else ""))


HEADER = (f"{'schedule':<17}{'M':>3}{'ticks':>6}{'bubble':>8}{'lockstep':>9}{'step ms':>9}{'1-dev ms':>9}"
          f"{'measured':>9}{'work':>7}{'cpu':>6}{'compile':>8}{'temp MiB':>9}  idle per stage (profile)")


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    todo, refs = cases(args)
    if "xla_cpu_multi_thread_eigen" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {ONE_THREAD_PER_OP}".strip()
    mesh, mesh_text, _ = bench_mesh(todo[0], request_fake_devices(todo[0]))
    out = args.out or default_out("pipeline", todo[0], mesh_text)
    trace_root = (out.with_name(out.stem + "-profile") if args.profile is True else args.profile)
    import jax

    from sharding.mesh import build_mesh

    one = build_mesh(refs[next(iter(refs))].parallel, [jax.devices()[0]])
    ref_rows: dict[int, dict] = {}
    rows: list[dict] = []
    try:
        for m, ref in refs.items():
            r = attempt(run_steps, ref, one, args.steps)
            ref_rows[m] = {"microbatches": m, "micro_batch_size": ref.train.micro_batch_size,
                           "global_batch_size": ref.train.global_batch_size, **r}
            if "error" not in r:
                print(f"one device, M={m}: {r['step_s'] * 1e3:.1f} ms (compile {r['compile_s']:.1f} s)", flush=True)
        print(HEADER)
        for cfg in todo:
            rows.append(schedule_row(dataclasses.replace(cfg, parallel=mesh_config(mesh, cfg.parallel)), mesh,
                                     ref_rows[cfg.parallel.microbatches], args.steps, trace_root))
            if "measured_bubble" in rows[-1]:
                print(row_line(rows[-1]), flush=True)
    except KeyboardInterrupt:  # the cases measured so far are kept
        write_report(record(argv, todo[-1], mesh, mesh_text, ref_rows, rows) | {"interrupted": True}, out)
        raise
    write_report(record(argv, todo[-1], mesh, mesh_text, ref_rows, rows), out)
    return failures(list(ref_rows.values()) + rows, out)


def schedule_row(cfg: RunConfig, mesh: jax.sharding.Mesh, ref: dict, steps: int, trace_root: Path | None) -> dict:
    """One schedule and M on the mesh: its timetable's figures, its measured step, and the
    measured bubble against the one-device step `ref` (an "error" where either failed)."""
    from tools.trace_summary import stage_idle

    par = cfg.parallel
    trace = trace_root / f"{par.schedule}-M{par.microbatches}" if trace_root else None
    row = {"schedule": par.schedule, "stages": par.stage, "microbatches": par.microbatches,
           "virtual_stages": par.virtual_stages, **timetable_figures(cfg), **attempt(run_steps, cfg, mesh, steps, trace)}
    if "error" in row or "error" in ref:  # no measured bubble without both steps
        return row
    t1, n = ref["step_s"], mesh.devices.size
    row |= {"one_device_s": t1, "ideal_s": t1 / n, "measured_bubble": 1 - t1 / n / row["step_s"],
            "work_ratio": row["step_s"] / t1, "cpu_work_ratio": row["step_cpu_s"] / ref["step_cpu_s"],
            "measured_bubble_min": 1 - ref["step_min_s"] / n / row["step_min_s"],
            "step_per_tick_s": row["step_s"] / row["ticks"]}
    if trace:
        row["profile"] = {"dir": str(trace), **stage_idle(trace, stage_of(mesh))}
    return row


def record(argv: list[str], cfg: RunConfig, mesh: jax.sharding.Mesh, mesh_text: str, ref_rows: dict[int, dict],
           rows: list[dict]) -> dict:
    import jax

    n = mesh.devices.size
    machine = {"cores": cores(), "devices": n, "core_floor": max(0.0, 1 - cores() / n),
               "fake_devices": jax.default_backend() == "cpu" and n > 1, "xla_flags": os.environ.get("XLA_FLAGS", "")}
    return report_head("bench.pipeline", argv, cfg, mesh, mesh_text) | {
        "machine": machine,
        "meaning": (
            "measured_bubble = 1 - (one_device_s / devices) / step_s. On fake CPU devices the devices are threads "
            f"sharing {machine['cores']} cores (and whatever else runs there): a pipeline without any bubble would "
            f"still read about core_floor = {machine['core_floor']:.2f} (1 - cores/devices), so on such a machine "
            "the CPU figure is an upper bound mixing the bubble, the core sharing and the pipeline's overheads, not "
            "the bubble. cpu_work_ratio = process CPU time of a step / the one-device step's: the work all "
            "devices execute (gpipe and interleaved compute their idle cells on zeros; the 1F1B family skips "
            "them) plus what their threads burn waiting for each other at each tick, so it overstates the work; "
            "the load moves it little. work_ratio is the same in wall time. "
            "profile.idle / profile.waiting: per stage, the traced step's time with none of the stage's own "
            "compute running / in collectives. On accelerators, one per device, measured_bubble is the real "
            "bubble plus the pipeline's overheads."),
        "one_device": list(ref_rows.values()), "schedules": rows}


if __name__ == "__main__":
    run_cli(main)
