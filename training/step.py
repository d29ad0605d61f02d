"""The loss, gradient accumulation and the jitted train step.

Precision: parameters and optimizer state stay in `param_dtype` (fp32); the step casts the
parameter tree to `compute_dtype` (bf16 by default) before the forward pass, so XLA moves and
multiplies bf16 while gradients arrive in fp32 through the cast. Logits and the cross-entropy
are fp32.

Accumulation: a batch is [k, b, L]; a `lax.scan` over the k microbatches sums fp32 gradients
and divides by k, then one optimizer update is applied. Microbatches have equal token counts,
so this equals the gradient of one batch of k*b.

Where it would otherwise reduce every microbatch's gradients (k > 1; `Strategies.accumulation`
names the axes, sharding.checks.accumulation_axes decides), the scan runs in one `shard_map`
manual over the batch axes of size > 1 (data, fsdp; `expert` for a MoE model, each device
then holding its E/ep experts; and `sequence` under the context parallelism written out: each
device then runs its L/sp columns, the rotary tables sliced to them, model/transformer.py);
tensor (and expert where it is not among them) stays automatic, and the model's own regions
nested inside are manual over what is left, sharding/rules.not_manual; a weight split over
them is gathered and reduced on each device's shard, sharding/accumulation.py.
Each device runs the k microbatches of its own rows and sums its own fp32 gradients of the
whole (fsdp-gathered) weights; after the loop, once per step: a
reduce-scatter over fsdp (psum_scatter of each weight's `embed` dimension) and an all-reduce
over data of the shard that is left (weights fsdp does not split, the norms: one all-reduce over
data and fsdp). Per device per step, G the fp32 gradient bytes of the device's shard and P_c
the compute-dtype bytes of its weights before fsdp splits them (N the axis size):

  data   all-reduce          2·G·(N-1)/N once (XLA reduced every microbatch: k times that); with
                             sequence in the region, one all-reduce over data and sequence
                             together (N = dp·sp; XLA's per microbatch, in the compute dtype);
                             with expert, the same over data and expert (N = dp·ep) for every
                             weight but the routed experts, whose sums go over data alone
  fsdp   reduce-scatter      4/c·P_c·(N-1)/N once (fp32)
         all-gather          P_c·(N-1)/N per microbatch, of the whole weight tree in the compute
                             dtype before the microbatch's forward, kept for its backward (an
                             optimization barrier keeps XLA from hoisting it out of the loop);
                             once per step with parallel.fsdp_gather_once

Memory (per device, for the step): the gradient accumulator is fp32 and whole over fsdp, 4 bytes
per parameter of the device's tensor (and stage) shard, fsdp times what ZeRO-3 holds; the
gathered weights, P_c, live through each microbatch (with fsdp_gather_once through the whole
loop), where XLA's ZeRO-3 gathers one layer at a time. With data alone the accumulator is the
size it always was. At k = 1 (unless fsdp_gather_once) there is nothing to accumulate: the
step is XLA's, which reduces once and keeps ZeRO-3's memory. The pipeline schedules take the
data, fsdp and (the context parallelism written out) sequence axes the same way
(pipeline/engine.py: manual over them, one reduction per step). MoE models too: their
regions nest in either and sum the router statistics over its axes as well, and `expert` is
one of the axes of both, but here beside XLA's ZeRO-3 (fsdp > 1 without fsdp_gather_once),
where it stays theirs and XLA reduces the other weights' gradients over it per microbatch. sp > 1 beside
XLA's fsdp or an expert axis keeps XLA's placement (in a pipeline over sequence only), a
reduction per microbatch (per tick in gpipe and interleaved); in this step's own scan XLA GPU
moves the embedding's and head's out of the loop, once per step (tools.traffic counts both).
Non-finite steps: when the loss or the gradient norm is NaN or inf, the step keeps the old
parameters and optimizer state (an elementwise select per parameter and moment, which XLA fuses
into the optimizer's elementwise update) and counts the step in `bad_steps` (in a row) and
`skipped` (in all); the loop stops after `train.max_bad_steps` in a row. `step` advances anyway,
so the next step reads the next batch; the optimizer's own step count (and so its learning rate)
then lags `step` by the number of skipped steps.

Pipeline parallelism (pp > 1) replaces the microbatch scan by a schedule over the stage axis
(pipeline/): the k microbatches of the batch are its M microbatches. Which schedule (if any)
is `Strategies.schedule` (sharding/strategies.py).

Evaluation (`make_eval_step`) is the forward pass alone: the mean cross-entropy of a batch of
the same layout and shardings, without z-loss or router losses; with pp > 1 it runs the GPipe
forward of pipeline/circular.py whatever the training schedule, since all of them store the
layers alike (contiguous per stage) and a forward needs no 1F1B interleaving of backwards.

Outside the accumulation region collectives are not written here: XLA derives them from the
shardings of the parameters (sharding/rules.py) and of the batch, e.g. the gradient all-reduce
over (data, fsdp).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import PartitionSpec as P

import pipeline
from pipeline.circular import mean_loss
from configs.base import RunConfig
from model.loss import cross_entropy
from model.moe import no_stats, router_loss
from model.transformer import compute_params
from sharding.accumulation import automatic, gather as fsdp_gather, reduce as batch_reduce
from sharding.rules import logical_to_spec
from sharding.strategies import Strategies



class TrainState(NamedTuple):
    step: jax.Array  # int32 scalar: steps taken, skipped ones included (= the data position)
    params: nnx.State
    opt_state: Any
    bad_steps: jax.Array  # int32 scalar: non-finite steps in a row (0 after a good step)
    skipped: jax.Array  # int32 scalar: non-finite steps skipped in all


def loss_fn(params: nnx.State, graphdef: nnx.GraphDef, batch: dict, cfg: RunConfig) -> tuple[jax.Array, tuple]:
    """The objective of one microbatch {'inputs', 'targets'} [b, L]: the mean next-token
    cross-entropy (nats), plus for a MoE model the router losses (model/moe.py) weighted by
    model.router_aux_loss and model.router_z_loss; and, as aux, (cross-entropy, router stats)."""
    compute = compute_params(params, cfg.model.compute_dtype)
    logits, stats = nnx.merge(graphdef, compute)(batch["inputs"])  # [b, L, V] fp32
    loss = cross_entropy(logits, batch["targets"], cfg.train.z_loss)
    return loss + router_loss(stats, cfg.model), (loss, stats)


def loss_and_grads(params: nnx.State, graphdef: nnx.GraphDef, batch: dict, cfg: RunConfig,
                   schedule: str | None, accumulation: tuple[str, ...] = (),
                   gather_once: bool = False) -> tuple[jax.Array, nnx.State, dict]:
    """Mean loss (cross-entropy), gradients (of the objective) and router statistics ({} for a
    dense model) over the k microbatches of `batch` ([k, b, L] leaves).

    With a pipeline `schedule` (pp > 1) the k = M microbatches run through pipeline/.
    `accumulation`: the batch axes over which the microbatch loop runs per device, its gradients
    reduced once per step (`Strategies.accumulation`, the module docstring); () leaves the
    reductions to XLA. `gather_once`: fsdp's weights gathered before the loop, not per microbatch.
    """
    mesh, axes = jax.sharding.get_abstract_mesh(), _sized(accumulation)
    if schedule:
        return pipeline.loss_and_grads(params, graphdef, batch, cfg, axes)
    if not axes:
        return _accumulate(params, graphdef, batch, cfg)
    is_var = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
    leaves, treedef = jax.tree.flatten(params)
    names = [(v.get_metadata().get("out_sharding") or (None,) * v.ndim, v.shape)
             for v in jax.tree.leaves(params, is_leaf=is_var)]
    specs = [logical_to_spec(n, shape, mesh, within=axes) for n, shape in names]
    splits = [logical_to_spec(n, shape, mesh, within=automatic(axes)) for n, shape in names]
    assert len(specs) == len(leaves)
    batch_spec = logical_to_spec((None, "batch", "length"), batch["inputs"].shape, mesh, within=axes)
    n = math.prod(dict(mesh.shape)[a] for a in axes)

    def local(leaves: list, batch: dict) -> tuple:
        """One device's k microbatches: its own rows of the batch, its fsdp shard of the weights."""
        def gather(weights: list) -> list:
            return jax.tree.map(fsdp_gather, specs, weights, splits)

        weights = compute_params(leaves, cfg.model.compute_dtype)  # the shard, cast before the gather
        if gather_once:
            weights = gather(weights)
        loss, grads, stats = _accumulate(
            weights, graphdef, batch, cfg, treedef=treedef, prepare=None if gather_once else gather,
            grad_dtypes=[a.dtype for a in leaves])
        grads = [batch_reduce(g, spec, axes, split) / n for g, spec, split in zip(grads, specs, splits)]
        return jax.lax.psum(loss, axes) / n, grads, jax.tree.map(lambda s: jax.lax.psum(s, axes) / n, stats)

    region = jax.shard_map(local, in_specs=(specs, {"inputs": batch_spec, "targets": batch_spec}),
                           out_specs=(P(), specs, P()), axis_names=set(axes), check_vma=False)
    loss, grads, stats = region(leaves, batch)
    return loss, jax.tree.unflatten(treedef, grads), stats


