"""GPipe and interleaved (circular) schedules: a scan over ticks on every stage; the backward pass
is autodiff's transpose of that scan, on each device.

Layout (p stages, V chunks per stage, X layers, Lc = X/(p·V) layers per chunk):

  blocks [X, ...] as stored, X split over stage; device s runs [V, Lc, ...], its chunk v =
  layers (v·p + s)·Lc ... + Lc - 1 (pipeline/layout.py). V = 1 (gpipe) is the stored layout
  itself: no data moves. V > 1 (interleaved) lays the cast layers out inside the shard_map
  every step, each chunk stored elsewhere moving once by collective-permute (the busiest
  device's `layout.leaving` chunks of Lc layers) in the compute dtype, their fp32 gradients
  back after the backward (pipeline/engine.py).

Tick t on device s runs its cell of pipeline/tables.py's table (the arrays of `cells`, in the
scan's rows): microbatch m on chunk v; its input is the embedding of m (s = 0, v = 0) or what
device s-1 sent last tick; the output is sent on to s+1 (p-1 wraps to 0 for the next chunk)
with one `ppermute` of [b, L, D] per tick: M·V + p - 1 collective-permutes of b·L·D per step
forward, the same backward. Idle cells run the layers on zeros (inputs masked with a select),
so no bubble value reaches the result.

Region and gradients: pipeline/engine.py's, shared with the 1F1B family: manual over stage
and the step's accumulation axes (data, fsdp and, the context parallelism written out,
sequence), the stage's weights cast, laid out and gathered whole over fsdp once per step, and
on each device `jax.value_and_grad` of its own objective (`_objective`) through the tick scan;
the summed gradients are then reduced over those axes once per step. The layers' gradients
sum over the ticks in fp32, as the 1F1B family's accumulators do (`_objective`'s fp32 stand-in:
autodiff's transpose of the scan sums a loop-invariant input's cotangent in its dtype). As
autodiff's transpose under XLA's batch axes, the tick scan had reduced the layers' gradients
over data in every tick, bubble ticks included (M·V + p - 1 all-reduces a step), and under
fsdp gathered the weights in every use (tiny pp=2,dp=2,fsdp=2 at M = 8: 7.7x the data bytes
and 15.3x the fsdp bytes, tests/test_hlo.py). Where a batch axis is not manual (`sequence` under
context_impl=gspmd: sharding.checks.accumulation_axes) XLA still reduces over it per tick.

Embedding and head run inside the region on every stage: the batch is embedded at once [M, b,
L, D] (only stage 0 reads it), and the M outputs, stage p-1's, are dealt out over the stages
after the ticks (`dealt`: stage p-1 sends each other stage its C·b·L·D by collective-permute,
the cotangents come back), so that each stage runs the head and loss on C = ceil(M/p) of
them. Run on every stage over all M, stage p-1's and the others' zeros, the head had cost
each stage M heads a step where C do: on 125m gpipe pp=2,dp=4, M = 8, 4 heads' 1.24e12 flops
per device, 21% of its model flops, and under remat none the logits of all M (XLA's peak
compiled for H100s 6.04 to 4.52 GiB, pp=4 9.25 to 4.66;
bench/results/gpipe-head-dealt-h100-compiled.json). The embedding's gradient is the lookup's
transpose from an fp32 table, once per step (pipeline.cells.embed_grad); the embedding's and
final norm's fp32 gradients, each nonzero on one stage, and the head's, summed over its C
microbatches on each, are summed over stage by the engine. `mean_loss`, the evaluation step's
forward, runs the same objective in the same region (pipeline.engine.forward_stages: the
weights gathered once over fsdp, the tables over stage, in the compute dtype).

Memory: the fp32 sum of the layers' gradients (`_objective`), the stage's layers in fp32 where
the bf16 sum had held them in bf16 (XLA's peak on 1b gpipe pp=2,dp=4: +0.8-0.9 GiB, where the
peak falls in the tick scan's backward; tools/estimate.py's `accumulator`); and autodiff keeps
every tick's chunk residuals: activation memory grows with M like the
unpipelined accumulation scan's would if it kept all microbatches, (M·V+p-1) ticks of Lc
layers, plus [M, b, L, D] of embeddings, outputs and their cotangents, and under remat none the
logits of the C microbatches dealt to the stage, [C·b, L, V/t] fp32 (else one microbatch's).
A tick runs its chunk in one checkpoint whose policy is model.remat.stash_policy, the 1F1B family's (pipeline/cells.py): its
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

from configs.base import RunConfig
from model.loss import cross_entropy
from model.moe import no_stats
from model.remat import stashed
from pipeline.cells import Static, embed, embed_grad, model_of, router_share
from pipeline.engine import forward_stages, run_stages
from pipeline.stages import AXIS, buffer, stages, with_part
from pipeline.tables import IDLE, cells, timetable
from sharding.checks import dealt_heads, head_per_microbatch


def loss_and_grads(params: nnx.State, graphdef: nnx.GraphDef, batch: dict, cfg: RunConfig,
                   batch_axes: tuple[str, ...] = ()) -> tuple[jax.Array, nnx.State, dict]:
    """Mean loss, fp32 gradients and router statistics of the [M, b, L] batch, the layers run as
    a circular pipeline in pipeline.engine's region (manual over stage and `batch_axes`), autodiff
    through the tick scan on each device."""
    st = _static(graphdef, cfg, batch)

    def run(compute: nnx.State, inputs: jax.Array, targets: jax.Array) -> tuple:
        tokens = merged(inputs)  # [b·M, L]
        sums = with_part(compute, "blocks", jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32), compute["blocks"]))
        (_, (loss, stats)), (grads, d_x) = jax.value_and_grad(_objective, argnums=(1, 2), has_aux=True)(
            st, sums, _embedded(st, compute, tokens), targets, cfg, compute["blocks"])  # _objective's docstring
        grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
        table = embed_grad(st, compute, tokens, merged(d_x), jax.tree.map(jnp.zeros_like, grads["embed"]))
        return loss, with_part(grads, "embed", table), stats

    return run_stages(params, batch, cfg, batch_axes, False, run)


def mean_loss(params: nnx.State, graphdef: nnx.GraphDef, batch: dict, cfg: RunConfig,
              batch_axes: tuple[str, ...] = ()) -> jax.Array:
    """The mean loss of the [M, b, L] batch, forward only (the evaluation step), in
    pipeline.engine's region (manual over stage and `batch_axes`, the weights gathered once)."""
    st = _static(graphdef, cfg, batch)

    def forward(compute: nnx.State, inputs: jax.Array, targets: jax.Array) -> jax.Array:
        return _objective(st, compute, _embedded(st, compute, merged(inputs)), targets, cfg)[1][0]

    return forward_stages(params, batch, cfg, batch_axes, forward)


