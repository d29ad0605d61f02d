"""Out of device memory: one `error:` line that names what would fit, from the analytic model.

XLA reports a failed device allocation (at compile time for the step's static buffers, or when
the first step runs) as an XlaRuntimeError whose text starts with RESOURCE_EXHAUSTED. train.py
turns that into a ConfigError with this module's advice instead of a traceback. The advice
uses tools/estimate.py and tools/search.py (no jax), in order of least cost to the step: the
largest smaller micro_batch_size that fits (more accumulation steps, the same global batch, the
same FLOPs), then full remat on the same mesh (it recomputes the forward, about a third more
FLOPs), then both, then the best-ranked
mesh of the same device count (or, when no mesh of that count splits the batch, the batch that
one splits). Measured for the order: 1b on one H100, unrolled under remat none, ran 432 ms a
step at 8 sequences x 2 accumulated and 416 at 16 x 1, against 539 ms under remat full with the
scan at 8 x 2 (bench/results/batch-1b-nvidia-h100-80gb-hbm3-20261126.json,
gpu-nvidia-h100-80gb-hbm3-20261126-second.json). The estimate is a model, not XLA's allocator: the
advice says so.
"""

from __future__ import annotations

import dataclasses
import math

from configs import RunConfig, apply_overrides
from sharding.mesh import format_mesh
from tools.estimate import memory
from tools.roofline import GPU, GPUS
from tools.search import fit, no_mesh_takes, search, settings
from tools.shape import GiB

MARKERS = ("resource_exhausted", "out of memory")


def is_out_of_memory(error: BaseException) -> bool:
    """Whether `error` is a device allocation failure reported by XLA (not a full disk, which
    tensorstore reports as RESOURCE_EXHAUSTED too: `is_disk_full`)."""
    text = str(error).lower()
    return any(m in text for m in MARKERS) and not is_disk_full(error)


def is_disk_full(error: BaseException) -> bool:
    """Whether `error` is a write that found no space left on the disk (a checkpoint save)."""
    return "no space left on device" in str(error).lower()


def advice(cfg: RunConfig, sizes: dict[str, int], device_bytes: float, device: str) -> str:
    """What ran out, the estimated peak, and the smallest change that the estimate says fits."""
    t = cfg.train
    # Rates (for ranking meshes) from the datasheet entry of this GPU kind, memory as reported.
    kind = next((g for name, g in GPUS.items() if name in device.lower()), GPUS["h100"])
    gpu = dataclasses.replace(kind, memory=device_bytes)
    what = (f"out of device memory on {device} ({device_bytes / GiB:.1f} GiB each): {cfg.name} on mesh "
            f"{format_mesh(sizes)} with model.remat={cfg.model.remat}"
            f"{'' if cfg.model.scan_layers else ', model.scan_layers=false'}, train.micro_batch_size="
            f"{t.micro_batch_size or 'all'} needs about {memory(cfg, sizes)['peak'] / GiB:.1f} GiB per device "
            "(tools.estimate)")
    return f"{what}; {remedy(cfg, sizes, gpu)}"


def remedy(cfg: RunConfig, sizes: dict[str, int], gpu: GPU) -> str:
    """The cheapest change the estimate says fits `gpu.memory`, in this order: a smaller micro
    batch, remat full, both, the planner's best mesh of as many devices (settings already in
    force are not offered)."""
    remat_full, full_sets = apply_overrides(cfg, ["model.remat=full"]), "--set model.remat=full"
    smaller = fit(cfg, sizes, gpu)
    if smaller is not None and memory(smaller, sizes)["peak"] < memory(cfg, sizes)["peak"]:
        return f"try --set train.micro_batch_size={smaller.train.micro_batch_size}"
    if remat_full != cfg and memory(remat_full, sizes)["peak"] <= gpu.memory:
        return f"try {full_sets}"
    smaller = fit(remat_full, sizes, gpu)
    if smaller is not None:
        return f"try --set train.micro_batch_size={smaller.train.micro_batch_size} {full_sets}"
    devices = math.prod(sizes.values())
    ranked, rejected = search(remat_full, devices, gpu)
    if ranked:
        best = ranked[0]
        sets = " ".join(f"--set {s}" for s in ["model.remat=full", *settings(best)])
        return f"try --mesh {format_mesh(best['sizes'])} {sets} (the planner's best fit: python train.py --dry-run)"
    if not rejected:  # no mesh was too big: none splits the batch
        return no_mesh_takes(cfg, devices)
    return f"no mesh of {devices} devices fits it: add devices (python -m tools.plan --search)"

