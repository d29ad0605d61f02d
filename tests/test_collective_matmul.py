"""The overlap rings (sharding/collective_matmul.py) against the collectives they replace: the
same values and gradients (fp32, within 1e-5), T-1 collective-permutes of one chunk each and no
all-gather or reduce-scatter."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, PartitionSpec as P

from sharding.collective_matmul import gather_ring, scatter_ring
from tools.hlo import census

AXIS = "tensor"


def _run(local, tp, x, w, in_specs, out_spec):
    """(value, d/dx, d/dw) of sum(local(x, w) * cotangent) on a mesh of tp devices, and the
    compiled collectives."""
    mesh = jax.make_mesh((tp,), (AXIS,), axis_types=(AxisType.Auto,), devices=jax.devices()[:tp])
    fn = jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=out_spec)
    cot = np.random.default_rng(1).normal(size=jax.eval_shape(fn, x, w).shape).astype(np.float32)
    grad = jax.jit(jax.value_and_grad(lambda x, w: jnp.sum(fn(x, w) * cot), argnums=(0, 1)))
    return grad(x, w), census(grad.lower(x, w).compile().as_text(), {AXIS: tp})


def assert_ring_replaces(ring, collective, tp, x, w, specs) -> None:
    """ring and collective give the same value and gradients; the ring's program holds T-1
    collective-permutes of one [B, L/T, D] chunk each way and no all-gather or reduce-scatter."""
    got, found = _run(ring, tp, x, w, *specs)
    want, _ = _run(collective, tp, x, w, *specs)
    for g, e in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-5)
    chunk = 2 * 4 * 16  # [B, L/T, D]
    permutes = [c for c in found if c.kind == "collective-permute"]
    assert len(permutes) == 2 * (tp - 1) and {c.elements for c in permutes} == {chunk}, found  # forward, backward
    assert not [c for c in found if c.kind in ("all-gather", "reduce-scatter")], found


@pytest.mark.parametrize("tp", [2, 4])
def test_gather_ring_equals_all_gather_then_matmul(tp):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 4 * tp, 16)).astype(np.float32)  # [B, L, D], L split over tensor
    w = rng.normal(size=(16, 4 * tp)).astype(np.float32)  # [D, F], F split over tensor

    def matmul(w):
        return lambda x: (jnp.einsum("bld,df->blf", x, w), x * 2)  # a tuple of [B, l, ...] outputs

    def ring(x, w):
        h, twice = gather_ring(x, matmul(w), AXIS, tp)
        return h + jnp.sum(twice)

    def gathered(x, w):
        h, twice = matmul(w)(jax.lax.all_gather(x, AXIS, axis=1, tiled=True))
        return h + jnp.sum(twice)

    assert_ring_replaces(ring, gathered, tp, x, w, ((P(None, AXIS), P(None, AXIS)), P(None, None, AXIS)))


@pytest.mark.parametrize("tp", [2, 4])
def test_scatter_ring_equals_matmul_then_reduce_scatter(tp):
    rng = np.random.default_rng(0)
    h = rng.normal(size=(2, 4 * tp, 4 * tp)).astype(np.float32)  # [B, L, F], F split over tensor
    w = rng.normal(size=(4 * tp, 16)).astype(np.float32)  # [F, D], F split over tensor

    def ring(h, w):
        return scatter_ring(h, lambda h: jnp.einsum("blf,fd->bld", h, w), AXIS, tp)

    def scattered(h, w):
        return jax.lax.psum_scatter(jnp.einsum("blf,fd->bld", h, w), AXIS, scatter_dimension=1, tiled=True)

    assert_ring_replaces(ring, scattered, tp, h, w, ((P(None, None, AXIS), P(AXIS)), P(None, AXIS)))
