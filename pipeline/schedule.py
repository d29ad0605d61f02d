"""Pipeline timetables weighed: time and bubble by cell cost, activations in flight, the closed
forms, and the command line that prints and draws them (the tables: pipeline/tables.py).

  python -m pipeline.schedule --schedule 1f1b --stages 4 --microbatches 8
  python -m pipeline.schedule --schedule all --stages 4 --microbatches 8
  python -m pipeline.schedule --schedule zb-h1 --stages 4 --microbatches 8 --png zb.png
  python -m pipeline.schedule --schedule zbv --stages 4 --microbatches 8
  python -m pipeline.schedule --schedule 1f1b --stages 4 --microbatches 8 --head 0.77

Weighted time (`weighted`, costs per cell kind; default F = 1, B = 2, W = 1 unsplit, B = W = 1
split; B = 3 where 1f1b recomputes the stage forward in B, `costs`). gpipe and interleaved are
weighed with their mirrored backward (`with_backward`). busy = a stage's cost sum.
  lock-step     every tick lasts as long as its most expensive cell: time = sum over ticks of
                max cost, bubble 1 - busy/(p·time). The tick program's figure.
                gpipe 3(M+p-1), interleaved 3(VM+p-1) (chunk costs): bubbles (p-1)/(M+p-1),
                (p-1)/(VM+p-1); 1f1b (p >= 2; its steady ticks pair an F with a B and last a B):
                2M·B + (p-1)(F+B) - (B-F); B = 2: 4M + 3p - 4, bubble 1 - 3M/(4M+3p-4),
                0.40 at p = 4, M = 8 (B = 3: 6M + 4p - 6); zb-h1 (units) 3M + p - 1, bubble
                (p-1)/(3M+p-1), zbv 6M + p - 1; interleaved-1f1b: no short form (e.g. p = 4, V = 2, M = 8:
                68 against 57 asynchronous), computed from the table.
  asynchronous  each stage runs its ops back to back, each as soon as its dependencies ended
                (weighted time, same order as the table): gpipe, 1f1b: (M+p-1)(F+B), bubble
                (p-1)/(M+p-1); interleaved, interleaved-1f1b: (VM+p-1)(F+B) in chunk costs, bubble
                (p-1)/(VM+p-1): the bubble time (p-1)(F+B) is (p-1)/(VM) of the ideal VM(F+B)
                (a chunk cell is 1/V of a stage's layers: (p-1)/V of 1F1B's bubble time); zb-h1:
                M(F+B+W) + (p-1)(F+B-W), bubble (p-1)/(3M+p-1) in units; zbv (half-stage cells,
                F = B = W = 1): 6M + p - 1 both ways (M >= p, p <= 4; tables.zbv), bubble
                (p-1)/(6M+p-1): p-1 idle half-stage cells per stage, half of zb-h1's idle time. The tick program's
                lock-step time is what this engine pays; the asynchronous one what an engine
                whose stages run free (MPMD, point-to-point sends) would.
Head (`costs(head=h)`, 0 by default): the final norm, head and loss of one microbatch, forward and
backward, in chunk forwards (`tools.pipeline_figures.cell_costs` takes it from the FLOPs: 0.77 for
1b on pp=4). The 1F1B family's tick program runs it over the stages (pipeline/head.py) at each
tick whose head stage runs the last chunk's B (`head_cell`), its vocabulary split p ways: in
lock-step each of those M ticks lasts h/p longer, all of it busy (its collectives not counted);
on the head stage alone every stage waited h at each (zb-h1's lock-step bubble for 1b on pp=4 at
M = 8: 0.230, now 0.105; the step 1.23x the headless one in forwards, now 1.06x). The
asynchronous timeline keeps the head in its stage's B cell, where an engine whose stages run
free would run it. gpipe and interleaved deal the M outputs out,
ceil(M/p) to each stage (pipeline.circular.dealt), and run those heads between the ticks and
their mirrored backward: h·ceil(M/p) on every stage, M·h/p of it busy.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

from configs.parser import Parser
from pipeline.tables import (SCHEDULES, Op, Table, bubble, forward_only, needs, route, split, timetable, v_shape,
                             virtual_stages, with_backward)
from sharding.checks import dealt_heads


def costs(split_backward: bool = False, recompute: bool = False, head: float = 0.0) -> dict[str, float]:
    """Cell costs in forwards: F 1, B 2 (input and weight gradients) or, split, B 1 and W 1;
    recompute adds the forward that B reruns (1f1b with model.remat=full); head: the final norm,
    head and loss of one microbatch, forward and backward (module docstring, Head)."""
    b = (1 if split_backward else 2) + (1 if recompute else 0)
    return {"F": 1, "B": b, "W": 1, "head": head}


class Weighted(NamedTuple):
    time: float  # lock-step: sum over ticks of the most expensive cell
    bubble: float  # 1 - busy / (p · time)
    async_time: float  # each stage back to back, as early as dependencies allow
    async_bubble: float


def head_cell(op: Op, stage: int, stages: int, virtual: int, vee: bool) -> bool:
    """Whether `op` on `stage` runs the head and loss first: the B of the model's last chunk
    (stage p-1's chunk V-1; zbv's stage 0 chunk 1), whose F output goes nowhere else."""
    return op.kind == "B" and route("F", stage, op.chunk, stages, virtual, vee) is None


def _microbatches(table: Table) -> int:
    return 1 + max(c.microbatch for row in table for c in row if c is not None)


def _dealt(table: Table) -> int:
    """gpipe and interleaved (forward-only tables): the heads each stage runs between the ticks
    and their mirrored backward, ceil(M/p) (sharding.checks.dealt_heads); else 0."""
    return dealt_heads(_microbatches(table), len(table[0])) if forward_only(table) else 0


def _cost_of(table: Table, cost: dict[str, float]) -> Callable[[int, Op], float]:
    """(stage, op) -> the cell's weighted cost: its kind's, plus `head` on the 1F1B family's head
    cell in the asynchronous timeline (gpipe and interleaved run their heads apart: `_dealt`)."""
    p, v_count, vee = len(table[0]), virtual_stages(table), v_shape(table)
    head = 0.0 if _dealt(table) else cost.get("head", 0.0)
    at = {(s, v) for s in range(p) for v in range(v_count) if head_cell(Op("B", 0, v), s, p, v_count, vee)}
    return lambda s, op: cost[op.kind] + (head if op.kind == "B" and (s, op.chunk) in at else 0.0)


def timeline(table: Table, cost: dict[str, float] | None = None) -> list[tuple[int, Op, float, float]]:
    """(stage, op, start, end) of every cell run asynchronously: each stage runs its cells in table
    order back to back, each as soon as the cells it needs ended (weighted time). gpipe's and
    interleaved's backward starts once every forward and the heads dealt to the stages ended."""
    cost = cost or costs(split(table))
    dealt, forward_ticks, cost_of = _dealt(table), len(table), _cost_of(table, cost)
    table = with_backward(table)
    p, v_count, vee = len(table[0]), virtual_stages(table), v_shape(table)
    free, end, spans, heads_end = [0.0] * p, {}, [], 0.0
    for t, row in enumerate(table):  # a cell's dependencies sit at earlier ticks
        if dealt and t == forward_ticks:  # the heads: after every forward, before any backward
            heads_end = max(free) + dealt * cost.get("head", 0.0)
        for s, op in enumerate(row):
            if op is not None:
                start = max([free[s], heads_end] + [end[d] for d in needs(op, s, p, v_count, vee)])
                free[s] = end[(op.kind, op.microbatch, op.chunk, s)] = start + cost_of(s, op)
                spans.append((s, op, start, free[s]))
    return spans