def _static(graphdef: nnx.GraphDef, cfg: RunConfig, batch: dict) -> Static:
    return Static(graphdef, cfg.model, jnp.dtype(cfg.model.compute_dtype), cfg.train.z_loss, batch["inputs"].shape[0])


def _embedded(st: Static, compute: nnx.State, tokens: jax.Array) -> jax.Array:
    """The M microbatches' tokens, merged [b·M, L], looked up at once: [M, b, L, D]."""
    return unmerged(embed(st, compute, tokens, compute["embed"]), st.m_count)


def _objective(st: Static, compute: nnx.State, x_all: jax.Array, targets: jax.Array, cfg: RunConfig,
               layers: nnx.State | None = None) -> tuple:
    """A device's objective, its chunks ([V, Lc, ...] blocks of `compute`) run over the
    timetable's ticks on the embedded batch x_all [M, b, L, D]: on every stage its share of the
    mean loss of the M microbatches' outputs (the losses of those `dealt` to it, over M) and
    its chunks' router losses; as aux (that share, and the router statistics' sums).

    `layers` (the training step's): the chunks' weights in the compute dtype, compute["blocks"]
    then fp32 zeros of their shape that stand in for them in autodiff (`_fp32_grad`): their
    gradient is the layers' gradient, summed over the ticks in fp32, as the 1F1B family's
    accumulators sum it. Autodiff's transpose of the tick scan sums a loop-invariant input's
    cotangent in that input's dtype, bf16 for the weights themselves (each tick's term is the
    bf16 matmul's in every schedule). Summed in bf16, gpipe's layer
    gradients on tiny pp=2 were 1.20x (M = 8), 1.36x (16) and 1.56x (32) as far from the fp32
    one-device gradients as 1f1b's."""
    p, v_count, s = stages(), max(cfg.parallel.virtual_stages, 1), lax.axis_index(AXIS)
    model, ring = model_of(st, compute), [(i, (i + 1) % p) for i in range(p)]
    rows = tuple(jnp.asarray(a) for a in cells(timetable(cfg.parallel.schedule, p, st.m_count, v_count)))

    zeros = None if layers is None else compute["blocks"]
    layers = compute["blocks"] if layers is None else layers

    def chunk(layers: nnx.State, zeros: nnx.State | None, x: jax.Array, v: jax.Array) -> tuple:
        weights = jax.tree.map(lambda a: a[v], layers)  # the slice recomputed (module docstring)
        if zeros is not None:
            weights = jax.tree.map(lambda w, z: _fp32_grad(w, z[v]), weights, zeros)
        y, stats = model.run_layers(x, weights)
        return (y, router_share(st, stats)), stats

    run_chunk = stashed(chunk, cfg.model.remat)

    def tick(carry, row):
        state, outputs, share, stats = carry  # state [b, L, D]: what arrived this tick
        kind, m, v = (a[s] for a in row)
        active = kind != IDLE
        x = jnp.where((s == 0) & (v == 0), x_all[m], state)
        x = jnp.where(active, x, jnp.zeros_like(x))  # idle ticks never read the buffers
        (y, more_share), more = run_chunk(layers, zeros, x, v)
        share = share + jnp.where(active, more_share, 0.0)
        stats = jax.tree.map(lambda a, b: a + jnp.where(active, b, 0.0), stats, more)  # idle: not counted
        done = active & (s == p - 1) & (v == v_count - 1)
        outputs = outputs.at[m].set(jnp.where(done, y, outputs[m]))
        return (lax.ppermute(y, AXIS, ring), outputs, share, stats), None

    start = (buffer(x_all.shape[1:], x_all.dtype), buffer(x_all.shape, x_all.dtype),
             jnp.zeros((), jnp.float32), no_stats(cfg.model))
    (_, outputs, share, stats), _ = lax.scan(tick, start, rows)
    out, mine, real = dealt(outputs, targets, s, p)
    loss = head_loss(model, out, mine, real, cfg.train.z_loss, head_per_microbatch(cfg.model)) / st.m_count
    return loss + share, (loss, stats)


