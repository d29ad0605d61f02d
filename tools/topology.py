"""What this process sees: processes, devices, where a mesh's axes fall, the links of the node.

  python -m tools.topology                       processes, devices, nvidia-smi topo -m, NICs
  python -m tools.topology --mesh dp=2,tp=4      and the mesh's placement over the nodes
  python -m tools.topology --mesh dp=16,tp=8 --coordinator host:1234 --num-processes 2 --process-id 0
  python -m tools.topology --json

Reported: the process count and this process's index; local and global devices and their kinds;
for --mesh, the mesh `sharding.mesh.build_mesh` makes (a node is one process, as build_mesh's
hybrid mesh takes it), read back from the built mesh: per axis, how many nodes a line of devices
along it spans (1: the axis stays inside a node, on NVLink; more: it crosses nodes, on the
network); `nvidia-smi topo -m` (the GPU and NIC matrix: NV# NVLink, PIX/PXB/PHB/NODE/SYS PCIe
paths) when the binary is on PATH, else a line saying so; the NICs of /sys/class/net (state,
speed) and /sys/class/infiniband (port state, rate) when present. On CPU, fake host devices
stand for the mesh (as in train.py), all in one process: every axis stays inside it.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from configs import RunConfig
from configs.parser import Parser
from sharding.mesh import AXES, SHORT, format_mesh, parse_mesh

if TYPE_CHECKING:
    import jax

NET, INFINIBAND = Path("/sys/class/net"), Path("/sys/class/infiniband")
SMI_TIMEOUT_S = 20


def nodes_along(processes: np.ndarray, axis: int) -> int:
    """The most processes (nodes) a line of the mesh along `axis` spans; `processes` holds each
    mesh device's process index, in the mesh's shape."""
    lines = np.moveaxis(processes, axis, -1).reshape(-1, processes.shape[axis])
    return max(len(set(line.tolist())) for line in lines)


def placement(mesh: jax.sharding.Mesh) -> list[dict]:
    """Per axis of the built mesh: its size, the nodes it spans, its devices per node, inside a node or not."""
    processes = np.vectorize(lambda d: d.process_index)(mesh.devices)
    rows = []
    for i, axis in enumerate(mesh.axis_names):
        nodes = nodes_along(processes, i)
        rows.append({"axis": axis, "size": int(mesh.shape[axis]), "nodes": nodes,
                     "per_node": int(mesh.shape[axis]) // nodes, "inside_node": nodes == 1})
    return rows


def nvidia_topology() -> dict:
    """`nvidia-smi topo -m`: {available, text} (text says why when it is not available)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return {"available": False, "text": "not available: no nvidia-smi on PATH (no NVIDIA driver here)"}
    try:
        out = subprocess.run([smi, "topo", "-m"], capture_output=True, text=True, timeout=SMI_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        return {"available": False, "text": f"not available: nvidia-smi topo -m failed ({e})"}
    if out.returncode:
        return {"available": False, "text": f"not available: nvidia-smi topo -m exited {out.returncode}: "
                                            f"{out.stderr.strip() or out.stdout.strip()}"}
    return {"available": True, "text": out.stdout.rstrip()}


def _read(path: Path) -> str | None:
    """A sysfs attribute, stripped, or None where it cannot be read (a down link has no speed)."""
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _speed(path: Path) -> int | None:
    """A NIC's speed in Mb/s, or None where unknown (unreadable, or -1 as virtual NICs report it)."""
    text = _read(path)
    return int(text) if text and text.lstrip("-").isdigit() and int(text) > 0 else None


def nics(net: Path = NET, infiniband: Path = INFINIBAND) -> dict:
    """{net: [...] or None, infiniband: [...] or None}: None where the sysfs directory is absent."""
    found: dict[str, list[dict] | None] = {"net": None, "infiniband": None}
    if net.is_dir():
        found["net"] = [{"name": d.name, "state": _read(d / "operstate"), "speed_mbps": _speed(d / "speed")}
                        for d in sorted(net.iterdir())]
    if infiniband.is_dir():
        found["infiniband"] = [
            {"name": d.name, "port": p.name, "state": _read(p / "state"), "rate": _read(p / "rate")}
            for d in sorted(infiniband.iterdir()) for p in sorted((d / "ports").glob("*"))]
    return found


def report(mesh_spec: str) -> dict:
    """Everything above, as one dict (jax initialized by the caller)."""
    import jax

    from sharding.mesh import build_mesh, check_backend

    check_backend()
    devices = jax.devices()
    mesh = build_mesh(parse_mesh(mesh_spec)) if mesh_spec else None
    return {
        "process_count": jax.process_count(), "process_index": jax.process_index(),
        "platform": jax.default_backend(), "local_devices": jax.local_device_count(), "global_devices": len(devices),
        "device_kinds": dict(Counter(d.device_kind for d in devices)),
        "devices_per_process": dict(Counter(d.process_index for d in devices)),
        "mesh": format_mesh(dict(mesh.shape)) if mesh else None,
        "placement": placement(mesh) if mesh else None,
        "nvidia_smi_topo": nvidia_topology(), "nics": nics(),
    }


def format_report(r: dict) -> str:
    kinds = ", ".join(f"{n} x {k}" for k, n in r["device_kinds"].items())
    lines = [f"processes: {r['process_count']} (this is process {r['process_index']})",
             f"devices: {r['local_devices']} local, {r['global_devices']} global ({r['platform']}): {kinds}"]
    if r["placement"] is None:
        lines.append("mesh: none given (--mesh dp=2,tp=4 shows where build_mesh puts each axis)")
    else:
        lines.append(f"mesh {r['mesh']} as sharding.mesh.build_mesh makes it (a node is one process):")
        big = [p for p in r["placement"] if p["size"] > 1]
        if not big:
            lines.append("  every axis has size 1: one device")
        for p in big:
            where = ("inside a node" if p["inside_node"] else
                     f"crosses {p['nodes']} nodes ({p['per_node']} devices per node along it)")
            lines.append(f"  {p['axis']:<9} {SHORT[p['axis']]:>4}={p['size']:<4} {where}")
    smi = r["nvidia_smi_topo"]
    lines.append(f"nvidia-smi topo -m:\n{smi['text']}" if smi["available"] else f"nvidia-smi topo -m: {smi['text']}")
    net, ib = r["nics"]["net"], r["nics"]["infiniband"]
    lines.append(f"NICs ({NET}): " + ("not available (absent)" if net is None else "; ".join(
        f"{n['name']} {n['state'] or '?'}" + (f" {n['speed_mbps']} Mb/s" if n["speed_mbps"] else "") for n in net)
        or "none"))
    lines.append(f"InfiniBand ({INFINIBAND}): " + ("not available (absent)" if ib is None else "; ".join(
        f"{n['name']} port {n['port']} {n['state'] or '?'}, {n['rate'] or '?'}" for n in ib) or "none"))
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    from cli import request_fake_devices
    from training.distributed import add_process_args, initialize, process_count

    p = Parser(__doc__)
    p.add_argument("--mesh", default="", help=f"axis sizes, e.g. dp=2,tp=4 (axes pp dp fsdp sp tp, or {' '.join(AXES)})")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    add_process_args(p)
    args = p.parse_args(argv)
    parallel = parse_mesh(args.mesh) if args.mesh else None  # checked before jax starts
    request_fake_devices(RunConfig(parallel=parallel) if parallel else RunConfig(), process_count(args))
    initialize(args)
    r = report(args.mesh)
    print(json.dumps(r, indent=1) if args.json else format_report(r))
    return 0


if __name__ == "__main__":
    from cli import run_cli

    run_cli(main)
