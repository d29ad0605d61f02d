"""Pipeline timetables: which stage does what at each tick, and the idle cells they leave.

A timetable is a list of ticks, each a list of one cell per stage: an `Op` (F forward, B backward,
W weight gradient of microbatch m, on chunk v of the stage's layers) or None (idle, printed `.`).
Every stage runs one cell per tick, and all stages run the same tick program (one SPMD program);
the bubble is the fraction of idle cells, computed from the table. The schedules' tick programs
read their cells from the table too, as arrays [ticks, p] (`cells`): the order is computed here
only. p stages, M microbatches, V chunks per stage; stage s holds chunks v = 0..V-1, the model's
chunks v·p + s (a chunk is 1/V of the stage's layers).

Dependencies (`needs`; a cell runs at a tick after the cells it needs): F(m, v) on s needs
F(m, v) on s-1, or on s = 0 with v > 0 F(m, v-1) on p-1; B(m, v) on s needs B(m, v) on s+1, or
on s = p-1 B(m, v+1) on stage 0, or for v = V-1 F(m, V-1) on p-1; W(m, v) needs B(m, v) on s.
zbv's V shape (`v_shape`) routes chunk 1 the other way: F(m, 1) on s needs F(m, 1) on s+1, on
p-1 F(m, 0) there; B(m, 1) on s needs B(m, 1) on s-1, on stage 0 F(m, 1) there (the last chunk);
B(m, 0) on p-1 needs B(m, 1) there. `route` says where each cell's output goes.
Unsplit schedules have F and B cells only (B = input and weight gradients); zb-h1 splits B into
B (input gradient) and W (weight gradient). The 1F1B family is placed by `place`: each stage runs
its op list in order, each op at the first tick its dependencies allow.

  gpipe        F(m) on stage s at tick m + s; M + p - 1 ticks of forwards (the backward is
               autodiff's mirror image of the same table). Bubble (p-1)/(M+p-1).
  interleaved  circular: work item w = t - s of stage s is microbatch g·p + w mod p
               (g = w div pV) on chunk (w mod pV) div p, so p microbatches travel the ring V
               times before the next p enter. V·M + p - 1 ticks, bubble (p-1)/(V·M+p-1); needs
               M divisible by p.
  1f1b         stage s: min(p-1-s, M) warm-up forwards, then one forward one backward, then the
               remaining backwards. 2(M + p - 1) ticks, 2M busy per stage: bubble (p-1)/(M+p-1),
               GPipe's (1F1B saves memory, not time): stage s holds at most p - s microbatches.
  interleaved-1f1b  Narayanan et al. 2021 (Megatron's order): forward op k of a stage is
               microbatch (k div pV)·p + k mod p on chunk (k div p) mod V, backward op k the same
               microbatch on chunk V-1-(k div p) mod V; min(2(p-s-1) + (V-1)p, MV) warm-up
               forwards, then one F one B, then the remaining Bs. Needs V >= 2 and M divisible
               by p. 2(V·M + p - 1) ticks: bubble (p-1)/(V·M+p-1), i.e. (p-1)/(V·M) of the ideal
               time; stage s holds at most min(2(p-s-1) + (V-1)p + 1, MV) (microbatch, chunk)
               pairs, stage 0 p + (p-1)/V microbatches' worth of activations.
  zb-h1        Qi et al. 2023 (ZB-H1): 1F1B's order with B split into B and W; stage s runs
               min(p-1-s, M) warm-up forwards, then F(i + warm-up), B(i) and, from i = s on,
               W(i - s), then the remaining Bs each followed by a W, then the remaining Ws: W is
               delayed s microbatches on stage s so that the last stage's Bs, which the earlier
               stages wait for, come early, and the Ws fill the tail. 3M + p - 1 ticks for
               M >= p (2M + 2p - 1 below: no steady state): bubble
               (p-1)/(3M+p-1), i.e. (p-1)(T_F+T_B-T_W) per stage against 1F1B's
               (p-1)(T_F+T_B+T_W). In flight until W: p on every stage (min(p, M)), 1F1B's stage 0
               figure; until B (the activations B needs): p - s, 1F1B's. (A stage that held at
               most p - s until W would make the last stage run F B W back to back:
               3M + 2p - 2 ticks, the bubble of 1F1B.)

  zbv          Qi et al. 2023 (ZB-V, the memory-efficient schedule of the paper of ZB-H1): zb-h1's
               split backward on V = 2 chunks laid in a V (`v_shape`): stage s
               holds the model's chunks s and 2p-1-s, so a microbatch's forward runs down the
               stages on chunk 0 and back up on chunk 1, and its head and loss are on stage 0,
               where it entered; the turn at stage p-1 is local (no transfer), as is the
               backward's. Placed greedily (`zbv`): every tick each stage runs a ready B (chunk 0
               first), else a ready F (chunk 1 first) while fewer than 2p (microbatch, chunk)
               pairs wait for their W, else its oldest W. 6M + p - 1 ticks of half-stage cells at
               every M >= p for p <= 4 and for p = 8 from M = 14 (this greedy order is not optimal
               elsewhere: up to p/2 ticks more; tests/test_schedule.py): bubble (p-1)/(6M+p-1),
               p-1 idle half-stage cells per stage where zb-h1 idles p-1 whole ones, at zb-h1's
               activation memory (2p half-stage pairs in flight = p whole ones, 1F1B's stage 0).
               With equal cell costs no schedule is shorter: each stage runs 6M cells, and stage
               p-1 can start none before microbatch 0 has crossed the p-1 stages above it. Twice
               zb-h1's ticks, each with its two permutes: twice its bytes over stage.

Their weighted time, the activations in flight, and the command line that prints and draws them
(`python -m pipeline.schedule`): pipeline/schedule.py.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

SCHEDULES = ("gpipe", "interleaved", "1f1b", "interleaved-1f1b", "zb-h1", "zbv")
IDLE, FORWARD, BACKWARD, WEIGHT = range(4)  # Cells.kind
_KIND = {"F": FORWARD, "B": BACKWARD, "W": WEIGHT}


@dataclass(frozen=True)
class Op:
    kind: str  # "F", "B" (whole backward, or its input gradient where split) or "W" (weight gradient)
    microbatch: int
    chunk: int = 0  # v, the stage's chunk of layers (interleaved)

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}" + (f".{self.chunk}" if self.chunk else "")


Table = list[list[Op | None]]  # [tick][stage]
Cell = tuple[str, int, int, int]  # (kind, microbatch, chunk, stage)


def route(kind: str, stage: int, chunk: int, stages: int, virtual: int, vee: bool = False) -> tuple[int, int] | None:
    """Where the output of `kind` ("F" or "B") on (stage, chunk) goes, as (stage, chunk): an F's
    to the next chunk of the model, a B's input gradient to the previous one; None at the ends
    (the last chunk's F feeds the head on its own stage, the first chunk's B the embedding).
    `vee`: zbv's V shape (module docstring)."""
    s, v, p = stage, chunk, stages
    if vee:
        down = (kind == "F") == (v == 0)  # chunk 0's forward and chunk 1's backward travel to s+1
        if down:
            return (s + 1, v) if s < p - 1 else (s, 1 - v)  # the turn at p-1 stays on the stage
        return (s - 1, v) if s > 0 else None
    if kind == "F":
        return (s + 1, v) if s < p - 1 else (0, v + 1) if v < virtual - 1 else None
    return (s - 1, v) if s > 0 else (p - 1, v - 1) if v > 0 else None


