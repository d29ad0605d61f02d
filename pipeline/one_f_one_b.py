"""The 1F1B family in one SPMD program: 1f1b, interleaved-1f1b and zb-h1. Each stage
alternates forwards and backwards of different microbatches, with its own per-stage `jax.vjp`;
no autodiff through the schedule.

Layout (p stages, V chunks per stage, V = 1 but for interleaved-1f1b, X layers, Lc = X/(p·V)):
blocks [X, ...] -> [V, p·Lc, ...], p·Lc split over stage: device s holds [V, Lc, ...], its
chunk v = layers (v·p + s)·Lc ... + Lc - 1. V = 1 is the stored layout (no data moves); V > 1
re-lays the stored contiguous split every step as the circular schedules do ((V-1)/V of each
device's layer weights forward, their gradients backward, over `stage`). The embedding, final
norm and head are replicated over stage and used by stage 0 chunk 0 (embedding) and stage p-1
chunk V-1 (head and loss) inside the schedule: the backward of microbatch 0 starts before
microbatch M-1 has entered, so each microbatch's loss is computed where its forward ends and
its cotangent starts there. Their gradients are summed over stage once per step (an
all-reduce of the embedding, norm and head: 2·(V·D+D)(p-1)/p elements per device).

Tick program (one `lax.scan` over the ticks of pipeline/schedule.py's table; every device runs
it and picks its own cell with `lax.axis_index`; the buffer slots are assigned on the host,
`program`):

  1. receive: ppermute the forward output sent last tick to s+1, the input gradient to s-1
     (with V > 1 both are rings: stage p-1's chunk v feeds stage 0's chunk v+1, and back);
     two collective-permutes of b·L·D per tick; an arriving value is written to its slot of
     `inputs` (forward) or `inbox` (gradient);
  2. input: stage 0 chunk 0 embeds microbatch m's tokens, the others read their `inputs` slot;
  3. the cell, a `lax.switch` over `CELLS` (`SPLIT_CELLS` for zb-h1), functions of the stage's
     parameters, chunk v, the cell's slots, the input x, the gradient g, the microbatch's
     targets and the carry's `Sent`:
     F      run chunk v's layers under `jax.vjp`, send the output, keep the vjp's residuals in
            a `residuals` slot until B (the last chunk's output waits in its input slot)
     B      the vjp from the kept residuals, cotangent g: chunk v's gradients (fp32, summed in
            the carry) and dx, sent to s-1; on the last chunk first the head and loss (scaled
            1/M), forward and backward, give its cotangent
     split (zb-h1, pipeline/split_backward.py): B computes dx only and leaves in a `stash`
            slot what W needs (each matmul's output cotangent); W, a later tick, the weight
            gradients from the residuals and the stash. All weight-gradient matmuls stay in W
            (B + W hold the unsplit B's matmuls, none twice)
  4. embedding backward: the table's gradient from stage 0 chunk 0's dx (zero elsewhere).

Residuals and the remat policy (model.remat): the residuals are exactly what `jax.vjp` keeps,
the parameters excepted (re-supplied at B from the stage's own, never stashed). With remat
none, dots or attn the layers' policy decides them (none: every intermediate; dots: matmul
outputs; attn: q, k, v and the attention output; plus each layer's input): B runs only the
backward, no forward is recomputed. With remat full the whole chunk is one checkpoint, so its
residual is its input [b, L, D] and B recomputes the chunk's forward (inside which each layer
is rematerialised again): the least memory, 2 extra forwards per microbatch.

Memory per stage, flat in M (`stash_bytes`; slot counts from the table, the most any stage
holds at once): `inputs` 2 slots x [b, L, D], `inbox` 1 (2 interleaved) x [b, L, D], and
`residuals` slots x R (R: one chunk's residuals for one microbatch; remat full: b·L·D):
p slots for 1f1b (stage 0 between F and B), 2(p-1) + (V-1)p + 1 for interleaved-1f1b once
M >= 2p (11 at p = 4, V = 2), p for zb-h1 (held until W); zb-h1 adds p `stash` slots of the
chunk's matmul output cotangents, about ((N+2K)·H/t + 4·D + 2·F/t)·b·L per layer. GPipe holds
the residuals of all M microbatches instead.

Under fsdp the stage's compute-dtype weights are gathered once per step, before the scan
(`whole_over_fsdp`), and the gradients accumulate whole: ZeRO-1 style within the step (the
fp32 master weights and AdamW moments stay split). The gradient's reduction over fsdp still
runs in each backward cell (XLA reduces the partial sums it sees); reducing once needs the
batch axes manual here too.

The embedding (2 and 4) runs outside the switch, on every stage every tick: the devices of
different stages take different branches, so a branch may hold only collectives whose devices
are all in one stage. GSPMD's partition of the embedding's scatter-add under sequence
parallelism is a collective-permute over all devices, which would wait forever for the stages
that took another branch (the tensor-parallel all-reduces, all-gathers and reduce-scatters
inside the stage's layers stay within a stage). The cost is a [b, L, D] gather and
scatter-add per tick on the stages that do not need them. The head's collectives (the vocab
split over tensor) stay within the last stage. tp_overlap's rings are collective-permutes too,
hence refused with this family (sharding/checks.py), and so is the context-parallel ring.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax
from jax.sharding import PartitionSpec as P
from jax.typing import DTypeLike

from configs.base import ModelConfig, RunConfig
from pipeline.schedule import BACKWARD, FORWARD, WEIGHT, cells, timetable
from pipeline.split_backward import split_vjp
from pipeline.stages import AXIS, buffer, over_stages, stages, with_part
from model.loss import cross_entropy
from model.moe import no_stats, router_loss
from sharding.checks import microbatches, moe_layers
from sharding.accumulation import FSDP, gather, reduce
from sharding.rules import constrain, logical_to_spec
from model.transformer import Transformer, compute_params

BACKWARD_LAST = WEIGHT + 1  # the cells: the table's IDLE, FORWARD, BACKWARD, WEIGHT, and B of chunk V-1 on stage p-1


class Program(NamedTuple):
    """The table as int32 arrays [ticks, p] that the tick program indexes with (tick, stage):
    each cell, and the buffer slots it and the arriving values use (-1: nothing arrives)."""

    branch: np.ndarray  # the cell, an index into CELLS
    microbatch: np.ndarray  # the cell's microbatch (0 when idle)
    chunk: np.ndarray  # the cell's chunk v (0 when idle)
    recv_f: np.ndarray  # `inputs` slot for the forward value arriving from s-1, -1 none
    recv_b: np.ndarray  # `inbox` slot for the gradient arriving from s+1, -1 none
    x_slot: np.ndarray  # `inputs` slot of the cell's input (F, B on p-1 chunk V-1)
    g_slot: np.ndarray  # `inbox` slot of the cell's output gradient (B)
    r_slot: np.ndarray  # `residuals` slot the F writes and its B (split: its W) reads
    s_slot: np.ndarray  # split backward: `stash` slot the B writes and its W reads
    inputs: int  # slots per buffer
    inbox: int
    residuals: int
    stash: int
    split: bool  # the table splits B (input gradient) and W (weight gradient): zb-h1


class _Slots:
    """Slots of one buffer on one stage: the lowest free slot to each value as it arrives."""

    def __init__(self) -> None:
        self.held: dict[tuple[int, int], int] = {}
        self.most = 1

    def take(self, item: tuple[int, int]) -> int:
        slot = min(set(range(len(self.held) + 1)) - set(self.held.values()))
        self.held[item] = slot
        self.most = max(self.most, slot + 1)
        return slot

    def free(self, item: tuple[int, int]) -> int:
        return self.held.pop(item)


def program(schedule: str, p: int, m_count: int, v_count: int = 1) -> Program:
    """The tick program of a 1F1B-family schedule: the table's cells, what arrives where, and
    the slot of every value in the stage's buffers (assigned on the host, checked here)."""
    kind, micro, chunk = cells(timetable(schedule, p, m_count, v_count))
    ticks, split = len(kind), bool((kind == WEIGHT).any())
    last = lambda s, v: s == p - 1 and v == v_count - 1  # noqa: E731  (head and loss)
    branch = kind.copy()
    arrays = {name: np.full((ticks, p), -1, np.int32) for name in ("recv_f", "recv_b")}
    arrays |= {name: np.zeros((ticks, p), np.int32) for name in ("x_slot", "g_slot", "r_slot", "s_slot")}
    sizes = dict.fromkeys(("inputs", "inbox", "residuals", "stash"), 1)
    for s in range(p):
        slots = {name: _Slots() for name in sizes}
        for t in range(ticks):
            if t > 0:  # what the neighbours sent last tick
                src = (s - 1) % p
                k, m, v = kind[t - 1, src], micro[t - 1, src], chunk[t - 1, src]
                if k == FORWARD and not last(src, v) and (s > 0 or (src == p - 1 and v_count > 1)):
                    arrays["recv_f"][t, s] = slots["inputs"].take((m, v + (s == 0)))
                src = (s + 1) % p
                k, m, v = kind[t - 1, src], micro[t - 1, src], chunk[t - 1, src]
                if k == BACKWARD and (s < p - 1 or (src == 0 and v > 0)):
                    arrays["recv_b"][t, s] = slots["inbox"].take((m, v - (s == p - 1)))
            k, item = kind[t, s], (micro[t, s], chunk[t, s])
            if k == FORWARD:
                if (s, item[1]) == (0, 0):  # stage 0 chunk 0 embeds its input
                    arrays["x_slot"][t, s] = 0
                elif last(s, item[1]):  # its output replaces its input in the slot, for the head at B
                    arrays["x_slot"][t, s] = slots["inputs"].held[item]
                else:
                    arrays["x_slot"][t, s] = slots["inputs"].free(item)
                arrays["r_slot"][t, s] = slots["residuals"].take(item)
            elif k == BACKWARD:
                if last(s, item[1]):
                    branch[t, s] = BACKWARD_LAST
                    arrays["x_slot"][t, s] = slots["inputs"].free(item)
                else:
                    arrays["g_slot"][t, s] = slots["inbox"].free(item)
                # split: its forward's residuals wait for W, and so does the stash B leaves
                kept = slots["residuals"]
                arrays["r_slot"][t, s] = kept.held[item] if split else kept.free(item)
                if split:
                    arrays["s_slot"][t, s] = slots["stash"].take(item)
            elif k == WEIGHT:
                arrays["r_slot"][t, s] = slots["residuals"].free(item)
                arrays["s_slot"][t, s] = slots["stash"].free(item)
        assert not any(b.held for b in slots.values()), f"stage {s} ends holding values"
        for name, b in slots.items():
            sizes[name] = max(sizes[name], b.most)
    return Program(branch, micro, chunk, **arrays, **sizes, split=split)


