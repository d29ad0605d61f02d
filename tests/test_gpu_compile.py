"""tools/gpu_compile.py: ptxas's log read right, bad input refused, and, where jax's CUDA plugin is
installed (the `gpu-compile` extra, CI's newest-jax pass), the flash attention kernels compiled
for an H100 on this CPU machine with the default tiles clean (no spill, no serialized wgmma)."""

import json
import os

import pytest

from conftest import run_module
from configs import ConfigError
from tools import gpu_compile, gpu_target

PLUGIN = gpu_target.plugin_installed()

# Two kernels as ptxas -v logs them through XLA (one log message per kernel, C++ log prefix).
LOG = """I1125 07:20:43.783928   28478 subprocess_compilation.cc:356] ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'forward_kernel' for 'sm_90a'
ptxas info    : Function properties for forward_kernel
ptxas info    : Used 157 registers, used 1 barriers
ptxas info    : Compile time = 80.5 ms
I1125 07:20:44.259956   28479 subprocess_compilation.cc:349] ptxas info    : (C7511) Potential Performance Loss: \
wgmma.mma_async instructions are serialized due to insufficient register resources for the wgmma pipeline in \
the function 'dkv_kernel' in line 2384
ptxas warning : Registers are spilled to local memory in function 'dkv_kernel', 372 bytes spill stores, 392 bytes spill loads
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'dkv_kernel' for 'sm_90a'
ptxas info    : Function properties for dkv_kernel
ptxas info    : Used 255 registers, used 1 barriers, 264 bytes cumulative stack size
I1125 07:20:45.1   28479 subprocess_compilation.cc:356] ptxas info    : (C7515) Potential Performance Loss: \
wgmma.mma_async instructions are serialized due to non wgmma instructions defining accumulator registers of a \
wgmma between start and end of the pipeline stage in the function 'dq_kernel'
ptxas info    : Compiling entry function 'dq_kernel' for 'sm_90a'
ptxas info    : Used 208 registers, used 1 barriers
"""


def test_ptxas_report_reads_registers_spills_and_serialized_wgmmas():
    assert gpu_compile.ptxas_report(LOG) == {
        "forward_kernel": {"registers": 157, "spill_stores": 0, "spill_loads": 0, "wgmma_serialized": False},
        "dkv_kernel": {"registers": 255, "spill_stores": 372, "spill_loads": 392,
                       "wgmma_serialized": "insufficient register resources"},
        "dq_kernel": {"registers": 208, "spill_stores": 0, "spill_loads": 0, "wgmma_serialized":
                      "non wgmma instructions defining accumulator registers of a wgmma between start and end "
                      "of the pipeline stage"},
    }


def test_rows_name_each_kernel_and_whether_it_is_clean():
    from model.kernels.flash_attention import default_tiling

    rows = gpu_compile.rows_for("all", default_tiling(128), LOG, None, 128)
    assert [(r["kernel"], r["clean"]) for r in rows] == [("forward", True), ("dq", False), ("dkv", False)]
    assert rows[2]["spill_stores"] == 372 and rows[0]["registers"] == 157
    failed = gpu_compile.rows_for("dq", default_tiling(128), "", "RESOURCE_EXHAUSTED: Shared memory", 128)
    assert failed[0]["compile_error"] == "the program did not compile: RESOURCE_EXHAUSTED: Shared memory"
    assert not failed[0]["clean"]


def test_the_suggestion_prefers_larger_tiles_then_the_owned_block():
    rows = [{"kernel": "dkv", "block_q": bq, "block_k": bk, "warps": w, "stages": 2}
            for bq, bk, w in ((128, 32, 8), (64, 128, 8), (128, 64, 8), (64, 128, 4))]
    assert [(r["block_q"], r["block_k"], r["warps"]) for r in sorted(rows, key=gpu_compile.preference)] == [
        (64, 128, 4), (64, 128, 8), (128, 64, 8), (128, 32, 8)]


@pytest.mark.parametrize("argv, message", [
    (["--head-dims", "0"], "--head-dims needs positive integers"),
    (["--heads", "6", "--kv-heads", "4"], "--heads 6 must be a multiple of --kv-heads 4"),
    (["--length", "0"], "--length must be at least 1"),
])
def test_bad_input_is_one_line_naming_the_flag(argv, message):
    with pytest.raises(ConfigError, match=message):
        gpu_compile.parse_args(argv)


