"""The roofline of a run: FLOPs, the step's kernels at achievable rates, communication,
the pipeline bubble, step time and MFU; and the GPUs it plans for.

Pure arithmetic on tools/shape.py's per-device shape, tools/activations.py's activations and
tools/traffic.py's bytes per axis.

Time (roofline): compute = the step's kernels one after another, each kind at an achievable
rate, not the datasheet peak (GPU.rates names the published figures; `tools.plan
--calibration` puts in those a `make gpu-check` record measured):
  matmuls    hardware FLOPs (model FLOPs, + one more forward under full remat, + the experts'
             rows beyond the T·k' routed ones: capacity's padded slots, and under dropless
             ragged_dot's dense lowering, every received row through every local expert:
             `expert_padding`) less the attention core's, at the GPU's large-GEMM rate
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
             126 ms before the layer's terms were measured, tools/activations.py). Under remat
             none the measured step is slower than this model (the layer scan's copies of its
             stacked residuals: tests/test_calibration.py holds the gap).
MFU is still model FLOPs over the datasheet peak. Each axis's bytes take their link's time
(tools/traffic.py). Two figures: communication not overlapped (compute + comm) and fully
overlapped (max). Then / (1 - bubble), the schedule's (tools/pipeline_figures.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from configs.base import RunConfig
from sharding.checks import expert_d_ff
from tools.activations import stack_activations
from tools.pipeline_figures import pipeline_figures
from tools.shape import dispatch_rows, local_params, shape
from tools.links import Links, comm_time
from tools.traffic import communication
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
    backward cell re-runs the stage's forward under jax.vjp), and the experts' rows beyond the
    routed ones, `padding_per_device` (`expert_padding`; hardware FLOPs, part of
    hardware_per_device). `attention_per_device`: the attention core's share of the hardware
    FLOPs (the rest are matmuls)."""
    m, t = cfg.model, cfg.train
    model = flops_per_token(m, t.seq_len) * t.global_batch_size * t.seq_len
    per_device = model / math.prod(sizes.values())
    redo = (2 + 1 + (m.remat == "full")) / 3  # forward, backward, recompute
    attention = attention_flops_per_token(m, t.seq_len) * t.global_batch_size * t.seq_len / math.prod(sizes.values())
    padding = expert_padding(cfg, sizes)
    return {"model": model, "model_per_device": per_device, "padding_per_device": padding,
            "hardware_per_device": per_device * redo + padding, "attention_per_device": attention * redo}


def expert_padding(cfg: RunConfig, sizes: dict[str, int]) -> float:
    """Hardware FLOPs per device and step of expert rows beyond the n·k' routed ones the model
    counts, per MoE layer and microbatch, each row 2·3·D·F_e/t a pass of the three matmuls
    (passes: forward, dx, dw, and the recompute under remat full):
      capacity             every slot of the buffers, ep·S = E·C rows, in every pass
      dropless ragged_dot  E·S rows in every pass: XLA lowers ragged_dot to a dense dot of
                           zero-padded operands, every received row through each of the E/ep
                           local experts (model/kernels/grouped_matmul.py: on the GPUs lent here,
                           jax 0.11.2 with cuDNN 9.19, and in every compile for an H100 without
                           one; a newer stack whose cuDNN ragged-dot fusion takes the forward and
                           dx still computes dw so)
      dropless mosaic      ep·S rows in the forward, dx and recompute (jax's Hopper kernels sweep
                           every row block, padding rows too), the routed rows only in dw
    ep·S = ep·n·min(k', E/ep) (`dispatch_rows`): n·k' at ep = 1, where mosaic has no padding."""
    m, s = cfg.model, shape(cfg, sizes)
    if not s.moe:
        return 0.0
    ep, block = sizes.get("expert", 1), dispatch_rows(cfg, sizes)
    passes = 3 + (m.remat == "full")
    if m.moe_dispatch == "capacity":
        rows = ep * block
    elif m.expert_matmul == "ragged_dot":
        rows = m.n_experts * block
    else:
        rows, passes = ep * block, passes - 1
    per_pass = 2 * 3 * m.d_model * expert_d_ff(m) / sizes["tensor"]
    return s.k * s.moe * per_pass * passes * (rows - s.tokens * m.experts_per_token)


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
    figures = pipeline_figures(cfg, sizes)
    bubble = figures["bubble"]
    serial = (compute + sum(comm.values())) / (1 - bubble)
    overlapped = max(compute, *comm.values()) / (1 - bubble) if comm else compute / (1 - bubble)
    mfu = {name: f["model_per_device"] / (gpu.peak_flops * t) for name, t in
           (("no_overlap", serial), ("overlap", overlapped))}
    return {"compute_s": compute, **kernels, "comm_s": comm, "bubble": bubble,
            "bubble_without_head": figures["bubble_without_head"], "no_overlap_s": serial,
            "overlap_s": overlapped, "mfu_no_overlap": mfu["no_overlap"], "mfu_overlap": mfu["overlap"]}
