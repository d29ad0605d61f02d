"""Which attention core runs where: `model.attention` checked and, for `auto`, chosen.

Pure functions of the config and the device (platform, CUDA compute capability), so the
planner (tools/shape.py) resolves a run for a GPU it does not have, and the build
(sharding/strategies.py) for the devices it runs on. The cores themselves are in
model/attention.py.

`auto` (the default) picks the fastest core that is correct where the run lands, from the
H100 record of `make gpu-check` (bench/results/gpu-nvidia-h100-80gb-hbm3-20261124.json;
causal, H = 128, N = 32, K = 8, bf16, forward + backward TFLOP/s):

    L      cudnn   pallas   xla
    2048    306     151      52
    4096    411     179      55
    8192    496     196      57

  NVIDIA GPU (8.0+), bf16/fp16    cudnn; pallas where cudnn cannot run (a head dim cuDNN
                                  refuses) or under context parallelism (ring/allgather),
                                  whose blocks need the log-sum-exp cudnn does not return;
                                  xla where neither runs (pallas: a head dim that is no
                                  power of two >= 16)
  NVIDIA GPU, float32 compute     xla: cuDNN takes bf16/fp16 only, and the Pallas kernel in
                                  fp32 runs its dots at 'highest' precision, which took
                                  115-124 s to compile per length on the H100 and was not timed
  CPU, TPU, older GPUs            xla (the Pallas kernel is only interpreted on CPU: for tests)
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

CORES = ("auto", "xla", "cudnn", "pallas")
FUSED_DTYPES = ("bfloat16", "float16")


def core_problem(name: str, platform: str, capability: tuple[int, int] | None, dtype: str,
                 head_dim: int) -> str | None:
    """Why core `name` cannot run on this device (None if it can). platform is jax's backend
    ('cpu', 'gpu', ...), capability the CUDA compute capability of an NVIDIA GPU.

    cudnn: jax's cuDNN flash attention takes float16/bfloat16 only, head dims that are multiples
    of 8 up to 128 (256 from Hopper, 9.0), on Ampere (8.0) or later. pallas: interpreted on CPU;
    on GPUs Triton lowers its bf16 dots from Ampere on, with power-of-two tiles of at least 16
    along the head dim. auto: runs everywhere (`choose_core`)."""
    if name not in CORES:
        return f"unknown core; choose one of {', '.join(CORES)}"
    gpu = platform == "gpu" and capability is not None
    if name == "cudnn":
        if not gpu:
            return f"needs an NVIDIA GPU (this backend is {platform}); use model.attention=auto (xla here)"
        if capability < (8, 0):
            return f"needs compute capability 8.0 or later (this GPU has {capability[0]}.{capability[1]}); use xla"
        if dtype not in FUSED_DTYPES:
            return "cuDNN attention takes bfloat16/float16 only; set model.compute_dtype=bfloat16 or use xla"
        limit = 256 if capability >= (9, 0) else 128
        if head_dim % 8 or head_dim > limit:
            return (f"cuDNN needs model.head_dim a multiple of 8 and at most {limit} (got {head_dim}); "
                    "use pallas or xla")
    if name == "pallas":
        if platform not in ("cpu", "gpu") or (platform == "gpu" and not gpu):
            return f"runs on NVIDIA GPUs (Triton) or interpreted on CPU, not on {platform}; use xla"
        if gpu and capability < (8, 0):
            return f"needs compute capability 8.0 or later (this GPU has {capability[0]}.{capability[1]}); use xla"
        if gpu and (head_dim < 16 or head_dim & (head_dim - 1)):
            return f"Triton needs model.head_dim a power of two >= 16 (got {head_dim}); use cudnn or xla"
    return None


def choose_core(name: str, platform: str, capability: tuple[int, int] | None, dtype: str, head_dim: int,
                context: bool) -> str:
    """The core a run takes: `name` itself unless it is auto, then the module docstring's rule.
    context: attention runs blockwise over the sequence axis (sp > 1, context_impl ring or
    allgather)."""
    if name != "auto":
        return name
    if platform != "gpu" or capability is None or capability < (8, 0) or dtype not in FUSED_DTYPES:
        return "xla"
    fused = ["pallas"] if context else ["cudnn", "pallas"]
    return next((c for c in fused if not core_problem(c, platform, capability, dtype, head_dim)), "xla")


def device_capability() -> tuple[int, int] | None:
    """The first device's CUDA compute capability, e.g. (9, 0) on an H100; None off NVIDIA."""
    import jax

    text = getattr(jax.devices()[0], "compute_capability", None)
    return tuple(int(x) for x in text.split(".")[:2]) if text else None


_BUILDING_FOR: contextvars.ContextVar[tuple[str, tuple[int, int] | None] | None] = contextvars.ContextVar(
    "building_for", default=None)


def target() -> tuple[str, tuple[int, int] | None]:
    """(platform, CUDA capability) that programs traced now are built for: this process's devices
    (jax's default backend and `device_capability`), or, inside `building_for`, a GPU this
    process does not have (tools/gpu_compile.py compiles for an H100 on a CPU machine)."""
    if (chosen := _BUILDING_FOR.get()) is not None:
        return chosen
    import jax

    return jax.default_backend(), device_capability()


@contextlib.contextmanager
def building_for(platform: str, capability: tuple[int, int] | None) -> Iterator[None]:
    """Within: `target()` is (platform, capability), so the attention cores and the Pallas
    kernels lower for that device whatever this process runs on."""
    token = _BUILDING_FOR.set((platform, capability))
    try:
        yield
    finally:
        _BUILDING_FOR.reset(token)
