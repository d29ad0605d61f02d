"""tools/hlo.py: the census parser, and the communication contract of DESIGN.md held against
the compiled train step of the tiny preset (bf16 compute) on 8 fake CPU devices.

How counts are read: a collective inside a while body runs once per iteration, so `trips` of
an op in the layer scan is n_layers (4) and "per layer" means ops with trips == n_layers. The
forward and backward scans are separate loops; backward ops carry `transpose(` in their
jax op_name. XLA on CPU computes bf16 matmuls in fp32, so the compiled buffers are f32: the
byte checks compare like with like, and the bf16 of the program is checked in its jaxpr.
Each contract test prints its census table; pytest shows it when the test fails.
"""

import dataclasses
import functools
import json
import re

import jax
import pytest

from configs import apply_overrides, get_preset
from model.transformer import count_params
from sharding.mesh import build_mesh, parse_mesh
from conftest import SMALL, run_module
from tools.hlo import census, format_table, per_device, step_census, summary
from training.build import make_program

TRIPS_MODULE = """HloModule m

%add (a: f32[], b: f32[]) -> f32[] {
  ROOT %s = f32[] add(f32[] %a, f32[] %b)
}

%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %ar = f32[1000]{0} all-reduce(%x), channel_id=1, replica_groups=[2,4]<=[8], use_global_device_ids=true, to_apply=%add
  %ag = (bf16[4,16]{1,0}, bf16[16,16]{1,0}) all-gather-start(%y), channel_id=2, replica_groups=[4,2]<=[2,4]T(1,0), dimensions={0}
  %cp = (f32[8]{0}, f32[8]{0}, u32[], u32[]) collective-permute-start(%z), channel_id=3, source_target_pairs={{0,1},{1,2},{2,3},{3,0},{4,5},{5,6},{6,7},{7,4}}
  ROOT %t = (s32[], f32[8]) tuple(%i, %w)
}

%cond (p: (s32[], f32[8])) -> pred[] {
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%wrapped (q: f32[16]) -> f32[4] {
  ROOT %rs = f32[4]{0} reduce-scatter(%q), channel_id=4, replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={0}, to_apply=%add
}

ENTRY %main (a: f32[8]) -> f32[8] {
  %w = (s32[], f32[8]) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %rs-start = ((f32[16]{0}), f32[4]{0}) async-start(%v), calls=%wrapped
  ROOT %a2a = f32[8]{0} all-to-all(%u), channel_id=5, replica_groups={{0,4},{1,5},{2,6},{3,7}}, dimensions={0}
}
"""


def test_census_reads_kinds_axes_loops_and_async_forms():
    found = {c.name: c for c in census(TRIPS_MODULE, {"data": 2, "tensor": 4})}
    assert set(found) == {"ar", "ag", "cp", "rs", "a2a"}
    ar, ag, cp, rs, a2a = (found[n] for n in ("ar", "ag", "cp", "rs", "a2a"))
    assert (ar.kind, ar.axes, ar.group, ar.trips, ar.elements) == ("all-reduce", ("tensor",), 4, 3, 1000)
    assert ar.bytes_per_run == 2 * 4000 * 3 / 4 and ar.bytes_per_step == 3 * ar.bytes_per_run
    assert (ag.kind, ag.axes, ag.dtype, ag.elements) == ("all-gather", ("data",), "bf16", 256)  # the result
    assert ag.bytes_per_run == 512 * 1 / 2
    assert (cp.kind, cp.axes, cp.elements, cp.bytes_per_run) == ("collective-permute", ("tensor",), 8, 32)
    assert (rs.kind, rs.axes, rs.trips, rs.elements) == ("reduce-scatter", ("tensor",), 1, 16)  # 4 x result
    assert rs.bytes_per_run == 64 * 3 / 4
    assert (a2a.kind, a2a.axes, a2a.bytes_per_run) == ("all-to-all", ("data",), 32 * 1 / 2)
    rows = {(r["kind"], r["axes"]): r for r in summary(list(found.values()))}
    assert rows[("all-reduce", "tensor")] == {"kind": "all-reduce", "axes": "tensor", "ops": 1, "count": 3,
                                               "bytes_per_device": 18000.0}
    assert "collective-permute" in format_table(list(found.values()))


PIPELINE_PERMUTES = """HloModule m

ENTRY %main (a: f32[16], b: f32[16]) -> f32[16] {
  %down = f32[16]{0} collective-permute(%a), channel_id=1, source_target_pairs={{0,1}}
  %up = f32[16]{0} collective-permute(%b), channel_id=2, source_target_pairs={{1,0}}
  %stay = f32[16]{0} collective-permute(%b), channel_id=3, source_target_pairs={{0,0},{1,1}}
  ROOT %ar = f32[16]{0} all-reduce(%a), channel_id=4, replica_groups={{0,1}}, to_apply=%add
}
"""


