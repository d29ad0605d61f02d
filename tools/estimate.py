"""The analytic memory model of a run: bytes per device, term by term, and the per-device
shape that every term of the model uses.

Pure arithmetic on the config and the schedule's timetable (pipeline/tables.py, weighed by
pipeline/schedule.py): no jax is imported, nothing traced or compiled, so `tools.search` can
rank hundreds of meshes in a second. Letters as in DESIGN.md; per device: b sequences per
microbatch, k microbatches, T = b·L/sp tokens, t = tp, X/pp layers; c = bytes of the compute
dtype, p4 = 4 (fp32).
Mixture of experts (model.n_experts = E > 0): X_moe = X/moe_every MoE layers, top-k' routing,
F_e the expert F, ep = size of `expert`; per MoE layer and microbatch a device sends
[ep, S, D] and its experts compute R = ep·S rows (`dispatch_rows`): dropless S = T·min(k', E/ep),
capacity S = (E/ep)·ceil(cf·T·k'/E).
Its siblings build on this shape: tools/traffic.py (bytes per mesh axis, the links they cross)
and tools/roofline.py (FLOPs, step time, MFU, the GPUs planned for).

Memory (bytes per device), the terms `memory()` returns:
  params      P_local · bytes(param_dtype)            P_local = P / (fsdp·tp·pp), norms whole;
                                                       the routed experts (3·E·D·F_e per MoE
                                                       layer) / (ep·fsdp·tp), the router [D, E]
                                                       / fsdp, shared experts as a dense MLP
  optimizer   2 · P_local · bytes(param_dtype)         AdamW mu and nu
  gradients   P_local · 4                              fp32 (they arrive through the bf16 cast)
  update      P_local · 4 when replicated over fsdp    optax's clipped update, held beside the
              gradients (measured on XLA CPU: the optimizer phase holds about 2 gradient copies)
  gathered    FSDP as XLA's ZeRO-3 only: the embedding and head gathered whole (V·D/t each,
              param dtype) and their full-size gradients before the reduce: 4 · V·D/t · 4
  gathered once  parallel.fsdp_gather_once, and the 1F1B family under fsdp: the rest of the
              weights whole over fsdp in the compute dtype and a whole fp32 gradient
              accumulator: P_local·(fsdp-1)·(c + 4) (the embedding and head among them, so
              not `gathered` too: llama3-8b fsdp=4,tp=2 had read 0.71x XLA's peak)
  cast        the 1F1B family: the device's own weights in the compute dtype, P_local·c, cast
              once per step before the tick loop and held through it (pipeline/one_f_one_b.py;
              under fsdp `gathered once` is the rest); backward phase only
  saved       activations kept for backward: X/pp layers of one microbatch; under gpipe and
              interleaved every tick's (the ticks of the schedule's table, V·M+p-1, of X/(p·V)
              layers: autodiff through the tick scan keeps the idle ticks' too; at least the
              table's in-flight peak, all M; under remat none twice, as the layer scan's below:
              XLA GPU copies the tick scan's stacked residuals too) plus [M, b, L, D]
              embeddings, outputs and their cotangents; under the 1F1B family (1f1b,
              interleaved-1f1b, zb-h1, zbv) stage 0's in-flight peak of its table
              (pipeline.schedule.in_flight: p (microbatch, chunk) under 1f1b and zb-h1,
              2(p-1) + (V-1)p + 1 interleaved, 2p zbv) of residual slots, each one chunk's
              X/(pp·V) layers' residuals by the remat policy (remat full: the layers' inputs,
              X/(pp·V)·T·D), plus 3·T·D of inputs and gradients in flight, plus under zb-h1 and
              zbv the in-flight peak of B's stash for W (`zb_stash`). Per layer and token, in
              elements:
                remat none  4·D (block inputs, norm outputs) + (N+2K)·H/t (q, k, v)
                            + N·H/t (output) + 3·F/t (gate, up, hidden: the silu is recomputed
                            in the backward's fusion); a fused core (pallas, cudnn) adds its
                            fp32 logsumexp, 4·N/t bytes; the xla core adds 2·N·H/t (K, V
                            repeated to N heads) and 3·N/t·L (scores, masked scores, probs:
                            fp32; model.attention=auto is resolved as on the GPU: `core`).
                            Measured on XLA GPU's own compile for an H100 (tools.plan
                            --compile-for-gpu, 1b at 2 and 4 layers x 4 and 8 sequences of
                            2048): 75,920 bytes per token and layer under cudnn and pallas,
                            the terms' 75,904; d_ff 4096 and n_kv_heads 32 move it by the
                            terms' 3·F and 2·K·H exactly. Its xla core: 434,448 bytes
                            against these terms' 870,400 (fewer fp32 score copies than
                            counted: an upper bound there).
                context parallel (ring, allgather): q, k, v, out and the fp32 lse only,
                            (2N+2K)·H/t + 4·N/t bytes: its custom_vjp saves no scores
                MoE layer   the dense layer's terms with 3·n_shared·F_e/t for the MLP's,
                            plus 2·E fp32 (router logits, probabilities) per token, plus per
                            routed row (R of them, not per token): 4·D (sent, received,
                            expert output, returned) + 3·F_e/t (gate, up, hidden; the
                            dense MLP's measured count, not measured on a MoE compile)
                remat full  D (the layer input)
                remat dots  (N+2K)·H/t + 2·D + 2·F/t: the projections' outputs (q, k, v,
                            the attention's and the MLP's output projections, under TP
                            their sums over tensor, gate, up)
                remat attn  D + (2N+2K)·H/t: the layer input, q, k, v, the core's output
                            (MoE layers under dots and attn: none's, an upper bound)
                1F1B-family slot (`chunk_residuals`: model.remat.stash_policy keeps no
                            elementwise intermediates, B recomputes them) under none:
                            ((N+2K)·H/t + N·H/t + 2·D + 2·F/t)·c (q, k, v before rotary,
                            the core's output, the two D-wide projections, gate, up), plus
                            the fp32 logsumexp 4·N/t (a fused core; context parallel) or
                            the xla core's fp32 scores 4·N/t·L; a MoE layer the attention's,
                            the router's 4·E + 8·k, per expert row D + 2·F_e/t and per
                            routed copy (k per token) D (twice under ep) and its positions;
                            dots and attn as above (attn without each layer's input); the
                            chunk input once where the layers are scanned. Equal to the
                            traced slot (pipeline.one_f_one_b.stash_bytes) for dense layers,
                            within 1% for MoE and context parallel (tests/test_pipeline.py)
                the layer scan under none: twice the layers' terms (XLA GPU stacks each
                            layer's residuals and copies them; 148,276 bytes per token and
                            layer for 1b's 75,920 unrolled; XLA CPU holds them once:
                            `memory(scan_copies=)`); under dots, attn and full the
                            terms exactly (47,104, 14,336 and 4,096 bytes; same compiles)
                unrolled layers (model.scan_layers=false): the policy's terms, as for the
                            scan but for none's second copy (1b compiled for one H100, 8 x 2048
                            tokens: XLA 22.69 GiB under full, 33.19 under dots, 40.16 under
                            none; estimate 1.09x, 1.06x, 1.05x; model/remat.py)
  accumulator k > 1 microbatches without a pipeline: the step's fp32 gradient sum, P_local·4,
              beside each microbatch's gradients (1b on one H100, 8 sequences a microbatch:
              36.04 GiB at k = 1, 40.16 at k = 2: +P·4); under fsdp_gather_once the local
              part of the whole accumulator, `gathered once` the rest
  working     the larger of: one layer's backward working set, and the logits [T, V/t] of the
              head and loss, in the compute dtype and in fp32 (of all M microbatches at once
              after a gpipe/interleaved pipe; 1b on an H100: 205,332 bytes per token beside the
              layers, the logits' 196,608).
              The working set is the gradients of one layer's 'none' terms (one more layer's
              worth; the larger of a dense and a MoE layer, the dispatch buffers included, and
              under dropless ragged_dot XLA's zero-padded copies, `dense_expert_copies`); under
              remat it is twice that, the layer's forward being recomputed first. Under the
              1F1B family at least the head's fp32 gradient V·D/t·4: the last stage's B
              computes it per microbatch beside the accumulator it is added to (1.05 GB on
              llama3-8b at t = 2, XLA's largest temporary there). Under context parallelism
              with the xla core, plus one block piece's fp32 scores, probs and their gradient,
              3·b·N/t·(L/sp)² · 4 (the ring's pieces are at most L/sp square; a flash core
              tiles them away).

Peak = params + optimizer + gradients + gathered + gathered once + accumulator
       + max(update, cast + saved + working):
the optimizer phase and the backward phase do not overlap in time. Against the 1b step measured
on one H100 (unrolled, remat none, 4 to 20 sequences a microbatch, k = 1 to 4): 1.03-1.11x
(bench/results/batch-1b-*.json; tests/test_calibration.py), and 1.02-1.06x XLA's static peak of
every case of the H100 gpu-check records (125m and 1b; none, dots and full; scanned and unrolled).
Against XLA's static peak on CPU (fp32): within 15% without a pipeline (tests/test_plan.py);
0.5-0.9x under gpipe (tiny and 125m, pp=2 and 4, M=4 and 8, remat none and full): gpipe keeps
more around its tick scan and its all-microbatch head than these terms count. Against XLA GPU's
compile for H100s (125m, `tools.plan --compile-for-gpu`, M = pp = 2): gpipe 0.65-0.71x until its
tick scan's residuals counted twice under remat none (now 1.00-1.05x for gpipe and interleaved,
pp=2,dp=2 and pp=2,tp=2, M = 2 to 8; 0.95-1.01x under full and dots;
bench/results/gpipe-memory-125m-h100-compiled.json); the 1F1B
family 0.90-0.95x (1f1b, pp=2,dp=2 and pp=2,tp=2, remat none, dots and full), 0.96x
(interleaved-1f1b), 0.97x (zb-h1; on pp=2,tp=2 0.93-0.98x, remat none, dots and full), 1.07-1.16x
(zbv at M = 4, pp=2,tp=2 and pp=2,dp=2, remat none and full: over, XLA keeping less), 0.88x
(1f1b remat full on pp=2,tp=2 at M = 4, its chunks keeping their layers' inputs; 0.85x when B
recomputed the chunk first, 0.74x before the layers' checkpoints prevented CSE unrolled,
model/remat.py; bench/results/remat-full-1f1b-family.json). Those figures predate `cast` and the
head's gradient: with them XLA's peak is 0.87-1.12x the estimate over the 1F1B family (125m and
llama3-8b, pp=2 and 4, dp, tp and fsdp beside; 0.77-1.20x before), and 1.00-1.16x under
parallel.fsdp_gather_once without the double-counted `gathered` (0.71-0.90x before;
bench/results/memory-cast-h100-compiled.json). tools.search scales each schedule's estimate by a
floor (`MEMORY_LOW`).

CPU vs GPU: XLA on CPU computes bf16 matmuls in fp32 and keeps f32 buffers, so compare with a
CPU compile only under model.compute_dtype=float32 (tests/test_plan.py does); on a GPU c = 2.
XLA CPU reduces FSDP gradients with an all-reduce + slice (full-size gradient buffers, the
'gathered' term); GPU's reduce-scatter needs less. The estimate leaves out XLA's fragmentation,
the CUDA context and NCCL buffers (about 1-2 GiB per GPU): keep a margin.

"""

