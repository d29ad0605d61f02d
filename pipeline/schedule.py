"""Pipeline timetables: which stage does what at each tick, and the bubble they leave.

  python -m pipeline.schedule --schedule 1f1b --stages 4 --microbatches 8
  python -m pipeline.schedule --schedule all --stages 4 --microbatches 8
  python -m pipeline.schedule --schedule zb-h1 --stages 4 --microbatches 8 --png zb.png

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

Weighted time (`weighted`, costs per cell kind; default F = 1, B = 2, W = 1 unsplit, B = W = 1
split; B = 3 where 1f1b recomputes the stage forward in B, `costs`). gpipe and interleaved are
weighed with their mirrored backward (`with_backward`). busy = a stage's cost sum.
  lock-step     every tick lasts as long as its most expensive cell: time = sum over ticks of
                max cost, bubble 1 - busy/(p·time). The tick program's figure.
                gpipe 3(M+p-1), interleaved 3(VM+p-1) (chunk costs): bubbles (p-1)/(M+p-1),
                (p-1)/(VM+p-1); 1f1b (p >= 2; its steady ticks pair an F with a B and last a B):
                2M·B + (p-1)(F+B) - (B-F); B = 2: 4M + 3p - 4, bubble 1 - 3M/(4M+3p-4),
                0.40 at p = 4, M = 8 (B = 3: 6M + 4p - 6); zb-h1 (units) 3M + p - 1, bubble
                (p-1)/(3M+p-1); interleaved-1f1b: no short form (e.g. p = 4, V = 2, M = 8:
                68 against 57 asynchronous), computed from the table.
  asynchronous  each stage runs its ops back to back, each as soon as its dependencies ended
                (weighted time, same order as the table): gpipe, 1f1b: (M+p-1)(F+B), bubble
                (p-1)/(M+p-1); interleaved, interleaved-1f1b: (VM+p-1)(F+B) in chunk costs, bubble
                (p-1)/(VM+p-1): the bubble time (p-1)(F+B) is (p-1)/(VM) of the ideal VM(F+B)
                (a chunk cell is 1/V of a stage's layers: (p-1)/V of 1F1B's bubble time); zb-h1:
                M(F+B+W) + (p-1)(F+B-W), bubble (p-1)/(3M+p-1) in units. The tick program's
                lock-step time is what this engine pays; the asynchronous one what an engine
                whose stages run free (MPMD, point-to-point sends) would.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

SCHEDULES = ("gpipe", "interleaved", "1f1b", "interleaved-1f1b", "zb-h1")
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


def needs(op: Op, stage: int, stages: int, virtual: int) -> tuple[Cell, ...]:
    """The cells `op` on `stage` waits for (see the module docstring)."""
    m, v, s, p = op.microbatch, op.chunk, stage, stages
    if op.kind == "F":
        return (("F", m, v, s - 1),) if s > 0 else (("F", m, v - 1, p - 1),) if v > 0 else ()
    if op.kind == "B":
        return ((("B", m, v, s + 1),) if s < p - 1 else (("B", m, v + 1, 0),) if v < virtual - 1
                else (("F", m, v, s),))
    return (("B", m, v, s),)


def place(queues: list[list[Op]], virtual: int = 1) -> Table:
    """Run each stage's op list in order, each op at the first tick after the cells it needs."""
    queues = [list(q) for q in queues]
    p, done, table = len(queues), {}, []
    while any(queues):
        t, row = len(table), []
        for s in range(p):
            op = queues[s][0] if queues[s] else None
            if op is not None and all(done.get(d, t) < t for d in needs(op, s, p, virtual)):
                queues[s].pop(0)
                done[(op.kind, op.microbatch, op.chunk, s)] = t
                row.append(op)
            else:
                row.append(None)
        if all(c is None for c in row):
            raise ValueError(f"op lists deadlock at tick {t}: {[q[0] for q in queues if q]}")
        table.append(row)
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


def timetable(schedule: str, stages: int, microbatches: int, virtual: int = 1) -> Table:
    """The schedule's table; `virtual` (V) is read by interleaved and interleaved-1f1b only."""
    if schedule == "1f1b":
        return one_f_one_b(stages, microbatches)
    if schedule == "interleaved-1f1b":
        if virtual < 2:
            raise ValueError(f"interleaved-1f1b needs virtual stages >= 2 (got {virtual}); V = 1 is 1f1b")
        return one_f_one_b(stages, microbatches, virtual)
    if schedule == "zb-h1":
        return zb_h1(stages, microbatches)
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