def test_census_counts_a_permute_for_its_senders_only():
    """pp=2's permutes: down from stage 0 only, up from stage 1 only, and a pair of one device (a
    local copy) moves nothing. Each device sends 64 bytes, not 128 (every permute counted as
    sent by every device, the census before per_device); the all-reduce's 2S(N-1)/N comes on
    top for both, and the total is the busiest device's."""
    found = {c.name: c for c in census(PIPELINE_PERMUTES, {"stage": 2})}
    assert (found["down"].devices, found["up"].devices, found["stay"].devices) == ((0,), (1,), ())
    assert (found["down"].bytes_per_run, found["stay"].bytes_per_run) == (64, 0)
    rows = {(r["kind"], r["axes"]): r["bytes_per_device"] for r in summary(list(found.values()))}
    assert rows == {("collective-permute", "stage"): 64, ("all-reduce", "stage"): 64, ("collective-permute", "-"): 0}
    assert per_device(list(found.values())) == 128
    assert format_table(list(found.values())).splitlines()[-1].split()[-1] == f"{128 / 2**20:.3f}"


def test_census_reads_the_mesh_form_of_replica_groups():
    """XLA of jax >= 0.12 prints groups as a mesh and the axes they span (its own mesh: the names
    need not be ours, so the groups are resolved to device ids), with sub-axes and listed ids."""
    module = """HloModule m

%add (a: f32[], b: f32[]) -> f32[] {
  ROOT %s = f32[] add(f32[] %a, f32[] %b)
}

ENTRY %main (a: f32[8]) -> f32[8] {
  %t = f32[8]{0} all-reduce(%a), replica_groups=mesh['data'=2,'tensor'=4] {'tensor'}, to_apply=%add
  %d = f32[8]{0} all-reduce(%t), replica_groups=mesh['axis_0'=4,'axis_1'=2] {'axis_1'}, to_apply=%add
  %s = f32[8]{0} all-reduce(%d), replica_groups=mesh['x'=8] {'x':(1)4}, to_apply=%add
  ROOT %p = f32[8]{0} all-reduce(%s), replica_groups=mesh['x'=4,'y'=2], device_ids=([[0,4],[1,5],[2,6],[3,7]]) {'x'}, to_apply=%add
}
"""
    found = {c.name: c for c in census(module, {"data": 2, "tensor": 4})}
    assert {n: (c.axes, c.group) for n, c in found.items()} == {
        "t": (("tensor",), 4), "d": (("tensor",), 2), "s": (("data", "tensor"), 4), "p": (("tensor",), 4)}


def test_census_reads_the_async_form_with_aliased_operands():
    """XLA GPU of jax 0.12 types an async collective's start as ((operands), result): lines of the
    tiny step compiled for H100s (tools.plan --compile-for-gpu, metadata cut). The operand is not
    a second buffer: before this was read, an all-reduce counted twice its bytes and a
    reduce-scatter three times (the tensor axis's census was 1.56x its contract)."""
    module = """HloModule m

%add (a: bf16[], b: bf16[]) -> bf16[] {
  ROOT %s = bf16[] add(bf16[] %a, bf16[] %b)
}

ENTRY %main (a: bf16[16,128,128]) -> bf16[16,128,128] {
  %ar = ((bf16[16,128,128]{2,1,0}), bf16[16,128,128]{2,1,0}) all-reduce-start(%a), channel_id=1, replica_groups=mesh['stage'=1,'data'=2,'fsdp'=1,'expert'=1,'sequence'=1,'tensor'=2] {'tensor'}, use_global_device_ids=true, to_apply=%add, output_to_operand_aliasing={{1}: (0, {})}
  %rs = ((bf16[256,128]{1,0}), bf16[256,64]{1,0}) reduce-scatter-start(%b), channel_id=2, replica_groups=[2,2]<=[2,2]T(1,0), dimensions={1}, to_apply=%add
  %cp = ((bf16[8,128,128]{2,1,0}), bf16[8,128,128]{2,1,0}) collective-permute-start(%c), channel_id=3, source_target_pairs={{0,2},{2,0},{1,3},{3,1}}
  ROOT %d = bf16[16,128,128]{2,1,0} all-reduce-done(%ar)
}
"""
    found = {c.name: c for c in census(module, {"data": 2, "tensor": 2})}
    assert {n: (c.kind, c.axes, c.dtype, c.elements) for n, c in found.items()} == {
        "ar": ("all-reduce", ("tensor",), "bf16", 16 * 128 * 128),
        "rs": ("reduce-scatter", ("data",), "bf16", 256 * 128),
        "cp": ("collective-permute", ("data",), "bf16", 8 * 128 * 128)}
    assert found["ar"].bytes_per_run == 2 * (16 * 128 * 128 * 2) / 2


