"""Mixture of experts (model/moe.py) and expert parallelism (sharding/expert_parallel.py).

The router against a hand computation; the layer against a token-by-token loop; the capacity's
dropped fraction in a constructed case; the train step on expert meshes equal to one device; the
compiled step's all-to-alls against the contract and tools.traffic.expert; the presets' sizes;
and the load-balancing loss at work.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding

from configs import apply_overrides, get_preset
from configs.base import ModelConfig
from conftest import assert_same_run, run_module, run_steps, small_config
from model.moe import MoE, Routing
from model.transformer import Transformer, count_params
from sharding.expert_parallel import Experts
from sharding.mesh import AXES, build_mesh, parse_mesh
from sharding.rules import logical_to_spec, param_shardings
from sharding.tensor_parallel import TensorParallel
from tools.gpu_target import plugin_installed
from tools.hlo import step_census
from training.metrics import param_counts

MOE = ["model.n_experts=8", "model.experts_per_token=2", "model.expert_d_ff=64"]


def _softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def test_router_by_hand():
    """Top-2 of 4 experts for 3 tokens, the gates renormalised, and the Switch loss
    E·Σ f_e·P_e, the z-loss and the load computed with numpy from the same logits."""
    rng = np.random.default_rng(0)
    tokens, router = rng.normal(size=(3, 5)).astype(np.float32), rng.normal(size=(5, 4)).astype(np.float32)
    gates, experts, stats = Routing(4, 2, "dropless", 1.0, "ragged_dot").route(Experts(), jnp.asarray(tokens), jnp.asarray(router))
    logits = tokens @ router
    probs = _softmax(logits)
    top = np.argsort(-probs, axis=1)[:, :2]
    np.testing.assert_array_equal(experts, top)
    picked = np.take_along_axis(probs, top, 1)
    np.testing.assert_allclose(gates, picked / picked.sum(1, keepdims=True), rtol=1e-6)
    f = np.bincount(top.ravel(), minlength=4) / 6
    np.testing.assert_allclose(stats["aux"], 4 * np.sum(f * probs.mean(0)), rtol=1e-6)
    lse = np.log(np.exp(logits).sum(1))
    np.testing.assert_allclose(stats["z"], np.mean(lse**2), rtol=1e-5)
    np.testing.assert_allclose(stats["load"], f.max() / f.mean(), rtol=1e-6)


def _layer(dispatch: str, cf: float = 1.0, e: int = 4, k: int = 2, seed: int = 0):
    m = ModelConfig(d_model=16, n_experts=e, experts_per_token=k, expert_d_ff=24, moe_dispatch=dispatch,
                    capacity_factor=cf)
    return MoE(m, TensorParallel(), dispatch, rngs=nnx.Rngs(seed))


def _by_token(layer: MoE, x: np.ndarray) -> np.ndarray:
    """Σ_j gate_j · SwiGLU_{e_j}(x), token by token, in numpy."""
    flat = x.reshape(-1, x.shape[-1])
    probs = _softmax(flat @ np.asarray(layer.router[...]))
    out = np.zeros_like(flat)
    for t, p in enumerate(probs):
        top = np.argsort(-p)[: layer.routing.k]
        for e, g in zip(top, p[top] / p[top].sum()):
            gate, up = flat[t] @ np.asarray(layer.w_gate[e]), flat[t] @ np.asarray(layer.w_up[e])
            out[t] += g * ((gate / (1 + np.exp(-gate)) * up) @ np.asarray(layer.w_down[e]))
    return out.reshape(x.shape)


@pytest.mark.parametrize("dispatch, cf", [("dropless", 1.0), ("capacity", 2.0)])
def test_layer_equals_a_token_by_token_loop(dispatch, cf):
    """Dropless, and capacity with room for every assignment (cf = E/k: C = n), equal the loop."""
    layer = _layer(dispatch, cf)
    x = np.random.default_rng(1).normal(size=(2, 6, 16)).astype(np.float32)
    y, stats = layer(jnp.asarray(x))
    np.testing.assert_allclose(y, _by_token(layer, x), rtol=1e-5, atol=1e-6)
    assert float(stats["dropped"]) == 0.0


def test_rank_within_counts_the_earlier_members_of_each_group():
    """model.moe._rank_within (each assignment's slot in its expert's buffer) against a loop."""
    from model.moe import _rank_within

    group = np.random.default_rng(0).integers(0, 8, size=200)
    seen: Counter = Counter()
    want = []
    for g in group:
        want.append(seen[g])
        seen[g] += 1
    assert np.array_equal(np.asarray(_rank_within(jnp.asarray(group), 8)), want)


@pytest.mark.skipif(not plugin_installed(), reason="jax's CUDA plugin is not installed (pip install -e '.[gpu-compile]')")
def test_the_capacity_dispatch_compiles_for_an_h100_in_the_layer_scan():
    """moe-tiny (capacity dispatch, layers scanned, remat none) compiled by XLA GPU for eight
    H100s on dp=2,fsdp=2,ep=2 on this CPU machine. When `_rank_within` summed the running count
    masked by the one-hot, XLA GPU (jax 0.12.1) rewrote that sum into a gather its emitter
    cannot lower and aborted the process ("Non-simplified HLO Gather is not supported"; dropless
    and unrolled layers compiled). Its census is the contract's (tools/traffic.py) within 1% on
    every axis, fsdp within 0.5%: the scan keeps the MoE region's gathered experts and routers,
    once (tools.shape.expert_gathers; counted twice, 0.72x), the region reduce-scatters their
    gradients over fsdp before the sum over data (TensorParallel.gather_in_region; before, one
    all-reduce over data and fsdp of 3.5 MB, none of it reduce-scattered), and XLA reduces the
    other weights' gradients over data and expert together (counted apart, data read 1.09x and
    expert 0.94x)."""
    done = run_module("tools.plan", "--config", "moe-tiny", "--mesh", "dp=2,fsdp=2,ep=2", "--set",
                      "train.global_batch_size=8", "--set", "model.attention=pallas", "--compile-for-gpu", "--json")
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["xla"]["platform"] == "gpu"
    rows, by_axis = report["xla"]["census"], Counter()
    for r in rows:  # a collective over several axes under the first
        by_axis[r["axes"].split("+")[0]] += r["bytes_per_device"]
    assert dict(by_axis) == pytest.approx(report["communication"], rel=0.01)
    assert by_axis["fsdp"] == pytest.approx(report["communication"]["fsdp"], rel=0.005)
    assert not [r for r in rows if r["kind"] == "all-reduce" and r["axes"] == "data+fsdp"]


def test_capacity_drops_exactly_the_overflow():
    """Every token prefers expert 0 (its router column dominates): with k = 1, 8 tokens, 4
    experts and cf = 1, C = ceil(8/4) = 2, so the first 2 tokens are kept and 6 of 8 assignments
    dropped, reported as 0.75; a dropped token's output is 0 (it keeps its residual only)."""
    layer = _layer("capacity", 1.0, e=4, k=1)
    x = np.abs(np.random.default_rng(2).normal(size=(1, 8, 16))).astype(np.float32) + 0.5
    layer.router[...] = jnp.zeros((16, 4)).at[:, 0].set(1.0)
    y, stats = layer(jnp.asarray(x))
    assert float(stats["dropped"]) == pytest.approx(0.75)
    assert float(stats["load"]) == pytest.approx(4.0)  # all 8 on one expert of 4: max / mean
    np.testing.assert_allclose(y[0, :2], _by_token(layer, x)[0, :2], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(y[0, 2:], 0.0)


# --- the train step on expert meshes -------------------------------------------------------

@pytest.fixture(scope="module")
def moe_reference(corpus):
    """One device, two microbatches of 8 sequences: the router statistics are per microbatch,
    so every mesh below runs the same two (accumulation, or a pipeline's M = 2)."""
    return run_steps(small_config("", *MOE, "train.micro_batch_size=8"), corpus, devices=jax.devices()[:1])


def _devices(cfg) -> list:
    return jax.devices()[: math.prod(getattr(cfg.parallel, a) for a in AXES)]


LAYER_MESHES = ["ep=2", "ep=4", "ep=8", "dp=2,ep=4", "ep=2,tp=2", "ep=2,tp=2 sp", "fsdp=2,ep=2", "fsdp=2,ep=2,tp=2",
                 "dp=2,fsdp=2,ep=2 gathered", "fsdp=2,ep=2,tp=2 sp gathered", "ep=2,sp=2", "ep=4 capacity"]


@functools.cache
def _layer_grads(mesh_spec: str | None):
    """Value and gradients (weights and input) of Σ y·c + aux + z for one MoE layer (E 8, top 2,
    fp32) on a batch [8, 16, 32], on `mesh_spec` ('sp': sequence parallelism; 'capacity': cf
    E/k, so nothing is dropped; 'gathered': the region takes the weights' fsdp shards and
    gathers them itself, TensorParallel.gather_in_region; sp=2: the tokens' L split over
    sequence) or on one device."""
    spec, *flags = (mesh_spec or "").split(" ")
    tp = TensorParallel(sequence_parallel="sp" in flags, gather_in_region="gathered" in flags)
    m = ModelConfig(d_model=32, n_experts=8, experts_per_token=2, expert_d_ff=48, compute_dtype="float32",
                    moe_dispatch="capacity" if "capacity" in flags else "dropless", capacity_factor=4.0)
    graphdef, params = nnx.split(MoE(m, tp, m.moe_dispatch, rngs=nnx.Rngs(3)))
    rng = np.random.default_rng(4)
    x, c = (jnp.asarray(rng.normal(size=(8, 16, 32)), jnp.float32) for _ in range(2))

    def loss(params, x):
        y, stats = nnx.merge(graphdef, params)(x)
        return jnp.sum(y * c) + stats["aux"] + stats["z"]

    fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    if not mesh_spec:
        return jax.device_get(fn(params, x))
    parallel = parse_mesh(spec)
    mesh = build_mesh(parallel, _devices(dataclasses.replace(small_config(), parallel=parallel)))
    x_spec = logical_to_spec(tp.activation_names, x.shape, mesh)
    with jax.set_mesh(mesh):
        return jax.device_get(fn(jax.device_put(params, param_shardings(params, mesh)),
                                 jax.device_put(x, NamedSharding(mesh, x_spec))))


@pytest.mark.parametrize("mesh", LAYER_MESHES)
def test_layer_on_expert_meshes_equals_one_device(mesh):
    """The layer's value and every gradient (router, experts, input) on each mesh equal one
    device's, rtol 1e-5 (fp32; only reduction orders differ): experts over ep 2, 4, 8; beside
    data, tensor (the experts' F split; with sequence parallelism), fsdp (the weights gathered
    at the region's edge, or inside it from each device's shard), sequence; capacity
    dispatch."""
    (value, grads), (want, want_grads) = _layer_grads(mesh), _layer_grads(None)
    np.testing.assert_allclose(value, want, rtol=1e-5)
    for (path, expected), actual in zip(jax.tree_util.tree_leaves_with_path(want_grads), jax.tree.leaves(grads)):
        np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-6, err_msg=jax.tree_util.keystr(path))