from __future__ import annotations

import math
from dataclasses import dataclass

from configs.base import RunConfig
from sharding.checks import accumulation_axes, batch_ranks, expert_d_ff, explicit_context, microbatches, moe_layers
from sharding.cores import choose_core
from tools.pipeline_figures import SPLIT, STASHING, pipeline_figures, virtual

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


def dense_expert_copies(cfg: RunConfig, sizes: dict[str, int]) -> float:
    """Bytes of XLA's dense lowering of the dropless experts' ragged_dot (model.expert_matmul =
    ragged_dot; tools.roofline.expert_padding): zero-padded operands and outputs, one
    [E/ep, R, D] and one [E/ep, R, F_e/t] pair of each of two ragged matmuls live at once
    (gate and up forward; dx and dw backward), R = ep·S the rows received: (E/ep)·R·2·(D +
    F_e/t)·c. 0 under capacity and under mosaic. Compiled for H100s (mixtral-8x7b, 2 layers,
    six meshes: bench/results/expert-matmul-mixtral-h100-compiled.json) XLA's peak under
    ragged_dot lies 0.49 to 5.40 GB above mosaic's, where this counts 1.21 to 2.42 GB (XLA's
    scheduler keeps the copies live unevenly: 4.36 GB against 2.42 on dp=2,ep=4, 0.49 against
    1.21 on ep=8); XLA's peak over the estimate went from 0.90-1.47x to 0.88-1.29x."""
    m = cfg.model
    if not m.n_experts or m.moe_dispatch == "capacity" or m.expert_matmul != "ragged_dot":
        return 0.0
    ep = sizes.get("expert", 1)
    rows = ep * dispatch_rows(cfg, sizes)
    return m.n_experts // ep * rows * 2 * (m.d_model + expert_d_ff(m) / sizes["tensor"]) * DTYPE_BYTES[m.compute_dtype]


