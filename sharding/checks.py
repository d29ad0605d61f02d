"""Whether a config can run on a mesh: every shape and combination rule, in one place, no jax.

`check_run(cfg, sizes)` is called by `training.build.make_program` (so by every entry point that
builds a step), by `cli.run_config` as soon as the mesh sizes are known (before jax is
imported), and by `tools.search` for every candidate mesh, so what the planner ranks is what
the step accepts. Each rule raises a ConfigError that names the field or flag and the fix.
Values alone (positive sizes, known dtypes and choices) are `configs.checks.check_values`,
which check_run runs first.

Rules, by what they protect:
  model        heads a multiple of kv heads (GQA groups); an even head dim (rotary pairs)
  batch        dp·fsdp divides the global batch; the micro batch (or, under a pipeline, the
               microbatch count) divides each rank's share; sp divides L
  tensor       tp divides the heads, F and V; kv heads divide or are divided by tp (shard_map);
               sequence parallelism and overlap need tp > 1 and L divisible by tp, and
               (overlap) shard_map with sequence parallelism
  context      sp > 1 with context_impl ring|allgather: 2·sp divides L (zigzag), and sp·tp under
               sequence parallelism; not the cudnn core; the ring not under 1f1b; sequence
               parallelism with sp > 1 only with ring|allgather
  experts      ep > 1 only with n_experts; ep divides E; top-k at most E; moe_every divides
               the layers; tp divides the expert (and shared expert) F; a pipeline's stages
               hold whole groups of moe_every layers
  fsdp         fsdp divides D (weights are split on `embed`)
  accumulation parallel.fsdp_gather_once only where the step accumulates itself (fsdp > 1,
               pp = 1, dense, sp = 1)
  pipeline     pp·V divides the layers; at least pp microbatches, a multiple of pp when
               interleaved; virtual stages only with interleaved; no train.micro_batch_size
               (the microbatches are the accumulation); no tp_overlap under 1f1b
"""

from __future__ import annotations

from configs.base import ConfigError, ModelConfig, RunConfig
from configs.checks import check_values

# The pipeline schedules run by pipeline/one_f_one_b.py (a different cell per stage in one
# tick), those with V chunks of layers per stage in a ring (M a multiple of p), and all with chunks
# (zbv: two, in a V).
ONE_F_ONE_B = ("1f1b", "interleaved-1f1b", "zb-h1", "zbv")
INTERLEAVED = ("interleaved", "interleaved-1f1b")
CHUNKED = (*INTERLEAVED, "zbv")


def check_run(cfg: RunConfig, sizes: dict[str, int]) -> None:
    """Every rule for `cfg` on a mesh of `sizes` ({axis: size}, no -1 left)."""
    check_values(cfg)
    check_model(cfg.model)
    check_batch(cfg, sizes)
    check_tensor(cfg, sizes)
    check_context(cfg, sizes)
    check_experts(cfg, sizes)
    check_pipeline(cfg, sizes)
    check_accumulation(cfg, sizes)


def check_model(m: ModelConfig) -> None:
    if m.n_heads % m.n_kv_heads:
        raise ConfigError(f"model.n_heads={m.n_heads} is not a multiple of model.n_kv_heads={m.n_kv_heads}")
    if m.head_dim % 2:
        raise ConfigError(f"model.head_dim={m.head_dim} must be even (rotary embedding pairs)")


def batch_ranks(sizes: dict[str, int]) -> int:
    """The devices the batch is split over: dp·fsdp·ep (`expert` is a data axis to the batch)."""
    return sizes["data"] * sizes["fsdp"] * sizes.get("expert", 1)