def dealt(outputs: jax.Array, targets: jax.Array, s: jax.Array, p: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The last stage's outputs [M, b, L, D] dealt out over the p stages for the head, C =
    ceil(M/p) microbatches each (stage s: s·C ... s·C + C - 1, the M padded to p·C with zeros):
    (its outputs [C, b, L, D], their targets [C, b, L], which of the C are real [C] bool).

    Stage p-1 keeps the last C and sends stage t its C by a collective-permute of one pair (p-1
    -> t), p - 1 of them; autodiff's transposes send the cotangents back. Each keeps the layout
    of the tick permutes (under sequence parallelism each tensor rank sends its L/t columns): a
    reduce-scatter over stage of the padded buffer, the same bytes in one collective, made XLA
    gather the outputs over tensor first and scatter whole copies. Forward stage p-1 sends
    (p-1)·C·b·L·D elements, backward every other stage C·b·L·D."""
    m_count = outputs.shape[0]
    c = dealt_heads(m_count, p)
    pad = lambda a: jnp.pad(a, [(0, p * c - m_count)] + [(0, 0)] * (a.ndim - 1))  # noqa: E731
    chunks = pad(jnp.where(s == p - 1, outputs, 0)).reshape(p, c, *outputs.shape[1:])  # the NaN buffers never read
    out = chunks[p - 1]
    for t in range(p - 1):
        out = jnp.where(s == t, lax.ppermute(chunks[t], AXIS, [(p - 1, t)]), out)
    return out, lax.dynamic_slice_in_dim(pad(targets), s * c, c), s * c + jnp.arange(c) < m_count


@jax.custom_vjp
def _fp32_grad(w: jax.Array, z: jax.Array) -> jax.Array:
    """w (a chunk's bf16 weights), whose cotangent, cast to fp32, goes to z (fp32 zeros of w's
    shape) rather than to w, so that autodiff sums it over the ticks in fp32. z's value is never
    read: neither the forward nor a tick's checkpoint keeps it. Adding z to w instead had XLA
    hold the zeros through the step too (1b gpipe pp=2,dp=4 remat full: 15.83 GiB against 14.57;
    interleaved 14.35 against 13.13)."""
    return w


def _fp32_grad_fwd(w: jax.Array, z: jax.Array) -> tuple:
    return w, None


def _fp32_grad_bwd(_, ct: jax.Array) -> tuple:
    return jnp.zeros_like(ct), ct.astype(jnp.float32)  # w's: dropped (the layers take no gradient)


_fp32_grad.defvjp(_fp32_grad_fwd, _fp32_grad_bwd)


def merged(a: jax.Array) -> jax.Array:
    """[M, b, ...] -> [b·M, ...], b kept major so that its split over the batch axes moves nothing."""
    return a.swapaxes(0, 1).reshape(-1, *a.shape[2:])


def unmerged(a: jax.Array, m_count: int) -> jax.Array:
    """[b·M, ...] (b major) -> [M, b, ...]."""
    return a.reshape(-1, m_count, *a.shape[1:]).swapaxes(0, 1)


def head_loss(model: nnx.Module, out: jax.Array, targets: jax.Array, real: jax.Array, z_loss: float,
              per_microbatch: bool) -> jax.Array:
    """The sum of the mean losses of the C microbatches' outputs [C, b, L, D] (those `dealt` to
    this stage) and targets [C, b, L] that are `real` [C] (the padding's count 0).

    Not per_microbatch (remat none: sharding.checks.head_per_microbatch): all C at once, as one
    batch [b·C, L, D] (b, split over the batch axes, kept major so that the merge moves
    nothing): the logits of all C are held for the backward, [C·b, L, V/t] fp32, and the head's
    gradient [D, V/t] comes out of one matmul. (A vmap over the microbatches made it one
    gradient each in fp32, summed after: M·V·D·4/t bytes, 7.8 GiB on llama3-8b at M = 4.)
    per_microbatch (any other policy): one microbatch at a time (a scan), each recomputed in
    the backward, so that one microbatch's logits are live at a time; the recompute is the
    head's forward matmul again, 2·b·L·D·V/t flops per microbatch (about 2% of llama3-8b's
    step, 7% of 125m's)."""
    if not per_microbatch:
        rows = merged(jnp.broadcast_to(real[:, None, None], targets.shape).astype(jnp.float32))  # [b·C, L]
        return out.shape[0] * cross_entropy(model.logits(merged(out)), merged(targets), z_loss, rows)

    def one(total: jax.Array, xy: tuple) -> tuple:
        x, y, keep = xy
        return total + jnp.where(keep, cross_entropy(model.logits(x), y, z_loss), 0.0), None

    total, _ = lax.scan(jax.checkpoint(one), jnp.zeros((), jnp.float32), (out, targets, real))
    return total
