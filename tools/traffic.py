"""The analytic communication model of a run: bytes per device per step on each mesh axis, and
the time they take on the link that axis crosses.

Pure arithmetic, with tools/shape.py's letters and per-device shape.

Communication (bytes per device per step, of the device that moves the most where devices
differ), the contract of DESIGN.md, in the bytes XLA GPU
moves (the census of `tools.plan --compile-for-gpu`; XLA CPU widens bf16 and moves fp32, so
its census is compared at model.compute_dtype=float32, where the two agree):
  gradients: a reduction once per step moves the fp32 sum of the k microbatches, G = 4·P'
          (P' the parameters of this device's shard; pipelined, the embedding's and head's
          1/p of them where fsdp·p divides D: tools.shape.table_split); a reduction per microbatch moves each as
          the backward leaves it, G_c = c·(P' - h - n - r) + 4·(h + n + r): the layers' and the
          embedding's gradients in the compute dtype (bf16 matmuls, a bf16 scatter-add), the
          head's and the routers' (their matmuls make fp32 logits) and the norms' in fp32;
          h = V·D/(f·t), n the norms' (2X + 1)·D, r the routers' D·E/f per MoE layer.
          Under gpipe and interleaved where a batch axis is not manual (sequence
          under context_impl=gspmd: XLA's reduction inside autodiff's transpose of the tick
          scan) XLA reduces the layers' gradients in every tick, bubble ticks included (T/V
          times, T the table's ticks), the head's, the embedding's and norms' once per step
          (`per_microbatch_reductions`)
  data    2 · G(N-1)/N              once per step (the k microbatches summed first; per
                                    microbatch, k · 2 · G_c(N-1)/N, where
                                    sharding.checks.accumulation_axes is empty: k = 1, sp > 1
                                    beside XLA's fsdp or an expert axis; every pipeline schedule
                                    reduces over data once per step: pipeline/engine.py);
                                    P' counts this device's E/ep experts (they are reduced over
                                    data), and of the wk, wv that tensor replicates (t does not
                                    divide K) one kv head when reduced per microbatch: each
                                    device's gradient covers the head it uses, and XLA reduces
                                    that slice over data before the tensor sum. With `expert`
                                    in the step's region too (MoE, ep > 1) the other weights'
                                    sum is all-reduced over data and expert together (N = dp·ep,
                                    counted here; under expert at dp = 1)
  fsdp    k·((3c·(w + h) + 4h)·f + 8n)·(f-1)/f    XLA's ZeRO-3 per microbatch, w the layers' weights
                                    of the device (after the fsdp split), h the head's as the
                                    embedding's: the layers' weights all-gathered forward
                                    and again backward in the compute dtype (cast, then
                                    gathered), the embedding and head forward only (the head's
                                    kept for backward, the lookup's backward needs no table);
                                    the gradients reduce-scattered as G_c, the norms (not split)
                                    all-reduced in fp32; with parallel.fsdp_gather_once
                                    ((c + 4)·(P'-n)·f + 8n)·(f-1)/f: the weights gathered whole
                                    in the compute dtype once per step, the fp32 gradient sum
                                    reduce-scattered once (norms all-reduced); so too under
                                    every pipeline schedule (pipeline/engine.py), manual over
                                    fsdp (the device's E/ep experts included), the embedding
                                    and head, stored 1/p a stage, first gathered whole over
                                    stage (2h of P'·f, not 2h/p; in the 1F1B family the head's
                                    columns alone where tools.shape.held_tables: h + h/p).
                                    Under remat with
                                    explicit TP the layers gather inside their checkpoint
                                    (sharding.tensor_parallel.TensorParallel.gather_in_checkpoint):
                                    unrolled, XLA merges each microbatch's forward and
                                    backward gathers there, the census reads 0.72-0.84x this;
                                    scanned it reads 1.000x (the head gathered before its
                                    region: TensorParallel.logits)
  expert  k · 2 · G'(ep-1)/ep       G' = G_c less the routed experts: every other weight treats
                                    `expert` as a data axis, reduced per microbatch where XLA
                                    places the reductions (beside XLA's ZeRO-3, or at k = 1);
                                    where it is one of the step's accumulation axes (every
                                    pipeline's too), once per step with data's (above)
          + all-to-alls, per MoE layer and microbatch: dispatch and combine forward, their
          transposes backward, 4 · (ep-1)/ep · ep·S·D·c; dropless adds the int32 expert ids
          forward, (ep-1)/ep · ep·S·4; remat=full repeats the forward's (6 and 2 ids;
          modelled, not measured). `expert()` returns the all-to-all bytes alone; none at ep = 1
  tensor  per microbatch, S = b·L·D·c: (4 + r) · 2S(t-1)/t per layer, 2 all-reduces forward
          and 2 backward (with sequence parallelism an all-gather and a reduce-scatter for each,
          the same bytes); plus 2 · 2S(t-1)/t per microbatch for the vocab-parallel embedding
          (its lookup's all-reduce forward) and head (its input gradient's all-reduce
          backward; under gpipe and interleaved each stage's head runs C = ceil(M/p)
          microbatches, `heads`; in the 1F1B family every stage runs all k heads on its slice
          of the vocabulary, the input gradient summed in fp32: `head_dx`, pipeline/head.py;
          compiled for H100s, XLA folds that all-reduce over tensor and the one over stage
          after it into one over both, which moves less: see stage); under sequence parallelism the same bytes, the embedding's reduce-scatter
          forward and all-gather backward, the head's all-gather forward and reduce-scatter
          backward (sharding/tensor_parallel.py); plus, when t does not
          divide K, the all-reduce of the replicated wk, wv gradients (2·D·K·H fp32 per layer).
          r: remat=full recomputes the layer's forward in the backward, but only what the
          backward reads: the attention output's all-reduce (its sum feeds the MLP), not the
          MLP's (its sum only makes the layer's output, which the backward never reads), so
          r = 1; under sequence parallelism the recompute runs all-gather, reduce-scatter,
          all-gather (the MLP's reduce-scatter is dead the same way): r = 1.5. remat=attn keeps
          q, k, v and the core's output and recomputes the rest: the same r. remat=dots keeps
          each row-parallel region's sum (sharding.tensor_parallel.SUM) in place of the partial
          matmul output it sums, so r = 0; under sequence parallelism the recompute still
          all-gathers the column regions' inputs (Megatron's choice too: [B, L/T, D] kept, not
          [B, L, D]), r = 1. The census of the compiled tiny step on dp=2,tp=4 agrees within
          0.1% for each policy, with and without SP (tests/test_hlo.py). The 1F1B
          family's tick program embeds in every F cell, V·k lookups (`extra_embeddings`), and
          runs the lookup's backward k times, at stage 0's chunk-0 B ticks. The census of tiny on pp=2,tp=2
          agrees within 1% with and without SP and remat full (tests/test_pipeline.py: 1f1b,
          zb-h1 and zbv; interleaved-1f1b measured alike; the census counts a cell's
          collectives per cell run: pipeline.tick_program.cell_shares). gpipe and interleaved
          run their chunk in every tick, idle ones on zeros: the layers' collectives (tensor,
          expert, sequence) run T/V times per step, not k (`layer_runs`; tiny's census on
          pp=2,tp=2 under gpipe: (M+1)/M of the k-count before the contract counted it).
  sequence the gradients per microbatch, as over data (every weight is replicated over
          sequence): k · 2 · G_c(N-1)/N; where the accumulation region is manual over sequence
          too (sharding.checks.accumulation_axes), once per step in one all-reduce over data
          and sequence together, 2 · G(N-1)/N with N = dp·sp, counted under data where dp > 1
          (the census counts a collective under its first axis);
          plus K and V per layer and microbatch, E = b·(L/sp)·K'·H elements of one local block
          (K' = the kv heads of the device: K/t, or 1 when t does not divide K):
            ring       2E(sp-1)·c forward; backward 2E(sp-1)·c (K, V again) + 2E(sp-1)·4
                       (dK, dV in fp32 travel with their blocks) + 2E·c (the last send
                       takes them home, cast to the compute dtype first)
            allgather  2E(sp-1)·c forward (all-gather); backward 2E(sp-1)·c (gathered
                       again) + 2E(sp-1)·4 (reduce-scatter of dK, dV in fp32)
          remat=full adds nothing: the recomputed forward needs the blocks the backward sends
          again, and XLA merges the two (the census of tiny on dp=2,sp=4 shows one set)
            gspmd      2 all-gathers of K and V per layer forward, 2 reduce-scatters backward
  (data and fsdp times k: the compiled step gathers the weights and reduces the gradients in
  each microbatch of the accumulation scan, as the census of a k > 1 step shows)
  stage   what the lock-step tick programs send (pipeline/), bubble ticks included, with
          a = b·L·D·c one microbatch's activations (b·L·D·c/t under sequence parallelism; without
          it every tensor rank holds the whole and sends its copy) and T the ticks of the
          schedule's table,
          counted for the stage that sends the most (tools.hlo.per_device: a permute down the
          stages has no sender on the last, one up none on the first):
            1F1B family  (T_down + T_up)·a: each permute runs at the ticks at which some
                         stage receives by it (pipeline_figures' `permute_ticks`,
                         pipeline.tick_program.moves;
                         T_down, T_up <= T, the table's ticks): the activations on, the
                         cotangents back; max(T_down, T_up)·a at p = 2 but on
                         interleaved-1f1b's ring (stage 0 sends only down, stage 1 only up);
                         plus, on every stage, the head over the stages (pipeline/head.py)
                         at each of the k head ticks: all-reduces of the chunk output
                         broadcast, a, of the head's input gradient in fp32, a·4/c, and of
                         the [b, L] max and [2, b, L] sums of the loss in fp32 (T = b·L/sp
                         tokens), 2·(a + a·4/c + 12·T)·(p-1)/p. Compiled for H100s without
                         sequence parallelism, XLA folds the input gradient's all-reduce over
                         tensor and this one into one over both axes ("stage+tensor" in the
                         census), which moves less: llama3-8b pp=4,tp=2 0.951x the contract's
                         stage and tensor bytes (XLA CPU keeps the two, as counted here;
                         bench/results/head-over-stages-h100-compiled.json)
            gpipe, interleaved  2T·a: T forward ticks on a ring, autodiff's transpose as many
                         back; plus the last stage's outputs dealt out to the stages'
                         heads (C = ceil(M/p) each, pipeline.circular.dealt): stage p-1
                         sends (p-1)·C·a forward, every other stage its C·a of cotangents
                         back
            every schedule  plus the weights every stage uses whole: the embedding and head,
                         stored 1/p a stage (pipeline/stage_weights.py), gathered in the
                         compute dtype and their fp32 sums (each nonzero on the stage that
                         uses it) reduce-scattered, (c + 4)·2h·(p-1)/p, and the final norm's
                         fp32 sum all-reduced, 2·4·D·(p-1)/p (where fsdp·p does not divide D
                         the tables are stored whole, their sums all-reduced: 2·4·(2h + D)·(p-1)/p);
                         in the 1F1B family where p divides V/t (tools.shape.held_tables) each
                         stage takes only its columns of the head, by all-to-all over stage,
                         and sends their gradient back by another: (c + 4)·(h + h/p)·(p-1)/p
            V > 1        plus the layers laid out from the stored split every step
                         (`layout`, pipeline/layout.py): the chunks stored on the device that
                         run elsewhere (of V, P_l/V each, P_l the stage's layer weights) leave
                         in the compute dtype and their fp32 gradients come back
          The census of tiny on pp=2 and pp=4 equals it within a scalar's bytes for every
          schedule (tests/test_pipeline.py).
          The contract of DESIGN.md (one permute per microbatch and boundary, 2k·a) is what
          must travel: gpipe with M ≫ p comes close to it; the 1F1B family at p = 2 sends it
          (M each way), at p > 2 more (in one steady tick some stages run F and others B, and
          a permute moves a buffer between every pair: 1f1b at p = 4, M = 8 moves down at 15
          and up at 17 of its 22 ticks; before 2026-12-02 at every tick, 2T).
          The bubble is the lock-step weighted bubble of the schedule's table
          (pipeline.schedule.weighted: every tick lasts as long as its most expensive cell) with
          `pipeline_figures.cell_costs`: F = 1, B = 2, or split (zb-h1, zbv) B = 1 and W = 1; B one more under
          model.remat=full (the layers' forward recomputed). gpipe
          (p-1)/(M+p-1), interleaved (p-1)/(V·M+p-1); 1f1b 1 - M(F+B)/(2M·B + (p-1)(F+B) - (B-F))
          (its F ticks last a B); zb-h1 (p-1)/(3M+p-1) (units), zbv (p-1)/(6M+p-1) (half-stage
          units); interleaved-1f1b from its table. These are without the head: cell_costs
          counts its forward and backward too (h chunk forwards), in the 1F1B family split
          over the stages at its M head ticks (+M·h/p of lock-step time and of every stage's
          work) and gpipe's and interleaved's ceil(M/p) heads a stage (pipeline/schedule.py,
          Head)
Links: each axis's bytes / its link: NVLink 450 GB/s per GPU when the axis and the axes inside
it fit in one node of 8 GPUs, InfiniBand 50 GB/s per GPU (400 Gb/s NIC per GPU) otherwise.
With measured links (`tools.plan --bandwidth`, read by tools/bandwidth.py) an axis they cover
takes latency + bytes / busbw of its fit instead: the contract's bytes are bus bytes, as
nccl-tests counts them.
"""

