"""Killed and stopped runs of train.py resume to the uninterrupted run's losses (bit-exact on CPU).

Every run here has the same config (train.steps=12, so the same learning-rate schedule),
checkpoints every 2 steps and logs every step; a resumed run reports its first step as the
compile, so the losses compared are those both runs logged.
"""

import os
import signal
import subprocess
from pathlib import Path
from typing import Callable

import pytest

from conftest import logged_losses, train_argv

ROOT = Path(__file__).resolve().parents[1]
ARGS = ("--steps", "12", "--set", "train.log_every=1", "--set", "train.checkpoint_every=2")


def start(run_dir: Path, *args: str, **env: str) -> subprocess.Popen:
    return subprocess.Popen(
        train_argv(*ARGS, "--run-dir", str(run_dir), *args), cwd=ROOT, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ, **env},
    )


def wait_for(proc: subprocess.Popen, done: Callable[[str], bool], what: str) -> None:
    """Read the process's output line by line until `done(line)`."""
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if done(line):
            return
    proc.wait()
    pytest.fail(f"exit {proc.returncode} before {what}:\n{''.join(seen)}")


def finish(proc: subprocess.Popen) -> str:
    return proc.communicate(timeout=600)[0]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[int, float]:
    run_dir = tmp_path_factory.mktemp("uninterrupted")
    proc = start(run_dir)
    out = finish(proc)
    assert proc.returncode == 0, out
    return logged_losses(run_dir)


def assert_same_losses(run_dir: Path, reference: dict[int, float], since: int) -> None:
    losses = {s: v for s, v in logged_losses(run_dir).items() if s > since}
    assert losses, "the resumed run logged nothing"
    assert losses == {s: reference[s] for s in losses}  # bit-exact


def test_kill9_mid_run_and_mid_checkpoint_write_then_resume(reference, tmp_path):
    # 1. kill -9 from outside while training, once a first checkpoint is complete.
    checkpoints = tmp_path / "checkpoints"
    proc = start(tmp_path)
    wait_for(proc, lambda _: any(p.name.isdigit() for p in checkpoints.glob("*")), "a checkpoint")
    proc.kill()
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    # 2. resume; the process kills itself while the checkpoint of step 10 is being written.
    proc = start(tmp_path, MESHTRAIN_TEST_KILL_IN_SAVE="10")
    out = finish(proc)
    assert proc.returncode == -signal.SIGKILL, out
    assert "resumed from" in out
    assert (checkpoints / "10.orbax-checkpoint-tmp").is_dir() and not (checkpoints / "10").exists()
    # 3. resume again: the cut-off checkpoint is reported and skipped, step 8 is the latest complete.
    proc = start(tmp_path)
    out = finish(proc)
    assert proc.returncode == 0, out
    assert "checkpoint 10.orbax-checkpoint-tmp was cut off mid-write" in out
    assert f"resumed from {checkpoints.resolve() / '8'} (step 8)" in out
    assert_same_losses(tmp_path, reference, since=9)
    assert sorted(int(p.name) for p in checkpoints.iterdir() if p.name.isdigit()) == [8, 10, 12]


def test_sigterm_writes_a_checkpoint_and_exits_0(reference, tmp_path):
    proc = start(tmp_path)
    wait_for(proc, lambda line: line.startswith("step  3/12"), "step 3")
    proc.send_signal(signal.SIGTERM)
    out = finish(proc)
    assert proc.returncode == 0, out
    line = next(ln for ln in out.splitlines() if ln.startswith("stopped by SIGTERM after step"))
    step = int(line.split("after step ")[1].split(":")[0])
    assert line.endswith(f"checkpoint written to {(tmp_path / 'checkpoints').resolve() / str(step)}")
    assert (tmp_path / "checkpoints" / str(step) / "state").is_dir()
    # the stopped run resumes from there to the uninterrupted losses
    proc = start(tmp_path)
    out = finish(proc)
    assert proc.returncode == 0 and f"(step {step})" in out, out
    assert_same_losses(tmp_path, reference, since=step + 1)
