"""Search the meshes of a GPU count with the analytic model (tools/estimate.py, traffic.py,
roofline.py).

Candidates: every (pp, dp, fsdp, ep, sp, tp) whose product is the GPU count (ep only for a MoE
model), with tp and sp·tp inside one node (<= 8), that the step itself accepts
(sharding/checks.py: tp dividing the heads, F and V, sp dividing L, pp dividing the layers,
dp·fsdp·ep dividing the global batch, ep dividing the experts, whole groups of moe_every
layers per stage, ...).
The expert axis is timed on NVLink when it and the axes inside it (sp, tp) fit in a node, like
every axis (tools/links.link_bandwidth). For
each, the microbatch is the largest that fits the GPU's memory (fewest microbatches: least
per-microbatch overhead); under a pipeline, every schedule of SCHEDULES is ranked, each with the
microbatch count (at least pp) of its shortest fitting step, its bubble the lock-step weighted
bubble of its table with the head's cells counted (tools/pipeline_figures.py), and the mesh runs
the fastest. gpipe's
and interleaved's memory estimate runs up to 2x low against XLA (tools/estimate.py): they fit
only if twice their estimate does. A mesh for which not even one sequence per microbatch fits
is rejected, never ranked. The rest are ranked by the estimated step time with communication overlapped
(ties: not overlapped). Nothing is compiled here; `tools.plan --search` compiles
the top 3 to confirm their memory. When no mesh of the count takes the config at all (none
rejected for memory), `no_mesh_takes` says why: usually no split of the global batch, and then
the smallest batch that some mesh splits.
"""

from __future__ import annotations

import dataclasses
import itertools

from configs.base import ConfigError, RunConfig
from sharding.checks import batch_ranks, check_run
from sharding.mesh import AXES
from tools.estimate import memory
from tools.pipeline_figures import pipeline_figures
from tools.roofline import GPU, step_time
from tools.shape import GiB, shape
from tools.links import GPUS_PER_NODE, Links
from tools.traffic import expert

SCHEDULES = (("gpipe", 1), ("interleaved", 2), ("1f1b", 1), ("interleaved-1f1b", 2), ("zb-h1", 1), ("zbv", 2))  # (name, V)
# XLA's peak over the estimate of a pipelined step, with a margin: at most 1.12x for the 1F1B
# family since its cast weights are counted (125m pp=2,fsdp=2,tp=2 1f1b; 1.20x before;
# bench/results/memory-cast-h100-compiled.json), 0.99x gpipe and interleaved since their ticks
# keep what the stash policy keeps (1.00x before; 1.14x before their head ran a microbatch at a
# time under remat, and 1.54x before their tick scan's copy was counted, when this was 2.0 for
# them; bench/results/circular-stash-h100-compiled.json, gpipe-head-h100-compiled.json,
# gpipe-memory-125m-h100-compiled.json); zbv's 0.87-1.01x
MEMORY_LOW = 1.35


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def valid(cfg: RunConfig, sizes: dict[str, int]) -> bool:
    """Whether the step accepts cfg on `sizes` in the form the search runs it (the micro batch,
    chosen later by `fit`; a pipeline as 1f1b with pp microbatches, the layout every schedule
    needs; `takes` checks each schedule), with tp·sp inside one node."""
    if sizes["stage"] > 1:
        trial = pipelined(cfg, sizes, sizes["stage"])
    else:
        trial = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, micro_batch_size=0))
    try:
        check_run(trial, sizes)
    except ConfigError:
        return False
    return sizes["tensor"] * sizes["sequence"] <= GPUS_PER_NODE


def meshes(cfg: RunConfig, gpus: int) -> list[dict[str, int]]:
    """Every valid mesh of `gpus` devices, as {axis: size} in AXES order."""
    found = []
    for pp, ep, sp, tp in itertools.product(divisors(gpus), divisors(gpus) if cfg.model.n_experts else (1,),
                                            divisors(gpus), divisors(gpus)):
        if gpus % (pp * ep * sp * tp):
            continue
        for fsdp in divisors(gpus // (pp * ep * sp * tp)):
            dp = gpus // (pp * ep * sp * tp * fsdp)
            sizes = dict(zip(AXES, (pp, dp, fsdp, ep, sp, tp)))
            if valid(cfg, sizes):
                found.append(sizes)
    return found


def fit(cfg: RunConfig, sizes: dict[str, int], gpu: GPU, links: Links | None = None) -> RunConfig | None:
    """cfg with the largest micro_batch_size that fits `gpu`'s memory on `sizes`, or None; under
    a pipeline, the fastest fitting schedule and microbatch count (`fit_pipeline`)."""
    per_rank = cfg.train.global_batch_size // batch_ranks(sizes)
    if sizes["stage"] > 1:
        return fit_pipeline(cfg, sizes, gpu, per_rank, links)
    for micro in sorted(divisors(per_rank), reverse=True):
        trial = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, micro_batch_size=micro))
        if memory(trial, sizes)["peak"] <= gpu.memory:
            return trial
    return None


