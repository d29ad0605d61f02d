"""Measured links for the planner: read the record of `python -m tools.collectives` (--bandwidth).

The record's `fit` holds, per mesh axis (or +-combination) and op, a least-squares fit
t = latency + S·factor / busbw. The contract's bytes per axis (tools/traffic.py) are bus bytes
(S·factor: 2G(N-1)/N is an all-reduce of G), so an axis's time is latency + bytes / busbw. Each
axis is timed with the op that dominates it in the contract, the first of these the record fits
with a bandwidth:

  data      all-reduce                  the gradients
  fsdp      all-gather, reduce-scatter  two gathers of the weights, one scatter of the gradients
  tensor    all-reduce                  the layers' activations (the same bytes under SP)
  stage     permute                     stage boundaries
  expert    all-to-all, all-reduce      the MoE dispatch and combine (the gradients of the
                                        non-expert weights otherwise)
  sequence  permute, all-gather         K and V round the ring (context_impl=ring); otherwise
            all-gather, permute         gathered (allgather, gspmd)

Combinations (`data+tensor`) are ignored: the estimate times each axis on its own. An axis the
record does not cover, or whose op's time did not grow with size (busbw null), keeps the
datasheet link. A negative fitted latency counts as 0. The latency counts once per axis and step (a floor: XLA combines the gradient
reductions, but the tensor axis pays it per layer). No jax here; the file is read before jax
starts, so a bad one is one `error:` line.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

from configs import ConfigError
from sharding.mesh import AXES

PREFERRED = {"data": ("all-reduce",), "fsdp": ("all-gather", "reduce-scatter"), "tensor": ("all-reduce",),
             "stage": ("permute",), "expert": ("all-to-all", "all-reduce")}
SEQUENCE = {"ring": ("permute", "all-gather"), "other": ("all-gather", "permute")}


@dataclass(frozen=True)
class Link:
    """One axis's measured link: the op whose fit it uses, latency (s) and bus bandwidth (B/s)."""

    op: str
    latency_s: float
    bytes_per_s: float


@dataclass(frozen=True)
class Measured:
    """The fit of a tools.collectives record, per mesh axis and op (GB/s and us, as written)."""

    path: str
    mesh: str
    smoke: bool
    fit: dict[str, dict[str, dict]]

    def links(self, context_impl: str) -> dict[str, Link]:
        """{axis: Link} for the axes the record measures, by the op preferences above."""
        found = {}
        for axis in AXES:
            prefs = SEQUENCE["ring" if context_impl == "ring" else "other"] if axis == "sequence" else PREFERRED[axis]
            ops = self.fit.get(axis, {})
            op = next((o for o in prefs if ops.get(o, {}).get("busbw_GBps")), None)
            if op:
                found[axis] = Link(op, max(0.0, ops[op]["latency_us"] * 1e-6), ops[op]["busbw_GBps"] * 1e9)
        return found

    def label(self, link: Link) -> str:
        """'measured FILE (all-reduce: 25.0 us + bytes / 180 GB/s, on dp=2,tp=4)'."""
        smoke = ", a CPU smoke run" if self.smoke else ""
        return (f"measured {self.path} ({link.op}: {link.latency_s * 1e6:.1f} us + bytes / "
                f"{link.bytes_per_s / 1e9:.3g} GB/s, on {self.mesh}{smoke})")


def add_bandwidth_arg(p: argparse.ArgumentParser) -> None:
    """--bandwidth FILE: tools.plan's and train.py --dry-run's measured links."""
    p.add_argument("--bandwidth", type=Path, metavar="FILE.json",
                   help="time each mesh axis the record of python -m tools.collectives measures with its fit "
                        "(latency + bytes / busbw) instead of the NVLink/InfiniBand datasheet")


def load(path: Path) -> Measured:
    """The record at `path`, checked: ConfigError naming --bandwidth when it is not one."""
    where = f"--bandwidth {path}"
    try:
        record = json.loads(path.read_text())
    except OSError as e:
        raise ConfigError(f"{where}: cannot read it ({e.strerror}); pass the JSON record that "
                          "python -m tools.collectives writes") from None
    except ValueError as e:
        raise ConfigError(f"{where}: not JSON ({e}); pass the record python -m tools.collectives writes") from None
    fit = record.get("fit") if isinstance(record, dict) else None
    if not isinstance(fit, dict) or not fit:
        raise ConfigError(f"{where}: no `fit` per mesh axis; pass the record python -m tools.collectives writes")
    for axes, ops in fit.items():
        names = axes.split("+")
        if any(n not in AXES for n in names) or not isinstance(ops, dict):
            raise ConfigError(f"{where}: fit key {axes!r} is not mesh axes ({' '.join(AXES)}, joined by +) "
                              "with ops under it")
        for op, f in ops.items():
            if not _valid_fit(f):
                raise ConfigError(f"{where}: fit {axes} {op} = {f!r}: expected latency_us (a number) and "
                                  "busbw_GBps (a positive number, or null)")
    return Measured(str(path), str(record.get("mesh", "?")), bool(record.get("smoke")), fit)


def _valid_fit(f: object) -> bool:
    if not isinstance(f, dict):
        return False
    latency, busbw = f.get("latency_us"), f.get("busbw_GBps")
    number = (int, float)
    return (isinstance(latency, number) and not isinstance(latency, bool)
            and (busbw is None or (isinstance(busbw, number) and not isinstance(busbw, bool) and busbw > 0)))
