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

The HLO text prints operands without shapes, so sizes come from each instruction's own result
type. Written by hand because no library reports collectives per mesh axis (XLA's
cost_analysis gives only a total of bytes accessed).
"""

from __future__ import annotations

import json
import math
import re
from collections import defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

import numpy as np

from configs.parser import Parser

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4,
               "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8, "f8e4m3fn": 1, "f8e5m2": 1}

# A computation's first line (its name; with "(" in the line), and an instruction: name, result
# type, opcode, the rest (operands, attributes, metadata). Also read by tools/trace_summary.py
# and bench/gpu.py: one reading of HLO text.
HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+) = (.+?) ([a-z][\w\-]*)\((.*)$")
_ARRAY = re.compile(r"([a-z]\w*)\[([\d,]*)\]")
_CALLS = re.compile(r"(condition|body|to_apply|calls|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_INDUCTION = re.compile(r'"known_induction_variable":\{"tuple_index":"(\d+)"\}')
_OPERANDS = re.compile(r"%([\w.\-]+)")
_GROUPS = re.compile(r"replica_groups=(\{(?:\{[\d,]*\},?)*\}|\[[\d,]+\]<=\[[\d,]+\](?:T\([\d,]+\))?)")
# XLA of jax >= 0.12 may print groups as a mesh and the axes each group spans, e.g.
# mesh['data'=2,'tensor'=4] {'tensor'} or mesh['a'=4,'b'=2], device_ids=(...) {'a':(1)2}
_MESH_GROUPS = re.compile(r"replica_groups=mesh\[([^\]]*)\](?:, device_ids=\(([^)]*)\))? \{([^}]*)\}")
_PAIRS = re.compile(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}")
OP_NAME = re.compile(r'op_name="([^"]*)"')  # jax's metadata: the op's path of named scopes


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


def _top_level(type_text: str) -> list[str]:
    """The top-level elements of a (possibly tuple) HLO type."""
    t = type_text.strip()
    if not t.startswith("("):
        return [t]
    parts, depth, start = [], 0, 1
    for i, c in enumerate(t):
        depth += c in "({[" and 1 or (c in ")}]" and -1 or 0)
        if (c == "," and depth == 1) or (c == ")" and depth == 0):
            parts.append(re.sub(r"/\*.*?\*/", "", t[start:i]).strip())
            start = i + 1
    return [p for p in parts if p]


def _arrays(type_text: str) -> list[tuple[str, int]]:
    return [(d, math.prod(int(x) for x in dims.split(",") if x)) for d, dims in _ARRAY.findall(type_text)]


def _buffer(kind: str, started: bool, type_text: str) -> tuple[str, int]:
    """(dtype, elements) of the buffer S that the byte formula of `kind` takes."""
    parts = _top_level(type_text)
    if started and parts[0].startswith("("):  # ((operands), results): XLA GPU of jax >= 0.12
        parts = parts[1:2] if kind in ("all-gather", "collective-permute") else parts[1:]
    elif started and kind in ("all-gather", "collective-permute"):
        parts = [parts[1]]  # (operand, result[, sync flags]): the result
    arrays = [a for p in parts for a in _arrays(p)]
    return arrays[0][0], sum(n for _, n in arrays)


def _mesh_groups(sizes: str, device_ids: str | None, group_axes: str) -> list[list[int]]:
    """The device groups of XLA's mesh form: the mesh's devices (iota unless listed), grouped along
    the named axes. A sub-axis 'a':(p)s is the size-s factor of axis a after its major factor p."""
    axes = [(name.strip("'"), int(n)) for name, n in re.findall(r"([^,=]+)=(\d+)", sizes)]
    ids = np.array([int(x) for x in re.findall(r"\d+", device_ids)] if device_ids else
                   np.arange(math.prod(n for _, n in axes)))
    size = dict(axes)
    refs = [(name, int(pre or 1), int(n or size[name]))
            for name, pre, n in re.findall(r"'?([^,:']+)'?(?::\((\d+)\)(\d+))?", group_axes)]
    dims, spans = [], []  # each axis cut into factors, major first: spans[i] = (axis, pre, pre*size)
    for name, n in axes:
        cuts = sorted({1, n} | {c for a, pre, k in refs if a == name for c in (pre, pre * k)})
        for lo, hi in zip(cuts, cuts[1:]):
            dims.append(hi // lo)
            spans.append((name, lo, hi))
    grouped = [i for a, pre, k in refs for i, (b, lo, hi) in enumerate(spans)
               if b == a and pre <= lo and hi <= pre * k]
    rest = [i for i in range(len(dims)) if i not in grouped]
    return ids.reshape(dims).transpose(rest + grouped).reshape(-1, math.prod(dims[i] for i in grouped)).tolist()


def _groups(rest: str) -> list[list[int]] | None:
    if m := _MESH_GROUPS.search(rest):
        return _mesh_groups(*m.groups())
    m = _GROUPS.search(rest)
    if m is None:
        return None
    text = m.group(1)
    if text.startswith("{"):
        return [[int(x) for x in g.split(",") if x] for g in re.findall(r"\{([\d,]*)\}", text[1:-1])]
    shape, dims, perm = re.match(r"\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", text).groups()
    ids = np.arange(math.prod(int(d) for d in dims.split(","))).reshape([int(d) for d in dims.split(",")])
    if perm:
        ids = ids.transpose([int(p) for p in perm.split(",")])
    return ids.reshape([int(s) for s in shape.split(",")]).tolist()


def _axes(device_sets: list[list[int]], axis_sizes: dict[str, int]) -> tuple[str, ...]:
    """Mesh axes along which the devices of any one set differ."""
    names, shape = list(axis_sizes), tuple(axis_sizes.values())
    varying = set()
    for devices in device_sets:
        coords = np.array(np.unravel_index(devices, shape)).T
        varying |= {names[i] for i in range(len(names)) if len(set(coords[:, i])) > 1}
    return tuple(a for a in names if a in varying)


def _multipliers(text: str) -> tuple[dict[str, list[str]], dict[str, int]]:
    """Instruction lines of each computation, and how often each computation runs per step."""
    body: dict[str, list[str]] = {}
    entry, current = None, None
    for line in text.splitlines():
        if current is None:
            m = HEADER.match(line)
            if m and "(" in line:
                current = m.group(1)
                body[current] = []
                entry = current if line.startswith("ENTRY") else entry
        elif line.startswith("}"):
            current = None
        else:
            body[current].append(line)
    edges = defaultdict(list)  # caller -> [(callee, times)]
    for comp, lines in body.items():
        for line in lines:
            calls = _CALLS.findall(line)
            for role, callee in calls:  # a while names its condition beside its body
                times = _trips(line, dict(calls)["condition"], comp, body) if role == "body" else 1
                edges[comp].append((callee, times))
            for group in _BRANCHES.findall(line):
                edges[comp] += [(c.strip().lstrip("%"), 1) for c in group.split(",") if c.strip()]
    runs: dict[str, int] = defaultdict(int)

    def visit(comp: str, times: int) -> None:
        runs[comp] += times
        for callee, n in edges.get(comp, []):
            visit(callee, times * n)

    visit(entry, 1)
    return body, runs


def _definitions(lines: list[str]) -> dict[str, tuple[str, str, str]]:
    """A computation's instructions by name: (result type, opcode, the rest of the line)."""
    return {m.group(1): m.groups()[1:] for line in lines if (m := INSTRUCTION.match(line))}


