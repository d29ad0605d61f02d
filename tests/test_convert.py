"""tools/convert.py: HF Llama <-> meshtrain, checked bit for bit (round trip), against transformers
(logits and loss), for host memory, through train.py, and on bad input."""

import dataclasses
import json
import os
import re
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from conftest import ROOT, child_env, initial_run, run_module
from configs import ConfigError, ParallelConfig, RunConfig, apply_overrides, get_preset
from sharding.mesh import build_mesh, parse_mesh
from tools import convert
from training.build import make_program
from training.checkpoint import Checkpointer

MESH = "fsdp=2,tp=2"  # the mesh of the CLI tests (4 fake devices in their subprocesses)
RESTORE_MESH = "dp=2,fsdp=2,tp=2"  # this session's 8 devices: the runs, in-process conversions, restores
SMALL = ["--set", "train.global_batch_size=4", "--set", "train.seq_len=16", "--set", "model.compute_dtype=float32"]


def convert_here(*args: str) -> None:
    """tools.convert in this process (its 8 devices): no subprocess's imports to wait for."""
    assert convert.main([str(a) for a in args]) == 0


def convert_cli(*args: str) -> subprocess.CompletedProcess:
    return run_module("tools.convert", *args)


def restore(run_dir):
    """(cfg, mesh, program, state) of a run's latest checkpoint, restored on this session's 8 devices."""
    cfg = RunConfig.from_dict(json.loads((run_dir / "config.json").read_text()))
    cfg = dataclasses.replace(cfg, parallel=parse_mesh(RESTORE_MESH, ParallelConfig()))
    mesh = build_mesh(cfg.parallel)
    program = make_program(cfg, mesh)
    checkpoints = Checkpointer(run_dir / "checkpoints", cfg)
    state = checkpoints.restore_latest(program)
    checkpoints.close()
    return cfg, mesh, program, state


def hf_tensors(directory) -> dict[str, np.ndarray]:
    out = {}
    for f in sorted(directory.glob("*.safetensors")):
        with safe_open(f, framework="numpy") as h:
            out |= {k: h.get_tensor(k) for k in h.keys()}
    return out


@pytest.fixture(scope="session")
def meshtrain_runs(tmp_path_factory):
    """Two runs with a step-0 checkpoint of random parameters on dp=2,fsdp=2,tp=2: tiny with 2
    layers, and a GQA variant (N=4, K=1, H=32)."""
    runs = {}
    for name, sets in {"tiny": [], "gqa": ["model.n_heads=4", "model.n_kv_heads=1", "model.head_dim=32"],
                       "moe": ["model.n_experts=4", "model.experts_per_token=2", "model.expert_d_ff=48"]}.items():
        run = tmp_path_factory.mktemp(name)
        cfg = apply_overrides(get_preset("tiny"), ["model.n_layers=2", "train.global_batch_size=4", *sets])
        initial_run(run, dataclasses.replace(cfg, parallel=parse_mesh(RESTORE_MESH, ParallelConfig())))
        runs[name] = run
    return runs