def accumulation_axes(cfg: RunConfig, sizes: dict[str, int]) -> tuple[str, ...]:
    """The batch axes (of size > 1) over which the step's microbatch loop runs per device, its
    gradients summed locally and reduced once per step (training/step.py), when there are k > 1
    microbatches or parallel.fsdp_gather_once asks for the gathered weights: data, and fsdp only
    with parallel.fsdp_gather_once (otherwise XLA's ZeRO-3 inside). () where XLA places the
    reductions: one microbatch (once per step already, and FSDP's weights gathered a layer at a
    time).

    `expert` joins them too (a MoE model on ep > 1): to every weight but the experts' it is one
    more data axis, and its MoE regions, nested, are then manual over what is left (tensor), the
    experts' weights each device's E/ep and their gradients summed over the other axes alone
    (sharding/accumulation.reduce). Not beside XLA's ZeRO-3 (fsdp > 1 without
    fsdp_gather_once): the MoE regions would make fsdp manual inside a region over `expert`,
    which comes after it in the mesh (below).

    With sp > 1 `sequence` joins them, the weights being replicated over it, where the context
    parallelism is written out (its regions then nest, already manual over `sequence`; XLA's
    own, context_impl=gspmd, needs the whole sequence in view) and no axis before `sequence` in
    the mesh is left automatic for the model's regions to make manual inside it (Shardy refuses
    an inner manual axis before an outer one; jax 0.12's XLA aborts the process): fsdp only
    gathered once, no expert axis. Elsewhere () and XLA reduces over sequence per microbatch.
    Tensor parallelism may be there: its attention region, nested, runs unchecked
    (TensorParallel.region).

    Every pipeline schedule (pipeline/engine.py) runs its M microbatches per device the same
    way, manual over data, fsdp, expert and (as above) sequence: it holds each stage's weights whole
    for the step anyway, so its gradients are summed over the schedule and reduced once per
    step on all of them (fsdp, when > 1, is manual there anyway, so `expert` may be). MoE regions nest
    in the step's region and in the engine and sum their router statistics over its axes too
    (sharding/expert_parallel.py)."""
    nests = explicit_context(cfg, sizes["sequence"]) is not None and sizes.get("expert", 1) == 1
    if sizes["stage"] > 1:
        return tuple(a for a in ("data", "fsdp", "expert", "sequence")
                     if sizes.get(a, 1) > 1 and (a != "sequence" or nests))
    if sizes["sequence"] > 1 and not (nests and (sizes["fsdp"] == 1 or cfg.parallel.fsdp_gather_once)):
        return ()
    per_rank = cfg.train.global_batch_size // batch_ranks(sizes)
    k = per_rank // (cfg.train.micro_batch_size or per_rank)
    if k == 1 and not (cfg.parallel.fsdp_gather_once and sizes["fsdp"] > 1):
        return ()
    axes = tuple(a for a in ("data", "fsdp", "expert", "sequence") if sizes.get(a, 1) > 1)
    if not cfg.parallel.fsdp_gather_once:  # fsdp stays XLA's (ZeRO-3): a layer's weights gathered
        # when used and its gradient reduce-scattered per microbatch, so neither is ever whole;
        # the MoE regions would then make fsdp manual inside a region over expert, which follows it
        axes = tuple(a for a in axes if a != "fsdp" and (a != "expert" or sizes["fsdp"] == 1))
    return axes


def check_accumulation(cfg: RunConfig, sizes: dict[str, int]) -> None:
    """parallel.fsdp_gather_once acts in the step's accumulation region only (accumulation_axes)."""
    if cfg.parallel.fsdp_gather_once and "fsdp" not in accumulation_axes(cfg, sizes):
        raise ConfigError(
            "parallel.fsdp_gather_once=true needs fsdp > 1 (with sp > 1 context_impl ring or allgather and "
            "no expert axis; pipelines gather once per step without it); drop it or change the --mesh"
        )


def microbatches(cfg: RunConfig, p: int) -> int:
    """M under a pipeline of p stages: `parallel.microbatches`, or p when it is 0."""
    return cfg.parallel.microbatches or p


