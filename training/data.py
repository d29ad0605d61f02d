"""Token streams and deterministic, sharded batches.

Sources (`data.source`):
  stdlib     this Python's own standard-library .py files, read as bytes (vocab 256): every
             machine with Python has them, so the default run needs no download.
  text       a file, or every file under a directory, read as bytes.
  tokens     a pretokenized flat .bin file of uint16 or uint32 ids (memory-mapped).
  synthetic  uniform random ids (for speed runs; nothing to learn).

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
from pathlib import Path

import jax
import numpy as np

from configs.base import ConfigError, DataConfig

SYNTHETIC_TOKENS = 1 << 22
NAN_STEPS_HOOK = "MESHTRAIN_TEST_NAN_STEPS"


def stdlib_files() -> list[Path]:
    """The standard library's .py files (site-packages excluded), in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "__pycache__"))
        files += [Path(dirpath, f) for f in sorted(filenames) if f.endswith(".py")]
    return files


def _read_bytes(files: list[Path], what: str) -> np.ndarray:
    data = np.frombuffer(b"".join(f.read_bytes() for f in files), dtype=np.uint8)
    if data.size == 0:
        raise ConfigError(f"{what} holds no bytes: point --set data.path at a non-empty file or directory")
    return data


def load_tokens(cfg: DataConfig, vocab_size: int) -> np.ndarray:
    """The whole token stream as a 1-D array (memory-mapped for token files)."""
    if cfg.source in ("stdlib", "text") and vocab_size < 256:
        raise ConfigError(f"data.source={cfg.source} is byte-level: model.vocab_size must be >= 256")
    if cfg.source == "stdlib":
        return _read_bytes(stdlib_files(), "the standard library")
    if cfg.source == "synthetic":
        return np.random.default_rng(cfg.seed).integers(0, vocab_size, SYNTHETIC_TOKENS, dtype=np.uint32)
    if cfg.source not in ("text", "tokens"):
        raise ConfigError(f"--set data.source={cfg.source}: choose stdlib, text, tokens or synthetic")
    path = Path(cfg.path)
    if not cfg.path or not path.exists():
        raise ConfigError(f"data.source={cfg.source} needs an existing --set data.path=... (got {cfg.path!r})")
    if cfg.source == "text":
        files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
        return _read_bytes(files, f"data.path={cfg.path}")
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
    return tokens


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