def _lockstep(table: Table, cost: dict[str, float]) -> tuple[float, float]:
    """(busy, lock-step time): a stage's mean cost sum, and the sum over ticks of the most
    expensive cell; gpipe and interleaved add their heads, ceil(M/p) on every stage at once, M
    of them real; the 1F1B family its M heads over the stages, each h/p on every stage."""
    dealt, whole, head = _dealt(table), with_backward(table), cost.get("head", 0.0)
    cost_of, p = _cost_of(table, cost | {"head": 0.0}), len(whole[0])
    heads = dealt * head if dealt else _microbatches(table) * head / p
    real_heads = _microbatches(table) / p * head
    busy = sum(cost_of(s, c) for row in whole for s, c in enumerate(row) if c is not None) / p + real_heads
    time = sum(max((cost_of(s, c) for s, c in enumerate(row) if c is not None), default=0) for row in whole) + heads
    return busy, time


def lockstep_bubble(table: Table, cost: dict[str, float]) -> float:
    """`weighted(table, cost).bubble` without the asynchronous timeline (what the planner reads)."""
    busy, time = _lockstep(table, cost)
    return 1 - busy / time


def weighted(table: Table, cost: dict[str, float] | None = None) -> Weighted:
    """Lock-step and asynchronous weighted time and bubble (module docstring); cost defaults to
    `costs(split(table))`."""
    cost = cost or costs(split(with_backward(table)))
    busy, time = _lockstep(table, cost)
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
    if schedule == "zbv":  # half-stage cells, 6M busy per stage; M >= p, p <= 4 (tables.zbv: some p, M more)
        return "(p-1)/(6M+p-1)", (p - 1) / (6 * m + p - 1)
    if m < p:  # zb-h1 never reaches its steady state: 2M + 2p - 1 ticks
        return "1 - 3M/(2M+2p-1) (M < p)", 1 - 3 * m / (2 * m + 2 * p - 1)
    return "(p-1)/(3M+p-1)", (p - 1) / (3 * m + p - 1)


