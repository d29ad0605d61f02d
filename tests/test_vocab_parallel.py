"""The vocab-split embedding and head (sharding/vocab_parallel.py): equal to the dense lookup and
matmul in value and gradient (fp32, within 1e-5), with the collectives the module docstring
names and no gather of the table; and the head's backward in the compute dtype."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from conftest import small_config
from pipeline.jaxpr_eval import equations
from sharding.mesh import build_mesh
from sharding.tensor_parallel import TensorParallel
from sharding.vocab_parallel import head_matmul, vocab_parallel_logits, vocab_parallel_take
from tools.hlo import census

B, L, D, V = 4, 8, 16, 40


def _mesh(text: str):
    cfg = small_config(text)
    return build_mesh(cfg.parallel, jax.devices()[:8])


def _collectives(fn, *args) -> list:
    """The compiled fn's collectives (tools.hlo.census) on the mesh in context."""
    mesh = jax.sharding.get_abstract_mesh()
    return census(fn.lower(*args).compile().as_text(), dict(mesh.shape))


@pytest.mark.parametrize("sequence_parallel", [False, True])
@pytest.mark.parametrize("mesh_text", ["tp=8", "dp=2,tp=4"])
def test_take_equals_the_dense_lookup(mesh_text, sequence_parallel):
    """Each device's V/T rows, summed over tensor (SP: reduce-scattered over L): the lookup and
    the table's gradient equal jnp.take's, and over tensor only [b, L, D] moves (GSPMD's own
    lookup all-reduces the table's whole gradient over tensor)."""
    rng = np.random.default_rng(0)
    table = rng.normal(size=(V, D)).astype(np.float32)
    tokens = rng.integers(0, V, size=(B, L)).astype(np.int32)
    weights = rng.normal(size=(B, L, D)).astype(np.float32)  # an arbitrary cotangent of the lookup

    def loss(take, table):
        return jnp.sum(take(table) * weights)

    want = jax.value_and_grad(lambda t: loss(lambda t: jnp.take(t, tokens, axis=0), t))(table)
    mesh = _mesh(mesh_text)
    with jax.set_mesh(mesh):
        sharded = jax.device_put(table, NamedSharding(mesh, P("tensor", None)))
        fn = jax.jit(jax.value_and_grad(lambda t: loss(lambda t: vocab_parallel_take(t, tokens, sequence_parallel), t)))
        got = fn(sharded)
        found = _collectives(fn, sharded)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
    kinds = {(c.kind, c.axes) for c in found}
    assert ("reduce-scatter" if sequence_parallel else "all-reduce", ("tensor",)) in kinds, kinds
    if sequence_parallel:
        assert ("all-gather", ("tensor",)) in kinds, kinds  # dx's, backward
    if "dp=2" in mesh_text:
        assert ("all-reduce", ("data",)) in kinds, kinds  # the table's gradient, summed over data
    rows = B // 2 if "dp=2" in mesh_text else B
    # over tensor only S = [b, L, D] moves (and the loss's sum), never the table [V, D] or its gradient
    assert {c.elements for c in found if c.axes == ("tensor",)} - {1} == {rows * L * D}, found


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_logits_equal_the_dense_head(sequence_parallel):
    """The column-parallel head on dp=2,tp=4: fp32 logits, dx and dW equal the dense matmul's."""
    rng = np.random.default_rng(1)
    x = rng.normal(size=(B, L, D)).astype(np.float32)
    head = (rng.normal(size=(D, V)) / 4).astype(np.float32)
    weights = rng.normal(size=(B, L, V)).astype(np.float32)
    tp = TensorParallel("shard_map", sequence_parallel=sequence_parallel)

    def loss(logits, x, head):
        return jnp.sum(logits(x, head) * weights)

    want = jax.value_and_grad(lambda x, w: loss(lambda x, w: x @ w, x, w), argnums=(0, 1))(x, head)
    mesh = _mesh("dp=2,tp=4")
    with jax.set_mesh(mesh):
        fn = jax.jit(jax.value_and_grad(lambda x, w: loss(lambda x, w: vocab_parallel_logits(tp, x, w), x, w),
                                        argnums=(0, 1)))
        value, grads = fn(x, head)
        logits = jax.jit(lambda x, w: vocab_parallel_logits(tp, x, w))(x, head)
    assert logits.dtype == jnp.float32 and logits.sharding.spec[2] == "tensor"  # never gathered whole
    np.testing.assert_allclose(value, want[0], rtol=1e-5)
    for g, w in zip(grads, want[1]):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


