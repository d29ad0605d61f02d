"""Compile for NVIDIA GPUs this machine does not have: an H100 or H200 described, not attached.

jax's CUDA plugin can build a GPU topology from a target description instead of from devices
(XLA's deviceless compilation: `jax.experimental.topologies.get_topology_desc(platform='cuda',
topology='1x1xN', target_config=...)`, the GpuTargetConfig proto XLA's own GPU specs are written
in). Arrays placed on its compile-only devices compile through XLA's whole GPU pipeline: its
fusion and scheduling passes with meshtrain's GPU flags, NCCL collectives, cuDNN and Triton
and Mosaic GPU kernels, ptxas down to sm_90a machine code; nothing can run. The code that asks
which device it is built for (`sharding.cores.target`) must be told, inside
`sharding.cores.building_for(...)`. Users: tools/gpu_compile.py (the flash kernels' registers)
and `tools.plan --compile-for-gpu` (a dry run's memory and census as XLA GPU compiles them).

Needs the plugin, ptxas and libdevice (`pip install -e '.[gpu-compile]'`, 1.3 GB; cuDNN too, for
the cudnn attention core: `jax[cuda13]`), no driver. The extra holds nvJitLink too, as jax[cuda13]
on a GPU machine does (the lent H200's image): XLA (libnvjitlink mode auto) and Mosaic GPU then
assemble PTX in-process instead of starting ptxas once per kernel (188 starts for tiny dp=2,tp=2
pallas: 8.1 s -> 7.1 s of compile, jax 0.12, 2 cores, the same memory), and the Mosaic GPU
kernels' register counts are the GPU machine's path's (tools/gpu_compile.py: 123 against ptxas's
127 for the H = 64 dq). The figures below are NVIDIA's H100/H200
SXM datasheets' (memory as nvidia-smi reports it); the rest is every compute capability 9.0
part's. Why by hand: jax ships no target descriptions, and XLA's live in its source tree.
"""

from __future__ import annotations

import contextlib
import ctypes.util
import dataclasses
import importlib.metadata
import importlib.util
import os
from collections.abc import Iterator

from configs import ConfigError
from sharding.xla_flags import with_flags

MIB = 1 << 20
AUTOTUNE = "--xla_gpu_autotune_level"  # off for compile-only devices (check_plugin)
COMPILERS = ("jax-cuda13-plugin", "jax-cuda12-plugin", "nvidia-cuda-nvcc", "nvidia-cuda-nvcc-cu12", "nvidia-nvjitlink",
             "nvidia-nvjitlink-cu12", "nvidia-cudnn-cu13", "nvidia-cudnn-cu12")


@dataclasses.dataclass(frozen=True)
class Gpu:
    """What XLA's GPU compiler reads of a device (GpuDeviceInfoProto)."""

    kind: str  # jax's device_kind
    memory_mib: int
    bandwidth: float  # bytes/s
    capability: tuple[int, int] = (9, 0)
    sms: int = 132
    l2_bytes: int = 50 * MIB
    clock_ghz: float = 1.98

    def target_config(self) -> str:
        major, minor = self.capability
        return f"""gpu_device_info {{
  cuda_compute_capability {{ major: {major} minor: {minor} }}
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_block_optin: 232448
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
  core_count: {self.sms}
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {int(self.bandwidth)}
  l2_cache_size: {self.l2_bytes}
  clock_rate_ghz: {self.clock_ghz}
  device_memory_size: {self.memory_mib * MIB}
}}
platform_name: "CUDA"
device_description_str: "{self.kind}"
"""


GPUS = {"h100": Gpu("NVIDIA H100 80GB HBM3", 81559, 3.35e12), "h200": Gpu("NVIDIA H200", 143771, 4.8e12)}


def version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def compiler_versions() -> dict[str, str]:
    """The installed plugin, ptxas and cuDNN packages, for a record."""
    return {p: v for p in COMPILERS if (v := version(p))}


def plugin_installed() -> bool:
    """Whether jax's CUDA plugin (13 or 12) is installed."""
    if importlib.util.find_spec("jax_plugins") is None:
        return False
    return any(importlib.util.find_spec(f"jax_plugins.xla_cuda{v}") for v in (13, 12))


def cudnn_compiles() -> bool:
    """Whether XLA GPU compiles a cuDNN call here without a GPU: jaxlib < 0.12.1 emits the call
    as it is; from 0.12.1 it builds cuDNN's graph at compile time, whose engines load the CUDA
    driver (libcuda.so.1: "StreamExecutor is null and deviceless cuDNN compilation is not
    enabled" without one), and the cuDNN wheel must be installed either way."""
    return not cudnn_fix()


