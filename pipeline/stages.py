"""What every schedule shares: the stage axis, the buffers' fill value, the model's pieces.

The model (model/transformer.py) knows no mesh axis: it exposes `embed_tokens`, `run_layers`
(the scan over any stack of block states) and `logits`; the schedules call them per stage.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import DTypeLike

from sharding.rules import axis_size

AXIS = "stage"
# Pipeline buffers (activations in flight, stashes, outputs) start as NaN: every schedule
# masks idle ticks with selects, so a bubble that leaked into the result would make it NaN
# and fail the equality tests instead of passing silently.
FILL = float("nan")


def stages() -> int:
    """p, the size of the stage axis of the current mesh (1 outside a mesh)."""
    return axis_size(AXIS)


def over_stages(body: Callable, in_specs: Any, out_specs: Any, batch_axes: tuple[str, ...] = ()) -> Callable:
    """`body` as a shard_map manual over `stage` and `batch_axes` (the schedules' accumulation
    axes: the batch split over them, the gradients reduced over them by the body,
    pipeline/engine.py); the other axes stay automatic.

    Unchecked (check_vma=False): the tensor-parallel regions inside the stages are shard_maps of
    their own, and jax 0.10 types the residuals of a nested, checked shard_map with every axis
    their values vary over, `stage` included, which Shardy rejects ("manual axis after free
    axis" / "already bound by a parent"). Left unchecked, the outer program's values carry no
    stage type, the regions' residuals name `tensor` only, and the regions keep their own
    checked collectives. Nothing inside the schedules relies on the types: every cross-stage
    sum (the gradients, loss and statistics: pipeline/engine.py) is an explicit psum, and
    gpipe's autodiff, taken inside the body, transposes only ppermutes across stages.
    """
    return jax.shard_map(body, in_specs=in_specs, out_specs=out_specs, axis_names={AXIS, *batch_axes},
                         check_vma=False)


def buffer(shape: tuple[int, ...], dtype: DTypeLike) -> jax.Array:
    """A NaN-filled buffer (integer ones, e.g. a MoE layer's kept expert ids: the dtype's least
    value, as far out of any index range; booleans: False)."""
    dtype = jnp.dtype(dtype)
    if jnp.issubdtype(dtype, jnp.inexact):
        return jnp.full(shape, FILL, dtype)
    return jnp.full(shape, jnp.iinfo(dtype).min if jnp.issubdtype(dtype, jnp.integer) else False, dtype)


def with_part(params: nnx.State, name: str, part: nnx.State) -> nnx.State:
    """A copy of the parameter tree whose subtree `name` (e.g. "blocks", "embed") is `part`."""
    out = jax.tree.map(lambda a: a, params)
    out[name] = part
    return out
