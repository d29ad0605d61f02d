"""A step-0 checkpoint written a slice at a time, and a checkpoint's parameters read one at a time.

training/checkpoint.py saves a whole TrainState at once (orbax StandardSave), which holds all of
it in memory, and even one array at a time would hold a whole stacked parameter [X, ...] (and
orbax's copy of it). So `write_state` writes the arrays itself, with tensorstore, in orbax's
format, a slice at a time, and no jax array is made (the mesh plays no part: restore reshards):

  unit    the bytes of the largest layer tensor (the largest [1:] of any array of the state)
  slice   each array is cut along its first axis into slices of at most `unit` bytes (at least
          one row): a stacked parameter or moment one layer at a time (or several small layers),
          embed and head a block of rows; scalars whole
  array   opened with the tensorstore spec orbax builds for a save (tensorstore_utils.
          ArrayWriteSpec: zarr3, one chunk per write shape sharded with `sharding_indexed`,
          bytes + zstd, in an OCDBT key-value store at state/), with the slice as write shape,
          so that each slice is one whole chunk: a write needs no read of the rest
  values  parameters from their readers (the HF files), moments, counts and step zeros; each
          slice written and its write committed before the next is read
  sums    training.checkpoint.checksums' value per array, summed over the slices on the host
          (block_checksum, in chunks), into meta's checksums
  _METADATA  the tree metadata a StandardSave of the TrainState writes (keys with their kinds,
          empty nodes, value_type jax.Array with the write shape) and orbax's format flags
          (use_ocdbt, use_zarr3, store_array_data_equal_to_fill_value)

So the host holds about three slices (the one read, its copies, tensorstore's), not one stacked
array. What it relies on in orbax's format (0.12.8): a pytree directory is an OCDBT store at its
root (manifest.ocdbt; per-process ocdbt.process_* stores are only a multi-process save's, merged
at its end) holding one zarr3 array per leaf under the leaf's dotted keys, plus _METADATA; the
restore reads the zarr metadata, not orbax's chunk choice, and needs neither `_sharding` (the
targets carry their shardings) nor `array_metadatas/`. Every chunk is written (orbax's restore
treats a missing chunk as an error, not as the fill value). The Checkpointer restores it unchanged:
same layout RUN/checkpoints/<step>/{state,meta,config}, same checksums in meta.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Callable

import jax
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts
from orbax.checkpoint._src.serialization import tensorstore_utils as ts_utils

from configs import ConfigError, RunConfig
from training.build import Program


def _key(k) -> str:
    return str(getattr(k, "name", getattr(k, "key", getattr(k, "idx", k))))


def _nest(keys: tuple[str, ...], leaf) -> dict:
    for k in reversed(keys):
        leaf = {k: leaf}
    return leaf


def _empty(x) -> bool:
    """An empty node (None, optax's EmptyState): orbax records it as a leaf of its own."""
    tree = jax.tree_util.tree_structure(x)
    return tree.num_nodes == 1 and tree.num_leaves == 0


def write_state(directory: Path, cfg: RunConfig, program: Program,
                readers: dict[tuple[str, ...], Callable[[tuple[slice, ...]], np.ndarray]]) -> None:
    """RUN/checkpoints/0: parameters from `readers` (path below params -> callback reading any
    block index), every other array of the TrainState zero (fresh AdamW moments and counts,
    step 0); each array a slice at a time (see the module docstring)."""
    directory = directory.absolute()  # orbax takes absolute paths only
    work = directory.with_name(directory.name + ".converting")
    shutil.rmtree(work, ignore_errors=True)
    state_dir = work / "state"
    state_dir.mkdir(parents=True)
    specs = jax.tree_util.tree_leaves_with_path(program.state)
    unit = max(math.prod(s.shape[1:]) * s.dtype.itemsize for _, s in specs)  # the largest layer tensor
    context = ts_utils.get_ts_context(use_ocdbt=True)
    sums, tree = {}, {}
    for path, spec in specs:
        keys = tuple(map(_key, path))
        name, dtype = ".".join(keys), np.dtype(spec.dtype)
        chunk, slices = _slices(spec.shape, unit // dtype.itemsize)
        write = ts_utils.ArrayWriteSpec(str(state_dir), name, global_shape=spec.shape, write_shape=chunk,
                                        dtype=dtype, use_zarr3=True, use_ocdbt=True)
        array = ts.open(write.json, create=True, context=context).result()
        total = 0
        for index in slices:
            if keys[0] == "params":
                block = np.asarray(readers[keys[1:-1]](index), dtype)
                total += block_checksum(block, tuple(s.indices(n)[0] for s, n in zip(index, spec.shape)), spec.shape)
            else:  # zeros, whose checksum is 0
                block = np.zeros(array[index].shape, dtype)
            array[index].write(block).result()
            del block
        sums[jax.tree_util.keystr(path)] = total % 2**32
        tree[name] = {"value_type": "jax.Array", "skip_deserialize": False, "write_shape": list(chunk)}
    _write_tree_metadata(state_dir / "_METADATA", program.state, tree)
    meta = {"step": 0, "data_position": 0, "data_seed": cfg.data.seed, "init_seed": cfg.train.seed, "checksums": sums}
    manager = ocp.CheckpointManager(work / "checkpoints")
    manager.save(0, args=ocp.args.Composite(meta=ocp.args.JsonSave(meta), config=ocp.args.JsonSave(cfg.to_dict())))
    manager.wait_until_finished()
    manager.close()
    state_dir.rename(work / "checkpoints" / "0" / "state")
    (work / "checkpoints").rename(directory)
    shutil.rmtree(work)


def _slices(shape: tuple[int, ...], elements: int) -> tuple[tuple[int, ...], list[tuple[slice, ...]]]:
    """The write (chunk) shape of an array of `shape` and the slices that tile it: blocks of its
    first axis of at most `elements` elements (at least one row); a scalar whole."""
    if not shape:
        return (), [()]
    rows = min(shape[0], max(1, elements // max(1, math.prod(shape[1:]))))
    rest = (slice(None),) * (len(shape) - 1)
    return (rows, *shape[1:]), [(slice(r, min(r + rows, shape[0])), *rest) for r in range(0, shape[0], rows)]


def _write_tree_metadata(path: Path, state, values: dict[str, dict]) -> None:
    """The _METADATA a StandardSave of `state` writes: per leaf its keys with their kinds
    (1 sequence, 2 dict, as orbax numbers them) and value metadata (`values`, by array name),
    empty nodes included; the format flags of the arrays written here."""
    tree = {}
    for keypath, leaf in jax.tree_util.tree_leaves_with_path(state, is_leaf=_empty):
        keys = tuple(map(_key, keypath))
        kinds = [1 if isinstance(k, jax.tree_util.SequenceKey) else 2 for k in keypath]
        value = {"value_type": "None", "skip_deserialize": True} if _empty(leaf) else values[".".join(keys)]
        tree[str(keys)] = {"key_metadata": [{"key": k, "key_type": t} for k, t in zip(keys, kinds)],
                           "value_metadata": value}
    path.write_text(json.dumps({"tree_metadata": tree, "use_ocdbt": True, "use_zarr3": True,
                                "store_array_data_equal_to_fill_value": True, "custom_metadata": None}))


def latest_params(directory: Path) -> tuple[RunConfig, Callable[[tuple[str, ...]], np.ndarray]]:
    """The latest checkpoint's config, and a function reading one parameter (path below params)
    as a numpy array, checked against the checkpoint's checksum."""
    manager = ocp.CheckpointManager(directory.resolve()) if directory.is_dir() else None
    step = manager.latest_step() if manager else None
    if step is None:
        raise ConfigError(f"--to-hf {directory.parent}: no checkpoint in {directory}; give a run directory "
                          "that train.py (or --from-hf) wrote checkpoints into")
    items = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore(), config=ocp.args.JsonRestore()))
    cfg, sums = RunConfig.from_dict(items.config), items.meta["checksums"]
    state_dir = directory.resolve() / str(step) / "state"

    def read(path: tuple[str, ...]) -> np.ndarray:
        keys = ("params", *path, "value")
        restore = _nest(keys, ocp.RestoreArgs(restore_type=np.ndarray))
        with ocp.PyTreeCheckpointer() as checkpointer:
            tree = checkpointer.restore(state_dir, args=ocp.args.PyTreeRestore(
                item=_nest(keys, 0), restore_args=restore, partial_restore=True))
        for k in keys:
            tree = tree[k]
        name = f".params{''.join(f'[{k!r}]' for k in path)}.value"
        if block_checksum(tree, (0,) * tree.ndim, tree.shape) != sums.get(name):
            raise ConfigError(f"--to-hf: {name} in {state_dir} does not match its checksum: the checkpoint is damaged")
        return tree

    return cfg, read


def block_checksum(block: np.ndarray, starts: tuple[int, ...], shape: tuple[int, ...], chunk: int = 2**20) -> int:
    """training.checkpoint.checksums' sum over the elements of `block`, which sits at `starts` in
    an array of `shape`: bits times (2 * flat index + 1), mod 2^32; `chunk` elements at a time."""
    columns = block.shape[-1] if block.ndim else 1
    words = block.reshape(-1, columns).view(np.dtype(f"uint{8 * block.dtype.itemsize}"))  # [R, C]
    strides = [math.prod(shape[k + 1:]) for k in range(len(shape))]
    rows = np.zeros((), np.uint64)  # the flat index of each row's first element
    for k in range(block.ndim - 1):
        rows = rows[..., None] + (np.arange(block.shape[k], dtype=np.uint64) + starts[k]) * strides[k]
    rows = rows.reshape(-1)
    cols = np.arange(columns, dtype=np.uint64) + (starts[-1] if block.ndim else 0)
    step, total = max(1, chunk // columns), 0
    for r in range(0, len(rows), step):
        index = ((rows[r:r + step, None] + cols) % 2**32).astype(np.uint32)
        weights = index * np.uint32(2) + np.uint32(1)
        total += int(np.sum(words[r:r + step].astype(np.uint32) * weights, dtype=np.uint32))
    return total % 2**32