def _accumulate(weights, graphdef: nnx.GraphDef, batch: dict, cfg: RunConfig, treedef=None,
                prepare: Callable | None = None, grad_dtypes: list | None = None) -> tuple:
    """The scan over the k microbatches: (mean loss, mean gradients, mean router statistics).
    `weights`: the parameter tree, or (in the accumulation region) the flat list of its leaves
    (`treedef`), passed through `prepare` (fsdp's all-gather) at every microbatch; the gradients
    are summed in `grad_dtypes` (the parameters' fp32), with the gathered weights' shapes."""
    as_tree = (lambda w: w) if treedef is None else functools.partial(jax.tree.unflatten, treedef)

    def objective(w, microbatch):
        return loss_fn(as_tree(w), graphdef, microbatch, cfg)

    grad_fn = jax.value_and_grad(objective, has_aux=True)

    def micro(acc, microbatch):
        w = weights
        if prepare:  # tied to the iteration, so that XLA does not hoist the gather out of the loop
            w, acc = jax.lax.optimization_barrier((w, acc))
        (_, (loss, stats)), grads = grad_fn(prepare(w) if prepare else w, microbatch)
        grads = jax.tree.map(lambda a, g: g.astype(a.dtype), acc[1], grads)
        return jax.tree.map(jnp.add, acc, (loss, grads, stats)), None

    shapes = jax.eval_shape(prepare, weights) if prepare else weights
    dtypes = grad_dtypes or [w.dtype for w in jax.tree.leaves(weights)]
    zero_grads = jax.tree.unflatten(jax.tree.structure(shapes),
                                    [jnp.zeros(s.shape, d) for s, d in zip(jax.tree.leaves(shapes), dtypes)])
    zeros = (jnp.zeros((), jnp.float32), zero_grads, no_stats(cfg.model))
    totals, _ = jax.lax.scan(micro, zeros, batch)
    k = batch["inputs"].shape[0]
    return jax.tree.map(lambda t: t / k, totals)


