"""The analytic model of a run: memory per device, communication per mesh axis, FLOPs, step time.

Pure arithmetic on the config and the schedule's timetable (pipeline/schedule.py; nothing is
traced or compiled, though importing the pipeline package imports jax), so `tools.search` can
rank hundreds of meshes in a second. Letters as in DESIGN.md; per device: b sequences per
microbatch, k microbatches, T = b·L/sp tokens, t = tp, X/pp layers; c = bytes of the compute
dtype, p4 = 4 (fp32).
Mixture of experts (model.n_experts = E > 0): X_moe = X/moe_every MoE layers, top-k' routing,
F_e the expert F, ep = size of `expert`; per MoE layer and microbatch a device sends
[ep, S, D] and its experts compute R = ep·S rows (`dispatch_rows`): dropless S = T·min(k', E/ep),
capacity S = (E/ep)·ceil(cf·T·k'/E).

Memory (bytes per device), the terms `memory()` returns:
  params      P_local · bytes(param_dtype)            P_local = P / (fsdp·tp·pp), norms whole;
                                                       the routed experts (3·E·D·F_e per MoE
                                                       layer) / (ep·fsdp·tp), the router [D, E]
                                                       / fsdp, shared experts as a dense MLP
  optimizer   2 · P_local · bytes(param_dtype)         AdamW mu and nu
  gradients   P_local · 4                              fp32 (they arrive through the bf16 cast)
  update      P_local · 4 when replicated over fsdp    optax's clipped update, held beside the
              gradients (measured on XLA CPU: the optimizer phase holds about 2 gradient copies)
  gathered    FSDP only: the embedding and head gathered whole (V·D/t each, param dtype) and
              their full-size gradients before the reduce: 4 · V·D/t · 4
  gathered once  parallel.fsdp_gather_once, and the 1F1B family under fsdp: the rest of the
              weights whole over fsdp in the compute dtype and a whole fp32 gradient
              accumulator: P_local·(fsdp-1)·(c + 4)
  saved       activations kept for backward: X/pp layers of one microbatch; under gpipe and
              interleaved every tick's (the ticks of the schedule's table, V·M+p-1, of X/(p·V)
              layers: autodiff through the tick scan keeps the idle ticks' too; at least the
              table's in-flight peak, all M) plus [M, b, L, D] embeddings, outputs and their
              cotangents; under the 1F1B family (1f1b, interleaved-1f1b, zb-h1) stage 0's
              in-flight peak of its table (pipeline.schedule.in_flight: p (microbatch, chunk)
              under 1f1b and zb-h1, 2(p-1) + (V-1)p + 1 interleaved) of residual slots, each
              one chunk's X/(pp·V) layers' residuals by the remat policy (remat full: the chunk
              input, T·D), plus 3·T·D of inputs and gradients in flight, plus under zb-h1 the
              in-flight peak of B's stash for W (`zb_stash`). Per layer and token, in elements:
                remat none  4·D (block inputs, norm outputs) + (N+2K)·H/t (q, k, v)
                            + 2·N·H/t (K, V repeated to N heads by the xla core) + N·H/t (output)
                            + 4·F/t (gate, up, silu, hidden)
                            + 3·N/t·L (scores, masked scores, probs: fp32, xla core only;
                            model.attention=auto is resolved as on the GPU: `core`)
                context parallel (ring, allgather): q, k, v, out and the fp32 lse only,
                            (2N+2K)·H/t + 4·N/t bytes: its custom_vjp saves no scores
                MoE layer   the dense layer's terms with 4·n_shared·F_e/t for the MLP's,
                            plus 2·E fp32 (router logits, probabilities) per token, plus per
                            routed row (R of them, not per token): 4·D (sent, received,
                            expert output, returned) + 4·F_e/t (gate, up, silu, hidden)
                remat full  D (the layer input)
                remat dots/attn: between the two (modelled as none; an upper bound)
  working     the larger of: one layer's backward working set, and the logits [T, V/t] fp32 of
              the head and loss (of all M microbatches at once after a gpipe/interleaved pipe).
              The working set is the gradients of one layer's 'none' terms (one more layer's
              worth; the larger of a dense and a MoE layer, the dispatch buffers included); under remat it is twice that, the layer's forward being
              recomputed first. Under context parallelism with the xla core, plus one block
              piece's fp32 scores, probs and their gradient, 3·b·N/t·(L/sp)² · 4 (the ring's
              pieces are at most L/sp square; a flash core tiles them away).

Peak = params + optimizer + gradients + gathered + max(update, saved + working): the optimizer
phase and the backward phase do not overlap in time. Against XLA's static peak on CPU (fp32):
within 15% without a pipeline (tests/test_plan.py); 0.8-1.3x under 1f1b and 0.5-0.9x under
gpipe (tiny and 125m, pp=2 and 4, M=4 and 8, remat none and full): gpipe keeps more around its
tick scan and its all-microbatch head than these terms count, so tools.search plans pipelines
with 1f1b.

CPU vs GPU: XLA on CPU computes bf16 matmuls in fp32 and keeps f32 buffers, so compare with a
CPU compile only under model.compute_dtype=float32 (tests/test_plan.py does); on a GPU c = 2.
XLA CPU reduces FSDP gradients with an all-reduce + slice (full-size gradient buffers, the
'gathered' term); GPU's reduce-scatter needs less. The estimate leaves out XLA's fragmentation,
the CUDA context and NCCL buffers (about 1-2 GiB per GPU): keep a margin.

Communication (bytes per device per step), the contract of DESIGN.md:
  data    2 · G(N-1)/N              once per step (the k microbatches summed first; per
                                    microbatch, times k, where sharding.checks.accumulation_axes
                                    is empty: k = 1, MoE, sp > 1, gpipe and interleaved;
                                    the 1F1B family reduces over data once per step);
                                    G = fp32 gradient bytes of this device's shard (its E/ep
                                    experts included: they are reduced over data), where the
                                    wk, wv that tensor replicates (t does not divide K) count
                                    one kv head: each device's gradient covers the head it uses,
                                    and XLA reduces that slice over data before the tensor sum
  fsdp    k·(2p + 4) · P(N-1)/N     P in parameters: XLA's ZeRO-3, per microbatch 2 all-gathers
                                    of each layer's weights (param dtype, p bytes) and a
                                    reduce-scatter of its fp32 gradient; with
                                    parallel.fsdp_gather_once (c + 4) · P(N-1)/N: the weights
                                    gathered whole in the compute dtype once per step, the
                                    gradients reduce-scattered once; so too under the 1F1B
                                    family (pipeline/one_f_one_b.py), manual over fsdp
                                    (the device's E/ep experts included)
  expert  2 · G'(ep-1)/ep           G' = G less the routed experts: every other weight treats
                                    `expert` as a data axis (summed per axis, as sequence's)
          + all-to-alls, per MoE layer and microbatch: dispatch and combine forward, their
          transposes backward, 4 · (ep-1)/ep · ep·S·D·c; dropless adds the int32 expert ids
          forward, (ep-1)/ep · ep·S·4; remat=full repeats the forward's (6 and 2 ids;
          modelled, not measured). `expert()` returns the all-to-all bytes alone; none at ep = 1
  tensor  per microbatch, S = b·L·D·c: (4 + r) · 2S(t-1)/t per layer, 2 all-reduces forward
          and 2 backward (with sequence parallelism an all-gather and a reduce-scatter for each,
          the same bytes); plus 2 · 2S(t-1)/t per microbatch for the vocab-parallel embedding
          (its lookup's all-reduce forward) and head (its input gradient's all-reduce
          backward); under sequence parallelism the same bytes, the embedding's reduce-scatter
          forward and all-gather backward, the head's all-gather forward and reduce-scatter
          backward (sharding/tensor_parallel.py); plus, when t does not
          divide K, the all-reduce of the replicated wk, wv gradients (2·D·K·H fp32 per layer).
          r: remat=full recomputes the layer's forward in the backward, but only what the
          backward reads: the attention output's all-reduce (its sum feeds the MLP), not the
          MLP's (its sum only makes the layer's output, which the backward never reads), so
          r = 1; under sequence parallelism the recompute runs all-gather, reduce-scatter,
          all-gather (the MLP's reduce-scatter is dead the same way): r = 1.5. The census of the
          compiled tiny step on dp=2,tp=4 agrees within 0.1% with and without remat and SP
          (tests/test_hlo.py). remat dots/attn: modelled as none (r = 0), not measured.
  sequence the gradients, as over data (every weight is replicated over sequence): 2 · G(N-1)/N;
          plus K and V per layer and microbatch, E = b·(L/sp)·K'·H elements of one local block
          (K' = the kv heads of the device: K/t, or 1 when t does not divide K):
            ring       2E(sp-1)·c forward; backward 2E(sp-1)·c (K, V again) + 2E·sp·4
                       (dK, dV in fp32 travel with their blocks and come home)
            allgather  2E(sp-1)·c forward (all-gather); backward 2E(sp-1)·c (gathered
                       again) + 2E(sp-1)·4 (reduce-scatter of dK, dV in fp32)
          remat=full adds nothing: the recomputed forward needs the blocks the backward sends
          again, and XLA merges the two (the census of tiny on dp=2,sp=4 shows one set)
            gspmd      2 all-gathers of K and V per layer forward, 2 reduce-scatters backward
  (data and fsdp times k: the compiled step gathers the weights and reduces the gradients in
  each microbatch of the accumulation scan, as the census of a k > 1 step shows)
  stage   a permute of b·L·D·c per microbatch per stage boundary, forward and backward;
          the bubble is the lock-step weighted bubble of the schedule's table
          (pipeline.schedule.weighted: every tick lasts as long as its most expensive cell) with
          `cell_costs`: F = 1, B = 2, or split (zb-h1) B = 1 and W = 1; B one more under
          model.remat=full (the layers' forward recomputed) and, for the 1F1B family under
          remat full, one more (the whole chunk is one checkpoint, pipeline/one_f_one_b.py). gpipe
          (p-1)/(M+p-1), interleaved (p-1)/(V·M+p-1); 1f1b 1 - M(F+B)/(2M·B + (p-1)(F+B) - (B-F))
          (its F ticks last a B); zb-h1 (p-1)/(3M+p-1) (units); interleaved-1f1b from its table
Time (roofline): compute = the step's kernels one after another, each kind at an achievable
rate, not the datasheet peak (GPU.rates names the published figures; `tools.plan
--calibration` puts in those a `make gpu-check` record measured):
  matmuls    hardware FLOPs (model FLOPs, + one more forward under full remat and one more
             where the 1F1B family's B recomputes the chunk (remat full), and under capacity
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
             step, this counts 126 ms (bench/results/gpu-h100-2026-11-24.json). Under remat
             none the measured step is slower than this model (the layer scan's copies of its
             stacked residuals: tests/test_calibration.py holds the gap).
MFU is still model FLOPs over the datasheet peak. Each axis's bytes / its link: NVLink
450 GB/s per GPU when the axis and the axes inside it fit in one node of 8 GPUs, InfiniBand
50 GB/s per GPU (400 Gb/s NIC per GPU) otherwise. Two figures: communication not overlapped
(compute + comm) and fully overlapped (max). Then / (1 - bubble), the schedule's (stage above).
With measured links (`tools.plan --bandwidth`, read by tools/bandwidth.py) an axis they cover
takes latency + bytes / busbw of its fit instead: the contract's bytes are bus bytes, as
nccl-tests counts them.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from configs.base import RunConfig
from pipeline.schedule import in_flight, timetable, weighted
from sharding.cores import choose_core
from sharding.mesh import AXES
from sharding.checks import accumulation_axes, batch_ranks, explicit_context, moe_layers, expert_d_ff
from training.metrics import PEAK_FLOPS, attention_flops_per_token, flops_per_token
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
NVLINK, INFINIBAND, GPUS_PER_NODE = 450e9, 50e9, 8
Links = dict[str, tuple[float, float]]  # measured {axis: (latency_s, bytes_per_s)}


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


@dataclass(frozen=True)
class Shape:
    """The per-device quantities every term uses."""

    k: int  # microbatches per step
    b: int  # sequences per microbatch per device
    tokens: int  # T = b·L/sp, tokens per microbatch on this device
    layers: int  # X/pp, layers on this device
    moe: int = 0  # of which MoE layers (X/(moe_every·pp) of the model's)


def shape(cfg: RunConfig, sizes: dict[str, int]) -> Shape:
    """Under a pipeline the microbatches are `parallel.microbatches` (default pp; sharding/checks.py
    refuses train.micro_batch_size there); otherwise k = the rank's batch / micro_batch_size."""
    t = cfg.train
    ranks = batch_ranks(sizes)
    per_rank = t.global_batch_size // ranks
    if sizes["stage"] > 1:
        k = cfg.parallel.microbatches or sizes["stage"]
    else:
        k = per_rank // (t.micro_batch_size or per_rank)
    b = per_rank // k
    return Shape(k, b, b * t.seq_len // sizes["sequence"], cfg.model.n_layers // sizes["stage"],
                 moe_layers(cfg.model) // sizes["stage"])


def core(cfg: RunConfig, sizes: dict[str, int]) -> str:
    """The attention core the run takes on an NVIDIA GPU (sharding/cores.py). Only xla against a
    fused core changes a term here, and every GPU of GPUS (8.0+) fuses bf16/fp16 under auto, so
    Hopper's capability stands for them all (A100 differs only in cudnn's head-dim limit, and
    pallas is fused too)."""
    m, context = cfg.model, explicit_context(cfg, sizes["sequence"]) is not None
    return choose_core(m.attention, "gpu", (9, 0), m.compute_dtype, m.head_dim, context)


STASHING = ("1f1b", "interleaved-1f1b", "zb-h1")  # per-stage vjp cells (pipeline/one_f_one_b.py): residuals stashed


def chunk_recompute(cfg: RunConfig, sizes: dict[str, int]) -> bool:
    """Whether B recomputes the whole chunk's forward: the 1F1B family under model.remat=full
    (its residual is the chunk input; the layers' own remat recomputes each layer once more)."""
    return sizes["stage"] > 1 and cfg.parallel.schedule in STASHING and cfg.model.remat == "full"


def virtual(cfg: RunConfig) -> int:
    """V, the chunks per stage: parallel.virtual_stages under the interleaved schedules, else 1."""
    return cfg.parallel.virtual_stages if cfg.parallel.schedule in ("interleaved", "interleaved-1f1b") else 1


def cell_costs(cfg: RunConfig, sizes: dict[str, int]) -> dict[str, float]:
    """The schedule's cell costs in forwards (module docstring, stage): F 1, B 2 (split: B 1, W 1),
    B + 1 under model.remat=full, B + 1 more where B recomputes the chunk (`chunk_recompute`)."""
    split = cfg.parallel.schedule == "zb-h1"
    b = (1 if split else 2) + (cfg.model.remat == "full") + chunk_recompute(cfg, sizes)
    return {"F": 1, "B": b, "W": 1}


@functools.lru_cache(maxsize=4096)
def _table_figures(schedule: str, p: int, m: int, v: int, cost: tuple[tuple[str, float], ...]) -> tuple:
    table = timetable(schedule, p, m, v)
    return weighted(table, dict(cost)).bubble, in_flight(table)[0], len(table)


def pipeline_figures(cfg: RunConfig, sizes: dict[str, int]) -> dict[str, float]:
    """From the schedule's table (pipeline.schedule): the lock-step weighted bubble with
    `cell_costs`, stage 0's in-flight peak ((microbatch, chunk) pairs) and the ticks; no pipeline:
    0, 1, 1."""
    p = sizes["stage"]
    if p == 1:
        return {"bubble": 0.0, "in_flight": 1, "ticks": 1}
    cost = tuple(sorted(cell_costs(cfg, sizes).items()))
    bubble, peak, ticks = _table_figures(cfg.parallel.schedule, p, shape(cfg, sizes).k, virtual(cfg), cost)
    return {"bubble": bubble, "in_flight": peak, "ticks": ticks}


def local_param_parts(cfg: RunConfig, sizes: dict[str, int]) -> tuple[float, float]:
    """(non-expert, expert) parameters held by one device: weights split by fsdp (D) and tensor
    (heads, F, V); kv weights replicated over tensor when t does not divide K; norms replicated;
    layers by stage. A MoE layer has no dense MLP: its router [D, E] split by fsdp, its shared
    experts [D, n_shared·F_e] as a dense MLP, and (the second figure) its routed experts
    [E, D, F_e] split by ep (E), fsdp (D) and tensor (F_e)."""
    m, fsdp, tp, ep = cfg.model, sizes["fsdp"], sizes["tensor"], sizes.get("expert", 1)
    d, h, fe = m.d_model, m.head_dim, expert_d_ff(m)
    kv_split = tp if m.n_kv_heads % tp == 0 else 1
    attention = 2 * d * m.n_heads * h / (fsdp * tp) + 2 * d * m.n_kv_heads * h / (fsdp * kv_split) + 2 * d
    dense = attention + 3 * d * m.d_ff / (fsdp * tp)
    moe = attention + d * m.n_experts / fsdp + 3 * d * m.n_shared_experts * fe / (fsdp * tp)
    s = shape(cfg, sizes)
    non_expert = (s.layers - s.moe) * dense + s.moe * moe + 2 * m.vocab_size * d / (fsdp * tp) + d
    return non_expert, s.moe * m.n_experts * 3 * d * fe / (ep * fsdp * tp)


def local_params(cfg: RunConfig, sizes: dict[str, int]) -> float:
    """Parameters held by one device, expert and non-expert (`local_param_parts`)."""
    return sum(local_param_parts(cfg, sizes))


def dispatch_rows(cfg: RunConfig, sizes: dict[str, int]) -> int:
    """S: rows of one block of a device's dispatch buffer [ep, S, D] per MoE layer and
    microbatch; the device's experts compute ep·S rows. dropless n·min(k, E/ep) (the most one
    device can send another); capacity (E/ep)·C, C = ceil(cf·n·k/E)."""
    m, n, ep = cfg.model, shape(cfg, sizes).tokens, sizes.get("expert", 1)
    if m.moe_dispatch == "capacity":
        return m.n_experts // ep * math.ceil(m.capacity_factor * n * m.experts_per_token / m.n_experts)
    return n * min(m.experts_per_token, m.n_experts // ep)


def layer_activations(cfg: RunConfig, sizes: dict[str, int], remat: str, moe: bool = False) -> float:
    """Bytes one layer (a MoE layer when `moe`) keeps for backward for one microbatch (module
    docstring)."""
    m, tp, s = cfg.model, sizes["tensor"], shape(cfg, sizes)
    c = DTYPE_BYTES[m.compute_dtype]
    if remat == "full":
        return s.tokens * m.d_model * c
    mlp = 4 * m.d_ff / tp
    routed = 0.0
    if moe:  # shared experts per token; the routed rows; fp32 router logits and probabilities
        fe = expert_d_ff(m)
        mlp = 4 * m.n_shared_experts * fe / tp
        rows = sizes.get("expert", 1) * dispatch_rows(cfg, sizes)
        routed = rows * (4 * m.d_model + 4 * fe / tp) * c + s.tokens * 2 * m.n_experts * 4
    heads = (m.n_heads + 2 * m.n_kv_heads) * m.head_dim + 3 * m.n_heads * m.head_dim
    scores = 3 * m.n_heads / tp * cfg.train.seq_len * 4 if core(cfg, sizes) == "xla" else 0
    if explicit_context(cfg, sizes["sequence"]):  # keeps q, k, v, out, lse
        heads, scores = (2 * m.n_heads + 2 * m.n_kv_heads) * m.head_dim, m.n_heads / tp * 4
    per_token = 4 * m.d_model + heads / tp + mlp
    return s.tokens * (per_token * c + scores) + routed


def stack_activations(cfg: RunConfig, sizes: dict[str, int], remat: str) -> float:
    """Bytes the device's X/pp layers keep for backward for one microbatch: the dense layers'
    and the MoE layers' (`layer_activations`)."""
    s = shape(cfg, sizes)
    dense = (s.layers - s.moe) * layer_activations(cfg, sizes, remat)
    return dense + s.moe * layer_activations(cfg, sizes, remat, moe=True) if s.moe else dense


def zb_stash(cfg: RunConfig, sizes: dict[str, int]) -> float:
    """Bytes zb-h1's B leaves for its W per microbatch (pipeline/split_backward.py): each layer's
    output cotangents of its 7 matmuls and 2 norms, ((N+2K)·H/t + 4·D + 2·F/t) per token, twice
    that under remat full (the recomputed matmul inputs W reads)."""
    m, s, tp = cfg.model, shape(cfg, sizes), sizes["tensor"]
    per_token = (m.n_heads + 2 * m.n_kv_heads) * m.head_dim / tp + 4 * m.d_model + 2 * m.d_ff / tp
    return (1 + (m.remat == "full")) * s.layers * s.tokens * per_token * DTYPE_BYTES[m.compute_dtype]


def memory(cfg: RunConfig, sizes: dict[str, int]) -> dict[str, float]:
    """The memory terms per device, in bytes, and their peak (module docstring)."""
    m, s = cfg.model, shape(cfg, sizes)
    p_local, param_b = local_params(cfg, sizes), DTYPE_BYTES[m.param_dtype]
    piped, v = sizes["stage"] > 1, virtual(cfg)
    stashing = piped and cfg.parallel.schedule in STASHING
    table = pipeline_figures(cfg, sizes)
    if stashing:  # stage 0's in-flight residual slots, the inputs/inbox, zb-h1's stash of dy's
        c = DTYPE_BYTES[m.compute_dtype]
        chunk = s.tokens * m.d_model * c if m.remat == "full" else stack_activations(cfg, sizes, m.remat) / v
        saved = table["in_flight"] * chunk + 3 * s.tokens * m.d_model * c
        if cfg.parallel.schedule == "zb-h1":
            saved += table["in_flight"] * zb_stash(cfg, sizes)
    elif piped:  # gpipe, interleaved: autodiff keeps every tick's residuals
        saved = table["ticks"] / v * stack_activations(cfg, sizes, m.remat)
        saved += 4 * s.k * s.tokens * m.d_model * DTYPE_BYTES[m.compute_dtype]  # [M, b, L, D] in, out, cotangents
    else:
        saved = stack_activations(cfg, sizes, m.remat)
    heads_at_once = s.k if piped and not stashing else 1
    logits = heads_at_once * s.tokens * m.vocab_size / sizes["tensor"] * 4
    # context parallel with the xla core: one block piece's fp32 scores, probs and their
    # gradient [b, N/t, L/sp, L/sp] at a time (a flash core tiles them away)
    blockwise_xla = explicit_context(cfg, sizes["sequence"]) is not None and core(cfg, sizes) == "xla"
    piece = 3 * s.b * m.n_heads / sizes["tensor"] * (cfg.train.seq_len / sizes["sequence"]) ** 2 * 4 * blockwise_xla
    kinds = [moe for moe, count in ((False, s.layers - s.moe), (True, s.moe)) if count]  # the device's layers
    layer = max(layer_activations(cfg, sizes, "none", moe) for moe in kinds)
    terms = {
        "params": p_local * param_b,
        "optimizer": 2 * p_local * param_b,
        "gradients": p_local * 4,
        "gathered": 4 * m.vocab_size * m.d_model / sizes["tensor"] * 4 if sizes["fsdp"] > 1 else 0.0,
        # parallel.fsdp_gather_once: the weights whole in the compute dtype and the whole fp32
        # gradient accumulator, for the step (training/step.py)
        "gathered once": p_local * (sizes["fsdp"] - 1) * (DTYPE_BYTES[m.compute_dtype] + 4)
        if "fsdp" in accumulation_axes(cfg, sizes) else 0.0,
        "update": p_local * 4 if sizes["fsdp"] == 1 else 0.0,
        "saved activations": saved,
        "working": max((1 if m.remat == "none" else 1.5) * layer + piece, logits),
    }
    fixed = sum(terms[n] for n in ("params", "optimizer", "gradients", "gathered", "gathered once"))
    terms["peak"] = fixed + max(terms["update"], saved + terms["working"])
    return terms


def communication(cfg: RunConfig, sizes: dict[str, int]) -> dict[str, float]:
    """Bytes per device per step on each mesh axis of size > 1 (the contract formulas)."""
    m, s = cfg.model, shape(cfg, sizes)
    c, param_b = DTYPE_BYTES[m.compute_dtype], DTYPE_BYTES[m.param_dtype]
    non_expert, experts = local_param_parts(cfg, sizes)
    shard = (non_expert + experts) * sizes["fsdp"]  # this device's parameters before fsdp splits them
    frac = {a: (n - 1) / n for a, n in sizes.items()}
    act = s.tokens * m.d_model * c  # S: one layer's input for one microbatch (its L/sp rows)
    sp = cfg.parallel.sequence_parallel
    recompute = (1.5 if sp else 1.0) * (m.remat == "full")  # r of the module docstring
    kv_replicated = m.n_kv_heads % sizes["tensor"] != 0
    kv_grads = 2 * 4 * m.d_model * m.n_kv_heads * m.head_dim * kv_replicated
    tensor = s.layers * ((4 + recompute) * 2 * act + 2 * kv_grads) + 2 * 2 * act
    local = accumulation_axes(cfg, sizes)  # gradients reduced once per step (training/step.py)
    # XLA's per-microbatch reduction over data takes one kv head of the replicated wk, wv per
    # device, not all K; the step's once-per-step psum takes the whole (tensor-summed) weights
    shard -= kv_replicated * (not local) * s.layers * 2 * m.d_model * (m.n_kv_heads - 1) * m.head_dim
    replicated = shard - experts * sizes["fsdp"]  # what `expert` reduces: every weight but the experts
    reduces = {axis: 1 if axis in local else s.k for axis in ("data", "fsdp")}
    once = cfg.parallel.fsdp_gather_once or sizes["stage"] > 1  # the 1F1B family gathers once per step
    gathers = (1 if once else s.k) * c if "fsdp" in local else s.k * 2 * param_b
    volume = {
        "stage": 2 * s.k * act / sizes["tensor"] * (sizes["stage"] > 1),
        "data": reduces["data"] * 2 * shard / sizes["fsdp"] * 4 * frac["data"],
        "fsdp": (gathers + reduces["fsdp"] * 4) * shard * frac["fsdp"],
        "expert": s.k * 2 * replicated / sizes["fsdp"] * 4 * frac["expert"] + expert(cfg, sizes),
        "sequence": s.k * 2 * shard / sizes["fsdp"] * 4 * frac["sequence"] + context(cfg, sizes),
        "tensor": s.k * tensor * frac["tensor"],
    }
    return {a: v for a, v in volume.items() if sizes[a] > 1}


def expert(cfg: RunConfig, sizes: dict[str, int]) -> float:
    """All-to-all bytes per device per step over the expert axis (module docstring): per MoE
    layer and microbatch 2 (dispatch, combine) forward + 2 backward of [ep, S, D] in the compute
    dtype, (ep-1)/ep of each leaving the device; dropless adds the int32 expert ids [ep, S]
    forward; remat=full repeats the forward's. None at ep = 1."""
    m, s, ep = cfg.model, shape(cfg, sizes), sizes.get("expert", 1)
    if ep == 1 or not s.moe:
        return 0.0
    rows, forwards = dispatch_rows(cfg, sizes), 1 + (m.remat == "full")
    ids = forwards * rows * 4 if m.moe_dispatch == "dropless" else 0
    return s.k * s.moe * (ep - 1) * ((2 * forwards + 2) * rows * m.d_model * DTYPE_BYTES[m.compute_dtype] + ids)


def context(cfg: RunConfig, sizes: dict[str, int]) -> float:
    """K and V bytes per device per step over the sequence axis (module docstring); none at sp = 1."""
    m, s, sp, tp = cfg.model, shape(cfg, sizes), sizes["sequence"], sizes["tensor"]
    c, impl = DTYPE_BYTES[m.compute_dtype], cfg.parallel.context_impl
    if sp == 1:
        return 0.0
    if impl == "gspmd":
        return 2 * s.k * s.layers * s.tokens * 2 * m.n_kv_heads * m.head_dim * c * (sp - 1)
    e = s.b * cfg.train.seq_len // sp * (m.n_kv_heads // tp if m.n_kv_heads % tp == 0 else 1) * m.head_dim
    home = sp if impl == "ring" else sp - 1  # the ring's last send takes dK, dV home
    return s.k * s.layers * (2 * 2 * e * (sp - 1) * c + 2 * e * home * 4)


def link_bandwidth(sizes: dict[str, int], axis: str) -> float:
    """NVLink when `axis` and every axis inside it fit in one node, else InfiniBand."""
    inner = math.prod(sizes[a] for a in AXES[AXES.index(axis):])
    return NVLINK if inner <= GPUS_PER_NODE else INFINIBAND


def datasheet_link(sizes: dict[str, int], axis: str) -> str:
    """'datasheet NVLink 450 GB/s' or 'datasheet InfiniBand 50 GB/s': the link `link_bandwidth` assumes."""
    bandwidth = link_bandwidth(sizes, axis)
    return f"datasheet {'NVLink' if bandwidth == NVLINK else 'InfiniBand'} {bandwidth / 1e9:.0f} GB/s"


def comm_time(sizes: dict[str, int], axis: str, nbytes: float, links: Links | None) -> float:
    """Seconds for `nbytes` of bus bytes on `axis`: latency + bytes / bandwidth of its measured
    link (links: {axis: (latency_s, bytes_per_s)}), else bytes / the datasheet link."""
    if links and axis in links:
        latency, bandwidth = links[axis]
        return latency + nbytes / bandwidth
    return nbytes / link_bandwidth(sizes, axis)


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
    redo = (2 + 1 + (m.remat == "full") + chunk_recompute(cfg, sizes)) / 3  # forward, backward, recomputes
    attention = attention_flops_per_token(m, t.seq_len) * t.global_batch_size * t.seq_len / math.prod(sizes.values())
    return {"model": model, "model_per_device": per_device, "padding_per_device": padding * redo,
            "hardware_per_device": (per_device + padding) * redo, "attention_per_device": attention * redo}


def memory_bound_bytes(cfg: RunConfig, sizes: dict[str, int]) -> float:
    """HBM bytes per device per step of the memory-bound kernels (module docstring, Time: memory)."""
    m, s = cfg.model, shape(cfg, sizes)
    passes = 4 + 2 * (m.remat != "none") + 2 * chunk_recompute(cfg, sizes)
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