from __future__ import annotations

import math

from configs.base import RunConfig
from pipeline.layout import leaving
from sharding.checks import accumulation_axes, dealt_heads
from sharding.mesh import AXES
from tools.pipeline_figures import STASHING, pipeline_figures, virtual
from tools.shape import DTYPE_BYTES, dispatch_rows, held_tables, local_param_parts, shape, table_split

NVLINK, INFINIBAND, GPUS_PER_NODE = 450e9, 50e9, 8
# r per remat policy, (plain TP, sequence parallelism): the tensor all-reduces a layer's backward
# runs again (module docstring)
RECOMPUTED = {"none": (0.0, 0.0), "dots": (0.0, 1.0), "attn": (1.0, 1.5), "full": (1.0, 1.5)}
Links = dict[str, tuple[float, float]]  # measured {axis: (latency_s, bytes_per_s)}


def communication(cfg: RunConfig, sizes: dict[str, int]) -> dict[str, float]:
    """Bytes per device per step on each mesh axis of size > 1 (the contract formulas)."""
    m, s, f = cfg.model, shape(cfg, sizes), sizes["fsdp"]
    c = DTYPE_BYTES[m.compute_dtype]
    non_expert, experts = local_param_parts(cfg, sizes)
    frac = {a: (n - 1) / n for a, n in sizes.items()}
    act = s.tokens * m.d_model * c  # S: one layer's input for one microbatch (its L/sp rows)
    sp = cfg.parallel.sequence_parallel
    recompute = RECOMPUTED[m.remat][sp]  # r of the module docstring
    kv_replicated = m.n_kv_heads % sizes["tensor"] != 0
    kv_grads = 2 * 4 * m.d_model * m.n_kv_heads * m.head_dim * kv_replicated
    layer_tensor = s.layers * ((4 + recompute) * 2 * act + 2 * kv_grads)  # one microbatch through the layers
    local = accumulation_axes(cfg, sizes)  # gradients reduced once per step (training/step.py)
    own = non_expert + experts  # P': this device's parameters (norms whole, the rest split by fsdp)
    # XLA's per-microbatch reduction over data takes one kv head of the replicated wk, wv per
    # device, not all K; the step's once-per-step psum takes the whole (tensor-summed) weights
    own -= kv_replicated * (not local) * s.layers * 2 * m.d_model * (m.n_kv_heads - 1) * m.head_dim / f
    head, norms, _ = small_parts(cfg, sizes)
    reduced, expert_share = per_microbatch_reductions(cfg, sizes, own, experts)
    data = (2 * 4 * own if "data" in local else 2 * reduced) * frac["data"]
    sequence = 2 * reduced * frac["sequence"]
    expert_grads = 2 * (reduced - expert_share) * frac["expert"]
    if "sequence" in local:  # one all-reduce over data and sequence together, counted under the first
        n = sizes["data"] * sizes["sequence"]
        once = 2 * 4 * own * (n - 1) / n
        data, sequence = (once, 0.0) if sizes["data"] > 1 else (0.0, once)
    if "expert" in local:  # the same over data and expert, the routed experts (split over expert) over data alone
        n = sizes["data"] * sizes["expert"]
        once = 2 * 4 * (own - experts) * (n - 1) / n
        data = 2 * 4 * experts * frac["data"] + (once if sizes["data"] > 1 else 0.0)
        expert_grads = 0.0 if sizes["data"] > 1 else once
    if "fsdp" in local:  # gathered whole once per step, the fp32 sum reduce-scattered once; the
        # embedding and head gathered over stage first (2h a device), reduce-scattered over stage after;
        # the head's columns alone (h/p) where they come by all-to-all over stage (pipeline/head.py)
        tables = (held_tables(cfg, sizes) - 2 / table_split(cfg, sizes)) * head  # beyond the stored ones
        fsdp = ((c + 4) * (own - norms + tables) * f + 8 * norms) * frac["fsdp"]
    else:  # ZeRO-3 per microbatch: the layers' weights gathered twice, embedding and head once
        layers = own - norms - 2 * head
        fsdp = s.k * ((3 * c * (layers + head) + 4 * head) * f + 8 * norms) * frac["fsdp"]
    volume = {
        "stage": stage(cfg, sizes),
        "data": data,
        "fsdp": fsdp,
        "expert": expert_grads + expert(cfg, sizes),
        "sequence": sequence + context(cfg, sizes),
        "tensor": (layer_runs(cfg, sizes) * layer_tensor + (s.k + heads(cfg, sizes) * head_dx(cfg, sizes)) * 2 * act
                   + extra_embeddings(cfg, sizes) * act) * frac["tensor"],
    }
    return {a: v for a, v in volume.items() if sizes[a] > 1}


