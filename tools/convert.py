"""Hugging Face Llama and Mixtral weights in and out of meshtrain runs (names and layouts:
tools/hf_llama.py).

  python -m tools.convert --from-hf DIR --run-dir RUN [--mesh fsdp=8] [--config llama3-8b] [--set ...]
  python train.py --run-dir RUN                        fine-tune it
  python -m tools.convert --to-hf RUN --out DIR        its latest checkpoint as HF safetensors

--from-hf reads DIR/config.json and DIR's safetensors (model.safetensors, or the shards named by
model.safetensors.index.json; q/k/v and gate/up split or fused; Mixtral's experts one tensor per
layer and expert, tools/hf_llama.py) and writes RUN/config.json and a step-0 checkpoint
RUN/checkpoints/0 that `train.py --run-dir RUN` resumes: the converted parameters (float32),
fresh AdamW moments (zeros) and step 0. The run's config is --config's preset (default tiny)
with the model's shape from config.json and fine-tuning's optimizer defaults (FINE_TUNE), then
--set; its data is the preset's unless --set data.* names the model's own tokens.

Memory (host): the checkpoint is written a slice at a time (tools/sliced_checkpoint.py): every
array of the state cut along its first axis into slices of at most the largest layer tensor's
bytes U (a stacked parameter or moment one layer at a time, embed and head blocks of rows),
each slice read from the safetensors files (tools/hf_files.py: at most READ_ELEMENTS of a
tensor's rows per file opening, so that no mapping keeps a whole tensor's pages), written as one
zarr chunk and dropped. The peak is about three slices, 3U (the slice, its copies while read and
cast, tensorstore's copy), whatever the mesh: no jax array is made. Measured
(tests/test_convert.py): 1b widths, 4 layers, bf16 (U = w_gate's 32 MiB, one layer's tensors
116 MiB): the peak RSS grew by 99 MiB. Computed by that law, not measured, in fp32: llama3-8b
(U = 224 MiB) about 0.7 GiB, llama3-70b (U = 896 MiB) about 2.6 GiB, Mixtral 8x7B (U = one
layer's 8 experts' w1, 1.75 GiB) about 5.3 GiB.

--to-hf restores the latest checkpoint's parameters one at a time as numpy (checked against the
checkpoint's checksums), writes them as HF tensors in the parameter dtype, whole parameters per
file, at most SHARD_BYTES per file unless one is larger, with model.safetensors.index.json and a
config.json that transformers loads (untied head; q/k/v and gate/up split, as LlamaForCausalLM
names them, whatever layout the run came from; a MoE run as MixtralForCausalLM). Peak: one
file's tensors plus one stacked parameter as restored.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from cli import add_run_args, check_run_dir, make_run_dir, request_fake_devices, run_cli, run_config, run_dir_path
from configs import ConfigError, RunConfig, get_preset
from configs.parser import Parser
from sharding.mesh import check_backend
from tools.hf_files import ParamPath, Safetensors, check_tensors, per_layer_shapes, read_json, shard_reader
from tools.hf_llama import Tensor, hf_config, hf_names, model_config, tensors

SHARD_BYTES = 2 * 2**30
FINE_TUNE = {"lr": 2e-5, "warmup_steps": 10, "weight_decay": 0.0}  # train.* of a converted run
# model.* that config.json decides (tools/hf_llama.model_config): a --set may not change them
FROM_CONFIG = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "d_ff", "rope_theta",
               "norm_eps", "n_experts", "experts_per_token", "moe_every", "n_shared_experts", "expert_d_ff")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = Parser(__doc__)
    way = p.add_mutually_exclusive_group(required=True)
    way.add_argument("--from-hf", type=Path, metavar="DIR",
                     help="a HF Llama or Mixtral directory: config.json + *.safetensors")
    way.add_argument("--to-hf", type=Path, metavar="RUN", help="a meshtrain run directory with checkpoints")
    p.add_argument("--run-dir", type=run_dir_path, help="with --from-hf: the new run directory")
    p.add_argument("--out", type=Path, help="with --to-hf: the HF directory to write")
    add_run_args(p)
    return p.parse_args(argv)


# --- from HF ---------------------------------------------------------------------------------

def from_hf_config(args: argparse.Namespace) -> tuple[RunConfig, dict]:
    """The run's config (checked) and the HF config.json."""
    path = args.from_hf / "config.json"
    if not path.exists():
        raise ConfigError(f"--from-hf {args.from_hf}: no config.json there; give a HF model directory")
    hf = read_json(path)
    base = get_preset(args.config or "tiny")
    model = model_config(hf, base.model)
    base = dataclasses.replace(base, name=f"hf-{args.from_hf.resolve().name}", model=model,
                               train=dataclasses.replace(base.train, **FINE_TUNE))
    cfg = run_config(args, base=base)
    changed = [f for f in FROM_CONFIG if getattr(cfg.model, f) != getattr(model, f)]
    if changed:
        given = ", ".join(f"model.{f}={getattr(cfg.model, f)!r}" for f in changed)
        raise ConfigError(f"--set {given}: the model's shape comes from {path} "
                          f"({', '.join(f'{f}={getattr(model, f)!r}' for f in changed)}); drop the --set "
                          "(train-time fields such as model.remat or model.moe_dispatch may change)")
    return cfg, hf