STEP_CASES = [
    ("fsdp=2,ep=2,tp=2", "model.moe_dispatch=capacity", "model.capacity_factor=4", "train.micro_batch_size=2"),
    ("dp=2,ep=2,tp=2", "train.micro_batch_size=2"), ("fsdp=4,ep=2", "parallel.fsdp_gather_once=true", "train.micro_batch_size=1"),
    ("ep=2,tp=2", "parallel.sequence_parallel=true", "train.micro_batch_size=4"),
    ("pp=2,ep=2",), ("pp=2,dp=2,ep=2", "parallel.schedule=1f1b"), ("pp=2,ep=2", "parallel.schedule=zb-h1"),
    ("pp=2,fsdp=2,ep=2",), ("pp=2,dp=2,sp=2",),
]


@pytest.mark.parametrize("case", STEP_CASES, ids=" ".join)
def test_train_step_equals_single_device(case, moe_reference, corpus):
    """Loss, every gradient of step 0 and 5 steps' losses equal the single-device dropless run
    (conftest.assert_same_run: fp32, rtol 2e-5 on losses, atol 1e-6 + rtol 1e-4 on gradients),
    all with two microbatches of 8: experts beside fsdp and tensor with capacity dispatch that
    drops nothing (cf = E/k); in the step's accumulation region, manual over expert too (its
    MoE regions nested: directly, or unchecked over tensor, with sequence parallelism); and in
    pipelines: gpipe, where each stage sums its router
    statistics over its active ticks, 1f1b beside data, where each B cell's vjp carries its
    stage's router loss, and zb-h1, whose split B and W carry the experts' ragged matmuls. The layer alone is checked on more meshes above (data, sequence, tensor
    with SP, dropless), at a fraction of the compile time."""
    cfg = small_config(case[0], *MOE, *case[1:])
    assert_same_run(run_steps(cfg, corpus, _devices(cfg)), moe_reference)