def _constant(name: str, defs: dict[str, tuple[str, str, str]]) -> int | None:
    """The integer an s32 scalar holds, followed through copies and bitcasts; None if not constant."""
    while name in defs:
        _, opcode, rest = defs[name]
        if opcode == "constant":
            return int(c.group(1)) if (c := re.match(r"(-?\d+)\)", rest)) else None
        if opcode not in ("copy", "bitcast") or not (o := _OPERANDS.search(rest)):
            return None
        name = o.group(1)
    return None


def _limit(condition: str, body: dict[str, list[str]]) -> int | None:
    """N of a loop condition `i < N`, N a constant, in the condition or a fusion it calls."""
    fused = [callee for role, callee in _CALLS.findall("\n".join(body.get(condition, []))) if role == "calls"]
    for name in [condition, *fused]:
        defs = _definitions(body.get(name, []))
        for _, opcode, rest in defs.values():
            if opcode == "compare" and "direction=LT" in rest and len(ops := _OPERANDS.findall(rest)) >= 2:
                return _constant(ops[1], defs)
    return None


def _trips(line: str, condition: str, comp: str, body: dict[str, list[str]]) -> int:
    """How often the while instruction `line` (in computation `comp`) runs its body: XLA's
    known_trip_count; without one its `condition` compares the induction variable (the tuple
    element XLA names, else the first) `< N` (`_limit`), and the loop's tuple starts it at a
    constant K: N - K. Else 1."""
    if t := _TRIPS.search(line):
        return int(t.group(1))
    limit, start = _limit(condition, body), re.search(r" while\(%([\w.\-]+)\)", line)
    if limit is None or not start:
        return 1
    defs = _definitions(body[comp])
    tuple_def = defs.get(start.group(1))
    index = int(i.group(1)) if (i := _INDUCTION.search(line)) else 0
    elements = _OPERANDS.findall(tuple_def[2]) if tuple_def and tuple_def[1] == "tuple" else []
    first = _constant(elements[index], defs) if index < len(elements) else None
    return limit - first if first is not None and limit > first else 1


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
    body, runs = _multipliers(hlo_text)
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
                pairs = [[int(a), int(b)] for a, b in re.findall(r"\{(\d+),(\d+)\}", _PAIRS.search(rest).group(1))]
                sets, group = pairs, 2
                devices = sorted({a for a, b in pairs if a != b})
            else:
                sets = _groups(rest) or [list(range(math.prod(axis_sizes.values())))]  # {}: all devices
                group = len(sets[0])
                devices = sorted({d for g in sets for d in g})
            dtype, elements = _buffer(kind, opcode.endswith("-start"), type_text)
            if kind == "reduce-scatter":
                elements *= group  # the result is 1/N of the reduced buffer
            op_name = (o.group(1) if (o := OP_NAME.search(rest)) else "")
            one = Collective(kind, _axes(sets, axis_sizes), group, dtype, elements, runs[comp], name, op_name,
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
