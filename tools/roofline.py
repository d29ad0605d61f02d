"""The roofline of a run: FLOPs, the step's kernels at achievable rates, communication,
the pipeline bubble, step time and MFU; and the GPUs it plans for.

Pure arithmetic on tools/estimate.py's shape and memory-model activations and tools/traffic.py's
bytes per axis.

Time (roofline): compute = the step's kernels one after another, each kind at an achievable
rate, not the datasheet peak (GPU.rates names the published figures; `tools.plan
--calibration` puts in those a `make gpu-check` record measured):
  matmuls    hardware FLOPs (model FLOPs, + one more forward under full remat, and under capacity
             dispatch the experts' padded rows: R - T·k' rows per MoE layer and microbatch,
             6·3·D·F_e/t each; dropless sorts its padding rows out of every group of the
             grouped matmul, so it computes the T·k' routed rows only, on average over
             devices) less the attention core's, at the GPU's large-GEMM rate
  attention  the attention core's FLOPs at its attention rate
  memory     the memory-bound kernels between them (norms, rope, SiLU, residual adds, the
             loss, the optimizer) at the GPU's copy bandwidth, `memory_bound_bytes`: per
             microbatch, every activation the layers would keep under remat none written once
             and read once by the forward and again by the backward's gradients, and once more
             by each recomputed forward (remat other than none; the 1F1B family's chunk
             recompute), plus the fp32 logits [T, V/t] four times (written, read by the loss,
             their gradient written and read); per step the optimizer's 7 x 4 bytes per
             parameter (AdamW reads params, gradients and two moments, writes three). On one
             H100, 1b at remat full: the profile's elementwise and copy kernels took 118 ms a
             step, this counts 100 ms (bench/results/gpu-nvidia-h100-80gb-hbm3-20261124.json;
             126 ms before the layer's terms were measured, tools/estimate.py). Under remat
             none the measured step is slower than this model (the layer scan's copies of its
             stacked residuals: tests/test_calibration.py holds the gap).
MFU is still model FLOPs over the datasheet peak. Each axis's bytes take their link's time
(tools/traffic.py). Two figures: communication not overlapped (compute + comm) and fully
overlapped (max). Then / (1 - bubble), the schedule's (tools/traffic.py, stage).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from configs.base import RunConfig
from sharding.checks import expert_d_ff
from tools.estimate import (dispatch_rows, local_params, pipeline_figures, shape,
                            stack_activations)
from tools.traffic import Links, comm_time, communication
from training.metrics import PEAK_FLOPS, attention_flops_per_token, flops_per_token


@dataclass(frozen=True)
class GPU:
    """One accelerator: datasheet figures (dense bf16 peak and HBM bytes: NVIDIA SXM datasheets)
    and the achievable rates the roofline computes at (module docstring, Time):
    published or measured figures, `rates` says which (tools/calibration.py puts a `make
    gpu-check` record's in). best_mfu: the best MFU published for dense transformer training on
    this GPU; a plan above it says why (tools/plan.py)."""

    name: str
    peak_flops: float
    memory: float
    copy_bandwidth: float  # bytes/s a device-to-device copy reaches, read + write counted
    matmul_flops: float  # FLOP/s a large bf16 GEMM reaches
    attention_flops: float  # FLOP/s of the fused causal attention core, in the model's FLOPs
    best_mfu: float
    rates: str


H100_RATES = ("matmul 798 TFLOP/s: a bf16 8192^3 GEMM measured on an H100 SXM (GPU-NOTES.md; "
              "81% of peak); attention 406 TFLOP/s: Pallas Mosaic GPU flash attention forward, causal, "
              "L=4096, h=128 (jax PR#35114), assumed for the backward too; best MFU 56%: Marin's "
              "dense 2.7B on 8 H100s (marin#6979)")
COPY_RATES = "copies {:.1f} TB/s: a device-to-device copy measured on an {} (read + write; GPU-NOTES.md)"
GPUS = {
    "h100": GPU("H100 SXM 80GB", PEAK_FLOPS["H100"], 80e9, 3.0e12, 798e12, 406e12, 0.56,
                H100_RATES + "; " + COPY_RATES.format(3.0, "H100")),
    # the H100's GH100 die and clocks: its compute rates; its own HBM's copy rate
    "h200": GPU("H200 SXM 141GB", PEAK_FLOPS["H200"], 141e9, 4.3e12, 798e12, 406e12, 0.56,
                "the H100's (same compute die): " + H100_RATES + "; " + COPY_RATES.format(4.3, "H200")),
    "a100": GPU("A100 SXM 80GB", PEAK_FLOPS["A100"], 80e9, 0.9 * 2.0e12, 0.81 * PEAK_FLOPS["A100"],
                0.5 * PEAK_FLOPS["A100"], 0.72,
                "matmul 81% of peak and copies 90% of its 2.0 TB/s HBM (the H100's fractions, assumed: "
                "nothing measured on an A100 here); attention 50%, the low end of FlashAttention-2's "
                "50-73% of A100 peak, and best MFU 72%, its GPT training at 225 TFLOP/s (arXiv 2307.08691)"),
}



def flops(cfg: RunConfig, sizes: dict[str, int]) -> dict[str, float]:
    """Model FLOPs per step (6·N·tokens + attention, N the active parameters) and per device,
    and the hardware FLOPs per device: each recomputed forward adds 1/3 (remat full; 1f1b, whose
    backward cell re-runs the stage's forward under jax.vjp); under capacity dispatch the
    experts compute every row of their buffers, ep·S = E·C per MoE layer and microbatch where
    the model counts n·k (padded, or dropped): 6·3·D·F_e/t per row of the difference, the
    `padding_per_device` (hardware FLOPs, part of hardware_per_device). Dropless runs the
    grouped matmul on the routed rows only (model/moe.py), so no padding FLOPs.
    `attention_per_device`: the attention core's share of the hardware FLOPs (the rest are matmuls)."""
    m, t, s = cfg.model, cfg.train, shape(cfg, sizes)
    model = flops_per_token(m, t.seq_len) * t.global_batch_size * t.seq_len
    per_device = model / math.prod(sizes.values())
    padding = 0.0
    if s.moe and m.moe_dispatch == "capacity":
        rows = sizes.get("expert", 1) * dispatch_rows(cfg, sizes) - s.tokens * m.experts_per_token
        padding = s.k * s.moe * 18 * m.d_model * expert_d_ff(m) / sizes["tensor"] * rows
    redo = (2 + 1 + (m.remat == "full")) / 3  # forward, backward, recompute
    attention = attention_flops_per_token(m, t.seq_len) * t.global_batch_size * t.seq_len / math.prod(sizes.values())
    return {"model": model, "model_per_device": per_device, "padding_per_device": padding * redo,
            "hardware_per_device": (per_device + padding) * redo, "attention_per_device": attention * redo}


def memory_bound_bytes(cfg: RunConfig, sizes: dict[str, int]) -> float:
    """HBM bytes per device per step of the memory-bound kernels (module docstring, Time: memory)."""
    m, s = cfg.model, shape(cfg, sizes)
    passes = 4 + 2 * (m.remat != "none")
    logits = 4 * s.tokens * m.vocab_size / sizes["tensor"] * 4
    return s.k * (passes * stack_activations(cfg, sizes, "none") + logits) + 7 * 4 * local_params(cfg, sizes)


def step_time(cfg: RunConfig, sizes: dict[str, int], gpu: GPU,
              links: Links | None = None) -> dict[str, float]:
    """Roofline step time (seconds): compute, each axis's communication, bubble, two totals, MFU.
    links: measured {axis: (latency_s, bytes_per_s)}; the datasheet links for the axes it lacks."""
    f = flops(cfg, sizes)
    attention = f["attention_per_device"]
    kernels = {"matmul_s": (f["hardware_per_device"] - attention) / gpu.matmul_flops,
               "attention_s": attention / gpu.attention_flops,
               "memory_s": memory_bound_bytes(cfg, sizes) / gpu.copy_bandwidth}
    compute = sum(kernels.values())
    comm = {a: comm_time(sizes, a, v, links) for a, v in communication(cfg, sizes).items()}
    bubble = pipeline_figures(cfg, sizes)["bubble"]
    serial = (compute + sum(comm.values())) / (1 - bubble)
    overlapped = max(compute, *comm.values()) / (1 - bubble) if comm else compute / (1 - bubble)
    mfu = {name: f["model_per_device"] / (gpu.peak_flops * t) for name, t in
           (("no_overlap", serial), ("overlap", overlapped))}
    return {"compute_s": compute, **kernels, "comm_s": comm, "bubble": bubble, "no_overlap_s": serial,
            "overlap_s": overlapped, "mfu_no_overlap": mfu["no_overlap"], "mfu_overlap": mfu["overlap"]}
