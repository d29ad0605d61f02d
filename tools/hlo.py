"""The collective census of a compiled program: per kind and mesh axis, how many run per step and
how many bytes each device moves.

  python -m tools.hlo --config tiny --mesh dp=2,tp=4
  python -m tools.hlo --config 125m --mesh fsdp=8 --set train.global_batch_size=8 --json
  python -m tools.hlo --config tiny --mesh tp=4 --set parallel.sequence_parallel=true --ops

It reads the text of the compiled (partitioned, optimised) HLO, what runs on each device:

- Collectives: all-reduce, all-gather, reduce-scatter, all-to-all, collective-permute, with
  their async `-start` forms (GPU) and those wrapped in `async-start` computations.
- Mesh axes: device ids in replica groups and source-target pairs are positions in the mesh's
  flat device order (the compiled program's device assignment), so a group's coordinates on
  the mesh show which axes it spans (e.g. `data+fsdp`).
- Loops: a collective inside a while body runs `known_trip_count` times per step (nested loops
  multiply), so a layer scan's body counts once per layer. XLA GPU drops the count from a loop
  it has unrolled (the accumulation scan over microbatches): its trips are then read off its
  condition, `i < N` with i starting at a constant (`_trips`); a loop read neither way
  counts once. `ops` counts instructions in the text, `count` executions per step (a row's: its
  busiest device's).
- Bytes per device, with S the full buffer and N the group size: all-reduce 2S(N-1)/N (ring);
  all-gather S(N-1)/N (S = its result); reduce-scatter S(N-1)/N (S = its operand, N times the
  result); all-to-all S(N-1)/N; collective-permute S, for the devices that send (a source of
  its pairs with another target; a pair of one device is a local copy, no bytes). A
  collective moves bytes on its `devices` only, so a row's (and the total's) bytes per device
  are those of the device that moves the most (`per_device`): a pipeline's permute down the
  stages is not sent by the last stage, nor the one up by the first, and at p = 2 each device
  sends one of the two.
- Branches: a conditional's branches all sit in the text, but each execution takes one. Where
  the caller knows how often a named scope's branch is taken (`taken`: a pipeline's cells,
  pipeline.tick_program.cell_shares), a collective under that scope (its op_name) runs that share of
  its loop's trips on each device; otherwise every branch is counted as taken every time, an
  upper bound.

The reading of the text (computations, groups, trip counts) is tools/hlo_text.py's. Written by
hand because no library reports collectives per mesh axis (XLA's cost_analysis gives only a
total of bytes accessed).
"""

from __future__ import annotations

import json
import math
import re
from collections import defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

from configs.parser import Parser
from tools.hlo_text import (DTYPE_BYTES, INSTRUCTION, OP_NAME, PAIRS, collective_buffer, computation_runs,
                            replica_groups, spanned_axes)

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


@dataclass(frozen=True)
class Collective:
    """One collective instruction of the compiled program."""

    kind: str  # one of KINDS
    axes: tuple[str, ...]  # mesh axes its groups span
    group: int  # N, devices per group
    dtype: str
    elements: int  # S: the full buffer (see the module docstring)
    trips: int  # executions per step
    name: str
    op_name: str  # jax's metadata: where in the program it comes from
    devices: tuple[int, ...]  # the devices that move bytes: its groups' members, a permute's senders

    @property
    def bytes_per_run(self) -> float:
        """Bytes each of its `devices` moves in one execution."""
        s, n = self.elements * DTYPE_BYTES.get(self.dtype, 4), self.group
        if self.kind == "collective-permute":
            return float(s) if self.devices else 0.0
        return (2 if self.kind == "all-reduce" else 1) * s * (n - 1) / n

    @property
    def bytes_per_step(self) -> float:
        return self.bytes_per_run * self.trips


def _shares(op_name: str, taken: dict[str, dict[int, float]]) -> dict[int, float] | None:
    """The shares of the scope of `taken` the op_name runs under (a whole path segment), if any."""
    for scope, shares in taken.items():
        if re.search(rf"(?<!\w){re.escape(scope)}(?!\w)", op_name):
            return shares
    return None


def census(hlo_text: str, axis_sizes: dict[str, int],
           taken: dict[str, dict[int, float]] | None = None) -> list[Collective]:
    """Every collective instruction of a compiled HLO module over a mesh of `axis_sizes`.
    `taken`: for a named scope, the share of its loop's trips each device runs it (module
    docstring, Branches); such a collective is listed once per share, with those devices."""
    body, runs = computation_runs(hlo_text)
    found = []
    for comp, lines in body.items():
        for line in lines:
            m = INSTRUCTION.match(line)
            if not m or runs.get(comp, 0) == 0:
                continue
            name, type_text, opcode, rest = m.groups()
            kind = opcode.removesuffix("-start")
            if kind not in KINDS:
                continue
            if kind == "collective-permute":
                pairs = [[int(a), int(b)] for a, b in re.findall(r"\{(\d+),(\d+)\}", PAIRS.search(rest).group(1))]
                sets, group = pairs, 2
                devices = sorted({a for a, b in pairs if a != b})
            else:
                sets = replica_groups(rest) or [list(range(math.prod(axis_sizes.values())))]  # {}: all devices
                group = len(sets[0])
                devices = sorted({d for g in sets for d in g})
            dtype, elements = collective_buffer(kind, opcode.endswith("-start"), type_text)
            if kind == "reduce-scatter":
                elements *= group  # the result is 1/N of the reduced buffer
            op_name = (o.group(1) if (o := OP_NAME.search(rest)) else "")
            one = Collective(kind, spanned_axes(sets, axis_sizes), group, dtype, elements, runs[comp], name, op_name,
                             tuple(devices))
            shares = _shares(op_name, taken or {})
            if shares is None:
                found.append(one)
                continue
            for share in sorted({shares.get(d, 0.0) for d in devices} - {0.0}):
                found.append(replace(one, trips=round(one.trips * share),
                                     devices=tuple(d for d in devices if shares.get(d, 0.0) == share)))
    return found