def needs(op: Op, stage: int, stages: int, virtual: int, vee: bool = False) -> tuple[Cell, ...]:
    """The cells `op` on `stage` waits for (see the module docstring); `vee`: zbv's V shape."""
    m, v, s = op.microbatch, op.chunk, stage
    if op.kind == "W":
        return (("B", m, v, s),)
    sources = _senders(op.kind, stages, virtual, vee).get((s, v))
    if sources:
        return tuple((op.kind, m, c, t) for t, c in sources)
    return (("F", m, v, s),) if op.kind == "B" else ()  # the last chunk's B follows its F; the first F needs none


@functools.lru_cache(maxsize=None)
def _senders(kind: str, stages: int, virtual: int, vee: bool) -> dict[tuple[int, int], tuple[tuple[int, int], ...]]:
    """`route` inverted: (stage, chunk) -> the (stage, chunk) cells of `kind` whose output it takes.
    Built once per shape: the placers ask `needs` millions of times in a planner search."""
    into: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for t in range(stages):
        for c in range(virtual):
            if (dest := route(kind, t, c, stages, virtual, vee)) is not None:
                into.setdefault(dest, []).append((t, c))
    return {dest: tuple(sent) for dest, sent in into.items()}


def v_shape(table: Table) -> bool:
    """Whether the table is zbv's V shape: two chunks, chunk 1's first F on stage p-1 before it
    runs on stage 0 (in the looping layout chunk 1 enters on stage 0). One stage: both agree."""
    p = len(table[0])
    first = {s: min((t for t, row in enumerate(table) if row[s] and row[s].kind == "F" and row[s].chunk == 1),
                    default=None) for s in (0, p - 1)}
    return p > 1 and first[0] is not None and first[p - 1] < first[0]


