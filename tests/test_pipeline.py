"""Pipeline parallelism (pipeline/): each schedule's timetable, matmuls per cell, memory,
collectives on `stage` and under fsdp, and bad input. Equality with one device:
tests/test_pipeline_equal.py. Pipeline buffers start as NaN (pipeline.stages.FILL)."""

import dataclasses
import functools
import math
import re

import jax
import numpy as np
import pytest

from configs.base import ConfigError
from conftest import mesh_sizes, pipeline_devices as _devices, small_config
from pipeline.jaxpr_eval import count_prims, equations
from pipeline.stages import FILL
from sharding.mesh import build_mesh
from training.build import make_program, build
from training.step import loss_and_grads


def test_buffers_start_as_nan():
    assert np.isnan(FILL)


def _compiled(cfg):
    mesh = build_mesh(cfg.parallel, _devices(cfg))
    program = make_program(cfg, mesh)
    with jax.set_mesh(mesh):
        return program.step_fn.lower(program.state, program.abstract_batch()).compile(), mesh


@pytest.fixture(scope="module")
def temp_memory():
    """Temp bytes per device of the compiled step, pp=2, 2 layers, microbatches of 2 sequences."""
    figures, compiled = {}, {}
    for schedule in ("gpipe", "1f1b"):
        for m in (4, 8, 16):
            cfg = small_config("pp=2", f"parallel.schedule={schedule}", f"parallel.microbatches={m}",
                               f"train.global_batch_size={2 * m}")
            compiled[schedule, m] = _compiled(cfg)
            figures[schedule, m] = compiled[schedule, m][0].memory_analysis().temp_size_in_bytes
    print("\ntemp bytes per device (pp=2, M = 4, 8, 16):",
          {s: [figures[s, m] for m in (4, 8, 16)] for s in ("gpipe", "1f1b")})
    return figures, compiled


def test_1f1b_memory_is_flat_in_m_and_gpipe_grows(temp_memory):
    figures, _ = temp_memory
    one = [figures["1f1b", m] for m in (4, 8, 16)]
    assert max(one) <= 1.15 * min(one)
    gpipe = [figures["gpipe", m] for m in (4, 8, 16)]
    assert gpipe[0] < gpipe[1] < gpipe[2] and gpipe[2] > 2 * one[2]


def test_1f1b_stash_bytes_explain_the_compiled_memory(temp_memory):
    """pipeline.one_f_one_b.stash_bytes against the compiled step (pp=2, M = 16, b = 2): the
    residual stash (p slots of one chunk's residuals R) is flat in M, and what remat none costs
    over remat full in compiled temp memory is the stash difference within one R: the B cells'
    working sets differ by less (remat full's B recomputes each layer's forward and holds its
    values for a while, none's B only the cheap ones). Before the cells ran as one switch per
    group (pipeline/cells.run_cell), XLA copied slots that the switch passed through, and none
    cost 1.63 R more than its stash."""
    from pipeline.one_f_one_b import stash_bytes

    figures, compiled = temp_memory
    stash = {}
    for remat in ("none", "full"):
        for m in (4, 16):
            cfg = small_config("pp=2", "parallel.schedule=1f1b", f"model.remat={remat}",
                               f"parallel.microbatches={m}", f"train.global_batch_size={2 * m}")
            mesh = build_mesh(cfg.parallel, _devices(cfg))
            program = make_program(cfg, mesh)
            with jax.set_mesh(mesh):
                stash[remat, m] = stash_bytes(cfg, program.graphdef, program.state.params, 2)
    assert stash["none", 4] == stash["none", 16] and stash["full", 4] == stash["full", 16]
    assert stash["full", 16]["per_microbatch"] == 2 * 32 * 64 * 4  # remat full: the one layer's input [b, L, D] fp32
    assert stash["none", 16]["residuals"] == 2 * stash["none", 16]["per_microbatch"]  # p = 2 slots
    full = _compiled(small_config("pp=2", "parallel.schedule=1f1b", "model.remat=full", "parallel.microbatches=16",
                                  "train.global_batch_size=32"))[0].memory_analysis().temp_size_in_bytes
    extra, more = figures["1f1b", 16] - full, stash["none", 16]["residuals"] - stash["full", 16]["residuals"]
    print(f"\nremat none over full: compiled temp +{extra} B, residual stash +{more} B, R = {stash['none', 16]}")
    assert abs(extra - more) <= stash["none", 16]["per_microbatch"]


