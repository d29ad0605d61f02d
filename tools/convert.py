"""Hugging Face Llama weights in and out of meshtrain runs (names and layouts: tools/hf_llama.py).

  python -m tools.convert --from-hf DIR --run-dir RUN [--mesh fsdp=8] [--config llama3-8b] [--set ...]
  python train.py --run-dir RUN                        fine-tune it
  python -m tools.convert --to-hf RUN --out DIR        its latest checkpoint as HF safetensors

--from-hf reads DIR/config.json and DIR's safetensors (model.safetensors, or the shards named by
model.safetensors.index.json; q/k/v and gate/up split or fused, tools/hf_llama.py) and writes
RUN/config.json and a step-0 checkpoint RUN/checkpoints/0 that `train.py --run-dir RUN` resumes:
the converted parameters (float32), fresh AdamW moments (zeros) and step 0. The run's config is
--config's preset (default tiny) with the model's shape from config.json and fine-tuning's
optimizer defaults (FINE_TUNE), then --set; its data is the preset's unless --set data.* names
the model's own tokens.

Memory (host): the checkpoint is written a slice at a time (tools/sliced_checkpoint.py): every
array of the state cut along its first axis into slices of at most the largest layer tensor's
bytes U (a stacked parameter or moment one layer at a time, embed and head blocks of rows),
each slice read from the safetensors files (at most READ_ELEMENTS of a tensor's rows per file
opening, so that no mapping keeps a whole tensor's pages), written as one zarr chunk and dropped.
The peak is about three slices, 3U (the slice, its copies while read and cast, tensorstore's
copy), whatever the mesh: no jax array is made. Measured (tests/test_convert.py): 1b widths,
4 layers, bf16 (U = w_gate's 32 MiB, one layer's tensors 116 MiB): the peak RSS grew by 99 MiB.
Computed by that law, not measured, in fp32: llama3-8b (U = 224 MiB) about 0.7 GiB,
llama3-70b (U = 896 MiB) about 2.6 GiB.

--to-hf restores the latest checkpoint's parameters one at a time as numpy (checked against the
checkpoint's checksums), writes them as HF tensors in the parameter dtype, whole parameters per
file, at most SHARD_BYTES per file unless one is larger, with model.safetensors.index.json and a
config.json that transformers loads (untied head; q/k/v and gate/up split, as LlamaForCausalLM
names them, whatever layout the run came from). Peak: one file's tensors plus one stacked
parameter as restored.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from pathlib import Path
from typing import Callable

import ml_dtypes  # noqa: F401 -- registers bfloat16 with numpy, which safetensors' numpy reader needs
import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from cli import add_run_args, check_run_dir, make_run_dir, request_fake_devices, run_cli, run_config
from configs import ConfigError, RunConfig, get_preset
from tools.hf_llama import TENSORS, Tensor, fused_names, hf_config, hf_names, hf_shape, model_config, tensor_of

SHARD_BYTES = 2 * 2**30
READ_ELEMENTS = 2**22  # of an HF tensor's rows per file opening (16 MiB in fp32)
FINE_TUNE = {"lr": 2e-5, "warmup_steps": 10, "weight_decay": 0.0}  # train.* of a converted run
IGNORED = ("rotary_emb.inv_freq",)  # buffers some checkpoints carry, recomputed by the model
ParamPath = tuple[str, ...]  # a parameter's path below `params`


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    way = p.add_mutually_exclusive_group(required=True)
    way.add_argument("--from-hf", type=Path, metavar="DIR", help="a HF Llama directory: config.json + *.safetensors")
    way.add_argument("--to-hf", type=Path, metavar="RUN", help="a meshtrain run directory with checkpoints")
    p.add_argument("--run-dir", type=Path, help="with --from-hf: the new run directory")
    p.add_argument("--out", type=Path, help="with --to-hf: the HF directory to write")
    add_run_args(p)
    return p.parse_args(argv)


# --- HF files --------------------------------------------------------------------------------

class Safetensors:
    """The tensors of a HF directory: name -> file, shapes from the headers, slices on demand; a
    split name that `unfuse` mapped to a row range of a fused tensor reads those rows."""

    def __init__(self, directory: Path):
        self.parts: dict[str, tuple[str, int, int]] = {}  # split name -> (fused name, first row, rows)
        index = directory / "model.safetensors.index.json"
        if index.exists():
            names = read_json(index).get("weight_map")
            if not isinstance(names, dict) or not all(isinstance(file, str) for file in names.values()):
                raise ConfigError(f"--from-hf: {index} has no weight_map {{tensor: file}}; re-download it")
            self.files = {name: directory / file for name, file in names.items()}
        else:
            self.files = {name: f for f in sorted(directory.glob("*.safetensors")) for name in self._keys(f)}
        if not self.files:
            raise ConfigError(f"--from-hf {directory}: no *.safetensors files (nor model.safetensors.index.json)")
        missing = sorted({str(f) for f in self.files.values() if not f.exists()})
        if missing:
            raise ConfigError(f"--from-hf {directory}: the index names missing files: {', '.join(missing)}")

    def _keys(self, file: Path) -> list[str]:
        with open_safetensors(file) as f:
            return list(f.keys())

    def unfuse(self, fused: str, parts: dict[str, int]) -> None:
        """Read the split tensors `parts` (name -> rows, in row order) from `fused`'s row blocks."""
        first = 0
        for name, rows in parts.items():
            self.parts[name] = (fused, first, rows)
            first += rows

    def shape(self, name: str) -> tuple[int, ...]:
        if name in self.parts:
            fused, _, rows = self.parts[name]
            return (rows, *self.shape(fused)[1:])
        with open_safetensors(self.files[name]) as f:
            if name not in f.keys():
                raise ConfigError(f"--from-hf: model.safetensors.index.json puts {name} in {self.files[name]}, "
                                  "which lacks it; re-download the model")
            return tuple(f.get_slice(name).get_shape())

    def read(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
        """tensor[index], READ_ELEMENTS of its rows per file opening: the file's pages that a read
        touches stay resident while it is mapped, and a column slice touches all its rows' pages."""
        if name in self.parts:  # a row range of a fused tensor: only those rows are read
            fused, first, rows = self.parts[name]
            start, stop, _ = index[0].indices(rows)
            return self.read(fused, (slice(first + start, first + stop), *index[1:]))
        shape = self.shape(name)
        rows = range(*index[0].indices(shape[0]))
        step = max(1, READ_ELEMENTS // max(1, math.prod(shape[1:])))
        out = None
        for r in range(rows.start, rows.stop, step):
            with open_safetensors(self.files[name]) as f:
                part = f.get_slice(name)[(slice(r, min(r + step, rows.stop)), *index[1:])]
            out = np.empty((len(rows), *part.shape[1:]), part.dtype) if out is None else out
            out[r - rows.start:r - rows.start + len(part)] = part
        return out


def open_safetensors(file: Path) -> safe_open:
    """safe_open(file) for numpy; a file it cannot read (an interrupted download: a header
    larger than the file, or no header at all) is a ConfigError naming it."""
    try:
        return safe_open(file, framework="numpy")
    except (SafetensorError, OSError) as e:
        raise ConfigError(f"--from-hf: {file} is damaged or truncated ({e}); re-download it") from None


def read_json(path: Path) -> dict:
    """The JSON object in `path` (a HF file); else a ConfigError naming it."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:  # ValueError: not JSON, or not text
        raise ConfigError(f"--from-hf: {path} is not readable JSON ({e}); re-download it") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--from-hf: {path} holds a JSON {type(data).__name__}, not an object; re-download it")
    return data


def check_tensors(st: Safetensors, cfg: RunConfig, tied: bool) -> None:
    """Every expected tensor present (split, or a row block of its fused tensor) with its shape,
    nothing unknown; else one error naming them. Maps the split names onto the fused tensors."""
    shapes = per_layer_shapes(cfg)
    expected = {name: hf_shape(tensor_of(path, tied), shape)
                for path, shape in shapes.items() for name in hf_names(path, cfg.model.n_layers, tied)}
    both, wrong, fused = [], [], set()  # fused: the fused names and their parts, checked here
    for name, parts in fused_names(cfg.model.n_layers).items():
        if name not in st.files:
            continue
        fused |= {name, *parts}
        want = (sum(expected[p][0] for p in parts), *expected[parts[0]][1:])
        if split := [p for p in parts if p in st.files]:
            both.append(f"{name} and {', '.join(split)}")
        elif st.shape(name) != want:
            wrong.append(f"{name} {list(st.shape(name))} (expected {list(want)})")
        else:
            st.unfuse(name, {p: expected[p][0] for p in parts})
    missing = [n for n in expected if n not in st.files and n not in fused]
    wrong += [f"{n} {list(st.shape(n))} (expected {list(s)})" for n, s in expected.items()
              if n in st.files and n not in fused and st.shape(n) != s]
    unknown = [n for n in st.files if n not in expected and n not in fused and not n.endswith(IGNORED)
               and not (tied and n == "lm_head.weight")]
    problems = [f"{what}: {', '.join(names[:4])}{' ...' if len(names) > 4 else ''}"
                for what, names in (("both fused and split tensors", both), ("missing tensors", missing),
                                    ("mismatched shapes", wrong),
                                    ("tensors with no meshtrain parameter", unknown)) if names]
    if problems:
        raise ConfigError(f"--from-hf: not the Llama config.json describes: {'; '.join(problems)}")


def per_layer_shapes(cfg: RunConfig) -> dict[ParamPath, tuple[int, ...]]:
    m = cfg.model
    d, n, k, h, f, v = m.d_model, m.n_heads, m.n_kv_heads, m.head_dim, m.d_ff, m.vocab_size
    return {
        ("embed", "table"): (v, d), ("blocks", "attn_norm", "scale"): (d,), ("blocks", "attn", "wq"): (d, n, h),
        ("blocks", "attn", "wk"): (d, k, h), ("blocks", "attn", "wv"): (d, k, h), ("blocks", "attn", "wo"): (n, h, d),
        ("blocks", "mlp_norm", "scale"): (d,), ("blocks", "mlp", "w_gate"): (d, f), ("blocks", "mlp", "w_up"): (d, f),
        ("blocks", "mlp", "w_down"): (f, d), ("final_norm", "scale"): (d,), ("head",): (d, v),
    }


def _cover(index: tuple[slice, ...], dims: tuple[int, ...]) -> tuple[slice, tuple[int, ...], tuple[slice, ...]]:
    """The flat range covering `index` over row-major `dims` (its first dim's rows, whole in the
    others), the covered block's shape, and the slices that cut `index` out of that block."""
    start, stop, _ = index[0].indices(dims[0])
    rest = math.prod(dims[1:])
    return slice(start * rest, stop * rest), (stop - start, *dims[1:]), (slice(None), *index[1:])


def read_layer(st: Safetensors, t: Tensor, name: str, shape: tuple[int, ...], index: tuple[slice, ...]) -> np.ndarray:
    """meshtrain's per-layer array [shape][index], read from HF tensor `name` (only that slice)."""
    if len(shape) == 1:
        return st.read(name, index)
    r = t.row_dims
    rows, row_block, row_cut = _cover(index[:r], shape[:r])
    cols, col_block, col_cut = _cover(index[r:], shape[r:])
    block = st.read(name, (cols, rows)).T if t.transposed else st.read(name, (rows, cols))
    return block.reshape(row_block + col_block)[row_cut + col_cut]


def shard_reader(st: Safetensors, path: ParamPath, cfg: RunConfig, tied: bool, dtype: np.dtype) -> Callable:
    """Parameter `path`'s reader: index -> that block of the stacked array, filled layer by
    layer (one layer's slice, and its transposed copy, beside the block)."""
    t, shape = tensor_of(path, tied), per_layer_shapes(cfg)[path]
    names = hf_names(path, cfg.model.n_layers, tied)
    if path[0] != "blocks":
        return lambda index: read_layer(st, t, names[0], shape, index).astype(dtype, copy=False)

    def read(index: tuple[slice, ...]) -> np.ndarray:
        layers = range(*index[0].indices(len(names)))
        out = np.empty((len(layers), *(len(range(*s.indices(n))) for s, n in zip(index[1:], shape))), dtype)
        for j, i in enumerate(layers):
            out[j] = read_layer(st, t, names[i], shape, index[1:])
        return out

    return read


# --- from HF ---------------------------------------------------------------------------------

def from_hf_config(args: argparse.Namespace) -> tuple[RunConfig, dict]:
    """The run's config (checked) and the HF config.json."""
    path = args.from_hf / "config.json"
    if not path.exists():
        raise ConfigError(f"--from-hf {args.from_hf}: no config.json there; give a HF model directory")
    hf = read_json(path)
    base = get_preset(args.config or "tiny")
    base = dataclasses.replace(base, name=f"hf-{args.from_hf.resolve().name}", model=model_config(hf, base.model),
                               train=dataclasses.replace(base.train, **FINE_TUNE))
    return run_config(args, base=base), hf


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
    readers = {path: shard_reader(st, path, cfg, tied, np.dtype(cfg.model.param_dtype)) for path in TENSORS}
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

    cfg, params = latest_params(args.to_hf / "checkpoints")
    if cfg.model.n_experts:
        raise ConfigError(f"--to-hf {args.to_hf}: a mixture-of-experts run has no Llama equivalent")
    shapes = per_layer_shapes(cfg)
    plan = shard_plan(cfg)
    try:
        args.out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"--out {args.out}: cannot create it ({e.strerror}); choose another --out") from None
    weight_map, total = {}, 0
    for file, paths in plan.items():
        tensors = {}
        for path in paths:
            stacked = params(path)
            layers = stacked if path[0] == "blocks" else stacked[None]
            for name, layer in zip(hf_names(path, cfg.model.n_layers), layers):
                tensors[name] = hf_layer(TENSORS[path], layer, shapes[path])
        save_file(tensors, args.out / file, metadata={"format": "pt"})
        weight_map |= dict.fromkeys(tensors, file)
        total += sum(x.nbytes for x in tensors.values())
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


def shard_plan(cfg: RunConfig) -> dict[str, list[ParamPath]]:
    """File name -> the parameters it holds, whole parameters in order, at most SHARD_BYTES per
    file unless one parameter is larger."""
    itemsize = np.dtype(cfg.model.param_dtype).itemsize
    groups: list[list[ParamPath]] = [[]]
    size = 0
    for path, shape in per_layer_shapes(cfg).items():
        nbytes = math.prod(shape) * itemsize * (cfg.model.n_layers if path[0] == "blocks" else 1)
        if groups[-1] and size + nbytes > SHARD_BYTES:
            groups.append([])
            size = 0
        groups[-1].append(path)
        size += nbytes
    n = len(groups)
    return {f"model-{i + 1:05d}-of-{n:05d}.safetensors": g for i, g in enumerate(groups)}


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    return from_hf(args) if args.from_hf else to_hf(args)


if __name__ == "__main__":
    run_cli(main)
