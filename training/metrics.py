"""FLOPs, TFLOP/s per device, MFU, device memory, and the step time over a log interval.

FLOPs are counted explicitly (model FLOPs, the MFU convention: remat recompute not counted):
  matmul   6 * P_matmul per token (forward 2, backward 4), P_matmul = every weight that is
           multiplied (the embedding lookup is a gather, not a matmul; the head is counted).
           Mixture of experts (model.n_experts > 0): the ACTIVE weights only, what one token
           multiplies: in each of the X/moe_every MoE layers (the last of each group of
           moe_every) the router D·E, k of the E experts 3·D·F_e and the shared experts
           3·D·n_shared·F_e instead of the dense MLP; the attention as in a dense layer
  attention per layer and token: scores q.k and probs.v, 2 * 2 * L * N * H forward, halved for
           the causal mask (only the useful lower triangle), times 3 for forward + backward
MFU = achieved FLOP/s per device / the device's dense bf16 peak (table below; None elsewhere).
`param_counts` gives (total, active) parameters, every one (embedding, head, norms) included:
Mixtral 8x7B's published 46.7B total and 12.9B active (tests/test_moe_plan.py).
The step time is the mean over a log interval (`IntervalTimer`): the host waits for the device
only at log steps, so single steps are not timed.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from configs.base import ModelConfig
from sharding.checks import expert_d_ff, moe_layers

if TYPE_CHECKING:  # jax-free at import: tools/roofline.py plans without jax
    import jax

# Dense bf16 peak FLOP/s, matched against jax's device_kind (SXM parts).
PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12}


def attention_params(m: ModelConfig) -> int:
    """wq, wk, wv, wo of one layer."""
    d, n, k, h = m.d_model, m.n_heads, m.n_kv_heads, m.head_dim
    return d * n * h + 2 * d * k * h + n * h * d


def moe_ffn_params(m: ModelConfig, active: bool) -> int:
    """The FFN of one MoE layer: router, the routed experts (k of them when `active`, else E)
    and the shared experts."""
    d, fe = m.d_model, expert_d_ff(m)
    experts = m.experts_per_token if active else m.n_experts
    return d * m.n_experts + experts * 3 * d * fe + 3 * d * m.n_shared_experts * fe


def matmul_params(m: ModelConfig) -> int:
    """Active matmul weights (module docstring): every layer's attention, the dense layers'
    MLP, the MoE layers' router + k experts + shared experts, and the head."""
    x_moe = moe_layers(m)
    dense = (m.n_layers - x_moe) * 3 * m.d_model * m.d_ff
    moe = x_moe * moe_ffn_params(m, active=True)
    return m.n_layers * attention_params(m) + dense + moe + m.d_model * m.vocab_size


def param_counts(m: ModelConfig) -> tuple[int, int]:
    """(total, active) parameters: every weight (embedding, head, 2 norms per layer and the
    final one included); active = what one token uses (k of the E experts of a MoE layer)."""
    d, x_moe = m.d_model, moe_layers(m)
    dense_layer = attention_params(m) + 3 * d * m.d_ff + 2 * d
    moe_layer = attention_params(m) + 2 * d
    rest = 2 * m.vocab_size * d + d  # embedding, head, final norm
    base = (m.n_layers - x_moe) * dense_layer + x_moe * moe_layer + rest
    return (base + x_moe * moe_ffn_params(m, active=False), base + x_moe * moe_ffn_params(m, active=True))


def attention_flops_per_token(m: ModelConfig, seq_len: int) -> float:
    """The attention core's training FLOPs (forward + backward) per token: the scores and the
    probabilities times V, causal (half of L x L), 3 times the forward."""
    return 3 * m.n_layers * 4 * seq_len * m.n_heads * m.head_dim / 2


def flops_per_token(m: ModelConfig, seq_len: int) -> float:
    """Training FLOPs (forward + backward) per token: the weights' matmuls and the attention core."""
    return 6 * matmul_params(m) + attention_flops_per_token(m, seq_len)


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

    def skip(self, seconds: float) -> None:
        """Leave `seconds` of host time (an evaluation, a checkpoint save) out of the current interval."""
        self.start += seconds
