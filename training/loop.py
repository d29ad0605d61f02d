"""The training loop: step, time, log, profile, checkpoint, stop on signals or repeated NaNs.

Steps are dispatched asynchronously. The host reads one scalar of the previous step (its count
of non-finite steps in a row) after dispatching the next, so the device always has a step
queued while the host can still stop within one step of `train.max_bad_steps`; otherwise it
waits for the device only at log steps and checkpoints. The reported step time is the mean over
the log interval (the first interval, which includes the compile, is reported separately).

A run starts at the state's step (0, or the restored checkpoint's) and the batch of step s is
`job.batches(s)`, so a resumed run continues the same data stream; its records append to
metrics.jsonl (steps since the checkpoint are logged again).
"""

from __future__ import annotations

import time
from pathlib import Path

import jax

from training.build import Job, compile_step
from training.checkpoint import Checkpointer
from training.logger import MetricsLogger, say
from training.metrics import peak_memory_bytes, step_figures
from training.profiling import Profiler, parse_window
from training.signals import StopSignals


class TrainingStopped(RuntimeError):
    """Too many non-finite steps in a row; the message says where the last good state is."""


def check_finite(metrics: dict | None, step: int, limit: int, checkpoints: Checkpointer | None) -> None:
    """Raise TrainingStopped when `metrics` (of step `step`) ends `limit` non-finite steps in a row."""
    if metrics is None or int(metrics["bad_steps"]) < limit:
        return
    latest = checkpoints.latest() if checkpoints else None
    where = f"the last checkpoint, {checkpoints.path(latest)}," if latest is not None else "no checkpoint"
    raise TrainingStopped(
        f"step {step}: {limit} non-finite steps in a row (loss {float(metrics['loss'])}, grad norm "
        f"{float(metrics['grad_norm'])}); their updates were skipped and {where} holds the last good "
        "state. Check the data and train.lr, or raise --set train.max_bad_steps"
    )


def train(job: Job, run_dir: Path, checkpoints: Checkpointer | None = None) -> list[dict]:
    """Run from the state's step to cfg.train.steps; return the logged records.

    Raises TrainingStopped after train.max_bad_steps non-finite steps in a row. On SIGTERM or
    SIGINT the current step finishes, a checkpoint is written and the loop returns.
    """
    cfg, t = job.cfg, job.cfg.train
    first_step = int(job.state.step)
    k, b, length = job.batches.shape
    tokens_per_step = k * b * length
    logger = MetricsLogger(run_dir, t.steps, first_step)
    profiler = Profiler(parse_window(t.profile_steps), run_dir)
    device = job.mesh.local_devices[0]  # memory stats exist only for this process's devices
    records, state, previous, done = [], job.state, None, first_step
    try:
        with jax.set_mesh(job.mesh), StopSignals() as stop:
            start = time.perf_counter()
            first = True
            for step in range(first_step, t.steps):
                batch = job.batches(step)
                profiler.before_step(step, lambda: compile_step(job.step_fn, job.mesh, state, batch)[0].as_text())
                state, metrics = job.step_fn(state, batch)
                profiler.after_step(step, metrics["loss"])
                check_finite(previous, step, t.max_bad_steps, checkpoints)  # waits for the previous step
                previous, done = metrics, step + 1
                stopping = stop.requested()
                if checkpoints and (checkpoints.due(done) or stopping):
                    check_finite(metrics, done, t.max_bad_steps, checkpoints)
                    previous = None
                    checkpoints.save(done, state)
                if stopping:
                    break
                if done % t.log_every and done != t.steps and not first:
                    continue
                metrics = jax.device_get(metrics)  # waits for the device
                now = time.perf_counter()
                if first:
                    say(f"compiled and ran step {done} in {now - start:.1f} s")
                    first, start = False, now
                    continue
                steps_timed = done - records[-1]["step"] if records else done - first_step - 1
                step_time = (now - start) / steps_timed
                record = {"step": done, **{n: v.item() for n, v in metrics.items()}, "step_time_s": step_time}
                record |= step_figures(cfg.model, length, tokens_per_step, step_time, job.mesh.size, device)
                record["peak_memory_bytes"] = peak_memory_bytes(device)
                logger.log(record)
                records.append(record)
                start = now
        check_finite(previous, done, t.max_bad_steps, checkpoints)
    finally:
        profiler.close()
        logger.close()
        if checkpoints:
            checkpoints.wait()  # a save in flight completes even when the run stops on NaNs
    job.state = state
    if stop.received:
        saved = f"checkpoint written to {checkpoints.path(done)}" if checkpoints else \
            "no checkpoint written (train.checkpoint_every=0)"
        say(f"stopped by {stop.received} after step {done}: {saved}")
    return records
