"""Held-out evaluation: the loss of the current parameters on data that training never reads.

What: `train.eval_batches` global batches of windows from the corpus's held-out part
(training/data.py: every 100th file, or the last 1% of a stream), drawn under a fixed seed, so
every evaluation of a run, and every mesh, scores the same windows and the figures compare
across steps and meshes. Each batch has the training batch's shape [k, b, L] and shardings and
runs through the run's own sharded forward (training/step.py make_eval_step).

Figures: `eval_loss`, the mean next-token cross-entropy in nats (no z-loss, no router losses);
`eval_ppl` = exp(eval_loss); `eval_bpb` = eval_loss / ln 2, bits per byte, for the byte-level
sources (stdlib, text: one token per byte), null for token files and synthetic data.

Cost: one forward pass per batch (about a third of a training step each) and, at the first
evaluation, one compile of the forward; the host waits for the device once per evaluation.
`python train.py --run-dir RUN --eval-only` evaluates the run's latest checkpoint and trains nothing;
its record in metrics.jsonl also holds `eval_only`, `eval_batches`, `seq_len`, `data_source` and
`mesh`, which --set and --mesh may change from the run's own.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Callable

import jax
from flax import nnx
from jax.sharding import Mesh

from configs.base import BYTE_SOURCES, ConfigError, RunConfig
from sharding.mesh import format_mesh
from training.build import Program
from training.checkpoint import Checkpointer
from training.data import Batches, Corpus
from training.logger import MetricsLogger


def evaluate(eval_fn: Callable, params: nnx.State, batches: Batches, n: int, source: str) -> dict:
    """{'eval_loss', 'eval_ppl', 'eval_bpb'} of `params` on batches 0..n-1 of `batches` (the
    mean of equal-sized batches' means: the mean over all their tokens), plus 'eval_time_s'."""
    start = time.perf_counter()
    losses = jax.device_get([eval_fn(params, batches(i)) for i in range(n)])  # one wait for all
    loss = sum(map(float, losses)) / n
    return {
        "eval_loss": loss,
        "eval_ppl": math.exp(loss) if loss < 700 else math.inf,  # exp overflows a float past ~709
        "eval_bpb": loss / math.log(2) if source in BYTE_SOURCES else None,
        "eval_time_s": time.perf_counter() - start,
    }


def evaluate_run(cfg: RunConfig, mesh: Mesh, program: Program, corpus: Corpus, run_dir: Path) -> int:
    """--eval-only: score the latest complete checkpoint of `run_dir` on the held-out batches,
    print the figures and append them to metrics.jsonl and TensorBoard; returns the exit code."""
    batches = program.held_out(corpus.eval)
    checkpoints = Checkpointer(run_dir / "checkpoints", cfg, read_only=True)
    try:
        state = checkpoints.restore_latest(program)
    finally:
        checkpoints.close()
    if state is None:
        raise ConfigError(f"--eval-only: {run_dir / 'checkpoints'} holds no complete, undamaged checkpoint "
                          f"to evaluate; train first (python train.py --run-dir {run_dir})")
    step = int(state.step)
    with jax.set_mesh(mesh):
        figures = evaluate(program.eval_fn, state.params, batches, cfg.train.eval_batches, cfg.data.source)
    logger = MetricsLogger(run_dir, cfg.train.steps, step)
    # what the figures were measured with, which --set and --mesh may change from the run's own
    settings = {"eval_only": True, "eval_batches": cfg.train.eval_batches, "seq_len": cfg.train.seq_len,
                "data_source": cfg.data.source, "mesh": format_mesh(dict(mesh.shape))}
    try:
        logger.log_eval({"step": step, **figures, **settings})
    finally:
        logger.close()
    return 0