def layer_activations(cfg: RunConfig, sizes: dict[str, int], remat: str, moe: bool = False) -> float:
    """Bytes one layer (a MoE layer when `moe`) keeps for backward for one microbatch (module
    docstring)."""
    m, tp, s = cfg.model, sizes["tensor"], shape(cfg, sizes)
    c = DTYPE_BYTES[m.compute_dtype]
    qkv, out = (m.n_heads + 2 * m.n_kv_heads) * m.head_dim / tp, m.n_heads * m.head_dim / tp
    if remat == "full":
        return s.tokens * m.d_model * c
    if remat == "dots" and not moe:  # the projections' outputs: q, k, v, the two D-wide ones, gate, up
        return s.tokens * (qkv + 2 * m.d_model + 2 * m.d_ff / tp) * c
    if remat == "attn" and not moe:  # the layer input, q, k, v and the core's output
        return s.tokens * (m.d_model + qkv + out) * c
    mlp = 3 * m.d_ff / tp
    routed = 0.0
    if moe:  # shared experts per token; the routed rows; fp32 router logits and probabilities
        fe = expert_d_ff(m)
        mlp = 3 * m.n_shared_experts * fe / tp
        rows = sizes.get("expert", 1) * dispatch_rows(cfg, sizes)
        routed = rows * (4 * m.d_model + 3 * fe / tp) * c + s.tokens * 2 * m.n_experts * 4
    heads, scores = qkv + out, m.n_heads / tp * 4  # q, k, v, output; the fp32 logsumexp
    if core(cfg, sizes) == "xla" and not explicit_context(cfg, sizes["sequence"]):  # context
        # parallelism's custom_vjp keeps the above whatever the core; the xla core alone keeps K, V
        # repeated to N heads and its fp32 scores, masked scores and probs instead of the logsumexp
        heads, scores = heads + 2 * out, 3 * m.n_heads / tp * cfg.train.seq_len * 4
    per_token = 4 * m.d_model + heads + mlp
    return s.tokens * (per_token * c + scores) + routed


