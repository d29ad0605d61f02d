"""Benchmark checkpoints: save and restore time and bytes; step time with async saves every step.

  python -m bench.checkpoint --config 125m --mesh fsdp=2 --set train.global_batch_size=2 --set train.seq_len=256

What is measured, on the job train.py builds (`training.build.build`) and its Checkpointer:
  save      `Checkpointer.save` of the state after one step: the blocking part (checksums and the
            copy of the shards to host memory) and the time until the write is complete on disk
            (`wait`); the bytes of the checkpoint directory.
  restore   `Checkpointer.restore_latest` into the same mesh's shardings, checksums verified.
  overlap   --steps steps without saving, then --steps steps each followed by an asynchronous
            save (train.checkpoint_every=1; orbax lets one save be in flight, so a save waits
            for the previous write). Each step is waited for; the ratio of the mean step times
            (with / without) is what the async save costs the training loop. The final wait for
            the last write is reported apart.
Checkpoints go to a temporary directory (TMPDIR chooses the disk), removed afterwards. On CPU (fake devices
sharing a few cores) the background write competes with the step for the same cores, so the
ratio is an upper bound of what a GPU host sees; compare only figures within one run.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from bench.common import bench_mesh, default_out, report_head
from configs import RunConfig
from configs.parser import Parser
from cli import add_run_args, request_fake_devices, run_cli, run_config
from tools.measure import check_at_least, check_out, file_path, timed, write_report


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = Parser(__doc__)
    add_run_args(p)
    p.add_argument("--steps", type=int, default=4, help="timed steps without and with saves (default 4)")
    p.add_argument("--out", type=file_path, help="JSON report (default bench/results/checkpoint-<config>-<mesh>.json)")
    args = p.parse_args(argv)
    check_out(args.out)
    return args


def directory_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def timed_steps(job, state, first: int, steps: int, checkpoints=None) -> tuple[object, list[float]]:
    """Run `steps` steps from step `first`, each waited for (and saved, with `checkpoints`)."""
    import jax

    times = []
    for step in range(first, first + steps):
        batch = jax.block_until_ready(job.batches(step))
        start = time.perf_counter()
        state, metrics = job.step_fn(state, batch)
        if checkpoints:
            checkpoints.save(step + 1, state)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - start)
    return state, times


def measure(cfg: RunConfig, mesh, steps: int, directory: Path) -> dict:
    import jax

    from training.build import make_program, build
    from training.checkpoint import Checkpointer

    job = build(cfg, mesh)
    checkpoints = Checkpointer(directory, cfg)
    program = make_program(cfg, mesh)  # outside set_mesh (see training.build.make_program)
    with jax.set_mesh(mesh):
        state, _ = timed_steps(job, job.state, 0, 1)  # compiles
        start = time.perf_counter()
        checkpoints.save(1, state)
        save_blocking = time.perf_counter() - start
        checkpoints.wait()
        save_total = time.perf_counter() - start
        size = directory_bytes(checkpoints.path(1))
        restored, restore_s = timed(checkpoints.restore_latest, program)
        del restored
        state, plain = timed_steps(job, state, 1, steps)
        state, saving = timed_steps(job, state, 1 + steps, steps, checkpoints)
        start = time.perf_counter()
        checkpoints.wait()
        last_wait = time.perf_counter() - start
    checkpoints.close()
    mean = statistics.fmean
    return {
        "n_params": job.n_params,
        "checkpoint_bytes": size,
        "save_blocking_s": save_blocking,
        "save_total_s": save_total,
        "save_gb_per_s": size / save_total / 1e9,
        "restore_s": restore_s,
        "restore_gb_per_s": size / restore_s / 1e9,
        "step_times_no_save_s": plain,
        "step_times_async_save_every_step_s": saving,
        "step_time_no_save_mean_s": mean(plain),
        "step_time_async_save_mean_s": mean(saving),
        "ratio_async_save_to_no_save": mean(saving) / mean(plain),
        "last_write_wait_s": last_wait,
    }


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    check_at_least(args, 1, "--steps")
    cfg = run_config(args)
    fake = request_fake_devices(cfg)

    mesh, mesh_text, cfg = bench_mesh(cfg, fake)
    directory = Path(tempfile.mkdtemp(prefix="meshtrain-bench-ckpt-"))
    try:
        figures = measure(cfg, mesh, args.steps, directory / "checkpoints")
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    report = report_head("bench.checkpoint", argv, cfg, mesh, mesh_text) | {"checkpoint": figures}
    f = figures
    print(f"  {f['n_params'] / 1e6:.1f}M parameters, checkpoint {f['checkpoint_bytes'] / 2**20:.0f} MiB")
    print(f"  save: {f['save_blocking_s']:.2f} s blocking, {f['save_total_s']:.2f} s until on disk")
    print(f"  restore: {f['restore_s']:.2f} s (checksums verified)")
    print(f"  step: {f['step_time_no_save_mean_s']:.2f} s without saves, {f['step_time_async_save_mean_s']:.2f} s "
          f"with an async save every step: ratio {f['ratio_async_save_to_no_save']:.2f}")
    write_report(report, args.out or default_out("checkpoint", cfg, mesh_text))
    return 0


if __name__ == "__main__":
    run_cli(main)
