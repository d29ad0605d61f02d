"""Measured compute rates for the planner: read the record `make gpu-check` writes (--calibration).

The roofline (tools/roofline.py) computes at a GPU's achievable rates, published figures by
default (roofline.GPUS). A record of `python -m bench.gpu` measured on that GPU replaces them:
  matmul     stages.ceilings.matmul_tflops: the bf16 8192^3 GEMM
  copies     stages.ceilings.copy_gbps: a 1 GiB fp32 x + 1, read + write counted (the rate of
             the memory-bound kernels); a record without it keeps the published copy rate
  attention  stages.attention: the fastest fused core (pallas or cudnn) forward + backward at the
             record's longest length; the record counts forward + backward as 3.5 forwards (the
             backward recomputes the scores), the model as 3 (training/metrics.py), so its
             TFLOP/s times 3/3.5 is the rate in the model's FLOPs
The record must come from a GPU of the planned kind (its device_kind names it): a CPU smoke
record or another GPU's is refused with one `error:` line, as is a record missing either stage,
or one whose field the planner reads holds the wrong type or a rate that is not a finite
positive number (the line names the field).
No jax here: the file is read before jax starts.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from pathlib import Path
from typing import NoReturn

from configs import ConfigError, RunConfig, apply_overrides, get_preset
from tools.roofline import GPU, GPUS

FUSED = ("pallas", "cudnn")


def add_calibration_arg(p: argparse.ArgumentParser) -> None:
    """--calibration FILE: tools.plan's and train.py --dry-run's measured compute rates."""
    p.add_argument("--calibration", type=Path, metavar="FILE.json",
                   help="compute at the matmul and attention rates a `make gpu-check` record measured on "
                        "this --gpu instead of the published ones")


def rated_gpu(name: str, calibration: Path | None = None) -> GPU:
    """The --gpu entry, with its rates measured by the record at `calibration` when given."""
    if name not in GPUS:
        raise ConfigError(f"--gpu {name!r}: choose one of {', '.join(GPUS)}")
    return GPUS[name] if calibration is None else calibrate(GPUS[name], name, calibration)


def calibrate(gpu: GPU, name: str, path: Path) -> GPU:
    """`gpu` with the matmul and attention rates of the bench.gpu record at `path` (module docstring)."""
    where = f"--calibration {path}"
    stages, env = read_record(path)
    kind = str(env.get("device_kind", "?"))
    if env.get("backend") != "gpu" or name.upper() not in kind.upper():
        raise ConfigError(f"{where}: measured on {env.get('backend')} device {kind!r}, not a {name.upper()}; "
                          f"pass a record made on one, or --gpu of the GPU that record measured")
    ceilings = _part(where, stages, "stages.ceilings", dict)
    matmul = ceilings.get("matmul_tflops")
    rows, measured = [], _part(where, stages, "stages.attention", dict)
    for i, row in enumerate(_part(where, measured, "stages.attention.rows", list)):
        field = f"stages.attention.rows[{i}]"
        if not isinstance(row, dict):
            _refuse(where, field, row, "an object")
        if row.get("core") in FUSED and row.get("forward_backward_tflops") is not None:
            _rate(where, row["forward_backward_tflops"], f"{field}.forward_backward_tflops")
            length = row.get("length")
            if isinstance(length, bool) or not isinstance(length, int) or length < 1:
                _refuse(where, f"{field}.length", length, "a positive integer")
            rows.append(row)
    if matmul is None or not rows:
        missing = "ceilings (matmul_tflops)" if matmul is None else "attention (a pallas or cudnn row)"
        raise ConfigError(f"{where}: the record has no {missing}; run `make gpu-check` with that stage")
    matmul = _rate(where, matmul, "stages.ceilings.matmul_tflops")
    longest = max(r["length"] for r in rows)
    best = max((r for r in rows if r["length"] == longest), key=lambda r: r["forward_backward_tflops"])
    attention = best["forward_backward_tflops"] * 1e12 * 3 / 3.5
    copy = ceilings.get("copy_gbps")
    copy = gpu.copy_bandwidth if copy is None else _rate(where, copy, "stages.ceilings.copy_gbps") * 1e9
    rates = (f"measured in {path} on {kind}: matmul {matmul:.0f} TFLOP/s (bf16 GEMM), attention "
             f"{attention / 1e12:.0f} TFLOP/s ({best['core']} forward + backward, L={longest}, in the model's FLOPs), "
             f"copies {copy / 1e12:.2f} TB/s")
    return dataclasses.replace(gpu, matmul_flops=matmul * 1e12, attention_flops=attention, copy_bandwidth=copy,
                               rates=rates)


def read_record(path: Path) -> tuple[dict, dict]:
    """The `stages` of the bench.gpu record at `path` and its `environment`, both objects, or
    ConfigError naming --calibration."""
    where = f"--calibration {path}"
    try:
        stages = json.loads(path.read_text())["stages"]
        env = stages["environment"]
    except OSError as e:
        raise ConfigError(f"{where}: cannot read it ({e.strerror}); pass the JSON record `make gpu-check` "
                          "writes (bench/results/gpu-*.json)") from None
    except (ValueError, KeyError, TypeError, IndexError):
        raise ConfigError(f"{where}: not a record of python -m bench.gpu (no stages.environment); pass the "
                          "JSON record `make gpu-check` writes") from None
    if not isinstance(env, dict):
        _refuse(where, "stages.environment", env, "an object")
    return stages, env


def _part(where: str, parent: dict, field: str, kind: type) -> dict | list:
    """The `field` (a dotted path, its last name a key of `parent`) when it is a `kind` (an empty
    one when absent), else ConfigError naming it."""
    value = parent.get(field.rsplit(".", 1)[-1], kind())
    if not isinstance(value, kind):
        _refuse(where, field, value, "an object" if kind is dict else "a list")
    return value


def _rate(where: str, value: object, field: str) -> float:
    """`value` when it is a finite positive number, else ConfigError naming `field`."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        _refuse(where, field, value, "a positive number")
    return float(value)


