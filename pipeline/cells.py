"""The cells of the 1F1B family's tick program (pipeline/one_f_one_b.py), one per `Program.branch`:
F runs a chunk under `jax.vjp` and keeps its residuals in a slot; B (or, for zb-h1, B and later
W: pipeline/split_backward.py) runs its backward from them (the last chunk's B from the
cotangent of the head, which runs outside the cells: pipeline/head.py). A cell is a function of
the static `Static`, the stage's compute parameters ([V, Lc, ...] blocks), chunk v, the cell's
(residuals, stash) slots, its input x [b, L, D], output gradient g, the microbatch's tokens and
targets [b, L] and the carry's `Sent`, and returns the next `Sent`; F on the model's first chunk
embeds the tokens itself. Layouts, slot counts and memory are in one_f_one_b.py's docstring.

`embed`, `embed_grad`, `router_share`, `Static` and `model_of` serve gpipe and interleaved too
(pipeline/circular.py).

`run_cell` runs a tick's cell as one `lax.switch` per group of cells that write the same fields
of `Sent` (F; B; W), whose operand and result are those fields alone:
the other fields, the slot buffers the group only reads among them, go in as operands that no
branch returns. With the buffers passed through one switch over all cells, XLA GPU's
latency-hiding scheduler copied them: under explicit tensor parallelism (the all-reduces inside
B) it copied 1.9 GB of residual slots per tick in the loop body and again in every cell that
only read or passed them on: 125m pp=2,tp=2 1f1b peaked at 9.82 GiB, 7.98 with the groups (H100
compile, `tools.plan --compile-for-gpu`); pp=2,dp=2 (no collective inside a cell) 8.11 either
way. XLA CPU copied them too: the tiny pp=2 step's temp fell 28-36% under remat none.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from flax import nnx
from jax.typing import DTypeLike

from configs.base import ModelConfig
from model.moe import router_loss
from model.remat import stashed
from model.transformer import Transformer
from pipeline.split_backward import split_vjp
from pipeline.stages import AXIS, with_part
from pipeline.tables import BACKWARD, FORWARD, WEIGHT
from pipeline.tick_program import NAMES, SCOPE
from sharding.checks import moe_layers
from sharding.vocab_parallel import take_grad_reduced

@dataclass(frozen=True)
class Static:
    """What the cells take besides arrays: the model's structure and config (its router losses'
    weights and remat policy), the compute dtype, the loss's z-loss weight, M (each
    microbatch's loss counts 1/M), whether B and W are split (zb-h1), and, once traced
    (`residual_layout`), the residuals' layout and the split's (b_fn, w_fn)."""

    graphdef: nnx.GraphDef
    model: ModelConfig
    dtype: DTypeLike
    z_loss: float
    m_count: int
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

    send_f: jax.Array  # [b, L, D] the stage's output, for s+1 at the next tick (zbv's chunk 1: its input gradient)
    send_b: jax.Array  # [b, L, D] the gradient of the stage's input, for s-1 at the next tick (zbv's chunk 1: its output)
    grads: nnx.State  # fp32 gradients of the stage's parameters ([V, Lc, ...] blocks), summed so far
    loss: jax.Array  # the loss summed so far (on the head stage: pipeline/head.py)
    stats: dict  # the router statistics of the stage's MoE layers, summed over its B cells so far
    residuals: tuple  # the residuals [slots, ...] (F writes its slot, B or W reads it)
    stash: tuple  # split backward: what W needs of B [slots, ...] (B writes its slot, W reads it)


def model_of(st: Static, local: nnx.State) -> Transformer:
    return nnx.merge(st.graphdef, local)


def router_share(st: Static, stats: dict) -> jax.Array:
    """This chunk's part of one microbatch's router losses in the objective: its MoE layers'
    summed losses over all MoE layers and M (0 for a dense model)."""
    return jnp.asarray(router_loss(stats, st.model), jnp.float32) / (st.m_count * max(moe_layers(st.model), 1))


def _chunk(st: Static, model: Transformer, layers: nnx.State, x: jax.Array) -> tuple[tuple[jax.Array, jax.Array], dict]:
    """(chunk output [b, L, D], its router share), and its router statistics as aux. The chunk is
    one checkpoint whose policy (model.remat.stash_policy) decides what its vjp keeps for B."""
    def run(layers, x):
        y, stats = model.run_layers(x, layers)
        return (y, router_share(st, stats)), stats

    return stashed(run, st.model.remat)(layers, x)


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
        model, layers = model_of(st, compute), chunk_of(compute, 0)
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


def chunk_of(local: nnx.State, v: jax.Array) -> nnx.State:
    return jax.tree.map(lambda a: a[v], local["blocks"])


def _acc(grads: nnx.State, v: jax.Array, d_layers: nnx.State) -> nnx.State:
    """grads + chunk v's layer gradients, in fp32."""
    add = lambda a, d: a.at[v].add(d.astype(a.dtype))  # noqa: E731
    return with_part(grads, "blocks", jax.tree.map(add, grads["blocks"], d_layers))