@dataclass(frozen=True)
class Static:
    """What the cells take besides arrays: the model's structure and config (its router losses'
    weights), the compute dtype, the loss's z-loss weight, M (each microbatch's loss counts
    1/M), whether a chunk is one checkpoint (remat full), whether B and W are split (zb-h1),
    and, once traced (`residual_layout`), the residuals' layout and the split's (b_fn, w_fn)."""

    graphdef: nnx.GraphDef
    model: ModelConfig
    dtype: DTypeLike
    z_loss: float
    m_count: int
    whole_chunk_remat: bool
    split_backward: bool = False
    layout: Any = None
    split: Any = None


class Layout(NamedTuple):
    """Where a chunk's vjp closure keeps what: its tree structure, and for each leaf the index of
    the chunk parameter it is (re-supplied at B) or -1 (a residual, kept in a slot)."""

    treedef: Any
    params_at: tuple[int, ...]


class Sent(NamedTuple):
    """What a cell leaves in the carry."""

    send_f: jax.Array  # [b, L, D] the stage's output, for s+1 at the next tick
    send_b: jax.Array  # [b, L, D] the gradient of the stage's input, for s-1 at the next tick
    grads: nnx.State  # fp32 gradients of the stage's parameters ([V, Lc, ...] blocks), summed so far
    loss: jax.Array  # the loss summed so far (stage p-1)
    stats: dict  # the router statistics of the stage's MoE layers, summed over its B cells so far
    residuals: tuple  # the residuals [slots, ...] (F writes its slot, B or W reads it)
    stash: tuple  # split backward: what W needs of B [slots, ...] (B writes its slot, W reads it)