def fit_pipeline(cfg: RunConfig, sizes: dict[str, int], gpu: GPU, per_rank: int,
                 links: Links | None = None) -> RunConfig | None:
    """The fastest schedule of `rank_schedules`, or None when none fits."""
    return next((row["cfg"] for row in rank_schedules(cfg, sizes, gpu, per_rank, links)), None)


def rank_schedules(cfg: RunConfig, sizes: dict[str, int], gpu: GPU, per_rank: int,
                   links: Links | None = None) -> list[dict]:
    """Each schedule of SCHEDULES that the mesh takes, with the microbatch count M (>= pp,
    dividing the rank's batch) of its shortest fitting step (more microbatches shrink the bubble
    and the stash), fastest first: {schedule, virtual_stages, microbatches, step_s (overlapped),
    bubble, memory_gib, cfg}. The microbatches are
    the accumulation (sharding/checks.py): train.micro_batch_size is 0."""
    rows = []
    for schedule, v in SCHEDULES:
        best: tuple[float, RunConfig] | None = None
        for m in divisors(per_rank):
            if m < sizes["stage"] or not takes(cfg, sizes, schedule, v, m):
                continue
            trial = pipelined(cfg, sizes, m, schedule, v)
            if memory(trial, sizes)["peak"] * MEMORY_LOW > gpu.memory:
                continue
            seconds = step_time(trial, sizes, gpu, links)["overlap_s"]
            if best is None or seconds < best[0]:
                best = (seconds, trial)
        if best:
            seconds, trial = best
            rows.append({"schedule": schedule, "virtual_stages": v, "microbatches": trial.parallel.microbatches,
                         "step_s": seconds, "bubble": pipeline_figures(trial, sizes)["bubble"],
                         "memory_gib": memory(trial, sizes)["peak"] / GiB, "cfg": trial})
    return sorted(rows, key=lambda r: r["step_s"])


def takes(cfg: RunConfig, sizes: dict[str, int], schedule: str, v: int, m: int) -> bool:
    """Whether the step's checks (sharding/checks.py) accept `schedule` with V = v and M = m on
    `sizes`."""
    try:
        check_run(pipelined(cfg, sizes, m, schedule, v), sizes)
    except ConfigError:
        return False
    return True


def pipelined(cfg: RunConfig, sizes: dict[str, int], microbatches: int, schedule: str = "1f1b",
              virtual: int = 1) -> RunConfig:
    """cfg as the search runs a pipeline: `schedule` with V = `virtual` and `microbatches`, no
    accumulation besides them, no tp_overlap (the 1F1B family refuses it), and context parallelism by
    all-gather (the 1F1B family refuses the ring)."""
    context = "allgather" if sizes["sequence"] > 1 and cfg.parallel.context_impl == "ring" else cfg.parallel.context_impl
    return dataclasses.replace(
        cfg, train=dataclasses.replace(cfg.train, micro_batch_size=0),
        parallel=dataclasses.replace(cfg.parallel, schedule=schedule, microbatches=microbatches, virtual_stages=virtual,
                                     tp_overlap=False, context_impl=context))