def replaced(tree: nnx.State, parts: dict) -> nnx.State:
    """A copy of the parameter tree with the subtrees {name: part} replaced."""
    for name, part in parts.items():
        tree = with_part(tree, name, part)
    return tree


# The cells, one per Program.branch but IDLE: (static, the stage's compute parameters, chunk v,
# the cell's (residuals, stash) slots, input x [b, L, D], output gradient g, the microbatch's
# tokens and targets [b, L], what the carry holds) -> what the carry holds next.


def _put(buffers: tuple, slot: jax.Array, values: tuple) -> tuple:
    return tuple(a.at[slot].set(k) for a, k in zip(buffers, values))


def _pullback_leaves(st: Static, local: nnx.State, v: jax.Array, kept: Any) -> list:
    """The chunk's vjp closure leaves: its parameters re-supplied, the others from `kept`."""
    params, kept = jax.tree.leaves(chunk_of(local, v)), iter(kept)
    return [params[i] if i >= 0 else next(kept) for i in st.layout.params_at]


def _forward(st: Static, local: nnx.State, v: jax.Array, at: tuple, x: jax.Array, g: jax.Array, tokens: jax.Array,
             target: jax.Array, out: Sent) -> Sent:
    """F: chunk v's layers under vjp on x, on the model's first chunk (stage 0, v = 0) on the
    embedding of `tokens` instead (`embed`: here, in the F cell, one lookup per microbatch and
    chunk, where outside the switch every stage looked up every tick)."""
    first = (lax.axis_index(AXIS) == 0) & (v == 0)
    x = jnp.where(first, embed(st, local, tokens, local["embed"]), x)
    y, residuals, stats, layout = _vjp(st, model_of(st, local), chunk_of(local, v), x)
    assert layout.params_at == st.layout.params_at, "the chunk's vjp closure changed between traces"
    return out._replace(send_f=y, residuals=_put(out.residuals, at[0], residuals),
                        stats=jax.tree.map(jnp.add, out.stats, stats))


def _backward(st: Static, local: nnx.State, v: jax.Array, at: tuple, x: jax.Array, g: jax.Array, tokens: jax.Array,
              target: jax.Array, out: Sent) -> Sent:
    leaves = _pullback_leaves(st, local, v, (a[at[0]] for a in out.residuals))
    d_layers, dx = jax.tree.unflatten(st.layout.treedef, leaves)((g, jnp.ones((), jnp.float32)))  # router share: as is
    return out._replace(send_b=dx, grads=_acc(out.grads, v, d_layers))


def _backward_input(st: Static, local: nnx.State, v: jax.Array, at: tuple, x: jax.Array, g: jax.Array,
                    tokens: jax.Array, target: jax.Array, out: Sent) -> Sent:
    """Split B: the input gradient only; what W needs of it goes to the stash slot."""
    leaves = _pullback_leaves(st, local, v, (a[at[0]] for a in out.residuals))
    dx, stash = st.split[0](leaves, (g, jnp.ones((), jnp.float32)))
    return out._replace(send_b=dx, stash=_put(out.stash, at[1], stash))