def _model(st: Static, local: nnx.State) -> Transformer:
    return nnx.merge(st.graphdef, local)


def _router_share(st: Static, stats: dict) -> jax.Array:
    """This chunk's part of one microbatch's router losses in the objective: its MoE layers'
    summed losses over all MoE layers and M (0 for a dense model)."""
    return jnp.asarray(router_loss(stats, st.model), jnp.float32) / (st.m_count * max(moe_layers(st.model), 1))


def _chunk(st: Static, model: Transformer, layers: nnx.State, x: jax.Array) -> tuple[tuple[jax.Array, jax.Array], dict]:
    """(chunk output [b, L, D], its router share), and its router statistics as aux."""
    def run(layers, x):
        y, stats = model.run_layers(x, layers)
        return (y, _router_share(st, stats)), stats

    return (jax.checkpoint(run, prevent_cse=False) if st.whole_chunk_remat else run)(layers, x)


def _head(st: Static, local: nnx.State, y: jax.Array, target: jax.Array) -> tuple[jax.Array, dict, jax.Array]:
    """Final norm, head and loss of one microbatch on the last chunk's output y [b, L, D] (target
    [b, L]), scaled 1/M, forward and backward at once: (the scaled loss, the gradients of the
    parameters outside the blocks, dy)."""
    def loss(outside, y):
        return cross_entropy(_model(st, _replaced(local, outside)).logits(y), target, st.z_loss) / st.m_count

    lm, (d_rest, dy) = jax.value_and_grad(loss, argnums=(0, 1))(_outside(local), y)
    return lm, d_rest, dy


