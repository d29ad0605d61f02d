"""The analytic communication model of a run: bytes per device per step on each mesh axis
(the stage axis's in tools/pipeline_traffic.py, the time on each axis's link in tools/links.py).

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
          head's and the routers' (their matmuls make fp32 logits) and the norms' in fp32
          (the head's in the compute dtype where its region sums it, SP or context beside
          explicit TP: `head_grad`); h = V·D/(f·t), n the norms' (2X + 1)·D, r the routers' D·E/f per MoE layer.
          Under gpipe and interleaved where a batch axis is not manual (sequence
          under context_impl=gspmd: XLA's reduction inside autodiff's transpose of the tick
          scan) XLA reduces the layers' gradients in every tick, bubble ticks included (T/V
          times, T the table's ticks), the head's, the embedding's and norms' once per step
          (`per_microbatch_reductions`)
  data    2 · G(N-1)/N              the gradient reductions over the batch axes a weight is
                                    replicated on (data, expert, sequence; the routed experts
                                    split over expert: data, sequence), in groups: over the
                                    step's accumulation axes (sharding.checks.accumulation_axes;
                                    every pipeline schedule's: pipeline/engine.py) once per step,
                                    the k microbatches' fp32 sum (G); over the others, where XLA
                                    places the reductions (k = 1, or sp > 1 beside XLA's fsdp or
                                    an expert axis), as the backward leaves them (G_c, k times;
                                    the embedding's and head's once where the step's own scan
                                    runs the k: XLA GPU moves them out of it,
                                    `per_microbatch_reductions`).
                                    Each group is one all-reduce over all its axes together, N
                                    their product, counted under its first axis (as the census
                                    counts a collective): data where dp > 1. Counted apart, the
                                    census of XLA's joint reduction read 1.5x on data at k = 1 on
                                    dp=2,sp=2 and dp=2,fsdp=2,sp=2 (tiny, 125m), 1.1-2.7x beside
                                    expert (bench/results/joint-reduction-h100-compiled.json,
                                    moe-region-fsdp-h100-compiled.json).
                                    P' counts this device's E/ep experts, and of the wk, wv that
                                    tensor replicates (t does not divide K) one kv head when
                                    reduced per microbatch: each device's gradient covers the head
                                    it uses, and XLA reduces that slice before the tensor sum
  fsdp    k·((3c·(w + h) + 4h)·f + 8n)·(f-1)/f    XLA's ZeRO-3 per microbatch, w the layers' weights
                                    of the device (after the fsdp split), h the head's as the
                                    embedding's: the layers' weights all-gathered forward
                                    and again backward in the compute dtype (cast, then
                                    gathered; once, 2c·w for 3c·w, where one gather serves
                                    both: unrolled layers under remat none without a tensor
                                    axis, or in shard_map regions but for plain TP under remat
                                    none: tools.shape.layer_gathers; the MoE regions' experts and
                                    routers scanned under remat none once: expert_gathers),
                                    the embedding and head forward only (the head's
                                    kept for backward, the lookup's backward needs no table);
                                    the gradients reduce-scattered as G_c (under sequence
                                    parallelism the head's in the compute dtype: c·h for
                                    4h; XLA reduces it before its cast), the norms (not split)
                                    all-reduced in fp32; with parallel.fsdp_gather_once
                                    ((c + 4)·(P'-n)·f + 8n)·(f-1)/f: the weights gathered whole
                                    in the compute dtype once per step, the fp32 gradient sum
                                    reduce-scattered once (norms all-reduced); so too under
                                    every pipeline schedule (pipeline/engine.py), manual over
                                    fsdp (the device's E/ep experts included), the embedding
                                    and head, stored 1/p a stage, first gathered whole over
                                    stage (2h of P'·f, not 2h/p; in the 1F1B family the head's
                                    columns alone where tools.shape.held_tables: h + h/p).
                                    Under remat with explicit TP the layers gather inside
                                    their checkpoint (sharding.tensor_parallel.TensorParallel.
                                    gather_in_checkpoint): unrolled, the one gather
                                    (layer_gathers); scanned, two (the head once: sharding.
                                    vocab_parallel.vocab_parallel_logits). Scanned under remat
                                    none in regions manual over fsdp (SP, context), once: they
                                    gather the weights themselves and the scan keeps them
                                    (TensorParallel.gather_in_region, layer_gathers)
  expert  2 · G'(ep-1)/ep           G' = G_c (or G) less the routed experts: every other weight
                                    treats `expert` as a data axis (above), counted here where
                                    it leads its group (no data in it)
          + all-to-alls, per MoE layer and microbatch: dispatch and combine forward, their
          transposes backward, 4 · (ep-1)/ep · ep·S·D·c; dropless adds the int32 expert ids
          forward, (ep-1)/ep · ep·S·4; remat=full repeats the forward's (6 and 2 ids;
          modelled, not measured). `expert()` returns the all-to-all bytes alone; none at ep = 1
  tensor  per microbatch, S = b·L·D·c: (4 + r) · 2S(t-1)/t per layer, 2 all-reduces forward
          and 2 backward (with sequence parallelism an all-gather and a reduce-scatter for each,
          the same bytes); plus 2 · 2S(t-1)/t per microbatch for the vocab-parallel embedding
          (its lookup's all-reduce forward) and head (its input gradient's all-reduce
          backward; under gpipe and interleaved each stage's head runs C = ceil(M/p)
          microbatches, tools.pipeline_traffic.heads; in the 1F1B family every stage runs all k heads on its slice
          of the vocabulary, the input gradient summed in fp32: pipeline_traffic.head_dx, pipeline/head.py;
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
          family's tick program embeds in every F cell, V·k lookups (pipeline_traffic.extra_embeddings), and
          runs the lookup's backward k times, at stage 0's chunk-0 B ticks. The census of tiny on pp=2,tp=2
          agrees within 1% with and without SP and remat full (tests/test_pipeline.py: 1f1b,
          zb-h1 and zbv; interleaved-1f1b measured alike; the census counts a cell's
          collectives per cell run: pipeline.tick_program.cell_shares). gpipe and interleaved
          run their chunk in every tick, idle ones on zeros: the layers' collectives (tensor,
          expert, sequence) run T/V times per step, not k (pipeline_traffic.layer_runs; tiny's census on
          pp=2,tp=2 under gpipe: (M+1)/M of the k-count before the contract counted it).
  sequence the gradients, as over data (every weight is replicated over sequence), counted
          here where it leads its group (no data or expert in it);
          plus K and V per layer and microbatch, E = b·(L/sp)·K'·H elements of one local block
          (K' = the kv heads of the device: K/t, or 1 when t does not divide K):
            ring       2E(sp-1)·c forward; backward 2E(sp-1)·c (K, V again) + 2E(sp-1)·4
                       (dK, dV in fp32 travel with their blocks) + 2E·c (the last send
                       takes them home, cast to the compute dtype first); with a fused
                       core (pallas) the first of the fp32 sends in c: the block's own
                       dK, dV leave the kernel in c, and XLA sends them before their cast
            allgather  2E(sp-1)·c forward (all-gather); backward 2E(sp-1)·c (gathered
                       again) + 2E(sp-1)·4 (reduce-scatter of dK, dV in fp32)
          remat=full adds nothing: the recomputed forward needs the blocks the backward sends
          again, and XLA merges the two (the census of tiny on dp=2,sp=4 shows one set);
          unrolled layers under remat none send K and V once: forward and backward are one
          program with nothing between them, and XLA merges the backward's sends (or gathers)
          with the forward's. Compiled for H100s with the pallas core, the ring read 0.80x
          (sp=2), 0.92x (sp=4) and 0.97x (sp=8) of the count without the first hop in c, and
          unrolled under remat none the ring 0.60x and the all-gathers 0.75x of one with the
          second set; 1.00x now (bench/results/joint-reduction-h100-compiled.json)
            gspmd      2 all-gathers of K and V per layer forward, 2 reduce-scatters backward:
                       the least it needs; XLA's partitioner moves more (it gathers the
                       queries too): compiled for H100s, tiny on dp=2,sp=2 moves 5.0x this
                       over sequence with the pallas core, 7.3x with the xla core (not modelled)
  (data and fsdp times k: the compiled step gathers the weights and reduces the gradients in
  each microbatch of the accumulation scan, as the census of a k > 1 step shows)
  stage   what the pipeline's tick programs send, and its tables' gathers: tools/pipeline_traffic.py
Each axis's time on its link: tools/links.py.
"""