def _sized(axes: tuple[str, ...]) -> tuple[str, ...]:
    """Those of the accumulation `axes` the mesh in context gives more than one device."""
    mesh = jax.sharding.get_abstract_mesh()
    return () if mesh.empty else tuple(a for a in axes if dict(mesh.shape).get(a, 1) > 1)


def make_train_step(graphdef: nnx.GraphDef, tx: optax.GradientTransformation, lr: optax.Schedule,
                    cfg: RunConfig, strategies: Strategies) -> Callable:
    """(state, batch) -> (state, metrics); jit it with the state's shardings."""

    def train_step(state: TrainState, batch: dict) -> tuple[TrainState, dict]:
        loss, grads, stats = loss_and_grads(state.params, graphdef, batch, cfg, strategies.schedule,
                                            strategies.accumulation, strategies.fsdp_gather_once)
        with jax.named_scope("optimizer"):
            grad_norm = optax.tree.norm(grads)
            updates, opt_state = tx.update(grads, state.opt_state, state.params)
            params = optax.apply_updates(state.params, updates)
            ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
            params, opt_state = jax.tree.map(
                lambda new, old: jnp.where(ok, new, old), (params, opt_state), (state.params, state.opt_state)
            )
        bad_steps = jnp.where(ok, 0, state.bad_steps + 1)
        skipped = state.skipped + (~ok).astype(jnp.int32)
        metrics = {"loss": loss, "grad_norm": grad_norm, "lr": lr(state.step),
                   "bad_steps": bad_steps, "skipped": skipped} | {f"moe_{k}": v for k, v in stats.items()}
        return TrainState(state.step + 1, params, opt_state, bad_steps, skipped), metrics

    return train_step


def make_eval_step(graphdef: nnx.GraphDef, cfg: RunConfig, strategies: Strategies) -> Callable:
    """(params, batch) -> the mean next-token cross-entropy (nats) of the [k, b, L] batch, forward
    only; jit it with the parameters' and the batch's shardings."""
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, z_loss=0.0))
    if strategies.schedule:
        gpipe = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, schedule="gpipe", virtual_stages=1))
        return lambda params, batch: mean_loss(params, graphdef, batch, gpipe, _sized(strategies.accumulation))

    def eval_step(params: nnx.State, batch: dict) -> jax.Array:
        def micro(total, microbatch):
            _, (loss, _) = loss_fn(params, graphdef, microbatch, cfg)
            return total + loss, None

        total, _ = jax.lax.scan(micro, jnp.zeros((), jnp.float32), batch)
        return total / batch["inputs"].shape[0]

    return eval_step