def layer_runs(cfg: RunConfig, sizes: dict[str, int]) -> float:
    """How many times per step the device's layers run a microbatch's worth of their per-layer
    collectives (tensor, expert, sequence): k, but T/V under gpipe and interleaved, whose idle
    ticks run their chunk on zeros, collectives included (T the table's ticks: M·V + p - 1)."""
    if circular(cfg, sizes):
        return pipeline_figures(cfg, sizes)["ticks"] / virtual(cfg)
    return shape(cfg, sizes).k


def heads(cfg: RunConfig, sizes: dict[str, int]) -> int:
    """How many microbatches' heads a device runs per step: k, but under gpipe and interleaved
    ceil(M/p), the M outputs dealt out over the stages, padded (pipeline.circular.dealt)."""
    k = shape(cfg, sizes).k
    return dealt_heads(k, sizes["stage"]) if circular(cfg, sizes) else k


def head_dx(cfg: RunConfig, sizes: dict[str, int]) -> float:
    """The head's tensor bytes per microbatch in units of 2S(t-1)/t: 1, but in the 1F1B family's
    head over the stages, whose input gradient is summed in fp32 (a partial sum over stage too:
    pipeline/head.py), 4/c for its all-reduce, and under sequence parallelism (1 + 4/c)/2: the
    forward's all-gather in the compute dtype, the backward's reduce-scatter in fp32."""
    if sizes["stage"] == 1 or circular(cfg, sizes):
        return 1.0
    wide = 4 / DTYPE_BYTES[cfg.model.compute_dtype]
    return (1 + wide) / 2 if cfg.parallel.sequence_parallel else wide