def place(queues: list[list[Op]], virtual: int = 1) -> Table:
    """Run each stage's op list in order, each op at the first tick after the cells it needs and
    after the stage's previous op: tick max(previous, needed...) + 1. A stage places ops until
    one needs a cell not yet placed, then waits for that cell alone: the same table as stepping
    tick by tick, at the cost of the ops rather than of ticks x stages (a planner search places
    hundreds, up to M = 1024)."""
    p = len(queues)
    done: dict[Cell, int] = {}
    waiting: dict[Cell, list[int]] = {}  # a cell not yet placed -> the stages whose next op needs it
    heads, last, runnable = [0] * p, [-1] * p, list(range(p))
    while runnable:
        s = runnable.pop()
        while heads[s] < len(queues[s]):
            op = queues[s][heads[s]]
            wanted = needs(op, s, p, virtual)
            if (missing := next((d for d in wanted if d not in done), None)) is not None:
                waiting.setdefault(missing, []).append(s)
                break
            last[s] = max([last[s]] + [done[d] for d in wanted]) + 1
            cell = (op.kind, op.microbatch, op.chunk, s)
            done[cell], heads[s] = last[s], heads[s] + 1
            runnable += waiting.pop(cell, [])
    if stuck := [q[h] for q, h in zip(queues, heads) if h < len(q)]:
        raise ValueError(f"op lists deadlock: {stuck} wait for cells never placed {sorted(waiting)}")
    table: Table = [[None] * p for _ in range(max(last) + 1)]
    for (kind, m, v, s), t in done.items():
        table[t][s] = Op(kind, m, v)
    return table


def _check(stages: int, microbatches: int, virtual: int = 1) -> None:
    if stages < 1 or microbatches < 1 or virtual < 1:
        raise ValueError(f"stages ({stages}), microbatches ({microbatches}) and virtual stages ({virtual}) "
                         "must be >= 1")


