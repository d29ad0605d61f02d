"""The loss, gradient accumulation and the jitted train step.

Precision: parameters and optimizer state stay in `param_dtype` (fp32); the step casts the
parameter tree to `compute_dtype` (bf16 by default) before the forward pass, so XLA moves and
multiplies bf16 while gradients arrive in fp32 through the cast. Logits and the cross-entropy
are fp32.

Accumulation: a batch is [k, b, L]; a `lax.scan` over the k microbatches sums fp32 gradients
(held with the parameters' shardings) and divides by k, then one optimizer update is applied.
Microbatches have equal token counts, so this equals the gradient of one batch of k*b.

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

Collectives are not written here: XLA derives them from the shardings of the parameters
(sharding/rules.py) and of the batch, e.g. the gradient all-reduce over (data, fsdp).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import pipeline
from pipeline.circular import pipelined_loss
from configs.base import RunConfig
from model.loss import cross_entropy
from model.moe import no_stats, router_loss
from model.transformer import compute_params
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
                   schedule: str | None) -> tuple[jax.Array, nnx.State, dict]:
    """Mean loss (cross-entropy), gradients (of the objective) and router statistics ({} for a
    dense model) over the k microbatches of `batch` ([k, b, L] leaves).

    With a pipeline `schedule` (pp > 1) the k = M microbatches run through pipeline/.
    """
    if schedule:
        return pipeline.loss_and_grads(params, graphdef, batch, cfg)
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def micro(acc, microbatch):
        (_, (loss, stats)), grads = grad_fn(params, graphdef, microbatch, cfg)
        return jax.tree.map(jnp.add, acc, (loss, grads, stats)), None

    zeros = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params), no_stats(cfg.model))
    totals, _ = jax.lax.scan(micro, zeros, batch)
    k = batch["inputs"].shape[0]
    return jax.tree.map(lambda t: t / k, totals)


def make_train_step(graphdef: nnx.GraphDef, tx: optax.GradientTransformation, lr: optax.Schedule,
                    cfg: RunConfig, strategies: Strategies) -> Callable:
    """(state, batch) -> (state, metrics); jit it with the state's shardings."""

    def train_step(state: TrainState, batch: dict) -> tuple[TrainState, dict]:
        loss, grads, stats = loss_and_grads(state.params, graphdef, batch, cfg, strategies.schedule)
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
        return lambda params, batch: pipelined_loss(params, graphdef, batch, gpipe)[1][0]

    def eval_step(params: nnx.State, batch: dict) -> jax.Array:
        def micro(total, microbatch):
            _, (loss, _) = loss_fn(params, graphdef, microbatch, cfg)
            return total + loss, None

        total, _ = jax.lax.scan(micro, jnp.zeros((), jnp.float32), batch)
        return total / batch["inputs"].shape[0]

    return eval_step
