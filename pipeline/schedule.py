"""Pipeline timetables: which stage does what at each tick, and the bubble they leave.

  python -m pipeline.schedule --schedule 1f1b --stages 4 --microbatches 8

A timetable is a list of ticks, each a list of one cell per stage: an `Op` (F forward or B
backward of microbatch m, on chunk v of the stage's layers) or None (idle, printed `.`). Every
stage runs one cell per tick, and all stages run the same tick program (one SPMD program); the
bubble is the fraction of idle cells, computed from the table. The schedules' tick programs read
their cells from the table too, as arrays [ticks, p] (`cells`): the order is computed here only.

  gpipe        F(m) on stage s at tick m + s; M + p - 1 ticks of forwards (the backward is
               autodiff's mirror image of the same table). Bubble (p-1)/(M+p-1).
  interleaved  circular: stage s holds V chunks of layers, chunks s, s+p, ..., s+(V-1)p; work
               item w = t - s of stage s is microbatch g·p + w mod p (g = w div pV) on chunk
               (w mod pV) div p, so p microbatches travel the ring V times before the next p
               enter. V·M + p - 1 ticks, bubble (p-1)/(V·M+p-1); needs M divisible by p.
  1f1b         F and B cells (one tick each): stage s runs min(p-1-s, M) warm-up forwards,
               then alternates one forward and one backward, then drains its backwards; a cell
               runs at the first tick after its inputs were sent (F(m, s-1), resp. B(m, s+1) or,
               on the last stage, F(m, p-1)). 2(M + p - 1) ticks of which 2M busy per stage:
               bubble (p-1)/(M+p-1), the same as GPipe's forward+backward (1F1B saves memory,
               not time): stage s holds at most p - s microbatch inputs instead of M.

Ticks count F and B alike; in time a backward costs about 2 forwards (3 where 1f1b recomputes the
forward in its backward), which this table does not weigh.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

SCHEDULES = ("gpipe", "interleaved", "1f1b")
IDLE, FORWARD, BACKWARD = range(3)  # Cells.kind


@dataclass(frozen=True)
class Op:
    kind: str  # "F" or "B"
    microbatch: int
    chunk: int = 0  # v, the stage's chunk of layers (interleaved)

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}" + (f".{self.chunk}" if self.chunk else "")


Table = list[list[Op | None]]  # [tick][stage]


def circular(stages: int, microbatches: int, virtual: int = 1) -> Table:
    """gpipe (virtual=1) and interleaved forward timetables."""
    p, m_count, v_count = stages, microbatches, virtual
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


def one_f_one_b(stages: int, microbatches: int) -> Table:
    """The 1F1B timetable, by running each stage's op list as early as its inputs allow."""
    p, m_count = stages, microbatches
    queues = []
    for s in range(p):
        warm = min(p - 1 - s, m_count)
        ops = [Op("F", m) for m in range(warm)]
        for m in range(m_count - warm):
            ops += [Op("F", warm + m), Op("B", m)]
        queues.append(ops + [Op("B", m) for m in range(m_count - warm, m_count)])
    done: dict[tuple[str, int, int], int] = {}  # (kind, m, stage) -> tick
    table: Table = []
    while any(queues):
        t, row = len(table), []
        for s in range(p):
            op = queues[s][0] if queues[s] else None
            if op is not None:
                need = (("F", op.microbatch, s - 1) if op.kind == "F" else
                        ("B", op.microbatch, s + 1) if s < p - 1 else ("F", op.microbatch, s))
                if (op.kind == "F" and s == 0) or done.get(need, t) < t:
                    queues[s].pop(0)
                    done[(op.kind, op.microbatch, s)] = t
                    row.append(op)
                    continue
            row.append(None)
        table.append(row)
    return table


def timetable(schedule: str, stages: int, microbatches: int, virtual: int = 1) -> Table:
    if schedule == "1f1b":
        return one_f_one_b(stages, microbatches)
    return circular(stages, microbatches, virtual if schedule == "interleaved" else 1)


class Cells(NamedTuple):
    """A timetable as int32 arrays [ticks, p] that a tick program indexes with (tick, stage)."""

    kind: np.ndarray  # IDLE, FORWARD or BACKWARD
    microbatch: np.ndarray  # m (0 when idle)
    chunk: np.ndarray  # v (0 when idle)


def cells(table: Table) -> Cells:
    """The table's cells as arrays."""
    kind, microbatch, chunk = (np.zeros((len(table), len(table[0])), np.int32) for _ in range(3))
    for t, row in enumerate(table):
        for s, op in enumerate(row):
            if op is not None:
                kind[t, s] = FORWARD if op.kind == "F" else BACKWARD
                microbatch[t, s], chunk[t, s] = op.microbatch, op.chunk
    return Cells(kind, microbatch, chunk)


def bubble(table: Table) -> float:
    """Idle cells / all cells."""
    every = [c for row in table for c in row]
    return sum(c is None for c in every) / len(every)


def format_table(table: Table) -> str:
    width = max(len(str(c)) for row in table for c in row if c is not None) + 1
    stages = len(table[0])
    lines = ["tick " + "".join(f"s{s}".rjust(width) for s in range(stages))]
    for t, row in enumerate(table):
        lines.append(f"{t:>4} " + "".join(("." if c is None else str(c)).rjust(width) for c in row))
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipeline.schedule", description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", choices=SCHEDULES, default="gpipe")
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--virtual-stages", type=int, default=2, help="V, for interleaved")
    args = parser.parse_args(argv)
    if args.schedule == "interleaved" and args.microbatches % args.stages:
        parser.error(f"interleaved needs --microbatches divisible by --stages ({args.stages})")
    table = timetable(args.schedule, args.stages, args.microbatches, args.virtual_stages)
    print(format_table(table))
    print(f"{args.schedule}: {len(table)} ticks, bubble {bubble(table):.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
