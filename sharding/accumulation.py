"""The gathers and reductions of an accumulation region: a shard_map manual over batch axes in
which each device runs its own rows of every microbatch, sums its gradients, and reduces them
once per step (training/step.py's microbatch loop, pipeline/engine.py's schedules).

A weight's spec (its in_spec in the region) names `fsdp` on the dimension FSDP splits (`embed`);
each device holds that shard. `gather` makes it whole over fsdp (an all-gather per such
dimension: P_c·(N-1)/N of the compute dtype); `reduce` takes the device's summed gradient of
the whole weight to its shard of the sum over the batch axes: a reduce-scatter over fsdp on that
dimension (4·P·(N-1)/N in fp32), then an all-reduce of the smaller shard over the other batch
axes (2·4·P/N_fsdp·(N-1)/N). A weight that fsdp does not split (the norms) is all-reduced over
every batch axis. Where `expert` is one of the region's axes (the step's accumulation region of
a MoE model: sharding.checks.accumulation_axes), the experts' weights are split over it, each
device holding its E/ep: their gradients are summed over the other batch axes only.

`tensor` stays automatic in the region, and `expert` too where it is not one of its axes (a
dense model's, or beside XLA's ZeRO-3), and XLA cannot partition a collective over a manual axis whose operand is
split over an automatic one: it gathers the operand over that axis first. So a weight that
tensor or expert parallelism splits (its spec over those axes, the third argument) is gathered
and reduced on each device's shard of it, in a shard_map manual over those axes too. Compiled
for H100s without it (llama3-70b, 4 layers, pp=2,fsdp=2,tp=8 under 1f1b) the fsdp bytes were
8x the contract, beside 16.7 GB of all-gathers over tensor, and XLA's peak 3.1x what it is now
(bench/results/accumulation-tensor-h100-compiled.json); mixtral-8x7b's experts (4 layers,
pp=2,fsdp=2,ep=2 under 1f1b) moved 1.8x the fsdp contract beside 26.4 GB of all-gathers over
expert (bench/results/pipeline-experts-h100-compiled.json).
"""

from __future__ import annotations

from typing import Callable

import jax
from jax.sharding import PartitionSpec as P

FSDP = "fsdp"
TENSOR = "tensor"
AUTOMATIC = ("expert", TENSOR)  # the axes that may split a weight while automatic in a region


def automatic(axes: tuple[str, ...]) -> tuple[str, ...]:
    """The AUTOMATIC axes a region manual over `axes` leaves to XLA: tensor, and expert unless
    it is one of them."""
    return tuple(a for a in AUTOMATIC if a not in axes)


def _splits(axes: str | tuple[str, ...] | None, axis: str) -> bool:
    return axes is not None and axis in (axes if isinstance(axes, tuple) else (axes,))


def _on_shard(fn: Callable[[jax.Array], jax.Array], x: jax.Array, split: P) -> jax.Array:
    """fn on each device's shard of x over the AUTOMATIC axes its spec `split` names (fn keeps
    that split)."""
    axes = {a for a in AUTOMATIC if any(_splits(d, a) for d in split)}
    if not axes:
        return fn(x)
    return jax.shard_map(fn, in_specs=split, out_specs=split, axis_names=axes, check_vma=False)(x)


def _over(axes: str | tuple[str, ...] | None, over: tuple[str, ...]) -> tuple[str, ...]:
    """The axes of one dimension's spec entry that are among `over`, major first."""
    return tuple(a for a in ((axes,) if isinstance(axes, str) else axes or ()) if a in over)


def gather(spec: P, w: jax.Array, split: P = P(), over: tuple[str, ...] = (FSDP,),
           exchange: tuple[str, int] | None = None) -> jax.Array:
    """w whole over fsdp (and the other axes of `over`, pipeline/stage_weights.py's stage): an
    all-gather per axis of `over` that `spec` splits a dimension over, the minor axis first (on
    each tensor or expert shard where `split`, w's spec over those axes, splits it).
    `exchange` (axis, dim): that axis's split moves to dimension dim instead, by an all-to-all
    (S·(N-1)/N of the shard where the all-gather received N-1 shards): each device then holds
    1/N of dim, whole along the other (the 1F1B family's head: pipeline/head.py)."""
    def whole(w: jax.Array) -> jax.Array:
        for dim, axes in enumerate(spec):
            for axis in reversed(_over(axes, over)):
                if exchange is not None and axis == exchange[0]:
                    w = jax.lax.all_to_all(w, axis, split_axis=exchange[1], concat_axis=dim, tiled=True)
                else:
                    w = jax.lax.all_gather(w, axis, axis=dim, tiled=True)
        return w

    return _on_shard(whole, w, split)


def reduce(g: jax.Array, spec: P, axes: tuple[str, ...], split: P = P(),
           over: tuple[str, ...] = (FSDP,), exchange: tuple[str, int] | None = None) -> jax.Array:
    """A device's summed gradient of a whole (gathered) weight -> its shard of the sum over
    the batch `axes` (and over the other axes of `over`): a reduce-scatter per axis of `over`
    that `spec` splits the weight over, the major axis first, then an all-reduce of the (smaller)
    shard over the axes that `spec` does not split it over (an expert's weights, split over a
    manual `expert`, are each device's own: summed over the others only), on each tensor or
    expert shard, as `gather`. `exchange` (axis, dim), as `gather`'s: g is the device's 1/N of
    dim, whole along the stored dimension, and no other device's gradient covers it (the head's
    columns), so that axis moves it back by an all-to-all, without a sum."""
    def shard(g: jax.Array) -> jax.Array:
        for dim, dim_axes in enumerate(spec):
            for axis in _over(dim_axes, over):
                if exchange is not None and axis == exchange[0]:
                    g = jax.lax.all_to_all(g, axis, split_axis=dim, concat_axis=exchange[1], tiled=True)
                else:
                    g = jax.lax.psum_scatter(g, axis, scatter_dimension=dim, tiled=True)
        rest = tuple(a for a in axes if not any(_splits(d, a) for d in spec))
        return jax.lax.psum(g, rest) if rest else g

    return _on_shard(shard, g, split)
