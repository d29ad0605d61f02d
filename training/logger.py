"""Where metrics go: a console line per log step, metrics.jsonl, TensorBoard event files.

Only process 0 writes. metrics.jsonl holds one JSON object per log step (step, loss,
tokens_per_s, step_time_s, lr, grad_norm, tflops_per_device, mfu, ...) and one per evaluation
(step, eval_loss, eval_ppl, eval_bpb, eval_time_s: no `loss` key, so a script tells the two
kinds apart), so runs can be read by scripts; the same scalars go to TensorBoard (tensorboardX,
no TensorFlow needed), under train/ and eval/. tensorboardX is a dependency, but a GPU image
with meshtrain installed by `pip install -e . --no-deps` may lack it (the H200 image of
2026-11-26 did): the run then writes metrics.jsonl alone and says so in one note.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import jax


def say(message: str) -> None:
    """One line on the console from process 0 (the others stay quiet)."""
    if jax.process_index() == 0:
        print(message, flush=True)


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class MetricsLogger:
    def __init__(self, run_dir: Path, total_steps: int, first_step: int = 0):
        self.total, self.first = total_steps, first_step  # a resumed run starts at first_step
        self.started = time.perf_counter()
        self.enabled = jax.process_index() == 0
        self.tb = None
        if self.enabled:
            self.jsonl = open(run_dir / "metrics.jsonl", "a")
            try:
                from tensorboardX import SummaryWriter
            except ImportError:
                say("note: tensorboardX is not installed, so this run writes no TensorBoard event files "
                    "(metrics.jsonl holds every figure); pip install tensorboardX to have them")
            else:
                self.tb = SummaryWriter(str(run_dir))

    def log(self, record: dict) -> None:
        """Write one log step's record (must hold step, loss, tokens_per_s, step_time_s, lr, grad_norm)."""
        if not self.enabled:
            return
        self.jsonl.write(json.dumps(record) + "\n")
        self.jsonl.flush()
        for key, value in record.items():
            if self.tb and key != "step" and isinstance(value, (int, float)) and math.isfinite(value):
                self.tb.add_scalar(f"train/{key}", value, record["step"])
        print(self.line(record), flush=True)

    def log_eval(self, record: dict) -> None:
        """Write one evaluation's record (training/evaluate.py: step, eval_loss, eval_ppl, eval_bpb)."""
        if not self.enabled:
            return
        self.jsonl.write(json.dumps(record) + "\n")
        self.jsonl.flush()
        for key in ("eval_loss", "eval_ppl", "eval_bpb"):
            if self.tb and record[key] is not None and math.isfinite(record[key]):
                self.tb.add_scalar(f"eval/{key.removeprefix('eval_')}", record[key], record["step"])
        bpb = f" | {record['eval_bpb']:.3f} bits/byte" if record["eval_bpb"] is not None else ""
        print(f"eval {record['step']:>{len(str(self.total))}}/{self.total} | held-out loss {record['eval_loss']:.4f} | "
              f"ppl {record['eval_ppl']:.2f}{bpb} | {record['eval_time_s']:.1f} s", flush=True)

    def line(self, r: dict) -> str:
        step, done = r["step"], r["step"] / self.total
        elapsed = time.perf_counter() - self.started
        remaining = (self.total - step) / (step - self.first) if step > self.first else 0.0
        eta = elapsed * remaining
        parts = [
            f"step {step:>{len(str(self.total))}}/{self.total} {done:4.0%}",
            f"loss {r['loss']:.4f}",
            f"{r['tokens_per_s']:,.0f} tok/s",
            f"{r['step_time_s'] * 1e3:.1f} ms/step",
            f"lr {r['lr']:.2e}",
            f"gnorm {r['grad_norm']:.3f}",
        ]
        if "checkpoint_s" in r:  # a save started in this interval (not in its step time: training/loop.py)
            parts.append(f"ckpt {r['checkpoint_s']:.1f} s")
        if "moe_aux" in r:  # router statistics, per MoE layer (model/moe.py)
            parts.append(f"moe aux {r['moe_aux']:.3f} load {r['moe_load']:.2f} dropped {r['moe_dropped']:.1%}")
        if r.get("skipped"):
            parts.append(f"skipped {r['skipped']} non-finite")
        if r.get("mfu") is not None:
            parts.append(f"{r['tflops_per_device']:.1f} TFLOP/s/dev MFU {r['mfu']:.1%}")
        parts.append(f"eta {_duration(eta)}")
        return " | ".join(parts)

    def close(self) -> None:
        if self.enabled:
            self.jsonl.close()
            if self.tb:
                self.tb.close()