@pytest.mark.parametrize("name", ["tiny", "gqa", "moe"])
def test_round_trip_is_bit_exact(meshtrain_runs, name, tmp_path):
    """meshtrain -> HF -> meshtrain -> HF, bit for bit; the MoE run as Mixtral (one HF tensor per
    layer and expert: 2 layers x 4 experts x w1/w2/w3, and a router per layer)."""
    run = meshtrain_runs[name]
    convert_here("--to-hf", run, "--out", tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    arch = "MixtralForCausalLM" if name == "moe" else "LlamaForCausalLM"
    assert config["architectures"] == [arch] and not config["tie_word_embeddings"]
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(hf_tensors(tmp_path / "hf"))
    modes = {f.name: f.stat().st_mode & 0o777 for f in (tmp_path / "hf").iterdir()}
    assert set(modes.values()) == {modes["config.json"]}, modes  # the umask's, not safetensors' 0600
    if name == "moe":
        assert (config["num_local_experts"], config["num_experts_per_tok"], config["intermediate_size"]) == (4, 2, 48)
        experts = [n for n in index["weight_map"] if ".block_sparse_moe.experts." in n]
        assert len(experts) == 2 * 4 * 3 and not [n for n in index["weight_map"] if ".mlp." in n]
        d, written = config["hidden_size"], hf_tensors(tmp_path / "hf")
        assert written["model.layers.1.block_sparse_moe.experts.3.w2.weight"].shape == (d, 48)
        assert written["model.layers.0.block_sparse_moe.gate.weight"].shape == (4, d)
    convert_here("--from-hf", tmp_path / "hf", "--run-dir", tmp_path / "back", "--mesh", "fsdp=4,tp=2")
    _, _, _, before = restore(run)
    _, _, program, after = restore(tmp_path / "back")
    for a, b in zip(jax.tree.leaves(before.params), jax.tree.leaves(after.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert int(after.step) == 0
    zeros = jax.tree.leaves(after.opt_state)
    assert all(not np.asarray(z).any() for z in zeros)  # fresh AdamW: moments and counts zero
    convert_here("--to-hf", tmp_path / "back", "--out", tmp_path / "hf2")  # and the written checkpoint reads back
    first, second = hf_tensors(tmp_path / "hf"), hf_tensors(tmp_path / "hf2")
    assert first.keys() == second.keys() and all(np.array_equal(first[k], second[k]) for k in first)


FUSED = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
         "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}


def fuse(tensors: dict, join) -> dict:
    """`tensors` (HF name -> array or shape) with each layer's q/k/v and gate/up replaced by one
    fused tensor: join(the parts, in row order)."""
    out = dict(tensors)
    for name in tensors:
        for fused, parts in FUSED.items():
            if name.endswith(f".{parts[0]}.weight"):
                layer = name.removesuffix(f"{parts[0]}.weight")
                out[f"{layer}{fused}.weight"] = join([out.pop(f"{layer}{p}.weight") for p in parts])
    return out


def test_fused_qkv_and_gate_up_convert_like_split(meshtrain_runs, tmp_path):
    """A checkpoint with self_attn.qkv_proj and mlp.gate_up_proj (GQA: K < N, so q, k and v have
    different row counts) converts to the same parameters, bit for bit, as its split original."""
    convert_here("--to-hf", meshtrain_runs["gqa"], "--out", tmp_path / "split")
    (tmp_path / "fused").mkdir()
    (tmp_path / "fused" / "config.json").write_text((tmp_path / "split" / "config.json").read_text())
    tensors = fuse(hf_tensors(tmp_path / "split"), np.concatenate)
    assert "model.layers.1.self_attn.qkv_proj.weight" in tensors and "model.layers.1.mlp.up_proj.weight" not in tensors
    save_file(tensors, tmp_path / "fused" / "model.safetensors", metadata={"format": "pt"})
    for layout in ("split", "fused"):
        convert_here("--from-hf", tmp_path / layout, "--run-dir", tmp_path / f"run-{layout}", "--mesh", "fsdp=4,tp=2")
    _, _, _, split = restore(tmp_path / "run-split")
    _, _, _, fused = restore(tmp_path / "run-fused")
    for a, b in zip(jax.tree.leaves(split.params), jax.tree.leaves(fused.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# --- against transformers --------------------------------------------------------------------

try:
    import torch
    import transformers
except ImportError:
    transformers = None
needs_hf = pytest.mark.skipif(transformers is None, reason="transformers/torch not installed (pip install -e '.[hf]')")


def hf_model(directory, tied: bool, kv_heads: int):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=kv_heads, head_dim=16,
                                      max_position_embeddings=64, rope_theta=500.0, rms_norm_eps=1e-5,
                                      tie_word_embeddings=tied)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # norms away from 1 and sharp attention, so that a swapped norm or rotary would show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            if "q_proj" in name or "k_proj" in name:
                p.mul_(10.0)
    model.save_pretrained(directory)
    return model


def hf_mixtral(directory):
    """A tiny MixtralForCausalLM (4 experts, top 2, GQA), random, saved as transformers saves it
    (one tensor per layer and expert: block_sparse_moe.experts.{e}.w1/w2/w3)."""
    torch.manual_seed(0)
    config = transformers.MixtralConfig(vocab_size=256, hidden_size=64, intermediate_size=48, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                        num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
                                        rope_theta=500.0, rms_norm_eps=1e-5, sliding_window=None)
    model = transformers.MixtralForCausalLM(config).eval()
    with torch.no_grad():  # a sharper router than init's, so that a swapped gate or expert would show
        for name, p in model.named_parameters():
            if "gate.weight" in name or "norm" in name:
                p.copy_(p * 10 if "gate" in name else 1 + 0.1 * torch.randn_like(p))
    model.save_pretrained(directory)
    return model


@needs_hf
@pytest.mark.parametrize("tied,kv_heads", [(False, 2), (True, 4), ("mixtral", 2)])
def test_logits_and_loss_equal_transformers(tmp_path, tied, kv_heads):
    """Llama (untied GQA, tied MHA) and Mixtral: converted, the logits and the loss of the
    first batch equal transformers' (the MoE run routes dropless, as Mixtral does)."""
    model = hf_mixtral(tmp_path / "hf") if tied == "mixtral" else hf_model(tmp_path / "hf", tied, kv_heads)
    convert_here("--from-hf", tmp_path / "hf", "--run-dir", tmp_path / "run", "--mesh", RESTORE_MESH, *SMALL)
    cfg, mesh, program, state = restore(tmp_path / "run")
    tokens = np.random.default_rng(0).integers(0, 256, (4, 17))
    with torch.no_grad():
        ref = model(torch.tensor(tokens), labels=torch.tensor(tokens))
    with jax.set_mesh(mesh):
        logits, _ = nnx.merge(program.graphdef, state.params)(jnp.asarray(tokens[:, :16]))
        batch = {k: jax.device_put(v, program.batch_sharding)
                 for k, v in {"inputs": tokens[None, :, :16], "targets": tokens[None, :, 1:]}.items()}
        _, metrics = program.step_fn(state, batch)
    want = ref.logits.numpy()[:, :16]
    np.testing.assert_allclose(np.asarray(logits), want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    np.testing.assert_allclose(float(metrics["loss"]), ref.loss.item(), rtol=1e-5)


@needs_hf
@pytest.mark.parametrize("name", ["gqa", "moe"])
def test_to_hf_loads_in_transformers(meshtrain_runs, tmp_path, name):
    """--to-hf of a Llama-shaped run loads as LlamaForCausalLM, of a MoE run as
    MixtralForCausalLM; the logits equal meshtrain's."""
    run = meshtrain_runs[name]
    convert_here("--to-hf", run, "--out", tmp_path / "hf")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(model).__name__ == ("MixtralForCausalLM" if name == "moe" else "LlamaForCausalLM")
    cfg, mesh, program, state = restore(run)
    tokens = np.random.default_rng(1).integers(0, 256, (4, 16))
    with torch.no_grad():
        want = model(torch.tensor(tokens)).logits.numpy()
    f32 = jax.tree.map(lambda p: p.astype(jnp.float32), state.params)
    with jax.set_mesh(mesh):
        logits, _ = nnx.merge(program.graphdef, f32)(jnp.asarray(tokens))
    np.testing.assert_allclose(np.asarray(logits), want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


# --- synthetic HF checkpoints (numpy only) ----------------------------------------------------

TINY_HF = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 256, "hidden_size": 64,
           "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": 16, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False}


MIXTRAL = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "num_local_experts": 4,
           "num_experts_per_tok": 2, "sliding_window": None}  # TINY_HF | MIXTRAL: a tiny Mixtral


def hf_shapes(c: dict) -> dict[str, tuple[int, ...]]:
    d, f, v, h = c["hidden_size"], c["intermediate_size"], c["vocab_size"], c["head_dim"]
    n, k = c["num_attention_heads"] * h, c["num_key_value_heads"] * h
    layer = {"input_layernorm": (d,), "self_attn.q_proj": (n, d), "self_attn.k_proj": (k, d),
             "self_attn.v_proj": (k, d), "self_attn.o_proj": (d, n), "post_attention_layernorm": (d,)}
    if c.get("num_local_experts"):  # Mixtral: a router and per-expert w1 (gate), w3 (up), w2 (down)
        e = c["num_local_experts"]
        layer |= {"block_sparse_moe.gate": (e, d)} | {f"block_sparse_moe.experts.{j}.{w}": s for j in range(e)
                                                      for w, s in (("w1", (f, d)), ("w3", (f, d)), ("w2", (d, f)))}
    else:
        layer |= {"mlp.gate_proj": (f, d), "mlp.up_proj": (f, d), "mlp.down_proj": (d, f)}
    shapes = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,), "lm_head.weight": (v, d)}
    for i in range(c["num_hidden_layers"]):
        shapes |= {f"model.layers.{i}.{name}.weight": s for name, s in layer.items()}
    return shapes


def write_hf(directory, config: dict, dtype=np.float32, drop: str = "", reshape: str = "", extra: str = "",
             fused: bool = False, float8: str = ""):
    """config.json, and one safetensors file per layer (plus one for the rest) with an index;
    `drop` leaves a tensor out, `reshape` adds a row to one, `extra` adds a [D] tensor, `fused`
    writes qkv_proj and gate_up_proj instead of their parts, `float8` stores one in float8_e4m3fn."""
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(config))
    groups: dict[str, dict[str, np.ndarray]] = {}
    rng = np.random.default_rng(0)
    shapes = fuse(hf_shapes(config), lambda s: (sum(p[0] for p in s), *s[0][1:])) if fused else hf_shapes(config)
    for name, shape in (shapes | ({extra: (config["hidden_size"],)} if extra else {})).items():
        if name == drop:
            continue
        shape = (shape[0] + 1, *shape[1:]) if name == reshape else shape
        file = f"layer-{name.split('.')[2]}.safetensors" if ".layers." in name else "rest.safetensors"
        groups.setdefault(file, {})[name] = (rng.standard_normal(shape[-1], np.float32) * 0.02).astype(dtype) \
            * np.ones(shape, dtype)  # cheap: one random row repeated
        if name == float8:
            groups[file][name] = groups[file][name].astype(ml_dtypes.float8_e4m3fn)
    for file, tensors in groups.items():
        save_file(tensors, directory / file, metadata={"format": "pt"})
    weight_map = {name: file for file, tensors in groups.items() for name in tensors}
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def test_converted_run_fine_tunes_with_train_py(tmp_path):
    write_hf(tmp_path / "hf", TINY_HF)
    relative = os.path.relpath(tmp_path / "run", ROOT)  # as a user types it (orbax wants it absolute)
    out = convert_cli("--from-hf", str(tmp_path / "hf"), "--run-dir", relative, "--mesh", MESH,
                      "--set", "train.global_batch_size=4", "--set", "train.seq_len=32", "--set", "train.steps=2")
    assert out.returncode == 0, out.stderr
    assert "from step 0 with fresh AdamW moments" in out.stdout
    out = run_module("train", "--run-dir", str(tmp_path / "run"))
    assert out.returncode == 0, out.stderr
    assert f"resumed from {tmp_path / 'run' / 'checkpoints' / '0'} (step 0)" in out.stdout
    assert "done: final loss" in out.stdout and "after 2 steps" in out.stdout


@pytest.mark.parametrize("change,message", [
    ({"architectures": ["MistralForCausalLM"], "model_type": "mistral"},
     "architecture MistralForCausalLM (model_type 'mistral') is not supported; supported: LlamaForCausalLM"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope scaling 'llama3' is not supported"),
    ({"attention_bias": True}, "attention_bias=True is not supported"),
    ({"drop": "model.layers.1.mlp.down_proj.weight"}, "missing tensors: model.layers.1.mlp.down_proj.weight"),
    ({"reshape": "model.layers.0.self_attn.k_proj.weight"},
     "mismatched shapes: model.layers.0.self_attn.k_proj.weight [33, 64] (expected [32, 64])"),
    ({"extra": "model.layers.0.self_attn.q_proj.bias"},
     "tensors with no meshtrain parameter: model.layers.0.self_attn.q_proj.bias"),
    ({"fused": True, "reshape": "model.layers.1.self_attn.qkv_proj.weight"},
     "mismatched shapes: model.layers.1.self_attn.qkv_proj.weight [129, 64] (expected [128, 64])"),
    ({"fused": True, "extra": "model.layers.0.mlp.up_proj.weight"},
     "both fused and split tensors: model.layers.0.mlp.gate_up_proj.weight and model.layers.0.mlp.up_proj.weight"),
    (MIXTRAL | {"sliding_window": 4096}, "sliding_window=4096 is not supported"),
    (MIXTRAL | {"router_aux_loss_coef": "abc"}, "config.json: router_aux_loss_coef='abc': expected positive integers"),
    (MIXTRAL | {"router_aux_loss_coef": None, "rms_norm_eps": -1},
     "config.json: rms_norm_eps=-1, router_aux_loss_coef=None: expected positive integers for the sizes, positive "
     "numbers for rope_theta, rms_norm_eps, initializer_range and a number >= 0 for router_aux_loss_coef"),
    (MIXTRAL | {"router_aux_loss_coef": True}, "config.json: router_aux_loss_coef=True: "),
    (MIXTRAL | {"num_experts_per_tok": 5}, "num_experts_per_tok=5 is above num_local_experts=4"),
    (MIXTRAL | {"num_local_experts": None}, "config.json lacks num_local_experts: a MixtralForCausalLM config.json"),
    (MIXTRAL | {"drop": "model.layers.1.block_sparse_moe.experts.3.w2.weight"},
     "not the Mixtral config.json describes: missing tensors: model.layers.1.block_sparse_moe.experts.3.w2.weight"),
    ({"num_local_experts": 4}, "a mixture-of-experts Llama is not supported"),
    ({"float8": "model.layers.1.self_attn.q_proj.weight"}, "dtypes other than F64, F32, F16, BF16 (a quantized "
     "checkpoint: convert the unquantized one): model.layers.1.self_attn.q_proj.weight F8_E4M3"),
])
def test_bad_hf_input_is_one_clear_line(tmp_path, change, message):
    files = {k: change.pop(k) for k in ("drop", "reshape", "extra", "fused", "float8") if k in change}
    write_hf(tmp_path / "hf", TINY_HF | change, **files)
    out = convert_cli("--from-hf", str(tmp_path / "hf"), "--run-dir", str(tmp_path / "run"))
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert out.returncode == 2 and len(errors) == 1 and message in errors[0], out.stderr
    assert "Traceback" not in out.stderr and not (tmp_path / "run").exists()


@pytest.mark.parametrize("config,sets,message", [
    (TINY_HF | MIXTRAL, ["model.moe_every=2"], "--set model.moe_every=2: the model's shape comes from "),
    (TINY_HF, ["model.n_layers=3", "model.d_ff=64"], "--set model.n_layers=3, model.d_ff=64: the model's shape comes "
                                                   "from "),
])
def test_a_set_that_changes_the_hf_models_shape_is_refused(tmp_path, config, sets, message):
    """config.json decides the model's shape: a --set of it (here moe_every, which would group the
    layers; n_layers and d_ff) is one error naming config.json's values; nothing is written."""
    write_hf(tmp_path / "hf", config)
    out = convert_cli("--from-hf", str(tmp_path / "hf"), "--run-dir", str(tmp_path / "run"),
                      *[a for s in sets for a in ("--set", s)])
    assert out.returncode == 2 and out.stderr.startswith(f"error: {message}{tmp_path / 'hf' / 'config.json'} ("), out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and not (tmp_path / "run").exists()


def half(path) -> bytes:
    """The first half of a file's bytes: an interrupted download."""
    data = path.read_bytes()
    return data[:len(data) // 2]


def misfiled(path) -> bytes:
    """The index with layer 0's input_layernorm.weight put in layer 1's file."""
    index = json.loads(path.read_text())
    index["weight_map"]["model.layers.0.input_layernorm.weight"] = "layer-1.safetensors"
    return json.dumps(index).encode()


@pytest.mark.parametrize("file,damage,message", [
    ("layer-0.safetensors", half, r"layer-0.safetensors is damaged or truncated \(.*incomplete metadata.*re-download"),
    ("rest.safetensors", lambda _: b"\xff" * 64, r"rest.safetensors is damaged or truncated \(.*header too large"),
    ("config.json", lambda _: b"{not json", r"config.json is not readable JSON \(Expecting property name"),
    ("config.json", lambda _: b"[1]", r"config.json holds a JSON list, not an object"),
    ("config.json", lambda _: json.dumps({k: v for k, v in TINY_HF.items()
                                          if k not in ("hidden_size", "num_attention_heads")}).encode(),
     r"^config.json lacks hidden_size, num_attention_heads: "),
    ("config.json", lambda _: json.dumps({"architectures": ["LlamaForCausalLM"]}).encode(),
     r"lacks vocab_size, hidden_size, intermediate_size, num_hidden_layers, num_attention_heads"),
    ("config.json", lambda _: json.dumps(TINY_HF | {"hidden_size": "64", "rms_norm_eps": None}).encode(),
     r"^config.json: hidden_size='64', rms_norm_eps=None: expected positive integers"),
    ("config.json", lambda _: json.dumps(TINY_HF | {"rope_scaling": "linear"}).encode(),
     r"^config.json: rope_scaling='linear' is not an object \{rope_type: ...\}"),
    ("model.safetensors.index.json", lambda _: b'{"metadata": {}}', r"index.json has no weight_map"),
    ("model.safetensors.index.json", misfiled,
     r"index.json puts model.layers.0.input_layernorm.weight in .*layer-1.safetensors, which lacks it"),
])
def test_damaged_hf_files_are_one_error_before_the_run_dir(tmp_path, file, damage, message):
    """A cut, garbled or incomplete HF file is one error naming it, raised before anything is
    written: the run directory is not created."""
    write_hf(tmp_path / "hf", TINY_HF)
    path = tmp_path / "hf" / file
    path.write_bytes(damage(path))
    with pytest.raises(ConfigError, match=message):
        convert.main(["--from-hf", str(tmp_path / "hf"), "--run-dir", str(tmp_path / "run")])
    assert not (tmp_path / "run").exists()


def test_to_hf_out_a_file_is_one_error(tmp_path):
    (tmp_path / "out").touch()
    with pytest.raises(ConfigError, match=r"--out .*out is a file: name a new \(or empty\) directory"):
        convert.main(["--to-hf", str(tmp_path), "--out", str(tmp_path / "out")])


@pytest.mark.parametrize("args, message", [
    (["--from-hf", "hf", "--run-dir", "run", "--out", "x"], "--out is for --to-hf (the HF directory to write)"),
    (["--to-hf", "run", "--out", "x", "--mesh", "fsdp=2", "--set", "train.lr=1"],
     "--mesh, --set with --to-hf: the run's saved config and checkpoint decide what is written; drop them"),
    (["--to-hf", "run", "--out", "x", "--run-dir", "r"], "--run-dir with --to-hf"),
])
def test_a_flag_of_the_other_direction_is_refused(tmp_path, args, message):
    """It would be ignored: refused before anything is read or written."""
    with pytest.raises(ConfigError, match=re.escape(message)):
        convert.main([str(tmp_path / a) if a in ("hf", "run", "x", "r") else a for a in args])
    assert not list(tmp_path.iterdir())


def test_to_hf_without_checkpoints_is_one_clear_line(tmp_path):
    out = convert_cli("--to-hf", str(tmp_path), "--out", str(tmp_path / "hf"))
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert out.returncode == 2 and len(errors) == 1 and "no checkpoint in" in errors[0], out.stderr
    assert "Traceback" not in out.stderr


# --- host memory -----------------------------------------------------------------------------

MEMORY = textwrap.dedent("""
    import json, sys
    import jax
    from tools import convert, sliced_checkpoint  # noqa: F401 -- every import before the baseline
    jax.devices()

    def status(field):
        line = next(l for l in open("/proc/self/status") if l.startswith(field))
        return int(line.split()[1]) * 1024

    base = status("VmRSS:")
    code = convert.main(sys.argv[1:])
    print(json.dumps({"base": base, "peak": status("VmHWM:"), "code": code}))
""")


@pytest.mark.slow
def test_host_memory_stays_near_one_layer(tmp_path):
    """The 1b preset's widths with 4 layers, bf16 files (0.75 GB) on one device: converting it
    (parameters kept in bf16, so that the state written stays small and one layer's tensors are
    the same bytes in the files and in the checkpoint: 116 MiB) raises the peak RSS by less than
    twice one layer's tensors, not by the checkpoint's size (0.75 GB of parameters, 2.25 GB of
    state). What it holds is about three slices of at most the largest layer tensor (w_gate,
    32 MiB): the HF tensor read (its mapped pages and copies) and tensorstore's copy of the slice
    being written (tools/sliced_checkpoint.py)."""
    d, f, n, k, x = 2048, 8192, 32 * 64, 8 * 64, 4
    config = TINY_HF | {"vocab_size": 32768, "hidden_size": d, "intermediate_size": f, "num_hidden_layers": x,
                        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64}
    write_hf(tmp_path / "hf", config, dtype=ml_dtypes.bfloat16)
    files = sum(p.stat().st_size for p in (tmp_path / "hf").glob("*.safetensors"))
    layer = (d * n + 2 * d * k + n * d + 3 * d * f + 2 * d) * 2  # one layer's tensors, bf16
    script = tmp_path / "measure.py"
    script.write_text(MEMORY)
    env = child_env()
    out = subprocess.run([sys.executable, str(script), "--from-hf", str(tmp_path / "hf"), "--run-dir",
                          str(tmp_path / "run"), "--set", "model.param_dtype=bfloat16"],
                         cwd=ROOT, env=env | {"PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    rss = json.loads(out.stdout.splitlines()[-1])
    grew = rss["peak"] - rss["base"]
    print(f"files {files / 2**20:.0f} MiB, one layer {layer / 2**20:.0f} MiB, peak RSS grew {grew / 2**20:.0f} MiB")
    assert files > 700 * 2**20 and grew < 2 * layer