def traced_stash(preset: str, mesh: str, schedule: str, remat: str, sets: tuple[str, ...]) -> tuple:
    """(cfg, its mesh sizes, stash_bytes per device) of `preset` under `schedule` and `remat`, 2
    microbatches of 2 sequences of 256 per batch rank. The trace's shapes are global over the
    mesh's batch and sequence axes: divided by their sizes, per device."""
    from configs import apply_overrides, get_preset
    from pipeline.one_f_one_b import stash_bytes
    from sharding.mesh import parse_mesh

    cfg = apply_overrides(get_preset(preset), [f"model.remat={remat}", f"parallel.schedule={schedule}",
                                                "train.seq_len=256", "parallel.microbatches=2", *sets])
    cfg = dataclasses.replace(cfg, parallel=parse_mesh(mesh, cfg.parallel))
    sizes = mesh_sizes(cfg)
    ranks = math.prod(max(sizes[a], 1) for a in ("data", "fsdp", "expert", "sequence"))
    cfg = apply_overrides(cfg, [f"train.global_batch_size={2 * 2 * ranks}"])
    mesh_ = build_mesh(cfg.parallel, _devices(cfg))
    program = make_program(cfg, mesh_)
    with jax.set_mesh(mesh_):
        held = stash_bytes(cfg, program.graphdef, program.state.params, 2 * ranks)
    return cfg, sizes, {name: value / ranks for name, value in held.items()}


# (preset, mesh, --set values, tolerance): dense scanned (tiny, GQA) and unrolled (125m), both
# cores, batch and sequence splits, capacity and dropless experts
SLOT_CASES = [
    ("tiny", "pp=2", ("model.attention=xla",), 0),
    ("tiny", "pp=2", ("model.attention=pallas",), 0),
    ("tiny", "pp=2,dp=2", ("model.attention=xla",), 0),
    ("125m", "pp=2", ("model.attention=pallas", "model.n_layers=4"), 0),
    ("tiny", "pp=2,sp=2", ("model.attention=pallas", "parallel.context_impl=allgather"), 0.01),
    ("moe-tiny", "pp=2", ("model.attention=pallas",), 0.01),
    ("moe-tiny", "pp=2", ("model.attention=pallas", "model.moe_dispatch=dropless"), 0.01),
]


@pytest.mark.parametrize("preset, mesh, sets, rel", SLOT_CASES)
def test_estimate_counts_what_a_1f1b_slot_holds(preset, mesh, sets, rel):
    """tools.activations.chunk_residuals, the planner's bytes of one residual slot, against
    stash_bytes (an abstract trace of the chunk's vjp under model.remat.stash_policy: what the
    slot holds) for every remat policy, bf16 compute: exact for dense layers on a batch split;
    within 1% where the trace keeps a few small integer arrays the formula leaves out (the
    sequence split's zigzag positions, the experts' routing bookkeeping)."""
    from tools.activations import chunk_residuals

    for remat in ("none", "dots", "attn", "full"):
        cfg, sizes, held = traced_stash(preset, mesh, "1f1b", remat, sets)
        assert chunk_residuals(cfg, sizes) == pytest.approx(held["per_microbatch"], rel=rel or 1e-12), (remat, held)


@pytest.mark.parametrize("preset, sets", [
    ("tiny", ("model.attention=xla",)),
    ("125m", ("model.attention=pallas", "model.n_layers=4", "model.n_kv_heads=4", "model.head_dim=32"))])
def test_estimate_counts_what_zb_h1_leaves_for_w(preset, sets):
    """tools.activations.zb_stash against the traced stash of zb-h1's B for its W (stash_bytes), for
    every remat policy, pp=2, dense layers (125m with N·H, K·H and D all different); zbv's, per
    chunk, half a stage's layers."""
    from tools.activations import zb_stash

    for schedule, extra in (("zb-h1", ()), ("zbv", ("parallel.virtual_stages=2", "model.n_layers=4"))):
        for remat in ("none", "dots", "attn", "full"):
            cfg, sizes, held = traced_stash(preset, "pp=2", schedule, remat, (*sets, *extra))
            assert zb_stash(cfg, sizes) == pytest.approx(held["stash_per_microbatch"], rel=1e-12), (schedule, remat)