def test_head_matmul_backward_runs_in_the_compute_dtype_in_the_weight_layout():
    """head_matmul's backward: in fp32 autodiff's (dx, dW) within 1e-5 (the same products, dW's
    summed in another order); in bf16 its two matmuls take
    bf16 operands (autodiff's widen x and W to fp32), accumulate in fp32, and dW leaves its
    matmul as [D, V] with no transpose, within bf16 rounding of the fp32 gradients."""
    b, length, d, v = 2, 8, 16, 40
    kx, kw, kt = jax.random.split(jax.random.key(0), 3)
    x, w = jax.random.normal(kx, (b, length, d)), jax.random.normal(kw, (d, v)) / 4
    weights = jax.random.normal(kt, (b, length, v))  # an arbitrary fp32 cotangent of the logits

    def loss(matmul, x, w):
        return jnp.sum(matmul(x, w) * weights)

    def autodiff(x, w):
        return jnp.einsum("bld,dv->blv", x, w, preferred_element_type=jnp.float32)

    grads = jax.grad(lambda x, w: loss(head_matmul, x, w), argnums=(0, 1))
    want = jax.grad(lambda x, w: loss(autodiff, x, w), argnums=(0, 1))(x, w)
    for got, expected in zip(grads(x, w), want):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)

    x16, w16 = x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
    jaxpr = jax.make_jaxpr(grads)(x16, w16)
    eqns = list(equations(jaxpr))
    dots = [e for e in eqns if e.primitive.name == "dot_general"]
    assert len(dots) == 3  # the forward, dx, dW
    assert all(str(a.aval.dtype) == "bfloat16" for e in dots for a in e.invars)
    assert sorted(tuple(e.outvars[0].aval.shape) for e in dots) == [(b, length, d), (b, length, v), (d, v)]
    assert not [e for e in eqns if e.primitive.name == "transpose"]
    dx, dw = grads(x16, w16)
    np.testing.assert_allclose(np.float32(dx), want[0], rtol=0.05, atol=0.05)
    np.testing.assert_allclose(np.float32(dw), want[1], rtol=0.05, atol=0.05)


@pytest.mark.parametrize("mesh_text, manual, reduced", [
    ("pp=2,dp=2,tp=2", ("stage", "data"), False),  # the 1F1B engine beside data: summed per device
    ("pp=2,dp=2,tp=2", ("stage",), True),  # MoE: data left to XLA, the lookup's region manual over it
    ("pp=2,sp=2,tp=2", ("stage",), True),  # sp > 1
    ("pp=2,dp=4", ("stage",), False),  # no tensor axis: GSPMD's own lookup, no region
    ("dp=2,tp=4", (), True),  # outside any region (not nested): the region is manual over data
])
def test_take_grad_reduced_where_the_region_owns_a_batch_axis(mesh_text, manual, reduced):
    """sharding.vocab_parallel.take_grad_reduced, read inside a shard_map manual over `manual`:
    whether the lookup's transpose all-reduces the table's gradient (pipeline.cells.embed_grad
    then keeps it in the compute dtype, so the all-reduce moves bf16; elsewhere it scatters fp32
    into the accumulator in place)."""
    from sharding.vocab_parallel import take_grad_reduced

    mesh, seen = _mesh(mesh_text), []

    def body(x):
        seen.append(take_grad_reduced())
        return x

    with jax.set_mesh(mesh):
        fn = jax.shard_map(body, in_specs=P(), out_specs=P(), axis_names=set(manual), check_vma=False) if manual else body
        jax.eval_shape(fn, jnp.zeros(()))
    assert seen == [reduced]
