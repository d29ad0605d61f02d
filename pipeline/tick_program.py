"""The tick program of the 1F1B family (pipeline/one_f_one_b.py), compiled on the host from
pipeline/tables.py's timetable: per tick and stage, the cell to run (an index into
pipeline/cells.py's CELLS or SPLIT_CELLS), its microbatch and chunk, and the slot of every value
in the stage's buffers (`inputs`, `inbox`, `residuals`, `stash`). Slots are assigned lowest
free first as values arrive and freed when read, so each buffer has as many slots as the stage
ever holds at once: flat in M (the counts are in one_f_one_b.py's docstring).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from pipeline.tables import BACKWARD, FORWARD, WEIGHT, Cells, Table, cells, route, timetable, v_shape, virtual_stages

# Each cell runs under the named scope SCOPE + its name (pipeline.cells.run_cell), which XLA keeps
# in its collectives' op_name: the census counts them per cell run, not per tick (`cell_shares`)
SCOPE = "pipeline_cell_"
NAMES = {FORWARD: "F", BACKWARD: "B", WEIGHT: "W"}
HEAD = "head"  # the head over the stages (pipeline/head.py), at the ticks of `heads`, under SCOPE + this
EMBED_BACK = "embed_back"  # the embedding's backward, at the ticks of `embeds_back`, under SCOPE + this
PERMUTE = "permute_"  # the two permutes, at the ticks of `moves`, under SCOPE + this + "down" or "up"


class Program(NamedTuple):
    """The table as int32 arrays [ticks, p] that the tick program indexes with (tick, stage):
    each cell, and the buffer slots it and the arriving values use (-1: nothing arrives).
    Arrivals come over two collective-permutes, "down" (stage s-1 to s) and "up" (s+1 to s): in
    the looping layout forwards come down and gradients up; in zbv's V chunk 1's come the other
    way, hence a slot for each permute and buffer."""

    branch: np.ndarray  # the cell, an index into CELLS
    head: np.ndarray  # bool: the cell is the model's last chunk's B, its cotangent the head's (pipeline/head.py)
    microbatch: np.ndarray  # the cell's microbatch (0 when idle)
    chunk: np.ndarray  # the cell's chunk v (0 when idle)
    down_input: np.ndarray  # `inputs` slot for a forward value arriving from s-1, -1 none
    down_grad: np.ndarray  # `inbox` slot for a gradient arriving from s-1 (zbv), -1 none
    up_input: np.ndarray  # `inputs` slot for a forward value arriving from s+1 (zbv), -1 none
    up_grad: np.ndarray  # `inbox` slot for a gradient arriving from s+1, -1 none
    x_slot: np.ndarray  # `inputs` slot of the cell's input (F; the last chunk's B: its output, the head's input)
    g_slot: np.ndarray  # `inbox` slot of the cell's output gradient (B)
    r_slot: np.ndarray  # `residuals` slot the F writes and its B (split: its W) reads
    s_slot: np.ndarray  # split backward: `stash` slot the B writes and its W reads
    keep_f: np.ndarray  # `inputs` slot the F's own output goes to on this stage, -1 none: the last
    #                     chunk's (for the head at its B) and zbv's turn on p-1 (chunk 0 feeds chunk 1)
    keep_b: np.ndarray  # `inbox` slot the B's input gradient goes to on this stage (zbv's turn), -1 none
    inputs: int  # slots per buffer
    inbox: int
    residuals: int
    stash: int
    split: bool  # the table splits B (input gradient) and W (weight gradient): zb-h1, zbv
    v_shape: bool  # zbv's V: chunk 1's values travel the other way (tables.route)
    moving: dict[str, np.ndarray]  # `moves`: {"down", "up"} [ticks] bool, the ticks each permute runs

    def used(self, field: str) -> bool:
        """Whether any tick uses the slot array `field` (a permute or handoff the engine can skip)."""
        return bool((getattr(self, field) >= 0).any())


class _Slots:
    """Slots of one buffer on one stage: the lowest free slot to each value as it arrives."""

    def __init__(self) -> None:
        self.held: dict[tuple[int, int], int] = {}
        self.most = 1

    def take(self, item: tuple[int, int]) -> int:
        slot = min(set(range(len(self.held) + 1)) - set(self.held.values()))
        self.held[item] = slot
        self.most = max(self.most, slot + 1)
        return slot

    def free(self, item: tuple[int, int]) -> int:
        return self.held.pop(item)


def program(schedule: str, p: int, m_count: int, v_count: int = 1) -> Program:
    """The tick program of a 1F1B-family schedule: the table's cells, what arrives where, and
    the slot of every value in the stage's buffers (assigned on the host, checked here)."""
    table = timetable(schedule, p, m_count, v_count)
    ways, cell, dest = _ways(table)
    kind, micro, chunk = cell
    vee, v_count = v_shape(table), virtual_stages(table)
    ticks, split = len(kind), bool((kind == WEIGHT).any())
    to = lambda k, s, v: route(SENDS[k], s, v, p, v_count, vee)  # noqa: E731  (stage, chunk) or None
    arriving = _arrivals(ways, cell, dest)
    head = np.zeros((ticks, p), bool)
    arrays = {name: np.full((ticks, p), -1, np.int32)
              for name in ("down_input", "down_grad", "up_input", "up_grad", "keep_f", "keep_b")}
    arrays |= {name: np.zeros((ticks, p), np.int32) for name in ("x_slot", "g_slot", "r_slot", "s_slot")}
    sizes = dict.fromkeys(("inputs", "inbox", "residuals", "stash"), 1)
    for s in range(p):
        slots = {name: _Slots() for name in sizes}
        for t in range(ticks):
            for way, forward, arrived in arriving.get((t, s), ()):  # what the neighbours sent last tick
                slot = slots["inputs" if forward else "inbox"].take(arrived)
                arrays[f"{way}_{'input' if forward else 'grad'}"][t, s] = slot
            k, item = kind[t, s], (micro[t, s], chunk[t, s])
            dest = to(k, s, item[1]) if k in SENDS else None
            if k == FORWARD:
                if (s, item[1]) == (0, 0):  # stage 0 chunk 0 embeds its input
                    arrays["x_slot"][t, s] = 0
                elif dest is None:  # the last chunk: its output replaces its input, for the head at B
                    arrays["x_slot"][t, s] = arrays["keep_f"][t, s] = slots["inputs"].held[item]
                else:
                    arrays["x_slot"][t, s] = slots["inputs"].free(item)
                if dest is not None and dest[0] == s:  # zbv's turn: chunk 1's input, on this stage
                    arrays["keep_f"][t, s] = slots["inputs"].take((item[0], dest[1]))
                arrays["r_slot"][t, s] = slots["residuals"].take(item)
            elif k == BACKWARD:
                if to(FORWARD, s, item[1]) is None:  # the last chunk: the head's cotangent
                    head[t, s] = True
                    arrays["x_slot"][t, s] = slots["inputs"].free(item)
                else:
                    arrays["g_slot"][t, s] = slots["inbox"].free(item)
                if dest is not None and dest[0] == s:  # zbv's turn: chunk 0's output gradient
                    arrays["keep_b"][t, s] = slots["inbox"].take((item[0], dest[1]))
                # split: its forward's residuals wait for W, and so does the stash B leaves
                kept = slots["residuals"]
                arrays["r_slot"][t, s] = kept.held[item] if split else kept.free(item)
                if split:
                    arrays["s_slot"][t, s] = slots["stash"].take(item)
            elif k == WEIGHT:
                arrays["r_slot"][t, s] = slots["residuals"].free(item)
                arrays["s_slot"][t, s] = slots["stash"].free(item)
        assert not any(b.held for b in slots.values()), f"stage {s} ends holding values"
        for name, b in slots.items():
            sizes[name] = max(sizes[name], b.most)
    return Program(kind, head, micro, chunk, **arrays, **sizes, split=split, v_shape=vee, moving=_moving(ways))


