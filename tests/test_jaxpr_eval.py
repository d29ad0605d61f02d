"""pipeline/jaxpr_eval.py: calls inlined, scans kept, equations counted through sub-jaxprs, scan
parameters read on every supported jax."""

import jax
import jax.numpy as jnp
import numpy as np

from pipeline.jaxpr_eval import count_prims, flatten, scan_counts

CALLS = {"pjit", "jit", "closed_call", "checkpoint", "remat", "remat2", "custom_jvp_call"}


def f(w, x):
    """A jit call holding a checkpoint and a custom_jvp (relu), then a scan of 3 matmuls."""
    inner = jax.jit(lambda w, x: jax.checkpoint(lambda y: jax.nn.relu(y @ w))(x))
    h = inner(w, x)
    h, _ = jax.lax.scan(lambda c, _: (jnp.tanh(c @ w), None), h, None, length=3)
    return h.sum()


def test_flatten_inlines_calls_and_keeps_scans():
    w, x = jnp.eye(4) * 0.5, jnp.arange(8.0).reshape(2, 4)
    closed = jax.make_jaxpr(f)(w, x)
    assert {e.primitive.name for e in closed.jaxpr.eqns} & CALLS
    jaxpr, consts = flatten(closed.jaxpr, closed.consts)
    names = [e.primitive.name for e in jaxpr.eqns]
    assert not set(names) & CALLS and names.count("scan") == 1
    [got] = jax.core.eval_jaxpr(jaxpr, consts, w, x)
    np.testing.assert_allclose(got, f(w, x), rtol=1e-6)


def test_count_prims_counts_each_sub_jaxpr_once():
    """Two dots: one under jit + checkpoint, one in the scan body (counted once, not 3 times)."""
    closed = jax.make_jaxpr(f)(jnp.eye(4), jnp.ones((2, 4)))
    assert count_prims(closed) == 2 and count_prims(closed, "tanh") == 1


def test_scan_counts_on_this_jax():
    """(consts, carries) of a scan with one const (w, closed over), two carries and one xs."""
    def g(w, c, xs):
        return jax.lax.scan(lambda carry, x: ((carry[0] @ w + x, carry[1] + 1), None), (c, 0), xs)[0]

    closed = jax.make_jaxpr(g)(jnp.eye(2), jnp.ones(2), jnp.ones((5, 2)))
    [scan] = [e for e in closed.jaxpr.eqns if e.primitive.name == "scan"]
    assert scan_counts(scan.params) == (1, 2)
