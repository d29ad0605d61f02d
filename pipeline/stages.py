"""What every schedule shares: the stage axis, the buffers' fill value, the model's pieces.

The model (model/transformer.py) knows no mesh axis: it exposes `embed_tokens`, `run_layers`
(the scan over any stack of block states) and `logits`; the schedules call them per stage.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

AXIS = "stage"
# Pipeline buffers (activations in flight, stashes, outputs) start as NaN: every schedule
# masks idle ticks with selects, so a bubble that leaked into the result would make it NaN
# and fail the equality tests instead of passing silently.
FILL = float("nan")


def stages() -> int:
    """p, the size of the stage axis of the current mesh (1 outside a mesh)."""
    mesh = jax.sharding.get_abstract_mesh()
    return 1 if mesh.empty else dict(mesh.shape).get(AXIS, 1)


def varying(x: jax.Array) -> jax.Array:
    """x typed as varying over `stage` (a scan carry inside the shard_map must be)."""
    return jax.lax.pcast(x, AXIS, to="varying")


def buffer(shape: tuple[int, ...], dtype) -> jax.Array:
    """A NaN-filled buffer, varying over stage."""
    return varying(jnp.full(shape, FILL, dtype))


def compute_params(params: nnx.State, dtype: str) -> nnx.State:
    return jax.tree.map(lambda p: p.astype(dtype), params)


def with_layers(params: nnx.State, layers: nnx.State) -> nnx.State:
    """A copy of the parameter tree whose stacked block states are `layers`."""
    out = jax.tree.map(lambda a: a, params)
    out["blocks"] = layers
    return out