SENDS = {FORWARD: "F", BACKWARD: "B"}  # the cells whose output a neighbour may receive (tables.route)
WAYS = {1: "down", 2: "up"}  # `_ways`' codes


def _ways(table: Table) -> tuple[np.ndarray, Cells, dict]:
    """The permute each cell's output takes to another stage, [ticks, p] int8 (0 none: idle, W,
    the ends of the model, zbv's turn at stage p-1 that stays on the stage; 1 "down", s -> s+1;
    2 "up", s+1 -> s; tables.route), the table's cells, and {(kind, stage, chunk): the route's
    (stage, chunk)}."""
    cell = cells(table)
    vee, v_count, p = v_shape(table), virtual_stages(table), cell.kind.shape[1]
    way, dest = np.zeros((WEIGHT + 1, p, v_count), np.int8), {}
    for k in SENDS:
        for s in range(p):
            for v in range(v_count):
                to = route(SENDS[k], s, v, p, v_count, vee)
                if to is not None and to[0] != s:
                    way[k, s, v], dest[k, s, v] = 1 if (k == FORWARD) == (not vee or v == 0) else 2, to
    return way[cell.kind, np.arange(p), cell.chunk], cell, dest


def _arrivals(ways: np.ndarray, cell: Cells, dest: dict) -> dict[tuple[int, int], list[tuple[str, bool, tuple]]]:
    """{(t, s): [(permute, forward, (microbatch, chunk on s))]}: the values stage s receives at
    tick t, each sent by a neighbour's F (forward) or B at t - 1 over the permute its route
    takes (`_ways`' three results), down first."""
    found: dict[tuple[int, int], list] = {}
    for t, src in np.argwhere(ways[:-1]).tolist():
        k, v = int(cell.kind[t, src]), int(cell.chunk[t, src])
        to = dest[k, src, v]
        arrived = (int(cell.microbatch[t, src]), to[1])
        found.setdefault((t + 1, to[0]), []).append((WAYS[ways[t, src]], k == FORWARD, arrived))
    return {key: sorted(values) for key, values in found.items()}