def test_census_reads_a_combined_collective_of_mixed_dtypes():
    """XLA GPU combines a context-parallel ring's backward permutes into one of a tuple, fp32 dK
    beside bf16 K and V (125m gpipe on pp=2,dp=2,sp=2 compiled for H100s, metadata cut): its
    bytes are each part's in its own dtype. Read as fp32 throughout, the ring's census had
    grown 18% with no byte more on the wire."""
    module = """HloModule m

ENTRY %main (a: f32[8,512,12,64]) -> f32[8,512,12,64] {
  %cp = ((f32[8,512,12,64]{3,2,1,0}, bf16[8,512,12,64]{3,2,1,0}, bf16[8,512,12,64]{3,2,1,0}), (f32[8,512,12,64]{3,2,1,0}, bf16[8,512,12,64]{3,2,1,0}, bf16[8,512,12,64]{3,2,1,0})) collective-permute-start(%x, %y, %z), channel_id=1, source_target_pairs={{0,1},{1,0},{2,3},{3,2}}
  ROOT %d = f32[8,512,12,64]{3,2,1,0} add(%a, %a)
}
"""
    (cp,) = census(module, {"data": 2, "sequence": 2})
    n = 8 * 512 * 12 * 64
    assert (cp.kind, cp.axes, cp.dtype, cp.elements) == ("collective-permute", ("sequence",), "bf16", 4 * n)
    assert cp.bytes_per_run == n * 4 + 2 * n * 2


def test_census_counts_a_loop_without_trip_count_from_its_condition():
    """XLA GPU unrolls tiny's accumulation scan (4 microbatches on fsdp=2: one peeled, the rest
    in a loop) and drops its known_trip_count: the trips are read off the condition, i < 3 in a
    fused compare, with i starting at constant 0 through copies (the shape of that program)."""
    module = """HloModule m

%add (a: bf16[], b: bf16[]) -> bf16[] {
  ROOT %s = bf16[] add(bf16[] %a, bf16[] %b)
}

%fused_compare (param_0.92: s32[]) -> pred[] {
  %param_0.92 = s32[] parameter(0)
  %constant_831_1 = s32[] constant(3)
  ROOT %compare.6.1 = pred[] compare(%param_0.92, %constant_831_1), direction=LT
}

%cond (p: (s32[], bf16[8])) -> pred[] {
  %p = (s32[], bf16[8]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  ROOT %lt = pred[] fusion(%i), kind=kLoop, calls=%fused_compare
}

%body (p: (s32[], bf16[8])) -> (s32[], bf16[8]) {
  %ag = bf16[8]{0} all-gather(%x), channel_id=1, replica_groups=[4,2]<=[8], dimensions={0}
  ROOT %t = (s32[], bf16[8]) tuple(%i, %ag)
}

%opaque (p: (s32[], bf16[8])) -> pred[] {
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

ENTRY %main (a: bf16[8]) -> bf16[8] {
  %constant_354 = s32[] constant(0)
  %copy.699 = s32[] copy(%constant_354)
  %copy.306 = s32[] copy(%copy.699)
  %tuple.137 = (s32[], bf16[8]) tuple(%copy.306, %a)
  %while.127 = (s32[], bf16[8]) while(%tuple.137), condition=%cond, body=%body, backend_config={"known_induction_variable":{"tuple_index":"0"},"dynamic_variables":[]}
  %while.128 = (s32[], bf16[8]) while(%tuple.137), condition=%opaque, body=%body
  ROOT %r = bf16[8]{0} get-tuple-element(%while.127), index=1
}
"""
    (gather,) = census(module, {"data": 4, "tensor": 2})
    assert (gather.name, gather.axes, gather.trips) == ("ag", ("tensor",), 3 + 1)  # 3 + 1: the opaque loop once


def test_cli_prints_the_census_as_json():
    out = run_module("tools.hlo", *[a for s in SMALL for a in ("--set", s)], "--mesh", "dp=2,tp=2", "--json")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["mesh"] == "dp=2,tp=2"
    kinds = {(r["kind"], r["axes"]) for r in report["rows"]}
    assert ("all-reduce", "tensor") in kinds and ("all-reduce", "data") in kinds
    assert all(op["trips"] >= 1 and op["bytes_per_run"] > 0 for op in report["ops"])
    assert all(op["devices"] == [0, 1, 2, 3] for op in report["ops"])  # no pipeline: every device moves its bytes


# --- the communication contract, on the tiny preset -------------------------------------------


