"""The training loop: step, time, log, profile.

Steps are dispatched asynchronously; the host waits for the device only at log steps, so the
reported step time is the mean over the log interval (the first interval, which includes the
compile, is reported separately as compile time).
"""

from __future__ import annotations

import time
from pathlib import Path

import jax

from training.build import Job
from training.logger import MetricsLogger
from training.metrics import peak_memory_bytes, step_figures
from training.profiling import Profiler, parse_window


def train(job: Job, run_dir: Path) -> list[dict]:
    """Run cfg.train.steps steps; return the logged records."""
    cfg, t = job.cfg, job.cfg.train
    k, b, length = job.batches.shape
    tokens_per_step = k * b * length
    logger = MetricsLogger(run_dir, t.steps)
    profiler = Profiler(parse_window(t.profile_steps), run_dir)
    device = job.mesh.devices.flat[0]
    records, state = [], job.state
    with jax.set_mesh(job.mesh):
        start = time.perf_counter()
        first = True
        for step in range(t.steps):
            profiler.before_step(step)
            state, metrics = job.step_fn(state, job.batches(step))
            profiler.after_step(step, metrics["loss"])
            done = step + 1
            if done % t.log_every and done != t.steps and not first:
                continue
            metrics = jax.device_get(metrics)  # waits for the device
            now = time.perf_counter()
            if first:
                print(f"compiled and ran step 1 in {now - start:.1f} s")
                first, start = False, now
                continue
            steps_timed = done - records[-1]["step"] if records else done - 1
            step_time = (now - start) / steps_timed
            record = {"step": done, **{n: float(v) for n, v in metrics.items()}, "step_time_s": step_time}
            record |= step_figures(cfg.model, length, tokens_per_step, step_time, job.mesh.size, device)
            record["peak_memory_bytes"] = peak_memory_bytes(device)
            logger.log(record)
            records.append(record)
            start = now
    logger.close()
    job.state = state
    return records
