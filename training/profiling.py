"""`--profile-steps START:END`: a jax.profiler trace of that window of steps.

The trace goes to RUN_DIR/plugins/profile/<timestamp>/ (the layout TensorBoard's profile
plugin and xprof read), with a Perfetto trace beside it (perfetto_trace.json.gz, Chrome trace
JSON). Named scopes (embedding, attention, mlp, head, optimizer) label the ops;
`python -m tools.trace_summary RUN_DIR` sums them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import jax

from configs.checks import parse_window  # jax-free: train.py checks the window before importing jax

__all__ = ["Profiler", "parse_window"]


class Profiler:
    def __init__(self, window: tuple[int, int] | None, run_dir: Path):
        self.window, self.run_dir, self.active = window, run_dir, False

    def before_step(self, step: int, hlo_text: Callable[[], str]) -> None:
        """At the window's start: write the compiled step's HLO (`hlo_text()`, one more compile,
        or a cache hit) to plugins/profile/train_step.hlo.txt, whose op_name metadata maps the
        trace's op names to scopes, then start tracing."""
        if self.window and step == self.window[0]:
            hlo = self.run_dir / "plugins" / "profile" / "train_step.hlo.txt"
            hlo.parent.mkdir(parents=True, exist_ok=True)
            hlo.write_text(hlo_text())
            # The Perfetto (Chrome trace JSON) copy is what tools/trace_summary.py reads: the
            # .xplane.pb needs xprof/TensorFlow protos to decode.
            jax.profiler.start_trace(str(self.run_dir), create_perfetto_trace=True)
            self.active = True

    def after_step(self, step: int, sync: jax.Array) -> None:
        """Stop after the window's last step, once `sync` (that step's output) is computed."""
        if self.active and step + 1 >= self.window[1]:
            jax.block_until_ready(sync)
            jax.profiler.stop_trace()
            self.active = False
            print(f"profile of steps {self.window[0]}..{self.window[1] - 1} written under {self.run_dir}")

    def close(self) -> None:
        """Stop a trace the loop left inside the window (stopped by a signal or by NaNs), so
        that what was traced is still written."""
        if self.active:
            jax.profiler.stop_trace()
            self.active = False
