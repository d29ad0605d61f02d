"""The 1F1B family in one SPMD program: 1f1b, interleaved-1f1b, zb-h1 and zbv. Each stage
alternates forwards and backwards of different microbatches, with its own per-stage `jax.vjp`;
no autodiff through the schedule.

Layout (p stages, V chunks per stage, V = 1 but for interleaved-1f1b and zbv, X layers, Lc =
X/(p·V)): blocks [X, ...] as stored, X split over stage; device s runs [V, Lc, ...], its chunk v
the model's chunk v·p + s (layers (v·p + s)·Lc ... + Lc - 1), or in zbv's V (pipeline/tables.py)
chunks s and 2p-1-s. V = 1 runs the stored layout (no data moves); V > 1 lays the stage's cast
layers out inside the engine every step, each chunk stored elsewhere moving once by
collective-permute, and their fp32 gradients back (pipeline/layout.py; tools.pipeline_traffic.layout). The
embedding and final norm are whole on every stage for the step, the head as the stage's columns
of the vocabulary (the embedding and head stored 1/p a stage, the embedding gathered once, the
head's columns exchanged: pipeline/stage_weights.py) and used inside the schedule: the
embedding by the first chunk (stage 0 chunk 0), the head and loss by every stage at the ticks
whose head stage (p-1, chunk V-1; zbv's stage 0, chunk 1) runs the model's last chunk's B, each
stage on its slice of the vocabulary (pipeline/head.py): the backward of microbatch 0 starts
before microbatch M-1 has entered, so each microbatch's loss is computed at the tick its
cotangent starts. Their gradients are summed over stage once per step (pipeline/engine.py).

Tick program (one `lax.scan` over the ticks of pipeline/tables.py's table; every device runs
it and picks its own cell with `lax.axis_index`; the buffer slots are assigned on the host,
pipeline/tick_program.py; the cells are pipeline/cells.py):

  1. receive: ppermute the forward output sent last tick to s+1, the input gradient to s-1
     (with V > 1 both are rings: stage p-1's chunk v feeds stage 0's chunk v+1, and back; zbv's
     chunk 1 sends its forward to s-1 and its gradient to s+1, and its turn at stage p-1, chunk
     0 into chunk 1 and back, stays on the device: `Program.keep_f`, `keep_b`); two
     collective-permutes of b·L·D, each under a `lax.cond` of the tick's (the same on every
     device: tick_program.moves) that runs it only where some stage receives by it (the
     warm-up sends no gradient back, the cool-down no forward on; at p = 2 each runs M of the
     T ticks); an arriving value is written to its slot of `inputs` (forward) or `inbox`
     (gradient);
  2. head, at the M ticks whose head stage runs the last chunk's B (tick_program.heads): the
     final norm, head and loss of that microbatch, forward and backward, on every stage under
     one `lax.cond` whose predicate is the tick's, the vocabulary split over the stages (the
     head stage's chunk output broadcast over stage; the loss's statistics and the head's input
     gradient summed over stage: pipeline/head.py). Its input gradient is that B's cotangent.
     On the head stage alone, those M cells were the longest of their ticks by the head's
     cost, and in lock-step every stage waited (0.77 chunk forwards for 1b on pp=4: zb-h1's
     bubble 0.230, now 0.105; pipeline/schedule.py, Head);
  3. input: the cell's `inputs` slot (F on stage 0 chunk 0 embeds microbatch m's tokens instead);
  4. the cell of `CELLS` (`SPLIT_CELLS` for zb-h1 and zbv), functions of the stage's parameters, chunk
     v, the cell's slots, the input x, the gradient g, the microbatch's tokens and targets, the carry's
     `Sent`, run by `cells.run_cell` (a `lax.switch` per group of cells that write the same
     fields, so that no switch passes a slot buffer through; cells.py's docstring says why):
     F      run chunk v's layers under `jax.vjp`, send the output, keep the vjp's residuals in
            a `residuals` slot until B (the last chunk's output waits in its input slot)
     B      the vjp from the kept residuals, cotangent g (on the last chunk, step 2's): chunk
            v's gradients (fp32, summed in the carry) and dx, sent to s-1
     split (zb-h1, zbv; pipeline/split_backward.py): B computes dx only and leaves in a `stash`
            slot what W needs (each matmul's output cotangent); W, a later tick, the weight
            gradients from the residuals and the stash. All weight-gradient matmuls stay in W
            (B + W hold the unsplit B's matmuls, none twice)
  5. embedding backward, at the M ticks whose stage 0 runs chunk 0's B (tick_program.embeds_back):
     the table's gradient from that dx (zero on the other stages), scattered into the fp32
     accumulator in place (cells.embed_grad), on every device under one `lax.cond` whose
     predicate is the tick's, the same on every stage.

Residuals and the remat policy (model.remat): a chunk runs as one jax.checkpoint whose policy is
model.remat.stash_policy, so the residuals are what it saves, the parameters excepted (re-supplied
at B from the stage's own, never stashed), and nothing derived from the weights alone (their
per-layer slices, casts and transposes are redone at B). remat none keeps the outputs of the
matmuls, attention kernels and collectives and B recomputes the cheap elementwise work (norms,
rotary, activations, residual adds: +1.3% of the tiny step's XLA FLOPs), because a slot, unlike
one program's intermediates, is opaque to XLA's fusion: keeping every intermediate of jax.vjp
stored 6 [b, L, F] arrays a layer, 4 [b, L, D] in fp32 and the weight slices (125m compiled for
an H100, pp=2,dp=2: 13.65 GiB, now 8.11). dots and attn keep what the layers' own policy names
(B recomputes what they leave, as without a pipeline). With remat full the chunk's residuals are
its layers' inputs, Lc x [b, L, D] (model.remat.LAYER_INPUT), and B recomputes each layer once,
as without a pipeline (keeping the chunk's input alone recomputed the chunk's forward first and
then each layer again: Lc - 1 fewer [b, L, D] per microbatch, one more forward). tools.activations'
`chunk_residuals` counts a slot (tests/test_pipeline.py holds it against `stash_bytes`).

Memory per stage, flat in M (`stash_bytes`; slot counts from the table, the most any stage
holds at once): `inputs` 2 slots x [b, L, D], `inbox` 1 (2 interleaved) x [b, L, D], and
`residuals` slots x R (R: one chunk's residuals for one microbatch; remat full: b·L·D):
p slots for 1f1b (stage 0 between F and B), 2(p-1) + (V-1)p + 1 for interleaved-1f1b once
M >= 2p (11 at p = 4, V = 2), p for zb-h1 (held until W); zb-h1 adds p `stash` slots of the
chunk's matmul output cotangents, about ((N+2K)·H/t + 4·D + 2·F/t)·b·L per layer; zbv 2p
residual slots and at most 2p stash slots, each of half a stage's layers (zb-h1's bytes), and
2 inbox slots once M >= 2p. GPipe holds the residuals of all M microbatches instead.

The region, and what happens before and after the ticks (the weights cast, laid out and
gathered over fsdp once per step, the gradients reduced over the batch axes once), is
pipeline/engine.py's, shared with gpipe and interleaved.

The embedding's lookup (3) runs in the F cell, on every chunk, its result selected on stage 0's
chunk 0 (pipeline.cells._forward): V·M lookups a stage, each under tensor parallelism with the
vocab-parallel lookup's all-reduce within the stage. Outside the switch, on every stage in every
tick, it had run T of them: the tensor bytes of 125m 1f1b on pp=2,dp=2,tp=2 at M = 8 fell
to 0.954x, zbv's to 0.868x, 1b interleaved-1f1b's on pp=4,tp=2 to 0.893x
(bench/results/embedding-in-f-cell-h100-compiled.json). The lookup's backward (5) stays
outside the switch: the devices of different stages take different branches, so a branch may
hold only collectives whose devices are all in one stage, and the backward's may span the
stages (GSPMD's partition of the scatter-add under sequence parallelism has been a
collective-permute over all devices; where the lookup's region leaves a batch axis to XLA,
sharding.vocab_parallel.take_grad_reduced, an all-reduce of the table's gradient). Its own
conditional runs it where every device takes the same branch, at M of the T ticks: the others
skip it (until 2026-12-02 it ran every tick: T scatter-adds of [b, L, D] a stage, T - M of them
on zeros, each with its collective; tiny's tensor bytes under SP on pp=2,tp=2 fell to 0.80x for
zbv, and under context_impl=gspmd on pp=2,sp=2,tp=2 1f1b's sequence bytes to 0.77x). The head
(2) is outside the switch for the same reason: its collectives span the stages.
tp_overlap's rings are collective-permutes too, hence refused with this family
(sharding/checks.py), and so is the context-parallel ring.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from configs.base import RunConfig
from model.moe import no_stats
from pipeline.cells import CELLS, SPLIT_CELLS, Sent, Static, embed_grad, model_of, replaced, residual_layout, run_cell
from pipeline.engine import run_stages
from pipeline.head import head_loss
from pipeline.stages import AXIS, buffer, stages, with_part
from pipeline.tick_program import EMBED_BACK, HEAD, PERMUTE, SCOPE, Program, cell_shares, embeds_back, heads, program
from sharding.checks import ONE_F_ONE_B, microbatches


def stash_bytes(cfg: RunConfig, graphdef: nnx.GraphDef, params: nnx.State, micro_batch: int) -> dict[str, int]:
    """Bytes of a stage's buffers under `cfg`'s 1F1B-family schedule, M microbatches of
    `micro_batch` sequences (global over the non-stage axes; call under the mesh):
    {'per_microbatch': one chunk's residuals R, 'residuals': slots x R, 'inputs', 'inbox':
    slots x b·L·D}. The stage's whole stash is flat in M."""
    p, v_count = stages(), max(cfg.parallel.virtual_stages, 1)
    prog = program(cfg.parallel.schedule, p, microbatches(cfg, p), v_count)
    dtype = jnp.dtype(cfg.model.compute_dtype)
    st = Static(graphdef, cfg.model, dtype, cfg.train.z_loss, 1, prog.split)
    local = with_part(jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, dtype), params), "blocks", jax.tree.map(
        lambda a: jax.ShapeDtypeStruct((v_count, a.shape[0] // (p * v_count), *a.shape[1:]), dtype), params["blocks"]))
    act = jax.ShapeDtypeStruct((micro_batch, cfg.train.seq_len, cfg.model.d_model), dtype)
    _, residuals, stash = residual_layout(st, local, act)
    per, kept = (sum(a.size * a.dtype.itemsize for a in avals) for avals in (residuals, stash))
    one = act.size * dtype.itemsize
    return {"per_microbatch": per, "residuals": prog.residuals * per, "inputs": prog.inputs * one,
            "inbox": prog.inbox * one, "stash_per_microbatch": kept, "stash": prog.stash * kept if kept else 0}


def loss_and_grads(params: nnx.State, graphdef: nnx.GraphDef, batch: dict, cfg: RunConfig,
                   batch_axes: tuple[str, ...] = ()) -> tuple[jax.Array, nnx.State, dict]:
    """Mean loss, fp32 gradients and router statistics of the [M, b, L] batch by the schedule,
    in pipeline.engine's region (manual over stage and `batch_axes`: each device its own b rows
    of every microbatch, its gradients summed over the whole schedule and reduced once per step)."""
    p, m_count = stages(), batch["inputs"].shape[0]
    v_count = max(cfg.parallel.virtual_stages, 1)
    prog = program(cfg.parallel.schedule, p, m_count, v_count)
    st = Static(graphdef, cfg.model, jnp.dtype(cfg.model.compute_dtype), cfg.train.z_loss, m_count, prog.split)
    pairs, arrivals = _links(prog, p, v_count)
    head_stage = int(np.flatnonzero(prog.head.any(axis=0))[0])
    head_m = prog.microbatch[:, head_stage] * heads(prog)  # [ticks] the microbatch whose head runs (0 elsewhere)

    def run(compute, inputs, targets):
        s = lax.axis_index(AXIS)
        act = jax.ShapeDtypeStruct((*inputs.shape[1:], cfg.model.d_model), st.dtype)  # this device's b rows (L/sp columns)
        stc, residuals, stash = residual_layout(st, compute, act)
        cells = {kind: partial(cell, stc) for kind, cell in (SPLIT_CELLS if prog.split else CELLS).items()}
        kinds = {int(k) for k in np.unique(prog.branch)}

        def tick(carry, row):
            (back, head_at, head_m, moving), row = row
            kind, m, v, here, xs, gs, rs, ss, kf, kb, *slots = (a[s] for a in row)
            inbuf, inbox, out = carry
            inbuf, inbox = _receive(inbuf, inbox, out, slots, pairs, arrivals, moving)
            out, g = _head(stc, compute, inbuf[xs], targets[head_m], inbox[gs], out, head_at, here, head_stage)
            out = run_cell(cells, kinds, kind, (compute, v, (rs, ss), inbuf[xs], g, inputs[m], targets[m]), out)
            inbuf = _put(inbuf, kf, out.send_f)  # the last chunk's output for its B; zbv's turn
            if prog.used("keep_b"):
                inbox = _put(inbox, kb, out.send_b)  # zbv's turn: chunk 1's input gradient feeds chunk 0's B
            out = _embedding_backward(stc, compute, inputs[m], out, back, s == 0)
            if prog.v_shape:  # chunk 1 of the V sends its forward to s-1 and its gradient to s+1
                out = out._replace(send_f=jnp.where(v == 1, out.send_b, out.send_f),
                                   send_b=jnp.where(v == 1, out.send_f, out.send_b))
            return (inbuf, inbox, out), None

        rows = tuple(jnp.asarray(a) for a in (prog.branch, prog.microbatch, prog.chunk, prog.head, prog.x_slot,
                                              prog.g_slot,
                                              prog.r_slot, prog.s_slot, prog.keep_f, prog.keep_b,
                                              *(getattr(prog, field) for _, _, field in arrivals)))
        (_, _, out), _ = lax.scan(tick, _start(prog, act, compute, residuals, stash, cfg),
                                  ((jnp.asarray(embeds_back(prog)), jnp.asarray(heads(prog)), jnp.asarray(head_m),
                                    {w: jnp.asarray(a) for w, a in prog.moving.items()}), rows))
        return out.loss, out.grads, out.stats

    return run_stages(params, batch, cfg, batch_axes, prog.v_shape, run, columns=True)


def _head(st: Static, compute: nnx.State, y: jax.Array, target: jax.Array, g: jax.Array, out: Sent,
          at: jax.Array, here: jax.Array, head_stage: int) -> tuple[Sent, jax.Array]:
    """Step 2 of the tick: where `at` (the tick's, the same on every device: tick_program.heads)
    the head over the stages (pipeline/head.py) on y, the head stage's last chunk output, and
    target, that microbatch's; (out with the loss and the head's and final norm's fp32
    gradients added, the cell's output gradient: the head's input gradient where `here`, the
    head stage's cell, else g). Under one lax.cond whose operands and results are the loss and
    those gradients, which the other ticks pass through."""
    def run(acc: tuple) -> tuple:
        loss, head, norm = acc
        with jax.named_scope(SCOPE + HEAD):
            lm, d, dy = head_loss(partial(model_of, st), compute, y, target, st.z_loss, st.m_count, head_stage,
                                  st.model.vocab_size)
        head, norm = (jax.tree.map(lambda a, b: a + b.astype(a.dtype), acc, d[name])
                      for acc, name in ((head, "head"), (norm, "final_norm")))
        return loss + lm, head, norm, dy

    acc = (out.loss, out.grads["head"], out.grads["final_norm"])
    loss, head, norm, dy = lax.cond(at, run, lambda acc: (*acc, jnp.zeros_like(g)), acc)
    return (out._replace(loss=loss, grads=replaced(out.grads, {"head": head, "final_norm": norm})),
            jnp.where(here, dy, g))


def _embedding_backward(st: Static, compute: nnx.State, tokens: jax.Array, out: Sent, back: jax.Array,
                        first: jax.Array) -> Sent:
    """Step 5 of the tick: where `back` (the tick's, the same on every device: tick_program.embeds_back)
    the embedding's gradient of `tokens` from the input gradient the B cell sent on stage 0
    (`first`; zeros on the others), under a lax.cond whose operand and result are the fp32 table
    gradient alone, which the other ticks pass through."""
    d = jnp.where(first, out.send_b, jnp.zeros_like(out.send_b))

    def run(acc: nnx.State) -> nnx.State:
        with jax.named_scope(SCOPE + EMBED_BACK):
            return embed_grad(st, compute, tokens, d, acc)

    table = lax.cond(back, run, lambda acc: acc, out.grads["embed"])
    return out._replace(grads=replaced(out.grads, {"embed": table}))


def _start(prog: Program, act: jax.ShapeDtypeStruct, compute: nnx.State, residuals: tuple, stash: tuple,
           cfg: RunConfig) -> tuple:
    """The tick scan's first carry: the `inputs` and `inbox` slots, and a `Sent` with NaN-filled
    sends and slots (pipeline.stages.buffer), zero fp32 gradients, loss and router statistics."""
    return (buffer((prog.inputs, *act.shape), act.dtype), buffer((prog.inbox, *act.shape), act.dtype),
            Sent(buffer(act.shape, act.dtype), buffer(act.shape, act.dtype),
                 jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32), compute),
                 jnp.zeros((), jnp.float32), no_stats(cfg.model),
                 tuple(buffer((prog.residuals, *a.shape), a.dtype) for a in residuals),
                 tuple(buffer((prog.stash, *a.shape), a.dtype) for a in stash)))


def _links(prog: Program, p: int, v_count: int) -> tuple[dict[str, list], list[tuple[str, str, str]]]:
    """The two permutes' pairs, {"down": s -> s+1, "up": s+1 -> s} (rings where V > 1 loops, not
    in zbv's V), and the arrivals the program uses: (permute, buffer, its slot field of Program)."""
    ring = v_count > 1 and not prog.v_shape
    n = p if ring else p - 1
    pairs = {"down": [(i, (i + 1) % p) for i in range(n)], "up": [((i + 1) % p, i) for i in range(n)]}
    arrivals = [(way, name, f"{way}_{field}") for way in pairs for name, field in (("inputs", "input"), ("inbox", "grad"))
                if prog.used(f"{way}_{field}")]
    return pairs, arrivals


def _receive(inbuf: jax.Array, inbox: jax.Array, out: Sent, slots: list, pairs: dict[str, list],
             arrivals: list[tuple[str, str, str]], moving: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
    """Step 1 of the tick: last tick's `Sent.send_f` over the down permute, `send_b` over the up
    one (only those the program uses), each at the ticks of `moving` (the tick's
    Program.moving, the same on every device; at the others the lax.cond passes the sent
    value through, which no slot reads), each arrival written to its slot (`slots`, in the
    order of `arrivals`) of `inputs` or `inbox`."""
    buffers, sent = {"inputs": inbuf, "inbox": inbox}, {"down": out.send_f, "up": out.send_b}

    def permute(way: str) -> jax.Array:
        def run(x: jax.Array) -> jax.Array:
            with jax.named_scope(SCOPE + PERMUTE + way):
                return lax.ppermute(x, AXIS, pairs[way])
        return lax.cond(moving[way], run, lambda x: x, sent[way])

    received = {way: permute(way) for way in pairs if any(w == way for w, *_ in arrivals)}
    for (way, name, _), slot in zip(arrivals, slots, strict=True):
        buffers[name] = _put(buffers[name], slot, received[way])
    return buffers["inputs"], buffers["inbox"]


def _put(buffer: jax.Array, slot: jax.Array, value: jax.Array) -> jax.Array:
    """`buffer` with `value` in `slot`, unchanged where slot is -1."""
    at = jnp.maximum(slot, 0)
    return buffer.at[at].set(jnp.where(slot >= 0, value, buffer[at]))


def census_taken(cfg: RunConfig, mesh_shape: dict[str, int]) -> dict[str, dict[int, float]] | None:
    """tools.hlo.census's `taken` for cfg's train step on a mesh of `mesh_shape`: under the 1F1B
    family each cell's share of the ticks per device (pipeline.tick_program.cell_shares); else None."""
    p = mesh_shape.get(AXIS, 1)
    if p == 1 or cfg.parallel.schedule not in ONE_F_ONE_B:
        return None
    prog = program(cfg.parallel.schedule, p, microbatches(cfg, p), max(cfg.parallel.virtual_stages, 1))
    return cell_shares(prog, mesh_shape, AXIS)
