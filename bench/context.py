"""Context parallelism three ways: step time and XLA temp memory as sp and L grow together.

  python -m bench.context                              tiny preset, sp 1 2 4 8, L = 512·sp, 3 rounds
  python -m bench.context --sp 2,4 --tokens-per-device 1024 --impls ring,allgather --steps 5

For each sp, a mesh sp=N of N devices (on a CPU host, fake devices: as many as the largest sp,
requested before jax starts) and L = tokens_per_device·sp with a global batch of one sequence,
so every device holds tokens_per_device tokens whatever sp is and only L grows. The ways
(`parallel.context_impl`, sharding/context_parallel.py): ring (K/V blocks passed around the
sequence axis), allgather (K and V gathered once per layer), gspmd (XLA all-gathers K and V and
each device computes [L/sp, L] scores). sp=1 is the single-device baseline, run once (no way
applies there).

For one sp, every way is built and compiled, run once, then timed round-robin (each of --steps
rounds runs one step of each way, so a noisy machine slows all alike), as bench.tp does; a row
gives the median step time and its ratio to the first of --impls (ring by default) at the same
sp. Memory is XLA's analysis of the compiled step per device (`training.build.xla_memory`):
temp (activations and working buffers) and the static peak, with temp's ratio to sp=1 (to the
same way at the smallest sp when 1 is not given): a flat ratio means a device's memory does not
grow with L. Beside them, the bytes per device per step over `sequence` that tools/traffic.py
gives: K and V (`context`) and everything (`communication`, with the gradients' all-reduce).

Every case is checked before jax starts (sharding/checks.py: L divisible by 2·sp for ring and
allgather, known ways), a bad one is one `error:` line. Writes bench/results/context-<config>.json.
Fake CPU devices share the host's cores, so the step times compare the ways' work on this
machine, not a GPU ring's overlap of transfers with compute: read ratios within one sp.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
from typing import TYPE_CHECKING

from bench.common import attempt, failures, report_head
from cli import add_run_args, request_fake_devices, run_cli, run_config
from configs import ConfigError, RunConfig, get_preset
from configs.checks import CHOICES
from configs.parser import Parser
from sharding.mesh import AXES, parse_mesh
from tools.traffic import communication, context
from tools.measure import RESULTS, check_at_least, check_out, file_path, timed, write_report

if TYPE_CHECKING:
    import jax


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = Parser(__doc__)
    add_run_args(p)
    p.add_argument("--sp", default="1,2,4,8",
                   help="sequence axis sizes (default 1,2,4,8; 1 = the single-device baseline)")
    p.add_argument("--tokens-per-device", type=int, default=512, metavar="T",
                   help="tokens each device holds: L = T·sp (default 512)")
    p.add_argument("--impls", default="ring,allgather,gspmd",
                   help="parallel.context_impl values to compare, ratios to the first (default ring,allgather,gspmd)")
    p.add_argument("--steps", type=int, default=3, help="timed rounds after the first step (default 3)")
    p.add_argument("--out", type=file_path, help="JSON report (default bench/results/context-<config>.json)")
    return p.parse_args(argv)


def cases(args: argparse.Namespace) -> dict[int, dict[str | None, RunConfig]]:
    """{sp: {way: checked config}}, sp ascending; at sp=1 the one key None. Refuses bad flags
    before jax."""
    if args.mesh:
        raise ConfigError(f"--mesh {args.mesh}: bench.context builds its meshes sp=N itself; choose N with --sp")
    check_at_least(args, 1, "--steps", "--tokens-per-device")
    check_out(args.out)
    try:
        sizes = sorted({int(x) for x in args.sp.split(",") if x.strip()})
    except ValueError:
        raise ConfigError(f"--sp {args.sp!r}: expected integers, e.g. 1,2,4,8") from None
    if not sizes or sizes[0] < 1:
        raise ConfigError(f"--sp {args.sp!r}: sizes must be 1 or more, e.g. 1,2,4,8")
    impls = list(dict.fromkeys(x.strip() for x in args.impls.split(",") if x.strip()))
    known = CHOICES["parallel.context_impl"]
    if not impls or set(impls) - set(known):
        raise ConfigError(f"--impls {args.impls!r}: name one or more of {', '.join(known)}")
    if {"ring", "allgather"} & set(impls) and sizes[-1] > 1 and args.tokens_per_device % 2:
        raise ConfigError(f"--tokens-per-device {args.tokens_per_device}: ring and allgather lay each device's "
                          "tokens out as two zigzag chunks; use an even number, or --impls gspmd")
    preset = get_preset(args.config or "tiny")
    base = {sp: dataclasses.replace(preset, parallel=parse_mesh(f"sp={sp}", preset.parallel)) for sp in sizes}
    # every way is checked at every sp (sharding/checks.py refuses unknown ones and L % 2·sp);
    # at sp=1 they all land on the key None: one baseline
    return {sp: {impl if sp > 1 else None: run_config(args, base=base[sp], extra_sets=[
        f"train.seq_len={args.tokens_per_device * sp}", "train.global_batch_size=1",
        f"parallel.context_impl={impl}"]) for impl in impls} for sp in sizes}


def measure(todo: dict[str | None, RunConfig], mesh: jax.sharding.Mesh, steps: int) -> dict[str | None, dict]:
    """Build, compile and run once every way of one sp, then time `steps` rounds round-robin."""
    import jax

    from training.build import build, compile_step, xla_memory

    runs = {}
    for impl, cfg in todo.items():
        job = build(cfg, mesh)  # outside jax.set_mesh (training.build.make_program)
        with jax.set_mesh(mesh):
            batch = jax.block_until_ready(job.batches(0))
            compiled, _, _ = compile_step(job.step_fn, mesh, job.state, batch)
            state, _ = jax.block_until_ready(compiled(job.state, batch))  # donates job.state
            runs[impl] = {"compiled": compiled, "state": state, "batch": batch, "times": []}
    with jax.set_mesh(mesh):
        for _ in range(steps):
            for run in runs.values():
                (run["state"], _), seconds = timed(run["compiled"], run["state"], run["batch"])
                run["times"].append(seconds)
    return {impl: {"step_time_median_s": statistics.median(r["times"]), "step_times_s": r["times"],
                   "memory_analysis": xla_memory(r["compiled"])} for impl, r in runs.items()}


def rows(todo: dict[int, dict[str | None, RunConfig]], measured: dict[int, dict[str | None, dict]]) -> list[dict]:
    """One row per (sp, way): the measured figures, their ratios and the estimated bytes."""
    baseline = next(iter(todo[max(todo)]))  # the first of --impls (None when only sp=1 ran)
    done = [sp for sp in measured if "error" not in measured[sp]]
    smallest = measured[min(done)] if done else {}
    out = []
    for sp, by_impl in todo.items():
        for impl, cfg in by_impl.items():
            if "error" in measured[sp]:  # that sp failed (bench.common.attempt): its ways' rows say so
                out.append({"sp": sp, "seq_len": cfg.train.seq_len, "impl": impl, "error": measured[sp]["error"]})
                continue
            m = measured[sp][impl]
            mem = m["memory_analysis"]
            temp_base = smallest[None if None in smallest else impl]["memory_analysis"]["temp"]
            step_base = measured[sp][baseline]["step_time_median_s"] if impl is not None else None
            sizes = {a: getattr(cfg.parallel, a) for a in AXES}
            out.append({
                "sp": sp, "seq_len": cfg.train.seq_len, "impl": impl,
                "step_time_median_s": m["step_time_median_s"], "step_times_s": m["step_times_s"],
                "step_ratio": None if step_base is None else m["step_time_median_s"] / step_base,
                "temp_bytes": mem["temp"], "static_peak_bytes": mem["static_peak"],
                "temp_ratio": mem["temp"] / temp_base,
                "kv_bytes_estimate": context(cfg, sizes),
                "sequence_bytes_estimate": communication(cfg, sizes).get("sequence", 0.0),
                "memory_analysis": mem,
            })
    return out


def print_table(table: list[dict], baseline: str, temp_base: str) -> None:
    mib = 2**20
    print(f"  {'sp':>3} {'L':>6}  {'impl':<10} {'step (median)':>14} {'vs ' + baseline:>13} {'temp MiB':>9} "
          f"{'vs ' + temp_base:>10} {'peak MiB':>9}  {'K/V MiB':>8} {'sequence MiB':>12}  (estimated bytes/step)")
    for r in table:
        if "error" in r:
            print(f"  {r['sp']:>3} {r['seq_len']:>6}  {r['impl'] or '-':<10} {r['error']}")
            continue
        ratio = "-" if r["step_ratio"] is None else f"{r['step_ratio']:.2f}x"
        print(f"  {r['sp']:>3} {r['seq_len']:>6}  {r['impl'] or '-':<10} {r['step_time_median_s'] * 1e3:>11.1f} ms "
              f"{ratio:>13} {r['temp_bytes'] / mib:>9.1f} {r['temp_ratio']:>9.2f}x "
              f"{r['static_peak_bytes'] / mib:>9.1f}  {r['kv_bytes_estimate'] / mib:>8.1f} "
              f"{r['sequence_bytes_estimate'] / mib:>12.1f}")


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    todo = cases(args)
    sizes, largest = list(todo), next(iter(todo[max(todo)].values()))
    fake = request_fake_devices(largest)

    import jax  # noqa: E402 -- after XLA_FLAGS is final

    from sharding.mesh import build_mesh, check_backend

    check_backend()
    # every mesh first: an sp larger than the devices is refused before anything runs
    meshes = {sp: build_mesh(next(iter(c.values())).parallel, jax.devices()[:sp]) for sp, c in todo.items()}
    if fake and jax.default_backend() == "cpu":
        print(f"CPU platform: meshes sp={','.join(map(str, todo))} on {fake} fake host devices")
    measured = {}
    for sp, by_impl in todo.items():
        measured[sp] = attempt(measure, by_impl, meshes[sp], args.steps)
        for impl, m in ({} if "error" in measured[sp] else measured[sp]).items():
            print(f"sp={sp} {impl or 'single device'}: step {m['step_time_median_s'] * 1e3:.1f} ms, "
                  f"temp {m['memory_analysis']['temp'] / 2**20:.1f} MiB", flush=True)
    table, baseline = rows(todo, measured), next(iter(todo[max(todo)]))
    print_table(table, baseline or "-", f"sp={sizes[0]}")
    head = report_head("bench.context", argv, largest, meshes[sizes[-1]], f"sp={','.join(map(str, sizes))}")
    report = head | {"tokens_per_device": args.tokens_per_device, "steps": args.steps, "baseline_impl": baseline,
                     "temp_ratio_to": f"sp={sizes[0]}", "rows": table}
    out = args.out or RESULTS / f"context-{largest.name}.json"
    write_report(report, out)
    return failures(table, out)


if __name__ == "__main__":
    run_cli(main)
