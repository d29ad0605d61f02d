"""sharding/xla_flags.py: which flags are added where, and that XLA accepts every GPU flag."""

import os
import subprocess
import sys

from sharding.xla_flags import FAKE_DEVICES, GPU_FLAGS, WORKAROUNDS, gpu_expected, with_flags

GPU_ENV = {"JAX_PLATFORMS": "cuda"}


def test_gpu_defaults_only_where_a_gpu_is_expected():
    on_gpu = with_flags("", env=GPU_ENV).split()
    assert [f.flag for f in GPU_FLAGS] == [f for f in on_gpu if f.startswith("--xla_gpu")]
    assert not any(f.startswith("--xla_gpu") for f in with_flags("", 8, env={"JAX_PLATFORMS": "cpu"}).split())
    off = with_flags("", env=GPU_ENV | {"MESHTRAIN_GPU_FLAGS": "0"}).split()
    assert off == list(WORKAROUNDS)
    assert gpu_expected({"JAX_PLATFORMS": "cuda,cpu"}) and not gpu_expected({"JAX_PLATFORMS": "cpu"})


def test_user_flags_win_and_nothing_is_repeated():
    mine = "--xla_gpu_enable_latency_hiding_scheduler=false --xla_force_host_platform_device_count=2"
    flags = with_flags(mine, 8, env=GPU_ENV).split()
    assert "--xla_gpu_enable_latency_hiding_scheduler=false" in flags
    assert "--xla_gpu_enable_latency_hiding_scheduler=true" not in flags
    assert [f for f in flags if f.startswith(FAKE_DEVICES)] == [f"{FAKE_DEVICES}=2"]
    assert with_flags(" ".join(flags), env=GPU_ENV).split() == flags


def test_xla_parses_every_gpu_flag():
    """XLA dies on an unknown flag on any platform: a renamed flag would stop every GPU run."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=" ".join(f.flag for f in GPU_FLAGS))
    code = "import jax, jax.numpy as jnp; print(float(jnp.ones(3).sum()))"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "3.0"


def test_cli_lists_the_flags_and_refuses_an_unknown_argument():
    run = lambda *a: subprocess.run([sys.executable, "-m", "sharding.xla_flags", *a], capture_output=True, text=True,  # noqa: E731
                                    timeout=60, env=dict(os.environ, JAX_PLATFORMS="cuda"))
    listed = run()
    assert listed.returncode == 0 and all(f.flag in listed.stdout for f in GPU_FLAGS), listed.stderr
    bogus = run("--bogus")
    assert bogus.returncode == 2 and "unrecognized arguments: --bogus" in bogus.stderr and not bogus.stdout