def held_activations(hlo: str, act: tuple[int, ...]) -> int:
    """Most [b, L, D] activations that one array of the compiled HLO text holds: the product of
    the leading dimensions of every array whose shape ends in `act`."""
    import re

    tail = ",".join(map(str, act))
    shapes = re.findall(r"\b[a-z]+[0-9]*\[([0-9,]+)\]", hlo)
    return max(math.prod(int(d) for d in s.split(",")[:-len(act)]) for s in shapes
               if s == tail or s.endswith("," + tail))


def test_1f1b_stash_holds_at_most_p_microbatches(temp_memory):
    """README: a 1f1b stage holds the residuals of at most p microbatches instead of M. The slot
    counts from the timetable at p = 2..4 and M up to 16: p residual slots (stage 0 between F and
    B), 2 input slots, 1 gradient slot; in the compiled step at pp=2, M = 16 no array holds more
    than p = 2 activations [b, L, D] = [2, 32, 64] (an M-sized stash would hold 16); gpipe's
    step holds M + 1 (the detector sees them)."""
    from pipeline.tick_program import program

    for p in (2, 3, 4):
        for m in (4, 8, 16):
            prog = program("1f1b", p, m)
            assert (prog.residuals, prog.inputs, prog.inbox) == (p, 2, 1), (p, m)
    compiled = temp_memory[1]
    act = (2, 32, 64)
    assert held_activations(compiled["1f1b", 16][0].as_text(), act) == 2
    assert held_activations(compiled["gpipe", 16][0].as_text(), act) >= 16


def _cells(jaxpr):
    """The 1f1b program's cell switches, found as the jaxpr level holding the two permutes'
    conds (2 branches each: the pass-through, the permute), then the head's cond
    (pipeline/head.py, at the head ticks on every stage), the cells' conds (pipeline.cells.run_cell:
    one per group of GROUPS present, its first branch the pass-through): F, B and, zb-h1, W; then
    the embedding backward's cond (the pass-through, then the lookup's transpose). All have 2
    branches."""
    conds = [eqn.params["branches"] for eqn in jaxpr.eqns if eqn.primitive.name == "cond"]
    if [len(b) for b in conds] in ([2] * 6, [2] * 7):
        return conds[2:-1]
    for eqn in jaxpr.eqns:
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else [value]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns") and (found := _cells(inner)):
                    return found
    return None


def _cell_dots(schedule: str, remat: str, mesh: str = "pp=2") -> tuple:
    """Matmuls in the schedule's cells: (the most in any switch's pass-through branch, F, B, W
    (None without one), the head)."""
    cfg = small_config(mesh, f"parallel.schedule={schedule}", f"model.remat={remat}")
    mesh = build_mesh(cfg.parallel, _devices(cfg))
    job = build(cfg, mesh)
    with jax.set_mesh(mesh):
        jaxpr = jax.make_jaxpr(functools.partial(loss_and_grads, graphdef=job.graphdef, cfg=cfg,
                                                 schedule=schedule))(job.state.params, batch=job.batches(0))
    switches = [[count_prims(branch) for branch in branches] for branches in _cells(jaxpr.jaxpr)]
    (keep_h, head), (keep_f, forward), (keep_b, backward), *w = switches
    weight = w[0][1] if w else None
    return max(keep_h, keep_f, keep_b, *(b[0] for b in w)), forward, backward, weight, head


@pytest.mark.parametrize("remat", ["none", "dots", "full"])
def test_1f1b_backward_recomputes_no_forward_unless_remat_full(remat):
    """The B cell runs the vjp from the residuals kept by its F: with remat none it holds
    exactly two matmuls (dx and dW) per forward matmul of the F cell, no recomputed forward;
    with dots it recomputes only the attention's batched matmuls (q·k and p·v, 2 per layer);
    with full each layer's forward is recomputed once from its kept input (the chunk's
    checkpoint keeps the layers' inputs, model.remat.stash_policy): 3 per forward matmul, less
    the one whose result only the discarded forward uses (the chunk recomputed whole, then each
    layer again, took 35).
    The head's cell, on every stage at the last chunk's B ticks, runs the head and loss forward
    and backward on its vocabulary slice: 3 matmuls (logits, dh, dW)."""
    idle, forward, backward, weight, head = _cell_dots("1f1b", remat)
    assert (idle, forward, weight, head) == (0, 9, None, 3)  # a layer: q, k, v, o, q·k, p·v, gate, up, down
    assert backward == {"none": 18, "dots": 20, "full": 26}[remat]


