"""XLA_FLAGS that meshtrain sets before jax is imported (XLA reads them once, at start-up).

Imports no jax: `train.py`, the benchmarks and the test conftest call `with_flags` first.

- Fake host devices: `--xla_force_host_platform_device_count=N` makes the CPU platform show N
  devices, so a mesh of any shape runs on one machine.
- A workaround: jax 0.10 lowers a psum inside a partially manual shard_map (our tensor-parallel
  regions: manual over `tensor`, automatic over the other axes) with a sharding constraint in
  the reduction body. XLA CPU's all-reduce-promotion pass, which widens bf16 all-reduces to fp32,
  cannot clone such a body and aborts the compile. Without the pass the CPU reduces bf16
  directly. On GPUs the pass only widens 16-bit integers, which meshtrain never all-reduces.
"""

from __future__ import annotations

FAKE_DEVICES = "--xla_force_host_platform_device_count"
WORKAROUNDS = ("--xla_disable_hlo_passes=all-reduce-promotion",)


def with_flags(current: str, devices: int | None = None) -> str:
    """`current` XLA_FLAGS plus the workarounds and, if given and unset, the fake device count."""
    flags = current.split()
    flags += [w for w in WORKAROUNDS if w not in flags]
    if devices and not any(f.startswith(FAKE_DEVICES) for f in flags):
        flags.append(f"{FAKE_DEVICES}={devices}")
    return " ".join(flags)
