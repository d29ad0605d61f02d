"""The per-device shape of a run, which every term of the planner's models uses: tokens,
layers, microbatches and parameters one device holds, and the rows its experts compute.

Pure arithmetic on the config: no jax is imported. Letters as in DESIGN.md; per device: b
sequences per microbatch, k microbatches, T = b·L/sp tokens, t = tp, X/pp layers; c = bytes of
the compute dtype, p4 = 4 (fp32).
Mixture of experts (model.n_experts = E > 0): X_moe = X/moe_every MoE layers, top-k' routing,
F_e the expert F, ep = size of `expert`; per MoE layer and microbatch a device sends
[ep, S, D] and its experts compute R = ep·S rows (`dispatch_rows`): dropless S = T·min(k', E/ep),
capacity S = (E/ep)·ceil(cf·T·k'/E).
Its users: tools/activations.py (what a layer keeps), tools/estimate.py (memory per device),
tools/traffic.py and tools/pipeline_traffic.py (bytes per mesh axis) and tools/roofline.py (FLOPs,
step time, MFU).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from configs.base import RunConfig
from sharding.checks import (ONE_F_ONE_B, accumulation_axes, batch_ranks, expert_d_ff, explicit_context,
                             explicit_tensor, microbatches, moe_layers)
from sharding.cores import choose_core

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
GiB = 2**30  # every memory figure the tools print is in GiB, as jax and nvidia-smi count


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
        k = microbatches(cfg, sizes["stage"])
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


def table_split(cfg: RunConfig, sizes: dict[str, int]) -> int:
    """How many ways stage splits the embedding and head as stored (their D after fsdp:
    sharding/rules.py): p where fsdp·p divides D, else 1."""
    p = sizes["stage"]
    return p if cfg.model.d_model % (sizes["fsdp"] * p) == 0 else 1


def held_tables(cfg: RunConfig, sizes: dict[str, int]) -> float:
    """The embedding and head a device holds for the step, in heads (V·D/t a tensor rank): 2
    whole, but 1 + 1/p where each stage holds only its columns [D, V/(t·p)] of the head, by an
    all-to-all over stage (pipeline/head.py): under the 1F1B family, where the head is stored
    split over stage (`table_split`) and p divides V/t."""
    p = sizes["stage"]
    columns = (p > 1 and cfg.parallel.schedule in ONE_F_ONE_B and table_split(cfg, sizes) > 1
               and cfg.model.vocab_size // sizes["tensor"] % p == 0)
    return 2 - (1 - 1 / p) * columns


def attention_params(cfg: RunConfig, sizes: dict[str, int]) -> float:
    """One layer's attention weights held by one device: wq and wo [D, N·H] split by fsdp (D) and
    tensor (heads), wk and wv [D, K·H] likewise, replicated over tensor when t does not divide K."""
    m, fsdp, tp = cfg.model, sizes["fsdp"], sizes["tensor"]
    kv_split = tp if m.n_kv_heads % tp == 0 else 1
    return 2 * m.d_model * m.head_dim * (m.n_heads / (fsdp * tp) + m.n_kv_heads / (fsdp * kv_split))


def local_param_parts(cfg: RunConfig, sizes: dict[str, int]) -> tuple[float, float]:
    """(non-expert, expert) parameters held by one device: weights split by fsdp (D) and tensor
    (heads, F, V); kv weights replicated over tensor when t does not divide K; norms replicated;
    layers by stage, the embedding and head by stage too (`table_split`). A MoE layer has no
    dense MLP: its router [D, E] split by fsdp, its shared experts [D, n_shared·F_e] as a dense
    MLP, and (the second figure) its routed experts [E, D, F_e] split by ep (E), fsdp (D) and
    tensor (F_e)."""
    m, fsdp, tp, ep = cfg.model, sizes["fsdp"], sizes["tensor"], sizes.get("expert", 1)
    d, fe = m.d_model, expert_d_ff(m)
    attention = attention_params(cfg, sizes) + 2 * d  # and the layer's two norms
    dense = attention + 3 * d * m.d_ff / (fsdp * tp)
    moe = attention + d * m.n_experts / fsdp + 3 * d * m.n_shared_experts * fe / (fsdp * tp)
    s = shape(cfg, sizes)
    tables = 2 * m.vocab_size * d / (fsdp * tp * table_split(cfg, sizes))
    non_expert = (s.layers - s.moe) * dense + s.moe * moe + tables + d
    return non_expert, s.moe * m.n_experts * 3 * d * fe / (ep * fsdp * tp)


def small_parts(cfg: RunConfig, sizes: dict[str, int]) -> tuple[float, float, float]:
    """(h, n, r) of the module docstring, parameters per device: the head's share (the
    embedding's too), V·D/(f·t); the norms', (2X + 1)·D (not split); the routers', D·E/f per MoE
    layer (X and the MoE layers this stage's)."""
    m, s = cfg.model, shape(cfg, sizes)
    return (m.vocab_size * m.d_model / (sizes["fsdp"] * sizes["tensor"]), (2 * s.layers + 1) * m.d_model,
            s.moe * m.d_model * m.n_experts / sizes["fsdp"])


def layers_gathered_once(cfg: RunConfig, sizes: dict[str, int]) -> bool:
    """Whether XLA gathers each layer's weights once per microbatch and keeps the gathered copy
    for the backward, where ZeRO-3 gathers them again: XLA's own fsdp (fsdp > 1, not gathered
    whole for the step: sharding.checks.accumulation_axes), the layers unrolled
    (model.scan_layers=false: the backward's gather is the forward's, which XLA computes once; a
    scan's backward loop cannot reach the forward loop's), under remat none (a checkpoint
    gathers again in its recompute), with no tensor axis (the explicit TP regions gather inside
    their own region and again in the backward). Compiled for H100s, 125m (remat none,
    unrolled, 16 x 1024 a step): the fsdp census read 0.777x a contract of three gathers on
    fsdp=8, dp=2,fsdp=4 and fsdp=4,sp=2, 1.000x scanned or under dots, attn, full or beside tp=2;
    1b on fsdp=8 held all 16 layers' gathered weights at its peak (16 all-gathers, not 32)."""
    m = cfg.model
    return (sizes["fsdp"] > 1 and sizes["tensor"] == 1 and not m.scan_layers and m.remat == "none"
            and "fsdp" not in accumulation_axes(cfg, sizes))


def layer_gathers(cfg: RunConfig, sizes: dict[str, int]) -> int:
    """How many times XLA's ZeRO-3 all-gathers each layer's weights per microbatch (the fsdp
    contract, tools/traffic.py), in units of the device's layer weights: for the forward and
    again for the backward, but once where one gather serves both. Unrolled: under remat none
    without shard_map regions (`layers_gathered_once`), and in the regions (explicit TP,
    context parallelism) under every remat policy (TensorParallel.gather_in_checkpoint makes the
    gather a value of the checkpoint) and under remat none where the regions are manual over the
    batch axes too (sequence parallelism, context); not under remat none in plain TP's regions,
    nor under a remat policy without regions, whose recompute gathers again. Scanned (a scan's
    backward loop cannot reach the forward loop's gather), twice, but under remat none in
    regions manual over fsdp, which gather their weights themselves
    (TensorParallel.gather_in_region): the forward loop's gathered weights are the scan's
    residuals. The MoE regions' own weights: `expert_gathers`. Compiled for H100s (XLA GPU, its scheduler
    off), the fsdp census of 125m on fsdp=4,tp=2 read 0.777x a contract of two gathers under
    remat dots and full, 0.711x with SP under none, dots and full (the head's gradient in fp32
    counted too: tools/traffic.py); 1b 0.701x (full) and 0.680x (SP, none); 125m fsdp=4,sp=2
    (ring, full) 0.777x; 1.000x with these counts (bench/results/layer-gathers-h100-compiled.json).
    Plain TP under remat none read 1.000x of two, and scanned under dots or full with SP too,
    but for the head's gradient. Scanned with SP or context under remat none: bench/results/
    region-fsdp-h100-compiled.json."""
    m, p = cfg.model, cfg.parallel
    if layers_gathered_once(cfg, sizes):
        return 1
    if sizes["fsdp"] == 1 or "fsdp" in accumulation_axes(cfg, sizes):
        return 2
    tensor = explicit_tensor(cfg, sizes["tensor"])
    context = explicit_context(cfg, sizes["sequence"]) is not None
    if m.scan_layers:
        over_fsdp = (tensor and p.sequence_parallel) or context  # TensorParallel.manual_axes
        return 1 if over_fsdp and m.remat == "none" else 2
    merged = (tensor or context) and (m.remat != "none" or p.sequence_parallel or context)
    return 1 if merged else 2


def expert_gathers(cfg: RunConfig, sizes: dict[str, int]) -> int:
    """`layer_gathers` of the MoE regions' weights (the routed experts and the routers,
    sharding/expert_parallel.py): scanned under remat none, once, whatever the dense weights
    beside them do: the region is manual over fsdp, and the scan keeps its gathered weights
    from the forward loop to the backward's, whether the region gathers them itself
    (TensorParallel.gather_in_region) or XLA at its edge. Compiled for H100s, moe-tiny's fsdp
    census read 0.70x (fsdp=4), 0.72x (dp=2,fsdp=2,ep=2 and fsdp=2,ep=2,tp=2) and 0.68x
    (dp=2,fsdp=2,ep=2,tp=2 with SP) of a contract of two gathers (bench/results/
    moe-region-fsdp-h100-compiled.json)."""
    m = cfg.model
    return 1 if m.scan_layers and m.remat == "none" else layer_gathers(cfg, sizes)


def local_params(cfg: RunConfig, sizes: dict[str, int]) -> float:
    """Parameters held by one device, expert and non-expert (`local_param_parts`)."""
    return sum(local_param_parts(cfg, sizes))


def local_layer_params(cfg: RunConfig, sizes: dict[str, int]) -> float:
    """The device's layers' parameters (`local_params` less the embedding and head and the final
    norm)."""
    m = cfg.model
    tables = 2 * m.vocab_size * m.d_model / (sizes["fsdp"] * sizes["tensor"] * table_split(cfg, sizes))
    return local_params(cfg, sizes) - tables - m.d_model


def dispatch_rows(cfg: RunConfig, sizes: dict[str, int]) -> int:
    """S: rows of one block of a device's dispatch buffer [ep, S, D] per MoE layer and
    microbatch; the device's experts compute ep·S rows. dropless n·min(k, E/ep) (the most one
    device can send another); capacity (E/ep)·C, C = ceil(cf·n·k/E)."""
    m, n, ep = cfg.model, shape(cfg, sizes).tokens, sizes.get("expert", 1)
    if m.moe_dispatch == "capacity":
        return m.n_experts // ep * math.ceil(m.capacity_factor * n * m.experts_per_token / m.n_experts)
    return n * min(m.experts_per_token, m.n_experts // ep)
