"""The analytic memory model of a run: bytes per device, term by term.

Pure arithmetic on the config and the schedule's timetable (pipeline/tables.py, weighed by
pipeline/schedule.py): no jax is imported, nothing traced or compiled, so `tools.search` can
rank hundreds of meshes in a second. Letters and the per-device shape: tools/shape.py; what a
layer and a pipeline chunk keep for backward, term by term: tools/activations.py.

Memory (bytes per device), the terms `memory()` returns:
  params      P_local · bytes(param_dtype)            P_local = P / (fsdp·tp·pp), norms whole
                                                       (the embedding and head split by pp
                                                       too where fsdp·pp divides D);
                                                       the routed experts (3·E·D·F_e per MoE
                                                       layer) / (ep·fsdp·tp), the router [D, E]
                                                       / fsdp, shared experts as a dense MLP
  optimizer   2 · P_local · bytes(param_dtype)         AdamW mu and nu
  gradients   P_local · 4                              fp32 (they arrive through the bf16 cast)
  update      P_local · 4 when replicated over fsdp    optax's clipped update, held beside the
              gradients (measured on XLA CPU: the optimizer phase holds about 2 gradient copies)
  gathered    FSDP as XLA's ZeRO-3 only: the head's weight gathered whole in the compute
              dtype, V·D/t·c (measured: halving llama3-8b's V, XLA GPU's peak fell by 2.0 and
              1.2 bytes per V·D beyond the stored shards and the logits, at k = 2 and 1;
              bench/results/estimate-zero3-tables-h100-compiled.json); XLA CPU (`cpu=`) also
              holds the two tables' whole fp32 gradients, which it all-reduces and slices where
              XLA GPU reduce-scatters: V·D/t·(c + 8), an upper bound (125m, 256 tokens a
              device, fp32 compute, c = 4: 9.7 bytes per V·D/t on fsdp=8 under remat none, 11.2
              under full; 8.0 on dp=2,fsdp=2,tp=2 under none). Until 2026-12-07 it counted
              both tables and both gradients, 16 bytes: llama3-8b's XLA GPU peak read 0.79-0.81x
              the estimate, and 1b's 1.08-1.11x only because XLA kept a fourth [T, F] array a
              layer that the saved activations do not count (model.mlp.swiglu)
  gathered layers  XLA's ZeRO-3 where it keeps each layer's forward gather for the backward
              (tools.shape.layers_gathered_once: unrolled layers under remat none, no tensor
              axis): the X/pp layers' weights whole in the compute dtype, (P_layers·f)·c, held
              from the forward to the backward (backward phase); 1b on fsdp=8, 8 x 2048 a
              device, compiled for H100s: XLA's peak 1.19x the estimate without it, 1.11x with
  gathered once  parallel.fsdp_gather_once, and every pipeline schedule under fsdp: the rest of the
              weights whole over fsdp in the compute dtype and a whole fp32 gradient
              accumulator: P_local·(fsdp-1)·(c + 4) (the embedding and head among them, so
              not `gathered` too: llama3-8b fsdp=4,tp=2 had read 0.71x XLA's peak)
  tables      pipelined, the embedding and head stored 1/pp a stage (tools.shape.table_split):
              gathered whole over stage for the step in the compute dtype, with their whole fp32
              gradient sums, 2·V·D/t·(pp-1)/pp·(c + 4) (pipeline/stage_weights.py); backward
              phase only (reduce-scattered before the update); in the 1F1B family where pp
              divides V/t (tools.shape.held_tables) the embedding's alone, each stage taking
              only its columns of the head, the 1/pp it stores
  cast        the 1F1B family: the device's own weights in the compute dtype, P_local·c, cast
              once per step before the tick loop and held through it (pipeline/one_f_one_b.py;
              under fsdp `gathered once` is the rest); backward phase only
  saved       activations kept for backward: X/pp layers of one microbatch; under gpipe and
              interleaved every tick's (the ticks of the schedule's table, V·M+p-1, of X/(p·V)
              layers: autodiff through the tick scan keeps the idle ticks' too; at least the
              table's in-flight peak, all M), each tick's what model.remat.stash_policy keeps of
              its chunk (pipeline/circular.py; `chunk_residuals`, as a 1F1B slot's), plus
              [M, b, L, D] embeddings, outputs and their cotangents; under the 1F1B family (1f1b,
              interleaved-1f1b, zb-h1, zbv) stage 0's in-flight peak of its table
              (pipeline.schedule.in_flight: p (microbatch, chunk) under 1f1b and zb-h1,
              2(p-1) + (V-1)p + 1 interleaved, 2p zbv) of residual slots, each one chunk's
              X/(pp·V) layers' residuals by the remat policy (remat full: the layers' inputs,
              X/(pp·V)·T·D), plus 3·T·D of inputs and gradients in flight, plus under zb-h1 and
              zbv the in-flight peak of B's stash for W (`zb_stash`); per layer and token:
              tools/activations.py
  accumulator k > 1 microbatches without a pipeline: the step's fp32 gradient sum, P_local·4,
              beside each microbatch's gradients (1b on one H100, 8 sequences a microbatch:
              36.04 GiB at k = 1, 40.16 at k = 2: +P·4); under fsdp_gather_once the local
              part of the whole accumulator, `gathered once` the rest. Under gpipe and
              interleaved the layers' gradients summed over the ticks in fp32
              (pipeline/circular.py), whole over fsdp: the device's layers (P_local less the
              embedding, head and final norm) · fsdp · 4 (1.81 GiB on 1b pp=2,dp=4). Against
              the sum in bf16, XLA's peak there (H100 compiles) rose 0.89 GiB under remat
              full and 0.79 under none; interleaved and 125m (whose peak falls in the head's
              backward, before the tick scan's) kept theirs
  working     the larger of: one layer's backward working set, and the logits [T, V/t] of the
              head and loss, in the compute dtype and in fp32 (after a gpipe/interleaved pipe
              under remat none of the ceil(M/p) microbatches dealt to the stage at once; in the
              1F1B family [T, V/(t·p)], the stage's slice of the vocabulary: pipeline/head.py;
              1b on an H100: 205,332 bytes per token beside the layers, the logits' 196,608).
              The working set is the gradients of one layer's 'none' terms (one more layer's
              worth; the larger of a dense and a MoE layer, the dispatch buffers included, and
              under dropless ragged_dot XLA's zero-padded copies, `dense_expert_copies`); under
              remat it is twice that, the layer's forward being recomputed first. Under the
              1F1B family at least the fp32 gradient of the stage's columns of the head,
              V·D/(t·pp)·4 (the whole head's, 1.05 GB on llama3-8b at t = 2, was XLA's largest
              temporary there when the last stage computed it per microbatch). Under context parallelism
              with the xla core, plus one block piece's fp32 scores, probs and their gradient,
              3·b·N/t·(L/sp)² · 4 (the ring's pieces are at most L/sp square; a flash core
              tiles them away).

Peak = params + optimizer + gradients + gathered + gathered once + accumulator
       + max(update, gathered layers + tables + cast + saved + working):
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
bench/results/memory-cast-h100-compiled.json). gpipe and interleaved since their head runs one
microbatch at a time under remat and each tick runs its chunk in a checkpoint by the 1F1B
family's stash policy: 0.92-0.99x on 125m under none and full (pp=2 and 4, dp and tp beside),
0.83-0.93x under dots (XLA keeping less), 0.62-0.70x on llama3-8b pp=2,fsdp=4
(bench/results/circular-stash-h100-compiled.json; gpipe-head-h100-compiled.json); since they sum
the layers' gradients in fp32, with the `accumulator` term, 0.92-1.05x (125m and 1b, pp=2,
gpipe and interleaved, none and full; bench/results/circular-fp32-sum-h100-compiled.json); since
their head runs on the ceil(M/p) microbatches dealt to each stage, 0.91-1.04x (125m and 1b, pp=2
and 4, M = 6 and 8, none and full; 0.83x on 125m pp=2,dp=2,tp=2 with SP under full;
bench/results/gpipe-head-dealt-h100-compiled.json).
tools.search scales each schedule's estimate by a floor (`MEMORY_LOW`).

CPU vs GPU: XLA on CPU computes bf16 matmuls in fp32 and keeps f32 buffers, so compare with a
CPU compile only under model.compute_dtype=float32 (tests/test_plan.py does); on a GPU c = 2.
XLA CPU reduces FSDP gradients with an all-reduce + slice (full-size gradient buffers, the
'gathered' term); GPU's reduce-scatter needs less. The estimate leaves out XLA's fragmentation,
the CUDA context and NCCL buffers (about 1-2 GiB per GPU): keep a margin.

"""

