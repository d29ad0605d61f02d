"""The planner on Mixture-of-Experts configs: parameter counts, the expert axis's terms in
tools/estimate and tools/traffic, the search over ep, the plan's all-to-all line. Pure arithmetic, nothing compiled."""

import dataclasses
import json
import math

import pytest

from configs import apply_overrides, get_preset
from conftest import run_module
from sharding.mesh import AXES
from tools import estimate, links, roofline, traffic
from tools.activations import dense_expert_copies
from tools.bandwidth import load
from tools.plan_report import format_plan, plan
from tools.search import meshes, search
from tools.shape import dispatch_rows, local_params
from training.metrics import flops_per_token, matmul_params, param_counts

ONE = dict.fromkeys(AXES, 1)


def test_mixtral_parameter_counts_are_the_published_ones():
    total, active = param_counts(get_preset("mixtral-8x7b").model)
    assert round(total / 1e9, 1) == 46.7 and round(active / 1e9, 1) == 12.9


def test_dense_presets_count_every_parameter_as_active():
    for name, billions in (("llama3-8b", 8.03), ("llama3-70b", 70.6)):
        m = get_preset(name).model
        total, active = param_counts(m)
        assert total == active and total / 1e9 == pytest.approx(billions, abs=0.05)
        assert total == local_params(get_preset(name), ONE)


def test_moe_tiny_counts_by_hand():
    m = get_preset("moe-tiny").model
    d, v, fe = 128, 256, 192
    attention = d * 8 * 16 * 2 + 2 * d * 2 * 16
    rest = 4 * (attention + 2 * d + d * 8) + 2 * v * d + d  # router [D, E] in every layer
    assert param_counts(m) == (rest + 4 * 8 * 3 * d * fe, rest + 4 * 2 * 3 * d * fe)
    # active matmuls: all but the embedding table and the norms; FLOPs from them
    assert matmul_params(m) == param_counts(m)[1] - v * d - (2 * 4 + 1) * d
    assert flops_per_token(m, 128) == 6 * matmul_params(m) + 3 * 4 * 4 * 128 * 8 * 16 / 2


def test_moe_every_and_shared_experts():
    """moe_every=2: layers 2 and 4 of 4 are MoE, 1 and 3 dense; a shared expert is a dense SwiGLU of
    n_shared·F_e that every token uses."""
    base = get_preset("moe-tiny").model
    m = dataclasses.replace(base, moe_every=2, n_shared_experts=1)
    d, fe = 128, 192
    total, active = param_counts(m)
    dense_total, _ = param_counts(dataclasses.replace(base, n_experts=0))
    moe_ffn = d * 8 + 3 * d * fe  # router + shared
    assert total == dense_total + 2 * (moe_ffn + 8 * 3 * d * fe - 3 * d * 384)
    assert active == dense_total + 2 * (moe_ffn + 2 * 3 * d * fe - 3 * d * 384)
    assert local_params(dataclasses.replace(get_preset("moe-tiny"), model=m), ONE) == total


def moe_tiny(*overrides):
    """moe-tiny with the model defaults' dispatch (dropless; cf 1.25 when capacity is asked for)."""
    return apply_overrides(get_preset("moe-tiny"), ["train.global_batch_size=32", "train.micro_batch_size=2",
                                                     "model.moe_dispatch=dropless", "model.capacity_factor=1.25",
                                                     *overrides])


