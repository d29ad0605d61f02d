"""Checkpoints: asynchronous sharded saves, resume from the latest complete one, on any mesh.

Where: RUN_DIR/checkpoints/<step>/ (orbax CheckpointManager), one directory per saved step:
  state/   the TrainState: step, parameters, AdamW moments and count, the bad-step counters
           (orbax OCDBT + zarr; the processes write their devices' shards collectively)
  meta/    JSON: step, data position, both seeds, one checksum per array
  config/  JSON: the resolved RunConfig of the run that wrote it
Saved every `train.checkpoint_every` steps, at the last step and when a signal stops the run;
the newest `train.keep_checkpoints` are kept.

RNG state: there is no dropout and no random state after initialisation. The batch of step s
depends only on (data.seed, s) and the initial parameters only on train.seed, so the data
position (= the step) and the two seeds are the whole RNG state; resume checks them.

Cost of a save: the caller blocks while the checksums are computed (one read of the state on
device, a few scalars to the host) and while orbax copies this process's shards to host memory
(state bytes / processes: 12 bytes per parameter with fp32 AdamW; in one process each shard
whole from one replica, `whole_shard_saves`); the disk write runs in
background threads while training goes on, holding that host copy until it ends. The blocking
part is logged as `checkpoint_s`, outside the step time (training/loop.py). Disk: those
12 bytes per parameter zstd-compressed by orbax (its default), 9.2 measured on 125m after 4 steps
(bench/results/checkpoint-125m-fsdp2.json); the ratio depends on the values. Restore: the targets are ShapeDtypeStructs carrying the
*current* mesh's NamedShardings, so each process reads only the chunks of its own shards and
no array is ever gathered onto one device; any saved mesh restores onto any current mesh.

Guarantees:
- Complete: orbax writes into `<step>.orbax-checkpoint-tmp` and renames it to `<step>` only
  after every process finished (atomic rename). A temporary directory left by a killed process
  is reported, removed and never restored.
- Damaged: a flipped bit in a data file restores silently in orbax, so every array's checksum
  (bits times odd position weights, summed mod 2^32: independent of the sharding) is compared
  with the saved one. A checkpoint that fails to read or to match is moved aside to
  `<step>.damaged` (`.damaged-2`, ... beside an earlier one) and the previous one is tried;
  the messages say which and why. When checkpoints exist and none restores, the run stops with
  an error rather than starting over beside them, and so does the next attempt, which finds
  only the `.damaged` ones.
- Readers leave the run alone: `read_only=True` (--eval-only, tools.generate) removes no
  temporary directory (a training run may be writing it) and sets nothing aside.
- Compatible: a checkpoint written for another model (fields of `model.*` other than
  COMPUTE_ONLY, or gradient clipping on/off, which changes the optimizer state) or another
  data.seed is refused with an error naming the fields that differ.

Test hook: MESHTRAIN_TEST_KILL_IN_SAVE=N makes the process SIGKILL itself right after the save of
step N was started (its temporary directory exists, its write is in flight): a deterministic
"killed mid-checkpoint-write" for the tests.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import logging
import os
import re
import signal
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from configs.base import ConfigError, RunConfig
from training.build import Program
from training.logger import say
from training.step import TrainState

KILL_IN_SAVE_HOOK = "MESHTRAIN_TEST_KILL_IN_SAVE"
COMPUTE_ONLY = ("attention", "remat", "compute_dtype")  # change the computation, not the state
TMP_STEP = re.compile(r"^(\d+)\.orbax-checkpoint-tmp")


# where tensorstore's read errors go on to print the whole store's spec (tens of lines)
TENSORSTORE_SPEC = "See full TensorStore details"


@functools.cache  # installed once
def quiet_abandoned_reads() -> None:
    """Drop the noise of a damaged checkpoint's abandoned reads, for the rest of the process.

    orbax reads the arrays as concurrent asyncio tasks on tensorstore futures; when one read of a
    damaged checkpoint fails, the restore raises (restore_latest says so in one line) and the
    others are dropped, each then printed by Python with tensorstore's whole spec: 'Exception
    ignored in: <coroutine ...>', 'Event loop is closed' from tensorstore's threads, asyncio's
    'Task exception was never retrieved': tens to hundreds of lines, some after the restore has
    returned. Exactly those are dropped (a coroutine's unraisable exception, the closed loop's,
    that asyncio message); anything else is printed as before."""
    previous = sys.unraisablehook

    def hook(unraisable: sys.UnraisableHookArgs) -> None:
        closed_loop = unraisable.exc_type is RuntimeError and str(unraisable.exc_value) == "Event loop is closed"
        if not (inspect.iscoroutine(unraisable.object) or closed_loop):
            previous(unraisable)

    sys.unraisablehook = hook
    logging.getLogger("asyncio").addFilter(
        lambda record: not str(record.msg).startswith("Task exception was never retrieved"))


class DamagedCheckpoint(Exception):
    """A checkpoint that reads but whose contents do not match what was saved."""


@jax.jit
def checksums(state: TrainState) -> list[jax.Array]:
    """One uint32 per array: sum of its bits times (2 * flat index + 1), mod 2^32."""

    def one(x: jax.Array) -> jax.Array:
        bits = jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * x.dtype.itemsize}")).astype(jnp.uint32)
        weights = jax.lax.iota(jnp.uint32, x.size).reshape(x.shape) * 2 + 1
        return jnp.sum(bits * weights, dtype=jnp.uint32)

    return [one(x) for x in jax.tree.leaves(state)]


def named_checksums(state: TrainState) -> dict[str, int]:
    names = [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_leaves_with_path(state)]
    return dict(zip(names, map(int, jax.device_get(checksums(state)))))


def restore_targets(program: Program) -> TrainState:
    """The abstract state as ShapeDtypeStructs carrying this mesh's NamedShardings."""
    leaves = [
        jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding)
        for s, sharding in zip(jax.tree.leaves(program.state), jax.tree.leaves(program.shardings))
    ]
    return jax.tree.unflatten(jax.tree.structure(program.state), leaves)


