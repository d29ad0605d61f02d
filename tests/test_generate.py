"""Decoding with a KV cache (model/decode.py) and the tools.generate command line."""

import json

import jax
import numpy as np
import pytest
from flax import nnx

from conftest import initial_run, run_module, small_config

PROMPT, NEW = 8, 32


@pytest.fixture(scope="module")
def setup():
    """A random-init small model (fp32), its parameters on dp=2,tp=2, and a batch of 2 prompts."""
    from model.transformer import Transformer
    from sharding.mesh import build_mesh
    from sharding.rules import param_shardings

    cfg = small_config("dp=2,tp=2", "train.seq_len=48")
    mesh = build_mesh(cfg.parallel, jax.devices()[:4])
    model = Transformer(cfg.model, rngs=nnx.Rngs(0))
    params = nnx.state(model)
    prompts = np.random.default_rng(0).integers(0, 256, (2, PROMPT))
    return cfg, mesh, model, jax.device_put(params, param_shardings(params, mesh)), prompts


def decoder(setup, temperature=0.0, top_p=1.0):
    from model.decode import Decoder

    cfg, mesh, _, params, _ = setup
    d = Decoder(cfg.model, mesh, 2, PROMPT, NEW, temperature, top_p)
    d.compile(params)
    return d


@pytest.fixture(scope="module")
def greedy(setup):
    d = decoder(setup)
    return d, d.generate(setup[3], setup[4])


def test_greedy_with_cache_equals_full_forward_argmax(setup, greedy):
    """Token for token, 32 tokens, 2 prompts, on dp=2,tp=2: the cached decode equals the argmax of
    the whole sequence's forward pass (one device) recomputed at every position."""
    _, _, model, _, prompts = setup
    forward = jax.jit(lambda tokens: model(tokens)[0])
    seq = np.zeros((2, PROMPT + NEW), np.int32)  # later positions cannot change earlier logits (causal)
    seq[:, :PROMPT] = prompts
    for i in range(NEW):
        seq[:, PROMPT + i] = np.argmax(np.asarray(forward(seq))[:, PROMPT + i - 1], axis=-1)
    np.testing.assert_array_equal(greedy[1].tokens, seq[:, PROMPT:])