def _vjp(st: Static, model: Transformer, layers: nnx.State, x: jax.Array) -> tuple:
    """Chunk forward under vjp: (output, residual leaves, router stats, the closure's Layout)."""
    (y, _), pullback, stats = jax.vjp(partial(_chunk, st, model), layers, x, has_aux=True)
    leaves, treedef = jax.tree.flatten(pullback)
    params = jax.tree.leaves(layers)
    at = tuple(next((i for i, a in enumerate(params) if leaf is a), -1) for leaf in leaves)
    return y, tuple(leaf for leaf, i in zip(leaves, at) if i < 0), stats, Layout(treedef, at)


def residual_layout(st: Static, compute: nnx.State, act: jax.ShapeDtypeStruct) -> tuple[Static, tuple, tuple]:
    """From an abstract trace of the chunk's vjp (`compute` the stage's compute parameters,
    [V, Lc, ...] blocks; act the chunk input [b, L, D]): `st` with the vjp closure's Layout (and,
    split_backward, the split's b_fn and w_fn: pipeline/split_backward.py), the shapes of one
    microbatch's residuals of a chunk (what a `residuals` slot holds) and of its stash (what a
    `stash` slot holds; () unsplit)."""
    found = {}

    def shapes(compute, x):
        model, layers = _model(st, compute), _chunk_of(compute, 0)
        y, residuals, _, found["layout"] = _vjp(st, model, layers, x)
        if not st.split_backward:
            return residuals, ()
        # shrink_stash=False: every weight gradient stays in W. Moving dW = x^T dy into B frees
        # dy from the stash whenever tokens > the matmul's input width, i.e. at every real size,
        # and would leave W nothing to fill the bubbles with.
        split = split_vjp(partial(_chunk, st, model), layers, x, has_aux=True, shrink_stash=False)
        found["split"] = split.b_fn, split.w_fn
        return residuals, split.b_fn(split.residuals, (y, jnp.ones((), jnp.float32)))[1]

    residuals, stash = jax.eval_shape(shapes, compute, act)
    return dataclasses.replace(st, layout=found["layout"], split=found.get("split")), residuals, stash


