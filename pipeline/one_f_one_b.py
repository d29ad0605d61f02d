"""1F1B in one SPMD program: each stage alternates one forward and one backward, with its own
per-stage `jax.vjp`; no autodiff through the schedule.

Layout: blocks [X, ...] split over stage as stored (device s holds layers s·X/p ... of X/p); the
embedding, final norm and head are replicated over stage and used by stage 0 (embedding) and
stage p-1 (head and loss) inside the schedule. They must be: the backward of microbatch 0
starts before microbatch M-1 has entered, so the loss of each microbatch is computed where
its forward ends, on the last stage, and its cotangent starts there. Their gradients are summed
over stage once per step (an all-reduce of the embedding, norm and head: 2·(V·D+D)(p-1)/p
bytes-elements per device).

Tick program (one `lax.scan` over the ticks of pipeline/schedule.py's 1f1b table; every device
runs it and picks its own cell with `lax.axis_index`):

  1. receive: ppermute the forward output sent last tick to s+1, the input gradient to s-1
     (two collective-permutes of b·L·D per tick, 2·(2(M+p-1)) per step); a value that
     arrives is put in the stash (forward) or the gradient inbox slot of its microbatch;
  2. input: stage 0 embeds microbatch m's tokens, the others read their stash;
  3. run the cell, a `lax.switch` on the program's branch over `CELLS`, functions of the stage's
     parameters, the input x, the gradient g from the inbox, the microbatch's targets and the
     carry's `Sent` (the two sends, gradients and loss), returning the next `Sent`:
     F                 run the stage's layers on the input, send the output
     F on stage p-1    nothing: the input waits in the stash for B
     B                 vjp of the layers from the input (forward recomputed), cotangent g
     B on stage p-1    value_and_grad of layers + head + loss (scaled 1/M)
     accumulating the parameter gradients (fp32) in the carry and sending dx to s-1;
  4. embedding backward: the table's gradient from stage 0's dx (zero on the other stages).

The embedding (2 and 4) runs outside the switch, on every stage every tick: the devices of
different stages take different branches, so a branch may hold only collectives whose devices
are all in one stage. GSPMD's partition of the embedding's scatter-add under sequence
parallelism is a collective-permute over all devices, which would wait forever for the stages
that took another branch (the tensor-parallel all-reduces, all-gathers and reduce-scatters
inside the stage's layers stay within a stage). The cost is a [b, L, D] gather and
scatter-add per tick on the stages that do not need them. The head's collectives (the vocab
split over tensor) stay within the last stage. tp_overlap's rings are collective-permutes too,
hence refused with 1f1b (sharding/checks.py).

Memory: the backward recomputes the stage forward from its stashed input (one extra forward
per stage per microbatch, the price of keeping no residuals between ticks), so a stage holds
only K stage inputs [b, L, D] (K = the most microbatches between arrival and backward, at most
p for stage 1, from the table) plus K' incoming gradients and one microbatch's vjp residuals
inside the B cell: flat in M. GPipe holds the residuals of all M microbatches instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax
from jax.sharding import PartitionSpec as P
from jax.typing import DTypeLike

from configs.base import ModelConfig, RunConfig
from pipeline.schedule import BACKWARD, FORWARD, IDLE, cells, one_f_one_b
from pipeline.stages import AXIS, buffer, over_stages, stages, with_part
from model.loss import cross_entropy
from model.moe import no_stats, router_loss
from sharding.checks import moe_layers
from model.transformer import Transformer, compute_params

BACKWARD_LAST = BACKWARD + 1  # the cells: the table's IDLE, FORWARD, BACKWARD, and B on stage p-1


def _slots(arrive: np.ndarray, kind: np.ndarray, microbatch: np.ndarray) -> int:
    """Most microbatches a stage holds at once, from their arrival to its own B; checks that
    slot m mod K never holds two."""
    most = 1
    for s in range(arrive.shape[1]):
        held: set[int] = set()
        for t in range(len(arrive)):
            if arrive[t, s] >= 0:
                held.add(int(arrive[t, s]))
            most = max(most, len(held))
            if kind[t, s] == BACKWARD:
                held.discard(int(microbatch[t, s]))
    for s in range(arrive.shape[1]):
        live = arrive[:, s][arrive[:, s] >= 0]
        assert len(set(live % most)) == min(len(live), most), "slot reuse would overwrite a held value"
    return most


class Program(NamedTuple):
    """The 1f1b table as int32 arrays [ticks, p] that the tick program indexes with (tick, stage),
    and the sizes of the buffers that hold what arrives until its B."""

    branch: np.ndarray  # the cell, an index into CELLS: IDLE, FORWARD, BACKWARD, BACKWARD_LAST
    microbatch: np.ndarray  # the cell's microbatch (0 when idle)
    arrive_f: np.ndarray  # microbatch whose stage input arrives from s-1 at this tick, -1 none
    arrive_b: np.ndarray  # microbatch whose output gradient arrives from s+1, -1 none
    stash: int  # slots for stage inputs (slot m mod stash)
    inbox: int  # slots for output gradients (slot m mod inbox)


def program(p: int, m_count: int) -> Program:
    """The 1f1b tick program of p stages and M microbatches."""
    kind, microbatch, _ = cells(one_f_one_b(p, m_count))
    last = np.arange(p) == p - 1
    branch = np.where(last & (kind == FORWARD), IDLE, np.where(last & (kind == BACKWARD), BACKWARD_LAST, kind))
    arrive_f, arrive_b = np.full_like(kind, -1), np.full_like(kind, -1)
    arrive_f[1:, 1:] = np.where(kind[:-1, :-1] == FORWARD, microbatch[:-1, :-1], -1)  # s-1's F last tick
    arrive_b[1:, :-1] = np.where(kind[:-1, 1:] == BACKWARD, microbatch[:-1, 1:], -1)  # s+1's B last tick
    stash, inbox = _slots(arrive_f, kind, microbatch), _slots(arrive_b, kind, microbatch)
    return Program(branch, microbatch, arrive_f, arrive_b, stash, inbox)


@dataclass(frozen=True)
class Static:
    """What the cells take besides arrays: the model's structure and config (its router losses'
    weights), the compute dtype, the loss's z-loss weight and M (each microbatch's loss counts 1/M)."""

    graphdef: nnx.GraphDef
    model: ModelConfig
    dtype: DTypeLike
    z_loss: float
    m_count: int


class Sent(NamedTuple):
    """What a cell leaves in the carry."""

    send_f: jax.Array  # [b, L, D] the stage's output, for s+1 at the next tick
    send_b: jax.Array  # [b, L, D] the gradient of the stage's input, for s-1 at the next tick
    grads: nnx.State  # fp32 gradients of the stage's parameters, summed over the ticks so far
    loss: jax.Array  # the loss summed so far (stage p-1)
    stats: dict  # the router statistics of the stage's MoE layers, summed over its B cells so far


def _model(st: Static, local: nnx.State) -> Transformer:
    """The model on the stage's parameters, cast to the compute dtype once (the blocks with them)."""
    return nnx.merge(st.graphdef, compute_params(local, st.dtype))


