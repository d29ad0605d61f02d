"""The device mesh: parse `--mesh`, resolve it against the device count, build it.

Axes, outermost first: (stage, data, fsdp, expert, sequence, tensor). `tensor` and `sequence` are
innermost so that their per-layer collectives stay on the fast intra-node links (NVLink);
`data`, `fsdp` and `stage` may cross nodes (InfiniBand). With several processes the mesh is
built hybrid: each axis is split into a node-local (ICI) factor, filled innermost first, and a
cross-node (DCN) factor; a tensor axis that would cross nodes is refused.

Parsing and resolving import no jax (train.py runs them before jax is imported, to choose the
number of fake CPU devices); only `build_mesh` needs jax.
"""

from __future__ import annotations

import dataclasses
import math
import os

from configs.base import ConfigError, ParallelConfig

AXES = ("stage", "data", "fsdp", "expert", "sequence", "tensor")
ALIASES = {"pp": "stage", "dp": "data", "ep": "expert", "sp": "sequence", "tp": "tensor"}
SHORT = {v: k for k, v in ALIASES.items()} | {"fsdp": "fsdp"}


def parse_mesh(spec: str, base: ParallelConfig = ParallelConfig()) -> ParallelConfig:
    """'dp=8,tp=8' -> `base` with data=8, tensor=8 and the other axes 1 (its flags kept)."""
    sizes: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, sep, value = part.partition("=")
        axis = ALIASES.get(name.strip(), name.strip())
        if not sep or axis not in AXES:
            raise ConfigError(
                f"--mesh {spec!r}: {part!r} is not axis=size; axes are pp dp fsdp ep sp tp "
                f"(or {' '.join(AXES)}), e.g. --mesh dp=2,tp=4"
            )
        if axis in sizes:
            raise ConfigError(f"--mesh {spec!r}: axis {axis} given twice")
        try:
            sizes[axis] = int(value)
        except ValueError:
            raise ConfigError(f"--mesh {spec!r}: size of {name} must be an integer, got {value!r}") from None
        if sizes[axis] == 0 or sizes[axis] < -1:
            raise ConfigError(f"--mesh {spec!r}: size of {name} must be positive or -1 (fill)")
    if list(sizes.values()).count(-1) > 1:
        raise ConfigError(f"--mesh {spec!r}: only one axis may be -1 (fill with the remaining devices)")
    return dataclasses.replace(base, **({a: 1 for a in AXES} | sizes))


def format_mesh(shape: dict[str, int]) -> str:
    """{'data': 8, 'tensor': 8, ...} -> 'dp=8,tp=8' (axes of size 1 left out)."""
    return ",".join(f"{SHORT[a]}={n}" for a, n in shape.items() if n != 1) or "single device"


def requested_devices(parallel: ParallelConfig) -> int | None:
    """Devices the mesh needs, or None when one axis is -1 (it fills whatever exists)."""
    sizes = [getattr(parallel, a) for a in AXES]
    return None if -1 in sizes else math.prod(sizes)


def resolve_shape(parallel: ParallelConfig, n_devices: int) -> dict[str, int]:
    """Fill the -1 axis and check that the product equals the device count."""
    sizes = {a: getattr(parallel, a) for a in AXES}
    fixed = math.prod(n for n in sizes.values() if n != -1)
    fill = [a for a, n in sizes.items() if n == -1]
    if fill:
        if n_devices % fixed:
            raise ConfigError(
                f"--mesh {format_mesh(sizes)}: the fixed axes multiply to {fixed}, which does not "
                f"divide the {n_devices} devices present; make their product a divisor of {n_devices}, or give "
                f"{SHORT[fill[0]]} a size too (e.g. --mesh {format_mesh(sizes | {fill[0]: 2})}: on CPU that many fake "
                "devices are then made)"
            )
        sizes[fill[0]] = n_devices // fixed
    elif fixed != n_devices:
        rest = fixed // sizes["data"]
        hint = (
            f" (e.g. {format_mesh(sizes | {'data': n_devices // rest})})"
            if n_devices % rest == 0 else ""
        )
        raise ConfigError(
            f"--mesh {format_mesh(sizes)} needs {fixed} devices but {n_devices} are available: "
            f"change the axis sizes so that they multiply to {n_devices}{hint}, "
            "or put -1 on one axis to fill"
        )
    return sizes


def split_hybrid(sizes: dict[str, int], local_devices: int) -> tuple[list[int], list[int]]:
    """Split each axis into (node-local, cross-node) factors, innermost axes local first."""
    ici, dcn, room = [], [], local_devices
    for axis in reversed(AXES):
        local = math.gcd(sizes[axis], room)
        if axis == "tensor" and local != sizes[axis]:
            raise ConfigError(
                f"--mesh tp={sizes[axis]} would cross nodes ({local_devices} devices per process): "
                "tensor parallelism all-reduces activations every layer and needs the intra-node "
                f"links; keep tp a divisor of {local_devices}"
            )
        ici.insert(0, local)
        dcn.insert(0, sizes[axis] // local)
        room //= local
    if room != 1:
        raise ConfigError(
            f"--mesh {format_mesh(sizes)} does not tile the {local_devices} devices of each process; "
            "make the innermost axes multiply to a multiple of the per-process device count"
        )
    return ici, dcn


def check_backend() -> None:
    """jax's devices, or one error line when its backend cannot start (JAX_PLATFORMS naming a
    platform this machine or this jaxlib lacks, a broken CUDA install)."""
    import jax

    try:
        jax.devices()
    except (RuntimeError, AssertionError) as e:  # AssertionError: jax 0.10 with no backend left at all
        platforms = os.environ.get("JAX_PLATFORMS")
        cause = (str(e).splitlines() or ["no backend"])[0][:200]
        hint = (f"JAX_PLATFORMS={platforms} names a platform jax cannot start here: unset it, or set cpu"
                if platforms else "check the CUDA install (python -c 'import jax; print(jax.devices())')")
        raise ConfigError(f"jax could not start its backend ({cause or type(e).__name__}); {hint}") from None


def build_mesh(parallel: ParallelConfig, devices=None):
    """The 6-axis jax Mesh with Auto axis types (GSPMD propagates what we do not pin); on jax's
    devices by default (a backend that cannot start is one ConfigError: check_backend)."""
    import jax
    from jax.experimental import mesh_utils

    if devices is None:
        check_backend()
    devices = list(jax.devices() if devices is None else devices)
    sizes = resolve_shape(parallel, len(devices))
    auto = (jax.sharding.AxisType.Auto,) * len(AXES)
    if jax.process_count() == 1:
        return jax.make_mesh(tuple(sizes.values()), AXES, axis_types=auto, devices=devices)
    ici, dcn = split_hybrid(sizes, jax.local_device_count())
    grid = mesh_utils.create_hybrid_device_mesh(ici, dcn, devices, process_is_granule=True)
    return jax.sharding.Mesh(grid, AXES, axis_types=auto)


def mesh_config(mesh, base: ParallelConfig) -> ParallelConfig:
    """`base` with the resolved axis sizes of a built mesh (for the saved config)."""
    return dataclasses.replace(base, **dict(mesh.shape))