def _virtual(table: Table) -> int:
    return 1 + max(c.chunk for row in table for c in row if c is not None)


def with_backward(table: Table) -> Table:
    """A forward-only table (gpipe, interleaved) followed by its backward, the mirror image:
    B(m, v) on s at tick T + (T-1-t) for F(m, v) on s at tick t. Other tables unchanged."""
    if any(c is not None and c.kind != "F" for row in table for c in row):
        return table
    return table + [[None if c is None else Op("B", c.microbatch, c.chunk) for c in row] for row in table[::-1]]


def split(table: Table) -> bool:
    """Whether the table has W cells (B is the input gradient only)."""
    return any(c is not None and c.kind == "W" for row in table for c in row)


def costs(split_backward: bool = False, recompute: bool = False) -> dict[str, float]:
    """Cell costs in forwards: F 1, B 2 (input and weight gradients) or, split, B 1 and W 1;
    recompute adds the forward that B reruns (1f1b with model.remat=full)."""
    b = (1 if split_backward else 2) + (1 if recompute else 0)
    return {"F": 1, "B": b, "W": 1}


class Weighted(NamedTuple):
    time: float  # lock-step: sum over ticks of the most expensive cell
    bubble: float  # 1 - busy / (p · time)
    async_time: float  # each stage back to back, as early as dependencies allow
    async_bubble: float


def timeline(table: Table, cost: dict[str, float] | None = None) -> list[tuple[int, Op, float, float]]:
    """(stage, op, start, end) of every cell run asynchronously: each stage runs its cells in table
    order back to back, each as soon as the cells it needs ended (weighted time)."""
    table = with_backward(table)
    cost = cost or costs(split(table))
    p, v_count = len(table[0]), _virtual(table)
    free, end, spans = [0.0] * p, {}, []
    for row in table:  # a cell's dependencies sit at earlier ticks
        for s, op in enumerate(row):
            if op is not None:
                start = max([free[s]] + [end[d] for d in needs(op, s, p, v_count)])
                free[s] = end[(op.kind, op.microbatch, op.chunk, s)] = start + cost[op.kind]
                spans.append((s, op, start, free[s]))
    return spans


def weighted(table: Table, cost: dict[str, float] | None = None) -> Weighted:
    """Lock-step and asynchronous weighted time and bubble (module docstring); cost defaults to
    `costs(split(table))`."""
    table = with_backward(table)
    cost = cost or costs(split(table))
    p = len(table[0])
    busy = sum(cost[c.kind] for row in table for c in row if c is not None) / p
    time = sum(max((cost[c.kind] for c in row if c is not None), default=0) for row in table)
    async_time = max(end for *_, end in timeline(table, cost))
    return Weighted(time, 1 - busy / time, async_time, 1 - busy / async_time)


def in_flight(table: Table, until: str | None = None) -> list[int]:
    """Per stage, the peak number of (microbatch, chunk) whose F ran and whose last backward cell
    (`until`: default W where split, else B) has not: the activations the stage holds. gpipe and
    interleaved count their mirrored backward (all M·V)."""
    table = with_backward(table)
    until = until or ("W" if split(table) else "B")
    peaks = []
    for s in range(len(table[0])):
        live = peak = 0
        for row in table:
            op = row[s]
            if op is not None:
                live += (op.kind == "F") - (op.kind == until)
                peak = max(peak, live)
        peaks.append(peak)
    return peaks


def closed_form(schedule: str, stages: int, microbatches: int, virtual: int = 1) -> tuple[str, float]:
    """The tick bubble's closed form (as text) and its value."""
    p, m, v = stages, microbatches, virtual
    if schedule in ("gpipe", "1f1b"):
        return "(p-1)/(M+p-1)", (p - 1) / (m + p - 1)
    if schedule in ("interleaved", "interleaved-1f1b"):
        return "(p-1)/(V·M+p-1)", (p - 1) / (v * m + p - 1)
    if m < p:  # zb-h1 never reaches its steady state: 2M + 2p - 1 ticks
        return "1 - 3M/(2M+2p-1) (M < p)", 1 - 3 * m / (2 * m + 2 * p - 1)
    return "(p-1)/(3M+p-1)", (p - 1) / (3 * m + p - 1)