FOUR_LAYERS = (*MOE, "model.n_layers=4")


@pytest.fixture(scope="module")
def four_layer_reference(corpus):
    """moe_reference with 4 layers: the V = 2 schedules need p·V = 4 of them."""
    return run_steps(small_config("", *FOUR_LAYERS, "train.micro_batch_size=8"), corpus, devices=jax.devices()[:1])


@pytest.mark.parametrize("schedule", ["interleaved", "zbv"])
def test_virtual_stage_schedules_equal_single_device(schedule, four_layer_reference, corpus):
    """The two schedules of V = 2 chunks a stage, which lay the experts (split over the engine's
    manual `expert`) out in chunks and back, zbv with its split backward: pp=2,ep=2, M = 2
    microbatches of 8, equal to one device as in test_train_step_equals_single_device."""
    cfg = small_config("pp=2,ep=2", *FOUR_LAYERS, f"parallel.schedule={schedule}", "parallel.virtual_stages=2")
    assert_same_run(run_steps(cfg, corpus, _devices(cfg)), four_layer_reference)


# --- the compiled step's collectives ---------------------------------------------------------

def _moe_census(mesh: str, *sets: str):
    cfg = apply_overrides(get_preset("moe-tiny"), ["model.compute_dtype=float32", "train.micro_batch_size=0", *sets])
    cfg = dataclasses.replace(cfg, parallel=parse_mesh(mesh, cfg.parallel))
    return cfg, step_census(cfg, build_mesh(cfg.parallel))