from __future__ import annotations

import math

from configs.base import RunConfig
from sharding.checks import accumulation_axes, explicit_context, explicit_tensor
from tools.pipeline_traffic import circular, extra_embeddings, head_dx, heads, layer_runs, stage
from tools.shape import (DTYPE_BYTES, core, dispatch_rows, expert_gathers, held_tables, layer_gathers,
                         local_param_parts, shape, small_parts, table_split)

# r per remat policy, (plain TP, sequence parallelism): the tensor all-reduces a layer's backward
# runs again (module docstring)
RECOMPUTED = {"none": (0.0, 0.0), "dots": (0.0, 1.0), "attn": (1.0, 1.5), "full": (1.0, 1.5)}


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
    head, norms, routers = small_parts(cfg, sizes)
    reduced, expert_share = per_microbatch_reductions(cfg, sizes, own, experts)
    # each gradient is all-reduced over the batch axes it is replicated on, one group for the
    # step's accumulation axes (the fp32 sum, once per step) and one for the others (as the
    # backward leaves it, per microbatch), counted under the group's first axis
    grads = dict.fromkeys(("data", "expert", "sequence"), 0.0)
    for axes, once, per_microbatch in ((("data", "expert", "sequence"), own - experts, reduced - expert_share),
                                       (("data", "sequence"), experts, expert_share)):  # the routed experts
        for held, weights in ((True, 4 * once), (False, per_microbatch)):
            group = [a for a in axes if sizes[a] > 1 and (a in local) == held]
            if group:
                n = math.prod(sizes[a] for a in group)
                grads[group[0]] += 2 * weights * (n - 1) / n
    if "fsdp" in local:  # gathered whole once per step, the fp32 sum reduce-scattered once; the
        # embedding and head gathered over stage first (2h a device), reduce-scattered over stage after;
        # the head's columns alone (h/p) where they come by all-to-all over stage (pipeline/head.py)
        tables = (held_tables(cfg, sizes) - 2 / table_split(cfg, sizes)) * head  # beyond the stored ones
        fsdp = ((c + 4) * (own - norms + tables) * f + 8 * norms) * frac["fsdp"]
    else:  # ZeRO-3 per microbatch: the layers' weights gathered twice (once where one gather serves
        # the forward and the backward: tools.shape.layer_gathers), embedding and head once
        routed = experts + routers  # the MoE regions' weights (tools.shape.expert_gathers)
        layers = own - norms - 2 * head - routed
        gathered = (layer_gathers(cfg, sizes) + 1) * layers + (expert_gathers(cfg, sizes) + 1) * routed
        fsdp = s.k * ((c * gathered + 3 * c * head + head_grad(cfg, sizes) * head) * f + 8 * norms) * frac["fsdp"]
    volume = {
        "stage": stage(cfg, sizes),
        "data": grads["data"],
        "fsdp": fsdp,
        "expert": grads["expert"] + expert(cfg, sizes),
        "sequence": grads["sequence"] + context(cfg, sizes),
        "tensor": (layer_runs(cfg, sizes) * layer_tensor + (s.k + heads(cfg, sizes) * head_dx(cfg, sizes)) * 2 * act
                   + extra_embeddings(cfg, sizes) * act) * frac["tensor"],
    }
    return {a: v for a, v in volume.items() if sizes[a] > 1}


