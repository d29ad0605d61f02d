"""The one shard_map every schedule runs in, and what it does before and after the ticks: a
stage's weights cast, laid out and gathered once per step, its fp32 gradients reduced once.

Region: manual over `stage` and the step's accumulation axes (`batch_axes`: data, fsdp,
expert and, under the context parallelism written out, sequence, where > 1:
sharding.checks.accumulation_axes; a MoE layer's region nests in it, manual over the token
axes left, sharding/expert_parallel.py); `tensor` (and any other axis) stays automatic. In:
the parameters as stored (blocks [X, ...], X over stage, under manual fsdp each weight's fsdp
shard, under manual expert each device's E/ep experts), the batch [M, b, L]
(each device its own b rows of every microbatch where the batch axes are manual, and its L/sp
columns where sequence is: the model then slices the rotary tables to them, and the
context-parallel attention regions nest in this one).

Per step, on each device:
  1. cast the stage's parameters to the compute dtype, lay its layers out as the [V, Lc, ...]
     chunks it runs (pipeline/layout.py: chunks stored on another stage move once, by
     collective-permute) and gather them whole over fsdp, and the embedding and head, each
     stage storing 1/p of them, over stage (by hand on each tensor shard:
     pipeline/stage_weights.py);
  2. `run` the schedule (pipeline/circular.py, pipeline/one_f_one_b.py): the mean loss of the
     device's rows (nonzero on the stage that computes it), the fp32 gradients of every
     parameter summed over the device's microbatches, and the router statistics summed over
     the stage's MoE layers and microbatches;
  3. reduce the gradients once over the batch axes (an fp32 reduce-scatter over fsdp, then an
     all-reduce of the shard over data, expert and sequence, the routed experts' over data
     alone, on each tensor shard: sharding/accumulation.py), the embedding's and head's (each
     nonzero on the stage that uses it) summed over stage between the two by a
     reduce-scatter into each stage's 1/p of them (pipeline/stage_weights.py); move the
     chunks' gradients back to where they are stored, and sum the final norm's over stage (an
     all-reduce of 2·D·4 bytes); loss and statistics summed over stage, averaged over the
     batch axes.

So the data and fsdp bytes of a pipelined step are those of one reduction whatever M and the
schedule: 2·4·P'·(N-1)/N over data (P' the device's parameters; N = dp·sp with sequence in the
region, dp·ep with expert for every weight but the routed experts), and under fsdp one all-gather of the compute-dtype weights and one fp32
reduce-scatter. Memory: the stage's weights whole over fsdp in the compute dtype and their fp32
gradients whole, for the step.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
from flax import nnx
from jax import lax
from jax.sharding import PartitionSpec as P

from configs.base import RunConfig
from model.transformer import compute_params
from pipeline.stage_weights import chunked, gathered_once, over_stage, reduced_once, weight_specs
from pipeline.stages import AXIS, over_stages, stages, with_part
from sharding.accumulation import automatic
from sharding.checks import moe_layers
from sharding.rules import logical_to_spec

# run(compute [V, Lc, ...] blocks, inputs [M, b, L], targets [M, b, L]) -> (the device's mean
# loss, its fp32 gradients of compute, its router statistics' sums {name: scalar})
Schedule = Callable[[nnx.State, jax.Array, jax.Array], tuple[jax.Array, nnx.State, dict]]


def run_stages(params: nnx.State, batch: dict, cfg: RunConfig, batch_axes: tuple[str, ...], vee: bool,
               run: Schedule) -> tuple[jax.Array, nnx.State, dict]:
    """Mean loss, fp32 gradients (as stored) and router statistics (means per MoE layer and
    microbatch) of the [M, b, L] batch, the schedule `run` on each stage's chunks (`vee`: zbv's
    V layout) in a region manual over stage and `batch_axes` (module docstring)."""
    p, m_count = stages(), batch["inputs"].shape[0]
    v_count = max(cfg.parallel.virtual_stages, 1)
    is_spec = lambda x: isinstance(x, P)  # noqa: E731
    # over the batch axes only fsdp (`embed`) and expert (`experts`) split weights
    manual = (*batch_axes, AXIS)
    flat_specs = jax.tree.leaves(weight_specs(params, manual), is_leaf=is_spec)  # the body's [V, Lc] chunks
    splits = jax.tree.leaves(weight_specs(params, automatic(batch_axes)), is_leaf=is_spec)
    outer = weight_specs(params, manual, stored=True)  # the stored [X] blocks, laid out in the body

    def body(local: nnx.State, inputs: jax.Array, targets: jax.Array) -> tuple:
        compute = compute_params(local, cfg.model.compute_dtype)
        compute = gathered_once(chunked(compute, p, v_count, vee), flat_specs, splits)
        loss, grads, stats = run(compute, inputs, targets)
        n = math.prod(lax.axis_size(a) for a in batch_axes)
        over_batch = (lambda a: lax.psum(a, batch_axes) / n) if batch_axes else (lambda a: a)  # noqa: E731
        grads = reduced_once(grads, flat_specs, splits, batch_axes)  # once per step; embedding, head over stage
        grads = chunked(grads, p, v_count, vee, back=True)
        leaves, treedef = jax.tree.flatten(grads)  # the final norm (and a table stage does not split): summed
        summed = treedef.unflatten([g if over_stage(spec) else lax.psum(g, AXIS)
                                    for g, spec in zip(leaves, flat_specs, strict=True)])
        stats = {name: over_batch(lax.psum(a, AXIS)) / (m_count * moe_layers(cfg.model)) for name, a in stats.items()}
        return over_batch(lax.psum(loss, AXIS)), with_part(summed, "blocks", grads["blocks"]), stats

    rows = logical_to_spec((None, "batch", "length"), batch["inputs"].shape, jax.sharding.get_abstract_mesh(),
                           within=batch_axes)  # [M, b, L]: each device its b rows (its L/sp columns)
    return over_stages(body, (outer, rows, rows), (P(), outer, P()), batch_axes)(params, batch["inputs"],
                                                                                batch["targets"])
