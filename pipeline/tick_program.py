"""The tick program of the 1F1B family (pipeline/one_f_one_b.py), compiled on the host from
pipeline/tables.py's timetable: per tick and stage, the cell to run (an index into
pipeline/cells.py's CELLS or SPLIT_CELLS), its microbatch and chunk, and the slot of every value
in the stage's buffers (`inputs`, `inbox`, `residuals`, `stash`). Slots are assigned lowest
free first as values arrive and freed when read, so each buffer has as many slots as the stage
ever holds at once: flat in M (the counts are in one_f_one_b.py's docstring).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from pipeline.tables import BACKWARD, FORWARD, WEIGHT, cells, timetable

BACKWARD_LAST = WEIGHT + 1  # the cells: the table's IDLE, FORWARD, BACKWARD, WEIGHT, and B of chunk V-1 on stage p-1


class Program(NamedTuple):
    """The table as int32 arrays [ticks, p] that the tick program indexes with (tick, stage):
    each cell, and the buffer slots it and the arriving values use (-1: nothing arrives)."""

    branch: np.ndarray  # the cell, an index into CELLS
    microbatch: np.ndarray  # the cell's microbatch (0 when idle)
    chunk: np.ndarray  # the cell's chunk v (0 when idle)
    recv_f: np.ndarray  # `inputs` slot for the forward value arriving from s-1, -1 none
    recv_b: np.ndarray  # `inbox` slot for the gradient arriving from s+1, -1 none
    x_slot: np.ndarray  # `inputs` slot of the cell's input (F, B on p-1 chunk V-1)
    g_slot: np.ndarray  # `inbox` slot of the cell's output gradient (B)
    r_slot: np.ndarray  # `residuals` slot the F writes and its B (split: its W) reads
    s_slot: np.ndarray  # split backward: `stash` slot the B writes and its W reads
    inputs: int  # slots per buffer
    inbox: int
    residuals: int
    stash: int
    split: bool  # the table splits B (input gradient) and W (weight gradient): zb-h1


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
    kind, micro, chunk = cells(timetable(schedule, p, m_count, v_count))
    ticks, split = len(kind), bool((kind == WEIGHT).any())
    last = lambda s, v: s == p - 1 and v == v_count - 1  # noqa: E731  (head and loss)
    branch = kind.copy()
    arrays = {name: np.full((ticks, p), -1, np.int32) for name in ("recv_f", "recv_b")}
    arrays |= {name: np.zeros((ticks, p), np.int32) for name in ("x_slot", "g_slot", "r_slot", "s_slot")}
    sizes = dict.fromkeys(("inputs", "inbox", "residuals", "stash"), 1)
    for s in range(p):
        slots = {name: _Slots() for name in sizes}
        for t in range(ticks):
            if t > 0:  # what the neighbours sent last tick
                src = (s - 1) % p
                k, m, v = kind[t - 1, src], micro[t - 1, src], chunk[t - 1, src]
                if k == FORWARD and not last(src, v) and (s > 0 or (src == p - 1 and v_count > 1)):
                    arrays["recv_f"][t, s] = slots["inputs"].take((m, v + (s == 0)))
                src = (s + 1) % p
                k, m, v = kind[t - 1, src], micro[t - 1, src], chunk[t - 1, src]
                if k == BACKWARD and (s < p - 1 or (src == 0 and v > 0)):
                    arrays["recv_b"][t, s] = slots["inbox"].take((m, v - (s == p - 1)))
            k, item = kind[t, s], (micro[t, s], chunk[t, s])
            if k == FORWARD:
                if (s, item[1]) == (0, 0):  # stage 0 chunk 0 embeds its input
                    arrays["x_slot"][t, s] = 0
                elif last(s, item[1]):  # its output replaces its input in the slot, for the head at B
                    arrays["x_slot"][t, s] = slots["inputs"].held[item]
                else:
                    arrays["x_slot"][t, s] = slots["inputs"].free(item)
                arrays["r_slot"][t, s] = slots["residuals"].take(item)
            elif k == BACKWARD:
                if last(s, item[1]):
                    branch[t, s] = BACKWARD_LAST
                    arrays["x_slot"][t, s] = slots["inputs"].free(item)
                else:
                    arrays["g_slot"][t, s] = slots["inbox"].free(item)
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
    return Program(branch, micro, chunk, **arrays, **sizes, split=split)
