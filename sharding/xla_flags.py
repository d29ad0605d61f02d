"""XLA_FLAGS that meshtrain sets before jax is imported (XLA reads them once, at start-up).

Imports no jax: `train.py`, the benchmarks and the test conftest call `with_flags` first.
`python -m sharding.xla_flags` prints what would be set here, each flag with its reason.

Every platform:
- Fake host devices: `--xla_force_host_platform_device_count=N` makes the CPU platform show N
  devices, so a mesh of any shape runs on one machine.
- A workaround: jax 0.10 lowers a psum inside a partially manual shard_map (our tensor-parallel
  regions: manual over `tensor`, automatic over the other axes) with a sharding constraint in
  the reduction body. XLA CPU's all-reduce-promotion pass, which widens bf16 all-reduces to fp32,
  cannot clone such a body and aborts the compile. Without the pass the CPU reduces bf16
  directly. On GPUs the pass only widens 16-bit integers, which meshtrain never all-reduces.

NVIDIA GPUs (`GPU_FLAGS`, added when a CUDA jax plugin is installed or JAX_PLATFORMS names
cuda/gpu; `MESHTRAIN_GPU_FLAGS=0` leaves XLA's defaults). Each is what practitioners set for
sharded training, with its source. The GPU check (`make gpu-check`) records the flags in force
next to its figures; these flags act on collectives, so measuring them needs several GPUs, which
no session here has had. (Not here: --xla_gpu_enable_dynamic_slice_fusion, XLA's own default
from jax 0.11 on, which gpu-check's flags stage times on and off.) A flag already in XLA_FLAGS is
never overridden, so `XLA_FLAGS=--xla_gpu_enable_latency_hiding_scheduler=false` turns one off.
XLA parses every `--xla_gpu_*` flag on every platform and dies on an unknown one, so
tests/test_xla_flags.py starts a CPU backend with these flags to catch a renamed flag.

Per program, over all of these and over the user's XLA_FLAGS too: `program_options`
(jax.jit's compiler_options, set by training/build.py from the run's strategies) turns the
all-gather pipeliner off where sequence parallelism makes it cost more than it can give; it
imports jax, when called.

Memory, set by the user, not here: jax preallocates 75% of GPU memory at start-up.
`XLA_PYTHON_CLIENT_MEM_FRACTION=0.9` gives the step more (practitioners use 0.8-0.9; lower it
when NCCL user buffers or NVLS need their own memory); `XLA_PYTHON_CLIENT_PREALLOCATE=false`
allocates on demand, which fragments: for debugging only.
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
from typing import Mapping, NamedTuple

FAKE_DEVICES = "--xla_force_host_platform_device_count"
WORKAROUNDS = ("--xla_disable_hlo_passes=all-reduce-promotion",)
GPU_SWITCH = "MESHTRAIN_GPU_FLAGS"


class Flag(NamedTuple):
    flag: str
    reason: str


GPU_FLAGS = (
    Flag("--xla_gpu_enable_latency_hiding_scheduler=true",
         "schedule async collectives early and their waits late, so they overlap compute "
         "(NVIDIA JAX-Toolbox GPU_performance.md; MaxText GPU configs)"),
    Flag("--xla_gpu_enable_pipelined_all_gather=true",
         "FSDP's per-layer weight all-gather inside the layer scan starts one iteration early "
         "(JAX-Toolbox GPU_performance.md); off under sequence parallelism (program_options)"),
    Flag("--xla_gpu_enable_pipelined_reduce_scatter=true",
         "FSDP's per-layer gradient reduce-scatter in the backward scan finishes one iteration "
         "late, behind the next layer's compute (JAX-Toolbox GPU_performance.md)"),
    Flag("--xla_gpu_enable_pipelined_all_reduce=true",
         "the same for all-reduces inside the layer scan (data-parallel gradients) "
         "(JAX-Toolbox GPU_performance.md)"),
    Flag("--xla_gpu_all_reduce_combine_threshold_bytes=1073741824",
         "merge small gradient all-reduces into calls of up to 1 GiB: one NCCL launch each "
         "instead of one per tensor (MaxText Llama 3.1 405B GPU config)"),
    Flag("--xla_gpu_all_gather_combine_threshold_bytes=134217728",
         "merge FSDP weight all-gathers up to 128 MiB (MaxText Llama 3.1 405B GPU config)"),
    Flag("--xla_gpu_reduce_scatter_combine_threshold_bytes=134217728",
         "merge FSDP gradient reduce-scatters up to 128 MiB (MaxText Llama 3.1 405B GPU config)"),
    Flag("--xla_gpu_nccl_termination_timeout_seconds=600",
         "a collective whose peers never arrive (a dead node) ends the process after 10 minutes "
         "instead of hanging forever; XLA's default is no timeout (Marin's trainer sets 600)"),
)


# The all-gather pipeliner off, as XLA names it: jax 0.12's enum, else the older bool
PIPELINER_OFF = (("xla_gpu_pipeline_all_gather", "COLLECTIVE_PIPELINING_MODE_OFF"),
                 ("xla_gpu_enable_pipelined_all_gather", False))


def program_options(sequence_parallel: bool) -> dict[str, str | bool]:
    """XLA options of one program (jax.jit's compiler_options, training/build.py), over the flags
    above and any in XLA_FLAGS: under sequence parallelism the all-gather pipeliner is off. It
    also moves SP's activation all-gathers across the loops, and the compiled step then sums
    rows over tensor again and holds more: for H100s (bench/results/pipelined-all-gather-sp-h100-compiled.json)
    125m unrolled on fsdp=4,tp=2, 2 microbatches of 2 x 1024, the tensor bytes 1.50x the
    contract (1.00x off) and XLA's peak 1.82x under remat none, 1.46x and 1.50x under full;
    llama3-8b scanned (4 layers) 1.06x and 1.15x on fsdp=4,tp=2, 1.06x and 1.01x on dp=2,tp=4.
    Elsewhere it stays on: FSDP's gathers in the layer scan are what it is for."""
    return _pipeliner_off() if sequence_parallel else {}


@functools.cache
def _pipeliner_off() -> dict[str, str | bool]:
    """The first of PIPELINER_OFF that this jax's XLA takes (a trivial compile each: the option
    was renamed, and a name XLA does not know fails the compile)."""
    import jax  # here, not at the top: this module is imported before jax (module docstring)

    for name, off in PIPELINER_OFF:
        try:
            jax.jit(lambda x: x, compiler_options={name: off}).lower(0.0).compile()
        except jax.errors.JaxRuntimeError:
            continue
        return {name: off}
    raise RuntimeError(f"XLA takes none of {', '.join(n for n, _ in PIPELINER_OFF)}: its option was renamed again")


def gpu_expected(env: Mapping[str, str] = os.environ) -> bool:
    """Whether jax will pick NVIDIA GPUs: JAX_PLATFORMS names cuda/gpu, or (unset) a CUDA jax
    plugin is installed. Decided without importing jax, which must see the final XLA_FLAGS."""
    platforms = env.get("JAX_PLATFORMS", "")
    if platforms:
        return any(p in platforms for p in ("cuda", "gpu"))
    names = (d.metadata["Name"] or "" for d in importlib.metadata.distributions())
    return any(n.lower().replace("_", "-").startswith("jax-cuda") for n in names)


def gpu_flags(env: Mapping[str, str] = os.environ) -> tuple[Flag, ...]:
    """The GPU defaults in force: GPU_FLAGS, unless MESHTRAIN_GPU_FLAGS=0 or no GPU is expected."""
    if env.get(GPU_SWITCH, "1") == "0" or not gpu_expected(env):
        return ()
    return GPU_FLAGS


def _name(flag: str) -> str:
    return flag.split("=", 1)[0]


def with_flags(current: str, devices: int | None = None, env: Mapping[str, str] = os.environ) -> str:
    """`current` XLA_FLAGS plus the workarounds, the GPU defaults (when a GPU is expected) and,
    if given and unset, the fake device count. A flag already in `current` keeps its value."""
    flags = current.split()
    flags += [w for w in WORKAROUNDS if w not in flags]
    present = {_name(f) for f in flags}
    flags += [f.flag for f in gpu_flags(env) if _name(f.flag) not in present]
    if devices and FAKE_DEVICES not in present:
        flags.append(f"{FAKE_DEVICES}={devices}")
    return " ".join(flags)


def describe(env: Mapping[str, str] = os.environ) -> str:
    """One line per flag meshtrain adds on this machine, with its reason."""
    gpu = gpu_flags(env)
    lines = [f"{w}  (XLA CPU workaround; see sharding/xla_flags.py)" for w in WORKAROUNDS]
    lines += [f"{f.flag}  ({f.reason})" for f in gpu]
    if not gpu:
        why = f"{GPU_SWITCH}=0" if env.get(GPU_SWITCH) == "0" else "no NVIDIA GPU expected"
        lines.append(f"GPU defaults off: {why}")
    return "\n".join(lines)


if __name__ == "__main__":
    from configs.parser import Parser

    Parser(describe.__doc__, prog="python -m sharding.xla_flags").parse_args()
    print(describe())