def search(cfg: RunConfig, gpus: int, gpu: GPU, links: Links | None = None) -> tuple[list[dict], int]:
    """(ranked candidates, number rejected for memory). A candidate: sizes, cfg (with its
    microbatch, or schedule), memory terms, step time (tools.roofline.step_time, on `links` where
    measured) and, under a pipeline, `schedules`: every schedule ranked (`rank_schedules`)."""
    ranked, rejected = [], 0
    for sizes in meshes(cfg, gpus):
        rows = []
        if sizes["stage"] > 1:
            rows = rank_schedules(cfg, sizes, gpu, cfg.train.global_batch_size // batch_ranks(sizes), links)
            trial = rows[0]["cfg"] if rows else None
        else:
            trial = fit(cfg, sizes, gpu, links)
        if trial is None:
            rejected += 1
            continue
        ranked.append({"sizes": sizes, "cfg": trial, "memory": memory(trial, sizes),
                       "time": step_time(trial, sizes, gpu, links), "schedules": rows})
    ranked.sort(key=lambda c: (c["time"]["overlap_s"], c["time"]["no_overlap_s"]))
    return ranked, rejected


def settings(candidate: dict) -> list[str]:
    """The --set overrides (beyond --mesh) that run a candidate as ranked."""
    cfg = candidate["cfg"]
    if candidate["sizes"]["stage"] > 1:
        return [f"parallel.schedule={cfg.parallel.schedule}", f"parallel.microbatches={cfg.parallel.microbatches}",
                *([f"parallel.virtual_stages={cfg.parallel.virtual_stages}"] if cfg.parallel.virtual_stages > 1 else []),
                *(["parallel.context_impl=allgather"] if candidate["sizes"]["sequence"] > 1 else [])]
    return [f"train.micro_batch_size={cfg.train.micro_batch_size}"]


def reason(candidate: dict, best: dict) -> str:
    """Why a candidate wins or loses: its largest cost against the best's."""
    t, mem = candidate["time"], candidate["memory"]
    comm = t["comm_s"]
    worst = max(comm, key=comm.get) if comm else None
    parts = [f"compute {t['compute_s']:.2f} s"]
    if worst:
        parts.append(f"slowest comm {worst} {comm[worst]:.2f} s")
    if candidate["sizes"]["expert"] > 1:
        parts.append(f"all-to-all {expert(candidate['cfg'], candidate['sizes']) / GiB:.0f} GiB")
    if t["bubble"]:
        parts.append(f"bubble {100 * t['bubble']:.0f}%")
    b = shape(candidate["cfg"], candidate["sizes"]).b
    parts.append(f"{b} seq/microbatch, {mem['peak'] / GiB:.0f} GiB")
    if candidate is not best:
        ratio = t["overlap_s"] / best["time"]["overlap_s"]
        parts.append(f"{ratio:.2f}x the best")
    return "; ".join(parts)


def format_tokens(tokens: int) -> str:
    """A token count as tools.plan.parse_tokens reads it: 3·2^20 -> '3M', 2064·2^10 -> '2064k', 4480 -> '4480'."""
    for unit, scale in (("M", 2**20), ("k", 2**10)):
        if tokens % scale == 0:
            return f"{tokens // scale}{unit}"
    return str(tokens)


def smallest_batch(cfg: RunConfig, gpus: int) -> int | None:
    """The smallest train.global_batch_size from cfg's up that some mesh of `gpus` GPUs takes (a
    multiple of its dp·fsdp·ep, times pp under a pipeline: the search runs at least pp
    microbatches), or None when no mesh takes any batch."""
    b = cfg.train.global_batch_size

    def batch(size: int) -> RunConfig:
        return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, global_batch_size=size))

    steps = {batch_ranks(sizes) * sizes["stage"] for sizes in meshes(batch(b * gpus), gpus)}  # any split divides it
    return next((size for size in sorted(-(-b // step) * step for step in steps) if meshes(batch(size), gpus)), None)


def no_mesh_takes(cfg: RunConfig, gpus: int) -> str:
    """Why the search has no mesh of `gpus` GPUs when none was rejected for memory, and the fix."""
    size = smallest_batch(cfg, gpus)
    if size is None:
        return (f"no mesh of {gpus} GPUs runs {cfg.name}: every split breaks a shape rule (sharding/checks.py: "
                "heads, layers, sequence, experts); choose another GPU count")
    return (f"no mesh of {gpus} GPUs splits {cfg.name}'s global batch of {cfg.train.global_batch_size} sequences "
            "over its data ranks (dp·fsdp·ep, times pp under a pipeline; the search keeps tp·sp within a node): "
            f"use --set train.global_batch_size={size} (in tools.plan: --global-batch-tokens "
            f"{format_tokens(size * cfg.train.seq_len)}), or another GPU count")
