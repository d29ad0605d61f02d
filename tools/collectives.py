"""nccl-tests for a JAX mesh: time one collective at a time over mesh axes and message sizes.

  python -m tools.collectives --mesh dp=2,tp=4
  python -m tools.collectives --mesh dp=2,tp=4 --ops all-reduce --axes tensor,data+tensor --sizes 1K:1G
  python -m tools.collectives --mesh dp=2,tp=4 --check          compile and census every program

What is measured: for each op (all-reduce, all-gather, reduce-scatter, all-to-all, permute), each
mesh axis or axis combination (`data+tensor`: one group of dp·tp devices) and each message size
(the powers of two between the --sizes bounds), a jitted `jax.shard_map` program, manual over
exactly those axes, whose body is that one collective: `lax.psum`, `lax.all_gather`,
`lax.psum_scatter`, `lax.all_to_all`, or `lax.ppermute` one step round a ring
(tools/collective_programs.py). Each program is run once to compile and warm up, then timed
--iters times (each sample BACK_TO_BACK calls dispatched back to back, waited for with
`jax.block_until_ready`, as nccl-tests times a run of launches); the table gives the median per
call.

Conventions: nccl-tests', in tools/busbw.py (the message size S, algbw, busbw and its factor per
op, the fit t = latency + S·factor / busbw that the record keeps per axes and op for the planner).

`--check` compiles every program without running it and asserts with `tools.hlo.census` that the
compiled HLO holds exactly one collective, of the intended kind, over the intended axes, with
the intended group size (2 for a permute: census counts its pairs) and element count (census'
S is nccl-tests' S). XLA CPU widens bf16 collectives to f32, so on CPU a bf16 program is
expected to move f32.

On CPU (fake host devices) the run is labelled a smoke run: the devices exchange copies in host
memory on the same cores (gloo over TCP between processes), not messages over a GPU interconnect,
so its figures measure nothing about NVLink or InfiniBand. Several processes run as train.py
does (--coordinator ..., or SLURM); process 0 prints and writes the record.

Written by hand: no JAX tool measures collectives per mesh axis (nccl-tests drives NCCL
directly, outside XLA and without a mesh).
"""

from __future__ import annotations

import argparse
import math
import re
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

from configs import ConfigError, RunConfig
from configs.parser import Parser
from sharding.mesh import ALIASES, AXES, parse_mesh
from tools.busbw import OPS, Op, Row, bandwidths, fit_model, format_block, message_count, smallest_message, summarize
from tools.collective_programs import Axes, check_program, group_size, input_spec, make_input, program
from tools.measure import check_at_least, check_out, file_path, png_path

if TYPE_CHECKING:
    import jax

BACK_TO_BACK = 4  # calls per timed sample
CPU_LIMIT = 2**30  # the largest message on CPU (fake devices share the host's memory)
MEMORY_FRACTION = 4  # elsewhere: at most 1/4 of a device's memory (input and output fit twice)
DTYPES = {"bf16": 2, "f32": 4}
UNITS = {"": 1, "B": 1, "K": 2**10, "M": 2**20, "G": 2**30}
SMOKE = ("smoke run on CPU: fake host devices exchange copies in host memory (gloo over TCP between "
         "processes), not messages over a GPU interconnect; these figures say nothing about NVLink or InfiniBand")


# --- input -----------------------------------------------------------------------------------

def parse_size(text: str) -> int:
    """'64K' -> 65536 (binary units B, K, M, G)."""
    m = re.fullmatch(r"(\d+)([KMG]?)B?", text.strip().upper())
    if not m or int(m.group(1)) == 0:
        raise ConfigError(f"--sizes: {text!r} is not a size; write a positive number with an optional "
                          "K, M or G (binary), e.g. --sizes 1K:64M or --sizes 4M")
    return int(m.group(1)) * UNITS[m.group(2)]


def parse_sizes(text: str) -> list[int]:
    """'LO:HI' -> the powers of two from LO to HI (bytes); 'S' -> [S]."""
    lo, _, hi = text.partition(":")
    low, high = parse_size(lo), parse_size(hi or lo)
    if low > high:
        raise ConfigError(f"--sizes {text}: the lower bound is above the upper one; write LO:HI, e.g. 1K:64M")
    if not hi:
        return [low]
    sizes = [2**k for k in range(math.ceil(math.log2(low)), math.floor(math.log2(high)) + 1)]
    if not sizes:
        raise ConfigError(f"--sizes {text}: no power of two lies between the bounds; widen them, e.g. 1K:64M")
    return sizes


def parse_ops(text: str) -> list[Op]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in OPS]
    if unknown or not names:
        raise ConfigError(f"--ops {text!r}: unknown op {', '.join(unknown) or '(none given)'}; "
                          f"ops are {','.join(OPS)}")
    return [OPS[n] for n in names]