@functools.cache
def _compile(mesh: str, *sets: str):
    cfg = apply_overrides(get_preset("tiny"), list(sets))
    cfg = dataclasses.replace(cfg, parallel=parse_mesh(mesh, cfg.parallel))
    built = build_mesh(cfg.parallel)
    return step_census(cfg, built), count_params(make_program(cfg, built).state.params), cfg


def compiled(mesh: str, *sets: str):
    """(census, n_params, cfg) of tiny's train step on `mesh` (compiled once per session);
    prints the census table, which pytest shows when the test fails."""
    found, n_params, cfg = _compile(mesh, *sets)
    print(f"census of tiny on {mesh} {' '.join(sets)}:\n{format_table(found)}")
    return found, n_params, cfg


def total(found, kinds, axes, **where) -> float:
    return sum(c.bytes_per_step for c in found if c.kind in kinds and c.axes == axes
               and all(getattr(c, k) == v for k, v in where.items()))


def test_dp_gradient_all_reduce_is_2P():
    found, n_params, _ = compiled("dp=8")
    n, grad_bytes = 8, 4 * n_params  # fp32 gradients as the compiled CPU program holds them
    moved = total(found, ("all-reduce", "reduce-scatter", "all-gather"), ("data",))
    assert moved == pytest.approx(2 * grad_bytes * (n - 1) / n, rel=0.02)
    assert {c.axes for c in found} == {("data",)}  # nothing else communicates


def test_fsdp_gathers_weights_twice_and_reduces_gradients():
    """ZeRO-3 on fsdp=8. XLA keeps nothing gathered between the forward and the backward scan:
    each block weight is all-gathered in the forward scan and again in the backward (7 weight
    matrices per block, norms are not sharded), the embedding and head once each way: 2P(N-1)/N.
    The gradients are reduced with an all-reduce and a slice: XLA's CPU pipeline lacks the pass
    that turns that pair into a reduce-scatter (GPU's has it), so it moves 2P(N-1)/N instead of
    P(N-1)/N. Counted at reduce-scatter volume the total is the contract's 3P(N-1)/N."""
    found, n_params, cfg = compiled("fsdp=8")
    n, p = 8, 4 * n_params
    gathers = total(found, ("all-gather",), ("fsdp",))
    reduces = total(found, ("all-reduce", "reduce-scatter"), ("fsdp",))
    assert gathers == pytest.approx(2 * p * (n - 1) / n, rel=0.05)
    assert reduces == pytest.approx(2 * p * (n - 1) / n, rel=0.05)
    assert gathers + reduces / 2 == pytest.approx(3 * p * (n - 1) / n, rel=0.05)
    per_layer = [c for c in found if c.kind == "all-gather" and c.trips == cfg.model.n_layers]
    assert len(per_layer) == 2 * 7


def reduction_bytes(found) -> dict[str, float]:
    """Gradient-reduction bytes per step by axes (all-reduce and reduce-scatter)."""
    rows = summary([c for c in found if c.kind in ("all-reduce", "reduce-scatter")])
    return {f"{r['kind']}@{r['axes']}": r["bytes_per_device"] for r in rows}


def microbatches(b: int, mesh: str, *sets: str):
    """compiled() of tiny (32 sequences, 4 per rank on 8 batch ranks) in microbatches of b."""
    found, n_params, cfg = compiled(mesh, *sets, f"train.micro_batch_size={b}")
    assert make_program(cfg, build_mesh(cfg.parallel)).batch_shape[0] == 4 // b
    return found


def test_data_parallel_accumulation_reduces_once_per_step():
    """dp=8, k = 1 and k = 4: the same gradient all-reduce bytes per step; at k = 4 each runs
    once (outside the microbatch loop), not once per microbatch."""
    one, four = microbatches(4, "dp=8"), microbatches(1, "dp=8")
    assert reduction_bytes(four) == pytest.approx(reduction_bytes(one), rel=1e-9)
    assert set(reduction_bytes(four)) == {"all-reduce@data"}
    assert all(c.trips == 1 for c in four)


def test_fsdp_accumulation_reduces_data_once_and_stays_zero_3():
    """dp=4,fsdp=2 with k = 2 and k = 4 microbatches: the gradients are all-reduced over data
    once per step (the same bytes at both k); over fsdp they stay XLA's ZeRO-3, gathered and
    reduce-scattered a layer at a time in every microbatch (about twice the bytes at k = 4:
    2% less, the head's and embedding's share is per step), so no
    device ever holds whole weights or gradients. parallel.fsdp_gather_once trades that memory
    for once-per-step fsdp traffic (the next test)."""
    two, four = (microbatches(b, "dp=4,fsdp=2") for b in (2, 1))
    data = [total(found, ("all-reduce",), ("data",)) for found in (two, four)]
    assert data[0] == pytest.approx(data[1], rel=1e-9) and data[0] > 0
    assert all(c.trips == 1 for c in four if c.axes == ("data",))
    fsdp = [total(found, ("all-gather", "all-reduce", "reduce-scatter"), ("fsdp",)) for found in (two, four)]
    assert fsdp[1] == pytest.approx(2 * fsdp[0], rel=0.02) and fsdp[0] > 0


