"""Pipeline parallelism (pipeline/): every schedule equals one device.

Loss and every gradient of step 0 against the single-device model of the same depth (fp32;
tolerances of conftest.assert_same_run). Pipeline buffers start as NaN (pipeline.stages.FILL),
so a bubble that leaked into the result would fail these tests. The 1F1B family's head over the
stages runs where p divides the vocabulary's rows and where it does not (vocab 258). The matrix covers p = 2 and
p = 4 and M = p and M = 2p (and for gpipe M = 1.5p, its heads' share padded); the interleaved schedules and zbv with V=2; remat full (and dots) for the
1F1B family, gpipe and interleaved (their head a microbatch at a time); sequence parallelism on pp=2,fsdp=2,tp=2 (gpipe with GSPMD TP, 1f1b, zb-h1,
interleaved with the overlap rings); interleaved-1f1b with GSPMD TP. Five optimizer steps of
every schedule on pp=2,dp=2,tp=2 (the explicit shard_map TP regions nested in the stage
program; their step 0 loss and gradients too) give the single-device losses.
"""

import functools

import jax
import numpy as np
import pytest

from conftest import assert_same_run, pipeline_devices as _devices, run_steps, small_config, start
from sharding.mesh import build_mesh
from training.step import loss_and_grads


def _loss_and_grads(cfg, corpus):
    mesh = build_mesh(cfg.parallel, _devices(cfg))
    job = start(cfg, mesh, corpus)
    with jax.set_mesh(mesh):
        fn = jax.jit(functools.partial(loss_and_grads, graphdef=job.graphdef, cfg=cfg,
                                       schedule=job.strategies.schedule))
        loss, grads, _ = fn(job.state.params, batch=job.batches(0))
        return jax.device_get((loss, grads))


_REFERENCES: dict[tuple[int, int], tuple] = {}


def _reference(layers: int, batch: int, corpus, vocab: int = 256):
    if (layers, batch, vocab) not in _REFERENCES:
        _REFERENCES[layers, batch, vocab] = _loss_and_grads(
            small_config("", f"model.n_layers={layers}", f"train.global_batch_size={batch}",
                         f"model.vocab_size={vocab}"), corpus)
    return _REFERENCES[layers, batch, vocab]


CASES = {  # id: (mesh, overrides)
    "gpipe-p2-m4": ("pp=2", ["parallel.microbatches=4"]),
    "gpipe-p4-m4": ("pp=4", ["parallel.microbatches=4"]),
    "interleaved-p2-m4-v2": ("pp=2", ["parallel.schedule=interleaved", "parallel.virtual_stages=2", "parallel.microbatches=4"]),
    "interleaved-p4-m4-v2": ("pp=4", ["parallel.schedule=interleaved", "parallel.virtual_stages=2", "parallel.microbatches=4"]),
    # under a remat policy the head runs one microbatch at a time, recomputed (pipeline.circular.head_loss)
    "gpipe-pp2-dp2-tp2-m4-full": ("pp=2,dp=2,tp=2", ["parallel.microbatches=4", "model.remat=full"]),
    "interleaved-pp2-dp2-m4-v2-dots": ("pp=2,dp=2", ["parallel.schedule=interleaved", "parallel.virtual_stages=2",
                                                      "parallel.microbatches=4", "model.remat=dots"]),
    # M not a multiple of p: the outputs dealt to the heads padded (pipeline.circular.dealt),
    # stage 3 of pp=4 given none of the 6; all at once (remat none) and a scan (full)
    "gpipe-p4-m6-padded": ("pp=4", ["parallel.microbatches=6", "train.global_batch_size=12"]),
    "gpipe-p2-m3-full-padded": ("pp=2", ["parallel.microbatches=3", "train.global_batch_size=12", "model.remat=full"]),
    "1f1b-p2-m4": ("pp=2", ["parallel.schedule=1f1b", "parallel.microbatches=4"]),
    "1f1b-p4-m4": ("pp=4", ["parallel.schedule=1f1b", "parallel.microbatches=4"]),
    "1f1b-p2-m2-full": ("pp=2", ["parallel.schedule=1f1b", "parallel.microbatches=2", "model.remat=full"]),
    "1f1b-p4-m8-dots": ("pp=4", ["parallel.schedule=1f1b", "parallel.microbatches=8", "model.remat=dots"]),
    "zb-h1-p2-m4": ("pp=2", ["parallel.schedule=zb-h1", "parallel.microbatches=4"]),
    "zb-h1-p4-m8-full": ("pp=4", ["parallel.schedule=zb-h1", "parallel.microbatches=8", "model.remat=full"]),
    "interleaved-1f1b-pp2-dp2-tp2-gspmd": ("pp=2,dp=2,tp=2", ["parallel.schedule=interleaved-1f1b", "parallel.virtual_stages=2", "parallel.tp_impl=gspmd"]),
    "zb-h1-pp2-fsdp2-tp2-sp": ("pp=2,fsdp=2,tp=2", ["parallel.schedule=zb-h1", "parallel.sequence_parallel=true"]),
    "interleaved-1f1b-p2-m4-v2": ("pp=2", ["parallel.schedule=interleaved-1f1b", "parallel.virtual_stages=2", "parallel.microbatches=4"]),
    "interleaved-1f1b-p4-m8-v2": ("pp=4", ["parallel.schedule=interleaved-1f1b", "parallel.virtual_stages=2", "parallel.microbatches=8"]),
    "gpipe-pp2-fsdp2-tp2-sp-gspmd": ("pp=2,fsdp=2,tp=2", ["parallel.tp_impl=gspmd", "parallel.sequence_parallel=true"]),
    "1f1b-pp2-fsdp2-tp2-sp": ("pp=2,fsdp=2,tp=2", ["parallel.schedule=1f1b", "parallel.sequence_parallel=true"]),
    "zbv-p2-m4": ("pp=2", ["parallel.schedule=zbv", "parallel.virtual_stages=2", "parallel.microbatches=4"]),
    "zbv-pp2-fsdp2-tp2-sp": ("pp=2,fsdp=2,tp=2", ["parallel.schedule=zbv", "parallel.virtual_stages=2", "parallel.sequence_parallel=true"]),
    "zbv-p4-m4-full": ("pp=4", ["parallel.schedule=zbv", "parallel.virtual_stages=2", "parallel.microbatches=4", "model.remat=full"]),
    # the head over the stages (pipeline/head.py) where p does not divide a tensor rank's 129 or
    # the 258 rows: stage 3 takes columns stage 2 takes too, counted on stage 2 alone
    "1f1b-pp4-tp2-m4-vocab258": ("pp=4,tp=2", ["parallel.schedule=1f1b", "parallel.microbatches=4",
                                               "model.vocab_size=258"]),
    "zbv-p4-m4-vocab258": ("pp=4", ["parallel.schedule=zbv", "parallel.virtual_stages=2", "parallel.microbatches=4",
                                    "model.vocab_size=258"]),
    "interleaved-pp2-fsdp2-tp2-sp-overlap": ("pp=2,fsdp=2,tp=2", ["parallel.schedule=interleaved", "parallel.virtual_stages=2", "parallel.sequence_parallel=true", "parallel.tp_overlap=true"]),
}


