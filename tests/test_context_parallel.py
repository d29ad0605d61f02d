"""Context parallelism (sharding/context_parallel.py): equal to one device, and the collectives
its docstring states (its layout and block schedule: tests/test_context_layout.py and
test_context_schedule.py).

- numbers: sp = 2, 4, 8 x ring/allgather x zigzag/contiguous, causal; full attention; the
  Pallas kernels as core (sp = 2, zigzag ring); the ring inside one region manual over
  sequence and tensor (the tensor-parallel region's way in);
- collectives of the compiled forward and backward (sp = 4), and clear errors;
- the train step (sharding/strategies.py wires it in): equal to one device on sp = 8, beside
  dp, fsdp, tp and pp, under full remat and accumulation, both impls and the Pallas core;
  the compiled step's K/V collectives = tools.traffic.context; memory flat in sp at fixed L/sp.

Numbers: fp32, B = 2, L = 32, N = 4 query heads over K = 2 kv heads (GQA), H = 8. The sharded
out, dq, dk, dv, put back in natural order, equal `model.attention.xla_attention` on the whole
sequence within rtol = atol = 1e-5 (observed about 1e-6: only the order of fp32 sums differs).
Each mesh has sequence = sp and every other axis 1, on sp of the 8 fake devices; the variants of
one sp run in one jitted program (one compile).

Collectives: the forward and the backward are compiled as separate programs (the backward from
the vjp's residuals). Compiled as one, XLA merges the backward's K/V sends with the forward's
identical ones, so the count of one program would not show the backward's own ring.
"""

import dataclasses
import functools
from collections import Counter

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from model.attention import xla_attention
from model.kernels.flash_attention import flash_block_backward, flash_block_forward
from sharding.context_layout import zigzag_permutation
from sharding.context_parallel import IMPLS, BlockCore, context_parallel_attention, ring_attention
from configs import apply_overrides, get_preset
from conftest import assert_same_run, run_steps, small_config
from sharding.mesh import build_mesh, parse_mesh
from tools.hlo import census, step_census
from training.build import make_program, compile_step

B, L, N, K, H = 2, 32, 4, 2, 8
TOL = 1e-5
SPS = (2, 4, 8)
PALLAS = BlockCore(flash_block_forward, flash_block_backward)


@pytest.fixture(scope="module")
def meshes() -> dict[int, jax.sharding.Mesh]:
    return {sp: build_mesh(parse_mesh(f"sp={sp}"), jax.devices()[:sp]) for sp in SPS}


@pytest.fixture(scope="module")
def data() -> list[jax.Array]:
    """q, k, v and a cotangent dO, normal(0, 1), in natural order."""
    keys = jax.random.split(jax.random.key(0), 4)
    shapes = [(B, L, N, H), (B, L, K, H), (B, L, K, H), (B, L, N, H)]
    return [jax.random.normal(key, shape) for key, shape in zip(keys, shapes)]


def out_and_grads(attend, q, k, v, d_out) -> tuple:
    out, vjp = jax.vjp(attend, q, k, v)
    return (out, *vjp(d_out))


def in_natural_order(attend, sp: int, zigzag: bool):
    """attend (on the layout's order) as a function of q, k, v in natural order."""
    perm, inverse = zigzag_permutation(L, sp) if zigzag else (np.arange(L), np.arange(L))
    return lambda q, k, v: attend(q[:, perm], k[:, perm], v[:, perm])[:, inverse]


def sharded(mesh, impl: str, zigzag: bool, causal: bool = True, core="xla"):
    attend = functools.partial(context_parallel_attention, mesh=mesh, impl=impl, causal=causal, zigzag=zigzag,
                               core=core)
    return in_natural_order(attend, mesh.shape["sequence"], zigzag)


def run_all(fns, data) -> list[tuple]:
    """(out, dq, dk, dv) of each function, in one jitted program."""
    return jax.jit(lambda q, k, v, d_out: [out_and_grads(f, q, k, v, d_out) for f in fns])(*data)


