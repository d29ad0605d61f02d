"""GPipe and interleaved (circular) schedules: a scan over ticks inside a shard_map over `stage`;
the backward pass is autodiff's transpose of that scan.

Layout (p stages, V chunks per stage, X layers, Lc = X/(p·V) layers per chunk):

  blocks [X, ...] as stored, X split over stage; device s runs [V, Lc, ...], its chunk v =
  layers (v·p + s)·Lc ... + Lc - 1 (pipeline/layout.py). V = 1 (gpipe) is the stored layout
  itself: no data moves. V > 1 (interleaved) lays the cast layers out inside the shard_map
  every step, each chunk stored elsewhere moving once by collective-permute (the busiest
  device's `layout.leaving` chunks of Lc layers), autodiff's transpose moving their gradients
  back, both in the compute dtype.

Tick t on device s runs its cell of pipeline/tables.py's table (the arrays of `cells`, in the
scan's rows): microbatch m on chunk v; its input is the embedding of m (s = 0, v = 0) or what
device s-1 sent last tick; the output is sent on to s+1 (p-1 wraps to 0 for the next chunk)
with one `ppermute` of [b, L, D] per tick: M·V + p - 1 collective-permutes of b·L·D per step
forward, the same backward. Idle cells run the layers on zeros (inputs masked with a select),
so no bubble value reaches the result.

Embedding and head run outside the shard_map, under GSPMD: the embedded batch [M, b, L, D]
enters replicated over stage (only stage 0 reads it; backward, its cotangent is summed over
stage: an all-reduce of M·b·L·D), the last stage's outputs [M, b, L, D] leave through a
[p, M, ...] array of which only row p-1 is read, and the head (final norm, [D, V] matmul, loss)
runs replicated on every stage, p times its work: under remat none on all M microbatches at
once, under any other policy one microbatch at a time, recomputed in the backward
(`head_loss`).

Memory: autodiff keeps every tick's chunk residuals: activation memory grows with M like the
unpipelined accumulation scan's would if it kept all microbatches, (M·V+p-1) ticks of Lc
layers, plus [M, b, L, D] of embeddings, outputs and their cotangents, and under remat none the
logits of all M, [M·b, L, V/t] fp32 (else one microbatch's). A tick runs its chunk in one
checkpoint whose policy is model.remat.stash_policy, the 1F1B family's (pipeline/cells.py): its
inputs are the loop-invariant layers [V, Lc, ...] and the chunk number, so what the tick keeps
is what that policy saves, never the chunk's weights (a dynamic slice of the layers, recomputed
in the backward), and under remat none not the cheap elementwise outputs either. Picked by the
tick's traced chunk outside a checkpoint, the weights were kept once a tick, (M·V+p-1) copies
of P_stage/V weights in the compute dtype, and under remat none every elementwise output of
every tick, which XLA GPU held twice (the tick scan's stacked residuals copied). XLA's peak,
compiled for H100s: 125m gpipe pp=2,dp=2 M = 4 17.89 to 11.33 GiB under remat none, pp=2,tp=2
21.06 to 11.68, llama3-8b (4 layers) pp=2,fsdp=4 16.67 to 13.30; full and dots unchanged
under gpipe (which had indexed its chunk statically), interleaved full 1.75 to 1.69 GiB
(125m pp=2,dp=4) and 11.56 to 11.10 (llama3-8b) (bench/results/circular-stash-h100-compiled.json).
The head runs one microbatch at a time under any policy but none (`head_loss`): with the
head's per-microbatch gradients that had cost 27-66% of XLA's peak under full and dots
(bench/results/gpipe-head-h100-compiled.json).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax
from jax.sharding import PartitionSpec as P

from configs.base import RunConfig
from pipeline.layout import lay_out
from pipeline.tables import IDLE, cells, timetable
from pipeline.stages import AXIS, buffer, over_stages, stages
from model.loss import cross_entropy
from model.moe import no_stats, router_loss
from model.remat import stashed
from sharding.checks import head_per_microbatch, moe_layers
from model.transformer import compute_params


def pipelined_loss(params: nnx.State, graphdef: nnx.GraphDef, batch: dict, cfg: RunConfig) -> tuple:
    """The objective of the [M, b, L] batch, the layers run as a circular pipeline: the mean
    loss plus the router losses; as aux, (mean loss, router statistics per MoE layer)."""
    p, v_count = stages(), max(cfg.parallel.virtual_stages, 1)
    m_count = batch["inputs"].shape[0]
    model = nnx.merge(graphdef, compute_params(params, cfg.model.compute_dtype))
    x_all = jax.vmap(model.embed_tokens)(batch["inputs"])  # [M, b, L, D]
    layers = nnx.state(model.blocks)  # [X, ...], cast to the compute dtype
    ring = [(i, (i + 1) % p) for i in range(p)]
    rows = tuple(jnp.asarray(a) for a in cells(timetable(cfg.parallel.schedule, p, m_count, v_count)))

    def body(stored: nnx.State, x_all: jax.Array) -> tuple[jax.Array, dict]:
        s = lax.axis_index(AXIS)
        layers = jax.tree.map(lambda a: lay_out(a.reshape(v_count, -1, *a.shape[1:]), p, vee=False),
                              stored)  # the stored [V·Lc, ...] -> the run [V, Lc, ...]

        def chunk(layers: nnx.State, x: jax.Array, v: jax.Array) -> tuple[jax.Array, dict]:
            return model.run_layers(x, jax.tree.map(lambda a: a[v], layers))  # the slice recomputed (docstring)

        run_chunk = stashed(chunk, cfg.model.remat)

        def tick(carry, row):
            state, outputs, stats = carry  # state [b, L, D]: what arrived this tick
            kind, m, v = (a[s] for a in row)
            active = kind != IDLE
            x = jnp.where((s == 0) & (v == 0), x_all[m], state)
            x = jnp.where(active, x, jnp.zeros_like(x))  # idle ticks never read the buffers
            y, more = run_chunk(layers, x, v)
            stats = jax.tree.map(lambda a, b: a + jnp.where(active, b, 0.0), stats, more)  # idle: not counted
            done = active & (s == p - 1) & (v == v_count - 1)
            outputs = outputs.at[m].set(jnp.where(done, y, outputs[m]))
            return (lax.ppermute(y, AXIS, ring), outputs, stats), None

        start = (buffer(x_all.shape[1:], x_all.dtype), buffer(x_all.shape, x_all.dtype), no_stats(cfg.model))
        (_, outputs, stats), _ = lax.scan(tick, start, rows)
        return outputs[None], jax.tree.map(lambda a: a[None], stats)  # [1, M, b, L, D], {name: [1]}

    specs = jax.tree.map(lambda _: P(AXIS), layers)
    out, stats = over_stages(body, (specs, P()), P(AXIS))(layers, x_all)
    stats = {name: jnp.sum(a) / (m_count * moe_layers(cfg.model)) for name, a in stats.items()}
    loss = head_loss(model, out[p - 1], batch["targets"], cfg.train.z_loss, head_per_microbatch(cfg.model))
    return loss + router_loss(stats, cfg.model), (loss, stats)


def head_loss(model: nnx.Module, out: jax.Array, targets: jax.Array, z_loss: float,
              per_microbatch: bool) -> jax.Array:
    """The mean loss of the M microbatches' outputs [M, b, L, D] (the last stage's) and targets
    [M, b, L].

    Not per_microbatch (remat none: sharding.checks.head_per_microbatch): all M at once, as one
    batch [b·M, L, D] (b, split over the batch axes, kept major so that the merge moves
    nothing): the logits of all M are held for the backward, [M·b, L, V/t] fp32, and the head's
    gradient [D, V/t] comes out of one matmul. (A vmap over M made it M gradients in fp32,
    summed after: M·V·D·4/t bytes, 7.8 GiB on llama3-8b at M = 4.) per_microbatch (any other
    policy): one microbatch at a time (a scan), each recomputed in the backward, so that one
    microbatch's logits are live at a time; the recompute is the head's forward matmul again,
    2·b·L·D·V/t flops per microbatch (about 2% of llama3-8b's step, 7% of 125m's)."""
    if not per_microbatch:
        merged = lambda a: a.swapaxes(0, 1).reshape(-1, *a.shape[2:])  # noqa: E731  [M, b, ...] -> [b·M, ...]
        return cross_entropy(model.logits(merged(out)), merged(targets), z_loss)

    def one(total: jax.Array, xy: tuple) -> tuple:
        x, y = xy
        return total + cross_entropy(model.logits(x), y, z_loss), None

    total, _ = lax.scan(jax.checkpoint(one), jnp.zeros((), jnp.float32), (out, targets))
    return total / out.shape[0]


def loss_and_grads(params: nnx.State, graphdef: nnx.GraphDef, batch: dict,
                   cfg: RunConfig) -> tuple[jax.Array, nnx.State, dict]:
    """Mean loss, gradients and router statistics of the [M, b, L] batch, autodiff through the
    circular pipeline."""
    (_, (loss, stats)), grads = jax.value_and_grad(pipelined_loss, has_aux=True)(params, graphdef, batch, cfg)
    return loss, grads, stats