def moves(table: Table) -> dict[str, np.ndarray]:
    """{"down", "up"}: [ticks] bool, the same for every stage: the ticks at which some stage
    receives a value over that permute, the ticks after some cell sent one by it (`_ways`;
    `Program.moving`). At the others no stage reads what it would carry (the warm-up sends no
    gradient back, the cool-down no forward on), and the engine skips it."""
    return _moving(_ways(table)[0])


def _moving(ways: np.ndarray) -> dict[str, np.ndarray]:
    return {name: np.concatenate([[False], (ways[:-1] == code).any(axis=1)]) for code, name in WAYS.items()}


def embeds_back(prog: Program) -> np.ndarray:
    """[ticks] bool, the same for every stage: the ticks whose stage 0 runs the B of chunk 0, the
    model's first, whose input gradient is the embedding's cotangent (M of them)."""
    return (prog.branch[:, 0] == BACKWARD) & (prog.chunk[:, 0] == 0)


def heads(prog: Program) -> np.ndarray:
    """[ticks] bool, the same for every stage: the ticks whose head stage runs the model's last
    chunk's B, at which every stage runs the head over the stages first (M of them)."""
    return prog.head.any(axis=1)


def cell_shares(prog: Program, mesh_shape: dict[str, int], axis: str = "stage") -> dict[str, dict[int, float]]:
    """tools.hlo.census's `taken`: for each cell's scope, the share of the ticks each device (by
    its position in the mesh's flat order, on the mesh of `mesh_shape`) runs it. The switch that
    holds a cell's collectives runs every tick; the cell only on its stage's ticks. Every device
    runs the head (HEAD) at the ticks of `heads`, the embedding's backward (EMBED_BACK) at those
    of `embeds_back`, and each permute (PERMUTE) at those of `Program.moving`."""
    shape = tuple(mesh_shape.values())
    stage = np.unravel_index(np.arange(math.prod(shape)), shape)[list(mesh_shape).index(axis)]
    ticks = len(prog.branch)
    shares = {SCOPE + name: {int(d): float(np.sum(prog.branch[:, s] == k)) / ticks for d, s in enumerate(stage)}
              for k, name in NAMES.items()}
    every = {HEAD: heads(prog), EMBED_BACK: embeds_back(prog)}
    every |= {PERMUTE + way: run for way, run in prog.moving.items()}
    return shares | {SCOPE + name: dict.fromkeys(range(len(stage)), float(np.sum(run)) / ticks)
                     for name, run in every.items()}
