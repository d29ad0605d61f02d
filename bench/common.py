"""What every benchmark shares: the record's head, its file under bench/results/, the mesh, timing.

A record (JSON, one file per run) starts with the command that made it, the time, the machine
and the package versions (`environment`), and, for benches of a train step, the mesh and the
resolved config (`report_head`); only process 0 writes it. Timing waits for the device
(`jax.block_until_ready`) before reading the clock, so a figure is the work, not its dispatch.

No jax at import: the benches set XLA_FLAGS (cli.request_fake_devices) before jax starts.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import os
import platform
import shlex
import statistics
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

from configs import RunConfig
from sharding.mesh import format_mesh

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


def report_head(module: str, argv: list[str], cfg: RunConfig, mesh: jax.sharding.Mesh, mesh_text: str) -> dict:
    """What every benchmark record of a train step starts with: command, time, machine and
    versions, mesh, config."""
    return run_record(module, argv) | {
        "environment": environment(list(mesh.devices.flat)),
        "mesh": mesh_text,
        "config": cfg.to_dict(),
    }


def default_out(bench: str, cfg: RunConfig, mesh_text: str) -> Path:
    """bench/results/<bench>-<config>-<mesh>.json, e.g. step-tiny-dp2_tp2.json."""
    safe = mesh_text.replace("=", "").replace(",", "_").replace(" ", "-")
    return RESULTS / f"{bench}-{cfg.name}-{safe}.json"


def write_report(report: dict, out: Path, announce: bool = True) -> None:
    """The JSON record at `out` (its folder made), from process 0 only; `announce` says where."""
    import jax

    if jax.process_index() == 0:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2) + "\n")
        if announce:
            print(f"\nwrote {out}")


def bench_mesh(cfg: RunConfig, fake: int | None) -> tuple[jax.sharding.Mesh, str, RunConfig]:
    """(mesh, its short text, cfg with the resolved mesh sizes); says when devices are fake."""
    import jax

    from sharding.mesh import build_mesh, mesh_config

    mesh = build_mesh(cfg.parallel)
    mesh_text = format_mesh(dict(mesh.shape))
    if fake and jax.default_backend() == "cpu":
        print(f"CPU platform: running mesh {mesh_text} on {fake} fake host devices")
    return mesh, mesh_text, dataclasses.replace(cfg, parallel=mesh_config(mesh, cfg.parallel))


def timed(fn: Callable[..., Any], *args: Any) -> tuple[Any, float]:
    """fn(*args), waited for, and the wall-clock seconds from the call to the result."""
    import jax

    start = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    return out, time.perf_counter() - start


def median_seconds(fn: Callable[..., Any], args: tuple, steps: int, inner: int = 1) -> float:
    """Compile and run once; then `steps` times: `inner` calls back to back, waited for; the
    median per call (inner > 1 hides the host's wait behind short kernels such as one matmul)."""
    import jax

    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        for _ in range(inner):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - start) / inner)
    return statistics.median(times)


def error_text(err: BaseException) -> str:
    """An exception as one short line for a record: its type and its message's first line."""
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"[:500]
