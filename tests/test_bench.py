"""bench/step.py runs end to end and writes a complete record (figures are not asserted: timing)."""

import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import SMALL

ROOT = Path(__file__).resolve().parents[1]


def test_step_benchmark_writes_json(tmp_path):
    out_file = tmp_path / "step.json"
    sets = [a for s in SMALL for a in ("--set", s)]
    out = subprocess.run(
        [sys.executable, "-m", "bench.step", *sets, "--mesh", "dp=2,tp=2", "--steps", "2",
         "--compile-layers", "1,2", "--out", str(out_file)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
        env={k: v for k, v in os.environ.items() if k != "XLA_FLAGS"},  # bench sets 4 fake devices
    )
    assert out.returncode == 0, out.stderr
    record = json.loads(out_file.read_text())
    assert record["config"]["parallel"]["data"] == 2 and record["config"]["parallel"]["tensor"] == 2
    assert len(record["throughput"]["step_times_s"]) == 2
    assert record["throughput"]["tokens_per_step"] == 16 * 32
    assert [r["n_layers"] for r in record["compile_scaling"]["rows"]] == [1, 2]
    assert record["throughput"]["loss_last"] < record["throughput"]["loss_first"]
