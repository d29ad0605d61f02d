"""A stage's weights in every schedule's region (pipeline/engine.py), once per step: laid
out in the chunks the stage runs, whole over fsdp for the step's ticks, and the summed gradients
reduced back to each device's shard.

Layout: the stage's blocks are stored [X/p, ...] (X layers over p stages) and run as [V, Lc, ...]
chunks (`chunked`: pipeline/layout.py; V > 1 moves the chunks stored elsewhere by
collective-permute, and their gradients back). The embedding, norm and head keep their stored
layout.

Under fsdp the stage's compute-dtype weights are gathered once per step, before the tick scan,
and the gradients accumulate whole: ZeRO-1 style within the step (the fp32 master weights and
AdamW moments stay split). With the batch axes manual in the engine (`batch_axes`, data, fsdp
and expert where > 1: sharding.checks.accumulation_axes) the gather is by hand, on each tensor
shard, and the summed gradients are reduced once per step (`gathered_once`, `reduced_once`,
with sharding/accumulation.py's gather and reduce): per step, whatever M, one all-gather of the
stage's weights in the compute dtype and one reduction of their fp32 gradients (a
reduce-scatter over fsdp, then an all-reduce of the shard over data, expert and sequence, the
routed experts' over data alone). Where they
are not (`gathered_once` without fsdp in `batch_axes`) the gather is a sharding constraint
(`whole_over_fsdp`) and XLA reduces the partial sums where the backward makes them (each
backward cell of the 1F1B family, each tick of gpipe and interleaved). Memory: the stage's
weights whole over fsdp in the compute dtype, and their fp32 gradients whole, for the step.
"""

from __future__ import annotations

import math

import jax
from flax import nnx
from jax import lax
from jax.sharding import PartitionSpec as P

from pipeline.layout import lay_out
from pipeline.stages import AXIS, with_part
from sharding.accumulation import FSDP, gather, reduce
from sharding.rules import constrain, logical_to_spec


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


def weight_specs(params: nnx.State, within: tuple[str, ...], stored: bool = False, stage: bool = True) -> nnx.State:
    """Each weight's spec over the mesh axes `within`: the blocks' [V, X/V, ...] chunks, X/V over
    stage (`stage`), as the body holds them after `chunked` (`stored`: the [X, ...] stack as
    stored, the engine's in_spec). With fsdp (manual here) its fsdp split (the `embed`
    dimension), each device then holding its shard, and with expert the experts' split; with
    tensor (automatic here) its split, which sharding.accumulation's gather and reduce keep;
    everything else replicated."""
    mesh = jax.sharding.get_abstract_mesh()

    def spec(var: nnx.Variable, block: bool) -> P:
        names = tuple(var.get_metadata().get("out_sharding") or (None,) * var.ndim)
        split = tuple(logical_to_spec(names, var.shape, mesh, within=within)) if within else ()
        split = (split + (None,) * var.ndim)[:var.ndim]
        layers = AXIS if stage else None
        return P(*((layers,) if stored else (None, layers)), *split[1:]) if block else P(*split)

    is_var = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
    return with_part(jax.tree.map(lambda v: spec(v, False), params, is_leaf=is_var), "blocks",
                     jax.tree.map(lambda v: spec(v, True), params["blocks"], is_leaf=is_var))


def gathered_once(tree: nnx.State, flat_specs: list[P], splits: list[P], batch_axes: tuple[str, ...]) -> nnx.State:
    """The stage's weights whole over fsdp, once per step: gathered by hand where fsdp is manual
    in the engine (on each tensor or expert shard: `splits`), else by a sharding constraint (XLA's
    gather)."""
    if FSDP not in batch_axes:
        return whole_over_fsdp(tree)
    leaves, treedef = jax.tree.flatten(tree)
    return treedef.unflatten([gather(spec, a, t) for spec, a, t in zip(flat_specs, leaves, splits, strict=True)])


def reduced_once(grads: nnx.State, flat_specs: list[P], splits: list[P], batch_axes: tuple[str, ...]) -> nnx.State:
    """The summed gradients -> their shard of the mean over the batch axes, once per step."""
    if not batch_axes:
        return grads
    n = math.prod(lax.axis_size(a) for a in batch_axes)
    leaves, treedef = jax.tree.flatten(grads)
    return treedef.unflatten([reduce(g, spec, batch_axes, t) / n
                              for spec, g, t in zip(flat_specs, leaves, splits, strict=True)])


def chunked(tree: nnx.State, p: int, v_count: int, vee: bool, back: bool = False) -> nnx.State:
    """`tree` with the device's stored [V·Lc, ...] layers as the [V, Lc, ...] chunks it runs
    (pipeline.layout.lay_out); `back`, the run chunks' gradients as the stored [V·Lc, ...]."""
    def lay(a: jax.Array) -> jax.Array:
        if back:
            return lay_out(a, p, vee, back=True).reshape(-1, *a.shape[2:])
        return lay_out(a.reshape(v_count, -1, *a.shape[1:]), p, vee)

    return with_part(tree, "blocks", jax.tree.map(lay, tree["blocks"]))
