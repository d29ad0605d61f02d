"""A pipeline schedule's figures for the planner: the cell costs, and from the schedule's
timetable (pipeline/tables.py, weighed by pipeline/schedule.py) the lock-step bubble, stage 0's
in-flight peak of (microbatch, chunk) pairs, the ticks and the ticks the 1F1B family's permutes
run. Pure arithmetic on the config, the
tables cached by their arguments: tools.search weighs mixtral-8x7b's meshes on 64 GPUs, 204 tables up
to M = 1024, in 13 s on one core.
tools/estimate.py (the residual slots in flight), tools/traffic.py (the stage's bytes) and
tools/roofline.py (the bubble) read them.
"""

from __future__ import annotations

import functools

from configs.base import RunConfig
from pipeline.schedule import in_flight, lockstep_bubble
from pipeline.tables import timetable
from pipeline.tick_program import moves
from sharding.checks import CHUNKED, ONE_F_ONE_B, head_per_microbatch, microbatches
from training.metrics import flops_per_token

SPLIT = ("zb-h1", "zbv")  # B split into B and W (pipeline/split_backward.py)
STASHING = ONE_F_ONE_B  # per-stage vjp cells (pipeline/one_f_one_b.py): residuals stashed


def virtual(cfg: RunConfig) -> int:
    """V, the chunks per stage: parallel.virtual_stages under the interleaved schedules and zbv, else 1."""
    return cfg.parallel.virtual_stages if cfg.parallel.schedule in CHUNKED else 1


def cell_costs(cfg: RunConfig, sizes: dict[str, int]) -> dict[str, float]:
    """The schedule's cell costs in forwards of a chunk (tools/traffic.py's docstring, stage): F 1,
    B 2 (split: B 1, W 1), B + 1 under model.remat=full (each layer recomputed once); head: the
    final norm, head and loss of one microbatch, forward and backward (pipeline/schedule.py, Head),
    from the FLOPs: 3 · 2·D·V over a chunk's forward per token (training.metrics: its layers'
    matmuls and attention core, 1/(p·V) of the model's). 1b on pp=4: 0.77, 125m on pp=2: 1.6,
    llama3-70b's 1f1b on pp=2: 0.085; gpipe and interleaved under a remat policy 4/3 of it (their
    head scanned a microbatch at a time, its forward recomputed in the backward:
    sharding.checks.head_per_microbatch). The memory-bound passes over the fp32 logits are not
    counted."""
    split = cfg.parallel.schedule in SPLIT
    b = (1 if split else 2) + (cfg.model.remat == "full")
    m = cfg.model
    head_forward = 2 * m.d_model * m.vocab_size
    chunk_forward = (flops_per_token(m, cfg.train.seq_len) - 3 * head_forward) / 3 / (sizes["stage"] * virtual(cfg))
    passes = 4 if cfg.parallel.schedule not in STASHING and head_per_microbatch(m) else 3
    return {"F": 1, "B": b, "W": 1, "head": passes * head_forward / chunk_forward}


@functools.lru_cache(maxsize=4096)
def _table_figures(schedule: str, p: int, m: int, v: int, cost: tuple[tuple[str, float], ...]) -> tuple:
    """(bubble with `cost`, the same with the head at 0, stage 0's in-flight peak, ticks, the ticks
    each of the 1F1B family's permutes runs, down and up: pipeline.tick_program.moves; the
    ticks both for gpipe and interleaved): one table built."""
    table, cost = timetable(schedule, p, m, v), dict(cost)
    runs = moves(table) if schedule in STASHING else None
    permutes = (int(runs["down"].sum()), int(runs["up"].sum())) if runs else (len(table), len(table))
    return (lockstep_bubble(table, cost), lockstep_bubble(table, cost | {"head": 0.0}), in_flight(table)[0], len(table),
            permutes)


def pipeline_figures(cfg: RunConfig, sizes: dict[str, int]) -> dict[str, float]:
    """From the schedule's table (pipeline.schedule): the lock-step weighted bubble with
    `cell_costs`, the same without the head (`bubble_without_head`), stage 0's in-flight peak
    ((microbatch, chunk) pairs), the ticks, and the ticks each permute runs (`permute_ticks`,
    down and up); no pipeline: 0, 0, 1, 1, (0, 0)."""
    p = sizes["stage"]
    if p == 1:
        return {"bubble": 0.0, "bubble_without_head": 0.0, "in_flight": 1, "ticks": 1, "permute_ticks": (0, 0)}
    cost = tuple(sorted(cell_costs(cfg, sizes).items()))
    bubble, headless, peak, ticks, permutes = _table_figures(cfg.parallel.schedule, p, microbatches(cfg, p),
                                                              virtual(cfg), cost)
    return {"bubble": bubble, "bubble_without_head": headless, "in_flight": peak, "ticks": ticks,
            "permute_ticks": permutes}
