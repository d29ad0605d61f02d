"""bench/attention.py runs end to end on tiny shapes and writes a complete record (no timing asserted)."""

import json

from bench.attention import main


def test_attention_benchmark_writes_json(tmp_path):
    out_file = tmp_path / "attention.json"
    argv = ["--lengths", "64", "--head-dims", "16", "--heads", "2", "--kv-heads", "1", "--tokens", "64",
            "--masks", "causal", "--steps", "1", "--out", str(out_file)]
    assert main(argv) == 0
    record = json.loads(out_file.read_text())
    rows = {r["core"]: r for r in record["rows"]}
    assert set(rows) == {"pallas", "cudnn", "xla"}
    for core in ("pallas", "xla"):
        assert rows[core]["forward_tflops"] > 0 and rows[core]["forward_backward_tflops"] > 0
    assert "NVIDIA GPU" in rows["cudnn"]["error"]  # the tests run on CPU
    assert record["interpret_mode"] and record["command"].startswith("python -m bench.attention")
