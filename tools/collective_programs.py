"""tools/collectives.py's programs: one jitted `jax.shard_map` per (op, mesh axes), manual over
exactly those axes, whose body is that one collective (`lax.psum`, `lax.all_gather`,
`lax.psum_scatter`, `lax.all_to_all`, or `lax.ppermute` one step round a ring); its input,
op.input_count elements per rank of the group as one array split over the axes (replicated
over the others), made in place on the devices; and `check_program`, the census of the compiled
program against the one collective it must hold (kind, axes, group, dtype, elements).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Callable

from tools.busbw import Op

if TYPE_CHECKING:
    import jax

Axes = tuple[str, ...]  # mesh axes, in mesh order


def body(op: Op, axes: Axes, n: int) -> Callable:
    """The per-device function: exactly one collective over `axes`."""
    from jax import lax

    if op.name == "all-reduce":
        return lambda x: lax.psum(x, axes)
    if op.name == "all-gather":
        return lambda x: lax.all_gather(x, axes, tiled=True)
    if op.name == "reduce-scatter":
        return lambda x: lax.psum_scatter(x, axes, tiled=True)
    if op.name == "all-to-all":
        return lambda x: lax.all_to_all(x, axes, 0, 0, tiled=True)
    return lambda x: lax.ppermute(x, axes, [(i, (i + 1) % n) for i in range(n)])


def program(mesh: jax.sharding.Mesh, op: Op, axes: Axes, n: int) -> Callable:
    """jit(shard_map) manual over `axes`; the input's dim 0 is split over them."""
    import jax
    from jax.sharding import PartitionSpec as P

    return jax.jit(jax.shard_map(body(op, axes, n), mesh=mesh, in_specs=P(axes), out_specs=P(axes),
                                 axis_names=set(axes)))


def input_spec(mesh: jax.sharding.Mesh, op: Op, axes: Axes, n: int, count: int, dtype: str) -> jax.ShapeDtypeStruct:
    """The global input: op.input_count elements per rank of the group, replicated elsewhere."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    return jax.ShapeDtypeStruct((n * op.input_count(count, n),), _jnp_dtype(dtype),
                                sharding=NamedSharding(mesh, P(axes)))


def _jnp_dtype(dtype: str):
    import jax.numpy as jnp

    return {"bf16": jnp.bfloat16, "f32": jnp.float32}[dtype]


def make_input(spec: jax.ShapeDtypeStruct) -> jax.Array:
    """Ones of `spec`'s shape, made on the devices in place."""
    import jax
    import jax.numpy as jnp

    return jax.jit(lambda: jnp.ones(spec.shape, spec.dtype), out_shardings=spec.sharding)()


def group_size(mesh: jax.sharding.Mesh, axes: Axes) -> int:
    return math.prod(mesh.shape[a] for a in axes)


def check_program(mesh: jax.sharding.Mesh, op: Op, axes: Axes, count: int, dtype: str) -> str | None:
    """Compile and census one program: None when it holds exactly the intended collective, else why not."""
    import jax

    from tools.hlo import census

    n = group_size(mesh, axes)
    spec = input_spec(mesh, op, axes, n, count, dtype)
    found = census(program(mesh, op, axes, n).lower(spec).compile().as_text(), dict(mesh.shape))
    moved = "f32" if dtype == "bf16" and jax.default_backend() == "cpu" else dtype
    want = (op.kind, axes, 2 if op.kind == "collective-permute" else n, moved, count)
    got = [(c.kind, c.axes, c.group, c.dtype, c.elements) for c in found]
    return None if got == [want] else f"expected {[want]}, compiled {got}"
