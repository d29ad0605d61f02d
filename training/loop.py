"""The training loop: step, time, log, evaluate, profile, checkpoint, stop on signals or repeated NaNs.

Steps are dispatched asynchronously. The host reads one scalar of the previous step (its count
of non-finite steps in a row) after dispatching the next, so the device always has a step
queued while the host can still stop within one step of `train.max_bad_steps`; otherwise it
waits for the device only at log steps and checkpoints. The reported step time is the mean over
the log interval (the first interval, which includes the compile, is reported separately).

A run starts at the state's step (0, or the restored checkpoint's) and the batch of step s is
`job.batches(s)`, so a resumed run continues the same data stream; its records append to
metrics.jsonl (steps since the checkpoint are logged again).

Evaluation (training/evaluate.py) runs every `train.eval_every` steps and at the last step, on
the state after that step; its time is not counted in the log interval's step time. Nor is a
checkpoint's: the host blocks while a save starts (checksums, the copy to host memory:
training/checkpoint.py), after waiting for the steps queued before it, which count as step time;
those seconds go to the next log record as `checkpoint_s`. Counted in, one save of the tiny
preset made its 5-step interval read 784 ms/step against 634-716 around it (one CPU).
"""

from __future__ import annotations

import time
from pathlib import Path

import jax

from training.build import Job, compile_step
from training.checkpoint import Checkpointer
from training.evaluate import evaluate
from training.logger import MetricsLogger, say
from training.metrics import IntervalTimer, peak_memory_bytes, step_figures
from training.profiling import Profiler, parse_window
from training.signals import StopSignals


class TrainingStopped(RuntimeError):
    """Too many non-finite steps in a row; the message says where the last good state is."""


class NonFiniteGuard:
    """Raises TrainingStopped when a step ends `limit` non-finite steps in a row, reading each
    step's count one step late.

    `push(metrics, step)` checks the step pushed before it (a host wait for that step, while the
    step just dispatched keeps the device busy) and holds this one; `flush()` checks the one held
    now: before a checkpoint, so that none is written past the stop, and at the end of the run.
    """

    def __init__(self, limit: int, checkpoints: Checkpointer | None) -> None:
        self.limit, self.checkpoints = limit, checkpoints
        self.held: tuple[dict, int] | None = None

    def push(self, metrics: dict, step: int) -> None:
        self.flush()
        self.held = (metrics, step)

    def flush(self) -> None:
        if self.held is None:
            return
        (metrics, step), self.held = self.held, None
        if int(metrics["bad_steps"]) < self.limit:
            return
        latest = self.checkpoints.latest() if self.checkpoints else None
        where = f"the last checkpoint, {self.checkpoints.path(latest)}," if latest is not None else "no checkpoint"
        raise TrainingStopped(
            f"step {step}: {self.limit} non-finite steps in a row (loss {float(metrics['loss'])}, grad norm "
            f"{float(metrics['grad_norm'])}); their updates were skipped and {where} holds the last good "
            "state. Check the data and train.lr, or raise --set train.max_bad_steps"
        )


def log_step(logger: MetricsLogger, job: Job, step: int, metrics: dict, step_time: float,
             checkpoint_s: float = 0.0) -> dict:
    """The record of a log step (the step's metrics on the host, the interval's mean step time and
    the figures from it, peak memory, and `checkpoint_s` when the interval started a save: the
    seconds the host spent on it, left out of the step time), written by `logger`; returns it."""
    k, b, length = job.batches.shape
    device = job.mesh.local_devices[0]  # memory stats exist only for this process's devices
    record = {"step": step, **{n: v.item() for n, v in metrics.items()}, "step_time_s": step_time}
    record |= step_figures(job.cfg.model, length, k * b * length, step_time, job.mesh.size, device)
    record["peak_memory_bytes"] = peak_memory_bytes(device)
    if checkpoint_s:
        record["checkpoint_s"] = checkpoint_s
    logger.log(record)
    return record


def train(job: Job, run_dir: Path, checkpoints: Checkpointer | None = None) -> list[dict]:
    """Run from the state's step to cfg.train.steps; return the logged records.

    Raises TrainingStopped after train.max_bad_steps non-finite steps in a row. On SIGTERM or
    SIGINT the current step finishes, a checkpoint is written and the loop returns.
    """
    t = job.cfg.train
    first_step = int(job.state.step)
    logger = MetricsLogger(run_dir, t.steps, first_step)
    profiler = Profiler(parse_window(t.profile_steps), run_dir)
    guard = NonFiniteGuard(t.max_bad_steps, checkpoints)
    records, state, done, saving_s = [], job.state, first_step, 0.0
    try:
        with jax.set_mesh(job.mesh), StopSignals() as stop:
            timer = IntervalTimer(first_step)
            for step in range(first_step, t.steps):
                batch = job.batches(step)
                profiler.before_step(step, lambda: compile_step(job.step_fn, job.mesh, state, batch)[0].as_text())
                state, metrics = job.step_fn(state, batch)
                profiler.after_step(step, metrics["loss"])
                done = step + 1
                guard.push(metrics, done)  # waits for the previous step
                stopping = stop.requested()
                if checkpoints and (checkpoints.due(done) or stopping):
                    guard.flush()
                    jax.block_until_ready(state)  # the steps queued before count as step time
                    started = time.perf_counter()
                    checkpoints.save(done, state)
                    seconds = time.perf_counter() - started
                    timer.skip(seconds)
                    saving_s += seconds
                if stopping:
                    break
                if done == first_step + 1 or done % t.log_every == 0 or done == t.steps:
                    metrics = jax.device_get(metrics)  # waits for the device
                    if done == first_step + 1:
                        say(f"compiled and ran step {done} in {timer.lap(done):.1f} s")
                    else:
                        records.append(log_step(logger, job, done, metrics, timer.lap(done), saving_s))
                    saving_s = 0.0
                if job.eval_batches is not None and (done % t.eval_every == 0 or done == t.steps):
                    jax.block_until_ready(state)  # the steps queued before count as step time
                    figures = evaluate(job.eval_fn, state.params, job.eval_batches, t.eval_batches, job.cfg.data.source)
                    logger.log_eval({"step": done, **figures})
                    timer.skip(figures["eval_time_s"])
        guard.flush()
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
