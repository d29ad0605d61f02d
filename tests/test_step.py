"""Every mesh computes the same training step as one device (conftest.assert_same_run: loss
and every gradient of step 0, and the losses of 5 steps, against the single-device run)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import assert_same_run, run_steps, small_config
from sharding.mesh import build_mesh
from training.build import build
from training.step import loss_and_grads

# tensor parallelism runs here with the default tp_impl=shard_map; tests/test_tensor_parallel.py
# covers its other settings.
MESHES = ["dp=8", "fsdp=8", "tp=8", "dp=2,fsdp=2,tp=2", "fsdp=4,sp=2", "dp=2,tp=2,sp=2"]


@pytest.mark.parametrize("mesh", MESHES)
def test_mesh_equals_single_device(mesh, reference, corpus):
    assert_same_run(run_steps(small_config(mesh), corpus), reference)


# the region over data (fsdp automatic inside, or manual with gather-once), and the tensor
# regions nested in it (GSPMD; shard_map with SP and the overlap rings)
ACCUMULATING = [("dp=4",), ("dp=2,fsdp=2",), ("dp=2,fsdp=2", "parallel.fsdp_gather_once=true"),
                ("fsdp=2,tp=2", "train.micro_batch_size=2", "parallel.fsdp_gather_once=true"),
                ("dp=2,tp=2", "train.micro_batch_size=2", "parallel.tp_impl=gspmd"),
                ("dp=2,tp=2", "train.micro_batch_size=2", "parallel.sequence_parallel=true", "parallel.tp_overlap=true")]


@pytest.mark.parametrize("case", ACCUMULATING, ids=[" ".join(c) for c in ACCUMULATING])
def test_accumulation_on_the_batch_axes_equals_single_device(case, reference, corpus):
    """k = 4 microbatches per rank (4 devices, 16 sequences), their gradients summed per device
    and reduced once per step (training/step.py), equal one device's one batch of 16."""
    mesh, *sets = case
    cfg = small_config(mesh, "train.micro_batch_size=1", *sets)  # 2 where tp=2 leaves 2 ranks
    devices = jax.devices()[:4]
    assert build(cfg, build_mesh(cfg.parallel, devices), corpus=corpus).batches(0)["inputs"].shape[0] == 4
    assert_same_run(run_steps(cfg, corpus, devices), reference)


def test_gradient_accumulation_equals_one_big_batch(corpus):
    """k=4 microbatches of 4 give the loss, gradients and update of one batch of 16."""
    big, acc = small_config(), small_config("", "train.micro_batch_size=4")
    mesh = build_mesh(big.parallel, jax.devices()[:1])
    jobs = [build(cfg, mesh, corpus=corpus) for cfg in (big, acc)]
    batches = [job.batches(0) for job in jobs]
    assert batches[0]["inputs"].shape == (1, 16, 32) and batches[1]["inputs"].shape == (4, 4, 32)
    np.testing.assert_array_equal(batches[0]["inputs"].reshape(16, 32), batches[1]["inputs"].reshape(16, 32))
    results = []
    with jax.set_mesh(mesh):
        for job, batch, cfg in zip(jobs, batches, (big, acc)):
            loss, grads, _ = jax.jit(functools.partial(loss_and_grads, graphdef=job.graphdef, cfg=cfg,
                                                    schedule=job.strategies.schedule,
                                                    accumulation=job.strategies.accumulation))(
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


@pytest.mark.parametrize("z_loss", [0.0, 1e-4])
def test_cross_entropy_equals_optax(z_loss):
    """The gather-free loss (model/loss.py) equals optax's integer-label cross-entropy."""
    import optax

    from model.loss import cross_entropy

    keys = jax.random.split(jax.random.key(0))
    logits = 3 * jax.random.normal(keys[0], (3, 7, 50))
    targets = jax.random.randint(keys[1], (3, 7), 0, 50)

    def reference(logits):
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
        return loss + z_loss * jnp.mean(jax.nn.logsumexp(logits, axis=-1) ** 2)

    for got, want in zip(jax.value_and_grad(cross_entropy)(logits, targets, z_loss), jax.value_and_grad(reference)(logits)):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("bad", [np.inf, np.nan], ids=["inf", "nan"])
def test_finite_loss_with_non_finite_gradient_is_skipped(bad, corpus, monkeypatch):
    """A step whose loss is finite but one gradient element is inf (or NaN) keeps the old
    parameters and optimizer state and counts as bad (training/step.py), so the loop's
    NonFiniteGuard, which reads bad_steps, sees it. The NaN-token hook of the resume and
    checkpoint tests makes loss and gradients NaN together; here only the gradient is, so a
    guard that checked the loss alone would apply the update (Adam turns the inf into NaN)."""
    import training.step as step_module

    real = step_module.loss_and_grads

    def poisoned(params, graphdef, batch, cfg, *args):  # the real loss and gradients, one element bad
        loss, grads, stats = real(params, graphdef, batch, cfg, *args)
        leaves, treedef = jax.tree.flatten(grads)
        leaves[-1] = leaves[-1].at[(0,) * leaves[-1].ndim].set(bad)
        return loss, jax.tree.unflatten(treedef, leaves), stats

    monkeypatch.setattr(step_module, "loss_and_grads", poisoned)
    cfg = small_config()
    mesh = build_mesh(cfg.parallel, jax.devices()[:1])
    job = build(cfg, mesh, corpus=corpus)
    before = jax.device_get(job.state)  # before the step, which may donate its input buffers
    with jax.set_mesh(mesh):
        state, metrics = job.step_fn(job.state, job.batches(0))
    after, metrics = jax.device_get((state, metrics))
    assert np.isfinite(metrics["loss"]) and not np.isfinite(metrics["grad_norm"])
    assert (int(after.step), int(after.bad_steps), int(after.skipped)) == (1, 1, 1)
    for old, new in zip(jax.tree.leaves((before.params, before.opt_state)),
                        jax.tree.leaves((after.params, after.opt_state))):
        np.testing.assert_array_equal(new, old)
