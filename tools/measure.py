"""What every measurement shares (the benches and tools.collectives): the record's head, its JSON
file under bench/results/, timing, and the checks of their flags before anything is measured.

A record (JSON, one file per run) starts with the command that made it, the time, the machine
and the package versions (`environment`); only process 0 writes it. Timing waits for the device
(`jax.block_until_ready`) before reading the clock, so a figure is the work, not its dispatch.
Placed below tools/ in the layers, so that a tool can write a record; bench/common.py adds what
the benches of a train step share.

No jax at import: the entry points set XLA_FLAGS (cli.request_fake_devices) before jax starts.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

from cli import check_creatable
from configs import ConfigError

if TYPE_CHECKING:
    import jax

PACKAGES = ("jax", "jaxlib", "flax", "optax")
RESULTS = Path("bench/results")


def run_record(module: str, argv: list[str]) -> dict:
    """The command (as `python -m module argv...`) and the local time of a run."""
    return {"command": shlex.join(["python", "-m", module, *argv]), "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def environment(devices: Sequence[jax.Device]) -> dict:
    """The machine, the package versions and the backend the figures of `devices` come from."""
    import jax

    def version(pkg: str) -> str | None:
        try:
            return importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            return None

    return {
        "platform": platform.platform(),
        "processor": platform.processor() or _cpu_model(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "versions": {p: version(p) for p in PACKAGES},
        "backend": jax.default_backend(),
        "device_kind": devices[0].device_kind,
        "device_count": jax.device_count(),
        "mesh_devices": len(devices),
    }


def _cpu_model() -> str:
    """The CPU model name from /proc/cpuinfo (platform.processor() is empty on Linux)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return ""
    return next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), "")


def check_at_least(args: argparse.Namespace, minimum: int, *flags: str) -> None:
    """Refuse the first of `flags` (e.g. '--steps'; a list value: each of its items) below `minimum`."""
    for flag in flags:
        value = getattr(args, flag.removeprefix("--").replace("-", "_"))
        values = value if isinstance(value, list) else [value]
        if any(v is not None and v < minimum for v in values):
            text = ",".join(map(str, values))
            raise ConfigError(f"{flag} {text}: must be >= {minimum}")


def int_list(text: str) -> list[int]:
    """argparse type of a comma-separated list of integers ('64,128'); an empty list is refused."""
    values = [int(x) for x in text.split(",") if x.strip()]
    if not values:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers, e.g. 64,128")
    return values


def file_path(text: str) -> Path:
    """argparse type of a file to write (--out, --png): a Path, refusing a name that ends in a
    separator (Path would drop it and write a file named like the folder the user meant)."""
    if text.endswith(("/", os.sep)):
        raise argparse.ArgumentTypeError(f"{text} names a folder; name the file to write, e.g. {text}record.json")
    return Path(text)


def png_path(text: str) -> Path:
    """argparse type of a picture to write (--png): `file_path` ending in .png (matplotlib would
    refuse another suffix, or add .png to a name without one and write a file not named)."""
    path = file_path(text)
    if path.suffix.lower() != ".png":
        raise argparse.ArgumentTypeError(f"{text} is not a .png name; name the picture to write, e.g. "
                                         f"{path.with_suffix('.png') if path.suffix else str(path) + '.png'}")
    return path


def check_out(out: Path | None, flag: str = "--out") -> None:
    """Refuse, before anything is measured, a record that could not be written: `out` a directory,
    under a file, or in a folder this process cannot write (None: the default folder, RESULTS)."""
    folder = out.parent if out else RESULTS
    where = f"{flag} {out}" if out else f"{RESULTS}/ (the default of {flag})"
    if out and out.is_dir():
        raise ConfigError(f"{where} is a directory: name the file to write, e.g. {out / 'record.json'}")
    check_creatable(folder, where, flag)
    if out and out.exists() and not os.access(out, os.W_OK):
        raise ConfigError(f"{where}: {out} is not writable; choose another {flag}")


def write_report(report: dict, out: Path, announce: bool = True, to_stderr: bool = False) -> None:
    """The JSON record at `out` (its folder made), from process 0 only; `announce` says where, on
    stderr with `to_stderr` (a --json run's stdout is the JSON alone)."""
    import jax

    if jax.process_index() == 0:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2) + "\n")
        if announce:
            print(f"\nwrote {out}", file=sys.stderr if to_stderr else sys.stdout)


GPU_WARMUP_S = 0.3  # seconds of calls before a GPU timing (median_seconds)


def timed(fn: Callable[..., Any], *args: Any) -> tuple[Any, float]:
    """fn(*args), waited for, and the wall-clock seconds from the call to the result."""
    import jax

    start = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    return out, time.perf_counter() - start


def median_seconds(fn: Callable[..., Any], args: tuple, steps: int, inner: int = 1) -> float:
    """Compile and run once; on a GPU, run on for GPU_WARMUP_S; then `steps` times: `inner` calls
    back to back, waited for; the median per call (inner > 1 hides the host's wait behind short
    kernels such as one matmul).

    The GPU warm-up: a compile leaves the card idle for seconds, and a kernel of a millisecond or
    two timed ten times right after it measured far apart from one run to the next: the same
    Mosaic forward at L = 4096, H = 128 gave 257, 291, 367 and 285 TFLOP/s in four processes
    of one H200 session (2026-11-26, before this warm-up). Idle clocks ramping up under load is
    the likely cause; the warm-up is what METHOD-style GPU timing asks for in any case. A CPU
    has no such ramp and is not waited for."""
    import jax

    jax.block_until_ready(fn(*args))
    warm_until = time.perf_counter() + (GPU_WARMUP_S if jax.default_backend() == "gpu" else 0.0)
    while time.perf_counter() < warm_until:
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        for _ in range(inner):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - start) / inner)
    return statistics.median(times)