def check_batch(cfg: RunConfig, sizes: dict[str, int]) -> None:
    t = cfg.train
    ranks = batch_ranks(sizes)
    if t.global_batch_size % ranks:
        raise ConfigError(
            f"train.global_batch_size={t.global_batch_size} is not divisible by dp*fsdp*ep={ranks}: "
            "change the batch size or the --mesh"
        )
    per_rank = t.global_batch_size // ranks
    if sizes["stage"] > 1:
        p = sizes["stage"]
        m = microbatches(cfg, p)
        if per_rank % m:
            fits = [d for d in range(p, per_rank + 1) if per_rank % d == 0]  # M >= p (check_pipeline)
            fix = (f"--set parallel.microbatches={fits[0]}" if fits else
                   f"a train.global_batch_size that is a multiple of pp*dp*fsdp*ep={p * ranks}")
            raise ConfigError(
                f"parallel.microbatches={m}{'' if cfg.parallel.microbatches else ' (0: one per stage)'} does not "
                f"divide the {per_rank} sequences per data-parallel rank (global_batch_size {t.global_batch_size} / "
                f"dp*fsdp*ep {ranks}): try {fix}"
            )
    elif per_rank % (t.micro_batch_size or per_rank):
        raise ConfigError(
            f"train.micro_batch_size={t.micro_batch_size} does not divide the {per_rank} sequences per "
            f"data-parallel rank (global_batch_size {t.global_batch_size} / dp*fsdp*ep {ranks})"
        )
    if t.seq_len % sizes["sequence"]:
        raise ConfigError(f"train.seq_len={t.seq_len} is not divisible by sp={sizes['sequence']}")


def explicit_tensor(cfg: RunConfig, tp: int) -> bool:
    """Whether tensor parallelism over tp devices is written out as shard_map regions
    (sharding/tensor_parallel.py) rather than left to GSPMD."""
    return cfg.parallel.tp_impl == "shard_map" and tp > 1


def explicit_context(cfg: RunConfig, sp: int) -> str | None:
    """The context parallelism written out over a `sequence` axis of sp devices (ring or
    allgather: sharding/context_parallel.py); None at sp = 1, or where XLA all-gathers K and V
    (context_impl=gspmd)."""
    return cfg.parallel.context_impl if sp > 1 and cfg.parallel.context_impl != "gspmd" else None


def check_context(cfg: RunConfig, sizes: dict[str, int]) -> None:
    """Context parallelism (ring or allgather over `sequence`): the zigzag layout cuts L into
    2·sp chunks; the per-block cores are xla and pallas."""
    sp, impl = sizes["sequence"], explicit_context(cfg, sizes["sequence"])
    if impl is None:
        return
    if cfg.train.seq_len % (2 * sp):
        raise ConfigError(
            f"train.seq_len={cfg.train.seq_len} is not divisible by 2·sp={2 * sp}: context_impl={impl} "
            f"lays L out in 2·sp chunks (zigzag); use a multiple of {2 * sp} or parallel.context_impl=gspmd"
        )
    tp = sizes["tensor"]
    if cfg.parallel.sequence_parallel and cfg.train.seq_len // sp % tp:
        raise ConfigError(
            f"train.seq_len={cfg.train.seq_len} with sp={sp} and parallel.sequence_parallel=true: each "
            f"device's L/sp={cfg.train.seq_len // sp} rows split again over tp={tp}; use a multiple of {2 * sp * tp}"
        )
    if cfg.model.attention == "cudnn":
        raise ConfigError(
            f"model.attention=cudnn with parallel.context_impl={impl}: the ring's blocks need a core that "
            "returns its log-sum-exp; use model.attention=pallas or xla, or parallel.context_impl=gspmd"
        )
    if impl == "ring" and sizes["stage"] > 1 and cfg.parallel.schedule in ONE_F_ONE_B:
        raise ConfigError(
            f"parallel.context_impl=ring with parallel.schedule={cfg.parallel.schedule}: it runs a different cell on each "
            "stage in the same tick, and the ring's collective-permutes inside those cells would not meet "
            "(XLA CPU deadlocks); use parallel.context_impl=allgather, or schedule gpipe or interleaved"
        )


def expert_d_ff(m: ModelConfig) -> int:
    """F of one routed expert: model.expert_d_ff, or d_ff when it is 0."""
    return m.expert_d_ff or m.d_ff