def parse_axes(text: str, shape: dict[str, int]) -> list[Axes]:
    """'tensor,data+tensor' -> [('tensor',), ('data', 'tensor')], each in mesh order; '' -> every
    axis larger than 1, and all of them together when there are several."""
    big = [a for a in AXES if shape.get(a, 1) > 1]
    if not big:
        raise ConfigError("--mesh has no axis larger than 1: nothing to measure; e.g. --mesh dp=2,tp=4")
    if not text:
        return [(a,) for a in big] + ([tuple(big)] if len(big) > 1 else [])
    return [_axis_group(part, shape) for part in text.split(",") if part.strip()]


def _axis_group(part: str, shape: dict[str, int]) -> Axes:
    names = [ALIASES.get(a.strip(), a.strip()) for a in part.split("+")]
    for a in names:
        if a not in AXES:
            raise ConfigError(f"--axes: {a!r} is not a mesh axis; axes are {' '.join(AXES)} (or pp dp sp tp), "
                              "combined with +, e.g. --axes tensor,data+tensor")
        if shape[a] == 1:
            raise ConfigError(f"--axes: axis {a} has size 1 in this mesh: no collective to measure")
    if len(set(names)) != len(names):
        raise ConfigError(f"--axes: {part!r} names an axis twice")
    return tuple(a for a in AXES if a in names)


def size_limit(device: jax.Device) -> int:
    """The largest message: 1/MEMORY_FRACTION of the device's memory, or CPU_LIMIT on CPU."""
    stats = device.memory_stats() if device.platform != "cpu" else None
    return stats["bytes_limit"] // MEMORY_FRACTION if stats and "bytes_limit" in stats else CPU_LIMIT


def check_sizes(sizes: list[int], low: int, limit: int) -> None:
    """Refuse a size below `low` (the smallest message) or above `limit` (the device's)."""
    if min(sizes) < low:
        raise ConfigError(f"--sizes: {min(sizes)} B is below the smallest message these ops, groups and dtype "
                          f"can build, {low} B; start --sizes at {low} or above")
    if max(sizes) > limit:
        raise ConfigError(f"--sizes: {max(sizes) / 2**20:.0f} MiB is above this device's limit of "
                          f"{limit / 2**20:.0f} MiB per message (1 GiB on CPU, else a quarter of the "
                          "device's memory); lower the upper bound")


# --- check -----------------------------------------------------------------------------------

def run_check(mesh: jax.sharding.Mesh, ops: list[Op], groups: list[Axes], sizes: list[int], dtype: str) -> int:
    """One line per program; 1 with a message if any program is not its one collective."""
    failed = 0
    for op in ops:
        for axes in groups:
            n = group_size(mesh, axes)
            for size in sizes:
                count = message_count(op, size, DTYPES[dtype], n)
                problem = check_program(mesh, op, axes, count, dtype)
                failed += problem is not None
                _say(f"{'ok' if problem is None else 'FAIL':<4} {op.name:<14} {'+'.join(axes):<16} n={n:<3} "
                     f"{dtype}[{count}] {size:>11} B" + (f": {problem}" if problem else ""))
    if failed:
        _say(f"collectives check failed: {failed} program(s) do not compile to exactly their one collective")
        return 1
    return 0


# --- timing ----------------------------------------------------------------------------------

def measure(mesh: jax.sharding.Mesh, op: Op, axes: Axes, size: int, dtype: str, iters: int) -> Row:
    """Time one program at one size: median of `iters` samples after a warm-up run."""
    from tools.measure import median_seconds

    n = group_size(mesh, axes)
    count = message_count(op, size, DTYPES[dtype], n)
    spec = input_spec(mesh, op, axes, n, count, dtype)
    seconds = median_seconds(program(mesh, op, axes, n), (make_input(spec),), iters, BACK_TO_BACK)
    nbytes = count * DTYPES[dtype]
    algbw, busbw = bandwidths(nbytes, seconds, op.factor(n))
    return Row(op.name, "+".join(axes), n, nbytes, count, seconds * 1e6, algbw, busbw)


def sweep(mesh: jax.sharding.Mesh, op: Op, axes: Axes, sizes: list[int], args: argparse.Namespace) -> list[Row]:
    """Every size of one op and axes; its table printed as it completes (unless --json)."""
    rows = [measure(mesh, op, axes, s, args.dtype, args.iters) for s in sizes]
    if not args.json:
        _say(format_block(rows, op, args.dtype))
    return rows


