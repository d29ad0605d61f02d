"""tools/oom.py: an out-of-memory step becomes one line naming a change that the estimate fits."""

import re

import pytest

from configs import apply_overrides, get_preset
from sharding.mesh import parse_mesh
from tools.estimate import memory
from tools.oom import advice, is_disk_full, is_out_of_memory

H100 = 80e9
ONE = {"stage": 1, "data": 1, "fsdp": 1, "expert": 1, "sequence": 1, "tensor": 1}


def test_xla_allocation_failures_are_recognised():
    assert is_out_of_memory(RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 8.00GiB."))
    assert not is_out_of_memory(RuntimeError("INVALID_ARGUMENT: shapes differ"))
    full = ValueError('RESOURCE_EXHAUSTED: Error writing "opt_state.mu" in OCDBT database at local file '
                      '"/runs/a/checkpoints/3.orbax-checkpoint-tmp/": No space left on device [OS error: No space left '
                      'on device]')  # what tensorstore raised when a checkpoint filled the disk
    assert is_disk_full(full) and not is_out_of_memory(full)


def _apply(cfg, suggestion: str, sizes: dict):
    """cfg and sizes with the --set and --mesh of an advice line applied."""
    sets = re.findall(r"--set (\S+)", suggestion)
    mesh = re.search(r"--mesh (\S+)", suggestion)
    if mesh:
        sizes = {a: getattr(parse_mesh(mesh.group(1)), a) for a in ONE}
    return apply_overrides(cfg, sets), sizes


@pytest.mark.parametrize(
    "preset, sets, mesh, fix",
    [
        # a smaller micro batch first: the same FLOPs, where remat recomputes the forward
        # 1b's default on one H100: 16 sequences, 57.1 GiB measured and the sweep's fastest row
        # (bench/results/batch-1b-*.json); the estimate before its terms were measured said 8
        ("1b", [], ONE, "--set train.micro_batch_size=16"),
        ("125m", ["model.remat=none", "model.attention=xla"], ONE, "--set train.micro_batch_size=32"),  # its scores
        # one sequence of 64k tokens: only remat helps, unrolled (the preset's default) and scanned
        ("1b", ["train.seq_len=65536", "train.global_batch_size=1"], ONE, "try --set model.remat=full"),
        ("1b", ["train.seq_len=65536", "train.global_batch_size=1", "model.scan_layers=true"], ONE,
         "try --set model.remat=full"),
        # remat alone does not fit 8 such sequences at once: both
        ("1b", ["train.seq_len=65536", "train.global_batch_size=8"], ONE,
         "--set train.micro_batch_size=2 --set model.remat=full"),
        ("llama3-8b", ["train.micro_batch_size=0"], ONE | {"fsdp": 8}, "--set train.micro_batch_size="),
        ("llama3-8b", ["train.micro_batch_size=0"], ONE | {"data": 8}, "--mesh fsdp=8 --set model.remat=full"),
    ],
)
def test_advice_names_a_change_that_fits(preset, sets, mesh, fix):
    cfg = apply_overrides(get_preset(preset), sets)
    assert memory(cfg, mesh)["peak"] > H100
    line = advice(cfg, mesh, H100, "NVIDIA H100 80GB HBM3")
    assert line.startswith("out of device memory on NVIDIA H100") and fix in line
    assert f"model.remat={cfg.model.remat}" in line and "GiB per device" in line
    fix_given = line.split("; try ")[1]
    for setting in ("model.remat=full", "model.scan_layers=true"):  # each only where the case expects it
        assert (setting in fix_given) == (setting in fix), (setting, fix_given)
    fixed, sizes = _apply(cfg, fix_given, mesh)
    assert memory(fixed, sizes)["peak"] <= H100


def test_advice_when_nothing_fits_says_add_devices():
    line = advice(get_preset("llama3-8b"), ONE, H100, "NVIDIA H100 80GB HBM3")
    assert "no mesh of 1 devices fits it: add devices" in line


def test_a_plan_that_does_not_fit_names_the_fix_that_fits():
    """The plan's verdict gives the OOM advice's remedy, settings in force not offered: 1b with 64
    sequences a microbatch on one H100, a smaller micro batch; with 1 sequence of 65,536 tokens
    (no smaller micro batch), remat full, unrolled and scanned alike (unrolled remat full keeps
    what the scan keeps under full: its checkpoints hold unrolled too, model/remat.py). The limit
    is printed to 0.1 GiB (74.5, not 75: a 74.7 GiB peak read as 'does NOT fit ... of 75 GiB')."""
    from tools.plan_report import plan
    from tools.roofline import GPUS

    cfg = apply_overrides(get_preset("1b"), ["train.micro_batch_size=64"])
    verdict = plan(cfg, ONE, GPUS["h100"], None)["verdict"]
    assert "does NOT fit" in verdict and "GiB estimated, of 74.5 GiB)" in verdict, verdict
    smaller = apply_overrides(cfg, [verdict.split("; try --set ")[1]])
    assert smaller.train.micro_batch_size < 64 and plan(smaller, ONE, GPUS["h100"], None)["fits"]
    long = apply_overrides(get_preset("1b"), ["train.micro_batch_size=1", "train.seq_len=65536"])
    for scan in ("false", "true"):
        verdict = plan(apply_overrides(long, [f"model.scan_layers={scan}"]), ONE, GPUS["h100"], None)["verdict"]
        assert verdict.endswith("; try --set model.remat=full"), verdict
    unrolled_full = apply_overrides(cfg, ["model.remat=full"])
    assert memory(unrolled_full, ONE)["peak"] == memory(
        apply_overrides(unrolled_full, ["model.scan_layers=true"]), ONE)["peak"] < 0.5 * memory(cfg, ONE)["peak"]