def per_microbatch_reductions(cfg: RunConfig, sizes: dict[str, int], own: float,
                              experts: float) -> tuple[float, float]:
    """(bytes, of which routed experts) per step of the gradients a reduction per microbatch
    moves (module docstring, G_c), `own` the device's parameters P': k·G_c, but
    - under gpipe and interleaved (autodiff's transpose of the tick scan, where XLA keeps a
      batch axis: sequence under context_impl=gspmd) the layers' gradients are reduced in every
      tick, bubble ticks included (T/V per chunk), and the head's, the embedding's and the
      norms' once (the lookup and the head's one batch or scan take the M microbatches at once);
    - in the step's own microbatch scan (k > 1 with no accumulation region: sp > 1 beside XLA's
      fsdp or an expert axis, training/step.py) XLA GPU moves the embedding's and the head's
      all-reduces out of the loop (their sums only feed its accumulator): once per step, in
      the dtype they leave the backward in. The layers' stay in it (the layer scan's, and
      unrolled ones' too), as do the norms' mostly (the final norm's leaves, and scanned
      tiny's all: 0.4% of its data bytes; not counted).
      Counted k times, XLA's census read 0.65x the contract on data on 125m dp=2,fsdp=2,sp=2
      at k = 4, 0.91x on tiny; 1.000x and 0.996x now (bench/results/hoisted-tables-h100-compiled.json).
      XLA CPU places these reductions otherwise (the CPU tests compare no such step with it)."""
    s, c = shape(cfg, sizes), DTYPE_BYTES[cfg.model.compute_dtype]
    head, norms, routers = small_parts(cfg, sizes)
    layers = c * (own - 2 * head / table_split(cfg, sizes) - norms - routers) + 4 * routers  # experts included
    trips = layer_runs(cfg, sizes)
    once = 1 if circular(cfg, sizes) else s.k
    tables = 1 if sizes["stage"] == 1 and not accumulation_axes(cfg, sizes) else once  # the step's own scan
    return trips * layers + tables * (head_grad(cfg, sizes) * head + c * head) + once * 4 * norms, trips * c * experts


def head_grad(cfg: RunConfig, sizes: dict[str, int]) -> int:
    """Bytes an element of the head's gradient is reduced in per microbatch: it leaves its matmul
    in the compute dtype and XLA reduces it after the cast to fp32, but where the head's region
    is manual over the batch axes (explicit TP with SP or context parallelism) the region sums
    it as it leaves (sharding/vocab_parallel.py)."""
    regions = cfg.parallel.sequence_parallel or explicit_context(cfg, sizes["sequence"]) is not None
    return DTYPE_BYTES[cfg.model.compute_dtype] if regions and explicit_tensor(cfg, sizes["tensor"]) else 4


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
    # K and V forward, and again backward but where XLA merges the two sends (one program, no loop
    # or recompute between them: unrolled layers under remat none)
    kv = (1 if not m.scan_layers and m.remat == "none" and sizes["stage"] == 1 else 2) * 2 * e * (sp - 1) * c
    if impl == "allgather":
        return layer_runs(cfg, sizes) * s.layers * (kv + 2 * e * (sp - 1) * 4)
    # dK, dV partial sums in fp32, but the first hop's in c where a fused core made them (XLA sends
    # them before their cast), and home in c (cast first)
    first = c if core(cfg, sizes) != "xla" else 4
    return layer_runs(cfg, sizes) * s.layers * (kv + 2 * e * (first + (sp - 2) * 4) + 2 * e * c)