from __future__ import annotations

from configs.base import RunConfig
from sharding.checks import accumulation_axes, dealt_heads, explicit_context, head_per_microbatch
from tools.activations import (chunk_residuals, dense_expert_copies, layer_activations, scan_streams,
                               stack_activations, zb_stash)
from tools.pipeline_figures import SPLIT, STASHING, pipeline_figures
from tools.shape import (DTYPE_BYTES, core, held_tables, layers_gathered_once, local_layer_params, local_params, shape,
                         table_split)


def memory(cfg: RunConfig, sizes: dict[str, int], cpu: bool = False) -> dict[str, float]:
    """The memory terms per device, in bytes, and their peak (module docstring), as XLA GPU
    compiles the step; cpu: as XLA CPU does (tests/test_plan.py compares with a CPU compile),
    which holds the layer scan's stacked residuals under remat none at the layers' terms (no
    `scan_streams`), and
    reduces FSDP's table gradients by an all-reduce of the whole fp32 gradient (`gathered`)."""
    m, s = cfg.model, shape(cfg, sizes)
    p_local, param_b, c = local_params(cfg, sizes), DTYPE_BYTES[m.param_dtype], DTYPE_BYTES[m.compute_dtype]
    piped = sizes["stage"] > 1
    stashing = piped and cfg.parallel.schedule in STASHING
    table = pipeline_figures(cfg, sizes)
    if stashing:  # stage 0's in-flight residual slots, the inputs/inbox, zb-h1's stash of dy's
        saved = table["in_flight"] * chunk_residuals(cfg, sizes) + 3 * s.tokens * m.d_model * c
        if cfg.parallel.schedule in SPLIT:
            saved += table["in_flight"] * zb_stash(cfg, sizes)
    elif piped:  # gpipe, interleaved: autodiff keeps every tick's chunk residuals, by stash_policy
        saved = table["ticks"] * chunk_residuals(cfg, sizes)
        saved += 4 * s.k * s.tokens * m.d_model * c  # [M, b, L, D] in, out, cotangents
    else:  # the layer scan under none holds its D-wide streams wider on XLA GPU (not XLA CPU)
        saved = stack_activations(cfg, sizes, m.remat)
        saved += scan_streams(cfg, sizes) if m.scan_layers and m.remat == "none" and not cpu else 0.0
    # gpipe and interleaved: the head of the ceil(M/p) microbatches dealt to the stage at once
    # under remat none, else one microbatch's at a time in a scan, recomputed in the backward
    # (pipeline.circular.head_loss), whose int32 iota of vocabulary ids [b, L, V/t] XLA hoists
    # out of the loop beside the logits (125m pp=2,dp=2 full)
    scanned_head = piped and not stashing and head_per_microbatch(m)
    heads_at_once = dealt_heads(s.k, sizes["stage"]) if piped and not stashing and not scanned_head else 1
    vocab = m.vocab_size / sizes["tensor"] / (sizes["stage"] if stashing else 1)  # the 1F1B family's: pipeline/head.py
    logits = heads_at_once * s.tokens * vocab * (4 + c + 4 * scanned_head)
    # context parallel with the xla core: one block piece's fp32 scores, probs and their
    # gradient [b, N/t, L/sp, L/sp] at a time (a flash core tiles them away)
    blockwise_xla = explicit_context(cfg, sizes["sequence"]) is not None and core(cfg, sizes) == "xla"
    piece = 3 * s.b * m.n_heads / sizes["tensor"] * (cfg.train.seq_len / sizes["sequence"]) ** 2 * 4 * blockwise_xla
    kinds = [moe for moe, count in ((False, s.layers - s.moe), (True, s.moe)) if count]  # the device's layers
    layer = max(layer_activations(cfg, sizes, "none", moe) for moe in kinds)
    once = "fsdp" in accumulation_axes(cfg, sizes)  # the weights gathered whole for the step
    tick_sum = local_layer_params(cfg, sizes) * sizes["fsdp"] * 4  # gpipe, interleaved: the ticks' fp32 sum
    layer_weights = local_layer_params(cfg, sizes) - 2 * s.layers * m.d_model  # less the norms (not split)
    one_table = m.vocab_size * m.d_model / sizes["tensor"]  # elements of the embedding's or head's V·D/t
    head_grad = one_table / sizes["stage"] * 4 if stashing else 0.0  # its columns'
    terms = {
        "params": p_local * param_b,
        "optimizer": 2 * p_local * param_b,
        "gradients": p_local * 4,
        "gathered": one_table * (c + 8 * cpu) if sizes["fsdp"] > 1 and not once else 0.0,
        # parallel.fsdp_gather_once: the weights whole in the compute dtype and the whole fp32
        # gradient accumulator, for the step (training/step.py)
        "gathered once": p_local * (sizes["fsdp"] - 1) * (c + 4) if once else 0.0,
        "gathered layers": layer_weights * sizes["fsdp"] * c if layers_gathered_once(cfg, sizes) else 0.0,
        "tables": (held_tables(cfg, sizes) - 2 / table_split(cfg, sizes)) * m.vocab_size * m.d_model / sizes["tensor"]
        * (c + 4),
        "cast": p_local * c if stashing else 0.0,
        "accumulator": p_local * 4 if s.k > 1 and not piped else (tick_sum if piped and not stashing else 0.0),
        "update": p_local * 4 if sizes["fsdp"] == 1 else 0.0,
        "saved activations": saved,
        "working": max((1 if m.remat == "none" else 1.5) * layer + piece + dense_expert_copies(cfg, sizes), logits,
                       head_grad),
    }
    fixed = sum(terms[n] for n in ("params", "optimizer", "gradients", "gathered", "gathered once", "accumulator"))
    backward = terms["gathered layers"] + terms["tables"] + terms["cast"] + saved + terms["working"]
    terms["peak"] = fixed + max(terms["update"], backward)
    return terms
