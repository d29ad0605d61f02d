"""Fake CPU devices and a shared compilation cache for every test.

XLA_FLAGS must be set before jax is imported anywhere, so it is set here at import time.
The persistent compilation cache lives in one temporary directory per test session and is
handed to CLI subprocesses through JAX_COMPILATION_CACHE_DIR, so identical programs compile once;
the process that made it (xdist's controller) deletes it at exit.

Tests compile with XLA CPU's LLVM optimisation off (`--xla_backend_optimization_level=0`, also
handed to the subprocesses, see `child_env`). A test's programs are tiny, so compiling is most of
its time: test_step.py took 93 s with it on and 62 s with it off (jax 0.10.2, 2 cores; 95 s and
63 s on jax 0.12). The flag acts after XLA's HLO passes: the optimized HLO and the memory
analysis of the train step, which the communication and memory tests read, were byte-identical
with and without it on both versions (dp=2,fsdp=2,tp=2 and pp=2,dp=2,fsdp=2 1f1b).

On jaxlib < 0.11 they also use XLA CPU's elemental IR emitter in place of its MLIR fusion
emitters (`--xla_cpu_use_fusion_emitters=false`; jaxlib 0.11 removed the flag and the choice):
the MLIR path builds a context and a pattern set per fusion, most of the compile of a small
program. Backend compile of test_step's dp=2,tp=2,sp=2 run (init, gradient and train step) went
from 9.5 s to 3.4 s on jax 0.10.2. Across six train steps (one device; dp=2,fsdp=2,tp=2; 1f1b
and zb-h1 pipelines; dp=2,sp=4; tp with SP and overlap) the collective census was identical and
XLA's temp differed by 64-128 bytes (the legacy emitter keeps a few scalar reductions outlined),
and a scatter-add (the embedding's gradient) becomes a loop over its rows (tests/test_model.py).
The whole suite (jax 0.10.2, 2 workers, a 2-core machine) took 16:19 with it; 27:01 without it
at the previous undisturbed run.

On jax >= 0.12 the tests lower erf_inv (every normal and truncated-normal draw: the parameter
initialisers, the tests' random inputs) with XLA's own polynomial, `chlo.erf_inv`, as jax 0.10
always does (`JAX_ACCURATE_ERF_INV=0`, handed to the subprocesses with the environment). jax
0.12's default traces and lowers a Python implementation, more accurate near |x| = 1, at every
such draw: 0.29 s of the lowering of a dp=2,tp=2 parameter init (0.78 s against 0.49, three
runs each), 127 lowerings and 3.9 s in test_step.py and test_tensor_parallel.py (1.5% of their
worker time). Nothing the tests compare depends on which: both sides of an equality test draw
the same way.

Python's cyclic garbage collector runs its young generation every 100,000 allocations instead of
every 700, as in the CLIs (cli.GC_THRESHOLDS, cli.run_cli): tracing a train step allocates
millions of short-lived objects, and each young collection also walks what survived into the
older ones. In the gpipe and zbv cases of tests/test_pipeline_equal.py (jax 0.12, one process)
the collector took 3.14 s of 50.7 s in 2,206 collections, and 0.84 s in 9 with these thresholds.
Cycles are still collected. When the session ends, `pytest_unconfigure` freezes what is left
(`gc.freeze`, as the CLIs do), so the interpreter exits without a last collection over every
object the tests' compiles made: a process that had run ten test_hlo.py cases took 1.4 s from
its last line to its exit, 0.2 s so.
"""

import atexit
import gc
import importlib.metadata
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from cli import GC_THRESHOLDS
from sharding.xla_flags import FAKE_DEVICES, with_flags

DEVICES = 8
FAST_COMPILE = "--xla_backend_optimization_level"
LEGACY_EMITTER = "--xla_cpu_use_fusion_emitters"
JAXLIB = tuple(int(p) for p in importlib.metadata.version("jaxlib").split(".")[:2])  # (major, minor)


def _test_flags(flags: str) -> str:
    """`flags` plus the compile-time flags of the docstring, unless already set."""
    if FAST_COMPILE not in flags:
        flags += f" {FAST_COMPILE}=0"
    if JAXLIB < (0, 11) and LEGACY_EMITTER not in flags:
        flags += f" {LEGACY_EMITTER}=false"
    return flags


gc.set_threshold(*GC_THRESHOLDS)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_ACCURATE_ERF_INV", "0")  # the docstring: jax 0.10's erf_inv lowering
os.environ["XLA_FLAGS"] = with_flags(_test_flags(os.environ.get("XLA_FLAGS", "")), DEVICES)
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="meshtrain-jax-cache-")
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")

