"""nccl-tests' conventions for one collective over a group of n ranks: the ops, the message
size and element count, algbw and busbw, and the latency + bandwidth fit (pure arithmetic, no
jax; the programs that measure them: tools/collectives.py).

Conventions, those of nccl-tests (doc/PERFORMANCE.md of github.com/NVIDIA/nccl-tests):
- Message size S: the per-rank buffer for all-reduce, all-to-all and permute; the output (all
  ranks' pieces together) for all-gather; the input (the whole array before it is scattered)
  for reduce-scatter. count = S / bytes per element, rounded down to a multiple of the group
  size n where the op splits the buffer into n pieces (nccl-tests rounds the same way).
- algbw = S / t, busbw = algbw · factor, in GB/s (1e9 bytes): factor 2(n-1)/n for all-reduce,
  (n-1)/n for all-gather, reduce-scatter and all-to-all, 1 for permute. busbw is what a link
  carries, comparable across group sizes and with the hardware's peak.
- Per op and axes: the latency floor (the time at the smallest size), the smallest size that
  reaches half the peak busbw, and a least-squares fit t = latency + S·factor / busbw (the
  record's `fit`, per axes and op, for the planner: latency_us and busbw_GBps).
- The printed table (`format_block`): nccl-tests' columns, then the floor, half-peak size, fit.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Op:
    """One collective: its HLO kind, whether it splits the buffer in n pieces, its bus factor."""

    name: str
    kind: str  # tools.hlo's kind
    splits: bool  # count must be a multiple of n

    def factor(self, n: int) -> float:
        """nccl-tests' busbw / algbw for a group of n."""
        return {"all-reduce": 2 * (n - 1) / n, "collective-permute": 1.0}.get(self.kind, (n - 1) / n)

    def input_count(self, count: int, n: int) -> int:
        """Elements per rank going in, for a message of `count` elements."""
        return count // n if self.name == "all-gather" else count


OPS = {op.name: op for op in (
    Op("all-reduce", "all-reduce", False),
    Op("all-gather", "all-gather", True),
    Op("reduce-scatter", "reduce-scatter", True),
    Op("all-to-all", "all-to-all", True),
    Op("permute", "collective-permute", False),
)}


@dataclass(frozen=True)
class Row:
    """One timed program."""

    op: str
    axes: str  # e.g. data+tensor
    group: int
    size: int  # S in bytes (the convention above)
    count: int  # S in elements
    time_us: float
    algbw_GBps: float
    busbw_GBps: float


def smallest_message(ops: list[Op], groups: list[int], itemsize: int) -> int:
    """The fewest bytes every program of `ops` over groups of these sizes carries: one element, one
    per rank where the op splits the buffer (`message_count`)."""
    return itemsize * max(n if op.splits else 1 for op in ops for n in groups)


def message_count(op: Op, size: int, itemsize: int, n: int) -> int:
    """Elements of a message of `size` bytes: rounded down to a multiple of n when op splits it."""
    count = max(1, size // itemsize)
    return max(n, count // n * n) if op.splits else count


def bandwidths(size: int, seconds: float, factor: float) -> tuple[float, float]:
    """(algbw, busbw) in GB/s of a message of `size` bytes taking `seconds`."""
    algbw = size / seconds / 1e9
    return algbw, algbw * factor


def fit_model(sizes: list[int], seconds: list[float], factor: float) -> dict:
    """Least squares t = latency + size·factor / busbw: {latency_us, busbw_GBps} (busbw None when
    the times do not grow with size)."""
    bus_bytes = np.array(sizes, dtype=float) * factor
    a = np.stack([np.ones_like(bus_bytes), bus_bytes], axis=1)
    (latency, per_byte), *_ = np.linalg.lstsq(a, np.array(seconds), rcond=None)
    return {"latency_us": float(latency * 1e6), "busbw_GBps": float(1 / per_byte / 1e9) if per_byte > 0 else None}


def summarize(rows: list[Row]) -> dict:
    """Latency floor (time at the smallest size), peak busbw and the first size reaching half of it."""
    peak = max(r.busbw_GBps for r in rows)
    half = next(r.size for r in rows if r.busbw_GBps >= peak / 2)
    return {"op": rows[0].op, "axes": rows[0].axes, "group": rows[0].group, "latency_floor_us": rows[0].time_us,
            "peak_busbw_GBps": peak, "half_peak_size": half}


def format_block(rows: list[Row], op: Op, dtype: str) -> str:
    """nccl-tests' columns for one op and axes, then its floor, half-peak size and fit."""
    s = summarize(rows)
    fit = fit_model([r.size for r in rows], [r.time_us / 1e6 for r in rows], op.factor(rows[0].group))
    bw = f"{fit['busbw_GBps']:.3g} GB/s" if fit["busbw_GBps"] else "none (time does not grow with size)"
    lines = [f"# {op.name} over {rows[0].axes} (n={rows[0].group}), {dtype}",
             f"# {'size(B)':>12} {'count':>12} {'time(us)':>10} {'algbw(GB/s)':>12} {'busbw(GB/s)':>12}"]
    lines += [f"  {r.size:>12} {r.count:>12} {r.time_us:>10.1f} {r.algbw_GBps:>12.3f} {r.busbw_GBps:>12.3f}"
              for r in rows]
    lines.append(f"# latency floor {s['latency_floor_us']:.1f} us; peak busbw {s['peak_busbw_GBps']:.3f} GB/s, "
                 f"half of it first at {s['half_peak_size']} B; fit: latency {fit['latency_us']:.1f} us, busbw {bw}")
    return "\n".join(lines) + "\n"