def per_device(collectives: list[Collective], of: Callable[[Collective], float] = lambda c: c.bytes_per_step) -> float:
    """The most any device has of `of` (bytes per step) over `collectives`, each counted on
    each of its `devices`."""
    moved: dict[int, float] = defaultdict(float)
    for c in collectives:
        for d in c.devices:
            moved[d] += of(c)
    return max(moved.values(), default=0.0)


def summary(collectives: list[Collective]) -> list[dict]:
    """Rows per (kind, axes): ops in the text, and the executions and bytes per step of the
    row's busiest device (`per_device`)."""
    groups: dict[tuple, list[Collective]] = defaultdict(list)
    for c in collectives:
        groups[c.kind, c.axes].append(c)
    rows = [{"kind": kind, "axes": "+".join(axes) or "-", "ops": len({c.name for c in ops}),
             "count": round(per_device(ops, lambda c: c.trips)), "bytes_per_device": per_device(ops)}
            for (kind, axes), ops in groups.items()]
    return sorted(rows, key=lambda r: (r["axes"], r["kind"]))


def format_table(collectives: list[Collective]) -> str:
    """`summary`'s rows as a table, and the busiest device's total."""
    rows = summary(collectives)
    lines = [f"{'collective':<20} {'mesh axes':<16} {'ops':>5} {'per step':>9} {'MiB/device':>11}"]
    for r in rows:
        lines.append(f"{r['kind']:<20} {r['axes']:<16} {r['ops']:>5} {r['count']:>9} "
                     f"{r['bytes_per_device'] / 2**20:>11.3f}")
    total = per_device(collectives)
    count = round(per_device(collectives, lambda c: c.trips))
    lines.append(f"{'total':<20} {'':<16} {'':>5} {count:>9} {total / 2**20:>11.3f}")
    return "\n".join(lines)


def compiled_census(compiled, cfg, mesh) -> list[Collective]:
    """The census of cfg's train step compiled for `mesh`, a pipeline's cells counted per run
    (pipeline.one_f_one_b.census_taken)."""
    from pipeline.one_f_one_b import census_taken

    return census(compiled.as_text(), dict(mesh.shape), census_taken(cfg, dict(mesh.shape)))


def step_census(cfg, mesh) -> list[Collective]:
    """The census of cfg's compiled train step on `mesh` (abstract inputs: nothing allocated)."""
    from training.build import make_program, compile_step

    program = make_program(cfg, mesh)
    compiled, _, _ = compile_step(program.step_fn, mesh, program.state, program.abstract_batch())
    return compiled_census(compiled, cfg, mesh)


def main(argv: list[str]) -> int:
    from cli import add_run_args, request_fake_devices, run_config

    p = Parser(__doc__)
    add_run_args(p)
    p.add_argument("--json", action="store_true", help="print JSON (rows and every op) instead of a table")
    p.add_argument("--ops", action="store_true", help="also list every collective instruction")
    args = p.parse_args(argv)
    cfg = run_config(args)
    request_fake_devices(cfg)

    from sharding.mesh import build_mesh, format_mesh

    mesh = build_mesh(cfg.parallel)
    found = step_census(cfg, mesh)
    if args.json:
        print(json.dumps({"config": cfg.name, "mesh": format_mesh(dict(mesh.shape)), "rows": summary(found),
                          "ops": [asdict(c) | {"bytes_per_run": c.bytes_per_run} for c in found]}, indent=1))
        return 0
    print(f"train step of {cfg.name} on mesh {format_mesh(dict(mesh.shape))}: collectives per step, per device")
    print(format_table(found))
    if args.ops:
        every = mesh.devices.size
        for c in sorted(found, key=lambda c: (c.axes, c.kind, c.name)):
            on = "" if len(c.devices) == every else f" on devices {','.join(map(str, c.devices)) or 'none'}"
            print(f"  {c.kind:<19} {'+'.join(c.axes) or '-':<12} {c.dtype}[{c.elements}] x{c.trips}{on} "
                  f"{c.bytes_per_run / 2**10:9.1f} KiB  {c.op_name}")
    return 0


if __name__ == "__main__":
    from cli import run_cli

    run_cli(main)
