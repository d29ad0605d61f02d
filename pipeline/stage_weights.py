"""A stage's weights in every schedule's region (pipeline/engine.py), once per step: laid
out in the chunks the stage runs, whole over fsdp (the embedding and head whole over stage too)
for the step's ticks, and the summed gradients reduced back to each device's shard.

Layout: the stage's blocks are stored [X/p, ...] (X layers over p stages) and run as [V, Lc, ...]
chunks (`chunked`: pipeline/layout.py; V > 1 moves the chunks stored elsewhere by
collective-permute, and their gradients back). The embedding [V, D] and head [D, V] are stored
with D split over fsdp and then stage (sharding/rules.py; where fsdp·p divides D): every stage
runs them, whole, but each stores 1/p of them and of their fp32 master weights, AdamW moments and
gradients, and updates that 1/p. The final norm [D] is stored whole on every stage.

Per step, whatever M, the gathers and reductions are by hand (`gathered_once`, `reduced_once`,
sharding/accumulation.py's gather and reduce, on each tensor or expert shard; the batch axes
data, fsdp and expert where > 1 are manual in the engine: sharding.checks.accumulation_axes):
one all-gather of the stage's weights over fsdp in the compute dtype, the embedding's and
head's over stage first; one reduction of their fp32 gradients: a reduce-scatter over fsdp, the
embedding's and head's then over stage, then an all-reduce of the shard over data, expert and
sequence (the routed experts' over data alone). Axes the engine leaves automatic (sequence under
context_impl=gspmd) XLA reduces where the backward makes the partial sums (each backward cell
of the 1F1B family, each tick of gpipe and interleaved).

Bytes over stage per step for the embedding and head (X = 2·V·D/(f·t) elements a device before
the split): an all-gather of X·c·(p-1)/p and a reduce-scatter of X·4·(p-1)/p, where an
all-reduce of the whole fp32 gradients moved 2·4·X·(p-1)/p (0.75x at c = 2); their all-reduce
over the other batch axes moves 1/p of what it did. Memory: the stage's weights whole over fsdp
(and the tables over stage) in the compute dtype, and their fp32 gradients whole, for the step;
outside it the tables' stored parameters, optimizer state and gradients are 1/p.

The 1F1B family's head (`heads`, `head_columns`) is the exception: every stage runs it on its
own columns of the vocabulary (pipeline/head.py), so it takes only those [D, V/(t·p)] for the
step, by an all-to-all over stage that trades the stored D split for one of each tensor rank's
V/t (where p divides V/t; then the all-gather over fsdp), and their fp32 gradient goes back by
the reverse all-to-all, without a sum over stage, each stage's columns its own: the head's
bytes over stage (c + 4)·(X/2p)·(p-1)/p, 1/p of its gather's and reduce-scatter's, its bytes
over fsdp 1/p too, and so its compute-dtype copy and fp32 gradient for the step.
"""

from __future__ import annotations

import math

import jax
from flax import nnx
from jax import lax
from jax.sharding import PartitionSpec as P

from pipeline.head import exchanges, stage_columns, whole
from pipeline.layout import lay_out
from pipeline.stages import AXIS, with_part
from sharding.accumulation import FSDP, gather, reduce
from sharding.rules import logical_to_spec

OVER = (FSDP, AXIS)  # the manual axes a weight is gathered over for the step, and reduced back to


def weight_specs(params: nnx.State, within: tuple[str, ...], stored: bool = False) -> nnx.State:
    """Each weight's spec over the mesh axes `within`: the blocks' [V, Lc, ...] chunks as the
    body holds them after `chunked`, each device's own (`stored`: the [X, ...] stack as stored,
    X over stage, the engine's in_spec). With fsdp (manual here) its fsdp split (the `embed`
    dimension), each device then holding its shard, and with expert the experts' split; with
    stage among `within` the embedding's and head's split over it (their `embed` dimension after
    fsdp: sharding/rules.py); with tensor (automatic here) its split, which
    sharding.accumulation's gather and reduce keep; everything else replicated."""
    mesh = jax.sharding.get_abstract_mesh()

    def spec(var: nnx.Variable, block: bool) -> P:
        names = tuple(var.get_metadata().get("out_sharding") or (None,) * var.ndim)
        split = tuple(logical_to_spec(names, var.shape, mesh, within=within)) if within else ()
        split = (split + (None,) * var.ndim)[:var.ndim]
        return P(*((AXIS,) if stored else (None, None)), *split[1:]) if block else P(*split)

    is_var = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
    return with_part(jax.tree.map(lambda v: spec(v, False), params, is_leaf=is_var), "blocks",
                     jax.tree.map(lambda v: spec(v, True), params["blocks"], is_leaf=is_var))


