"""training/evaluate.py: held-out loss, the same on every mesh, logged by the loop."""

import json
import math

import jax
import numpy as np
import pytest

from conftest import small_config
from sharding.mesh import build_mesh
from training.build import build, make_program
from training.evaluate import evaluate
from training.loop import train

EVAL = ("train.eval_every=2", "train.eval_batches=2")


@pytest.fixture(scope="module")
def single(corpus):
    """The figures and the job of the untrained small config on one device."""
    cfg = small_config("", *EVAL)
    job = build(cfg, build_mesh(cfg.parallel, jax.devices()[:1]), corpus=corpus)
    with jax.set_mesh(job.mesh):
        return evaluate(job.eval_fn, job.state.params, job.eval_batches, 2, cfg.data.source), job


def test_eval_reads_only_the_held_out_part(single, corpus):
    _, job = single
    assert job.batches.tokens is corpus.train and job.eval_batches.tokens is corpus.eval


def test_eval_figures_and_repeat(single):
    figures, job = single
    assert 5.0 < figures["eval_loss"] < 6.0  # untrained: near ln 256 = 5.55
    assert figures["eval_ppl"] == pytest.approx(math.exp(figures["eval_loss"]))
    assert figures["eval_bpb"] == pytest.approx(figures["eval_loss"] / math.log(2))
    with jax.set_mesh(job.mesh):
        again = evaluate(job.eval_fn, job.state.params, job.eval_batches, 2, "stdlib")
    assert again["eval_loss"] == figures["eval_loss"]  # the same windows, the same program
    with jax.set_mesh(job.mesh):
        assert evaluate(job.eval_fn, job.state.params, job.eval_batches, 2, "tokens")["eval_bpb"] is None


@pytest.mark.parametrize("mesh, schedule", [("fsdp=2,tp=2", "gpipe"), ("pp=2,dp=2", "gpipe"), ("pp=2,dp=2", "1f1b"),
                                              ("pp=2,fsdp=2", "zb-h1"), ("pp=2,sp=2", "gpipe")])
def test_eval_loss_same_on_every_mesh(mesh, schedule, single, corpus):
    """Within conftest.assert_same_run's loss tolerance (fp32 compute; reduction order only).
    pp=2 runs the GPipe forward of pipeline/circular.py (the batch as 2 microbatches), whatever
    the training schedule."""
    cfg = small_config(mesh, *EVAL, f"parallel.schedule={schedule}")
    sharded = build_mesh(cfg.parallel, jax.devices()[:4])
    program = make_program(cfg, sharded)
    params = jax.device_put(single[1].state.params, program.shardings.params)  # the same parameters, resharded
    with jax.set_mesh(sharded):
        figures = evaluate(program.eval_fn, params, program.held_out(corpus.eval), 2, cfg.data.source)
    np.testing.assert_allclose(figures["eval_loss"], single[0]["eval_loss"], rtol=2e-5)


def test_loop_evaluates_every_n_steps_and_at_the_end(corpus, tmp_path):
    cfg = small_config("", *EVAL)
    job = build(cfg, build_mesh(cfg.parallel, jax.devices()[:1]), corpus=corpus)
    records = train(job, tmp_path)
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in lines if "eval_loss" in r]
    assert [r["step"] for r in evals] == [2, 4, 5]
    assert set(evals[0]) == {"step", "eval_loss", "eval_ppl", "eval_bpb", "eval_time_s"}
    assert all("loss" in r for r in records) and len(lines) == len(records) + 3
    assert evals[-1]["eval_loss"] < evals[0]["eval_loss"]  # it learns something that carries over
    with jax.set_mesh(job.mesh):  # the final state scores the same afterwards
        assert evaluate(job.eval_fn, job.state.params, job.eval_batches, 2, "stdlib")["eval_loss"] == \
            evals[-1]["eval_loss"]
