"""Every mesh computes the same training step as one device.

For each mesh the loss and every gradient of one step (jitted `loss_and_grads`) must equal the
single-device run, and the losses of 5 optimizer steps must match. Compute is fp32 here, so the
only differences are the order of the reductions that sharding splits: we allow rtol 2e-5 on
the loss and, on gradients, atol 1e-6 + rtol 1e-4 (gradient entries are O(1e-3)).
"""

import functools

import jax
import numpy as np
import pytest

from conftest import small_config
from sharding.mesh import build_mesh
from training.build import build
from training.step import loss_and_grads

MESHES = ["dp=8", "fsdp=8", "tp=8", "dp=2,fsdp=2,tp=2", "fsdp=4,sp=2", "dp=2,tp=2,sp=2"]
STEPS = 5


def run(cfg, corpus, devices=None):
    """(loss, grads) of step 0 and the losses of STEPS steps, all on host."""
    mesh = build_mesh(cfg.parallel, devices)
    job = build(cfg, mesh, tokens=corpus)
    grad_fn = jax.jit(functools.partial(loss_and_grads, graphdef=job.graphdef, cfg=cfg))
    with jax.set_mesh(mesh):
        loss, grads = jax.device_get(grad_fn(job.state.params, batch=job.batches(0)))
        state, losses = job.state, []
        for step in range(STEPS):
            state, metrics = job.step_fn(state, job.batches(step))
            losses.append(float(metrics["loss"]))
    return float(loss), grads, np.array(losses)


@pytest.fixture(scope="module")
def reference(corpus):
    return run(small_config(), corpus, devices=jax.devices()[:1])


@pytest.mark.parametrize("mesh", MESHES)
def test_mesh_equals_single_device(mesh, reference, corpus):
    ref_loss, ref_grads, ref_losses = reference
    loss, grads, losses = run(small_config(mesh), corpus)
    np.testing.assert_allclose(loss, ref_loss, rtol=2e-5)
    flat_ref = jax.tree_util.tree_leaves_with_path(ref_grads)
    flat = jax.tree.leaves(grads)
    assert len(flat) == len(flat_ref) > 0
    for (path, want), got in zip(flat_ref, flat):
        np.testing.assert_allclose(got, want, atol=1e-6, rtol=1e-4, err_msg=jax.tree_util.keystr(path))
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-5)
    assert losses[-1] < losses[0]  # it trains


def test_gradient_accumulation_equals_one_big_batch(corpus):
    """k=4 microbatches of 4 give the loss, gradients and update of one batch of 16."""
    big, acc = small_config(), small_config("", "train.micro_batch_size=4")
    mesh = build_mesh(big.parallel, jax.devices()[:1])
    jobs = [build(cfg, mesh, tokens=corpus) for cfg in (big, acc)]
    batches = [job.batches(0) for job in jobs]
    assert batches[0]["inputs"].shape == (1, 16, 32) and batches[1]["inputs"].shape == (4, 4, 32)
    np.testing.assert_array_equal(batches[0]["inputs"].reshape(16, 32), batches[1]["inputs"].reshape(16, 32))
    results = []
    with jax.set_mesh(mesh):
        for job, batch, cfg in zip(jobs, batches, (big, acc)):
            loss, grads = jax.jit(functools.partial(loss_and_grads, graphdef=job.graphdef, cfg=cfg))(
                job.state.params, batch=batch
            )
            state, _ = job.step_fn(job.state, batch)
            results.append(jax.device_get((loss, grads, state.params)))
    (loss1, grads1, params1), (loss4, grads4, params4) = results
    np.testing.assert_allclose(loss4, loss1, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(grads4), jax.tree.leaves(grads1)):
        np.testing.assert_allclose(a, b, atol=1e-7, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(params4), jax.tree.leaves(params1)):
        np.testing.assert_allclose(a, b, atol=1e-7, rtol=1e-5)