def cudnn_fix() -> str:
    """Why XLA GPU cannot compile a cuDNN call here without a GPU, and what to do ('' where it
    can: `cudnn_compiles`)."""
    if version("nvidia-cudnn-cu13") is None and version("nvidia-cudnn-cu12") is None:
        return "pip install nvidia-cudnn-cu13, or plan --set model.attention=pallas"
    release = tuple(int(part) for part in (version("jaxlib") or "0").split(".")[:3] if part.isdigit())
    if release < (0, 12, 1) or ctypes.util.find_library("cuda") is not None:
        return ""
    return (f"jaxlib {version('jaxlib')} builds cuDNN's graph as it compiles, which loads the CUDA driver "
            "(libcuda.so.1), absent here: plan --set model.attention=pallas (a fused core of the same memory "
            "terms), or compile with jaxlib < 0.12.1")


def check_plugin(who: str) -> None:
    """A ConfigError naming the install, where the plugin is missing; else, before jax is
    imported: meshtrain's GPU flags in XLA_FLAGS (sharding/xla_flags.py, as on a GPU machine;
    MESHTRAIN_GPU_FLAGS=0 still turns them off), and the plugin's start-up check of the driver
    and cuPTI skipped (this machine has neither; compiling needs neither). A flag left by the
    tests, `--xla_backend_optimization_level` (LLVM off, to compile CPU programs faster), is
    dropped: it changes the GPU code too (the H = 64 flash forward was no longer clean with it).

    Autotuning is off (`--xla_gpu_autotune_level=0` unless XLA_FLAGS sets a level): a compile-only
    device cannot time a candidate, so XLA's config assigner instead compiles candidate GEMM
    configurations until one compiles, about half of the compile. Measured with tools.plan
    --compile-for-gpu (jax 0.12, 2 cores): tiny dp=2,tp=2 pallas 26.4 s -> 12.6 s, fsdp=2,tp=2
    cudnn 25.2 -> 13.6, pp=2,dp=2 gpipe 32.4 -> 17.4, 125m fsdp=2,tp=2 53.0 -> 37.9; memory
    analysis and collective census identical in all four. A real GPU autotunes by timing, which
    neither choice reproduces."""
    if not plugin_installed():
        raise ConfigError(f"{who} needs jax's CUDA plugin (no GPU needed): pip install -e '.[gpu-compile]'")
    kept = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith("--xla_backend_optimization_level")]
    if not any(f.startswith(f"{AUTOTUNE}=") for f in kept):
        kept.append(f"{AUTOTUNE}=0")
    os.environ["XLA_FLAGS"] = with_flags(" ".join(kept), env={**os.environ, "JAX_PLATFORMS": "cuda"})
    os.environ["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"] = "1"


def devices(gpu: Gpu, count: int) -> list:
    """`count` compile-only devices of `gpu`, one host (`check_plugin` first). jax's persistent
    compilation cache is turned off for the process: jax writes what compiles for these devices
    to it but cannot read it back (jax 0.12.1: "PjRtCompiler must be constructed with a Client
    to call DeserializeLoadedExecutable"), so a second compile of the same program warned and
    compiled again where JAX_COMPILATION_CACHE_DIR is set."""
    import jax
    from jax.experimental import topologies

    jax.config.update("jax_enable_compilation_cache", False)

    try:
        topology = topologies.get_topology_desc(platform="cuda", topology=f"1x1x{count}",
                                                target_config=gpu.target_config())
    except (NotImplementedError, jax.errors.JaxRuntimeError) as e:
        raise ConfigError(f"jax {jax.__version__} cannot compile for {count} x {gpu.kind} here: "
                          f"{str(e).strip().splitlines()[0]}") from None
    return list(topology.devices)


@contextlib.contextmanager
def listed(compile_only: list) -> Iterator[None]:
    """Within: `jax.devices()` lists the compile-only devices. jax's Hopper kernel for the
    experts' weight gradient (transposed_ragged_dot_mgpu, model/kernels/grouped_matmul.py) sizes
    its grid by `jax.devices()[0].core_count` while it is traced, and this machine's devices are
    CPUs; the compile-only GPU has the target's 132 SMs."""
    import jax

    listing = jax.devices
    jax.devices = lambda backend=None: compile_only
    try:
        yield
    finally:
        jax.devices = listing
