"""`make gpu-check`'s training, flags and profile stages (bench/gpu.py): whole train steps.

A case is (preset, remat, overrides): `tools.calibration.case_config` fills the global batch in
per device count (weak scaling, dp over every device), and `model.attention=auto` picks the core,
recorded per row. Timing is `bench.step.measure_steps` (compile, one step, then the median of
`steps`); an out-of-memory case is a row with status "oom" and the next case runs. All cases
share one process, so `peak_memory_bytes_per_device` (memory_stats) is the process's peak so
far: bench/gpu_sizes.py lists the cases smallest first, and XLA's static memory analysis of each step
is recorded beside it.

- training: one row per case.
- flags: one case compiled twice in this process, an XLA option on and off (per-compile
  options, over XLA_FLAGS), and the ratio of the step times, off / on.
- profile: four steps with steps 2..3 traced (training/profiling.py), summed by
  tools/trace_summary.py (scopes) and tools/op_kinds.py (op kinds and fractions).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from bench.common import error_text
from tools.calibration import case_config
from tools.oom import is_out_of_memory

Case = tuple[str, str, tuple[str, ...]]  # (preset, remat, overrides)
PROFILE_EXTRA = ("train.steps=4", "train.profile_steps=2:4",  # steps 2..3 traced
                 "train.checkpoint_every=0", "train.log_every=1000", "train.eval_every=0")
KEEP = ("n_params", "batch_shape", "tokens_per_step", "compile_s", "step_time_median_s", "tokens_per_s",
        "tflops_per_device", "mfu", "peak_memory_bytes_per_device", "memory_analysis", "loss_first", "loss_last")


def training_case(preset: str, remat: str, overrides: tuple[str, ...], steps: int,
                  compiler_options: dict | None = None, mesh_text: str | None = None) -> dict:
    """One case's row: its settings and, measured over `steps`, the KEEP figures (status "ok"),
    or status "oom" / "error" with the error's text. `mesh_text` (the mesh stage's, e.g.
    "fsdp=4,tp=2"): that mesh instead of dp over every device, and per mesh axis the compiled
    step's collective bytes (its busiest device's) beside tools.traffic's contract."""
    import jax

    from bench.step import measure_steps
    from sharding.mesh import build_mesh, mesh_config, parse_mesh
    from sharding.strategies import device_core

    cfg = case_config(preset, overrides, [f"model.remat={remat}"], jax.device_count())
    if mesh_text:
        cfg = dataclasses.replace(cfg, parallel=parse_mesh(mesh_text, cfg.parallel))
    row = {"preset": preset, "remat": remat, "attention": device_core(cfg.model, context=False),
           "scan_layers": cfg.model.scan_layers, "overrides": list(overrides)} | ({"mesh": mesh_text} if mesh_text else {})
    try:
        mesh = build_mesh(cfg.parallel)
        cfg = dataclasses.replace(cfg, parallel=mesh_config(mesh, cfg.parallel))
        t = measure_steps(cfg, mesh, steps, compiler_options, census=bool(mesh_text))
    except Exception as err:  # noqa: BLE001 -- an OOM is a result; the next case runs
        return row | {"status": "oom" if is_out_of_memory(err) else "error", "error": error_text(err)}
    row |= {"status": "ok", "devices": mesh.size} | {k: t[k] for k in KEEP}
    return row | ({"bytes_per_axis": bytes_per_axis(cfg, t["census"])} if mesh_text else {})


def bytes_per_axis(cfg, census: list) -> dict:
    """Per mesh axis of cfg's mesh, the census's bytes (collectives over it, with others too)
    beside tools.traffic's contract, and their ratio."""
    from sharding.mesh import AXES
    from tools import traffic
    from tools.hlo import per_device

    contract = traffic.communication(cfg, {a: getattr(cfg.parallel, a) for a in AXES})
    moved = {a: per_device([c for c in census if a in c.axes]) for a in contract}
    return {a: {"census": moved[a], "contract": contract[a], "ratio": moved[a] / contract[a] if contract[a] else None}
            for a in contract}


def training(cases: tuple[Case, ...], steps: int) -> dict:
    return {"peak_memory_note": "memory_stats peak of the whole process so far (cases run smallest first)",
            "rows": [training_case(p, r, o, steps) for p, r, o in cases]}


def flags(cases: tuple[tuple[str, str, tuple[str, ...], str], ...], steps: int) -> dict:
    """Per (preset, remat, overrides, XLA option): the case with the option on and off."""
    rows = []
    for preset, remat, overrides, option in cases:
        on, off = (training_case(preset, remat, overrides, steps, {option: value}) for value in (True, False))
        row = {"preset": preset, "remat": remat, "option": option, "on": on, "off": off}
        if on["status"] == off["status"] == "ok":
            row["ratio_off_to_on"] = off["step_time_median_s"] / on["step_time_median_s"]
        rows.append(row)
    return {"note": "each case compiled twice in this process, the option on and off (compile options over "
                    "XLA_FLAGS); ratio_off_to_on > 1: the option pays", "rows": rows}


def profile(cases: tuple[tuple[str, tuple[str, ...]], ...], run_dir: Path) -> dict:
    """Per (preset, overrides), under the preset's own remat: a traced run in run_dir/<i>-<preset>
    and its scope and op-kind tables."""
    import jax

    from sharding.mesh import build_mesh, mesh_config
    from sharding.strategies import device_core
    from tools.op_kinds import op_breakdown
    from tools.trace_summary import summarize
    from training.build import build
    from training.loop import train

    rows = []
    for i, (preset, overrides) in enumerate(cases):
        cfg = case_config(preset, overrides, list(PROFILE_EXTRA), jax.device_count())
        mesh = build_mesh(cfg.parallel)
        job = build(dataclasses.replace(cfg, parallel=mesh_config(mesh, cfg.parallel)), mesh)
        case_dir = run_dir / f"{i}-{preset}"
        case_dir.mkdir(parents=True, exist_ok=True)
        train(job, case_dir)
        row = {"run_dir": str(case_dir), "preset": preset, "overrides": list(overrides),
               "remat": cfg.model.remat, "scan_layers": cfg.model.scan_layers,
               "attention": device_core(cfg.model, context=False)}
        try:
            row["scopes"] = {k: v for k, v in summarize(case_dir).items() if k != "timeline"}
        except Exception as err:  # noqa: BLE001 -- the op breakdown below may still work
            row["scopes"] = {"error": error_text(err)}
        rows.append(row | {"ops": op_breakdown(case_dir)})
    return {"cases": rows}