@pytest.mark.parametrize("case", CASES)
def test_schedule_equals_single_device(case, corpus):
    mesh, overrides = CASES[case]
    eight = ("interleaved-p4-m4-v2", "interleaved-1f1b-p4-m8-v2", "zbv-p4-m4-full", "zbv-p4-m4-vocab258")
    layers = 8 if case in eight else 4
    cfg = small_config(mesh, f"model.n_layers={layers}", *overrides)
    loss, grads = _loss_and_grads(cfg, corpus)
    ref_loss, ref_grads = _reference(layers, cfg.train.global_batch_size, corpus, cfg.model.vocab_size)
    np.testing.assert_allclose(loss, ref_loss, rtol=2e-5)
    flat_ref = jax.tree_util.tree_leaves_with_path(ref_grads)
    assert len(flat_ref) == len(jax.tree.leaves(grads))
    for (path, want), got in zip(flat_ref, jax.tree.leaves(grads)):
        np.testing.assert_allclose(got, want, atol=1e-6, rtol=1e-4, err_msg=jax.tree_util.keystr(path))


@pytest.fixture(scope="module")
def reference4(corpus):
    """run_steps of the small config with 4 layers on one device (the interleaved schedules
    need pp·V = 4 layers)."""
    return run_steps(small_config("", "model.n_layers=4"), corpus, devices=jax.devices()[:1])


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved", "interleaved-1f1b", "zb-h1", "zbv"])
def test_pipelined_training_equals_single_device(schedule, reference, reference4, corpus):
    """Five optimizer steps on pp=2,dp=2,tp=2 (the stage-sharded gradients through the update)
    give the single-device losses."""
    if schedule.startswith("interleaved") or schedule == "zbv":
        cfg = small_config("pp=2,dp=2,tp=2", f"parallel.schedule={schedule}", "parallel.virtual_stages=2",
                           "model.n_layers=4")
        assert_same_run(run_steps(cfg, corpus, _devices(cfg)), reference4)
    else:
        cfg = small_config("pp=2,dp=2,tp=2", f"parallel.schedule={schedule}")
        assert_same_run(run_steps(cfg, corpus, _devices(cfg)), reference)


def test_gpipe_sums_layer_gradients_in_fp32_as_1f1b(corpus):
    """In bf16 every schedule computes a tick's layer gradients in the bf16 matmuls; gpipe sums
    them over the ticks in fp32, as the 1F1B family's accumulators do (pipeline.circular's
    `_objective`), so at M = 16 the two schedules' layer gradients agree to 1e-3 (the norm of the
    difference over the norm). Summed in bf16 (the tick scan's transpose in the weights' dtype)
    gpipe's differ from 1f1b's by 4.3e-3 (2.4e-3 at M = 4, 3.1e-3 at M = 8; 3.9e-3 to 4.5e-3 per
    weight on jax 0.12, 2026-12-06). In fp32 they differ only where the head's input gradient
    (1f1b: its vocabulary columns summed over stage, pipeline/head.py; gpipe: one matmul) rounds
    to a different bf16 value: 0 on jax 0.10.2; on jax 0.12 below 1e-5 on the machines before,
    8.7e-5 (at most 2.3e-4 per weight) on an AVX2-only 2-core one (2026-12-06), where the same
    packages' XLA CPU rounds some of those matmul outputs the other way."""
    blocks = {}
    for schedule in ("gpipe", "1f1b"):
        cfg = small_config("pp=2", f"parallel.schedule={schedule}", "parallel.microbatches=16",
                           "train.global_batch_size=32", "model.compute_dtype=bfloat16")
        blocks[schedule] = np.concatenate([np.ravel(g) for g in jax.tree.leaves(_loss_and_grads(cfg, corpus)[1]["blocks"])])
    gpipe, one_f = blocks["gpipe"], blocks["1f1b"]
    assert np.linalg.norm(gpipe - one_f) / np.linalg.norm(one_f) < 1e-3