def from_hf(args: argparse.Namespace) -> int:
    if not args.run_dir:
        raise ConfigError("--from-hf needs --run-dir RUN: the new run directory to write")
    cfg, hf = from_hf_config(args)
    check_run_dir(args.run_dir)
    if (args.run_dir / "checkpoints").exists():
        raise ConfigError(f"--run-dir {args.run_dir} already holds checkpoints: choose a new run directory")
    tied = bool(hf.get("tie_word_embeddings", False))
    st = Safetensors(args.from_hf)
    check_tensors(st, cfg, tied)
    request_fake_devices(cfg)

    from sharding.mesh import build_mesh, mesh_config
    from tools.sliced_checkpoint import write_state
    from training.build import make_program

    mesh = build_mesh(cfg.parallel)
    cfg = dataclasses.replace(cfg, parallel=mesh_config(mesh, cfg.parallel))
    program = make_program(cfg, mesh)
    make_run_dir(args.run_dir)
    readers = {path: shard_reader(st, path, cfg, tied, np.dtype(cfg.model.param_dtype)) for path in tensors(cfg.model)}
    write_state(args.run_dir / "checkpoints", cfg, program, readers)
    (args.run_dir / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
    print(f"wrote {args.run_dir}/checkpoints/0 ({cfg.model.n_layers} layers, {len(st.files)} HF tensors, "
          f"tied head: {tied}); train.py --run-dir {args.run_dir} fine-tunes it from step 0 with fresh AdamW "
          f"moments (train.lr={cfg.train.lr}, warmup {cfg.train.warmup_steps}, weight_decay {cfg.train.weight_decay})")
    return 0


# --- to HF -----------------------------------------------------------------------------------

def to_hf(args: argparse.Namespace) -> int:
    if not args.out:
        raise ConfigError("--to-hf needs --out DIR: the HF directory to write")
    if args.out.exists() and not args.out.is_dir():
        raise ConfigError(f"--out {args.out} is a file: name a new (or empty) directory for the HF files")
    if args.out.exists() and any(args.out.iterdir()):
        raise ConfigError(f"--out {args.out} is not empty: choose a new directory")
    from tools.sliced_checkpoint import latest_params

    check_backend()
    cfg, params = latest_params(args.to_hf / "checkpoints")
    m = cfg.model
    if m.n_experts and (m.moe_every > 1 or m.n_shared_experts):
        raise ConfigError(f"--to-hf {args.to_hf}: model.moe_every={m.moe_every}, model.n_shared_experts="
                          f"{m.n_shared_experts}: no Mixtral equivalent (every layer a mixture of experts, none "
                          "shared); only a run trained with model.moe_every=1 and model.n_shared_experts=0 converts")
    shapes, known = per_layer_shapes(cfg), tensors(m)
    plan = shard_plan(cfg)
    try:
        args.out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"--out {args.out}: cannot create it ({e.strerror}); choose another --out") from None
    weight_map, total, mode = {}, 0, _new_file_mode()
    for file, paths in plan.items():
        written = {}
        for path in paths:
            units = params(path).reshape(-1, *shapes[path])  # [X(·E), ...]: one row per HF tensor, hf_names' order
            for name, unit in zip(hf_names(path, m), units, strict=True):
                written[name] = hf_layer(known[path], unit, shapes[path])
        save_file(written, args.out / file, metadata={"format": "pt"})
        (args.out / file).chmod(mode)  # safetensors writes 0600 whatever the umask
        weight_map |= dict.fromkeys(written, file)
        total += sum(x.nbytes for x in written.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (args.out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (args.out / "config.json").write_text(json.dumps(hf_config(cfg.model, cfg.train.seq_len), indent=2) + "\n")
    print(f"wrote {args.out}: {len(weight_map)} tensors in {len(plan)} file(s), {total / 2**30:.2f} GiB "
          f"({cfg.model.param_dtype})")
    return 0


def hf_layer(t: Tensor, layer: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """One layer's meshtrain array -> its HF tensor (contiguous)."""
    if len(shape) == 1:
        return np.ascontiguousarray(layer)
    flat = layer.reshape(math.prod(shape[:t.row_dims]), -1)
    return np.ascontiguousarray(flat.T if t.transposed else flat)


def _new_file_mode() -> int:
    """The mode `open` gives a new file here: 0666 less the process's umask (read by setting it)."""
    umask = os.umask(0o022)
    os.umask(umask)
    return 0o666 & ~umask


def shard_plan(cfg: RunConfig) -> dict[str, list[ParamPath]]:
    """File name -> the parameters it holds, whole parameters in order, at most SHARD_BYTES per
    file unless one parameter is larger."""
    itemsize = np.dtype(cfg.model.param_dtype).itemsize
    groups: list[list[ParamPath]] = [[]]
    size = 0
    for path, shape in per_layer_shapes(cfg).items():
        nbytes = math.prod(shape) * itemsize * len(hf_names(path, cfg.model))
        if groups[-1] and size + nbytes > SHARD_BYTES:
            groups.append([])
            size = 0
        groups[-1].append(path)
        size += nbytes
    n = len(groups)
    return {f"model-{i + 1:05d}-of-{n:05d}.safetensors": g for i, g in enumerate(groups)}


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    check_flags(args)
    return from_hf(args) if args.from_hf else to_hf(args)


def check_flags(args: argparse.Namespace) -> None:
    """A flag of the other direction would be silently ignored: refused, naming it."""
    if args.from_hf and args.out:
        raise ConfigError("--out is for --to-hf (the HF directory to write); --from-hf writes --run-dir: drop --out")
    if args.to_hf:
        ignored = [f for f, given in (("--run-dir", args.run_dir), ("--config", args.config), ("--mesh", args.mesh),
                                      ("--set", args.set)) if given]
        if ignored:
            raise ConfigError(f"{', '.join(ignored)} with --to-hf: the run's saved config and checkpoint decide "
                              "what is written; drop them")


if __name__ == "__main__":
    run_cli(main)
