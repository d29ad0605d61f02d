"""`make gpu-check`'s device stages (bench/gpu.py): what the card is, what it really does, and
how fast each attention core runs on it.

  environment_info  device name and count, CUDA/cuDNN as jaxlib reports them, versions, the
                    XLA/JAX/NCCL/CUDA environment, jax.print_environment_info()
  ceilings          a bf16 matmul's TFLOP/s and a copy's GB/s, as fractions of the datasheet
  attention_speed   pallas, pallas-mosaic, cudnn, xla forward and forward+backward TFLOP/s
                    per L (cudnn recorded as unavailable off a GPU)

A piece jax cannot report is recorded as "unavailable: ...", never fatal.
"""

from __future__ import annotations

import argparse
import os
import re

from bench.attention import CORES
from bench.common import error_text
from tools.measure import environment, median_seconds

ENV_PREFIXES = ("XLA_", "JAX_", "NCCL_", "CUDA_", "TF_", "NVIDIA_")


def _try(fn):
    try:
        return fn()
    except Exception as err:  # noqa: BLE001 -- a missing piece is reported, never fatal
        return f"unavailable: {error_text(err)}"


def cuda_versions() -> dict:
    """CUDA runtime/driver and cuDNN versions as jaxlib reports them (None off CUDA builds)."""
    from jax._src import lib

    cv = getattr(lib, "cuda_versions", None)
    if cv is None:
        return {"cuda": "unavailable: jaxlib has no CUDA plugin loaded"}
    names = ("cuda_runtime_get_version", "cuda_driver_get_version", "cudnn_get_version",
             "cufft_get_version", "cusolver_get_version", "cublas_get_version", "cusparse_get_version")
    return {n.removesuffix("_get_version"): _library_version(getattr(cv, n)) if hasattr(cv, n) else "unavailable"
            for n in names}


def _library_version(get_version):
    """A CUDA library's version, as `_try`; a library that is not installed makes jaxlib's call
    fail with an untranslated SystemError ('nanobind ... exception could not be translated!'),
    which jax's CUDA plugin reads as 'Unable to load ...': said so here too."""

    def call():
        try:
            return get_version()
        except SystemError:
            return "unavailable: jaxlib could not load the library (not installed?)"

    return _try(call)


def environment_info() -> dict:
    import jax

    from training.metrics import peak_flops

    device = jax.devices()[0]
    peak = peak_flops(device)
    return environment(jax.devices()) | {
        "devices": [str(d) for d in jax.devices()],
        "compute_capability": getattr(device, "compute_capability", None),
        "datasheet_bf16_tflops": peak / 1e12 if peak else None,
        "cuda_versions": cuda_versions(),
        "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith(ENV_PREFIXES)},
        "jax_environment_info": _try(lambda: jax.print_environment_info(return_string=True)),
    }


def ceilings(n: int, copy_bytes: int, runs: int) -> dict:
    """A bf16 [n, n] @ [n, n] matmul's TFLOP/s and an fp32 `x + 1` pass over `copy_bytes` as the
    copy bandwidth (read + write counted): what this card really does, the ceiling of every
    later figure; each the median of `runs` timed runs of 10 calls."""
    import jax
    import jax.numpy as jnp

    from training.metrics import peak_flops

    a, b = (jax.random.normal(k, (n, n), jnp.float32).astype(jnp.bfloat16) for k in jax.random.split(jax.random.key(0)))
    matmul = jax.jit(jnp.matmul).lower(a, b).compile()
    matmul_s = median_seconds(matmul, (a, b), runs, inner=10)
    x = jnp.zeros(copy_bytes // 4, jnp.float32)
    copy_s = median_seconds(jax.jit(lambda x: x + 1), (x,), runs, inner=10)
    tflops, peak = 2 * n**3 / matmul_s / 1e12, peak_flops(jax.devices()[0])
    hlo = matmul.as_text()
    target = re.search(r'custom_call_target="([^"]+)"', hlo)
    return {
        "matmul": f"bf16 [{n},{n}] @ [{n},{n}], 2*n^3 FLOPs, random normal data",
        "matmul_kernel": target.group(1) if target else ("triton gemm" if "triton_gemm" in hlo else "xla fusion"),
        "matmul_ms": matmul_s * 1e3, "matmul_tflops": tflops,
        "matmul_fraction_of_peak": tflops * 1e12 / peak if peak else None,
        "copy": f"fp32 x + 1 over {copy_bytes} bytes: read + write counted",
        "copy_ms": copy_s * 1e3, "copy_gbps": 2 * copy_bytes / copy_s / 1e9,
    }


def attention_speed(lengths: tuple[int, ...], heads: tuple[int, int, int], more: tuple[tuple[int, int], ...],
                    tokens: int, runs: int, cores: tuple[str, ...] = CORES) -> dict:
    """bench/attention.py's `measure` of each of `cores` at each L (causal, bf16, heads = N, K,
    H), then at each (L, H) of `more` (N and K as before): forward and forward+backward TFLOP/s,
    also as fractions of the datasheet peak."""
    import jax

    from bench.attention import core_fn, measure
    from training.metrics import peak_flops

    n, kv, head_dim = heads
    ns = argparse.Namespace(tokens=tokens, heads=n, kv_heads=kv, dtype="bfloat16", steps=runs)
    peak, rows = peak_flops(jax.devices()[0]), []
    for length, h in [(length, head_dim) for length in lengths] + list(more):
        for core in cores:
            if core == "cudnn" and jax.default_backend() != "gpu":
                rows.append({"core": core, "causal": True, "length": length, "head_dim": h,
                             "status": "unavailable on cpu"})
                continue
            row = measure(core, lambda c=core: core_fn(c, True), True, length, h, ns)
            if peak and "forward_tflops" in row:
                row["forward_fraction_of_peak"] = row["forward_tflops"] * 1e12 / peak
                row["forward_backward_fraction_of_peak"] = row["forward_backward_tflops"] * 1e12 / peak
            rows.append(row)
    return {"flops": "forward 4*B*N*L^2*H halved (causal); forward+backward 3.5x forward", "rows": rows}
