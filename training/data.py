"""Token streams and deterministic, sharded batches.

Sources (`data.source`):
  stdlib     this Python's own standard-library .py files, read as bytes (vocab 256): every
             machine with Python has them, so the default run needs no download.
  text       a file, or every file under a directory, read as bytes.
  tokens     a pretokenized flat .bin file of uint16 or uint32 ids (memory-mapped).
  synthetic  uniform random ids (for speed runs; nothing to learn).

Held-out split: one part in HOLDOUT (100) of every source is kept for evaluation and never read
by training (`Corpus.train` / `Corpus.eval`). Several files (stdlib; text with a directory):
whole files, file i of n in sorted order when (i + 1) % min(n, 100) == 0 (every 100th file
spread over the tree, so the held-out code is like the rest; the last file when n < 100). One
file (text) or a token file: the last len // 100 tokens. Synthetic: a second random stream of
SYNTHETIC_TOKENS // 100 ids, seeded apart. Evaluation draws a fixed set of windows from
`Corpus.eval` (`held_out`), the same at every evaluation and on every mesh.

Order: the batch of step s is a set of windows whose start offsets are drawn from
`numpy.random.default_rng([data.seed, s])`, so it depends only on (seed, step): a resumed run
continues the same stream, and any process can compute any batch without coordination.

Layout: a batch is {'inputs', 'targets'}, each [k, b, L] int32 (k microbatches of b sequences;
targets are inputs shifted by one). It is sharded b over (data, fsdp) and L over sequence; each
process reads only the rows its devices hold and assembles the global array with
`jax.make_array_from_process_local_data`.

Test hook: MESHTRAIN_TEST_NAN_STEPS=3,4 puts an out-of-range token id (int32 max) first in the
inputs of those steps' batches; the embedding lookup (`jnp.take`, fill mode) reads it as NaN, so
the step's loss and gradients are NaN. Tests use it to exercise the skipping of non-finite steps.
"""

from __future__ import annotations

import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import jax
import numpy as np

from configs.base import BYTE_SOURCES, ConfigError, DataConfig

SYNTHETIC_TOKENS = 1 << 22
HOLDOUT = 100  # one part in HOLDOUT of the corpus is held out for evaluation
EVAL_SEED = 0  # the held-out windows' seed: fixed, so that every run of a corpus scores the same windows
NAN_STEPS_HOOK = "MESHTRAIN_TEST_NAN_STEPS"


@dataclass(frozen=True)
class Corpus:
    """A source's tokens in two parts: `train`, the only part training reads, and `eval`, the
    held-out part (it may be shorter than one window; evaluation then refuses to run)."""

    train: np.ndarray
    eval: np.ndarray


def stdlib_files() -> list[Path]:
    """The standard library's .py files (site-packages excluded), in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "__pycache__"))
        files += [Path(dirpath, f) for f in sorted(filenames) if f.endswith(".py")]
    return files


def held_out_files(files: list[Path]) -> tuple[list[Path], list[Path]]:
    """(training files, held-out files) of a sorted list of two or more: file i of n is held out
    when (i + 1) % min(n, HOLDOUT) == 0."""
    stride = min(len(files), HOLDOUT)
    return ([f for i, f in enumerate(files) if (i + 1) % stride],
            [f for i, f in enumerate(files) if (i + 1) % stride == 0])


def split_stream(tokens: np.ndarray) -> Corpus:
    """One stream (a token file, a single text file): the last len // HOLDOUT tokens are held out."""
    cut = tokens.size - tokens.size // HOLDOUT
    return Corpus(tokens[:cut], tokens[cut:])


def _concat(files: list[Path]) -> np.ndarray:
    return np.frombuffer(b"".join(f.read_bytes() for f in files), dtype=np.uint8)


def _read_bytes(files: list[Path], what: str) -> Corpus:
    if len(files) > 1:
        train, held = held_out_files(files)
        corpus = Corpus(_concat(train), _concat(held))
    else:
        corpus = split_stream(_concat(files))
    if corpus.train.size == 0:
        raise ConfigError(f"{what} holds no bytes to train on: point --set data.path at a non-empty file or directory")
    return corpus


