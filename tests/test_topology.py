"""tools/topology.py on CPU: the mesh placement build_mesh makes (one process: every axis inside
it; a synthetic two-process grid: the outer axis crosses), the "not available" lines where there
is no nvidia-smi or InfiniBand, NICs read from a sysfs-like tree, and --json."""

import json
import shutil

import numpy as np
import pytest

from conftest import run_module
from tools.topology import INFINIBAND, nics, nodes_along


def test_nodes_along_a_two_process_grid():
    """dp=2,tp=4 over 2 processes of 4 devices, as build_mesh's hybrid mesh lays it: data crosses."""
    processes = np.array([0, 0, 0, 0, 1, 1, 1, 1]).reshape(1, 2, 1, 1, 4)
    assert [nodes_along(processes, i) for i in range(5)] == [1, 2, 1, 1, 1]


def test_nics_from_sysfs(tmp_path):
    net, ib = tmp_path / "net", tmp_path / "infiniband"
    for name, state, speed in (("eth0", "up", "100000"), ("lo", "unknown", None), ("veth", "up", "-1")):
        (net / name).mkdir(parents=True)
        (net / name / "operstate").write_text(state + "\n")
        if speed:
            (net / name / "speed").write_text(speed + "\n")
    port = ib / "mlx5_0" / "ports" / "1"
    port.mkdir(parents=True)
    (port / "state").write_text("4: ACTIVE\n")
    (port / "rate").write_text("400 Gb/sec (4X NDR)\n")
    found = nics(net, ib)
    assert found["net"] == [{"name": "eth0", "state": "up", "speed_mbps": 100000},
                            {"name": "lo", "state": "unknown", "speed_mbps": None},
                            {"name": "veth", "state": "up", "speed_mbps": None}]
    assert found["infiniband"] == [{"name": "mlx5_0", "port": "1", "state": "4: ACTIVE", "rate": "400 Gb/sec (4X NDR)"}]
    assert nics(tmp_path / "absent", tmp_path / "absent") == {"net": None, "infiniband": None}


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="checks the lines of a machine without NVIDIA")
def test_cli_prints_the_placement_and_what_is_not_available():
    out = run_module("tools.topology", "--mesh", "dp=2,tp=4")
    assert out.returncode == 0, out.stderr
    assert "devices: 8 local, 8 global (cpu)" in out.stdout
    assert "  data        dp=2    inside a node" in out.stdout and "  tensor      tp=4    inside a node" in out.stdout
    assert "nvidia-smi topo -m: not available: no nvidia-smi on PATH" in out.stdout
    if not INFINIBAND.is_dir():
        assert f"InfiniBand ({INFINIBAND}): not available (absent)" in out.stdout
    report = json.loads(run_module("tools.topology", "--mesh", "dp=2,tp=4", "--json").stdout)
    assert report["process_count"] == 1 and report["global_devices"] == 8 and report["mesh"] == "dp=2,tp=4"
    assert {p["axis"]: p["nodes"] for p in report["placement"]} == dict.fromkeys(
        ("stage", "data", "fsdp", "expert", "sequence", "tensor"), 1)
    assert report["nvidia_smi_topo"]["available"] is False


def test_bad_mesh_is_one_error_line():
    out = run_module("tools.topology", "--mesh", "dp=x")
    assert out.returncode == 2 and out.stderr == "error: --mesh 'dp=x': size of dp must be an integer, got 'x'\n"
