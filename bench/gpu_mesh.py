"""`make gpu-check`'s mesh stage (bench/gpu.py): what a machine with several GPUs moves between
them, and what each parallelism trains at there. With one device it is skipped, and says so.

- interconnect: tools/collectives.py over every device as one group (dp=n): all-reduce,
  all-gather, reduce-scatter, all-to-all and a ring permute in bf16, one message size per power
  of two between the sizes' bounds; per op the latency floor, peak busbw and the fit
  t = latency + S·factor / busbw (tools/busbw.py, nccl-tests' conventions). The same record is
  written beside the report as `collectives-<device>-dp<n>.json`, which `tools.plan --bandwidth`
  reads (the planner then times each axis by these links instead of the datasheet's).
- strategies: one preset (125m; smoke: tiny) under remat full on dp=n, fsdp=n, fsdp=n/2,tp=2
  (explicit tensor parallelism; tp=2 at n = 2) without and with sequence parallelism (whose
  step compiles with XLA's all-gather pipeliner off: sharding.xla_flags.program_options) and
  pp=2,dp=n/2 (1f1b, 4 microbatches), the
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

from pathlib import Path

from bench.common import error_text
from bench.gpu_training import training_case


SP = "parallel.sequence_parallel=true"


def label(row: dict) -> str:
    """A strategy row's name: its mesh, and 'sp' under sequence parallelism."""
    return row["mesh"] + " sp" * (SP in row["overrides"])


def meshes(n: int) -> list[tuple[str, tuple[str, ...]]]:
    """The strategies' (mesh, overrides) on n devices (n even for the tp and pp ones)."""
    out = [(f"dp={n}", ()), (f"fsdp={n}", ())]
    if n % 2 == 0:
        tensor = "tp=2" if n == 2 else f"fsdp={n // 2},tp=2"
        out += [(tensor, ()), (tensor, (SP,))]
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
            "strategies": [training_case(preset, "full", overrides + extra, steps, mesh_text=mesh)
                           for mesh, extra in meshes(n)]}


def interconnect(n: int, message_bounds: str, iters: int, record_dir: Path) -> dict:
    """tools.collectives over dp=n, every op it has at the bounds' powers of two, its record
    written to record_dir; returns the record's path, summaries and fits (or the error)."""
    import json

    import jax

    from tools import collectives

    path = record_dir / f"collectives-{jax.devices()[0].device_kind.lower().replace(' ', '-')}-dp{n}.json"
    argv = ["--mesh", f"dp={n}", "--sizes", message_bounds, "--dtype", "bf16", "--iters", str(iters),
            "--out", str(path)]
    try:
        collectives.run(collectives.parse_args(argv), argv)
        report = json.loads(path.read_text())
    except Exception as err:  # noqa: BLE001 -- the strategies still run
        return {"error": error_text(err)}
    return {"record": str(path), "summary": report["summary"], "fit": report["fit"]}
