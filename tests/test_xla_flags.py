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


def test_sequence_parallel_programs_compile_with_the_all_gather_pipeliner_off():
    """Under SP the step and eval programs take an option that turns XLA's all-gather pipeliner
    off, under the name this jax's XLA knows (the compile would fail on another); the strategies'
    log line names it. Without SP: no option."""
    import jax

    from conftest import small_config
    from sharding.mesh import build_mesh
    from sharding.strategies import parallelize
    from sharding.xla_flags import PIPELINER_OFF, program_options
    from training.build import compile_step, make_program

    assert program_options(False) == {}
    (name, off), = program_options(True).items()
    assert (name, off) in PIPELINER_OFF
    cfg = small_config("dp=2,tp=2", "parallel.sequence_parallel=true")
    mesh = build_mesh(cfg.parallel, jax.devices()[:4])
    program = make_program(cfg, mesh)
    assert program.strategies.compiler_options == {name: off}
    assert program.strategies.describe().endswith(f", xla {name}={off if isinstance(off, str) else 'false'}")
    compile_step(program.step_fn, mesh, program.state, program.abstract_batch())
    assert parallelize(small_config("dp=2,tp=2"), dict(mesh.shape)).compiler_options == {}


def test_cli_lists_the_flags_and_refuses_an_unknown_argument():
    run = lambda *a: subprocess.run([sys.executable, "-m", "sharding.xla_flags", *a], capture_output=True, text=True,  # noqa: E731
                                    timeout=60, env=dict(os.environ, JAX_PLATFORMS="cuda"))
    listed = run()
    assert listed.returncode == 0 and all(f.flag in listed.stdout for f in GPU_FLAGS), listed.stderr
    bogus = run("--bogus")
    assert bogus.returncode == 2 and "unrecognized arguments: --bogus" in bogus.stderr and not bogus.stdout