def _weight(st: Static, local: nnx.State, v: jax.Array, at: tuple, x: jax.Array, g: jax.Array, tokens: jax.Array,
            target: jax.Array, out: Sent) -> Sent:
    """Split W: the chunk's weight gradient from its residuals and B's stash."""
    leaves = _pullback_leaves(st, local, v, (a[at[0]] for a in out.residuals))
    d_layers = st.split[1](leaves, tuple(a[at[1]] for a in out.stash))
    return out._replace(grads=_acc(out.grads, v, d_layers))


# Program.branch -> cell, unsplit and split (zb-h1); IDLE runs none
CELLS = {FORWARD: _forward, BACKWARD: _backward}
SPLIT_CELLS = {FORWARD: _forward, BACKWARD: _backward_input, WEIGHT: _weight}
# The groups of cells `run_cell` runs as one switch each, and the fields of Sent they write
GROUPS = (((FORWARD,), ("send_f", "residuals", "stats")),
          ((BACKWARD,), ("send_b", "grads", "stash")),
          ((WEIGHT,), ("grads",)))


def run_cell(cells: dict, kinds: set[int], kind: jax.Array, args: tuple, out: Sent) -> Sent:
    """The cell `kind` (`cells[kind]`, each partial in Static; nothing for IDLE) on args (the
    stage's compute parameters, v, slots, x, g, tokens, target) and the carry's `out`, as one
    lax.switch per group of `GROUPS` with a kind in `kinds` (the program's), each cell under its
    named scope (pipeline.tick_program.SCOPE, for the census): a group's switch
    takes and returns the fields it writes, its first branch (any other kind) returns them as
    they are; the other fields are read-only operands (module docstring)."""
    for group, fields in GROUPS:
        present = [k for k in group if k in kinds and k in cells]
        if not present:
            continue

        def branch(k, fields=fields):
            def run(written, rest):
                given = rest._replace(**dict(zip(fields, written)))
                with jax.named_scope(SCOPE + NAMES[k]):
                    new = cells[k](*args, given)
                assert all(getattr(new, f) is getattr(given, f) for f in Sent._fields if f not in fields), \
                    f"{cells[k]} writes a field of Sent outside its group's {fields}"
                return tuple(getattr(new, f) for f in fields)
            return run

        index = sum((kind == k) * (i + 1) for i, k in enumerate(present))
        written = lax.switch(index, [lambda written, rest: written] + [branch(k) for k in present],
                             tuple(getattr(out, f) for f in fields), out._replace(**dict.fromkeys(fields)))
        out = out._replace(**dict(zip(fields, written)))
    return out


def embed(st: Static, compute: nnx.State, tokens: jax.Array, table: jax.Array) -> jax.Array:
    """Stage 0's input: tokens [b, L] looked up in `table` (the embedding, vocab-parallel), in
    the compute dtype."""
    return model_of(st, with_part(compute, "embed", table)).embed_tokens(tokens, vocab_parallel=True, dtype=st.dtype)


def embed_grad(st: Static, compute: nnx.State, tokens: jax.Array, d: jax.Array, acc: nnx.State) -> nnx.State:
    """acc (the embedding's fp32 gradient, its [V, D] table) + the lookup's for cotangent d [b,
    L, D]: the transpose of `embed` from a table in fp32, so that the scatter-add is fp32 from
    the start and XLA writes it into acc in place (add(acc, scatter(0, ...)) folds to
    scatter(acc, ...)), b·L·D elements a run. From the compute-dtype table it zero-filled a
    [V, D] table, converted it and added it to acc: about 12·V·D bytes of memory traffic a run
    on every stage. Where the lookup's region all-reduces the table's gradient at each run
    (sharding.vocab_parallel.take_grad_reduced) nothing folds past the all-reduce, and the
    transpose stays in the compute dtype, which the all-reduce then moves."""
    dtype = st.dtype if take_grad_reduced() else jnp.float32
    table = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, dtype), acc)
    grad = jax.linear_transpose(partial(embed, st, compute, tokens), table)(d)[0]
    return jax.tree.map(lambda a, g: a + g.astype(a.dtype), acc, grad)