def _refuse(where: str, field: str, value: object, expected: str) -> NoReturn:
    """ConfigError: the record's `field` holds `value`, not `expected`."""
    raise ConfigError(f"{where}: {field}={value!r:.60} is not {expected}; pass a record written by python -m bench.gpu")


def case_config(preset: str, overrides: tuple[str, ...], extra: list[str], n_devices: int) -> RunConfig:
    """A bench.gpu training case: the preset with its overrides, the global batch times the
    device count (weak scaling over dp)."""
    cfg = apply_overrides(get_preset(preset), [*overrides, *extra])
    return apply_overrides(cfg, [f"train.global_batch_size={cfg.train.global_batch_size * n_devices}"])


def scanned(case: dict) -> bool:
    """Whether a bench.gpu training case ran the layer scan. Records before 2026-11-26's H100 one
    do not say; every preset scanned then unless the case set model.scan_layers=false."""
    return case.get("scan_layers", "model.scan_layers=false" not in case["overrides"])


def recorded_config(case: dict) -> RunConfig:
    """The config a bench.gpu training case ran: its preset, overrides, remat, core and layer
    scan (`scanned`: a record from before the presets unrolled ran the scan without saying so,
    and today's preset would rebuild it unrolled), the global batch times its devices."""
    sets = [f"model.remat={case['remat']}", f"model.attention={case['attention']}",
            f"model.scan_layers={str(scanned(case)).lower()}"]
    return case_config(case["preset"], tuple(case["overrides"]), sets, case["devices"])


def estimate_vs_measured(path: Path) -> list[dict]:
    """The training and mesh stages of the bench.gpu record at `path` against the roofline at that
    record's own measured rates: per case (preset, remat, devices; the mesh stage's on its mesh)
    the measured median step, tools.roofline's overlapped step time on the same config and mesh
    (data over the record's devices for the training stage), and their ratio. Reads the GPU kind
    from the record; refuses what `calibrate` refuses."""
    from sharding.mesh import AXES, parse_mesh
    from tools.roofline import step_time

    stages, env = read_record(path)
    kind = str(env.get("device_kind", "?")).lower()
    name = next((n for n in GPUS if n in kind), None)
    if name is None:
        raise ConfigError(f"--calibration {path}: device {kind!r} is none of {', '.join(GPUS)}")
    gpu, rows = rated_gpu(name, path), []
    cases = [(case, f"dp={case.get('devices')}") for case in stages.get("training", {}).get("rows", [])]
    cases += [(case, case["mesh"]) for case in (stages.get("mesh") or {}).get("strategies", [])]
    for case, mesh in cases:
        if case.get("status") != "ok":
            continue
        cfg = recorded_config(case)
        cfg = dataclasses.replace(cfg, parallel=parse_mesh(mesh, cfg.parallel))
        estimate = step_time(cfg, {a: getattr(cfg.parallel, a) for a in AXES}, gpu)["overlap_s"]
        measured = case["step_time_median_s"]
        rows.append({"preset": case["preset"], "remat": case["remat"], "scan_layers": scanned(case),
                     "devices": case["devices"], "mesh": mesh,
                     "measured_s": measured, "estimate_s": estimate, "ratio": estimate / measured})
    return rows