def stack_activations(cfg: RunConfig, sizes: dict[str, int], remat: str) -> float:
    """Bytes the device's X/pp layers keep for backward for one microbatch: the dense layers'
    and the MoE layers' (`layer_activations`)."""
    s = shape(cfg, sizes)
    dense = (s.layers - s.moe) * layer_activations(cfg, sizes, remat)
    return dense + s.moe * layer_activations(cfg, sizes, remat, moe=True) if s.moe else dense


def chunk_residuals(cfg: RunConfig, sizes: dict[str, int]) -> float:
    """Bytes of one chunk's residuals for one microbatch, one slot of the 1F1B family's stash:
    what model.remat.stash_policy keeps of X/(pp·V) layers (module docstring, saved)."""
    m, s, tp = cfg.model, shape(cfg, sizes), sizes["tensor"]
    c, n = DTYPE_BYTES[m.compute_dtype], s.tokens
    layers, moe = s.layers / virtual(cfg), s.moe / virtual(cfg)  # the chunk's layers, of which MoE
    qkv, out = (m.n_heads + 2 * m.n_kv_heads) * m.head_dim / tp, m.n_heads * m.head_dim / tp
    if m.remat == "full":  # each layer's input (model.remat.stash_policy)
        return layers * n * m.d_model * c
    if m.remat == "attn":  # the chunk input; q, k, v and the core's output of every layer
        return n * m.d_model * c + layers * n * (qkv + out) * c
    # the chunk input, kept apart from the layers' residuals where the layers are scanned (unrolled,
    # it takes the place of the last layer's MLP output, which the backward does not need)
    x = n * m.d_model * c if m.scan_layers else 0.0
    if m.remat == "dots":  # a MoE layer: its attention's projections and the router's logits
        return x + (layers - moe) * layer_activations(cfg, sizes, "dots") + moe * n * ((qkv + m.d_model) * c
                                                                                       + 4 * m.n_experts)
    fused = core(cfg, sizes) != "xla" or explicit_context(cfg, sizes["sequence"]) is not None
    attention = n * ((qkv + out + m.d_model) * c + 4 * m.n_heads / tp * (1 if fused else cfg.train.seq_len))
    dense = attention + n * (m.d_model + 2 * m.d_ff / tp) * c
    if not moe:
        return x + layers * dense
    fe, k, ep = expert_d_ff(m), m.experts_per_token, sizes.get("expert", 1)
    rows = ep * dispatch_rows(cfg, sizes)  # the rows the device's experts compute
    shared = n * (m.d_model + 2 * m.n_shared_experts * fe / tp) * c if m.n_shared_experts else 0.0
    bookkeeping = 4 * m.n_experts if m.moe_dispatch == "capacity" else 12  # positions per routed row
    expert_layer = (attention + shared + n * (4 * m.n_experts + 8 * k) + rows * (m.d_model + 2 * fe / tp) * c
                    + n * k * ((1 + (ep > 1)) * m.d_model * c + bookkeeping))
    return x + (layers - moe) * dense + moe * expert_layer


