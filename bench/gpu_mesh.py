"""`make gpu-check`'s mesh stage (bench/gpu.py): what a machine with several GPUs moves between
them, and what each parallelism trains at there. With one device it is skipped, and says so.

- interconnect: tools/collectives.py over every device as one group (dp=n): all-reduce,
  all-gather, reduce-scatter, all-to-all and a ring permute in bf16, one message size per power
  of two between the sizes' bounds; per op the latency floor, peak busbw and the fit
  t = latency + S·factor / busbw (tools/busbw.py, nccl-tests' conventions). The same record is
  written beside the report as `collectives-<device>-dp<n>.json`, which `tools.plan --bandwidth`
  reads (the planner then times each axis by these links instead of the datasheet's).
- strategies: one preset (125m; smoke: tiny) under remat full on dp=n, fsdp=n, fsdp=n/2,tp=2
  (explicit tensor parallelism; tp=2 at n = 2) and pp=2,dp=n/2 (1f1b, 4 microbatches), the
  global batch n times the case's (weak scaling): tokens/s, TFLOP/s per device, MFU, peak memory
  (bench.step.measure_steps), and per mesh axis the bytes per device per step of the compiled
  step's collectives (tools.hlo, its busiest device) beside tools.traffic's contract, so the
  communication each strategy promises is checked on the machine that runs it. bench/gpu.py's
  `estimate` then puts the planner's step time at the record's measured rates beside each
  (tools.calibration.estimate_vs_measured), as for the training stage.

Measured only where several GPUs are: the sessions that built it had one GPU at a time; the CPU
smoke test (tests/test_gpu_check.py, 4 fake devices) runs every part of it at tiny shapes.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from bench.common import error_text
from bench.gpu_training import KEEP
from tools.oom import is_out_of_memory

OPS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "permute")


def meshes(n: int) -> list[tuple[str, tuple[str, ...]]]:
    """The strategies' (mesh, overrides) on n devices (n even for the tp and pp ones)."""
    out = [(f"dp={n}", ()), (f"fsdp={n}", ())]
    if n % 2 == 0:
        out.append(("tp=2" if n == 2 else f"fsdp={n // 2},tp=2", ()))
        out.append(("pp=2" if n == 2 else f"pp=2,dp={n // 2}",
                    ("parallel.schedule=1f1b", "parallel.microbatches=4", "train.micro_batch_size=0")))
    return out


def mesh_stage(preset: str, overrides: tuple[str, ...], steps: int, message_bounds: str, iters: int,
               record_dir: Path) -> dict:
    """The stage's result: {"interconnect": ..., "strategies": [...]}, or {"skipped": ...} on one device."""
    import jax

    n = jax.device_count()
    if n == 1:
        return {"skipped": "one device: nothing to measure between GPUs (run on a machine with several)"}
    return {"interconnect": interconnect(n, message_bounds, iters, record_dir),
            "strategies": [strategy(preset, mesh, overrides + extra, steps) for mesh, extra in meshes(n)]}


def interconnect(n: int, message_bounds: str, iters: int, record_dir: Path) -> dict:
    """tools.collectives over dp=n, every op of OPS at the bounds' powers of two; its record written
    to record_dir; returns the record's path, summaries and fits (or the error)."""
    import jax

    from sharding.mesh import build_mesh, parse_mesh
    from tools import collectives
    from tools.busbw import OPS as ALL_OPS
    from tools.measure import write_report

    argv = ["--mesh", f"dp={n}", "--sizes", message_bounds, "--dtype", "bf16", "--iters", str(iters),
            "--ops", ",".join(OPS)]
    try:
        args = collectives.parse_args(argv)
        mesh = build_mesh(parse_mesh(args.mesh))
        rows = [r for op in OPS for r in collectives.sweep(mesh, ALL_OPS[op], ("data",),
                                                           collectives.parse_sizes(args.sizes), args)]
        report = collectives.record(argv, mesh, f"dp={n}", args, rows, jax.default_backend() == "cpu")
    except Exception as err:  # noqa: BLE001 -- the strategies still run
        return {"error": error_text(err)}
    kind = jax.devices()[0].device_kind.lower().replace(" ", "-")
    path = record_dir / f"collectives-{kind}-dp{n}.json"
    write_report(report, path, announce=False)
    return {"record": str(path), "summary": report["summary"], "fit": report["fit"]}


def strategy(preset: str, mesh_text: str, overrides: tuple[str, ...], steps: int) -> dict:
    """One mesh's row: the measured step (KEEP figures) and the census beside the contract per axis."""
    import jax

    from bench.step import measure_steps
    from sharding.mesh import AXES, build_mesh, mesh_config, parse_mesh
    from tools import traffic
    from sharding.strategies import device_core
    from tools.calibration import case_config
    from tools.hlo import per_device

    cfg = case_config(preset, overrides, ["model.remat=full"], jax.device_count())
    cfg = dataclasses.replace(cfg, parallel=parse_mesh(mesh_text, cfg.parallel))
    row = {"preset": preset, "remat": "full", "mesh": mesh_text, "attention": device_core(cfg.model, context=False),
           "scan_layers": cfg.model.scan_layers, "overrides": list(overrides)}
    try:
        mesh = build_mesh(cfg.parallel)
        cfg = dataclasses.replace(cfg, parallel=mesh_config(mesh, cfg.parallel))
        t = measure_steps(cfg, mesh, steps, census=True)
    except Exception as err:  # noqa: BLE001 -- an OOM is a result; the next mesh runs
        return row | {"status": "oom" if is_out_of_memory(err) else "error", "error": error_text(err)}
    sizes = {a: getattr(cfg.parallel, a) for a in AXES}
    contract = traffic.communication(cfg, sizes)
    census = {a: per_device([c for c in t["census"] if a in c.axes]) for a in contract}
    return row | {"status": "ok", "devices": mesh.size} | {k: t[k] for k in KEEP} | {
        "bytes_per_axis": {a: {"census": census[a], "contract": contract[a],
                               "ratio": census[a] / contract[a] if contract[a] else None} for a in contract}}
