"""Reading the text of a compiled HLO module: its computations and instructions, a
collective's buffer and replica groups (and the mesh axes the groups span), and how often each
computation runs per step (while loops' trip counts, read from XLA's backend config or, where
XLA dropped it, from the loop's condition). tools/hlo.py's census is built on it; the
instruction and metadata patterns are also read by tools/op_kinds.py and tools/trace_summary.py.

The HLO text prints operands without shapes, so sizes come from each instruction's own result
type. Written by hand because no library parses XLA's HLO text for these (jax exposes the
compiled text, not its structure).
"""

from __future__ import annotations

import math
import re
from collections import defaultdict

import numpy as np

# A computation's first line (its name; with "(" in the line), and an instruction: name, result
# type, opcode, the rest (operands, attributes, metadata). Also read by tools/trace_summary.py
# and tools/op_kinds.py: one reading of HLO text.
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
PAIRS = re.compile(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}")
OP_NAME = re.compile(r'op_name="([^"]*)"')  # jax's metadata: the op's path of named scopes
DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4,
               "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8, "f8e4m3fn": 1, "f8e5m2": 1}


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


def collective_buffer(kind: str, started: bool, type_text: str) -> tuple[str, int]:
    """(dtype, elements) of the buffer S that the byte formula of `kind` takes. A collective that
    XLA combined from several holds a tuple of them; where their dtypes differ (a ring's fp32
    dK beside its bf16 K and V) S is counted in the narrowest of them, its elements the tuple's
    bytes over that dtype's (the first array's dtype for all had read bf16 parts as fp32)."""
    parts = _top_level(type_text)
    if started and parts[0].startswith("("):  # ((operands), results): XLA GPU of jax >= 0.12
        parts = parts[1:2] if kind in ("all-gather", "collective-permute") else parts[1:]
    elif started and kind in ("all-gather", "collective-permute"):
        parts = [parts[1]]  # (operand, result[, sync flags]): the result
    arrays = [a for p in parts for a in _arrays(p)]
    unit = min((d for d, _ in arrays), key=lambda d: DTYPE_BYTES.get(d, 4))
    return unit, sum(n * DTYPE_BYTES.get(d, 4) for d, n in arrays) // DTYPE_BYTES.get(unit, 4)


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


def replica_groups(rest: str) -> list[list[int]] | None:
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


def spanned_axes(device_sets: list[list[int]], axis_sizes: dict[str, int]) -> tuple[str, ...]:
    """Mesh axes along which the devices of any one set differ."""
    names, shape = list(axis_sizes), tuple(axis_sizes.values())
    varying = set()
    for devices in device_sets:
        coords = np.array(np.unravel_index(devices, shape)).T
        varying |= {names[i] for i in range(len(names)) if len(set(coords[:, i])) > 1}
    return tuple(a for a in names if a in varying)


def computation_runs(text: str) -> tuple[dict[str, list[str]], dict[str, int]]:
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
