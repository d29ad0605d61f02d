"""FLOPs, TFLOP/s per device, MFU, device memory, and the step time over a log interval.

FLOPs are counted explicitly (model FLOPs, the MFU convention: remat recompute not counted):
  matmul   6 * P_matmul per token (forward 2, backward 4), P_matmul = every weight that is
           multiplied (the embedding lookup is a gather, not a matmul; the head is counted)
  attention per layer and token: scores q.k and probs.v, 2 * 2 * L * N * H forward, halved for
           the causal mask (only the useful lower triangle), times 3 for forward + backward
MFU = achieved FLOP/s per device / the device's dense bf16 peak (table below; None elsewhere).
The step time is the mean over a log interval (`IntervalTimer`): the host waits for the device
only at log steps, so single steps are not timed.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from configs.base import ModelConfig

if TYPE_CHECKING:  # jax-free at import: tools/estimate.py plans without jax
    import jax

# Dense bf16 peak FLOP/s, matched against jax's device_kind (SXM parts).
PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12}


def matmul_params(m: ModelConfig) -> int:
    d, n, k, h, f = m.d_model, m.n_heads, m.n_kv_heads, m.head_dim, m.d_ff
    per_layer = d * n * h + 2 * d * k * h + n * h * d + 3 * d * f
    return m.n_layers * per_layer + d * m.vocab_size


def flops_per_token(m: ModelConfig, seq_len: int) -> float:
    """Training FLOPs (forward + backward) per token."""
    attention = m.n_layers * 4 * seq_len * m.n_heads * m.head_dim / 2  # causal: half of L x L
    return 6 * matmul_params(m) + 3 * attention


def peak_flops(device: jax.Device) -> float | None:
    kind = device.device_kind.upper()
    return next((v for k, v in PEAK_FLOPS.items() if k in kind), None)


def step_figures(m: ModelConfig, seq_len: int, tokens_per_step: int, step_time_s: float,
                 n_devices: int, device: jax.Device) -> dict:
    """tokens/s, TFLOP/s per device and MFU (None when the peak of `device` is unknown)."""
    per_device = flops_per_token(m, seq_len) * tokens_per_step / step_time_s / n_devices
    peak = peak_flops(device)
    return {
        "tokens_per_s": tokens_per_step / step_time_s,
        "tflops_per_device": per_device / 1e12,
        "mfu": per_device / peak if peak else None,
    }


def peak_memory_bytes(device: jax.Device) -> int | None:
    """Peak bytes in use on `device` so far (None where the backend does not report it)."""
    stats = device.memory_stats() or {}
    return stats.get("peak_bytes_in_use")


class IntervalTimer:
    """Mean seconds per step between laps: call `lap(step)` once the device has finished `step`
    (the loop waits for it at log steps); the first lap, from the start, holds the compile."""

    def __init__(self, step: int) -> None:
        self.step, self.start = step, time.perf_counter()

    def lap(self, step: int) -> float:
        """Seconds per step since the previous lap (or the start), which was at `self.step`."""
        now = time.perf_counter()
        seconds = (now - self.start) / (step - self.step)
        self.step, self.start = step, now
        return seconds