def gathered_once(tree: nnx.State, flat_specs: list[P], splits: list[P], heads: list[bool]) -> nnx.State:
    """The stage's weights whole over fsdp, and the embedding and head whole over stage, once per
    step: gathered by hand (on each tensor or expert shard: `splits`), over stage first (its
    split is the minor one). The leaves marked in `heads` (the 1F1B family's head) are instead
    the stage's columns of the head, whole over fsdp (`head_columns`)."""
    leaves, treedef = jax.tree.flatten(tree)
    return treedef.unflatten([head_columns(spec, a, t) if h else gather(spec, a, t, OVER)
                              for spec, a, t, h in zip(flat_specs, leaves, splits, heads, strict=True)])


def reduced_once(grads: nnx.State, flat_specs: list[P], splits: list[P], batch_axes: tuple[str, ...],
                 heads: list[bool], vocab: int) -> nnx.State:
    """The summed gradients -> their shard of the mean over the batch axes, once per step, the
    embedding's and head's summed over stage into each device's shard of them too (a
    reduce-scatter over fsdp, then one over stage, then the all-reduce over the other batch
    axes); the final norm's is summed over stage by the engine. The leaves marked in `heads`
    are the gradients of the stage's columns of the V = `vocab` head (`head_columns`)."""
    n = math.prod(lax.axis_size(a) for a in batch_axes)
    leaves, treedef = jax.tree.flatten(grads)

    def one(spec: P, g: jax.Array, t: P, h: bool) -> jax.Array:
        if not h:
            return reduce(g, spec, batch_axes, t, OVER)
        if exchanges(spec, vocab):  # the columns back by all-to-all over stage, no sum: each stage's own
            return reduce(g, spec, batch_axes, t, OVER, exchange=(AXIS, 1))
        return reduce(whole(g, vocab), spec, batch_axes, t, OVER)

    return treedef.unflatten([one(*leaf) / n for leaf in zip(flat_specs, leaves, splits, heads, strict=True)])


def head_columns(spec: P, w: jax.Array, split: P) -> jax.Array:
    """The head as stored (`spec`; its D split over fsdp, and stage where sharding/rules.py
    could, V over tensor: `split`) -> the stage's columns [D, t·q] (pipeline/head.py), whole
    over fsdp: by an all-to-all over stage where `exchanges` (its D's stage split traded for
    V/t's), else sliced from the whole head."""
    if exchanges(spec, w.shape[1]):
        return gather(spec, w, split, OVER, exchange=(AXIS, 1))
    return stage_columns(gather(spec, w, split, OVER))


def heads_of(params: nnx.State) -> list[bool]:
    """Per leaf of `params`, whether it is the head's."""
    return jax.tree.leaves(with_part(jax.tree.map(lambda _: False, params), "head",
                                     jax.tree.map(lambda _: True, params["head"])))


def over_stage(spec: P) -> bool:
    """Whether a weight of the body's spec `spec` is split over stage (the embedding and head:
    `gathered_once`, `reduced_once`)."""
    return any(AXIS in ((d,) if isinstance(d, str) else d or ()) for d in spec)


def chunked(tree: nnx.State, p: int, v_count: int, vee: bool, back: bool = False) -> nnx.State:
    """`tree` with the device's stored [V·Lc, ...] layers as the [V, Lc, ...] chunks it runs
    (pipeline.layout.lay_out); `back`, the run chunks' gradients as the stored [V·Lc, ...]."""
    def lay(a: jax.Array) -> jax.Array:
        if back:
            return lay_out(a, p, vee, back=True).reshape(-1, *a.shape[2:])
        return lay_out(a.reshape(v_count, -1, *a.shape[1:]), p, vee)

    return with_part(tree, "blocks", jax.tree.map(lay, tree["blocks"]))
