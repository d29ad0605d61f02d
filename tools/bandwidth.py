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
datasheet link. A negative fitted latency counts as 0 (the least-squares fit can dip below it).
The latency counts once per axis and step (a floor: XLA combines the gradient reductions, but
the tensor axis pays it per layer). No jax here; the file is read before jax starts, so a bad
one is one `error:` line: a CPU smoke record (`smoke` set, or backend cpu: its figures say
nothing about a network), an op tools.busbw does not name, a latency or busbw not finite.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from pathlib import Path

from configs import ConfigError
from sharding.mesh import AXES
from tools.busbw import OPS

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
        return (f"measured {self.path} ({link.op}: {link.latency_s * 1e6:.1f} us + bytes / "
                f"{link.bytes_per_s / 1e9:.3g} GB/s, on {self.mesh})")


def add_bandwidth_arg(p: argparse.ArgumentParser) -> None:
    """--bandwidth FILE: tools.plan's and train.py --dry-run's measured links."""
    p.add_argument("--bandwidth", type=Path, metavar="FILE.json",
                   help="time each mesh axis the record of python -m tools.collectives measures with its fit "
                        "(latency + bytes / busbw) instead of the NVLink/InfiniBand datasheet")


def load(path: Path) -> Measured:
    """The record at `path`, checked: ConfigError naming --bandwidth and the field when it is not
    one, or when it is a CPU smoke run."""
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
    env = record.get("environment")
    backend = env.get("backend") if isinstance(env, dict) else None
    if record.get("smoke") or backend == "cpu":
        raise ConfigError(f"{where}: measured on {backend or 'cpu'} devices (a smoke run), not over a GPU "
                          "interconnect; pass a record python -m tools.collectives made on the GPUs you plan")
    for axes, ops in fit.items():
        names = axes.split("+")
        if any(n not in AXES for n in names) or not isinstance(ops, dict):
            raise ConfigError(f"{where}: fit key {axes!r} is not mesh axes ({' '.join(AXES)}, joined by +) "
                              "with ops under it")
        for op, f in ops.items():
            if op not in OPS:
                raise ConfigError(f"{where}: fit {axes} {op!r} is not an op; the ops are {', '.join(OPS)}")
            problem = _fit_problem(f)
            if problem:
                raise ConfigError(f"{where}: fit {axes} {op} {problem}; pass the record python -m "
                                  "tools.collectives writes")
    return Measured(str(path), str(record.get("mesh", "?")), fit)


def _fit_problem(f: object) -> str | None:
    """What is wrong with one op's fit: None when latency_us is a finite number and busbw_GBps a
    finite positive number or null."""
    if not isinstance(f, dict):
        return f"= {f!r:.60}: expected latency_us and busbw_GBps"
    latency, busbw = f.get("latency_us"), f.get("busbw_GBps")
    if not _number(latency) or not math.isfinite(latency):
        return f"latency_us={latency!r} is not a finite number"
    if busbw is not None and (not _number(busbw) or not 0 < busbw < math.inf):
        return f"busbw_GBps={busbw!r} is not a finite positive number (or null)"
    return None


def _number(x: object) -> bool:
    """A JSON number (an int or float, not a bool)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool)