def test_fsdp_gather_once_moves_the_same_bytes_whatever_k():
    """parallel.fsdp_gather_once: the weights are gathered before the microbatch loop, so k = 1
    and k = 4 move the same bytes per step on every axis and kind, each collective once."""
    one, four = (microbatches(b, "dp=4,fsdp=2", "parallel.fsdp_gather_once=true") for b in (4, 1))
    by_kind = lambda found: {(r["kind"], r["axes"]): r["bytes_per_device"] for r in summary(found)}  # noqa: E731
    assert by_kind(four) == pytest.approx(by_kind(one), rel=1e-9)
    assert {kind for kind, _ in by_kind(four)} == {"all-gather", "reduce-scatter", "all-reduce"}
    assert all(c.trips == 1 for c in four + one)


REGIONS_OVER_FSDP = [("fsdp=4,sp=2",), ("dp=2,fsdp=2,tp=2", "parallel.sequence_parallel=true")]


@pytest.mark.parametrize("case", REGIONS_OVER_FSDP, ids=[" ".join(c) for c in REGIONS_OVER_FSDP])
def test_regions_over_fsdp_reduce_scatter_before_the_other_batch_axes(case):
    """Regions manual over fsdp and another batch axis (context parallelism; SP beside data)
    take each weight's fsdp shard and gather it themselves (TensorParallel.gather_in_region,
    and the embedding's and head's regions under TP): each gradient is reduce-scattered over
    fsdp (fp32 buffers on CPU: 4·P·(f-1)/f, P the device's layer weights and tables before the
    fsdp split), then its 1/f shard is all-reduced over the other axis; no all-reduce spans
    fsdp and another axis but for the norms' gradients (not split by fsdp). Given the weights
    whole over fsdp, the regions' transpose summed every gradient over fsdp+sequence (or
    data+fsdp) in one all-reduce, each device receiving all of it, and XLA GPU, compiled for
    H100s, reduce-scattered none of the layers' gradients in the layer scan."""
    mesh, *sets = case
    found, _, cfg = compiled(mesh, *sets)
    m, p = cfg.model, cfg.parallel
    f, t, (other, n) = p.fsdp, p.tensor, ("sequence", p.sequence) if p.sequence > 1 else ("data", p.data)
    attention = 2 * m.d_model * (m.n_heads + m.n_kv_heads) * m.head_dim
    weights = (m.n_layers * (attention + 3 * m.d_model * m.d_ff) + 2 * m.vocab_size * m.d_model * (t > 1)) / t
    scattered = 4 * weights * (f - 1) / f
    assert total(found, ("reduce-scatter",), ("fsdp",)) == pytest.approx(scattered, rel=1e-6)
    assert total(found, ("all-reduce",), (other,)) >= 2 * 4 * weights / f * (n - 1) / n * (1 - 1e-6)
    joint = [c for c in found if c.kind == "all-reduce" and "fsdp" in c.axes and len(c.axes) > 1]
    norms = (2 * m.n_layers + 1) * m.d_model
    assert sum(c.elements for c in joint) <= norms + 16  # and the gradient norm's partial sums


@pytest.mark.parametrize("schedule", ["gpipe", "interleaved", "1f1b", "zb-h1", "zbv"])
def test_pipeline_gathers_and_reduces_once_per_step(schedule):
    """pp=2,dp=2,fsdp=2 (tiny, fp32: 32 sequences, 8 per batch rank), M = 4 and 8 microbatches:
    every schedule's engine (pipeline/engine.py), manual over data and fsdp, gathers each
    stage's weights over fsdp once, sums its gradients over the whole schedule, reduce-scatters
    them over fsdp once and all-reduces the shard over data once: every collective on those axes
    runs once per step, the same bytes at both M, equal to `tools.traffic.communication` (the
    stage's parameters: the embedding and head 1/p of them a stage but gathered over fsdp whole
    over stage, the norm whole, 2 of the 4 layers;
    interleaved's and zbv's chunks laid out from the fsdp shards, over stage only). gpipe and
    interleaved, autodiff's transpose of their tick scan under XLA, had reduced the layers'
    gradients in every tick and gathered the weights over fsdp in every use: gpipe moved 4.3x
    these data bytes and 8.5x the fsdp bytes at M = 4, 7.7x and 15.3x at M = 8."""
    from tools import traffic

    chunks = ["parallel.virtual_stages=2"] if schedule in ("zbv", "interleaved") else []
    runs = [compiled("pp=2,dp=2,fsdp=2", f"parallel.schedule={schedule}", f"parallel.microbatches={m}",
                     "model.compute_dtype=float32", *chunks) for m in (4, 8)]
    (four, _, cfg), (eight, _, _) = runs
    on_batch = lambda found: {(r["kind"], r["axes"]): r["bytes_per_device"] for r in summary(found)  # noqa: E731
                              if "data" in r["axes"] or "fsdp" in r["axes"]}
    assert on_batch(eight) == pytest.approx(on_batch(four), rel=1e-9)
    assert all(c.trips == 1 for c in four if {"data", "fsdp"} & set(c.axes))
    assert {kind for kind, _ in on_batch(four)} == {"all-gather", "reduce-scatter", "all-reduce"}
    sizes = {a: getattr(cfg.parallel, a) for a in ("stage", "data", "fsdp", "expert", "sequence", "tensor")}
    contract = traffic.communication(cfg, sizes)
    fsdp = total(four, ("all-gather", "reduce-scatter"), ("fsdp",))
    data = total(four, ("all-reduce",), ("data",)) + total(four, ("all-reduce",), ("data", "fsdp"))
    assert fsdp == pytest.approx(contract["fsdp"], rel=0.01)
    assert data == pytest.approx(contract["data"], rel=0.01)


