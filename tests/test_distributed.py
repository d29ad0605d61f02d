"""Two processes x 4 fake CPU devices (gloo, 127.0.0.1) train like one process with 8 devices.

The two-process run (dp=2,fsdp=2,tp=2; each process loads only its rows of the batch) checkpoints
at steps 5 and 8; its losses must equal the one-process run's. Then the checkpoint of step 5,
written by two processes, is resumed by one process, which must reach the same losses again.
"""

import argparse
import re
import shutil
import socket
import subprocess
from pathlib import Path

import numpy as np
import pytest

from configs import ConfigError
from conftest import child_env, logged_losses, small_config, train_argv
from sharding.mesh import build_mesh
from training.build import build
from training.checkpoint import Checkpointer
from training.distributed import process_count
from training.loop import train

ROOT = Path(__file__).resolve().parents[1]
MESH = "dp=2,fsdp=2,tp=2"
SETS = ("train.steps=8", "train.log_every=1", "train.checkpoint_every=5")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("two-processes")
    env = child_env()  # train.py asks for 4 devices each
    coordinator = f"127.0.0.1:{free_port()}"
    sets = [a for s in SETS for a in ("--set", s)]
    procs = [
        subprocess.Popen(
            train_argv("--mesh", MESH, *sets, "--run-dir", str(run_dir), "--coordinator", coordinator,
                       "--num-processes", "2", "--process-id", str(i)),
            cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        )
        for i in range(2)
    ]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out
    assert "on 4 fake host devices per process (2 process(es))" in outs[0]
    return run_dir


def one_process(run_dir: Path, resume: bool) -> dict[int, float]:
    """Train (or resume) the same config in this process on 8 devices; {step: loss}."""
    cfg = small_config(MESH, *SETS)
    checkpoints = Checkpointer(run_dir / "checkpoints", cfg) if resume else None
    job = build(cfg, build_mesh(cfg.parallel), restore=checkpoints.restore_latest if resume else None)
    try:
        return {r["step"]: r["loss"] for r in train(job, run_dir)}
    finally:
        if checkpoints:
            checkpoints.close()


def test_two_processes_equal_one_and_resume_across_the_boundary(two_processes, tmp_path, capsys):
    reference = one_process(tmp_path, resume=False)
    losses = logged_losses(two_processes)
    assert sorted(losses) == list(range(2, 9))
    np.testing.assert_allclose([losses[s] for s in losses], [reference[s] for s in losses], rtol=1e-6)
    assert all(p.name.isdigit() for p in (two_processes / "checkpoints").iterdir())

    resumed_dir = tmp_path / "resumed"
    shutil.copytree(two_processes / "checkpoints", resumed_dir / "checkpoints")
    shutil.rmtree(resumed_dir / "checkpoints" / "8")
    resumed = one_process(resumed_dir, resume=True)
    assert "(step 5)" in capsys.readouterr().out and sorted(resumed) == [7, 8]
    np.testing.assert_allclose([resumed[s] for s in (7, 8)], [reference[s] for s in (7, 8)], rtol=1e-6)


@pytest.mark.parametrize("coordinator, processes, message", [
    ("nocolon", 2, "--coordinator 'nocolon': expected HOST:PORT"),
    ("host:port", 2, "--coordinator 'host:port': expected HOST:PORT"),
    (":1234", 2, "--coordinator ':1234': expected HOST:PORT"),
    ("host:1234", 0, "--num-processes 0: must be >= 1"),
])
def test_bad_process_flags_are_refused_before_jax(coordinator, processes, message):
    args = argparse.Namespace(coordinator=coordinator, num_processes=processes, process_id=0)
    with pytest.raises(ConfigError, match=re.escape(message)):
        process_count(args)


def test_several_processes_without_a_run_dir_are_refused():
    """Each process would name its own default run directory (its start time), so the
    checkpoints, which all processes write together, would have no common folder."""
    from conftest import run_module

    out = run_module("train", "--coordinator", "127.0.0.1:1234", "--num-processes", "2", "--process-id", "0")
    assert out.returncode == 2 and out.stderr.strip() == (
        "error: a run of 2 processes needs --run-dir: each would name its own default (runs/NAME-<its start "
        "time>), and the checkpoints are one directory they all write; give a folder they share, e.g. "
        "--run-dir runs/tiny")


SLURM = {"SLURM_NTASKS": "2", "SLURM_PROCID": "1", "SLURM_LOCALID": "0", "SLURM_JOB_ID": "77",
         "SLURM_STEP_NODELIST": "node[1-2]"}
NO_FLAGS = argparse.Namespace(coordinator=None, num_processes=None, process_id=None)


def slurm_env(monkeypatch, env: dict[str, str]) -> None:
    """Exactly `env` of SLURM's variables (restored after the test, with any initialize sets)."""
    for name in [*SLURM, "SLURM_JOB_NODELIST"]:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)


@pytest.mark.parametrize("env, message", [
    ({"SLURM_NTASKS": "abc"}, "SLURM_NTASKS='abc' is not a positive integer; run under srun, or pass --coordinator"),
    ({"SLURM_NTASKS": "2"}, ("SLURM_NTASKS=2 asks for 2 processes, but the environment has missing SLURM_PROCID, "
                             "SLURM_LOCALID, SLURM_JOB_ID, SLURM_STEP_NODELIST")),
    (SLURM | {"SLURM_PROCID": "one"}, "has non-integer SLURM_PROCID='one'"),
])
def test_a_partial_or_bad_slurm_environment_is_refused_before_jax(monkeypatch, env, message):
    slurm_env(monkeypatch, env)
    with pytest.raises(ConfigError, match=re.escape(message)):
        process_count(NO_FLAGS)


def test_slurm_counts_its_tasks_and_initialize_says_whom_it_waits_for(monkeypatch, capsys):
    """A full SLURM set (the job's node list in place of the step's, as under sbatch) is 2 processes;
    initialize names them and the coordinator before it blocks (jax's initialize stubbed)."""
    import jax

    from training.distributed import initialize

    slurm_env(monkeypatch, {k: v for k, v in SLURM.items() if k != "SLURM_STEP_NODELIST"}
              | {"SLURM_JOB_NODELIST": "node[1-2]"})
    monkeypatch.setattr(jax.config, "update", lambda *a: None)
    monkeypatch.setattr(jax.distributed, "initialize", lambda *a, **k: None)
    assert process_count(NO_FLAGS) == 2
    initialize(NO_FLAGS)
    assert capsys.readouterr().err == ("waiting for 2 processes at the first node of node[1-2] (SLURM job 77) "
                                       "(process 1; without them jax aborts this one after 300 s)\n")
    initialize(argparse.Namespace(coordinator="host:1234", num_processes=2, process_id=0))
    assert capsys.readouterr().err == ("waiting for 2 processes at host:1234 (process 0; without them jax aborts "
                                       "this one after 300 s)\n")