def _layers(model: Transformer, x: jax.Array) -> tuple[jax.Array, dict]:
    """x [b, L, D] through the stage's X/p layers; their router statistics, summed."""
    return model.run_layers(x, nnx.state(model.blocks))


def _router_share(st: Static, stats: dict) -> jax.Array:
    """This stage's part of one microbatch's router losses in the objective: its MoE layers'
    summed losses over all MoE layers and M (0 for a dense model)."""
    return jnp.asarray(router_loss(stats, st.model), jnp.float32) / (st.m_count * max(moe_layers(st.model), 1))


def _stage(st: Static, local: nnx.State, x: jax.Array) -> tuple[tuple[jax.Array, jax.Array], dict]:
    """(the stage's output, its router share), and its router statistics as aux."""
    y, stats = _layers(_model(st, local), x)
    return (y, _router_share(st, stats)), stats


def _last(st: Static, local: nnx.State, x: jax.Array, target: jax.Array) -> tuple[jax.Array, tuple]:
    """Stage p-1's layers, head and loss of one microbatch (target [b, L]), scaled 1/M, plus its
    router share; as aux (the scaled loss, the router statistics)."""
    model = _model(st, local)
    y, stats = _layers(model, x)
    loss = cross_entropy(model.logits(y), target, st.z_loss) / st.m_count
    return loss + _router_share(st, stats), (loss, stats)


def _embed(st: Static, local: nnx.State, tokens: jax.Array, table: jax.Array) -> jax.Array:
    """Stage 0's input: tokens [b, L] looked up in `table` (the embedding, vocab-parallel)."""
    return _model(st, with_part(local, "embed", table)).embed_tokens(tokens, vocab_parallel=True)


def _acc(grads: nnx.State, d: nnx.State) -> nnx.State:
    return jax.tree.map(lambda a, b: a + b.astype(a.dtype), grads, d)


# The cells, one per Program.branch: (static, the stage's parameters, its input x [b, L, D], the
# gradient g of its output from the inbox, the microbatch's target tokens [b, L], what the
# carry holds) -> what the carry holds next.