def test_pipelined_evaluation_gathers_once_per_step():
    """The evaluation step of pp=2,dp=2,fsdp=2 (gpipe's forward, M = 4) runs in the training
    step's region (pipeline.engine.forward_stages): each stage's weights gathered over fsdp
    once, the training step's gathers but for the head, whole here (gpipe's forward) where the
    1F1B family's training step gathers each stage's vocabulary columns of it (pipeline/head.py),
    the embedding and head over stage once each;
    every collective on data and fsdp once per step. Manual over stage alone, it had let XLA
    gather each layer over fsdp in every tick (tiny: 4.4x these bytes, 10 gathers of each layer
    weight a step at M = 4: 5 ticks, 2 layers a stage)."""
    sets = ("parallel.schedule=1f1b", "parallel.microbatches=4", "model.compute_dtype=float32")
    train, _, cfg = compiled("pp=2,dp=2,fsdp=2", *sets)
    mesh = build_mesh(cfg.parallel)
    program = make_program(cfg, mesh)
    with jax.set_mesh(mesh):
        text = program.eval_fn.lower(program.state.params, program.abstract_batch()).compile().as_text()
    found = census(text, dict(mesh.shape))
    print(f"census of tiny's evaluation on pp=2,dp=2,fsdp=2:\n{format_table(found)}")
    assert all(c.trips == 1 for c in found if {"data", "fsdp"} & set(c.axes))
    head = cfg.model.vocab_size * cfg.model.d_model  # whole over fsdp and stage; the training step's columns 1/p
    gathers = lambda ops: sorted(c.elements for c in ops if c.kind == "all-gather" and c.axes == ("fsdp",))  # noqa: E731
    expected = gathers(train)
    expected.remove(head // cfg.parallel.stage)
    assert gathers(found) == sorted([*expected, head])
    tables = cfg.model.vocab_size * cfg.model.d_model // cfg.parallel.fsdp  # each fsdp shard whole over stage
    assert [(c.elements, c.trips) for c in found if c.kind == "all-gather" and c.axes == ("stage",)] == [(tables, 1)] * 2


def tp_loop_ops(found, cfg, kind):
    return [c for c in found if c.kind == kind and c.axes == ("tensor",) and c.trips == cfg.model.n_layers]


def activation_elements(cfg, dp: int) -> int:
    """S = B·L·D of one layer's input on one device (B the local batch)."""
    return cfg.train.global_batch_size // dp * cfg.train.seq_len * cfg.model.d_model


def test_tp_two_all_reduces_per_layer_forward_and_two_backward():
    """dp=2,tp=4 with the shard_map regions: per layer, 2 all-reduces of S in the forward scan
    and 2 in the backward. tiny has K=2 kv heads < tp=4, so wk and wv are replicated and their
    gradients (2·D·K·H) are all-reduced too; XLA merges them into one of the backward ones."""
    found, _, cfg = compiled("dp=2,tp=4")
    m = cfg.model
    s, kv_grads = activation_elements(cfg, 2), 2 * m.d_model * m.n_kv_heads * m.head_dim
    ops = tp_loop_ops(found, cfg, "all-reduce")
    big = [c for c in ops if c.elements >= s]
    forward = [c.elements for c in big if "transpose(" not in c.op_name]
    backward = [c for c in big if "transpose(" in c.op_name]
    assert forward == [s, s] and len(backward) == 2
    assert sum(c.elements for c in ops) == 4 * s + kv_grads
    assert not tp_loop_ops(found, cfg, "all-gather") and not tp_loop_ops(found, cfg, "reduce-scatter")


def test_tp_collectives_are_bf16_in_the_program():
    """The compiled CPU buffers are f32 (see the module docstring); the program all-reduces the
    bf16 activations [B, L, D]: 2 psums in the forward scan body, 2 in the backward, and the
    head's input gradient. (Inside those regions only `tensor` is manual, so the jaxpr shows the
    global batch; XLA splits it on data.) The embedding's region is manual over the batch axes
    too: its psum holds the data-local [B/2, L, D]."""
    _, _, cfg = compiled("dp=2,tp=4")
    program = make_program(cfg, mesh := build_mesh(cfg.parallel))
    with jax.set_mesh(mesh):
        text = str(jax.make_jaxpr(program.step_fn)(program.state, program.abstract_batch()))
    b, length, d = cfg.train.global_batch_size, cfg.train.seq_len, cfg.model.d_model
    psums = re.findall(rf":bf16\[{b},{length},{d}\]\S* = psum\w*\[axes=\('tensor',\)\]", text)
    assert len(psums) == 4 + 1
    assert len(re.findall(rf":bf16\[{b // 2},{length},{d}\]\S* = psum\w*\[axes=\('tensor',\)\]", text)) == 1


def test_sequence_parallel_replaces_each_all_reduce_with_all_gather_and_reduce_scatter():
    plain, _, cfg = compiled("dp=2,tp=4")
    found, _, _ = compiled("dp=2,tp=4", "parallel.sequence_parallel=true")
    s = activation_elements(cfg, 2)
    gathers, scatters = tp_loop_ops(found, cfg, "all-gather"), tp_loop_ops(found, cfg, "reduce-scatter")
    assert [c.elements for c in gathers] == [s] * 4 and [c.elements for c in scatters] == [s] * 4
    assert sum("transpose(" in c.op_name for c in gathers + scatters) == 4  # 2 AG + 2 RS each way
    assert all(c.elements < s for c in tp_loop_ops(found, cfg, "all-reduce"))  # only the kv grads
    sp_bytes = sum(c.bytes_per_step for c in gathers + scatters)
    tp_bytes = sum(c.bytes_per_step for c in tp_loop_ops(plain, cfg, "all-reduce") if c.elements >= s)
    tp_bytes -= sum(c.bytes_per_run * c.trips * (c.elements - s) / c.elements
                    for c in tp_loop_ops(plain, cfg, "all-reduce") if c.elements > s)  # minus the kv grads
    assert sp_bytes == pytest.approx(tp_bytes, rel=1e-6)


def test_overlap_uses_collective_permutes_instead_of_gathers():
    sp, _, cfg = compiled("dp=2,tp=4", "parallel.sequence_parallel=true")
    found, _, _ = compiled("dp=2,tp=4", "parallel.sequence_parallel=true", "parallel.tp_overlap=true")
    s, t = activation_elements(cfg, 2), 4
    assert not tp_loop_ops(found, cfg, "all-gather") and not tp_loop_ops(found, cfg, "reduce-scatter")
    permutes = tp_loop_ops(found, cfg, "collective-permute")
    # 4 rings (2 column, 2 row) of T-1 steps in each scan, each step moving one chunk S/T
    assert len(permutes) == 2 * 4 * (t - 1) and {c.elements for c in permutes} == {s // t}
    sp_bytes = sum(c.bytes_per_step for k in ("all-gather", "reduce-scatter") for c in tp_loop_ops(sp, cfg, k))
    assert sum(c.bytes_per_step for c in permutes) == pytest.approx(sp_bytes, rel=1e-6)


def census_by_axis(found) -> dict[str, float]:
    rows: dict[str, float] = {}
    for c in found:
        rows["+".join(c.axes)] = rows.get("+".join(c.axes), 0) + c.bytes_per_step
    return rows


CONTRACT_CASES = [("dp=8",), ("fsdp=8",), ("dp=2,tp=4",), ("dp=2,tp=4", "model.remat=full"),
                  ("dp=2,tp=4", "parallel.sequence_parallel=true"),
                  ("dp=2,tp=4", "parallel.sequence_parallel=true", "model.remat=full"),
                  ("dp=2,tp=4", "model.remat=dots"), ("dp=2,tp=4", "parallel.sequence_parallel=true", "model.remat=dots"),
                  ("dp=2,tp=4", "model.remat=attn"), ("dp=2,tp=4", "parallel.sequence_parallel=true", "model.remat=attn"),
                  # ZeRO-3 beside explicit TP: the head gathered once per microbatch, before its region
                  ("fsdp=4,tp=2",), ("fsdp=4,tp=2", "model.remat=full"),
                  # gradient accumulation, k = 4 (training/step.py's accumulation region)
                  ("dp=8", "train.micro_batch_size=1"),
                  ("fsdp=8", "train.micro_batch_size=1", "parallel.fsdp_gather_once=true"),
                  ("dp=2,tp=4", "train.micro_batch_size=4")]


@pytest.mark.parametrize("case", CONTRACT_CASES, ids=[" ".join(c) for c in CONTRACT_CASES])
def test_census_equals_the_contract_of_tools_traffic_on_every_axis(case):
    """Bytes per device per step on each axis, census = tools.traffic.communication, two-sided:
    2% on data (dp=8) and tensor, 5% on fsdp and on data beside tensor (README). Like with like:
    the CPU buffers of bf16 matmuls are f32 (module docstring), so the contract is evaluated at
    compute_dtype=float32; XLA CPU reduces fsdp gradients with all-reduce + slice, so those count
    at reduce-scatter volume (half, see test_fsdp_gathers_weights_twice_and_reduces_gradients;
    the accumulation region's own reduce-scatters count whole, its norms' all-reduces half);
    gradients of the weights replicated over tensor (norms) are reduced over data+tensor at
    once, counted with data."""
    from configs import apply_overrides
    from sharding.mesh import AXES
    from tools import traffic

    mesh, *sets = case
    found, _, cfg = compiled(mesh, *sets)
    contract = traffic.communication(apply_overrides(cfg, ["model.compute_dtype=float32"]),
                                      {a: getattr(cfg.parallel, a) for a in AXES})
    rows = census_by_axis(found)
    census = {"data": rows.get("data", 0) + rows.get("data+tensor", 0), "tensor": rows.get("tensor", 0),
              "fsdp": total(found, ("all-gather", "reduce-scatter"), ("fsdp",)) + total(found, ("all-reduce",), ("fsdp",)) / 2}
    assert set(rows) <= {"data", "fsdp", "tensor", "data+tensor", "fsdp+tensor"}
    assert rows.get("fsdp+tensor", 0) < 1e3  # the gradient norm's partial sums (a few scalars)
    assert set(contract) == {a for a in ("data", "fsdp", "tensor") if census[a]}
    tolerance = {"data": 0.02 if mesh == "dp=8" else 0.05, "fsdp": 0.05, "tensor": 0.02}
    off = {axis: census[axis] / contract[axis] for axis in contract
           if census[axis] != pytest.approx(contract[axis], rel=tolerance[axis])}
    assert not off, off


BY_HAND = [("fsdp=4,tp=2", "train.micro_batch_size=1", "parallel.fsdp_gather_once=true"),
           ("pp=2,fsdp=2,tp=2", "parallel.schedule=1f1b", "parallel.microbatches=4", "train.micro_batch_size=0",
            "train.global_batch_size=16")]


@pytest.mark.parametrize("case", BY_HAND, ids=[c[0] for c in BY_HAND])
def test_fsdp_gathered_by_hand_keeps_the_tensor_split(case):
    """The accumulation region (parallel.fsdp_gather_once) and the 1F1B engine gather and reduce
    FSDP's weights by hand, manual over fsdp with tensor automatic; they do it on each device's
    tensor shard (sharding/accumulation.py): nothing is all-gathered over tensor, and the fsdp
    bytes are the contract's (fp32, as the CPU program's; within 0.1%). Before, XLA gathered
    every weight and gradient over tensor first: 2.00x the contract over fsdp on both, beside
    2.05 MB (fsdp=4,tp=2) and 1.33 MB (pp=2,fsdp=2,tp=2) of all-gathers over tensor."""
    from configs import apply_overrides
    from sharding.mesh import AXES
    from tools import traffic

    found, _, cfg = compiled(*case)
    contract = traffic.communication(apply_overrides(cfg, ["model.compute_dtype=float32"]),
                                      {a: getattr(cfg.parallel, a) for a in AXES})
    assert total(found, ("all-gather",), ("tensor",)) == 0
    fsdp = total(found, ("all-gather", "reduce-scatter", "all-reduce"), ("fsdp",))
    assert fsdp == pytest.approx(contract["fsdp"], rel=0.001)


def test_pallas_core_moves_what_the_xla_core_moves_over_tensor():
    """The attention region runs unchecked around the Pallas kernel (sharding/tensor_parallel.py);
    its collectives over tensor are still exactly the typed regions': the same bytes as with the
    xla core (an unchecked psum alone would add one all-reduce per layer in the backward)."""
    xla, _, _ = compiled("dp=2,tp=4")
    pallas, _, _ = compiled("dp=2,tp=4", "model.attention=pallas")
    assert census_by_axis(pallas)["tensor"] == pytest.approx(census_by_axis(xla)["tensor"], rel=1e-6)
