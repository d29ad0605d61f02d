"""`--profile-steps START:END`: a jax.profiler trace of that window of steps.

The trace goes to RUN_DIR/plugins/profile/<timestamp>/ (the layout TensorBoard's profile
plugin and xprof read). Named scopes (embedding, attention, mlp, head) label the ops.
"""

from __future__ import annotations

from pathlib import Path

import jax

from configs.base import ConfigError


def parse_window(text: str) -> tuple[int, int] | None:
    """'5:8' -> (5, 8): trace steps 5, 6 and 7. '' -> None."""
    if not text:
        return None
    start, sep, end = text.partition(":")
    try:
        window = int(start), int(end)
    except ValueError:
        window = None
    if not sep or window is None or not 0 <= window[0] < window[1]:
        raise ConfigError(f"--profile-steps {text!r}: expected START:END with 0 <= START < END, e.g. 5:8")
    return window


class Profiler:
    def __init__(self, window: tuple[int, int] | None, run_dir: Path):
        self.window, self.run_dir, self.active = window, run_dir, False

    def before_step(self, step: int) -> None:
        if self.window and step == self.window[0]:
            jax.profiler.start_trace(str(self.run_dir))
            self.active = True

    def after_step(self, step: int, sync: jax.Array) -> None:
        """Stop after the window's last step, once `sync` (that step's output) is computed."""
        if self.active and step + 1 >= self.window[1]:
            jax.block_until_ready(sync)
            jax.profiler.stop_trace()
            self.active = False
            print(f"profile of steps {self.window[0]}..{self.window[1] - 1} written under {self.run_dir}")