def summary(schedule: str, table: Table, stages: int, microbatches: int, virtual: int, cost: dict) -> str:
    """One line: ticks and bubble, weighted bubbles, closed form, peak in flight per stage."""
    w = weighted(table, cost)
    form, value = closed_form(schedule, stages, microbatches, virtual)
    idle = sum(c is None for row in table for c in row) // stages
    used = " ".join(f"{k}={cost[k]:g}" for k in ("F", "B", "W") if k != "W" or split(table))
    return (f"{schedule}: {len(table)} ticks, bubble {bubble(table):.4f} ({idle} idle ticks per stage); "
            f"weighted ({used}) lock-step {w.bubble:.4f}, asynchronous {w.async_bubble:.4f}; "
            f"closed form {form} = {value:.4f}; in flight {in_flight(table)}")


def draw(table: Table, path: str, title: str, cost: dict[str, float]) -> None:
    """The asynchronous timeline as a PNG: stages as rows, cells as wide as their cost."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    colours = {"F": "#4c72b0", "B": "#dd8452", "W": "#55a868"}
    spans = timeline(table, cost)
    p, end = len(table[0]), max(e for *_, e in spans)
    fig, ax = plt.subplots(figsize=(max(6.0, min(40.0, end * 0.35)), 0.6 * p + 1.4))
    for s, op, start, stop in spans:
        ax.barh(s, stop - start, left=start, color=colours[op.kind], edgecolor="white", height=0.9)
        ax.text((start + stop) / 2, s, str(op.microbatch) + (f".{op.chunk}" if op.chunk else ""),
                ha="center", va="center", fontsize=7, color="white")
    ax.set_yticks(range(p), [f"stage {s}" for s in range(p)])
    ax.invert_yaxis()
    ax.set_xlim(0, end)
    ax.set_xlabel("time (F = 1)")
    kinds = [k for k in "FBW" if any(op.kind == k for _, op, *_ in spans)]
    ax.legend(handles=[Patch(color=colours[k], label=k) for k in kinds], loc="upper left", bbox_to_anchor=(1.0, 1.0),
              fontsize=8)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)


def main(argv: list[str]) -> int:
    parser = _Parser(prog="python -m pipeline.schedule", description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", choices=(*SCHEDULES, "all"), default="gpipe")
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--virtual-stages", type=int, default=2,
                        help="V, for interleaved and interleaved-1f1b")
    parser.add_argument("--recompute", action="store_true",
                        help="B reruns the stage forward (1f1b with model.remat=full): B costs one more")
    parser.add_argument("--png", help="draw the timetable (asynchronous weighted time) to this PNG")
    args = parser.parse_args(argv)
    p, m, v = args.stages, args.microbatches, args.virtual_stages
    if p < 1 or m < 1 or v < 1:
        return _error(f"--stages ({p}), --microbatches ({m}) and --virtual-stages ({v}) must be >= 1")
    if args.schedule == "all":
        if args.png:
            return _error("--png draws one schedule, not --schedule all")
        print(f"p={p} M={m} V={v}")
        for schedule in SCHEDULES:
            try:
                table = timetable(schedule, p, m, v)
            except ValueError as e:
                print(f"{schedule}: n/a ({e})")
                continue
            print(summary(schedule, table, p, m, v, costs(split(table), args.recompute)))
        return 0
    if args.schedule == "interleaved" and m % p:
        return _error(f"interleaved needs --microbatches divisible by --stages ({p})")
    try:
        table = timetable(args.schedule, p, m, v)
    except ValueError as e:
        return _error(str(e))
    cost = costs(split(table), args.recompute)
    print(format_table(table))
    print(summary(args.schedule, table, p, m, v, cost))
    if args.png:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            return _error("--png needs matplotlib: pip install 'meshtrain[profile]'")
        w = weighted(table, cost)
        used = " ".join(f"{k}={cost[k]:g}" for k in "FBW" if k != "W" or split(table))
        draw(table, args.png, f"{args.schedule} p={p} M={m}" + (f" V={v}" if _virtual(table) > 1 else "")
             + f": asynchronous time ({used}), bubble {w.async_bubble:.3f}", cost)
        print(f"wrote {args.png}")
    return 0


def _error(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


def format_table(table: Table) -> str:
    width = max(len(str(c)) for row in table for c in row if c is not None) + 1
    stages = len(table[0])
    lines = ["tick " + "".join(f"s{s}".rjust(width) for s in range(stages))]
    for t, row in enumerate(table):
        lines.append(f"{t:>4} " + "".join(("." if c is None else str(c)).rjust(width) for c in row))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
