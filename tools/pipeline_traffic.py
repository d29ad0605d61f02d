"""What pipelines add to a step's communication: the bytes over the stage axis, and how a
schedule repeats the per-layer collectives of the other axes (tools/traffic.py's terms).

Pure arithmetic, with tools/shape.py's letters and per-device shape; bytes per device per step,
of the device that moves the most.

Per-layer collectives (tensor, expert, sequence) under a pipeline (`layer_runs`): k microbatches'
worth in the 1F1B family; gpipe and interleaved run their chunk in every tick, idle ones on zeros,
collectives included: T/V per step (T the table's ticks). Heads (`heads`): k a stage in the 1F1B
family (the head over the stages, pipeline/head.py, its input gradient summed in fp32: `head_dx`),
ceil(M/p) under gpipe and interleaved. The 1F1B family's tick program embeds in every F cell
(`extra_embeddings`).

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
"""

from __future__ import annotations

from configs.base import RunConfig
from pipeline.layout import leaving
from sharding.checks import dealt_heads
from tools.pipeline_figures import STASHING, pipeline_figures, virtual
from tools.shape import DTYPE_BYTES, held_tables, local_layer_params, shape, small_parts, table_split


def circular(cfg: RunConfig, sizes: dict[str, int]) -> bool:
    """Whether the step is pipelined by gpipe or interleaved (pipeline/circular.py)."""
    return sizes["stage"] > 1 and cfg.parallel.schedule not in STASHING


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
    p, v = sizes["stage"], virtual(cfg)
    chunk = local_layer_params(cfg, sizes) / v * (DTYPE_BYTES[cfg.model.compute_dtype] + 4)
    return [n * chunk for n in leaving(p, v, vee=cfg.parallel.schedule == "zbv")]