def head_per_microbatch(m: ModelConfig) -> bool:
    """Whether gpipe and interleaved run the head one microbatch at a time, recomputed in the
    backward (pipeline.circular.head_loss): under every remat policy but none, which runs all M
    at once. The memory estimate and the traffic contract read the same rule."""
    return m.remat != "none"


def dealt_heads(m_count: int, p: int) -> int:
    """C, the microbatches whose head each of p stages runs under gpipe and interleaved: the M
    outputs dealt out over the stages, ceil(M/p), padded (pipeline.circular.dealt). The memory
    estimate and the traffic contract read the same rule."""
    return -(-m_count // p)


def moe_layers(m: ModelConfig) -> int:
    """How many of the X layers are MoE: the last of each group of moe_every; 0 when dense."""
    return m.n_layers // m.moe_every if m.n_experts else 0


def check_experts(cfg: RunConfig, sizes: dict[str, int]) -> None:
    """The MoE layers (model/moe.py) and the expert axis (sharding/expert_parallel.py)."""
    m, ep, tp = cfg.model, sizes.get("expert", 1), sizes["tensor"]
    if not m.n_experts:
        if ep > 1:
            raise ConfigError(
                f"--mesh ep={ep} with model.n_experts=0: the expert axis splits the experts of MoE "
                "layers, and this model has none; set model.n_experts (e.g. --config moe-tiny) or drop ep"
            )
        return
    if m.n_experts % ep:
        raise ConfigError(
            f"model.n_experts={m.n_experts} is not divisible by ep={ep}: each device of the expert "
            "axis holds n_experts/ep experts; change the --mesh or model.n_experts"
        )
    if m.experts_per_token > m.n_experts:
        raise ConfigError(
            f"model.experts_per_token={m.experts_per_token} is more than model.n_experts={m.n_experts}: "
            "each token picks k distinct experts; use k <= n_experts"
        )
    if m.n_layers % m.moe_every:
        raise ConfigError(
            f"model.n_layers={m.n_layers} is not divisible by model.moe_every={m.moe_every}: "
            "the layers run in groups of moe_every (the last of each MoE); change either"
        )
    if m.expert_matmul != "ragged_dot" and m.moe_dispatch != "dropless":
        raise ConfigError(
            f"--set model.expert_matmul={m.expert_matmul} with model.moe_dispatch={m.moe_dispatch}: the grouped "
            "matmul runs the dropless dispatch only (capacity runs one batched einsum); drop one of the two"
        )
    for field, f in (("expert_d_ff", expert_d_ff(m)), ("n_shared_experts*expert_d_ff", m.n_shared_experts * expert_d_ff(m))):
        if f % tp:
            raise ConfigError(f"model.{field}={f} is not divisible by tp={tp}: the experts' F is split over tensor")
    units, p, v = m.n_layers // m.moe_every, sizes["stage"], cfg.parallel.virtual_stages
    if p > 1 and units % (p * v):
        raise ConfigError(
            f"model.n_layers={m.n_layers} with model.moe_every={m.moe_every} makes {units} groups of layers, "
            f"not divisible by pp*virtual_stages={p * v}: each stage holds whole groups (the MoE layer with "
            "its dense ones); change moe_every, n_layers or pp"
        )


def check_tensor(cfg: RunConfig, sizes: dict[str, int]) -> None:
    p, m, tp = cfg.parallel, cfg.model, sizes["tensor"]
    for field, value in (("n_heads", m.n_heads), ("d_ff", m.d_ff), ("vocab_size", m.vocab_size)):
        if value % tp:
            raise ConfigError(f"model.{field}={value} is not divisible by tp={tp}: change it or the --mesh")
    if m.d_model % sizes["fsdp"]:
        raise ConfigError(f"model.d_model={m.d_model} is not divisible by fsdp={sizes['fsdp']}: change it or the --mesh")
    flag = "tp_overlap" if p.tp_overlap else "sequence_parallel"
    if p.sequence_parallel or p.tp_overlap:
        if tp == 1:
            raise ConfigError(f"parallel.{flag}=true needs a tensor axis: add tp=2 or more to --mesh")
        if cfg.train.seq_len % tp:
            raise ConfigError(
                f"train.seq_len={cfg.train.seq_len} is not divisible by tp={tp}: parallel.{flag} "
                f"splits L over the tensor axis; use a multiple of {tp}"
            )
    if p.sequence_parallel and sizes["sequence"] > 1 and p.context_impl == "gspmd":
        raise ConfigError(
            f"parallel.sequence_parallel=true with sp={sizes['sequence']} and parallel.context_impl=gspmd: "
            "L split over both sequence and tensor needs the explicit context parallelism; "
            "use parallel.context_impl=ring or allgather"
        )
    if p.tp_overlap and p.tp_impl != "shard_map":
        raise ConfigError("parallel.tp_overlap=true is written with shard_map: set parallel.tp_impl=shard_map")
    if p.tp_overlap and not p.sequence_parallel:
        raise ConfigError(
            "parallel.tp_overlap=true overlaps sequence parallelism's all-gather and reduce-scatter "
            "with the matmuls: add --set parallel.sequence_parallel=true"
        )
    k = m.n_kv_heads
    if p.tp_impl == "shard_map" and k % tp and tp % k:
        raise ConfigError(
            f"model.n_kv_heads={k} and tp={tp}: one must divide the other (kv heads are split over "
            "tensor, or replicated when fewer than tp)"
        )


def check_pipeline(cfg: RunConfig, sizes: dict[str, int]) -> None:
    par, p = cfg.parallel, sizes["stage"]
    v = par.virtual_stages
    if v > 1 and par.schedule not in CHUNKED:
        raise ConfigError(f"parallel.virtual_stages={v}: use 1, or more with --set parallel.schedule=interleaved "
                          "(or interleaved-1f1b; 2 with zbv)")
    if par.schedule == "zbv" and v != 2:
        raise ConfigError(f"parallel.schedule=zbv with parallel.virtual_stages={v}: it runs 2 chunks of layers "
                          "per stage, in a V; --set parallel.virtual_stages=2")
    if v < 2 and par.schedule == "interleaved-1f1b":
        raise ConfigError(f"parallel.schedule=interleaved-1f1b with parallel.virtual_stages={v}: it runs V >= 2 "
                          "chunks of layers per stage; --set parallel.virtual_stages=2 (with V=1 it is 1f1b)")
    if p == 1:
        return
    m, layers = microbatches(cfg, p), cfg.model.n_layers
    if layers % (p * v):
        raise ConfigError(
            f"model.n_layers={layers} is not divisible by pp*virtual_stages={p}*{v}={p * v}: "
            "each stage holds the same number of layers; change model.n_layers, pp or virtual_stages"
        )
    if m < p:
        raise ConfigError(
            f"parallel.microbatches={m} is fewer than the pp={p} stages: the pipeline would never "
            f"fill; use at least {p}"
        )
    if par.schedule in INTERLEAVED and m % p:
        raise ConfigError(
            f"parallel.microbatches={m} with schedule={par.schedule} must be a multiple of pp={p} "
            "(p microbatches travel the ring together)"
        )
    if par.schedule in ONE_F_ONE_B and par.tp_overlap and sizes["tensor"] > 1:
        raise ConfigError(
            f"parallel.tp_overlap=true with parallel.schedule={par.schedule}: the overlap rings are "
            "collective-permutes, which XLA runs over all devices at once, while this schedule's stages run "
            "different cells each tick, so a ring would wait for stages that never join it; set "
            "parallel.tp_overlap=false, or use parallel.schedule=gpipe|interleaved"
        )
    if cfg.train.micro_batch_size:
        raise ConfigError(
            f"train.micro_batch_size={cfg.train.micro_batch_size} with pp={p}: the pipeline's "
            "microbatches are the gradient accumulation; set train.micro_batch_size=0 and "
            "choose parallel.microbatches"
        )