def load_tokens(cfg: DataConfig, vocab_size: int) -> Corpus:
    """The source's tokens as 1-D arrays (memory-mapped for token files), split into the part
    training reads and the held-out part (module docstring)."""
    if cfg.source in BYTE_SOURCES and vocab_size < 256:
        raise ConfigError(f"data.source={cfg.source} is byte-level: model.vocab_size must be >= 256")
    if cfg.source == "stdlib":
        return _read_bytes(stdlib_files(), "the standard library")
    if cfg.source == "synthetic":
        rngs = np.random.default_rng(cfg.seed), np.random.default_rng([cfg.seed, 1])
        return Corpus(*(rng.integers(0, vocab_size, size, dtype=np.uint32)
                        for rng, size in zip(rngs, (SYNTHETIC_TOKENS, SYNTHETIC_TOKENS // HOLDOUT))))
    if cfg.source not in ("text", "tokens"):
        raise ConfigError(f"--set data.source={cfg.source}: choose stdlib, text, tokens or synthetic")
    path = Path(cfg.path)
    if not cfg.path or not path.exists():
        raise ConfigError(f"data.source={cfg.source} needs an existing --set data.path=... (got {cfg.path!r})")
    if cfg.source == "text":
        files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
        return _read_bytes(files, f"data.path={cfg.path}")
    if path.is_dir():
        raise ConfigError(f"--set data.path={cfg.path} is a directory: data.source=tokens reads one file of token "
                          "ids; name that file (a directory of text files is data.source=text)")
    if cfg.token_dtype not in ("uint16", "uint32"):
        raise ConfigError(f"--set data.token_dtype={cfg.token_dtype}: choose uint16 or uint32")
    size, itemsize = path.stat().st_size, np.dtype(cfg.token_dtype).itemsize
    if size == 0:
        raise ConfigError(f"data.path={cfg.path} is empty")
    if size % itemsize:
        raise ConfigError(
            f"data.path={cfg.path} has {size} bytes, not a multiple of {itemsize}: "
            f"is --set data.token_dtype={cfg.token_dtype} the dtype it was written with?"
        )
    tokens = np.memmap(path, dtype=cfg.token_dtype, mode="r")
    if int(tokens.max()) >= vocab_size:
        raise ConfigError(
            f"data.path={cfg.path} holds token id {int(tokens.max())} >= model.vocab_size={vocab_size}"
        )
    return split_stream(tokens)


class Batches:
    """Batch of any step, sharded onto the mesh: {'inputs', 'targets'} [k, b, L] int32."""

    def __init__(self, tokens: np.ndarray, seed: int, k: int, b: int, seq_len: int,
                 sharding: jax.sharding.NamedSharding, order: np.ndarray | None = None):
        if tokens.size < seq_len + 1:
            raise ConfigError(
                f"the corpus has {tokens.size} tokens, fewer than train.seq_len={seq_len} + 1 "
                "(one window of inputs and shifted targets)"
            )
        self.tokens, self.seed, self.shape, self.sharding = tokens, seed, (k, b, seq_len), sharding
        self.order = order  # a permutation of each sequence's positions (context parallelism's zigzag)
        # Rows (along b) held by this process's devices; all processes draw the same offsets.
        index = sharding.addressable_devices_indices_map(self.shape).values()
        self.rows = np.unique(np.concatenate([np.arange(b)[ix[1]] for ix in index]))
        self.nan_steps = {int(s) for s in os.environ.get(NAN_STEPS_HOOK, "").split(",") if s.strip()}

    def host_batch(self, step: int) -> dict[str, np.ndarray]:
        """This process's rows of step `step`, as numpy [k, rows, L]."""
        k, b, length = self.shape
        rng = np.random.default_rng([self.seed, step])
        starts = rng.integers(0, self.tokens.size - length, size=(k, b))[:, self.rows]  # windows of L + 1
        windows = self.tokens[starts[..., None] + np.arange(length + 1)].astype(np.int32)
        if step in self.nan_steps:
            windows[..., 0] = np.iinfo(np.int32).max  # see the test hook in the module docstring
        inputs, targets = windows[..., :-1], windows[..., 1:]
        if self.order is not None:  # inputs and targets alike: the loss, a mean, needs no undoing
            inputs, targets = inputs[..., self.order], targets[..., self.order]
        return {"inputs": inputs, "targets": targets}

    def __call__(self, step: int) -> dict[str, jax.Array]:
        return {
            name: jax.make_array_from_process_local_data(self.sharding, local, self.shape)
            for name, local in self.host_batch(step).items()
        }


def held_out(tokens: np.ndarray, k: int, b: int, seq_len: int, sharding: jax.sharding.NamedSharding,
             order: np.ndarray | None = None) -> Batches:
    """The evaluation batches: batch i is step i of the held-out tokens under EVAL_SEED (the
    same windows at every evaluation, whatever the mesh, since the windows of a step depend only
    on the seed, the step and k·b)."""
    if tokens.size < seq_len + 1:
        raise ConfigError(
            f"the held-out part of the corpus has {tokens.size} tokens, fewer than one window of "
            f"train.seq_len={seq_len} + 1 (one file in {HOLDOUT}, or the last 1%, is held out: README, "
            "Evaluation): use a larger corpus, or --set train.eval_every=0 to train without evaluation"
        )
    return Batches(tokens, EVAL_SEED, k, b, seq_len, sharding, order)