def assert_same(got, want, label: str) -> None:
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        np.testing.assert_allclose(a, b, rtol=TOL, atol=TOL, err_msg=f"{label}: {name}")


@pytest.fixture(scope="module")
def attention_reference(data):
    """xla_attention's out and grads on one device, causal and full."""
    return dict(zip((True, False), run_all([xla_attention, lambda q, k, v: xla_attention(q, k, v, False)], data)))


# --- equal to one device -------------------------------------------------------------------------

@pytest.mark.parametrize("sp", SPS)
def test_causal_equals_one_device(sp, meshes, data, attention_reference):
    """Both impls, zigzag and contiguous, GQA: out, dq, dk, dv."""
    variants = [(impl, zigzag) for impl in IMPLS for zigzag in (True, False)]
    results = run_all([sharded(meshes[sp], impl, zigzag) for impl, zigzag in variants], data)
    for (impl, zigzag), got in zip(variants, results):
        assert_same(got, attention_reference[True], f"sp={sp} {impl} zigzag={zigzag}")


def test_full_attention_equals_one_device(meshes, data, attention_reference):
    variants = [("ring", True), ("allgather", False)]
    results = run_all([sharded(meshes[4], impl, zigzag, causal=False) for impl, zigzag in variants], data)
    for (impl, zigzag), got in zip(variants, results):
        assert_same(got, attention_reference[False], f"full {impl} zigzag={zigzag}")


def test_pallas_core_equals_one_device(meshes, data, attention_reference):
    """The flash kernels per piece (interpreted on CPU), lse merged across the ring."""
    got, = run_all([sharded(meshes[2], "ring", True, core=PALLAS)], data)
    assert_same(got, attention_reference[True], "pallas ring")


def test_ring_inside_one_region_manual_over_sequence_and_tensor(data, attention_reference):
    """How the tensor-parallel region can call it: one shard_map manual over sequence and tensor
    (not one nested in the other), q heads split over tensor with their kv head."""
    mesh = build_mesh(parse_mesh("sp=2,tp=2"), jax.devices()[:4])
    spec = P(None, "sequence", "tensor")
    region = jax.shard_map(ring_attention, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec,
                           axis_names={"sequence", "tensor"})
    got, = run_all([in_natural_order(region, 2, zigzag=True)], data)
    assert_same(got, attention_reference[True], "region over sequence and tensor")


# --- collectives ---------------------------------------------------------------------------------

def collectives(text: str, mesh) -> Counter:
    return Counter((c.kind, c.axes, c.elements) for c in census(text, dict(mesh.shape)))


