"""The gathers and reductions of an accumulation region: a shard_map manual over batch axes in
which each device runs its own rows of every microbatch, sums its gradients, and reduces them
once per step (training/step.py's microbatch loop, pipeline/one_f_one_b.py's schedule).

A weight's spec (its in_spec in the region) names `fsdp` on the dimension FSDP splits (`embed`);
each device holds that shard. `gather` makes it whole over fsdp (an all-gather per such
dimension: P_c·(N-1)/N of the compute dtype); `reduce` takes the device's summed gradient of
the whole weight to its shard of the sum over the batch axes: a reduce-scatter over fsdp on that
dimension (4·P·(N-1)/N in fp32), then an all-reduce of the smaller shard over the other batch
axes (2·4·P/N_fsdp·(N-1)/N). A weight that fsdp does not split (the norms) is all-reduced over
every batch axis.
"""

from __future__ import annotations

import jax
from jax.sharding import PartitionSpec as P

FSDP = "fsdp"


def _splits_fsdp(axes: str | tuple[str, ...] | None) -> bool:
    return axes is not None and FSDP in (axes if isinstance(axes, tuple) else (axes,))


def gather(spec: P, w: jax.Array) -> jax.Array:
    """w whole over fsdp: an all-gather of each dimension that `spec` splits over fsdp."""
    for dim, axes in enumerate(spec):
        if _splits_fsdp(axes):
            w = jax.lax.all_gather(w, FSDP, axis=dim, tiled=True)
    return w


def reduce(g: jax.Array, spec: P, axes: tuple[str, ...]) -> jax.Array:
    """A device's summed gradient of a whole (fsdp-gathered) weight -> its shard of the sum over
    the batch `axes`: a reduce-scatter over fsdp where `spec` splits the weight over it, then an
    all-reduce over the other axes of the (smaller) shard."""
    scattered = ()
    for dim, dim_axes in enumerate(spec):
        if _splits_fsdp(dim_axes):
            g = jax.lax.psum_scatter(g, FSDP, scatter_dimension=dim, tiled=True)
            scattered = (FSDP,)
    rest = tuple(a for a in axes if a not in scattered)
    return jax.lax.psum(g, rest) if rest else g
