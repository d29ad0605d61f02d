"""Pipeline parallelism over the `stage` mesh axis: settings, checks and the schedule to run.

The stacked layers [X, ...] are split over `stage` by the rules table ('layers' -> stage):
stage s holds X/p contiguous layers and never gathers the others. `parallel.schedule` picks
how the M microbatches of a step (`parallel.microbatches`, default p) travel the stages:
gpipe and interleaved in pipeline/circular.py, 1f1b in pipeline/one_f_one_b.py; their
timetables are pipeline/schedule.py.

Batch: with pp > 1 the step's batch [M, b, L] holds the M microbatches (training.build's
batch_layout; `train.micro_batch_size` must stay 0, gradient accumulation *is* the microbatch
loop). The loss is the mean of the M microbatch losses: equal token counts make it the loss of
the whole batch, as without a pipeline.
"""

from __future__ import annotations

from configs.base import ConfigError, RunConfig
from pipeline import circular, one_f_one_b
from pipeline.schedule import SCHEDULES
from pipeline.stages import AXIS, stages

__all__ = ["check", "loss_and_grads", "microbatches", "stages"]


def microbatches(cfg: RunConfig, p: int) -> int:
    """M: `parallel.microbatches`, or p when it is 0."""
    return cfg.parallel.microbatches or p


def check(cfg: RunConfig, sizes: dict[str, int]) -> None:
    """The pipeline settings against the mesh `sizes`, as ConfigErrors naming the fix."""
    par, p = cfg.parallel, sizes[AXIS]
    if par.schedule not in SCHEDULES:
        raise ConfigError(f"--set parallel.schedule={par.schedule}: choose one of {', '.join(SCHEDULES)}")
    v = par.virtual_stages
    if v < 1 or (v > 1 and par.schedule != "interleaved"):
        raise ConfigError(
            f"parallel.virtual_stages={v}: use 1, or more with --set parallel.schedule=interleaved"
        )
    if p == 1:
        return
    m, layers = microbatches(cfg, p), cfg.model.n_layers
    if layers % (p * v):
        raise ConfigError(
            f"model.n_layers={layers} is not divisible by pp*virtual_stages={p}*{v}={p * v}: "
            "each stage holds the same number of layers; change model.n_layers, pp or virtual_stages"
        )
    if m < p:
        raise ConfigError(
            f"parallel.microbatches={m} is fewer than the pp={p} stages: the pipeline would never "
            f"fill; use at least {p}"
        )
    if par.schedule == "interleaved" and m % p:
        raise ConfigError(
            f"parallel.microbatches={m} with schedule=interleaved must be a multiple of pp={p} "
            "(p microbatches travel the ring together)"
        )
    if par.schedule == "1f1b" and par.tp_overlap and sizes["tensor"] > 1:
        raise ConfigError(
            "parallel.tp_overlap=true with parallel.schedule=1f1b: the overlap rings are "
            "collective-permutes, which XLA runs over all devices at once, while 1f1b's stages run "
            "different cells each tick, so a ring would wait for stages that never join it; set "
            "parallel.tp_overlap=false, or use parallel.schedule=gpipe|interleaved"
        )
    if cfg.train.micro_batch_size:
        raise ConfigError(
            f"train.micro_batch_size={cfg.train.micro_batch_size} with pp={p}: the pipeline's "
            "microbatches are the gradient accumulation; set train.micro_batch_size=0 and "
            "choose parallel.microbatches"
        )


def loss_and_grads(params, graphdef, batch: dict, cfg: RunConfig):
    """Mean loss and gradients of the [M, b, L] batch, pipelined by `parallel.schedule`."""
    if cfg.parallel.schedule == "1f1b":
        return one_f_one_b.loss_and_grads(params, graphdef, batch, cfg)
    return circular.loss_and_grads(params, graphdef, batch, cfg)
