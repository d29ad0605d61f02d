"""What every benchmark shares: the record's head, its file under bench/results/, the mesh, timing.

The record's command, machine and versions, its JSON file and the timing are tools/measure.py's
(below tools/ in the layers, so that tools.collectives writes the same record). Here: for
benches of a train step, the head with the mesh and the resolved config (`report_head`), the
record's default file, the mesh with its fake-device line.

No jax at import: the benches set XLA_FLAGS (cli.request_fake_devices) before jax starts.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

from configs import RunConfig
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
    """bench/results/<bench>-<config>-<mesh>.json, e.g. step-tiny-dp2_tp2.json."""
    safe = mesh_text.replace("=", "").replace(",", "_").replace(" ", "-")
    return RESULTS / f"{bench}-{cfg.name}-{safe}.json"


def bench_mesh(cfg: RunConfig, fake: int | None) -> tuple[jax.sharding.Mesh, str, RunConfig]:
    """(mesh, its short text, cfg with the resolved mesh sizes); says when devices are fake."""
    import jax

    from sharding.mesh import build_mesh, mesh_config

    mesh = build_mesh(cfg.parallel)
    mesh_text = format_mesh(dict(mesh.shape))
    if fake and jax.default_backend() == "cpu":
        print(f"CPU platform: running mesh {mesh_text} on {fake} fake host devices")
    return mesh, mesh_text, dataclasses.replace(cfg, parallel=mesh_config(mesh, cfg.parallel))


def error_text(err: BaseException) -> str:
    """An exception as one short line for a record: its type and its message's first line."""
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"[:500]
