"""training/logger.py: metrics.jsonl and TensorBoard event files, and a machine without tensorboardX
(a GPU image with meshtrain installed by `pip install -e . --no-deps`)."""

import json
import sys

from training.logger import MetricsLogger

RECORD = {"step": 1, "loss": 5.5, "tokens_per_s": 1000.0, "step_time_s": 0.1, "lr": 1e-3, "grad_norm": 0.5}


def test_the_logger_writes_jsonl_and_event_files(tmp_path):
    logger = MetricsLogger(tmp_path, total_steps=1)
    logger.log(RECORD)
    logger.close()
    assert [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [RECORD]
    assert list(tmp_path.glob("events.out.tfevents*"))


def test_without_tensorboardx_the_run_writes_jsonl_and_says_so(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tensorboardX", None)  # `import tensorboardX` raises ImportError
    logger = MetricsLogger(tmp_path, total_steps=1)
    logger.log(RECORD)
    logger.log_eval({"step": 1, "eval_loss": 5.0, "eval_ppl": 148.4, "eval_bpb": None, "eval_time_s": 0.2})
    logger.close()
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines[0] == RECORD and lines[1]["eval_loss"] == 5.0
    assert not list(tmp_path.glob("events.out.tfevents*"))
    out = capsys.readouterr().out
    assert "note: tensorboardX is not installed" in out and "pip install tensorboardX" in out