@pytest.mark.parametrize("dispatch", ["dropless", "capacity"])
def test_expert_all_to_all_bytes_by_hand(dispatch):
    """moe-tiny on dp=2,ep=4 (8 devices): 32 sequences over dp·ep = 8 ranks, 4 each, 2 per
    microbatch: k = 2 microbatches of n = 2·128 tokens. Per MoE layer (all 4) and microbatch,
    4 all-to-alls of [ep, S, D] bf16, (ep-1)/ep of each leaving the device; dropless adds the
    int32 ids [ep, S] once."""
    cfg = moe_tiny(f"model.moe_dispatch={dispatch}")
    sizes = ONE | {"data": 2, "expert": 4}
    n, ep, k, layers, d, c = 256, 4, 2, 4, 128, 2
    if dispatch == "dropless":
        s = n * min(2, 8 // ep)  # 512
        per_layer = 4 * (ep - 1) / ep * ep * s * d * c + (ep - 1) / ep * ep * s * 4
    else:
        s = 8 // ep * math.ceil(1.25 * n * 2 / 8)  # 2 experts x 80 rows
        per_layer = 4 * (ep - 1) / ep * ep * s * d * c
    assert dispatch_rows(cfg, sizes) == s
    assert traffic.expert(cfg, sizes) == pytest.approx(k * layers * per_layer)
    # the step's accumulation region is manual over data and expert: once per step, the k
    # microbatches' fp32 sums of the device's own experts (E/ep of them) all-reduced over data,
    # of every other weight over data and expert together (N = 8), counted under data; so the
    # expert axis moves the all-to-alls alone
    non_expert = param_counts(cfg.model)[0] - layers * 8 * 3 * d * 192
    experts = layers * 8 // ep * 3 * d * 192
    comm = traffic.communication(cfg, sizes)
    assert comm["expert"] == pytest.approx(traffic.expert(cfg, sizes))
    assert comm["data"] == pytest.approx(2 * 4 * experts / 2 + 2 * 4 * non_expert * 7 / 8)
    assert local_params(cfg, sizes) == pytest.approx(non_expert + experts)
    # at k = 1 XLA places the reductions as the backward leaves them (bf16 but for the fp32
    # head, norms and routers): every weight but the routed experts' over data and expert
    # together (N = 8, counted under data: compiled for H100s, tests/test_moe.py), the experts
    # over data alone; the expert axis again moves the all-to-alls alone
    one = moe_tiny(f"model.moe_dispatch={dispatch}", "train.micro_batch_size=0")
    fp32 = 256 * d + (2 * layers + 1) * d + layers * d * 8
    grads = c * (non_expert - fp32) + 4 * fp32
    comm = traffic.communication(one, sizes)
    assert comm["expert"] == pytest.approx(traffic.expert(one, sizes))
    assert comm["data"] == pytest.approx(2 * c * experts / 2 + 2 * grads * 7 / 8)


def test_no_expert_axis_no_all_to_all():
    cfg = moe_tiny()
    assert traffic.expert(cfg, ONE | {"data": 8}) == 0
    assert "expert" not in traffic.communication(cfg, ONE | {"data": 8})
    dense = get_preset("tiny")
    assert traffic.expert(dense, ONE | {"data": 8}) == 0 and roofline.flops(dense, ONE)["padding_per_device"] == 0


def test_remat_full_repeats_the_forward_all_to_alls():
    sizes = ONE | {"data": 2, "expert": 4}
    none, full = (traffic.expert(moe_tiny(f"model.remat={r}"), sizes) for r in ("none", "full"))
    s, d = 512, 128
    assert full - none == pytest.approx(2 * 4 * 3 * (2 * s * d * 2 + s * 4))  # k·X·(ep-1)·(2 acts + ids)


def test_expert_padding_is_hardware_flops_only():
    """Rows the experts compute beyond the n·k = 512 routed ones per MoE layer (n = 256 tokens a
    microbatch, 2 microbatches, 4 MoE layers, remat none: forward, dx and dw passes of
    2·3·D·F FLOPs a row). Capacity (cf 1.25) computes every slot, E·C = 8·ceil(1.25·256·2/8) =
    640 rows, at any ep. Dropless under ragged_dot (XLA's dense lowering) every received row
    through each local expert: E·n·min(k, E/ep) = 4096 rows at ep 1 and 4. Dropless under
    mosaic the ep·S received rows in the forward and dx, the routed ones in dw: none at ep = 1,
    2048 - 512 at ep = 4. The model FLOPs do not change with the mesh or the implementation."""
    dropless, capacity = moe_tiny(), moe_tiny("model.moe_dispatch=capacity")
    mosaic = moe_tiny("model.expert_matmul=mosaic")
    row = 2 * 3 * 128 * 192
    for sizes, mosaic_rows in ((ONE | {"data": 8}, 0), (ONE | {"data": 2, "expert": 4}, 2048 - 512)):
        got = {name: roofline.flops(cfg, sizes) for name, cfg in
               (("dropless", dropless), ("capacity", capacity), ("mosaic", mosaic))}
        assert got["capacity"]["padding_per_device"] == pytest.approx(2 * 4 * 3 * row * (640 - 512))
        assert got["dropless"]["padding_per_device"] == pytest.approx(2 * 4 * 3 * row * (4096 - 512))
        assert got["mosaic"]["padding_per_device"] == pytest.approx(2 * 4 * 2 * row * mosaic_rows)
        for g in got.values():
            assert g["model_per_device"] == got["dropless"]["model_per_device"]
            assert g["hardware_per_device"] == pytest.approx(g["model_per_device"] + g["padding_per_device"])
    full = moe_tiny("model.remat=full")  # the recompute is a fourth pass
    assert roofline.flops(full, ONE | {"data": 8})["padding_per_device"] == pytest.approx(2 * 4 * 4 * row * (4096 - 512))


def test_dense_ragged_dot_copies_are_working_memory():
    """Dropless under ragged_dot holds XLA's zero-padded copies in the MoE layer's working set:
    on dp=2,ep=4 the E/ep = 2 local experts over R = ep·n·min(k, E/ep) = 2048 received rows, a
    [2, R, D] and a [2, R, F] pair twice, bf16: 2·2048·2·(128 + 192)·2 bytes. Mosaic and
    capacity hold none."""
    sizes = ONE | {"data": 2, "expert": 4}
    working = {name: estimate.memory(moe_tiny(*sets), sizes)["working"] for name, sets in
               (("ragged_dot", ()), ("mosaic", ("model.expert_matmul=mosaic",)))}
    assert working["ragged_dot"] - working["mosaic"] == 2 * 2048 * 2 * (128 + 192) * 2
    assert dense_expert_copies(moe_tiny("model.moe_dispatch=capacity"), sizes) == 0


def test_expert_weights_split_over_ep_in_memory():
    cfg = get_preset("mixtral-8x7b")
    sizes = ONE | {"fsdp": 8}
    p1, p8 = (estimate.memory(cfg, sizes | {"expert": ep})["params"] for ep in (1, 8))
    experts = 32 * 8 * 3 * 4096 * 14336 / 8 * 4  # fp32 bytes of the routed experts over fsdp=8
    assert p1 - p8 == pytest.approx(experts * 7 / 8)


def test_search_over_ep_respects_the_experts():
    cfg = moe_tiny("train.micro_batch_size=0")
    found = meshes(cfg, 8)
    assert {s["expert"] for s in found} == {1, 2, 4, 8}
    six = apply_overrides(cfg, ["model.n_experts=6"])
    assert {s["expert"] for s in meshes(six, 8)} == {1, 2}
    assert any(s["stage"] > 1 for s in found)  # pipelines hold whole MoE layers
    assert {s["expert"] for s in meshes(get_preset("tiny"), 8)} == {1}
    ranked, _ = search(cfg, 8, roofline.GPUS["h100"])
    assert any(c["sizes"]["expert"] > 1 for c in ranked)
    for c in ranked:
        assert 8 % c["sizes"]["expert"] == 0
        assert ("expert" in c["time"]["comm_s"]) == (c["sizes"]["expert"] > 1)


def test_expert_axis_link_is_nvlink_inside_a_node():
    sizes = ONE | {"fsdp": 8, "expert": 8}
    assert links.link_bandwidth(sizes, "expert") == links.NVLINK
    assert links.link_bandwidth(sizes | {"tensor": 2, "fsdp": 4}, "expert") == links.INFINIBAND


def test_plan_shows_ep_and_the_all_to_all(tmp_path):
    cfg = get_preset("mixtral-8x7b")
    sizes = ONE | {"fsdp": 8, "expert": 8}
    path = tmp_path / "bw.json"
    path.write_text(json.dumps({"mesh": "fsdp=8,ep=8", "fit": {
        "expert": {"all-to-all": {"latency_us": 50.0, "busbw_GBps": 100.0}}}}))
    report = plan(cfg, sizes, roofline.GPUS["h100"], None, load(path))
    assert report["mesh"] == "fsdp=8,ep=8" and report["all_to_all"] == traffic.expert(cfg, sizes) > 0
    assert report["time"]["comm_s"]["expert"] == pytest.approx(50e-6 + report["communication"]["expert"] / 100e9)
    text = format_plan(report)
    assert "of which all-to-all" in text and "expert measured" in text


def test_plan_cli_search_mixtral():
    out = run_module("tools.plan", "--config", "mixtral-8x7b", "--gpus", "64", "--search", "--confirm", "0",
                     "--set", "model.moe_dispatch=capacity", "--json")
    assert out.returncode == 0, out.stderr
    top = json.loads(out.stdout)["top"]
    assert len(top) == 5 and all(r["memory_gib"] <= 80e9 / 2**30 for r in top)
    assert any("ep=" in r["mesh"] and r["all_to_all_gib"] > 0 for r in top)
