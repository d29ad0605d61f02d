"""Pipeline parallelism over the `stage` mesh axis: settings, checks and the schedule to run.

The stacked layers [X, ...] are split over `stage` by the rules table ('layers' -> stage):
stage s holds X/p contiguous layers and never gathers the others. `parallel.schedule` picks
how the M microbatches of a step (`parallel.microbatches`, default p) travel the stages:
gpipe and interleaved in pipeline/circular.py, the 1F1B family (1f1b, interleaved-1f1b,
zb-h1, zbv) in pipeline/one_f_one_b.py (zb-h1's and zbv's B/W split: pipeline/split_backward.py); their
timetables are pipeline/tables.py (weighed in pipeline/schedule.py). What a pipeline needs of the config (layers divisible by
p·V, at least p microbatches, ...) is checked in sharding/checks.py.

Batch: with pp > 1 the step's batch [M, b, L] holds the M microbatches (training.build's
batch_layout; `train.micro_batch_size` must stay 0, gradient accumulation *is* the microbatch
loop). The loss is the mean of the M microbatch losses: equal token counts make it the loss of
the whole batch, as without a pipeline.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sharding.checks import ONE_F_ONE_B

if TYPE_CHECKING:  # importing the package stays jax-free: tools.estimate reads pipeline.schedule and pipeline.tables
    import jax
    from flax import nnx

    from configs.base import RunConfig

__all__ = ["loss_and_grads"]


def loss_and_grads(params: nnx.State, graphdef: nnx.GraphDef, batch: dict, cfg: RunConfig,
                   accumulation: tuple[str, ...] = ()) -> tuple[jax.Array, nnx.State, dict]:
    """Mean loss, gradients (of the loss plus the router losses of a MoE model) and the router
    statistics (model/moe.py; {} for a dense model) of the [M, b, L] batch, pipelined by
    `parallel.schedule`. Each stage sums the statistics of its MoE layers over the microbatches
    it runs (idle ticks masked out), and the sums meet across `stage` once per step.
    `accumulation`: the batch axes the schedule's region runs manual over, reducing its gradients
    over them once per step (sharding.checks.accumulation_axes: data, fsdp, and sequence where
    the context parallelism is written out; pipeline/engine.py)."""
    from configs.base import ConfigError
    from pipeline import circular, one_f_one_b
    from pipeline.stages import stages

    if stages() == 1:  # the step was built for pp > 1; the schedules read p from the mesh in context
        raise ConfigError("the pipelined step needs its mesh in context, which has no stage axis here: call it "
                          "inside `with jax.set_mesh(mesh)`, the mesh training.build built it for")
    engine = one_f_one_b if cfg.parallel.schedule in ONE_F_ONE_B else circular
    return engine.loss_and_grads(params, graphdef, batch, cfg, accumulation)