def incompatibilities(saved: dict, cfg: RunConfig) -> list[str]:
    """'field: saved vs now' for each config field whose difference forbids a restore."""
    now = cfg.to_dict()
    diffs = [
        f"model.{key}={saved['model'].get(key)!r} in the checkpoint, {value!r} now"
        for key, value in now["model"].items()
        if key not in COMPUTE_ONLY and saved["model"].get(key) != value
    ]
    if bool(saved["train"]["grad_clip"]) != bool(cfg.train.grad_clip):
        diffs.append(f"train.grad_clip={saved['train']['grad_clip']} in the checkpoint, "
                     f"{cfg.train.grad_clip} now (clipping on/off changes the optimizer state)")
    if saved["data"]["seed"] != cfg.data.seed:
        diffs.append(f"data.seed={saved['data']['seed']} in the checkpoint, {cfg.data.seed} now "
                     "(the data stream would not continue)")
    return diffs


# fields a resume may change, which make the batches from the resumed step on another stream
STREAM = (("data", "source"), ("data", "path"), ("train", "global_batch_size"), ("train", "seq_len"))


def stream_changes(saved: dict, cfg: RunConfig) -> list[str]:
    """'field=saved in the checkpoint, now' for each STREAM field this resume changes: allowed
    (fine-tuning a converted run on other data is one), and said in one note."""
    now = cfg.to_dict()
    return [f"{part}.{key}={saved[part].get(key)!r} in the checkpoint, {now[part][key]!r} now"
            for part, key in STREAM if saved[part].get(key) != now[part][key]]


def whole_shard_saves() -> None:
    """In one process, save each shard whole from one of its replicas (orbax's jax.Array handler
    with `use_replica_parallel=False`, registered for the process).

    orbax's replica-parallel save (its default unless JAX_PLATFORMS names cuda or gpu) splits
    each replicated shard among its replicas so that several hosts share the writing. In one
    process every replica is this process's: the same bytes are written from the same host,
    but each replica's part is cut out by an eager slice on its device, compiled once per
    array, replica and device. train.py on dp=8,tp=8 (the tiny preset over 64 fake devices, 3
    steps, one save; jax 0.12, 2 cores): 46 s -> 22 s, the difference the save's slice
    compiles. Across processes orbax's default stands. The handler leaves out orbax's
    ArrayMetadata store, which records PRNG-key arrays: a TrainState holds none."""
    if jax.process_count() == 1:
        absl = logging.getLogger("absl")  # orbax warns of every override, this intended one too (a line
        level = absl.level  # before every run's output, and before an error's one line)
        absl.setLevel(logging.ERROR)
        try:
            ocp.type_handlers.register_type_handler(
                jax.Array, ocp.type_handlers.ArrayHandler(use_replica_parallel=False), override=True)
        finally:
            absl.setLevel(level)