@pytest.mark.parametrize("dispatch, remat", [("dropless", "none"), ("capacity", "none"), ("dropless", "full")])
def test_census_holds_the_expert_contract(dispatch, remat):
    """moe-tiny's compiled step on dp=2,ep=4 (fp32): in each layer loop, on `expert` alone, 2
    all-to-alls of the dispatch buffer forward (dispatch, combine) and 2 backward, each of
    ep·S·D elements (dropless S = n·min(k, E/ep), capacity (E/ep)·C); dropless adds one int32
    all-to-all of the expert ids forward. Full remat repeats the forward's (in the backward).
    Their bytes equal tools.traffic.expert within 2%; the attention weights' gradients are
    reduced over data and expert together, as the contract counts them: the census on data
    (data+expert under data) and on expert equal tools.traffic's within 1% (counted apart, the
    expert axis's share of those gradients had been counted over expert alone)."""
    from tools import traffic
    from tools.hlo import per_device

    cfg, found = _moe_census("dp=2,ep=4", f"model.moe_dispatch={dispatch}", f"model.remat={remat}")
    again = remat == "full"
    m, ep = cfg.model, 4
    n = cfg.train.global_batch_size // 8 * cfg.train.seq_len
    rows = n * min(m.experts_per_token, m.n_experts // ep) if dispatch == "dropless" else (
        m.n_experts // ep * math.ceil(m.capacity_factor * n * m.experts_per_token / m.n_experts))
    a2a = [c for c in found if c.kind == "all-to-all"]
    assert all(c.axes == ("expert",) and c.trips == m.n_layers for c in a2a)
    acts = [c for c in a2a if c.dtype == "f32"]
    assert {c.elements for c in acts} == {ep * rows * m.d_model}
    forward = sum("transpose(" not in c.op_name for c in acts)
    assert (forward, len(acts) - forward) == (2, 2 + 2 * again)
    ids = [c for c in a2a if c.dtype != "f32"]
    assert [(c.dtype, c.elements) for c in ids] == [("s32", ep * rows)] * (1 + again) * (dispatch == "dropless")
    sizes = {"stage": 1, "data": 2, "fsdp": 1, "expert": ep, "sequence": 1, "tensor": 1}
    assert sum(c.bytes_per_step for c in a2a) == pytest.approx(traffic.expert(cfg, sizes), rel=0.02)
    grads = Counter(c.axes for c in found if c.kind == "all-reduce")
    assert grads[("data", "expert")] > 0
    contract = traffic.communication(cfg, sizes)
    by_axis = {axis: per_device([c for c in found if c.axes[0] == axis]) for axis in ("data", "expert")}
    assert by_axis == pytest.approx({axis: contract[axis] for axis in by_axis}, rel=0.01)


def test_the_expert_region_reduce_scatters_over_fsdp_before_data():
    """moe-tiny (fp32, scanned, remat none) on dp=2,fsdp=2,ep=2: the MoE region, manual over
    data, fsdp and expert, takes the experts' and the router's fsdp shards and gathers them
    itself (TensorParallel.gather_in_region, sharding/expert_parallel.py), so their gradients
    are reduce-scattered over fsdp (4·P·(f-1)/f, P the device's E/ep experts and the routers)
    and the experts' 1/f shard all-reduced over data (2·4·P_e/f·(n-1)/n; the routers' shard
    goes with the other weights, over data and expert). Given the weights whole over fsdp, the
    region's transpose all-reduced the experts' whole gradient over data and fsdp together
    (7.1 MB a device here; compiled for H100s, 3.5 MB on moe-tiny's bf16)."""
    cfg, found = _moe_census("dp=2,fsdp=2,ep=2")
    m, (n, f, ep) = cfg.model, (cfg.parallel.data, cfg.parallel.fsdp, cfg.parallel.expert)
    experts = m.n_layers * m.n_experts // ep * 3 * m.d_model * m.expert_d_ff
    routers = m.n_layers * m.d_model * m.n_experts
    bytes_of = lambda kind, axes: sum(c.bytes_per_step for c in found if c.kind == kind and c.axes == axes)  # noqa: E731
    assert bytes_of("reduce-scatter", ("fsdp",)) == pytest.approx(4 * (experts + routers) * (f - 1) / f, rel=1e-9)
    assert bytes_of("all-reduce", ("data",)) == pytest.approx(2 * 4 * experts / f * (n - 1) / n, rel=1e-9)
    assert bytes_of("all-reduce", ("data", "fsdp")) == 0


# --- presets and the load-balancing loss -------------------------------------------------------

@pytest.mark.parametrize("mesh, sets, kinds", [
    ("pp=2,dp=2,fsdp=2", ("parallel.microbatches=4",), {"all-gather", "reduce-scatter", "all-reduce"}),
    ("pp=2,dp=2,ep=2", ("parallel.microbatches=4", "parallel.schedule=1f1b"), {"all-reduce"}),
    ("dp=4,ep=2", ("train.micro_batch_size=1",), {"all-reduce"}),
    ("fsdp=4,ep=2", ("train.micro_batch_size=1", "parallel.fsdp_gather_once=true"),
     {"all-gather", "reduce-scatter", "all-reduce"}),
], ids=["gpipe", "1f1b-experts", "accumulation", "accumulation-fsdp"])
def test_experts_reduce_once_per_step(mesh, sets, kinds):
    """moe-tiny (fp32) in a pipeline (gpipe on pp=2,dp=2,fsdp=2 and 1f1b on pp=2,dp=2,ep=2, M =
    4; the engine is every schedule's) and in the step's accumulation region (dp=4,ep=2 and
    fsdp=4,ep=2 with the weights gathered once, 4 microbatches of one sequence per device):
    both regions are manual over data (and fsdp) and expert for MoE models (the expert regions nest
    in them and sum the router statistics over their axes: sharding/expert_parallel.py), so
    beside the statistics' psums (at most 2E + 2 numbers each, forward and backward in each MoE
    layer's run) and the all-to-alls every collective on data, fsdp and expert runs once per
    step (the weights gathered, the fp32 gradient sum reduce-scattered and all-reduced: the
    routed experts' over data, the other weights' over data and expert in one group), and their
    bytes equal tools.traffic's within 1%. Left to XLA (at f2ddadc) the gradients were reduced
    per tick (gpipe), per backward cell (1f1b: 4.7x these bytes, measured alike) or per
    microbatch (the accumulation): 5.3x these bytes under gpipe, 4.1x in the accumulation; with
    `expert` automatic in both regions (at bb00f64) XLA reduced the other weights' gradients
    over expert per microbatch or backward cell, in fp32 on XLA CPU: 1.37x these bytes on
    dp=4,ep=2 and fsdp=4,ep=2."""
    from tools import traffic
    from tools.hlo import per_device

    cfg, found = _moe_census(mesh, *sets)
    batch = [c for c in found if {"data", "fsdp", "expert"} & set(c.axes) and c.kind != "all-to-all"]
    stats = [c for c in batch if "moe/" in c.op_name and c.elements <= 2 * cfg.model.n_experts + 2]
    assert stats
    once = [c for c in batch if c not in stats]
    assert {c.trips for c in once} == {1}
    assert {c.kind for c in once} == kinds
    sizes = {a: getattr(cfg.parallel, a) for a in AXES}
    contract = traffic.communication(cfg, sizes)
    gradients = contract.get("data", 0) + contract.get("fsdp", 0) + contract.get("expert", 0) - traffic.expert(cfg, sizes)
    assert per_device(once) == pytest.approx(gradients, rel=0.01)


@pytest.mark.parametrize("name", ["moe-tiny", "mixtral-8x7b"])
def test_preset_parameter_counts(name):
    """The built model's parameters (abstract: nothing allocated) equal training.metrics.param_counts,
    whose figures for Mixtral 8x7B are the published 46.7B total and 12.9B active."""
    m = get_preset(name).model
    model = nnx.eval_shape(lambda: Transformer(m, rngs=nnx.Rngs(0)))
    total, active = param_counts(m)
    assert count_params(nnx.state(model, nnx.Param)) == total
    if name == "mixtral-8x7b":
        assert (round(total / 1e9, 1), round(active / 1e9, 1)) == (46.7, 12.9)


def test_load_balancing_loss_evens_the_load(corpus):
    """25 steps of a small MoE on one device: with the Switch loss at weight 0.1 the busiest
    expert's share of the assignments (over the mean) ends lower than without it (about 2.1
    against 3.9 of a possible 4 when this was written)."""
    def final_load(weight: float) -> float:
        cfg = small_config("", *MOE, f"model.router_aux_loss={weight}", "train.steps=25", "train.lr=1e-2")
        mesh = build_mesh(cfg.parallel, jax.devices()[:1])
        from training.build import build

        job = build(cfg, mesh, corpus=corpus)
        state, loads = job.state, []
        with jax.set_mesh(mesh):
            for step in range(cfg.train.steps):
                state, metrics = job.step_fn(state, job.batches(step))
                loads.append(float(metrics["moe_load"]))
        return float(np.mean(loads[-5:]))

    balanced, free = final_load(0.1), final_load(0.0)
    assert balanced < free