def circular(stages: int, microbatches: int, virtual: int = 1) -> Table:
    """gpipe (virtual=1) and interleaved forward timetables."""
    _check(stages, microbatches, virtual)
    p, m_count, v_count = stages, microbatches, virtual
    if v_count > 1 and m_count % p:
        raise ValueError(f"interleaved needs microbatches ({m_count}) divisible by stages ({p})")
    table = []
    for t in range(v_count * m_count + p - 1):
        row = []
        for s in range(p):
            w = t - s
            if 0 <= w < v_count * m_count:
                group, r = divmod(w, p * v_count)
                row.append(Op("F", group * p + r % p, r // p))
            else:
                row.append(None)
        table.append(row)
    return table


def one_f_one_b(stages: int, microbatches: int, virtual: int = 1) -> Table:
    """1F1B (virtual=1) and interleaved 1F1B (virtual >= 2): Megatron's per-stage op order, placed."""
    _check(stages, microbatches, virtual)
    p, m_count, v_count = stages, microbatches, virtual
    if v_count > 1 and m_count % p:
        raise ValueError(f"interleaved-1f1b needs microbatches ({m_count}) divisible by stages ({p})")
    total = m_count * v_count

    def op(kind: str, k: int) -> Op:
        v = (k // p) % v_count
        return Op(kind, (k // (p * v_count)) * p + k % p, v if kind == "F" else v_count - 1 - v)

    queues = []
    for s in range(p):
        warm = min(p - 1 - s if v_count == 1 else 2 * (p - 1 - s) + (v_count - 1) * p, total)
        ops = [op("F", k) for k in range(warm)]
        for k in range(total - warm):
            ops += [op("F", warm + k), op("B", k)]
        queues.append(ops + [op("B", k) for k in range(total - warm, total)])
    return place(queues, v_count)


def zb_h1(stages: int, microbatches: int) -> Table:
    """ZB-H1: 1F1B with B split into B and W, W delayed s microbatches on stage s."""
    _check(stages, microbatches)
    p, m_count = stages, microbatches
    queues = []
    for s in range(p):
        warm = min(p - 1 - s, m_count)
        ops, w = [Op("F", m) for m in range(warm)], 0
        for i in range(m_count):
            ops += ([Op("F", warm + i)] if warm + i < m_count else []) + [Op("B", i)]
            if i >= s or warm + i >= m_count:  # from i = s on, or in the cool-down: one W per B
                ops.append(Op("W", w))
                w += 1
        queues.append(ops + [Op("W", m) for m in range(w, m_count)])
    return place(queues)


def zbv(stages: int, microbatches: int) -> Table:
    """ZB-V: zb-h1's B/W split on two chunks in a V, placed greedily tick by tick (docstring)."""
    _check(stages, microbatches)
    p, m_count = stages, microbatches
    cap = 2 * p  # (microbatch, chunk) pairs between F and W: zb-h1's memory; less deadlocks this greedy order
    following = [dict.fromkeys(((k, v) for k in "FB" for v in (0, 1)), 0) for _ in range(p)]  # next microbatch
    waiting: list[list[tuple[int, int]]] = [[] for _ in range(p)]  # B done, W not: the order their Ws run
    held, done, table = [0] * p, {}, []

    def ready(s: int, t: int, kind: str, v: int) -> Op | None:
        """Stage s's next op of this kind and chunk, if what it needs ran before tick t."""
        op = Op(kind, following[s][kind, v], v)
        return op if op.microbatch < m_count and all(done.get(d, t) < t for d in needs(op, s, p, 2, vee=True)) else None

    while len(done) < 6 * m_count * p:
        t, row = len(table), []
        for s in range(p):
            op = ready(s, t, "B", 0) or ready(s, t, "B", 1)
            if op is None and held[s] < cap:
                op = ready(s, t, "F", 1) or ready(s, t, "F", 0)
            if op is None and waiting[s] and done[("B", *waiting[s][0], s)] < t:
                op = Op("W", *waiting[s].pop(0))
            if op is not None:
                if op.kind != "W":
                    following[s][op.kind, op.chunk] += 1
                held[s] += (op.kind == "F") - (op.kind == "W")
                if op.kind == "B":
                    waiting[s].append((op.microbatch, op.chunk))
                done[(op.kind, op.microbatch, op.chunk, s)] = t
            row.append(op)
        if all(c is None for c in row):
            raise ValueError(f"zbv deadlocks at tick {t} (p={p}, M={m_count})")
        table.append(row)
    return table


def timetable(schedule: str, stages: int, microbatches: int, virtual: int = 1) -> Table:
    """The schedule's table; `virtual` (V) is read by interleaved and interleaved-1f1b only (zbv
    has 2 chunks)."""
    if schedule == "1f1b":
        return one_f_one_b(stages, microbatches)
    if schedule == "interleaved-1f1b":
        if virtual < 2:
            raise ValueError(f"interleaved-1f1b needs virtual stages >= 2 (got {virtual}); V = 1 is 1f1b")
        return one_f_one_b(stages, microbatches, virtual)
    if schedule == "zb-h1":
        return zb_h1(stages, microbatches)
    if schedule == "zbv":
        return zbv(stages, microbatches)
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; one of {', '.join(SCHEDULES)}")
    return circular(stages, microbatches, virtual if schedule == "interleaved" else 1)


class Cells(NamedTuple):
    """A timetable as int32 arrays [ticks, p] that a tick program indexes with (tick, stage)."""

    kind: np.ndarray  # IDLE, FORWARD, BACKWARD or WEIGHT
    microbatch: np.ndarray  # m (0 when idle)
    chunk: np.ndarray  # v (0 when idle)


def cells(table: Table) -> Cells:
    """The table's cells as arrays."""
    kind, microbatch, chunk = (np.zeros((len(table), len(table[0])), np.int32) for _ in range(3))
    for t, row in enumerate(table):
        for s, op in enumerate(row):
            if op is not None:
                kind[t, s] = _KIND[op.kind]
                microbatch[t, s], chunk[t, s] = op.microbatch, op.chunk
    return Cells(kind, microbatch, chunk)


def bubble(table: Table) -> float:
    """Idle cells / all cells."""
    every = [c for row in table for c in row]
    return sum(c is None for c in every) / len(every)


def virtual_stages(table: Table) -> int:
    """V, the chunks per stage that the table's cells use."""
    return 1 + max(c.chunk for row in table for c in row if c is not None)


def forward_only(table: Table) -> bool:
    """Whether the table holds only F cells (gpipe, interleaved: autodiff mirrors the backward)."""
    return all(c is None or c.kind == "F" for row in table for c in row)


def with_backward(table: Table) -> Table:
    """A forward-only table (gpipe, interleaved) followed by its backward, the mirror image:
    B(m, v) on s at tick T + (T-1-t) for F(m, v) on s at tick t. Other tables unchanged."""
    if not forward_only(table):
        return table
    return table + [[None if c is None else Op("B", c.microbatch, c.chunk) for c in row] for row in table[::-1]]


def split(table: Table) -> bool:
    """Whether the table has W cells (B is the input gradient only)."""
    return any(c is not None and c.kind == "W" for row in table for c in row)