def test_without_the_cuda_plugin_it_says_what_to_install(monkeypatch):
    monkeypatch.setattr(gpu_target.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConfigError, match=r"needs jax's CUDA plugin.*pip install -e '\.\[gpu-compile\]'"):
        gpu_compile.main([])


@pytest.mark.parametrize("versions, driver, fix", [
    ({"jaxlib": "0.12.0.1", "nvidia-cudnn-cu13": "9.28.1.4"}, None, ""),
    ({"jaxlib": "0.12.1", "nvidia-cudnn-cu13": "9.28.1.4"}, "libcuda.so.1", ""),
    ({"jaxlib": "0.12.1", "nvidia-cudnn-cu13": "9.28.1.4"}, None, "jaxlib 0.12.1 builds cuDNN's graph as it "
     "compiles, which loads the CUDA driver (libcuda.so.1), absent here: plan --set model.attention=pallas"),
    ({"jaxlib": "0.12.0.1"}, None, "pip install nvidia-cudnn-cu13, or plan --set model.attention=pallas"),
])
def test_where_cudnn_cannot_compile_without_a_gpu_it_says_why(monkeypatch, versions, driver, fix):
    """cuDNN's attention compiles without a GPU on jaxlib < 0.12.1, and from 0.12.1 only where the
    CUDA driver's library loads; never without the cuDNN wheel."""
    monkeypatch.setattr(gpu_target, "version", versions.get)
    monkeypatch.setattr(gpu_target.ctypes.util, "find_library", lambda name: driver)
    found = gpu_target.cudnn_fix()
    assert found.startswith(fix) and (found == "") == (fix == ""), found
    assert gpu_target.cudnn_compiles() == (fix == "")


@pytest.mark.parametrize("given, level", [("", "0"), ("--xla_gpu_autotune_level=4", "4")])
def test_compile_only_flags_turn_autotuning_off_unless_asked(monkeypatch, given, level):
    """check_plugin's XLA_FLAGS: autotuning off (a compile-only device cannot time a candidate)
    unless the user set a level; the tests' LLVM-off flag dropped."""
    monkeypatch.setattr(gpu_target, "plugin_installed", lambda: True)
    monkeypatch.setenv("XLA_FLAGS", f"--xla_backend_optimization_level=0 {given}")
    monkeypatch.delenv("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", raising=False)  # check_plugin sets it: restored after
    gpu_target.check_plugin("test")
    flags = os.environ["XLA_FLAGS"].split()
    assert [f for f in flags if f.startswith(gpu_target.AUTOTUNE)] == [f"{gpu_target.AUTOTUNE}={level}"]
    assert not [f for f in flags if f.startswith("--xla_backend_optimization_level")]


@pytest.mark.skipif(not PLUGIN, reason="jax's CUDA plugin is not installed (pip install -e '.[gpu-compile]')")
def test_kernels_compile_for_an_h100_and_the_default_tiles_are_clean(tmp_path):
    """Every kernel of the default and the Mosaic GPU tilings assembles for sm_90a (registers
    within the 255 a thread can have); the default tiles neither spill nor serialize their wgmmas."""
    out = tmp_path / "h100.json"
    done = run_module("tools.gpu_compile", "--head-dims", "64,128", "--length", "1024", "--heads", "8",
                      "--kv-heads", "2", "--out", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads(out.read_text())
    assert record["environment"]["compiled_for"] == "NVIDIA H100 80GB HBM3"
    rows = record["rows"]
    assert {(r["head_dim"], r["kernel"], r["lowering"]) for r in rows} == {
        (h, k, lowering) for h in (64, 128) for k in ("forward", "dq", "dkv") for lowering in ("triton", "mosaic")}
    assert all(0 < r.get("registers", 0) <= 255 for r in rows), [r for r in rows if "registers" not in r]
    for h in (64, 128):
        for kernel in ("forward", "dq", "dkv"):
            verdict = record["summary"][f"h{h}-{kernel}"]
            assert verdict["default_clean"], (h, kernel, verdict)
    assert "h128-dkv: default triton 64x128 w8 s3 clean" in done.stdout
    assert "h128-forward: default mosaic 64x64" in done.stdout  # the Hopper default at H = 128
