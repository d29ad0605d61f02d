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
     pipeline/stage_weights.py; the 1F1B family's head only as the stage's vocabulary
     columns, `columns`: pipeline/head.py);
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

The evaluation step (`forward_stages`: gpipe's forward, pipeline.circular.mean_loss) runs in
the same region after step 1, then sums the loss over stage and averages it over the batch
axes: its weights too are gathered once, in the compute dtype.

So the data and fsdp bytes of a pipelined step are those of one reduction whatever M and the
schedule: 2·4·P'·(N-1)/N over data (P' the device's parameters; N = dp·sp with sequence in the
region, dp·ep with expert for every weight but the routed experts), and under fsdp one all-gather of the compute-dtype weights and one fp32
reduce-scatter. Memory: the stage's weights whole over fsdp in the compute dtype and their fp32
gradients whole, for the step.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import jax
from flax import nnx
from jax import lax
from jax.sharding import PartitionSpec as P

from configs.base import RunConfig
from model.transformer import compute_params
from pipeline.stage_weights import chunked, gathered_once, heads_of, over_stage, reduced_once, weight_specs
from pipeline.stages import AXIS, over_stages, stages, with_part
from sharding.accumulation import automatic
from sharding.checks import moe_layers
from sharding.rules import logical_to_spec

# run(compute [V, Lc, ...] blocks, inputs [M, b, L], targets [M, b, L]) -> (the device's mean
# loss, its fp32 gradients of compute, its router statistics' sums {name: scalar})
Schedule = Callable[[nnx.State, jax.Array, jax.Array], tuple[jax.Array, nnx.State, dict]]


class _Region(NamedTuple):
    """The specs of a step's region: the body's weights (`flat`, the [V, Lc, ...] chunks), their
    splits over the automatic axes (`splits`), the stored parameters (`outer`, the in_spec), the
    batch's rows (`rows`) and which leaves are the head's, run as the stage's columns of it
    (`heads`: the 1F1B family, pipeline/head.py)."""

    flat: list[P]
    splits: list[P]
    outer: nnx.State
    rows: P
    heads: list[bool]


def _region(params: nnx.State, batch: dict, batch_axes: tuple[str, ...], columns: bool) -> _Region:
    """The specs of a region manual over stage and `batch_axes` (over the batch axes only fsdp,
    `embed`, and expert, `experts`, split weights); `columns`: the head as the stage's columns."""
    is_spec = lambda x: isinstance(x, P)  # noqa: E731
    manual = (*batch_axes, AXIS)
    rows = logical_to_spec((None, "batch", "length"), batch["inputs"].shape, jax.sharding.get_abstract_mesh(),
                           within=batch_axes)  # [M, b, L]: each device its b rows (its L/sp columns)
    return _Region(jax.tree.leaves(weight_specs(params, manual), is_leaf=is_spec),
                  jax.tree.leaves(weight_specs(params, automatic(batch_axes)), is_leaf=is_spec),
                  weight_specs(params, manual, stored=True), rows,
                  heads_of(params) if columns else [False] * len(jax.tree.leaves(params)))


def _compute(local: nnx.State, specs: _Region, cfg: RunConfig, vee: bool) -> nnx.State:
    """Step 1 (module docstring): the device's stored parameters cast to the compute dtype, laid
    out as the chunks it runs and gathered whole over fsdp (the tables over stage too)."""
    compute = compute_params(local, cfg.model.compute_dtype)
    return gathered_once(chunked(compute, stages(), max(cfg.parallel.virtual_stages, 1), vee), specs.flat, specs.splits,
                         specs.heads)


def run_stages(params: nnx.State, batch: dict, cfg: RunConfig, batch_axes: tuple[str, ...], vee: bool,
               run: Schedule, columns: bool = False) -> tuple[jax.Array, nnx.State, dict]:
    """Mean loss, fp32 gradients (as stored) and router statistics (means per MoE layer and
    microbatch) of the [M, b, L] batch, the schedule `run` on each stage's chunks (`vee`: zbv's
    V layout) in a region manual over stage and `batch_axes` (module docstring); `columns`:
    `run` takes the head as the stage's columns of it, and gives their gradient (the 1F1B
    family's head over the stages, pipeline/head.py)."""
    p, m_count = stages(), batch["inputs"].shape[0]
    v_count = max(cfg.parallel.virtual_stages, 1)
    specs = _region(params, batch, batch_axes, columns)

    def body(local: nnx.State, inputs: jax.Array, targets: jax.Array) -> tuple:
        loss, grads, stats = run(_compute(local, specs, cfg, vee), inputs, targets)
        over_batch = _over_batch(batch_axes)
        grads = reduced_once(grads, specs.flat, specs.splits, batch_axes, specs.heads,  # once per step; embedding,
                             cfg.model.vocab_size)  # head over stage
        grads = chunked(grads, p, v_count, vee, back=True)
        leaves, treedef = jax.tree.flatten(grads)  # the final norm (and a table stage does not split): summed
        summed = treedef.unflatten([g if over_stage(spec) else lax.psum(g, AXIS)
                                    for g, spec in zip(leaves, specs.flat, strict=True)])
        stats = {name: over_batch(lax.psum(a, AXIS)) / (m_count * moe_layers(cfg.model)) for name, a in stats.items()}
        return over_batch(lax.psum(loss, AXIS)), with_part(summed, "blocks", grads["blocks"]), stats

    return over_stages(body, (specs.outer, specs.rows, specs.rows), (P(), specs.outer, P()), batch_axes)(
        params, batch["inputs"], batch["targets"])


def forward_stages(params: nnx.State, batch: dict, cfg: RunConfig, batch_axes: tuple[str, ...],
                   forward: Callable[[nnx.State, jax.Array, jax.Array], jax.Array]) -> jax.Array:
    """The mean loss of the [M, b, L] batch, forward only (the evaluation step): `forward`
    (compute, inputs, targets) -> the device's share of it, on run_stages's region and weights
    (gathered once, in the compute dtype), without a gradient."""
    specs = _region(params, batch, batch_axes, False)

    def body(local: nnx.State, inputs: jax.Array, targets: jax.Array) -> jax.Array:
        loss = forward(_compute(local, specs, cfg, False), inputs, targets)
        return _over_batch(batch_axes)(lax.psum(loss, AXIS))

    return over_stages(body, (specs.outer, specs.rows, specs.rows), P(), batch_axes)(params, batch["inputs"],
                                                                                     batch["targets"])


def _over_batch(batch_axes: tuple[str, ...]) -> Callable[[jax.Array], jax.Array]:
    """A device's value -> its mean over the batch axes (inside the region)."""
    if not batch_axes:
        return lambda a: a
    n = math.prod(lax.axis_size(axis) for axis in batch_axes)
    return lambda a: lax.psum(a, batch_axes) / n
