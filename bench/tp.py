"""Tensor parallelism four ways: step time and collective census for tp in 2, 4, 8.

  python -m bench.tp                                   tiny preset, tp 2 4 8, 5 rounds
  python -m bench.tp --config 125m --set train.global_batch_size=8 --tp 8 --rounds 3

Variants, each on a mesh tp=T of T devices: gspmd (XLA places the collectives from the logical
rules), shard_map (the explicit Megatron regions, sharding/tensor_parallel.py), shard_map+sp
(sequence parallelism) and shard_map+sp+overlap (collective-matmul rings).

For one T, every variant is built and compiled, then timed round-robin: each round runs one
step of each variant in turn, so a noisy machine slows all of them alike; the report gives
each variant's median step time and its ratio to gspmd's, both from that one run. With fake
CPU devices sharing a few cores the ratios reflect XLA CPU's scheduling of the same work, not
NVLink: the multi-GPU figures wait for a multi-GPU machine. Each variant's census
(tools/hlo.py) is recorded beside it: what each moves per device per step, per mesh axis.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics

from bench.common import report_head
from cli import add_run_args, request_fake_devices, run_cli, run_config
from configs import ConfigError, RunConfig, apply_overrides
from configs.parser import Parser
from sharding.checks import check_tensor
from tools.measure import RESULTS, check_at_least, check_out, file_path, timed, write_report

VARIANTS = {
    "gspmd": ["parallel.tp_impl=gspmd"],
    "shard_map": ["parallel.tp_impl=shard_map"],
    "shard_map+sp": ["parallel.tp_impl=shard_map", "parallel.sequence_parallel=true"],
    "shard_map+sp+overlap": ["parallel.tp_impl=shard_map", "parallel.sequence_parallel=true",
                             "parallel.tp_overlap=true"],
}


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = Parser(__doc__)
    add_run_args(p)
    p.add_argument("--tp", default="2,4,8", help="tensor axis sizes to compare (default 2,4,8)")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds (one step of each variant per round)")
    p.add_argument("--out", type=file_path, help="JSON report (default bench/results/tp-<config>.json)")
    args = p.parse_args(argv)
    if args.mesh:
        raise ConfigError(f"--mesh {args.mesh}: bench.tp runs each variant on tp=T alone, T from --tp; drop --mesh")
    check_out(args.out)
    return args


def variant_config(base: RunConfig, tp: int, sets: list[str]) -> RunConfig:
    from sharding.mesh import parse_mesh

    cfg = apply_overrides(base, sets)
    return dataclasses.replace(cfg, parallel=parse_mesh(f"tp={tp}", cfg.parallel))


def compare(base: RunConfig, tp: int, rounds: int) -> dict:
    """Build, compile and time every variant on tp=T (round-robin); their census and memory."""
    import jax

    from sharding.mesh import build_mesh
    from tools.hlo import census, summary
    from training.build import build, compile_step, xla_memory

    runs = {}
    for name, sets in VARIANTS.items():
        cfg = variant_config(base, tp, sets)
        mesh = build_mesh(cfg.parallel, jax.devices()[:tp])
        job = build(cfg, mesh)
        with jax.set_mesh(mesh):
            batch = jax.block_until_ready(job.batches(0))
            compiled, _, compile_s = compile_step(job.step_fn, mesh, job.state, batch)
            state, _ = jax.block_until_ready(compiled(job.state, batch))
        runs[name] = {"mesh": mesh, "job": job, "compiled": compiled, "state": state, "batch": batch,
                      "compile_s": compile_s, "times": [], "census": summary(census(compiled.as_text(), dict(mesh.shape)))}
    for _ in range(rounds):
        for run in runs.values():
            with jax.set_mesh(run["mesh"]):
                (run["state"], metrics), seconds = timed(run["compiled"], run["state"], run["batch"])
                run["times"].append(seconds)
                run["loss"] = float(metrics["loss"])
    base_time = statistics.median(runs["gspmd"]["times"])
    return {name: {"step_time_median_s": statistics.median(r["times"]), "step_times_s": r["times"],
                   "ratio_to_gspmd": statistics.median(r["times"]) / base_time, "compile_s": r["compile_s"],
                   "loss_after_rounds": r["loss"], "memory_analysis": xla_memory(r["compiled"]),
                   "census": r["census"]}
            for name, r in runs.items()}


def tensor_collectives(variant: dict) -> list[dict]:
    """A variant's census rows over the tensor axis alone (bench.tables sums their bytes)."""
    return [c for c in variant["census"] if c["axes"] == "tensor"]


def print_table(results: dict) -> None:
    print(f"  {'tp':>3}  {'variant':<22} {'step (median)':>14} {'vs gspmd':>9}  {'tensor-axis collectives per step'}")
    for tp, variants in results.items():
        for name, r in variants.items():
            tensor = tensor_collectives(r)
            text = ", ".join(f"{c['count']} {c['kind']} {c['bytes_per_device'] / 2**20:.1f} MiB" for c in tensor)
            print(f"  {tp:>3}  {name:<22} {r['step_time_median_s'] * 1e3:>11.1f} ms {r['ratio_to_gspmd']:>8.2f}x  {text}")


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    try:
        sizes = sorted({int(x) for x in args.tp.split(",") if x.strip()})
    except ValueError:
        raise ConfigError(f"--tp {args.tp!r}: expected integers, e.g. 2,4,8") from None
    check_at_least(args, 1, "--rounds")
    if not sizes or sizes[0] < 2:
        raise ConfigError(f"--tp {args.tp!r}: sizes must be 2 or more, e.g. 2,4,8")
    base = run_config(args)
    for tp in sizes:  # the shared rule, its fix named in this tool's flags (it takes no --mesh)
        try:
            check_tensor(base, {"tensor": tp, "fsdp": 1, "sequence": 1})
        except ConfigError as e:
            raise ConfigError(f"--tp {tp}: {str(e).removesuffix(': change it or the --mesh')}; choose another "
                              "--tp, or change the model with --set") from None
    request_fake_devices(variant_config(base, sizes[-1], []))

    import jax  # noqa: E402 -- after XLA_FLAGS is final

    from sharding.mesh import build_mesh

    results = {tp: compare(base, tp, args.rounds) for tp in sizes}
    print_table(results)
    largest = variant_config(base, sizes[-1], [])
    mesh = build_mesh(largest.parallel, jax.devices()[: sizes[-1]])
    report = report_head("bench.tp", argv, base, mesh, f"tp={','.join(map(str, sizes))}")
    write_report(report | {"results": results}, args.out or RESULTS / f"tp-{base.name}.json")
    return 0

if __name__ == "__main__":
    run_cli(main)