# zb-h1's stash per layer by remat policy: (extra N·H/t of query cotangents, D-wide and F-wide
# bf16 arrays, fp32 [T, 1] norm statistics, fp32 copies of the norms' scales)
_ZB_TERMS = {"none": (0, 2, 3, 2, 2), "dots": (1, 2, 3, 2, 2), "attn": (0, 3, 4, 1, 1), "full": (1, 4, 4, 0, 0)}


def zb_stash(cfg: RunConfig, sizes: dict[str, int]) -> float:
    """Bytes zb-h1's (zbv's) B leaves for its W per microbatch and chunk (pipeline/split_backward.py),
    the chunk's X/(pp·V) layers (V = 2 under zbv, else 1), per layer:
    the output cotangents of its q, k, v projections and of its MLP, the matmul inputs W reads
    that B recomputed (the norms' outputs, the MLP hidden: under none too, the chunk's
    checkpoint keeping no elementwise result), and each norm's fp32 normalised input for its
    scale's gradient, 4·D·4 bytes a token (`_ZB_TERMS` by policy; dense layers, equal to the
    traced stash: tests/test_pipeline.py)."""
    m, s, tp = cfg.model, shape(cfg, sizes), sizes["tensor"]
    queries, d, f, stats, scales = _ZB_TERMS[m.remat]
    heads = (m.n_heads * (1 + queries) + 2 * m.n_kv_heads) * m.head_dim / tp
    per_token = (heads + d * m.d_model + f * m.d_ff / tp) * DTYPE_BYTES[m.compute_dtype] + 4 * (4 * m.d_model + stats)
    if m.remat == "dots" and core(cfg, sizes) == "xla" and not explicit_context(cfg, sizes["sequence"]):
        per_token += DTYPE_BYTES[m.compute_dtype] * m.n_heads / tp * cfg.train.seq_len  # the recomputed probabilities
    return s.layers / virtual(cfg) * (s.tokens * per_token + scales * m.d_model * 4)