class Checkpointer:
    """Saves and restores a run's TrainState under `directory` (RUN_DIR/checkpoints)."""

    def __init__(self, directory: Path, cfg: RunConfig, read_only: bool = False):
        t = cfg.train
        if t.checkpoint_every < 1 or t.keep_checkpoints < 1:
            raise ConfigError(
                f"train.checkpoint_every={t.checkpoint_every}, train.keep_checkpoints={t.keep_checkpoints}: "
                "both must be >= 1 (train.checkpoint_every=0 turns checkpoints off)"
            )
        self.directory, self.cfg, self.read_only = directory.resolve(), cfg, read_only
        self.cut_off = sorted(p for p in self.directory.glob("*") if TMP_STEP.match(p.name))
        writer = {"max_to_keep": t.keep_checkpoints, "cleanup_tmp_directories": True}
        reader = {"max_to_keep": None, "save_interval_steps": 0, "create": False, "read_only": True}
        options = ocp.CheckpointManagerOptions(enable_async_checkpointing=True, **(reader if read_only else writer))
        whole_shard_saves()
        absl = logging.getLogger("absl")  # orbax warns that a read-only manager is read only: what a reader asks for
        said = lambda record: not str(record.msg).startswith("Given directory is read only")  # noqa: E731
        absl.addFilter(said)
        try:
            self.manager = ocp.CheckpointManager(self.directory, options=options)
        finally:
            absl.removeFilter(said)

    def due(self, step: int) -> bool:
        return step % self.cfg.train.checkpoint_every == 0 or step == self.cfg.train.steps

    def path(self, step: int) -> Path:
        return self.directory / str(step)

    def save(self, step: int, state: TrainState) -> None:
        """Start an asynchronous save of `state` (after `step` steps); returns once it is on host."""
        meta = {"step": step, "data_position": step, "data_seed": self.cfg.data.seed,
                "init_seed": self.cfg.train.seed, "checksums": named_checksums(state)}
        self.manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state),
            meta=ocp.args.JsonSave(meta),
            config=ocp.args.JsonSave(self.cfg.to_dict()),
        ))
        if os.environ.get(KILL_IN_SAVE_HOOK) == str(step):
            os.kill(os.getpid(), signal.SIGKILL)  # see the test hook in the module docstring

    def wait(self) -> None:
        """Block until every started save is complete on disk."""
        self.manager.wait_until_finished()

    def latest(self) -> int | None:
        return self.manager.latest_step()

    def restore_latest(self, program: Program) -> TrainState | None:
        """The newest complete, undamaged checkpoint's state in `program`'s shardings, or None when
        there is none; a ConfigError when there are checkpoints and none restores."""
        for tmp in self.cut_off:
            say(f"checkpoint {tmp.name} was cut off mid-write, or is still being written (never committed): "
                + ("not read" if self.read_only else "ignored and removed"))
        steps = sorted(self.manager.all_steps(), reverse=True)
        if steps:
            quiet_abandoned_reads()
        for step in steps:
            try:
                state = self._restore(step, program)
            except ConfigError:
                raise
            except Exception as e:  # unreadable files fail in many ways (tensorstore, json, orbax)
                first_line = (str(e).splitlines() or [""])[0].split(TENSORSTORE_SPEC)[0].strip()[:200]
                self._set_aside(step, f"{type(e).__name__}: {first_line}")
                continue
            say(f"resumed from {self.path(step)} (step {step})")
            return state
        if steps:
            raise ConfigError(f"none of the {len(steps)} checkpoint(s) in {self.directory} restores (messages above); "
                              "put back a good copy, or move the directory away to start over")
        damaged = sorted(p.name for p in self.directory.glob("*.damaged*"))  # none where the directory is not
        if damaged:  # set aside by an earlier attempt: starting over beside them would hide it
            raise ConfigError(f"{self.directory} holds only damaged checkpoints ({', '.join(damaged)}), set aside "
                              "by an earlier resume; put back a good copy, or move the directory away to start over")
        return None

    def _restore(self, step: int, program: Program) -> TrainState:
        items = self.manager.restore(step, args=ocp.args.Composite(
            meta=ocp.args.JsonRestore(), config=ocp.args.JsonRestore()))
        diffs = incompatibilities(items.config, self.cfg)
        if diffs:
            raise ConfigError(
                f"checkpoint {self.path(step)} was written by a different run: {'; '.join(diffs)}. "
                "Use the --config/--set of the run that wrote it, or another --run-dir"
            )
        state = self.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(restore_targets(program)))).state
        saved, now = items.meta["checksums"], named_checksums(state)
        wrong = [name for name in saved if now.get(name) != saved[name]]
        if wrong or saved.keys() != now.keys():
            raise DamagedCheckpoint(f"checksum mismatch in {len(wrong)} array(s), e.g. {(wrong or ['?'])[0]}")
        if int(state.step) != items.meta["data_position"] or items.meta["step"] != step:
            raise DamagedCheckpoint(f"state step {int(state.step)} != saved data position {items.meta['data_position']}")
        changes = [] if self.read_only else stream_changes(items.config, self.cfg)  # readers draw no batches
        if changes:
            say(f"note: {'; '.join(changes)}: from step {step} on the batches are another stream, not the "
                "saved run's continuation (as intended when fine-tuning on other data; else resume without the --set)")
        return state

    def _set_aside(self, step: int, reason: str) -> None:
        """Move a damaged checkpoint to `<step>.damaged` (orbax no longer sees it), beside any
        earlier one of that step, and say so; read-only, only say so."""
        if self.read_only:
            say(f"checkpoint {self.path(step)} is damaged ({reason}): left in place, trying the previous one")
            return
        names = (f"{step}.damaged" + (f"-{n}" if n > 1 else "") for n in itertools.count(1))
        aside = next(p for p in (self.directory / name for name in names) if not p.exists())
        if jax.process_index() == 0:
            self.path(step).rename(aside)
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices(f"meshtrain-set-aside-{step}")
        self.manager.reload()
        say(f"checkpoint {self.path(step)} is damaged ({reason}): moved to {aside}, "
            "falling back to the previous checkpoint")

    def close(self) -> None:
        self.manager.close()