def plot(rows: list[Row], path: Path) -> None:
    """busbw vs size, one panel per op, one line per axes, log-x."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ops = list(dict.fromkeys(r.op for r in rows))
    fig, panels = plt.subplots(1, len(ops), figsize=(4 * len(ops), 3.5), squeeze=False)
    for ax, op in zip(panels[0], ops):
        for axes in dict.fromkeys(r.axes for r in rows if r.op == op):
            mine = [r for r in rows if r.op == op and r.axes == axes]
            ax.plot([r.size for r in mine], [r.busbw_GBps for r in mine], marker="o",
                    label=f"{axes} (n={mine[0].group})")
        ax.set(xscale="log", xlabel="message size (B)", ylabel="busbw (GB/s)", title=op)
        ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


# --- the command -----------------------------------------------------------------------------

def parse_args(argv: list[str]) -> argparse.Namespace:
    from training.distributed import add_process_args

    p = Parser(__doc__)
    p.add_argument("--mesh", required=True, help="axis sizes, e.g. dp=2,tp=4 (axes pp dp fsdp sp tp; one may be -1)")
    p.add_argument("--sizes", default="1K:64M", help="LO:HI, the powers of two between (binary K M G), or one size")
    p.add_argument("--ops", default=",".join(OPS), help=f"comma-separated, of {','.join(OPS)} (default all)")
    p.add_argument("--axes", default="", help="mesh axes or +-combinations, e.g. tensor,data+tensor "
                   "(default every axis larger than 1, and all of them together)")
    p.add_argument("--dtype", choices=list(DTYPES), default="f32")
    p.add_argument("--iters", type=int, default=20, help="timed samples per size (median)")
    p.add_argument("--check", action="store_true", help="compile every program and census it; no timing")
    p.add_argument("--json", action="store_true", help="print the record as JSON instead of the tables")
    p.add_argument("--png", type=png_path, help="plot busbw vs size to this PNG")
    p.add_argument("--out", type=file_path, help="the record (default bench/results/collectives-<backend>-<mesh>.json)")
    add_process_args(p)
    args = p.parse_args(argv)
    check_at_least(args, 1, "--iters")
    check_out(args.out)
    if args.png:
        check_out(args.png, "--png")
    return args


def _say(text: str) -> None:
    """Print from process 0 only."""
    import jax

    if jax.process_index() == 0:
        print(text, flush=True)


def main(argv: list[str]) -> int:
    from cli import request_fake_devices
    from training.distributed import initialize, process_count

    args = parse_args(argv)
    request_fake_devices(RunConfig(parallel=parse_mesh(args.mesh)), process_count(args))
    initialize(args)
    return run(args, argv)


def run(args: argparse.Namespace, argv: list[str]) -> int:
    """The command once this process has its devices (main; bench/gpu_mesh.py calls it in its own
    process): check, or time and write the record (args.out)."""
    import jax

    from sharding.mesh import build_mesh, format_mesh

    ops, sizes = parse_ops(args.ops), parse_sizes(args.sizes)
    mesh = build_mesh(parse_mesh(args.mesh))
    groups = parse_axes(args.axes, dict(mesh.shape))
    check_sizes(sizes, smallest_message(ops, [group_size(mesh, axes) for axes in groups], DTYPES[args.dtype]),
                size_limit(jax.local_devices()[0]))
    if args.check:
        return run_check(mesh, ops, groups, sizes, args.dtype)
    smoke = jax.default_backend() == "cpu"
    mesh_text = format_mesh(dict(mesh.shape))
    if not args.json:
        _say(f"# collectives on mesh {mesh_text}, {jax.device_count()} {jax.devices()[0].device_kind} devices"
             + (f"\n# {SMOKE}" if smoke else ""))
    rows = [r for op in ops for axes in groups for r in sweep(mesh, op, axes, sizes, args)]
    report = record(argv, mesh, mesh_text, args, rows, smoke)
    write(report, args, mesh_text, rows)
    return 0


def record(argv: list[str], mesh: jax.sharding.Mesh, mesh_text: str, args: argparse.Namespace, rows: list[Row],
           smoke: bool) -> dict:
    """The JSON record: tools.measure's head (command, machine, versions), the mesh, the rows,
    the summaries and the fit per axes and op."""
    from tools.measure import environment, run_record

    blocks = {}
    for r in rows:
        blocks.setdefault((r.axes, r.op), []).append(r)
    fit: dict[str, dict] = {}
    for (axes, op), mine in blocks.items():
        fit.setdefault(axes, {})[op] = fit_model([r.size for r in mine], [r.time_us / 1e6 for r in mine],
                                                 OPS[op].factor(mine[0].group))
    return run_record("tools.collectives", argv) | {
        "environment": environment(list(mesh.devices.flat)), "mesh": mesh_text, "smoke": SMOKE if smoke else None,
        "dtype": args.dtype, "iters": args.iters, "calls_per_sample": BACK_TO_BACK,
        "rows": [asdict(r) for r in rows], "summary": [summarize(m) for m in blocks.values()], "fit": fit,
    }


def write(report: dict, args: argparse.Namespace, mesh_text: str, rows: list[Row]) -> None:
    import json

    import jax

    from tools.measure import RESULTS, write_report

    safe = mesh_text.replace("=", "").replace(",", "_")
    write_report(report, args.out or RESULTS / f"collectives-{jax.default_backend()}-{safe}.json",
                 to_stderr=args.json)
    if args.json:
        _say(json.dumps(report, indent=1))
    if args.png and jax.process_index() == 0:
        plot(rows, args.png)
        _say(f"wrote {args.png}")


if __name__ == "__main__":
    from cli import run_cli

    run_cli(main)