import jax  # noqa: E402
import pytest  # noqa: E402
from jax.experimental.pallas import mosaic_gpu as plgpu  # noqa: E402


def pytest_unconfigure(config: pytest.Config) -> None:
    gc.freeze()  # the docstring: exit without walking the session's objects


@pytest.fixture(scope="session", autouse=True)
def _enough_devices():
    assert jax.device_count() >= DEVICES, "tests need the fake CPU devices set in conftest"


ROOT = Path(__file__).resolve().parents[1]
GPU_INTERPRET = hasattr(plgpu, "InterpretGPUParams")  # jax >= 0.11 runs Mosaic GPU kernels on CPU (flash_mosaic.py)


def child_env(devices: int | None = None, **extra: str) -> dict[str, str]:
    """This session's environment for a child process that asks for its own fake devices (train.py,
    the benchmarks, the tools): XLA_FLAGS keeps every flag but the device count (`devices`: that
    many fake devices instead; the compile-time flags stay either way); `extra` added."""
    flags = " ".join(f for f in os.environ["XLA_FLAGS"].split() if not f.startswith(FAKE_DEVICES))
    return {**os.environ, "XLA_FLAGS": with_flags(flags, devices), **extra}


def run_module(*args: str, fake_devices: bool = True) -> subprocess.CompletedProcess:
    """`python -m args...` from the repository root, as a user runs it. fake_devices: without this
    session's device count (`child_env`), so that the entry point must ask for its own."""
    env = child_env() if fake_devices else dict(os.environ)
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)


SMALL = [
    "model.d_model=64", "model.n_layers=2", "model.n_heads=8", "model.n_kv_heads=2",
    "model.head_dim=8", "model.d_ff=128", "model.compute_dtype=float32",
    "train.seq_len=32", "train.global_batch_size=16", "train.warmup_steps=2", "train.steps=5",
    "train.eval_every=0",  # the tests that evaluate turn it on: it costs a compile per run
]


def small_config(mesh: str = "", *overrides: str):
    """The tiny preset shrunk for tests (fp32 compute so that sharded runs compare tightly)."""
    import dataclasses

    from configs import apply_overrides, get_preset
    from sharding.mesh import parse_mesh

    cfg = apply_overrides(get_preset("tiny"), SMALL + list(overrides))
    return dataclasses.replace(cfg, parallel=parse_mesh(mesh, cfg.parallel))


@pytest.fixture(scope="session")
def corpus():
    """A fixed byte corpus (the start of the stdlib training stream, and the whole held-out
    part) shared by the training tests."""
    from training.data import Corpus, load_tokens

    full = load_tokens(small_config().data, 256)
    return Corpus(full.train[:200_000], full.eval)


STEPS = 5


def mesh_sizes(cfg) -> dict[str, int]:
    """{axis: size} of cfg's mesh, every axis of sharding.mesh.AXES."""
    from sharding.mesh import AXES

    return {a: getattr(cfg.parallel, a) for a in AXES}


def pipeline_devices(cfg) -> list:
    """The first devices, as many as cfg's mesh (every axis) needs."""
    import math

    p = cfg.parallel
    return jax.devices()[: math.prod(max(n, 1) for n in (p.stage, p.data, p.fsdp, p.expert, p.sequence, p.tensor))]


def first_step_grads(opt_state, grad_norm: float, train):
    """The gradients the train step handed its optimizer at the first step, read back from the
    state after it: AdamW's first moment starts at 0, so mu = (1 - b1)·g', where g' is g after
    the global-norm clip (optax: g' = g·c/|g| when |g| >= c); the step's own grad_norm metric,
    taken before the clip, undoes it. So a test compiles only the train step (the program users
    run) and still compares every gradient: a wrong scale (a mean missing its 1/N) changes |g|
    and so the recovered g. mu is fp32 here (the parameters' dtype): the read-back costs a
    rounding or two, far below assert_same_run's tolerances."""
    import numpy as np
    import optax

    mu = optax.tree_utils.tree_get(opt_state, "mu")
    clip = train.grad_clip > 0 and grad_norm >= train.grad_clip
    scale = (grad_norm / train.grad_clip if clip else 1.0) / (1.0 - train.b1)
    return jax.tree.map(lambda m: np.asarray(m, np.float64) * scale, jax.device_get(mu))


