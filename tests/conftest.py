"""Fake CPU devices and a shared compilation cache for every test.

XLA_FLAGS must be set before jax is imported anywhere, so it is set here at import time.
The persistent compilation cache lives in one temporary directory per test session and is
handed to CLI subprocesses through JAX_COMPILATION_CACHE_DIR, so identical programs compile once.
"""

import os
import tempfile

DEVICES = 8
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={DEVICES}"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", tempfile.mkdtemp(prefix="meshtrain-jax-cache-"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")

import jax  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def _enough_devices():
    assert jax.device_count() >= DEVICES, "tests need the fake CPU devices set in conftest"


SMALL = [
    "model.d_model=64", "model.n_layers=2", "model.n_heads=8", "model.n_kv_heads=2",
    "model.head_dim=8", "model.d_ff=128", "model.compute_dtype=float32",
    "train.seq_len=32", "train.global_batch_size=16", "train.warmup_steps=2", "train.steps=5",
]


def small_config(mesh: str = "", *overrides: str):
    """The tiny preset shrunk for tests (fp32 compute so that sharded runs compare tightly)."""
    import dataclasses

    from configs import apply_overrides, get_preset
    from sharding.mesh import parse_mesh

    cfg = apply_overrides(get_preset("tiny"), SMALL + list(overrides))
    return dataclasses.replace(cfg, parallel=parse_mesh(mesh))


@pytest.fixture(scope="session")
def corpus():
    """A fixed byte corpus (the start of the stdlib stream) shared by the training tests."""
    from training.data import load_tokens

    return load_tokens(small_config().data, 256)[:200_000]


def train_argv(*args: str) -> list[str]:
    """`python -u train.py` with the SMALL settings, then `args` (for subprocess tests)."""
    import sys

    return [sys.executable, "-u", "train.py", *[a for s in SMALL for a in ("--set", s)], *args]


def logged_losses(run_dir) -> dict[int, float]:
    """{step: loss} from a run's metrics.jsonl (the last record of a step logged twice)."""
    import json
    from pathlib import Path

    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines)}
