"""SIGTERM and SIGINT: finish the current step, checkpoint, exit 0.

While training, both signals only set a flag; the loop reads it after each step, writes a
checkpoint and stops. A second signal raises KeyboardInterrupt (exit 130, no checkpoint) for
a user who does not want to wait. With several processes the flag is agreed on by all of them
after every step (`process_allgather` of one int: a tiny collective, and a host wait for that
step) so that all stop at the same step and write the checkpoint together.
"""

from __future__ import annotations

import signal
from types import FrameType

import jax
import numpy as np
from jax.experimental import multihost_utils

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopSignals:
    """Context manager: SIGTERM/SIGINT handlers that request a clean stop."""

    def __init__(self) -> None:
        self.received: str | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> "StopSignals":
        self._previous = {s: signal.signal(s, self._handle) for s in SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received:
            raise KeyboardInterrupt
        self.received = signal.Signals(signum).name

    def requested(self) -> bool:
        """Whether any process received a stop signal (the same answer on every process)."""
        if jax.process_count() == 1:
            return self.received is not None
        flags = multihost_utils.process_allgather(np.int32(self.received is not None))
        if flags.any() and not self.received:
            self.received = "a signal to another process"
        return bool(flags.any())