def summary(schedule: str, table: Table, stages: int, microbatches: int, virtual: int, cost: dict) -> str:
    """One line: ticks and bubble, weighted bubbles, closed form, peak in flight per stage."""
    w = weighted(table, cost)
    form, value = closed_form(schedule, stages, microbatches, virtual)
    idle = sum(c is None for row in table for c in row) // stages
    used = _used(table, cost)
    return (f"{schedule}: {len(table)} ticks, bubble {bubble(table):.4f} ({idle} idle ticks per stage); "
            f"weighted ({used}) lock-step {w.bubble:.4f}, asynchronous {w.async_bubble:.4f}; "
            f"closed form {form} = {value:.4f}; in flight {in_flight(table)}")


def draw(table: Table, path: Path, title: str, cost: dict[str, float]) -> None:
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


def main(argv: list[str]) -> int:
    parser = Parser(__doc__.splitlines()[0], prog="python -m pipeline.schedule")
    parser.add_argument("--schedule", choices=(*SCHEDULES, "all"), default="gpipe")
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--virtual-stages", type=int, default=2,
                        help="V, for interleaved and interleaved-1f1b")
    parser.add_argument("--recompute", action="store_true",
                        help="B reruns the stage forward (1f1b with model.remat=full): B costs one more")
    parser.add_argument("--head", type=float, default=0.0,
                        help="the head and loss of one microbatch, forward and backward, in chunk forwards "
                             "(module docstring, Head; 0.77 for 1b on pp=4): default 0, left out")
    parser.add_argument("--png", type=Path, help="draw the timetable (asynchronous weighted time) to this PNG")
    args = parser.parse_args(argv)
    p, m, v = args.stages, args.microbatches, args.virtual_stages
    if p < 1 or m < 1 or v < 1:
        return _error(f"--stages ({p}), --microbatches ({m}) and --virtual-stages ({v}) must be >= 1")
    if not 0 <= args.head < float("inf"):
        return _error(f"--head {args.head}: the head's cost is a finite number of chunk forwards >= 0, "
                      "e.g. --head 0.77")
    if args.png:  # checked, its folder made, before anything is printed
        if args.png.suffix.lower() != ".png":  # matplotlib refuses another suffix, adds .png to none
            return _error(f"--png {args.png} is not a .png name; name the picture to write, e.g. "
                          f"{args.png.with_suffix('.png') if args.png.suffix else str(args.png) + '.png'}")
        try:
            args.png.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:  # a path through a file, ...
            return _error(f"--png {args.png}: cannot make its folder ({e.strerror or e}); choose another --png")
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
            print(summary(schedule, table, p, m, v, costs(split(table), args.recompute, args.head)))
        return 0
    if args.schedule == "interleaved" and m % p:
        return _error(f"interleaved needs --microbatches divisible by --stages ({p})")
    try:
        table = timetable(args.schedule, p, m, v)
    except ValueError as e:
        return _error(str(e))
    cost = costs(split(table), args.recompute, args.head)
    print(format_table(table))
    print(summary(args.schedule, table, p, m, v, cost))
    if args.png:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            return _error("--png needs matplotlib: pip install 'meshtrain[profile]'")
        w = weighted(table, cost)
        used = _used(table, cost)
        try:
            draw(table, args.png, f"{args.schedule} p={p} M={m}" + (f" V={v}" if virtual_stages(table) > 1 else "")
                 + f": asynchronous time ({used}), bubble {w.async_bubble:.3f}", cost)
        except OSError as e:  # not writable, ...
            return _error(f"--png {args.png}: cannot write it ({e.strerror or e}); choose another --png")
        print(f"wrote {args.png}")
    return 0


def _used(table: Table, cost: dict[str, float]) -> str:
    """The costs that weigh the table, as the CLI prints them: F, B, W where split, the head where counted."""
    kinds = ("F", "B", "W", "head") if split(table) else ("F", "B", "head")
    return " ".join(f"{k}={cost[k]:g}" for k in kinds if k != "head" or cost.get(k))


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

