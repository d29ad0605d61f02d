"""A step-0 checkpoint written one array at a time, and a checkpoint's parameters read one at a time.

training/checkpoint.py saves a whole TrainState at once (orbax StandardSave), which holds all of
it in memory. Here each array of the state is made, saved with orbax's partial save
(`orbax.checkpoint.experimental.v1.partial`: each call adds leaves to one pending checkpoint,
`finalize` commits it) and dropped, so the host holds one array (and orbax's copy of it) at a
time. Partial saves take nested dicts, so the tree metadata they leave records every container
as a dict; `_restore_tree_metadata` rewrites it to the TrainState's own (tuples as sequences,
its empty nodes), so that the existing Checkpointer restores it unchanged: same layout
RUN/checkpoints/<step>/{state,meta,config}, same checksums in meta.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from orbax.checkpoint.experimental.v1 import partial

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
    """RUN/checkpoints/0: parameters from `readers` (path below params -> shard callback), every
    other array of the TrainState zero (fresh AdamW moments and counts, step 0)."""
    work = directory.with_name(directory.name + ".converting")
    shutil.rmtree(work, ignore_errors=True)
    pending = work / "state"
    sums = {}
    leaves = jax.tree_util.tree_leaves_with_path(program.state)
    for (path, spec), sharding in zip(leaves, jax.tree.leaves(program.shardings)):
        keys = tuple(map(_key, path))
        total = [0]
        if keys[0] == "params":
            read = _summing(readers[keys[1:-1]], spec.shape, total)
            array = jax.make_array_from_callback(spec.shape, sharding, read)
        else:  # zeros: checksum 0
            array = jax.jit(lambda s=spec: jnp.zeros(s.shape, s.dtype), out_shardings=sharding)()
        sums[jax.tree_util.keystr(path)] = total[0] % 2**32
        partial.save(pending, _nest(keys, array))
        del array
    partial.finalize(pending)
    _restore_tree_metadata(pending / "state" / "_METADATA", program.state)
    meta = {"step": 0, "data_position": 0, "data_seed": cfg.data.seed, "init_seed": cfg.train.seed, "checksums": sums}
    manager = ocp.CheckpointManager(work / "checkpoints")
    manager.save(0, args=ocp.args.Composite(meta=ocp.args.JsonSave(meta), config=ocp.args.JsonSave(cfg.to_dict())))
    manager.wait_until_finished()
    manager.close()
    (pending / "state").rename(work / "checkpoints" / "0" / "state")
    (work / "checkpoints").rename(directory)
    shutil.rmtree(work)


def _restore_tree_metadata(path: Path, state) -> None:
    """The tree metadata a StandardSave of `state` writes: per leaf its keys with their kinds
    (1 sequence, 2 dict, as orbax numbers them) and value metadata, empty nodes included."""
    saved = json.loads(path.read_text())
    written = saved["tree_metadata"]
    tree = {}
    for keypath, leaf in jax.tree_util.tree_leaves_with_path(state, is_leaf=_empty):
        keys = tuple(map(_key, keypath))
        kinds = [1 if isinstance(k, jax.tree_util.SequenceKey) else 2 for k in keypath]
        value = {"value_type": "None", "skip_deserialize": True} if _empty(leaf) else written[str(keys)]["value_metadata"]
        tree[str(keys)] = {"key_metadata": [{"key": k, "key_type": t} for k, t in zip(keys, kinds)],
                           "value_metadata": value}
    path.write_text(json.dumps(saved | {"tree_metadata": tree}))


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


def _summing(read: Callable, shape: tuple[int, ...], total: list[int]) -> Callable:
    """`read`, adding each distinct shard's checksum to total[0] (replicas counted once)."""
    seen = set()

    def callback(index: tuple[slice, ...]) -> np.ndarray:
        data = read(index)
        starts = tuple(s.indices(n)[0] for s, n in zip(index, shape))
        if starts not in seen:
            seen.add(starts)
            total[0] += block_checksum(data, starts, shape)
        return data

    return callback


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