def _idle(st: Static, local: nnx.State, x: jax.Array, g: jax.Array, target: jax.Array, out: Sent) -> Sent:
    return out


def _forward(st: Static, local: nnx.State, x: jax.Array, g: jax.Array, target: jax.Array, out: Sent) -> Sent:
    return out._replace(send_f=_stage(st, local, x)[0][0])


def _backward(st: Static, local: nnx.State, x: jax.Array, g: jax.Array, target: jax.Array, out: Sent) -> Sent:
    _, vjp, stats = jax.vjp(partial(_stage, st), local, x, has_aux=True)
    dl, dx = vjp((g, jnp.ones((), jnp.float32)))  # the router share enters the objective as is
    return out._replace(send_b=dx, grads=_acc(out.grads, dl), stats=jax.tree.map(jnp.add, out.stats, stats))


def _backward_last(st: Static, local: nnx.State, x: jax.Array, g: jax.Array, target: jax.Array,
                   out: Sent) -> Sent:
    (_, (lm, stats)), (dl, dx) = jax.value_and_grad(partial(_last, st), argnums=(0, 1), has_aux=True)(local, x, target)
    return out._replace(send_b=dx, grads=_acc(out.grads, dl), loss=out.loss + lm,
                        stats=jax.tree.map(jnp.add, out.stats, stats))


CELLS = (_idle, _forward, _backward, _backward_last)  # IDLE, FORWARD, BACKWARD, BACKWARD_LAST


def loss_and_grads(params: nnx.State, graphdef: nnx.GraphDef, batch: dict,
                   cfg: RunConfig) -> tuple[jax.Array, nnx.State, dict]:
    """Mean loss, fp32 gradients and router statistics of the [M, b, L] batch by the 1F1B schedule."""
    p, (m_count, b, length) = stages(), batch["inputs"].shape
    prog = program(p, m_count)
    st = Static(graphdef, cfg.model, jnp.dtype(cfg.model.compute_dtype), cfg.train.z_loss, m_count)
    branches = [partial(cell, st) for cell in CELLS]
    down, up = [(i, i + 1) for i in range(p - 1)], [(i + 1, i) for i in range(p - 1)]

    def body(local, inputs, targets):
        s = lax.axis_index(AXIS)

        def tick(carry, row):
            kind, m, af, ab = (a[s] for a in row)
            stash, inbox, out = carry
            recv_f, recv_b = lax.ppermute(out.send_f, AXIS, down), lax.ppermute(out.send_b, AXIS, up)
            slot_f, slot_b = jnp.maximum(af, 0) % prog.stash, jnp.maximum(ab, 0) % prog.inbox
            stash = stash.at[slot_f].set(jnp.where(af >= 0, recv_f, stash[slot_f]))
            inbox = inbox.at[slot_b].set(jnp.where(ab >= 0, recv_b, inbox[slot_b]))
            embedded, embed_vjp = jax.vjp(partial(_embed, st, local, inputs[m]), local["embed"])
            x = jnp.where(s == 0, embedded, stash[m % prog.stash])
            out = lax.switch(kind, branches, local, x, inbox[m % prog.inbox], targets[m], out)
            d_embedded = jnp.where((s == 0) & (kind == BACKWARD), out.send_b, jnp.zeros_like(out.send_b))
            grads = with_part(out.grads, "embed", _acc(out.grads["embed"], embed_vjp(d_embedded)[0]))
            return (stash, inbox, out._replace(grads=grads)), None

        act = (b, length, cfg.model.d_model)
        start = (buffer((prog.stash, *act), st.dtype), buffer((prog.inbox, *act), st.dtype),
                 Sent(buffer(act, st.dtype), buffer(act, st.dtype), jax.tree.map(jnp.zeros_like, local),
                      jnp.zeros((), jnp.float32), no_stats(cfg.model)))
        rows = tuple(jnp.asarray(a) for a in (prog.branch, prog.microbatch, prog.arrive_f, prog.arrive_b))
        (_, _, out), _ = lax.scan(tick, start, rows)
        summed = jax.tree.map(lambda a: lax.psum(a, AXIS), out.grads)  # embedding, norm, head
        stats = {name: lax.psum(a, AXIS) / (m_count * moe_layers(cfg.model)) for name, a in out.stats.items()}
        return lax.psum(out.loss, AXIS), with_part(summed, "blocks", out.grads["blocks"]), stats

    specs = with_part(jax.tree.map(lambda _: P(), params), "blocks", jax.tree.map(lambda _: P(AXIS), params["blocks"]))
    run = over_stages(body, (specs, P(), P()), (P(), specs, P()))
    return run(params, batch["inputs"], batch["targets"])