def memory(cfg: RunConfig, sizes: dict[str, int], scan_copies: int = 2) -> dict[str, float]:
    """The memory terms per device, in bytes, and their peak (module docstring). scan_copies: how
    many times the layer scan under remat none holds its stacked residuals, 2 as XLA GPU
    compiles it; XLA CPU holds them once (tests/test_plan.py compares with a CPU compile)."""
    m, s = cfg.model, shape(cfg, sizes)
    p_local, param_b, c = local_params(cfg, sizes), DTYPE_BYTES[m.param_dtype], DTYPE_BYTES[m.compute_dtype]
    piped, v = sizes["stage"] > 1, virtual(cfg)
    stashing = piped and cfg.parallel.schedule in STASHING
    table = pipeline_figures(cfg, sizes)
    if stashing:  # stage 0's in-flight residual slots, the inputs/inbox, zb-h1's stash of dy's
        saved = table["in_flight"] * chunk_residuals(cfg, sizes) + 3 * s.tokens * m.d_model * c
        if cfg.parallel.schedule in SPLIT:
            saved += table["in_flight"] * zb_stash(cfg, sizes)
    elif piped:  # gpipe, interleaved: autodiff keeps every tick's residuals, under none twice as the layer scan's
        saved = (scan_copies if m.remat == "none" else 1) * table["ticks"] / v * stack_activations(cfg, sizes, m.remat)
        saved += 4 * s.k * s.tokens * m.d_model * c  # [M, b, L, D] in, out, cotangents
    else:  # the layer scan under none stacks each layer's residuals and copies them: twice
        saved = (scan_copies if m.scan_layers and m.remat == "none" else 1) * stack_activations(cfg, sizes, m.remat)
    heads_at_once = s.k if piped and not stashing else 1
    logits = heads_at_once * s.tokens * m.vocab_size / sizes["tensor"] * (4 + c)
    # context parallel with the xla core: one block piece's fp32 scores, probs and their
    # gradient [b, N/t, L/sp, L/sp] at a time (a flash core tiles them away)
    blockwise_xla = explicit_context(cfg, sizes["sequence"]) is not None and core(cfg, sizes) == "xla"
    piece = 3 * s.b * m.n_heads / sizes["tensor"] * (cfg.train.seq_len / sizes["sequence"]) ** 2 * 4 * blockwise_xla
    kinds = [moe for moe, count in ((False, s.layers - s.moe), (True, s.moe)) if count]  # the device's layers
    layer = max(layer_activations(cfg, sizes, "none", moe) for moe in kinds)
    once = "fsdp" in accumulation_axes(cfg, sizes)  # the weights gathered whole for the step
    head_grad = m.vocab_size * m.d_model / sizes["tensor"] * 4 if stashing else 0.0
    terms = {
        "params": p_local * param_b,
        "optimizer": 2 * p_local * param_b,
        "gradients": p_local * 4,
        "gathered": 4 * m.vocab_size * m.d_model / sizes["tensor"] * 4 if sizes["fsdp"] > 1 and not once else 0.0,
        # parallel.fsdp_gather_once: the weights whole in the compute dtype and the whole fp32
        # gradient accumulator, for the step (training/step.py)
        "gathered once": p_local * (sizes["fsdp"] - 1) * (c + 4) if once else 0.0,
        "cast": p_local * c if stashing else 0.0,
        "accumulator": p_local * 4 if s.k > 1 and not piped else 0.0,
        "update": p_local * 4 if sizes["fsdp"] == 1 else 0.0,
        "saved activations": saved,
        "working": max((1 if m.remat == "none" else 1.5) * layer + piece + dense_expert_copies(cfg, sizes), logits,
                       head_grad),
    }
    fixed = sum(terms[n] for n in ("params", "optimizer", "gradients", "gathered", "gathered once", "accumulator"))
    terms["peak"] = fixed + max(terms["update"], terms["cast"] + saved + terms["working"])
    return terms