def circular(cfg: RunConfig, sizes: dict[str, int]) -> bool:
    """Whether the step is pipelined by gpipe or interleaved (pipeline/circular.py)."""
    return sizes["stage"] > 1 and cfg.parallel.schedule not in STASHING


def extra_embeddings(cfg: RunConfig, sizes: dict[str, int]) -> float:
    """The vocab-parallel lookups' tensor collectives beyond the k microbatches' that the 1F1B
    family's tick program runs, in units of S(t-1)/t (the module docstring's 2 per embedding:
    without sequence parallelism the forward's all-reduce, 2, and no backward collective; with
    it the forward's reduce-scatter, 1, and the backward's all-gather, 1). Every F cell embeds,
    selected on stage 0's chunk 0 (pipeline.cells._forward): V·k forwards on each stage, (V-1)·k
    more. The backward runs k times, at the ticks of stage 0's chunk-0 B cells
    (pipeline.tick_program.embeds_back). None elsewhere."""
    if sizes["stage"] == 1 or cfg.parallel.schedule not in STASHING:
        return 0.0
    forwards = (virtual(cfg) - 1) * shape(cfg, sizes).k
    return forwards * (1 if cfg.parallel.sequence_parallel else 2)


def small_parts(cfg: RunConfig, sizes: dict[str, int]) -> tuple[float, float, float]:
    """(h, n, r) of the module docstring, parameters per device: the head's share (the
    embedding's too), V·D/(f·t); the norms', (2X + 1)·D (not split); the routers', D·E/f per MoE
    layer (X and the MoE layers this stage's)."""
    m, s = cfg.model, shape(cfg, sizes)
    return (m.vocab_size * m.d_model / (sizes["fsdp"] * sizes["tensor"]), (2 * s.layers + 1) * m.d_model,
            s.moe * m.d_model * m.n_experts / sizes["fsdp"])


