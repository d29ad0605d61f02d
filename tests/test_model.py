"""The transformer: presets build abstractly with the published sizes; causality; remat; errors."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import PRESETS, ConfigError, get_preset
from conftest import JAXLIB, small_config
from model.transformer import Transformer, count_params
from sharding.cores import building_for, choose_core, core_problem
from training.step import loss_fn


def abstract_params(model_cfg):
    return nnx.state(nnx.eval_shape(lambda: Transformer(model_cfg, rngs=nnx.Rngs(0))))


@pytest.mark.parametrize("name", list(PRESETS))
def test_every_preset_builds_abstractly(name):
    params = abstract_params(get_preset(name).model)
    leaves = jax.tree.leaves(params)
    assert leaves and all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)


@pytest.mark.parametrize("name, billions", [("llama3-8b", 8.03), ("llama3-70b", 70.6)])
def test_published_parameter_counts(name, billions):
    n = count_params(abstract_params(get_preset(name).model))
    assert n / 1e9 == pytest.approx(billions, abs=0.05)  # published figures are rounded


def small_model(**changes):
    cfg = small_config().model
    return dataclasses.replace(cfg, **changes)


def test_causal_future_tokens_do_not_change_past_logits():
    model = Transformer(small_model(), rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, 256)
    changed = tokens.at[:, 10:].set((tokens[:, 10:] + 7) % 256)
    (a, _), (b, _) = model(tokens), model(changed)
    np.testing.assert_array_equal(a[:, :10], b[:, :10])
    assert not np.allclose(a[:, 10:], b[:, 10:])


@pytest.mark.parametrize("policy", ["full", "dots", "attn"])
def test_remat_policies_change_memory_not_numbers(policy):
    cfg = small_config()
    tokens = jax.random.randint(jax.random.key(2), (4, 33), 0, 256)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    results = []
    for name in ("none", policy):
        run = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, remat=name))
        graphdef, params = nnx.split(Transformer(run.model, rngs=nnx.Rngs(0)))
        results.append(jax.jit(jax.value_and_grad(loss_fn, has_aux=True), static_argnums=(1, 3))(params, graphdef, batch, run))
    ((loss0, _), grads0), ((loss1, _), grads1) = results
    np.testing.assert_allclose(loss1, loss0, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(grads1), jax.tree.leaves(grads0)):
        np.testing.assert_allclose(a, b, atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize("changes", [{"remat": "none"}, {"n_experts": 4, "moe_every": 2, "remat": "full"}])
def test_unrolled_layers_equal_the_scan(changes):
    """model.scan_layers=false (a Python loop over the layers' slices) computes what the scan
    does: loss, router statistics and every gradient (fp32, tolerances of the remat test); a
    dense stack without remat, and MoE Groups of 2 layers under full remat with their router
    statistics."""
    cfg = small_config()
    tokens = jax.random.randint(jax.random.key(3), (4, 33), 0, 256)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    results = []
    for scan in (True, False):
        run = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, scan_layers=scan, **changes))
        graphdef, params = nnx.split(Transformer(run.model, rngs=nnx.Rngs(0)))
        results.append(jax.jit(jax.value_and_grad(loss_fn, has_aux=True), static_argnums=(1, 3))(params, graphdef, batch, run))
    ((loss0, aux0), grads0), ((loss1, aux1), grads1) = results
    np.testing.assert_allclose(loss1, loss0, rtol=1e-6)
    for a, b in zip(jax.tree.leaves((aux1, grads1)), jax.tree.leaves((aux0, grads0))):
        np.testing.assert_allclose(a, b, atol=1e-7, rtol=1e-5)


def test_remat_saves_memory_scanned_and_unrolled():
    """Compiled temp memory of the gradient, 4 layers of 8 x 128 tokens (the xla core's [B, N, L, L]
    scores dominate): remat full keeps under half of what none keeps, with the layer scan and
    unrolled alike. Unrolled, each layer's checkpoint lowers with an optimization barrier
    (prevent_cse, model/remat.py), beside the one of its SwiGLU gating's own checkpoint
    (model.mlp.swiglu, under every policy): without it XLA merged each layer's recomputation into its
    forward and kept every intermediate (full within 3% of none here; 1b compiled for one H100:
    40.2 GiB under full, dots and none). XLA CPU before jaxlib 0.11 schedules the recomputation
    early and keeps them anyway (72.8 MB against 74.8 on jax 0.10.2), so there the test holds the
    barriers only; jax 0.12's CPU and GPU compiles keep what full keeps (21.2 MB; 1b on an H100
    22.7 GiB, bench/results/remat-unrolled-1b-h100-compiled.json)."""
    cfg = small_config("", "model.n_layers=4")
    tokens = jnp.zeros((8, 129), jnp.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    temp = {}
    for scan in (True, False):
        for name in ("none", "full"):
            run = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, remat=name, scan_layers=scan))
            graphdef, params = nnx.split(Transformer(run.model, rngs=nnx.Rngs(0)))
            grad = jax.jit(jax.grad(lambda p: loss_fn(p, graphdef, batch, run)[0]))
            lowered = grad.lower(params)
            temp[scan, name] = lowered.compile().memory_analysis().temp_size_in_bytes
            if not scan:
                # each layer's one or two, and the loss's terms' (model/loss.py)
                assert lowered.as_text().count("optimization_barrier") == (8 if name == "full" else 4) + 1
    assert temp[True, "full"] < 0.5 * temp[True, "none"], temp
    if JAXLIB >= (0, 11):
        assert temp[False, "full"] < 0.5 * temp[False, "none"], temp


def test_unrolled_layers_keep_no_stacks():
    """The compiled gradient of the unrolled stack has no loop over the layers, and its backward
    puts the per-layer gradients together by one concatenate, not by summing zero-padded copies
    (the transpose of indexing): no pad of a stacked parameter's shape. (XLA CPU's elemental
    emitter, which the tests use on jaxlib < 0.11 (conftest), expands the embedding gradient's
    scatter-add into a loop over the tokens: the one loop allowed.)"""
    cfg = small_config()
    run = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, scan_layers=False))
    graphdef, params = nnx.split(Transformer(run.model, rngs=nnx.Rngs(0)))
    tokens = jnp.zeros((2, 17), jnp.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    hlo = jax.jit(jax.grad(lambda p: loss_fn(p, graphdef, batch, run)[0])).lower(params).compile().as_text()
    loops = [line for line in hlo.splitlines() if " while(" in line]
    assert all("scatter-add" in line and '"known_trip_count":{"n":"32"}' in line for line in loops), loops
    stacked = {"x".join(map(str, a.shape)) for a in jax.tree.leaves(nnx.state(params["blocks"]))}
    pads = set(re.findall(r"f32\[([\d,]+)\][^ ]* pad\(", hlo))
    assert not {p.replace(",", "x") for p in pads} & stacked, pads
    assert "concatenate(" in hlo


def test_the_xla_core_keeps_one_fp32_score_stack_for_backward():
    """The xla core's softmax is differentiated by its custom JVP (model.layers.softmax), whose
    backward reads the probabilities alone. The gradient of 4 scanned attention layers, compiled
    on XLA CPU, takes 2.13 fp32 [X, B, N, L, L] stacks of temporaries on jax 0.10.2, 0.11.2 and
    0.12.1 (the saved probabilities and one layer's backward working set); with jax.nn.softmax's
    default on jax <= 0.11, which keeps exp(x - max) too, 3.17."""
    from model.attention import xla_attention

    layers, b, length, heads, head_dim = 4, 1, 256, 8, 16

    def loss(w, x):
        return jax.lax.scan(lambda x, wi: (xla_attention(x * wi, x, x), None), x, w)[0].sum()

    compiled = jax.jit(jax.grad(loss)).lower(jnp.ones((layers,)), jnp.ones((b, length, heads, head_dim))).compile()
    stacks = compiled.memory_analysis().temp_size_in_bytes / (layers * b * heads * length ** 2 * 4)
    assert 1.0 < stacks < 2.5, stacks


def test_bf16_compute_stays_close_to_fp32():
    cfg = small_config()
    tokens = jax.random.randint(jax.random.key(3), (4, 33), 0, 256)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    graphdef, params = nnx.split(Transformer(cfg.model, rngs=nnx.Rngs(0)))
    losses = []
    for dtype in ("float32", "bfloat16"):
        run = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, compute_dtype=dtype))
        losses.append(float(loss_fn(params, graphdef, batch, run)[0]))
    assert losses[0] == pytest.approx(np.log(256), rel=0.02)  # untrained: near-uniform
    assert losses[1] == pytest.approx(losses[0], rel=1e-2)


@pytest.mark.parametrize(
    "changes, field",
    [
        ({"remat": "sometimes"}, "model.remat"),
        ({"attention": "flash"}, "model.attention"),
        ({"n_heads": 8, "n_kv_heads": 3}, "model.n_kv_heads"),
        ({"head_dim": 7}, "model.head_dim"),
    ],
)
def test_bad_model_config_is_a_clear_error(changes, field):
    with pytest.raises(ConfigError) as err:
        model = Transformer(small_model(**changes), rngs=nnx.Rngs(0))
        model(jnp.zeros((1, 8), jnp.int32))
    assert field in str(err.value)


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="cudnn is available on GPUs")
def test_cudnn_core_off_gpu_says_so():
    with pytest.raises(ConfigError, match="NVIDIA GPU"):
        Transformer(small_model(attention="cudnn"), rngs=nnx.Rngs(0))


@pytest.mark.parametrize(
    "core, platform, capability, dtype, head_dim, expected",
    [
        ("cudnn", "gpu", (9, 0), "bfloat16", 128, None),
        ("cudnn", "gpu", (9, 0), "bfloat16", 256, None),
        ("cudnn", "gpu", (8, 0), "bfloat16", 256, "at most 128"),
        ("cudnn", "gpu", (9, 0), "float32", 64, "model.compute_dtype=bfloat16"),
        ("cudnn", "gpu", (9, 0), "bfloat16", 60, "multiple of 8"),
        ("cudnn", "gpu", (7, 0), "bfloat16", 64, "compute capability 8.0"),
        ("cudnn", "cpu", None, "bfloat16", 64, "NVIDIA GPU"),
        ("pallas", "cpu", None, "float32", 64, None),
        ("pallas", "gpu", (9, 0), "bfloat16", 128, None),
        ("pallas", "gpu", (7, 5), "bfloat16", 128, "compute capability 8.0"),
        ("pallas", "gpu", (9, 0), "bfloat16", 96, "power of two >= 16"),
        ("pallas", "tpu", None, "bfloat16", 128, "not on tpu"),
        ("xla", "tpu", None, "float32", 64, None),
        ("auto", "cpu", None, "bfloat16", 64, None),
        ("flash", "gpu", (9, 0), "bfloat16", 64, "choose one of auto, xla, cudnn, pallas"),
    ],
)
def test_core_refused_where_it_cannot_run(core, platform, capability, dtype, head_dim, expected):
    problem = core_problem(core, platform, capability, dtype, head_dim)
    assert problem is None if expected is None else expected in problem


@pytest.mark.parametrize(
    "name, platform, capability, dtype, head_dim, context, expected",
    [
        ("auto", "gpu", (9, 0), "bfloat16", 128, False, "cudnn"),  # the H100 record's fastest
        ("auto", "gpu", (8, 0), "float16", 64, False, "cudnn"),
        ("auto", "gpu", (9, 0), "bfloat16", 128, True, "pallas"),  # ring blocks need the lse
        ("auto", "gpu", (8, 0), "bfloat16", 256, False, "pallas"),  # cuDNN's head-dim limit before Hopper
        ("auto", "gpu", (9, 0), "bfloat16", 264, False, "xla"),  # neither cuDNN nor Triton takes it
        ("auto", "gpu", (9, 0), "bfloat16", 96, True, "xla"),  # the ring's pallas blocks: Triton refuses 96
        ("auto", "gpu", (9, 0), "float32", 128, False, "xla"),
        ("auto", "gpu", (7, 0), "bfloat16", 128, False, "xla"),
        ("auto", "cpu", None, "bfloat16", 128, False, "xla"),
        ("auto", "tpu", None, "bfloat16", 128, True, "xla"),
        ("pallas", "cpu", None, "float32", 64, True, "pallas"),  # a named core is kept
        ("xla", "gpu", (9, 0), "bfloat16", 128, False, "xla"),
    ],
)
def test_auto_takes_the_fastest_core_that_runs(name, platform, capability, dtype, head_dim, context, expected):
    """model.attention=auto by device (sharding/cores.py); what it picks can always run there."""
    core = choose_core(name, platform, capability, dtype, head_dim, context)
    assert core == expected
    assert core_problem(core, platform, capability, dtype, head_dim) is None or name != "auto"


def test_the_build_resolves_auto_for_its_devices():
    """parallelize hands the model a concrete core: xla on these CPU devices; on a faked H100
    (`building_for` an H100) cudnn, and under sp > 1 pallas, with the tensor regions' typing
    off around either (both run per device under shard_map: model/kernels/sharded.py)."""
    from sharding import strategies
    from sharding.mesh import AXES

    def resolved(mesh: str, head_dim: int = 16) -> strategies.Strategies:
        cfg = small_config(mesh, "model.compute_dtype=bfloat16", f"model.head_dim={head_dim}")
        return strategies.parallelize(cfg, {a: getattr(cfg.parallel, a) for a in AXES})

    cpu = resolved("dp=2,tp=2")
    assert cpu.attention == "xla" and cpu.tensor.check_vma  # the xla core keeps the typed regions
    with building_for("gpu", (9, 0)):
        on_gpu = resolved("dp=2,tp=2")
        assert on_gpu.attention == "cudnn" and not on_gpu.tensor.check_vma and "attention cudnn" in on_gpu.describe()
        ring = resolved("dp=2,sp=2,tp=2")
        assert (ring.attention, ring.context, ring.tensor.check_vma) == ("pallas", "ring", False)
        assert resolved("dp=2,sp=2,tp=2", head_dim=8).attention == "xla"  # Triton's tiles need H >= 16
    assert strategies.Strategies.single_device(small_config().model).attention == "xla"  # fp32