@pytest.mark.parametrize("mesh, remat", [("pp=2", "none"), ("pp=2", "full"), ("pp=2,tp=2", "none"),
                                         ("pp=2,tp=2", "full")])
def test_zb_h1_splits_the_backward_without_repeating_work(mesh, remat):
    """zb-h1's B cell holds only the input-gradient chain and its W cell only the 7 weight
    matmuls (q, k, v, o, gate, up, down): together the unsplit B's matmuls, none twice
    (pipeline/split_backward.py); remat full recomputes each layer's forward in B. The head's
    cell runs the head and loss forward and backward (3 matmuls). Under
    explicit TP the matmuls sit in shard_map regions, split in two as well
    (pipeline/split_map.py): kept whole, W held none (B 18, W 0)."""
    idle, forward, backward, weight, head = _cell_dots("zb-h1", remat, mesh)
    unsplit = {"none": 18, "full": 26}[remat]
    assert (idle, forward, weight, head) == (0, 9, 7, 3)
    assert backward + weight == unsplit


def stage_bytes(ops) -> float:
    """Bytes over stage of the device that moves the most (at p = 2 without a ring, each device
    sends one of the two permutes: tools.hlo.per_device)."""
    from tools.hlo import per_device

    return per_device([c for c in ops if c.axes == ("stage",)])


@pytest.mark.parametrize("schedule, remat", [("gpipe", "none"), ("gpipe", "full"), ("interleaved", "none"),
                                             ("interleaved", "full")])