def test_compiled_collectives(meshes, data):
    """sp = 4, E = b·l·K·H elements; both impls in one forward and one backward program (their
    collectives differ in kind). Ring: forward 2(sp-1) collective-permutes of E on `sequence`
    (K and V, separate ops), backward 2(sp-1) again + 2·sp (dK, dV). All-gather: forward 2
    all-gathers of sp·E, backward those again and 2 reduce-scatters. Nothing else. The
    residuals: none larger than q."""
    sp, mesh = 4, meshes[4]
    q, k, v, d_out = data
    e, seq = B * (L // sp) * K * H, ("sequence",)

    def both(q, k, v):
        return [context_parallel_attention(q, k, v, mesh, impl=impl) for impl in IMPLS]

    forward = jax.jit(both).lower(q, k, v).compile().as_text()
    vjp = jax.eval_shape(lambda q, k, v: jax.vjp(both, q, k, v)[1], q, k, v)  # residual shapes only
    assert max(x.size for x in jax.tree.leaves(vjp)) == q.size  # saved: q, k, v, out, lse; no [L, L]
    backward = jax.jit(lambda vjp, d_out: vjp(d_out)).lower(vjp, [d_out, d_out]).compile().as_text()
    assert collectives(forward, mesh) == {("collective-permute", seq, e): 2 * (sp - 1),
                                          ("all-gather", seq, sp * e): 2}
    assert collectives(backward, mesh) == {("collective-permute", seq, e): 2 * (sp - 1) + 2 * sp,
                                           ("all-gather", seq, sp * e): 2, ("reduce-scatter", seq, sp * e): 2}


def test_bad_inputs_are_clear_errors():
    q, k = np.zeros((B, 8, N, H), np.float32), np.zeros((B, 8, 3, H), np.float32)
    with pytest.raises(ValueError, match="not a multiple of 3 kv heads"):
        ring_attention(q, k, k)
    with pytest.raises(ValueError, match="neither 'xla' nor a BlockCore"):
        ring_attention(q, q, q, core="cudnn")


# --- the train step under context parallelism (sharding/strategies.py wires it in) -----------

STEP_CASES = [
    ("sp=8",), ("dp=2,sp=4", "parallel.context_impl=allgather"), ("sp=2,tp=4",),
    ("sp=2,tp=4", "parallel.sequence_parallel=true"),
    ("fsdp=2,sp=4", "model.remat=full", "train.micro_batch_size=4"),
    ("dp=2,sp=4", "model.attention=pallas"),
    ("pp=2,dp=2,sp=2",), ("pp=2,dp=2,sp=2", "parallel.schedule=1f1b", "parallel.context_impl=allgather"),
    ("pp=2,fsdp=2,sp=2",), ("pp=2,dp=2,sp=2", "parallel.context_impl=gspmd"),
    # the accumulation region manual over sequence too (training/step.py): gradients summed per device
    ("dp=2,sp=4", "train.micro_batch_size=1"), ("sp=8", "model.remat=full", "train.micro_batch_size=2"),
    ("sp=2,tp=4", "train.micro_batch_size=2"), ("sp=2,tp=4", "parallel.sequence_parallel=true", "train.micro_batch_size=2"),
    ("dp=2,sp=2,tp=2", "model.attention=pallas", "model.remat=full", "train.micro_batch_size=2"),
    ("fsdp=2,sp=2,tp=2", "parallel.fsdp_gather_once=true", "parallel.sequence_parallel=true", "train.micro_batch_size=2"),
    ("fsdp=2,sp=4", "parallel.fsdp_gather_once=true", "parallel.context_impl=allgather", "train.micro_batch_size=2"),
]


@pytest.mark.parametrize("case", STEP_CASES, ids=" ".join)
def test_train_step_equals_single_device(case, reference, corpus):
    """Loss and every gradient of step 0 and the losses of 5 steps equal the single-device run
    (conftest.assert_same_run: fp32, rtol 2e-5 on losses, atol 1e-6 + rtol 1e-4 on gradients):
    the ring and the all-gather, beside data, fsdp, tensor (with sequence parallelism: L split
    over sequence and tensor between blocks) and stage axes, under full remat and gradient
    accumulation, with the Pallas kernel as the block core."""
    assert_same_run(run_steps(small_config(*case), corpus), reference)


def _step_census(mesh: str, *sets: str):
    cfg = apply_overrides(get_preset("tiny"), ["model.compute_dtype=float32", *sets])
    cfg = dataclasses.replace(cfg, parallel=parse_mesh(mesh, cfg.parallel))
    return cfg, step_census(cfg, build_mesh(cfg.parallel))


@pytest.mark.parametrize("impl", IMPLS)
def test_step_census_holds_the_context_contract(impl):
    """tiny's compiled step on dp=2,sp=4 (fp32, as CPU buffers are; see tests/test_hlo.py): in
    each layer loop exactly the K/V collectives of sharding/context_parallel.py's table on
    `sequence`, every one of one local block E = b·(L/sp)·K·H (all-gathers: sp·E), and their
    bytes equal `tools.traffic.context` within 2%; everything else on `sequence` is the
    gradients' all-reduce."""
    from tools import traffic

    cfg, found = _step_census("dp=2,sp=4", f"parallel.context_impl={impl}")
    m, sp = cfg.model, 4
    e = cfg.train.global_batch_size // 2 * cfg.train.seq_len // sp * m.n_kv_heads * m.head_dim
    on_axis = [c for c in found if "sequence" in c.axes]
    assert {c.kind for c in on_axis if c.kind != "all-reduce"} == (
        {"collective-permute"} if impl == "ring" else {"all-gather", "reduce-scatter"})
    kv = [c for c in on_axis if c.kind != "all-reduce"]
    assert all(c.trips == m.n_layers and c.axes == ("sequence",) for c in kv)
    forward = Counter(c.kind for c in kv if "transpose(" not in c.op_name)
    backward = Counter(c.kind for c in kv if "transpose(" in c.op_name)
    if impl == "ring":
        assert forward == {"collective-permute": 2 * (sp - 1)}
        assert backward == {"collective-permute": 2 * (sp - 1) + 2 * sp}
        assert {c.elements for c in kv} == {e}
    else:
        assert forward == {"all-gather": 2} and backward == {"all-gather": 2, "reduce-scatter": 2}
        assert {c.elements for c in kv} == {sp * e}
    sizes = {"stage": 1, "data": 2, "fsdp": 1, "expert": 1, "sequence": sp, "tensor": 1}
    assert sum(c.bytes_per_step for c in kv) == pytest.approx(traffic.context(cfg, sizes), rel=0.02)


@pytest.mark.parametrize("impl", IMPLS)
def test_unrolled_layers_send_k_and_v_once(impl):
    """Unrolled under remat none the forward and the backward are one program with nothing
    between them, and XLA merges the backward's K/V sends (the ring's permutes, or the second
    all-gather) with the forward's: tiny on dp=2,sp=4 (fp32) moves tools.traffic.context's
    bytes on `sequence` exactly, which counts K and V once there (compiled for H100s too:
    bench/results/joint-reduction-h100-compiled.json; counted twice, the ring read 0.60x and
    the all-gathers 0.75x)."""
    from tools import traffic

    cfg, found = _step_census("dp=2,sp=4", f"parallel.context_impl={impl}", "model.scan_layers=false")
    kv = [c for c in found if "sequence" in c.axes and c.kind != "all-reduce"]
    sizes = {"stage": 1, "data": 2, "fsdp": 1, "expert": 1, "sequence": 4, "tensor": 1}
    assert sum(c.bytes_per_step for c in kv) == pytest.approx(traffic.context(cfg, sizes), rel=1e-9)


GRADIENT_CASES = [("dp=2,sp=4", ("data", "sequence")), ("sp=8", ("sequence",))]


@pytest.mark.parametrize("mesh, group", GRADIENT_CASES, ids=[m for m, _ in GRADIENT_CASES])
def test_accumulated_gradients_are_reduced_once_per_step_over_data_and_sequence(mesh, group):
    """4 microbatches per device under context parallelism: the step's accumulation region is
    manual over sequence too (sharding.checks.accumulation_axes), so the fp32 gradient sum is
    all-reduced once per step, over data and sequence in one group, not per microbatch (before:
    4 all-reduces of every gradient). The bytes are tools.traffic's, counted under the group's
    first axis, within 2% (fp32, as XLA CPU's buffers are); on `sequence` alone the K/V ring."""
    from sharding.checks import accumulation_axes
    from sharding.mesh import AXES
    from tools import traffic

    cfg, found = _step_census(mesh, "train.micro_batch_size=1", "train.global_batch_size=8")
    sizes = {a: getattr(cfg.parallel, a) for a in AXES}
    assert accumulation_axes(cfg, sizes) == group
    reductions = [c for c in found if c.kind == "all-reduce" and c.axes == group]
    assert {c.trips for c in reductions} == {1}
    assert not [c for c in found if c.kind in ("all-reduce", "reduce-scatter") and c.axes != group]
    contract, ring = traffic.communication(cfg, sizes), traffic.context(cfg, sizes)
    gradients = contract[group[0]] - (ring if group[0] == "sequence" else 0)  # sequence: the ring's K/V too
    assert sum(c.bytes_per_step for c in reductions) == pytest.approx(gradients, rel=0.02)
    assert sum(c.bytes_per_step for c in found if c.kind == "collective-permute") == pytest.approx(ring, rel=0.02)


@pytest.mark.parametrize("sets", [("parallel.context_impl=ring",),
                                  ("parallel.schedule=1f1b", "parallel.context_impl=allgather")], ids=" ".join)
def test_pipelines_reduce_once_per_step_over_data_and_sequence(sets):
    """pp=2,dp=2,sp=2, M = 4 (gpipe with the ring, 1f1b with the all-gather): the schedules'
    engine (pipeline/engine.py) is manual over sequence too, so each device sums its fp32
    gradients over the schedule and they are all-reduced once per step over data and sequence
    in one group, `tools.traffic`'s bytes; everything else on those axes is the K/V traffic of
    `tools.traffic.context`, each within 1% (fp32, CPU; the busiest device's bytes, the 1F1B
    family's cell collectives counted per cell run). Left to XLA (data and sequence automatic,
    as at f2ddadc), gpipe all-reduced the layers' gradients over data, sequence or both in
    every tick, bubble ticks included: 4.4x these all-reduce bytes, and 1.6x the other bytes on
    the two axes; 1f1b in every backward cell: 3.8x and 3.5x."""
    from sharding.mesh import AXES
    from tools import traffic
    from tools.hlo import per_device

    cfg, found = _step_census("pp=2,dp=2,sp=2", "parallel.microbatches=4", *sets)
    sizes = {a: getattr(cfg.parallel, a) for a in AXES}
    batch = [c for c in found if {"data", "sequence"} & set(c.axes)]
    reductions = [c for c in batch if c.kind == "all-reduce"]
    assert {(c.axes, c.trips) for c in reductions} == {(("data", "sequence"), 1)}
    assert per_device(reductions) == pytest.approx(traffic.communication(cfg, sizes)["data"], rel=0.01)
    kv = [c for c in batch if c.kind != "all-reduce"]
    assert {c.axes for c in kv} == {("sequence",)}
    assert per_device(kv) == pytest.approx(traffic.context(cfg, sizes), rel=0.01)  # the busiest device's


def test_ring_memory_stays_flat_as_sp_and_length_grow_together():
    """XLA's temp memory of tiny's compiled step per device at a fixed L/sp = 256 tokens (b = 1,
    fp32) from sp = 2 (L = 512) to sp = 8 (L = 2048): the ring's stays within 15%; the
    all-gather's grows by what it gathers, the full-length K and V of a layer (2·ΔL·K·H fp32,
    within 25%); GSPMD's (context_impl=gspmd) more than doubles: its scores span all of L.
    Measured on jax 0.10.2: 1.013x, +393712 bytes for 393216 gathered, 3.1x."""
    from training.build import xla_memory

    def temp(impl: str, sp: int) -> int:
        sets = (f"parallel.context_impl={impl}", f"train.seq_len={256 * sp}", "train.global_batch_size=1")
        base = apply_overrides(get_preset("tiny"), ["model.compute_dtype=float32", *sets])
        cfg = dataclasses.replace(base, parallel=parse_mesh(f"sp={sp}", base.parallel))
        mesh = build_mesh(cfg.parallel, jax.devices()[:sp])
        program = make_program(cfg, mesh)
        compiled, _, _ = compile_step(program.step_fn, mesh, program.state, program.abstract_batch())
        return xla_memory(compiled)["temp"]

    grown = {impl: (temp(impl, 2), temp(impl, 8)) for impl in ("ring", "allgather", "gspmd")}
    m = get_preset("tiny").model
    assert grown["ring"][1] / grown["ring"][0] == pytest.approx(1.0, abs=0.15), grown
    gathered = 2 * (2048 - 512) * m.n_kv_heads * m.head_dim * 4
    extra = (grown["allgather"][1] - grown["allgather"][0]) - (grown["ring"][1] - grown["ring"][0])
    assert extra == pytest.approx(gathered, rel=0.25), grown
    assert grown["gspmd"][1] / grown["gspmd"][0] > 2, grown