@pytest.mark.parametrize("moe_every", [1, 2])
def test_moe_greedy_with_cache_equals_full_forward_argmax(moe_every):
    """A MoE model (4 experts, top-2, dropless; every layer, or a Group of a dense layer and a MoE
    one) decodes on dp=2,tp=2 token for token as the argmax of its full forward on one device.
    Per MoE layer the decode step adds one all-reduce over tensor of [B/dp, 1, D] (the experts'
    row-parallel outputs), as the dense MLP's: no all-to-all, the experts all on every device."""
    from model.decode import Decoder
    from model.transformer import Transformer
    from sharding.mesh import build_mesh
    from sharding.rules import param_shardings
    from tools.hlo import census

    cfg = small_config("dp=2,tp=2", "train.seq_len=24", "model.n_experts=4", "model.experts_per_token=2",
                       "model.expert_d_ff=32", "model.moe_dispatch=dropless", f"model.moe_every={moe_every}")
    m, new = cfg.model, 16
    mesh = build_mesh(cfg.parallel, jax.devices()[:4])
    model = Transformer(m, rngs=nnx.Rngs(1))
    params = nnx.state(model)
    prompts = np.random.default_rng(1).integers(0, 256, (2, PROMPT))
    d = Decoder(m, mesh, 2, PROMPT, new)
    d.compile(jax.device_put(params, param_shardings(params, mesh)))
    got = d.generate(jax.device_put(params, param_shardings(params, mesh)), prompts).tokens
    forward = jax.jit(lambda tokens: model(tokens)[0])
    seq = np.zeros((2, PROMPT + new), np.int32)
    seq[:, :PROMPT] = prompts
    for i in range(new):
        seq[:, PROMPT + i] = np.argmax(np.asarray(forward(seq))[:, PROMPT + i - 1], axis=-1)
    np.testing.assert_array_equal(got, seq[:, PROMPT:])
    found = census(d.decode.as_text(), dict(mesh.shape))
    assert not [c for c in found if c.kind == "all-to-all"]
    in_scan = [(c.kind, c.axes, c.elements, c.trips) for c in found if "/while/body/" in c.op_name]
    assert in_scan == [("all-reduce", ("tensor",), m.d_model, m.n_layers // moe_every)] * 2 * moe_every


def test_decode_step_splits_heads_and_batch(setup, greedy):
    """The compiled step holds each device's shard of the cache, [X, B/dp, M, K/tp, H], and the
    two row-parallel all-reduces over tensor per layer of [B/dp, 1, D] that GSPMD inserted."""
    from tools.hlo import census

    cfg, mesh, _, _, _ = setup
    d, out = greedy
    m = cfg.model
    local = (m.n_layers, 1, PROMPT + NEW, m.n_kv_heads // 2, m.head_dim)
    assert out.cache["k"].sharding.shard_shape(out.cache["k"].shape) == local
    text = d.decode.as_text()
    assert f"f32[{','.join(map(str, local))}]" in text
    per_layer = [c for c in census(text, dict(mesh.shape)) if c.trips == m.n_layers]
    assert [(c.kind, c.axes, c.elements) for c in per_layer] == [("all-reduce", ("tensor",), m.d_model)] * 2


def test_cache_bytes_equal_the_formula(setup, greedy):
    from model.decode import cache_bytes

    cfg, d = setup[0], greedy[0]
    m, length = cfg.model, PROMPT + NEW
    held = sum(c.nbytes for c in d.new_cache().values())
    assert held == cache_bytes(m, 2, length) == 2 * m.n_layers * m.n_kv_heads * m.head_dim * length * 2 * 4


def test_sample_greedy_limits():
    from model.decode import sample

    logits = jax.random.normal(jax.random.key(1), (4, 256))
    best = np.argmax(logits, axis=-1)
    key = jax.random.key(2)
    np.testing.assert_array_equal(sample(logits, key, 0.0, 0.9), best)  # temperature 0
    np.testing.assert_array_equal(sample(logits, key, 1.0, 1e-6), best)  # tiny nucleus
    draws = np.asarray(jax.vmap(lambda k: sample(logits, k, 1.0, 0.5))(jax.random.split(key, 64))).T  # [4, 64]
    ranked = np.sort(np.asarray(logits), axis=-1)[:, ::-1]
    probs = np.asarray(jax.nn.softmax(ranked, axis=-1))
    kept = np.sum(np.cumsum(probs, axis=-1) - probs < 0.5, axis=-1)  # the nucleus's size per row
    floor = ranked[np.arange(4), kept - 1]
    assert (np.take_along_axis(np.asarray(logits), draws, axis=-1) >= floor[:, None]).all()  # in the nucleus
    assert all(len(np.unique(row)) > 1 for row in draws)  # and sampled, not greedy


def test_sampling_same_seed_same_text(setup, greedy):
    d = decoder(setup, temperature=1.0, top_p=0.9)
    params, prompts = setup[3], setup[4]
    first, again, other = (d.generate(params, prompts, seed).tokens for seed in (0, 0, 1))
    np.testing.assert_array_equal(first, again)
    assert (first != other).any() and (first != greedy[1].tokens).any()


def fake_run(tmp_path, *sets, step=True):
    """A run directory with the small config and an (empty) checkpoints/5: enough for the checks
    made before jax is imported."""
    cfg = small_config("", *sets)
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_dict()))
    if step:
        (tmp_path / "checkpoints" / "5").mkdir(parents=True)
    return tmp_path


@pytest.mark.parametrize("args, sets, message", [
    (["--prompt", "x" * 32], [], "--prompt is 32 bytes: give 1 to 31 (the model was trained on train.seq_len=32"),
    (["--max-new-tokens", "30"], [], "--max-new-tokens 30: the prompt's 11 bytes + the new tokens must fit"),
    (["--temperature", "-0.5"], [], "--temperature -0.5: must be finite and >= 0"),
    (["--temperature", "nan"], [], "--temperature nan: must be finite and >= 0"),
    (["--temperature", "inf"], [], "--temperature inf: must be finite and >= 0"),
    (["--top-p", "0"], [], "--top-p 0.0: must be in (0, 1]"),
    (["--top-p", "1.5"], [], "--top-p 1.5: must be in (0, 1]"),
    ([], ["data.source=tokens", "data.path=x.bin"], "no tokenizer for a text --prompt"),
    ([], ["data.source=synthetic", "model.vocab_size=512"], "no tokenizer for a text --prompt"),
])
def test_bad_input_is_one_error_line(tmp_path, args, sets, message):
    run = fake_run(tmp_path, *sets)
    out = run_module("tools.generate", "--run-dir", str(run), "--prompt", "def fib(n):", *args)
    assert out.returncode == 2 and out.stderr.startswith("error: ") and message in out.stderr, out.stderr
    assert len(out.stderr.splitlines()) == 1


def test_run_without_checkpoints_is_refused(tmp_path):
    out = run_module("tools.generate", "--run-dir", str(fake_run(tmp_path, step=False)), "--prompt", "a")
    assert out.returncode == 2 and "no config.json and checkpoints/<step> there; train first" in out.stderr
    assert len(out.stderr.splitlines()) == 1


def test_cli_generates_from_a_checkpoint(tmp_path):
    """End to end: a checkpoint of the initial state, restored on dp=2,tp=2, greedy."""
    initial_run(tmp_path, small_config(), jax.devices()[:1])
    out = run_module("tools.generate", "--run-dir", str(tmp_path), "--prompt", "def f", "--max-new-tokens", "6",
                     "--temperature", "0", "--mesh", "dp=2,tp=2")
    assert out.returncode == 0, out.stderr
    assert "mesh dp=2,tp=2" in out.stdout and "2 row(s) x 11 positions" in out.stdout
    assert "KV cache 5,632 bytes = 2·X·K·H·L·B·bytes = 2·2·2·8·11·2·4 (float32); 1,408 per device" in out.stdout
    assert "tok/s" in out.stdout and "--- sample 0 ---\ndef f" in out.stdout


def test_cli_generates_from_a_moe_run_trained_on_ep2(tmp_path):
    """A MoE run saved on ep=2 with capacity dispatch decodes on the run's other axes (here one
    device: the expert axis is left out, every expert on it) and routes dropless."""
    sets = ("model.n_experts=4", "model.experts_per_token=2", "model.expert_d_ff=32", "model.moe_dispatch=capacity")
    initial_run(tmp_path, small_config("ep=2", *sets), jax.devices()[:2])
    out = run_module("tools.generate", "--run-dir", str(tmp_path), "--prompt", "def f", "--max-new-tokens", "4",
                     "--temperature", "0")
    assert out.returncode == 0, out.stderr
    assert "mesh single device" in out.stdout and "1 row(s) x 9 positions" in out.stdout
    assert "--- sample 0 ---\ndef f" in out.stdout


def test_any_dp_decodes_whatever_batch_the_run_trained_with(tmp_path):
    """The run's train.global_batch_size (16) does not split over dp=3: decoding has its own batch,
    one row per dp·fsdp rank, so --mesh dp=3 decodes 3 rows (it once said to change the batch)."""
    initial_run(tmp_path, small_config(), jax.devices()[:1])
    out = run_module("tools.generate", "--run-dir", str(tmp_path), "--prompt", "ab", "--max-new-tokens", "2",
                     "--temperature", "0", "--mesh", "dp=3")
    assert out.returncode == 0, out.stderr
    assert "mesh dp=3" in out.stdout and "3 row(s) x 4 positions" in out.stdout and "x 3 row(s)" in out.stdout