_INITIAL: dict[tuple[str, str], object] = {}


def one_device_init(cfg, program):
    """`restore` for training.build.build: the run's initial state from its seed as one device
    computes it (once per model and optimizer, kept on the host), placed in `program`'s
    shardings. The state's shapes do not depend on the mesh, and every mesh's own init_fn gives
    the same values (tests/test_build.py checks it on a mesh of each axis); compiling that init
    per mesh took 0.4-0.8 s a test (jax 0.12, 2 cores), about 190 s of the suite."""
    import dataclasses

    from configs.base import ParallelConfig
    from sharding.mesh import build_mesh
    from training.build import make_program

    key = (repr(cfg.model), repr(cfg.train))
    if key not in _INITIAL:
        one = dataclasses.replace(cfg, parallel=ParallelConfig(data=1))
        mesh = build_mesh(one.parallel, jax.devices()[:1])
        init_fn = make_program(one, mesh).init_fn
        with jax.set_mesh(mesh):
            _INITIAL[key] = jax.device_get(init_fn())
    return jax.device_put(_INITIAL[key], program.shardings)


def start(cfg, mesh, corpus):
    """training.build.build of cfg on mesh, its state from `one_device_init`."""
    import functools

    from training.build import build

    return build(cfg, mesh, corpus=corpus, restore=functools.partial(one_device_init, cfg))


def run_steps(cfg, corpus, devices=None):
    """(loss, grads) of step 0 and the losses of STEPS steps, all on host, from STEPS calls of
    the run's jitted train step (one compile): step 0's gradients by `first_step_grads`."""
    import numpy as np

    from sharding.mesh import build_mesh

    mesh = build_mesh(cfg.parallel, devices)
    job = start(cfg, mesh, corpus)
    with jax.set_mesh(mesh):
        state, losses = job.state, []
        for step in range(STEPS):
            state, metrics = job.step_fn(state, job.batches(step))
            if step == 0:
                grads = first_step_grads(state.opt_state, float(metrics["grad_norm"]), cfg.train)
            losses.append(float(metrics["loss"]))
    return losses[0], grads, np.array(losses)


@pytest.fixture(scope="session")
def reference(corpus):
    """run_steps of the small config on one device: what every mesh must reproduce."""
    return run_steps(small_config(), corpus, devices=jax.devices()[:1])


def assert_same_run(got, want):
    """A sharded run equals the single-device one. Compute is fp32 in these tests, so the only
    differences are the order of the reductions that sharding splits: rtol 2e-5 on the losses,
    atol 1e-6 + rtol 1e-4 on gradients (their entries are O(1e-3))."""
    import numpy as np

    (loss, grads, losses), (ref_loss, ref_grads, ref_losses) = got, want
    np.testing.assert_allclose(loss, ref_loss, rtol=2e-5)
    flat_ref = jax.tree_util.tree_leaves_with_path(ref_grads)
    flat = jax.tree.leaves(grads)
    assert len(flat) == len(flat_ref) > 0
    for (path, expected), actual in zip(flat_ref, flat):
        np.testing.assert_allclose(actual, expected, atol=1e-6, rtol=1e-4, err_msg=jax.tree_util.keystr(path))
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-5)
    assert losses[-1] < losses[0]  # it trains


def initial_run(run_dir, cfg, devices=None) -> None:
    """A run directory holding cfg's config.json and a step-0 checkpoint of its initial state (the
    state of a run before its first step), on cfg's mesh over `devices` (default all it needs)."""
    import json

    from sharding.mesh import build_mesh
    from training.build import make_program
    from training.checkpoint import Checkpointer

    mesh = build_mesh(cfg.parallel, devices)
    program = make_program(cfg, mesh)
    with jax.set_mesh(mesh):
        state = program.init_fn()
    checkpoints = Checkpointer(run_dir / "checkpoints", cfg)
    checkpoints.save(0, state)
    checkpoints.close()
    (run_dir / "config.json").write_text(json.dumps(cfg.to_dict()))


def train_argv(*args: str) -> list[str]:
    """`python -u train.py` with the SMALL settings, then `args` (for subprocess tests)."""
    import sys

    return [sys.executable, "-u", "train.py", *[a for s in SMALL for a in ("--set", s)], *args]


def logged_losses(run_dir) -> dict[int, float]:
    """{step: loss} from a run's metrics.jsonl (the last record of a step logged twice; the
    evaluation records, which have no loss, left out)."""
    import json
    from pathlib import Path

    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines) if "loss" in r}