def per_microbatch_reductions(cfg: RunConfig, sizes: dict[str, int], own: float,
                              experts: float) -> tuple[float, float]:
    """(bytes, of which routed experts) per step of the gradients a reduction per microbatch
    moves (module docstring, G_c), `own` the device's parameters P': k·G_c, but under gpipe and
    interleaved (autodiff's transpose of the tick scan, where XLA keeps a batch axis:
    sequence under context_impl=gspmd) the layers' gradients are reduced in every tick, bubble
    ticks included (T/V per chunk), and the head's, the embedding's and the norms' once (the lookup and the head's one
    batch or scan take the M microbatches at once)."""
    s, c = shape(cfg, sizes), DTYPE_BYTES[cfg.model.compute_dtype]
    head, norms, routers = small_parts(cfg, sizes)
    layers = c * (own - 2 * head / table_split(cfg, sizes) - norms - routers) + 4 * routers  # experts included
    trips = layer_runs(cfg, sizes)
    once = 1 if circular(cfg, sizes) else s.k
    return trips * layers + once * (4 * head + c * head + 4 * norms), trips * c * experts


def stage(cfg: RunConfig, sizes: dict[str, int]) -> float:
    """Bytes per device per step over stage (module docstring): the tick programs' permutes and
    all-reduces; none at p = 1."""
    m, s, p = cfg.model, shape(cfg, sizes), sizes["stage"]
    if p == 1:
        return 0.0
    split = sizes["tensor"] if cfg.parallel.sequence_parallel else 1  # else every tensor rank sends its copy
    a = s.tokens * m.d_model * DTYPE_BYTES[m.compute_dtype] / split
    schedule = cfg.parallel.schedule
    ring = virtual(cfg) > 1 and schedule != "zbv" or schedule not in STASHING  # gpipe, interleaved: rings
    # the ticks each permute moves: every tick under gpipe and interleaved, the 1F1B family's `moves`
    down, up = pipeline_figures(cfg, sizes)["permute_ticks"]
    # down from every stage but the last, up from every stage but the first; both from each on a ring
    sends = [((ring or d < p - 1) * down + (ring or d > 0) * up) * a for d in range(p)]
    if circular(cfg, sizes):  # the outputs dealt to the stages' heads: p-1 sends each C forward, each its C back
        sends = [x + heads(cfg, sizes) * a * (p - 1 if d == p - 1 else 1) for d, x in enumerate(sends)]
    if not circular(cfg, sizes):  # the 1F1B family's head over the stages, every stage at each of k head ticks:
        # the chunk output broadcast (c), dh summed (fp32), the [b, L] max and [2, b, L] sums (fp32)
        statistics = 3 * 4 * s.tokens
        sends = [x + heads(cfg, sizes) * 2 * (a * (1 + 4 / DTYPE_BYTES[m.compute_dtype]) + statistics) * (p - 1) / p
                 for x in sends]
    h = small_parts(cfg, sizes)[0]  # embedding and head, 2h: stored 1/p a stage where split
    if table_split(cfg, sizes) > 1:  # gathered in the compute dtype, reduce-scattered in fp32; the head's
        # columns by all-to-all over stage, forward and back, each of 1/p of the stored h/p (pipeline/head.py)
        tables = held_tables(cfg, sizes) * h
        reduced = (DTYPE_BYTES[m.compute_dtype] + 4) * tables * (p - 1) / p + 2 * 4 * m.d_model * (p - 1) / p
    else:  # the fp32 sums all-reduced, the final norm's too
        reduced = 2 * 4 * (2 * h + m.d_model) * (p - 1) / p
    return reduced + max(x + y for x, y in zip(sends, layout(cfg, sizes), strict=True))


