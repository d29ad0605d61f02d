"""Reading a Hugging Face Llama directory for tools/convert.py --from-hf: its safetensors
(one file, or the shards an index names; q/k/v and gate/up split or fused), checked against the
model config.json describes, read a slice at a time.

Layout: each meshtrain parameter (tools/hf_llama.py TENSORS) is one HF tensor per layer, maybe
transposed, maybe a row block of a fused tensor; `shard_reader` gives the stacked parameter's
reader, index -> that block, filled layer by layer. Memory: a read maps at most READ_ELEMENTS of
a tensor's rows per file opening (the pages a read touches stay resident while mapped), so a
slice costs its own bytes and its transposed copy, never a whole tensor.

Damaged files (a truncated download, an index naming missing files, JSON that is not an object)
are one ConfigError naming the file and the fix.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Callable

import ml_dtypes  # noqa: F401 -- registers bfloat16 with numpy, which safetensors' numpy reader needs
import numpy as np
from safetensors import SafetensorError, safe_open

from configs import ConfigError, RunConfig
from sharding.checks import expert_d_ff
from tools.hf_llama import Tensor, fused_names, hf_names, hf_shape, per_expert, tensor_of

READ_ELEMENTS = 2**22  # of an HF tensor's rows per file opening (16 MiB in fp32)
IGNORED = ("rotary_emb.inv_freq",)  # buffers some checkpoints carry, recomputed by the model
FLOATS = ("F64", "F32", "F16", "BF16")  # the safetensors dtypes read as they are (a quantized one needs its scales)
ParamPath = tuple[str, ...]  # a parameter's path below `params`


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

    def dtype(self, name: str) -> str:
        """The tensor's safetensors dtype ('BF16', 'F8_E4M3', ...)."""
        name = self.parts[name][0] if name in self.parts else name
        with open_safetensors(self.files[name]) as f:
            return f.get_slice(name).get_dtype()

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
    m, shapes = cfg.model, per_layer_shapes(cfg)
    expected = {name: hf_shape(tensor_of(path, m, tied), shape)
                for path, shape in shapes.items() for name in hf_names(path, m, tied)}
    both, wrong, fused = [], [], set()  # fused: the fused names and their parts, checked here
    for name, parts in fused_names(m).items():
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
    dtypes = {n: st.dtype(n) for n in st.files if n not in unknown}
    quantized = [f"{n} {dtype}" for n, dtype in dtypes.items() if dtype not in FLOATS]
    problems = [f"{what}: {', '.join(names[:4])}{' ...' if len(names) > 4 else ''}"
                for what, names in (("both fused and split tensors", both), ("missing tensors", missing),
                                    ("mismatched shapes", wrong),
                                    ("tensors with no meshtrain parameter", unknown),
                                    (f"dtypes other than {', '.join(FLOATS)} (a quantized checkpoint: convert "
                                     "the unquantized one)", quantized)) if names]
    if problems:
        raise ConfigError(f"--from-hf: not the {'Mixtral' if m.n_experts else 'Llama'} config.json describes: "
                          f"{'; '.join(problems)}")


def per_layer_shapes(cfg: RunConfig) -> dict[ParamPath, tuple[int, ...]]:
    """Each parameter's shape per HF tensor: per layer, and per expert for Mixtral's experts."""
    m = cfg.model
    d, n, k, h, f, v = m.d_model, m.n_heads, m.n_kv_heads, m.head_dim, m.d_ff, m.vocab_size
    mlp = ({("blocks", "mlp", "router"): (d, m.n_experts), ("blocks", "mlp", "w_gate"): (d, expert_d_ff(m)),
            ("blocks", "mlp", "w_up"): (d, expert_d_ff(m)), ("blocks", "mlp", "w_down"): (expert_d_ff(m), d)}
           if m.n_experts else
           {("blocks", "mlp", "w_gate"): (d, f), ("blocks", "mlp", "w_up"): (d, f), ("blocks", "mlp", "w_down"): (f, d)})
    return {
        ("embed", "table"): (v, d), ("blocks", "attn_norm", "scale"): (d,), ("blocks", "attn", "wq"): (d, n, h),
        ("blocks", "attn", "wk"): (d, k, h), ("blocks", "attn", "wv"): (d, k, h), ("blocks", "attn", "wo"): (n, h, d),
        ("blocks", "mlp_norm", "scale"): (d,), **mlp, ("final_norm", "scale"): (d,), ("head",): (d, v),
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
    """Parameter `path`'s reader: index -> that block of the stacked array [X(, E), ...], filled
    one HF tensor at a time (a layer's, or a layer's expert's, slice and its transposed copy
    beside the block)."""
    m = cfg.model
    t, shape = tensor_of(path, m, tied), per_layer_shapes(cfg)[path]
    names = hf_names(path, m, tied)
    if path[0] != "blocks":
        return lambda index: read_layer(st, t, names[0], shape, index).astype(dtype, copy=False)
    stacked = (m.n_layers, m.n_experts) if per_expert(t) else (m.n_layers,)  # names: row-major over these

    def read(index: tuple[slice, ...]) -> np.ndarray:
        units = [range(*s.indices(n)) for s, n in zip(index, stacked)]  # the layers (and experts) asked for
        inner = index[len(stacked):]
        out = np.empty((*map(len, units), *(len(range(*s.indices(n))) for s, n in zip(inner, shape))), dtype)
        for at in np.ndindex(*out.shape[:len(stacked)]):
            flat = np.ravel_multi_index(tuple(r[j] for r, j in zip(units, at)), stacked)  # hf_names' order
            out[at] = read_layer(st, t, names[flat], shape, inner)
        return out

    return read
