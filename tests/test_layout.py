"""pipeline/layout.py: every chunk runs where its schedule runs it, moving once, and back.

The routes are checked on the host for every layout; `lay_out` runs in a shard_map over 4 fake
CPU devices on chunks that carry their own number."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from pipeline.layout import lay_out, leaving, model_chunk, routes
from pipeline.stages import AXIS

LAYOUTS = [(p, v, vee) for p in (2, 3, 4, 8) for v in (1, 2, 3, 4) for vee in (False, True) if not vee or v == 2]


@pytest.mark.parametrize("p, v, vee", LAYOUTS)
def test_each_chunk_moves_once_to_the_stage_that_runs_it(p, v, vee):
    """Each (stage, slot) receives exactly one chunk, the one it runs; each stored chunk is sent
    once; within a permute no device sends or receives twice; `leaving` counts what leaves."""
    received, sent = {}, set()
    for a, b, pairs in routes(p, v, vee):
        assert len({src for src, _ in pairs}) == len(pairs) == len({dst for _, dst in pairs})
        for src, dst in pairs:
            chunk = src * v + b  # stored: device d holds the model's chunks d·V ... d·V + V - 1
            assert (dst, a) not in received and chunk not in sent
            received[dst, a], _ = chunk, sent.add(chunk)
    assert received == {(s, a): model_chunk(a, s, p, vee) for s in range(p) for a in range(v)}
    assert leaving(p, v, vee) == [sum(c // v == d != s for (s, _), c in received.items()) for d in range(p)]


def test_leaving_counts():
    """The busiest device's chunks that leave: one of two at p = 2, both at p = 4 (interleaved and
    zbv), 3 of 4 at p = V = 4, none at V = 1."""
    assert [max(leaving(p, v, vee)) for p, v, vee in [(2, 2, False), (4, 2, False), (4, 4, False), (2, 2, True),
                                                       (4, 2, True), (4, 1, False)]] == [1, 2, 3, 1, 2, 0]
    assert leaving(4, 2, False) == [1, 2, 2, 1]


@pytest.mark.parametrize("v, vee", [(2, False), (2, True), (4, False)])
def test_lay_out_and_back_on_devices(v, vee):
    """4 stages: each device's stored chunks, filled with their model chunk's number, come out as
    the chunks it runs; `back` returns them to where they are stored."""
    p = 4
    mesh = jax.make_mesh((p,), (AXIS,), devices=jax.devices()[:p])
    stored = jnp.repeat(jnp.arange(p * v, dtype=jnp.float32), 3).reshape(p * v, 3)  # chunk c: [3] of c
    stored = jax.device_put(stored, NamedSharding(mesh, P(AXIS)))

    def both(a):
        run = lay_out(a.reshape(v, -1, *a.shape[1:]), p, vee)
        return run.reshape(-1, *a.shape[1:]), lay_out(run, p, vee, back=True).reshape(-1, *a.shape[1:])

    run, back = jax.jit(jax.shard_map(both, mesh=mesh, in_specs=P(AXIS), out_specs=(P(AXIS), P(AXIS))))(stored)
    want = np.array([model_chunk(a, s, p, vee) for s in range(p) for a in range(v)], np.float32)
    np.testing.assert_array_equal(np.asarray(run)[:, 0], want)
    np.testing.assert_array_equal(np.asarray(back), np.asarray(stored))
