"""What every benchmark shares: the record's head, its file under bench/results/, the mesh, timing.

The record's command, machine and versions, its JSON file and the timing are tools/measure.py's
(below tools/ in the layers, so that tools.collectives writes the same record). Here: for
benches of a train step, the head with the mesh and the resolved config (`report_head`), the
record's default file, the mesh with its fake-device line.

No jax at import: the benches set XLA_FLAGS (cli.request_fake_devices) before jax starts.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from configs import ConfigError, RunConfig
from sharding.mesh import format_mesh
from tools.measure import RESULTS, environment, run_record

if TYPE_CHECKING:
    import jax



def report_head(module: str, argv: list[str], cfg: RunConfig, mesh: jax.sharding.Mesh, mesh_text: str) -> dict:
    """What every benchmark record of a train step starts with: command, time, machine and
    versions, mesh, config."""
    return run_record(module, argv) | {
        "environment": environment(list(mesh.devices.flat)),
        "mesh": mesh_text,
        "config": cfg.to_dict(),
    }


def default_out(bench: str, cfg: RunConfig, mesh_text: str) -> Path:
    """bench/results/<bench>-<config>-<mesh>.json, e.g. step-tiny-dp2_tp2.json; one device's mesh
    is `single` (step-tiny-single.json, as README's table of bench.step reads it)."""
    safe = "single" if mesh_text == "single device" else mesh_text.replace("=", "").replace(",", "_")
    return RESULTS / f"{bench}-{cfg.name}-{safe}.json"


def bench_mesh(cfg: RunConfig, fake: int | None) -> tuple[jax.sharding.Mesh, str, RunConfig]:
    """(mesh, its short text, cfg with the resolved mesh sizes); says when devices are fake; a
    backend jax cannot start is one error line (build_mesh: check_backend)."""
    import jax

    from sharding.mesh import build_mesh, mesh_config

    mesh = build_mesh(cfg.parallel)
    mesh_text = format_mesh(dict(mesh.shape))
    if fake and jax.default_backend() == "cpu":
        print(f"CPU platform: running mesh {mesh_text} on {fake} fake host devices")
    return mesh, mesh_text, dataclasses.replace(cfg, parallel=mesh_config(mesh, cfg.parallel))


def attempt(fn: Callable[..., dict], *args: Any) -> dict:
    """fn(*args)'s figures, or {"error": one line} when it raises: one case's failure (an OOM, a
    compile error) is a row of the record, and the cases before and after it keep theirs. A
    ConfigError is bad input, not a result: it stops the run (one `error:` line, exit 2)."""
    try:
        return fn(*args)
    except ConfigError:  # bad input (a core this machine lacks, a shape the mesh refuses): refused, not a result
        raise
    except Exception as err:  # noqa: BLE001 -- recorded and said; KeyboardInterrupt still stops the run
        print(f"  failed: {error_text(err)}", flush=True)
        return {"error": error_text(err)}


def failures(rows: list[dict], out: Path) -> int:
    """The exit code of a bench whose cases are `rows`: 0, or 1 with one stderr line counting the
    failed cases (each row's error is in the record at `out`)."""
    failed = [r for r in rows if "error" in r]
    if failed:
        print(f"error: {len(failed)} of {len(rows)} cases failed (their errors are in {out}): "
              f"{failed[0]['error']}", file=sys.stderr)
    return 1 if failed else 0


def error_text(err: BaseException) -> str:
    """An exception as one short line for a record: its type and its message's first line."""
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"[:500]
