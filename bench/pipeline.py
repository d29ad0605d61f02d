"""Pipeline schedules side by side: step time, XLA temp memory and the timetable's bubble.

  python -m bench.pipeline [--stages 4] [--microbatches 4,8] [--steps 3] [--set KEY=VALUE ...]

For each schedule (gpipe, interleaved with V=2, 1f1b) and each M, on a pp=p mesh of p fake CPU
devices: the tiny preset with p·2 layers, microbatches of 2 sequences (so the batch grows with
M), compiled ahead of time, then `--steps` timed steps (median). Writes
bench/results/pipeline-tiny-pp<p>.json. Fake CPU devices share the machine's cores: the step
times compare the schedules' work on this machine, not a GPU pipeline's overlap.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time

from configs import apply_overrides, get_preset
from sharding.mesh import parse_mesh
from sharding.xla_flags import with_flags

SCHEDULES = {"gpipe": [], "interleaved": ["parallel.virtual_stages=2"], "1f1b": []}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.pipeline", description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--microbatches", default="4,8")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--set", action="append", default=[], dest="overrides")
    args = parser.parse_args(argv)
    p, ms = args.stages, [int(m) for m in args.microbatches.split(",")]
    os.environ["XLA_FLAGS"] = with_flags(os.environ.get("XLA_FLAGS", ""), p)

    import jax

    from bench.step import default_out, report_head, write_report
    from pipeline.schedule import bubble, timetable
    from sharding.mesh import build_mesh
    from training.build import build, compile_step, xla_memory

    rows = []
    for schedule, extra in SCHEDULES.items():
        for m in ms:
            cfg = apply_overrides(get_preset("tiny"), [
                f"model.n_layers={2 * p}", f"parallel.schedule={schedule}", f"parallel.microbatches={m}",
                f"train.global_batch_size={2 * m}", *extra, *args.overrides])
            cfg = dataclasses.replace(cfg, parallel=parse_mesh(f"pp={p}", cfg.parallel))
            mesh = build_mesh(cfg.parallel)
            job = build(cfg, mesh)
            with jax.set_mesh(mesh):
                batch = job.batches(0)
                compiled, _, compile_s = compile_step(job.step_fn, mesh, job.state, batch)
                state, times = job.state, []
                for _ in range(args.steps + 1):
                    start = time.perf_counter()
                    state, metrics = jax.block_until_ready(compiled(state, batch))
                    times.append(time.perf_counter() - start)
            v = cfg.parallel.virtual_stages
            row = {"schedule": schedule, "stages": p, "microbatches": m, "virtual_stages": v,
                   "bubble": bubble(timetable(schedule, p, m, v)), "compile_s": compile_s,
                   "step_s_median": statistics.median(times[1:]),
                   "temp_bytes": xla_memory(compiled)["temp"]}
            rows.append(row)
            print(f"{schedule:<12} M={m:<3} bubble {row['bubble']:.3f}  step {row['step_s_median'] * 1e3:8.1f} ms"
                  f"  temp {row['temp_bytes'] / 2**20:7.2f} MiB  compile {compile_s:.1f} s", flush=True)
    report = report_head("bench.pipeline", argv, cfg, mesh, f"pp={p}") | {"schedules": rows}
    write_report(report, default_out("pipeline", cfg, f"pp{p}"))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
