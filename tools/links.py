"""The link each mesh axis crosses, and the time a collective's bytes take on it.

Datasheet links: NVLink 450 GB/s per GPU when the axis and the axes inside it fit in one node of
8 GPUs, InfiniBand 50 GB/s per GPU (400 Gb/s NIC per GPU) otherwise. With measured links
(`tools.plan --bandwidth`, read by tools/bandwidth.py) an axis they cover takes latency + bytes /
busbw of its fit instead: the contract's bytes (tools/traffic.py) are bus bytes, as nccl-tests
counts them.
"""

from __future__ import annotations

import math

from sharding.mesh import AXES

NVLINK, INFINIBAND, GPUS_PER_NODE = 450e9, 50e9, 8
Links = dict[str, tuple[float, float]]  # measured {axis: (latency_s, bytes_per_s)}


def link_bandwidth(sizes: dict[str, int], axis: str) -> float:
    """NVLink when `axis` and every axis inside it fit in one node, else InfiniBand."""
    inner = math.prod(sizes[a] for a in AXES[AXES.index(axis):])
    return NVLINK if inner <= GPUS_PER_NODE else INFINIBAND


def datasheet_link(sizes: dict[str, int], axis: str) -> str:
    """'datasheet NVLink 450 GB/s' or 'datasheet InfiniBand 50 GB/s': the link `link_bandwidth` assumes."""
    bandwidth = link_bandwidth(sizes, axis)
    return f"datasheet {'NVLink' if bandwidth == NVLINK else 'InfiniBand'} {bandwidth / 1e9:.0f} GB/s"


def comm_time(sizes: dict[str, int], axis: str, nbytes: float, links: Links | None) -> float:
    """Seconds for `nbytes` of bus bytes on `axis`: latency + bytes / bandwidth of its measured
    link (links: {axis: (latency_s, bytes_per_s)}), else bytes / the datasheet link."""
    if links and axis in links:
        latency, bandwidth = links[axis]
        return latency + nbytes / bandwidth
    return nbytes / link_bandwidth(sizes, axis)
