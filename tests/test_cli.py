"""train.py end to end, through a subprocess, as a user runs it."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import SMALL

ROOT = Path(__file__).resolve().parents[1]


def train(*args: str, fake_devices: bool = False) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    if fake_devices:
        env.pop("XLA_FLAGS", None)  # train.py must set the fake device count itself
    sets = [a for s in SMALL for a in ("--set", s)]
    return subprocess.run(
        [sys.executable, "train.py", *sets, *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )


def test_mesh_dp8_tp8_on_fake_devices(tmp_path):
    out = train("--steps", "3", "--mesh", "dp=8,tp=8", "--run-dir", str(tmp_path), fake_devices=True)
    assert out.returncode == 0, out.stderr
    assert "running mesh dp=8,tp=8 on 64 fake host devices" in out.stdout
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["parallel"] == {"stage": 1, "data": 8, "fsdp": 1, "sequence": 1, "tensor": 8,
                                  "tp_impl": "shard_map", "sequence_parallel": False, "tp_overlap": False,
                                  "schedule": "gpipe", "microbatches": 0, "virtual_stages": 1}
    assert config["model"]["d_model"] == 64 and config["train"]["steps"] == 3
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [3]
    for key in ("loss", "tokens_per_s", "step_time_s", "lr", "grad_norm", "tflops_per_device", "mfu"):
        assert key in records[0]
    assert 4.0 < records[0]["loss"] < 6.0 and records[0]["tokens_per_s"] > 0
    assert list(tmp_path.glob("events.out.tfevents*")), "no TensorBoard event file"
    assert "step 3/3" in out.stdout and "tok/s" in out.stdout


def test_log_lines_and_profile_window(tmp_path):
    out = train("--steps", "4", "--set", "train.log_every=1", "--profile-steps", "1:3",
                "--run-dir", str(tmp_path))
    assert out.returncode == 0, out.stderr
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [2, 3, 4]  # step 1 is reported as the compile
    assert list(tmp_path.glob("plugins/profile/*/*.xplane.pb")), "no profiler trace"


@pytest.mark.parametrize(
    "args, message",
    [
        (["--mesh", "dp=2,xp=4"], "axes are pp dp fsdp sp tp"),
        (["--set", "model.n_layer=2"], "did you mean model.n_layers"),
        (["--mesh", "dp=3"], "train.global_batch_size=16 is not divisible by dp*fsdp=3"),
        (["--set", "data.source=text", "--set", "data.path=/no/such/dir"], "data.path"),
        (["--mesh", "dp=2", "--set", "parallel.sequence_parallel=true"], "add tp=2 or more to --mesh"),
    ],
)
def test_bad_input_is_one_clear_line(args, message, tmp_path):
    out = train(*args, "--run-dir", str(tmp_path), fake_devices=True)
    assert out.returncode == 2
    assert message in out.stderr and "Traceback" not in out.stderr