def layout(cfg: RunConfig, sizes: dict[str, int]) -> list[float]:
    """Per stage, the bytes of laying its layers out from the stored split every step
    (pipeline/layout.py): its `leaving` chunks of layer weights (of V) leave it in the compute
    dtype, and as many chunks' fp32 gradients come back from it (pipeline/engine.py). All 0 at
    V = 1."""
    m, p, v = cfg.model, sizes["stage"], virtual(cfg)
    tables = 2 * small_parts(cfg, sizes)[0] / table_split(cfg, sizes)
    layers = sum(local_param_parts(cfg, sizes)) - tables - m.d_model  # less embedding, head, final norm
    c = DTYPE_BYTES[m.compute_dtype]
    chunk = layers / v * (c + 4)
    return [n * chunk for n in leaving(p, v, vee=cfg.parallel.schedule == "zbv")]


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
    return layer_runs(cfg, sizes) * s.moe * (ep - 1) * ((2 * forwards + 2) * rows * m.d_model
                                                        * DTYPE_BYTES[m.compute_dtype] + ids)


def context(cfg: RunConfig, sizes: dict[str, int]) -> float:
    """K and V bytes per device per step over the sequence axis (module docstring); none at sp = 1."""
    m, s, sp, tp = cfg.model, shape(cfg, sizes), sizes["sequence"], sizes["tensor"]
    c, impl = DTYPE_BYTES[m.compute_dtype], cfg.parallel.context_impl
    if sp == 1:
        return 0.0
    if impl == "gspmd":
        return 2 * layer_runs(cfg, sizes) * s.layers * s.tokens * 2 * m.n_kv_heads * m.head_dim * c * (sp - 1)
    e = s.b * cfg.train.seq_len // sp * (m.n_kv_heads // tp if m.n_kv_heads % tp == 0 else 1) * m.head_dim
    home = 2 * e * c if impl == "ring" else 0.0  # the ring's last send takes dK, dV home, cast
    return layer_runs(cfg, sizes) * s.layers * (2 * 2 * e * (sp - 1) * c + 2 * e * (sp - 1) * 4 + home)


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