def test_circular_keeps_no_weights_per_tick_nor_head_gradient_per_microbatch(schedule, remat):
    """The traced step of gpipe and interleaved (pp=2, V = 1 and 2, 4 layers, M = 4 of b = 4
    sequences): no value stacks the chunk's [Lc, D, F] weights per tick (picked by the tick's
    traced chunk outside the chunk's checkpoint, autodiff of the tick scan kept one copy a
    tick: pipeline.circular), only the stage's [V, Lc, ...] layout; no [M, D, V] head gradient
    (a vmap of the head over M made one per microbatch); of the MLP's [b, L, F] values the tick
    scan stacks [ticks, Lc, b, L, F] only the two projections' under remat none (their
    elementwise products, four more, recomputed: model.remat.stash_policy), none under full;
    and under remat full no logits of more than one microbatch, [b, L, V]
    (pipeline.circular.head_loss); remat none holds those of the M/p = 2 microbatches dealt to
    the stage (pipeline.circular.dealt), [b·M/p, L, V], where it had held all M's. The previous
    circular.py fails all but gpipe under full."""
    virtual = 2 if schedule == "interleaved" else 1
    cfg = small_config("pp=2", f"parallel.schedule={schedule}", f"parallel.virtual_stages={virtual}",
                       "parallel.microbatches=4", f"model.remat={remat}", "model.n_layers=4")
    mesh = build_mesh(cfg.parallel, _devices(cfg))
    program = make_program(cfg, mesh)
    with jax.set_mesh(mesh):
        jaxpr = jax.make_jaxpr(program.step_fn)(program.state, program.abstract_batch())
    shapes = {tuple(v.aval.shape) for e in equations(jaxpr) for v in e.outvars if hasattr(v.aval, "shape")}
    m, lc, b, length = 4, 4 // (2 * virtual), 4, cfg.train.seq_len
    d, f, v = cfg.model.d_model, cfg.model.d_ff, cfg.model.vocab_size
    stacked = [x for x in shapes if len(x) == 4 and x[1:] in ((lc, d, f), (lc, f, d)) and x[0] not in (1, virtual, 2 * virtual)]
    assert not stacked, stacked  # one chunk, the stage's [V, Lc, ...] layout (outside the shard_map [p·V, Lc, ...])
    ticks = virtual * m + 2 - 1
    per_tick = [tuple(o.aval.shape) for e in equations(jaxpr) if e.primitive.name == "scan" for o in e.outvars]
    assert per_tick.count((ticks, lc, b, length, f)) == (2 if remat == "none" else 0)  # 6 before
    assert (m, d, v) not in shapes
    logits = max(math.prod(x) for x in shapes if x and x[-1] == v)
    assert logits == (m // 2 if remat == "none" else 1) * b * length * v, sorted(x for x in shapes if x and x[-1] == v)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_census_permutes_on_stage_and_gathers_no_stacked_weights(schedule, temp_memory):
    """pp=2 at M = 4, 8, 16: the ticks permute [b, L, D] (b = 2 sequences per microbatch), no
    stacked weight is gathered over stage (the embedding and head, stored 1/p a stage, are: once
    each, pipeline/stage_weights.py; under 1f1b the head as each stage's vocabulary columns, by
    an all-to-all there and one back: pipeline/head.py), and the bytes over stage are tools.pipeline_traffic.stage's
    exactly: under gpipe 2T permutes of a microbatch for the T ticks of the table (bubble
    ticks included) and the M/2 outputs dealt to stage 0's head and their cotangents back
    (pipeline.circular.dealt); under 1f1b a permute at each tick that some stage receives by
    it (pipeline.tick_program.moves: M each way at p = 2, of the 2M + 2 ticks); and the
    embedding and head gathered, their gradients reduce-scattered, the norm's all-reduced
    (pipeline/engine.py)."""
    from tools import pipeline_traffic
    from tools.hlo import compiled_census
    from tools.pipeline_figures import pipeline_figures

    for m in (4, 8, 16):
        (compiled, mesh) = temp_memory[1][schedule, m]
        cfg = small_config("pp=2", f"parallel.schedule={schedule}", f"parallel.microbatches={m}",
                           f"train.global_batch_size={2 * m}")
        ops = compiled_census(compiled, cfg, mesh)
        permutes = [c for c in ops if c.kind == "collective-permute" and c.axes == ("stage",)]
        dealt = m // 2 * 2 * 32 * 64 if schedule == "gpipe" else None
        assert permutes and all(c.elements in (2 * 32 * 64, dealt) for c in permutes if "ppermute" in c.op_name)
        assert schedule != "gpipe" or sum(c.elements == dealt for c in permutes) == 2  # there and back
        tables = cfg.model.vocab_size * cfg.model.d_model
        gathers = [(c.elements, c.trips) for c in ops if c.kind == "all-gather" and "stage" in c.axes]
        scatters = [(c.elements, c.trips) for c in ops if c.kind == "reduce-scatter" and "stage" in c.axes]
        exchanged = [(c.elements, c.trips) for c in ops if c.kind == "all-to-all" and "stage" in c.axes]
        whole = 2 if schedule == "gpipe" else 1  # 1f1b: the embedding whole, the head's columns exchanged
        assert gathers == scatters == [(tables, 1)] * whole, (gathers, scatters)
        assert exchanged == [(tables // 2, 1)] * (2 - whole) * 2, exchanged
        assert stage_bytes(ops) == pytest.approx(pipeline_traffic.stage(cfg, mesh_sizes(cfg)), rel=1e-3), m
        if schedule == "1f1b":
            assert pipeline_figures(cfg, mesh_sizes(cfg))["permute_ticks"] == (m, m)


@pytest.mark.parametrize("schedule, v, mesh", [
    ("zb-h1", 1, "pp=2"), ("interleaved-1f1b", 2, "pp=2"), ("interleaved", 2, "pp=2"), ("zbv", 2, "pp=2"),
    ("zbv", 2, "pp=4"), ("gpipe", 1, "pp=4"), ("interleaved", 2, "pp=4"), ("interleaved-1f1b", 2, "pp=4"), ("1f1b", 1, "pp=2,tp=2"), ("1f1b", 1, "pp=2,tp=2 sp full"),
    ("zb-h1", 1, "pp=2,tp=2 full"), ("zbv", 2, "pp=2,tp=2 sp"), ("gpipe", 1, "pp=2,tp=2 sp")])
def test_stage_census_is_the_tick_program_contract(schedule, v, mesh):
    """M = 4, 2p layers: the bytes over stage of the stage that sends the most are
    tools.pipeline_traffic.stage's (T permutes for the T ticks of zb-h1's and zbv's tables at p = 2, where
    each device sends one of the two, 2T at p = 4; 2T on interleaved-1f1b's ring; interleaved as
    gpipe with V·M + p - 1 ticks, both rings), and for V = 2 the layers laid out from the stored
    split every step by collective-permutes before and after the ticks (pipeline/layout.py,
    pipeline_traffic.layout): of the stage's 2 chunks 1 leaves it at p = 2, 2 at p = 4 (interleaved's
    stage 0 keeps chunk 0, stage 3 chunk 7; zbv's stage 0 chunk 0), in the compute dtype, and
    their fp32 gradients come back; no all-to-all (XLA's own re-lay moved 1.75x the device's fp32 layer weights each way at p = 4)
    but, in the 1F1B family, the two of the head's columns (pipeline/head.py: its stored 1/p there, its gradient's back).
    Under tp=2 every tensor rank sends its copy of the activations, under sequence parallelism
    its 1/t of them; and the tensor bytes are traffic's, counting each
    cell's collectives per run of the cell (without the cells' shares, as if every branch of
    their switch ran every tick, the census reads 1.5-2x), with the chunk's whole recompute
    under remat full (2 layers a chunk), the embedding's lookup in every F cell and its backward
    at stage 0's M chunk-0 B ticks (in every tick until 2026-12-02: zbv's census under SP
    read 1.25x today's); gpipe's layers run in every tick, idle ones on zeros, T/V = M + 1 times
    (pipeline_traffic.layer_runs; counted M times, the census read 1.21x; now 1.01x). The contract
    leaves out XLA's all-reduces of fp32 vectors: the vocab-parallel loss's max and sums
    ([b, L] per head) and, under sequence parallelism, the norms' scale gradients ([D] per
    layer run). They are about 1/D of the activations' bytes: 1.0-1.2% of gpipe's and the SP
    cases' tensor bytes at this case's D = 64, hence 1.5% there; the census never reads below
    the contract."""
    from tools import pipeline_traffic, traffic
    from tools.shape import DTYPE_BYTES, local_layer_params
    from pipeline.layout import SCOPE
    from sharding.checks import ONE_F_ONE_B
    from tools.hlo import census, compiled_census, per_device

    mesh, *options = mesh.split(" ")
    p = int(mesh.split(",")[0].removeprefix("pp="))
    cfg = small_config(mesh, f"parallel.schedule={schedule}", f"parallel.virtual_stages={v}",
                       "parallel.microbatches=4", "train.global_batch_size=8", f"model.n_layers={2 * p}",
                       f"parallel.sequence_parallel={'sp' in options}",
                       f"model.remat={'full' if 'full' in options else 'none'}")
    compiled, mesh = _compiled(cfg)
    ops = compiled_census(compiled, cfg, mesh)
    sizes = mesh_sizes(cfg)
    if sizes["tensor"] > 1:
        tensor = per_device([c for c in ops if c.axes == ("tensor",)])
        contract = traffic.communication(cfg, sizes)["tensor"]
        small = 0.015 if schedule == "gpipe" or "sp" in options else 0.01  # docstring: the fp32 vectors left out
        assert contract <= tensor == pytest.approx(contract, rel=small)
        if schedule in ONE_F_ONE_B:  # cells in a switch
            every_branch = census(compiled.as_text(), dict(mesh.shape))
            assert per_device([c for c in every_branch if c.axes == ("tensor",)]) > 1.5 * tensor
    assert stage_bytes(ops) == pytest.approx(pipeline_traffic.stage(cfg, sizes), rel=1e-3)
    exchanged = [c.elements for c in ops if c.axes == ("stage",) and c.kind == "all-to-all"]
    head = cfg.model.vocab_size * cfg.model.d_model // (sizes["tensor"] * sizes["stage"])  # a device's stored 1/p
    assert exchanged == [head] * 2 * (schedule in ONE_F_ONE_B), exchanged
    c = DTYPE_BYTES[cfg.model.compute_dtype]
    layers = local_layer_params(cfg, sizes)  # 2 of 2p
    laid_out = per_device([op for op in ops if SCOPE in op.op_name])
    assert laid_out == pytest.approx(max(pipeline_traffic.layout(cfg, sizes)), rel=1e-3)
    assert max(pipeline_traffic.layout(cfg, sizes)) == pytest.approx((c + 4) * layers / 2 * (p // 2) if v > 1 else 0, rel=1e-3)


@pytest.fixture(scope="module")
def tp_sp_1f1b():
    """The compiled 1f1b step on pp=2,dp=2,tp=2 with sequence parallelism, in bf16 (the vocab
    320, so that no other value has the [V/T, D] shape of a device's embedding table)."""
    cfg = small_config("pp=2,dp=2,tp=2", "parallel.schedule=1f1b", "parallel.sequence_parallel=true",
                       "model.compute_dtype=bfloat16", "model.vocab_size=320")
    return cfg, *_compiled(cfg)


def test_1f1b_cells_hold_no_collective_across_stages(tp_sp_1f1b):
    """The devices of different stages run different 1f1b cells (lax.switch) in the same tick,
    so a collective inside a cell may only group devices of one stage, and no collective-permute
    (XLA runs one over all devices): with tp and sequence parallelism on, the census of the
    compiled step finds none inside the cells: the F cell's embedding lookup reduce-scatters
    within the stage, and the lookup's backward and the ticks' permutes run outside them, in
    conditionals of their own that every device takes alike (pipeline/one_f_one_b.py)."""
    from pipeline.tick_program import NAMES, SCOPE
    from tools.hlo import census

    _, compiled, mesh = tp_sp_1f1b
    ops = census(compiled.as_text(), dict(mesh.shape))
    in_cell = re.compile(f"/{SCOPE}({'|'.join(NAMES.values())})/")
    cells = [c for c in ops if in_cell.search(c.op_name)]
    assert [c for c in ops if c.kind == "collective-permute" and "/cond/" in c.op_name]  # the permutes' own
    assert {c.kind for c in cells} >= {"all-gather", "reduce-scatter"}  # SP's, per stage
    assert [c for c in cells if "pipeline_cell_F/embedding" in c.op_name and c.kind == "reduce-scatter"]
    assert not [c for c in cells if c.kind == "collective-permute" or "stage" in c.axes]


def test_1f1b_embedding_gradient_is_scattered_in_place(tp_sp_1f1b):
    """Every stage runs the embedding's backward at the M ticks of stage 0's chunk-0 B cells
    (pipeline/one_f_one_b.py says why), so it must cost the tick's b·L·D rows, not the table:
    the lookup's transpose from an fp32 table (pipeline.cells.embed_grad) scatters into the
    fp32 accumulator in place, and no [V/T, D] table is filled, converted, added or copied
    inside the tick loop (the conditional that runs it passes the accumulator through). The
    vjp of the bf16 lookup filled, converted and added every tick. A value inside a fusion is
    not held unless it is the fusion's result: the F cell's lookup gathers its rows from the
    table converted in the gather's fusion (XLA CPU computes bf16 in fp32), element by element."""
    import re

    from tools.hlo_text import INSTRUCTION, computation_runs

    cfg, compiled, mesh = tp_sp_1f1b
    text = compiled.as_text()
    body, runs = computation_runs(text)
    fused = set(re.findall(r" fusion\(.*?calls=%?([\w.\-]+)", text))
    table = f"[{cfg.model.vocab_size // mesh.shape['tensor']},{cfg.model.d_model}]"
    in_loop = [m for comp, lines in body.items() if runs.get(comp, 0) > 1 for line in lines
               if (m := INSTRUCTION.match(line)) and table in m.group(2)
               and (comp not in fused or line.lstrip().startswith("ROOT"))]
    ops = {m.group(3) for m in in_loop}
    assert "conditional" in ops and not {"broadcast", "convert", "add", "copy"} & ops, sorted(ops)


@pytest.mark.parametrize(
    "mesh, overrides, message",
    [
        ("pp=2", ["model.n_layers=3"], "model.n_layers=3 is not divisible by pp*virtual_stages=2*1=2"),
        ("pp=2", ["parallel.schedule=interleaved", "parallel.virtual_stages=2"], "model.n_layers=2 is not divisible by pp*virtual_stages=2*2=4"),
        ("pp=4", ["model.n_layers=4", "parallel.microbatches=2"], "parallel.microbatches=2 is fewer than the pp=4 stages"),
        ("pp=2", ["parallel.schedule=zigzag"], "choose one of gpipe, interleaved, 1f1b, interleaved-1f1b, zb-h1"),
        ("pp=2", ["parallel.virtual_stages=2"], "with --set parallel.schedule=interleaved"),
        ("pp=2", ["train.micro_batch_size=4"], "set train.micro_batch_size=0"),
        ("pp=2,tp=2", ["parallel.schedule=1f1b", "parallel.sequence_parallel=true", "parallel.tp_overlap=true"], "set parallel.tp_overlap=false"),
        ("pp=2", ["parallel.microbatches=3"], "parallel.microbatches=3 does not divide the 16 sequences per data-"
                                              "parallel rank (global_batch_size 16 / dp*fsdp*ep 1): try --set "
                                              "parallel.microbatches=2"),
        ("pp=2", ["model.n_layers=6", "train.global_batch_size=3"],
         "parallel.microbatches=2 (0: one per stage) does not divide the 3 sequences per data-parallel rank "
         "(global_batch_size 3 / dp*fsdp*ep 1): try --set parallel.microbatches=3"),
        ("pp=2,dp=2", ["train.global_batch_size=2"], "try a train.global_batch_size that is a multiple of "
                                                     "pp*dp*fsdp*ep=4"),
        ("pp=2", ["parallel.schedule=interleaved-1f1b", "model.n_layers=4"], "--set parallel.virtual_stages=2 (with V=1 it is 1f1b)"),
        ("pp=4", ["parallel.schedule=interleaved-1f1b", "parallel.virtual_stages=2", "model.n_layers=8",
                  "train.global_batch_size=12", "parallel.microbatches=6"],
         "parallel.microbatches=6 with schedule=interleaved-1f1b must be a multiple of pp=4"),
        ("pp=2", ["parallel.schedule=zb-h1", "parallel.virtual_stages=2", "model.n_layers=4"], "with --set parallel.schedule=interleaved"),
        ("pp=2,tp=2", ["parallel.schedule=zb-h1", "parallel.sequence_parallel=true", "parallel.tp_overlap=true"], "parallel.tp_overlap=true with parallel.schedule=zb-h1"),
        ("pp=2,sp=2", ["parallel.schedule=interleaved-1f1b", "parallel.virtual_stages=2", "model.n_layers=4"], "parallel.context_impl=ring with parallel.schedule=interleaved-1f1b"),
        ("pp=2", ["parallel.schedule=zbv", "model.n_layers=4"], "parallel.schedule=zbv with parallel.virtual_stages=1: "
         "it runs 2 chunks of layers per stage, in a V; --set parallel.virtual_stages=2"),
        ("pp=2", ["parallel.schedule=zbv", "parallel.virtual_stages=4", "model.n_layers=8"], "zbv with parallel.virtual_stages=4"),
        ("pp=2", ["parallel.schedule=zbv", "parallel.virtual_stages=2"], "model.n_layers=2 is not divisible by pp*virtual_stages=2*2=4"),
    ],
)
def test_bad_pipeline_settings_are_clear_errors(mesh, overrides, message):
    cfg = small_config(mesh, *overrides)
    with pytest.raises(ConfigError) as err:
        make_program(cfg, build_mesh(cfg.parallel, _devices(cfg)))
    assert message in str(err.value)


def test_pipeline_mesh_needs_enough_devices():
    cfg = small_config("pp=4,tp=4", "model.n_layers=4")
    with pytest.raises(ConfigError, match="needs 16 devices but 8 are available"):
        build_mesh(cfg.parallel, jax.devices()[:8])


def test_the_step_outside_its_mesh_is_one_clear_error():
    """A pipelined step traced with no mesh in context (the schedules read p from it) is refused
    with the fix, not a KeyError from the tick program built for one stage."""
    import dataclasses

    from sharding.mesh import mesh_config

    cfg = small_config("pp=2", "parallel.schedule=1f1b", "model.n_layers=4")
    mesh = build_mesh(cfg.parallel, _devices(cfg))
    program = make_program(dataclasses.replace(cfg, parallel=mesh_config(mesh, cfg.parallel)), mesh)
    with pytest.raises(ConfigError, match=r"needs its mesh in context.*jax.set_mesh\(mesh\)"):
        jax.eval_shape(program.step_fn, program.state, program.abstract_batch())