def stash_bytes(cfg: RunConfig, graphdef: nnx.GraphDef, params: nnx.State, micro_batch: int) -> dict[str, int]:
    """Bytes of a stage's buffers under `cfg`'s 1F1B-family schedule, M microbatches of
    `micro_batch` sequences (global over the non-stage axes; call under the mesh):
    {'per_microbatch': one chunk's residuals R, 'residuals': slots x R, 'inputs', 'inbox':
    slots x b·L·D}. The stage's whole stash is flat in M."""
    p, v_count = stages(), max(cfg.parallel.virtual_stages, 1)
    prog = program(cfg.parallel.schedule, p, microbatches(cfg, p), v_count)
    dtype = jnp.dtype(cfg.model.compute_dtype)
    st = Static(graphdef, cfg.model, dtype, cfg.train.z_loss, 1, cfg.model.remat == "full", prog.split)
    local = with_part(jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, dtype), params), "blocks", jax.tree.map(
        lambda a: jax.ShapeDtypeStruct((v_count, a.shape[0] // (p * v_count), *a.shape[1:]), dtype), params["blocks"]))
    act = jax.ShapeDtypeStruct((micro_batch, cfg.train.seq_len, cfg.model.d_model), dtype)
    _, residuals, stash = residual_layout(st, local, act)
    per, kept = (sum(a.size * a.dtype.itemsize for a in avals) for avals in (residuals, stash))
    one = act.size * dtype.itemsize
    return {"per_microbatch": per, "residuals": prog.residuals * per, "inputs": prog.inputs * one,
            "inbox": prog.inbox * one, "stash_per_microbatch": kept, "stash": prog.stash * kept if kept else 0}


def whole_over_fsdp(tree: nnx.State) -> nnx.State:
    """The parameter-shaped tree with FSDP's split of the weights (their `embed` dimension over
    fsdp) undone by a sharding constraint: gathered once per step, whole on every fsdp device
    for the step's ticks (tensor and stage splits kept)."""
    variables = jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, nnx.Variable))
    leaves, treedef = jax.tree.flatten(tree)
    out = []
    for var, a in zip(variables, leaves, strict=True):
        names = tuple(var.get_metadata().get("out_sharding") or ())
        names = (None,) * (a.ndim - len(names)) + tuple(None if n in ("embed", "layers") else n for n in names)
        out.append(constrain(a, names))
    return treedef.unflatten(out)


def _specs(params: nnx.State, fsdp: bool) -> nnx.State:
    """The engine's in_spec of each weight: the blocks' [V, X/V, ...] layers over stage, and with
    `fsdp` (manual here) its fsdp split (the `embed` dimension), each device then holding its
    shard; everything else replicated."""
    mesh = jax.sharding.get_abstract_mesh()

    def spec(var: nnx.Variable, chunked: bool) -> P:
        names = tuple(var.get_metadata().get("out_sharding") or (None,) * var.ndim)
        split = tuple(logical_to_spec(names, var.shape, mesh, within=(FSDP,))) if fsdp else ()
        split = (split + (None,) * var.ndim)[:var.ndim]
        return P(None, AXIS, *split[1:]) if chunked else P(*split)

    is_var = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
    return with_part(jax.tree.map(lambda v: spec(v, False), params, is_leaf=is_var), "blocks",
                     jax.tree.map(lambda v: spec(v, True), params["blocks"], is_leaf=is_var))


def _whole(tree: nnx.State, flat_specs: list[P], batch_axes: tuple[str, ...]) -> nnx.State:
    """The stage's weights whole over fsdp, once per step: gathered by hand where fsdp is manual
    in the engine, else by a sharding constraint (XLA's gather)."""
    if FSDP not in batch_axes:
        return whole_over_fsdp(tree)
    leaves, treedef = jax.tree.flatten(tree)
    return treedef.unflatten([gather(spec, a) for spec, a in zip(flat_specs, leaves, strict=True)])


def _reduced(grads: nnx.State, flat_specs: list[P], batch_axes: tuple[str, ...]) -> nnx.State:
    """The summed gradients -> their shard of the mean over the batch axes, once per step."""
    if not batch_axes:
        return grads
    n = math.prod(lax.axis_size(a) for a in batch_axes)
    leaves, treedef = jax.tree.flatten(grads)
    return treedef.unflatten([reduce(g, spec, batch_axes) / n for spec, g in zip(flat_specs, leaves, strict=True)])


def _chunk_of(local: nnx.State, v: jax.Array) -> nnx.State:
    return jax.tree.map(lambda a: a[v], local["blocks"])


def _acc(grads: nnx.State, v: jax.Array, d_layers: nnx.State | None, d_rest: dict | None = None) -> nnx.State:
    """grads + chunk v's layer gradients (and those of the parameters outside the blocks,
    d_rest {name: part}: the head's and final norm's), in fp32."""
    add = lambda a, d: a + d.astype(a.dtype)  # noqa: E731
    parts = {name: jax.tree.map(add, grads[name], part) for name, part in (d_rest or {}).items()}
    if d_layers is not None:
        parts["blocks"] = jax.tree.map(lambda a, d: a.at[v].add(d.astype(a.dtype)), grads["blocks"], d_layers)
    return _replaced(grads, parts)


def _replaced(tree: nnx.State, parts: dict) -> nnx.State:
    """A copy of the parameter tree with the subtrees {name: part} replaced."""
    for name, part in parts.items():
        tree = with_part(tree, name, part)
    return tree


def _outside(local: nnx.State) -> dict:
    """The parameters outside the blocks {name: part}: embedding, final norm, head."""
    return {name: local[name] for name in local if name != "blocks"}


# The cells, one per Program.branch: (static, the stage's compute parameters, chunk v, the
# cell's (residuals, stash) slots, input x [b, L, D], output gradient g, the microbatch's
# targets [b, L], what the carry holds) -> what the carry holds next.


def _idle(st: Static, local: nnx.State, v: jax.Array, at: tuple, x: jax.Array, g: jax.Array, target: jax.Array,
          out: Sent) -> Sent:
    return out


def _put(buffers: tuple, slot: jax.Array, values: tuple) -> tuple:
    return tuple(a.at[slot].set(k) for a, k in zip(buffers, values))


def _pullback_leaves(st: Static, local: nnx.State, v: jax.Array, kept: Any) -> list:
    """The chunk's vjp closure leaves: its parameters re-supplied, the others from `kept`."""
    params, kept = jax.tree.leaves(_chunk_of(local, v)), iter(kept)
    return [params[i] if i >= 0 else next(kept) for i in st.layout.params_at]


def _forward(st: Static, local: nnx.State, v: jax.Array, at: tuple, x: jax.Array, g: jax.Array, target: jax.Array,
             out: Sent) -> Sent:
    y, residuals, stats, layout = _vjp(st, _model(st, local), _chunk_of(local, v), x)
    assert layout.params_at == st.layout.params_at, "the chunk's vjp closure changed between traces"
    return out._replace(send_f=y, residuals=_put(out.residuals, at[0], residuals),
                        stats=jax.tree.map(jnp.add, out.stats, stats))


def _backward(st: Static, local: nnx.State, v: jax.Array, at: tuple, x: jax.Array, g: jax.Array, target: jax.Array,
              out: Sent) -> Sent:
    leaves = _pullback_leaves(st, local, v, (a[at[0]] for a in out.residuals))
    d_layers, dx = jax.tree.unflatten(st.layout.treedef, leaves)((g, jnp.ones((), jnp.float32)))  # router share: as is
    return out._replace(send_b=dx, grads=_acc(out.grads, v, d_layers))


def _backward_last(st: Static, local: nnx.State, v: jax.Array, at: tuple, x: jax.Array, g: jax.Array,
                   target: jax.Array, out: Sent) -> Sent:
    """B of the last chunk: x is the chunk's output (its F left it in the input slot); the head
    and loss, then the chunk's vjp from its residuals."""
    lm, d_rest, dy = _head(st, local, x, target)
    leaves = _pullback_leaves(st, local, v, (a[at[0]] for a in out.residuals))
    d_layers, dx = jax.tree.unflatten(st.layout.treedef, leaves)((dy, jnp.ones((), jnp.float32)))
    return out._replace(send_b=dx, grads=_acc(out.grads, v, d_layers, d_rest), loss=out.loss + lm)


def _backward_input(st: Static, local: nnx.State, v: jax.Array, at: tuple, x: jax.Array, g: jax.Array,
                    target: jax.Array, out: Sent) -> Sent:
    """Split B: the input gradient only; what W needs of it goes to the stash slot."""
    leaves = _pullback_leaves(st, local, v, (a[at[0]] for a in out.residuals))
    dx, stash = st.split[0](leaves, (g, jnp.ones((), jnp.float32)))
    return out._replace(send_b=dx, stash=_put(out.stash, at[1], stash))


def _weight(st: Static, local: nnx.State, v: jax.Array, at: tuple, x: jax.Array, g: jax.Array, target: jax.Array,
            out: Sent) -> Sent:
    """Split W: the chunk's weight gradient from its residuals and B's stash."""
    leaves = _pullback_leaves(st, local, v, (a[at[0]] for a in out.residuals))
    d_layers = st.split[1](leaves, tuple(a[at[1]] for a in out.stash))
    return out._replace(grads=_acc(out.grads, v, d_layers))


def _backward_input_last(st: Static, local: nnx.State, v: jax.Array, at: tuple, x: jax.Array, g: jax.Array,
                         target: jax.Array, out: Sent) -> Sent:
    """Split B of the last chunk: the head and loss on its output x (forward and backward at
    once: their small weight gradients here), then the chunk's input gradient."""
    lm, d_rest, dy = _head(st, local, x, target)
    leaves = _pullback_leaves(st, local, v, (a[at[0]] for a in out.residuals))
    dx, stash = st.split[0](leaves, (dy, jnp.ones((), jnp.float32)))
    return out._replace(send_b=dx, grads=_acc(out.grads, v, None, d_rest), loss=out.loss + lm,
                        stash=_put(out.stash, at[1], stash))


# Program.branch -> cell: IDLE, FORWARD, BACKWARD, WEIGHT, BACKWARD_LAST; unsplit and split (zb-h1)
CELLS = (_idle, _forward, _backward, _idle, _backward_last)
SPLIT_CELLS = (_idle, _forward, _backward_input, _weight, _backward_input_last)


def loss_and_grads(params: nnx.State, graphdef: nnx.GraphDef, batch: dict, cfg: RunConfig,
                   batch_axes: tuple[str, ...] = ()) -> tuple[jax.Array, nnx.State, dict]:
    """Mean loss, fp32 gradients and router statistics of the [M, b, L] batch by the schedule.
    `batch_axes` (data, or none): the engine runs manual over them too, each device its own b
    rows of every microbatch, and sums its gradients over the whole schedule before one psum
    over them per step (without them XLA reduces each backward cell's weight gradients)."""
    p, (m_count, _, length) = stages(), batch["inputs"].shape
    v_count = max(cfg.parallel.virtual_stages, 1)
    prog = program(cfg.parallel.schedule, p, m_count, v_count)
    st = Static(graphdef, cfg.model, jnp.dtype(cfg.model.compute_dtype), cfg.train.z_loss, m_count,
                cfg.model.remat == "full", prog.split)
    ring = v_count > 1
    down = [(i, (i + 1) % p) for i in range(p if ring else p - 1)]
    up = [((i + 1) % p, i) for i in range(p if ring else p - 1)]

    chunked = with_part(params, "blocks", jax.tree.map(lambda a: a.reshape(v_count, -1, *a.shape[1:]), params["blocks"]))
    specs = _specs(params, FSDP in batch_axes)
    flat_specs = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))

    def body(local, inputs, targets):
        s = lax.axis_index(AXIS)
        compute = _whole(compute_params(local, st.dtype), flat_specs, batch_axes)  # cast and gathered once per step
        act = jax.ShapeDtypeStruct((inputs.shape[1], length, cfg.model.d_model), st.dtype)  # this device's b rows
        stc, residuals, stash = residual_layout(st, compute, act)
        branches = [partial(cell, stc) for cell in (SPLIT_CELLS if prog.split else CELLS)]

        def tick(carry, row):
            kind, m, v, rf, rb, xs, gs, rs, ss = (a[s] for a in row)
            inbuf, inbox, out = carry
            recv_f, recv_b = lax.ppermute(out.send_f, AXIS, down), lax.ppermute(out.send_b, AXIS, up)
            slot_f, slot_b = jnp.maximum(rf, 0), jnp.maximum(rb, 0)
            inbuf = inbuf.at[slot_f].set(jnp.where(rf >= 0, recv_f, inbuf[slot_f]))
            inbox = inbox.at[slot_b].set(jnp.where(rb >= 0, recv_b, inbox[slot_b]))
            first = (s == 0) & (v == 0)
            embedded, embed_vjp = jax.vjp(partial(_embed, stc, compute, inputs[m]), compute["embed"])
            x = jnp.where(first, embedded, inbuf[xs])
            out = lax.switch(kind, branches, compute, v, (rs, ss), x, inbox[gs], targets[m], out)
            keep = (kind == FORWARD) & (s == p - 1) & (v == v_count - 1)  # the last chunk's output, for its B
            inbuf = inbuf.at[xs].set(jnp.where(keep, out.send_f, inbuf[xs]))
            d_embedded = jnp.where(first & (kind == BACKWARD), out.send_b, jnp.zeros_like(out.send_b))
            grads = _replaced(out.grads, {"embed": jax.tree.map(lambda a, d: a + d.astype(a.dtype),
                                                                out.grads["embed"], embed_vjp(d_embedded)[0])})
            return (inbuf, inbox, out._replace(grads=grads)), None

        start = (buffer((prog.inputs, *act.shape), st.dtype), buffer((prog.inbox, *act.shape), st.dtype),
                 Sent(buffer(act.shape, st.dtype), buffer(act.shape, st.dtype),
                      jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32), compute),
                      jnp.zeros((), jnp.float32), no_stats(cfg.model),
                      tuple(buffer((prog.residuals, *a.shape), a.dtype) for a in residuals),
                      tuple(buffer((prog.stash, *a.shape), a.dtype) for a in stash)))
        rows = tuple(jnp.asarray(a) for a in (prog.branch, prog.microbatch, prog.chunk, prog.recv_f, prog.recv_b,
                                              prog.x_slot, prog.g_slot, prog.r_slot, prog.s_slot))
        (_, _, out), _ = lax.scan(tick, start, rows)
        n = math.prod(lax.axis_size(a) for a in batch_axes)
        over_batch = (lambda a: lax.psum(a, batch_axes) / n) if batch_axes else (lambda a: a)  # noqa: E731
        grads = _reduced(out.grads, flat_specs, batch_axes)  # once per step
        summed = jax.tree.map(lambda a: lax.psum(a, AXIS), grads)  # embedding, norm, head
        stats = {name: over_batch(lax.psum(a, AXIS)) / (m_count * moe_layers(cfg.model)) for name, a in out.stats.items()}
        return over_batch(lax.psum(out.loss, AXIS)), with_part(summed, "blocks", grads["blocks"]), stats

    rows = P(None, batch_axes) if batch_axes else P()  # [M, b, L]: each device its b rows
    run = over_stages(body, (specs, rows, rows), (P(), specs, P()), batch_axes)
    loss, grads, stats = run(chunked, batch["inputs"], batch["targets"])
    blocks = jax.tree.map(lambda g, a: g.reshape(a.shape), grads["blocks"], params["blocks"])
    return loss, with_part(grads, "blocks", blocks), stats


def _embed(st: Static, compute: nnx.State, tokens: jax.Array, table: jax.Array) -> jax.Array:
    """Stage 0's input: tokens [b, L] looked up in `table` (the embedding, vocab-parallel)."""
    return _model(st, with_part(compute, "embed", table)).embed_tokens(tokens, vocab_parallel=True)
