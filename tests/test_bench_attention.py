"""bench/attention.py and bench/tune_attention.py run end to end on tiny shapes and write
complete records (no timing asserted: the kernels are interpreted on CPU)."""

import json

import pytest

from bench.attention import main, parse_args as attention_args
from bench.tune_attention import main as tune, parse_args
from configs import ConfigError
from conftest import GPU_INTERPRET


def test_attention_benchmark_writes_json(tmp_path):
    out_file = tmp_path / "attention.json"
    argv = ["--lengths", "64", "--head-dims", "64", "--heads", "2", "--kv-heads", "1", "--tokens", "64",
            "--masks", "causal", "--steps", "1", "--cores", "pallas,pallas-mosaic,cudnn,xla,jax-triton,jax-mgpu",
            "--out", str(out_file)]
    assert main(argv) == 0
    record = json.loads(out_file.read_text())
    rows = {r["core"]: r for r in record["rows"]}
    assert set(rows) == {"pallas", "pallas-mosaic", "cudnn", "xla", "jax-triton", "jax-mgpu"}
    for core in ("pallas", "xla") + (("pallas-mosaic",) if GPU_INTERPRET else ()):
        assert rows[core]["forward_tflops"] > 0 and rows[core]["forward_backward_tflops"] > 0
    if not GPU_INTERPRET:
        assert "GPU interpret mode (jax >= 0.11" in rows["pallas-mosaic"]["error"]
    assert all("NVIDIA GPU" in rows[c]["error"] for c in ("cudnn", "jax-triton", "jax-mgpu"))  # the tests run on CPU
    assert record["interpret_mode"] and record["command"].startswith("python -m bench.attention")


def test_tune_attention_sweeps_each_kernel_and_keeps_the_fastest(tmp_path):
    """bench/tune_attention.py at tiny shapes (interpreted): every tile of the grid for each
    kernel in turn, the tuned tiling made of each kernel's fastest tile, then default and tuned
    side by side with the references (cudnn: an error on CPU)."""
    out_file = tmp_path / "tune.json"
    argv = ["--length", "64", "--head-dim", "16", "--heads", "2", "--kv-heads", "1", "--tokens", "64",
            "--blocks", "32", "--warps", "4,8", "--stages", "2", "--mosaic-blocks", "none", "--steps", "1",
            "--references", "cudnn", "--out", str(out_file)]
    assert tune(argv) == 0
    record = json.loads(out_file.read_text())
    assert [r["kernel"] for r in record["sweep"]] == ["forward"] * 2 + ["dq"] * 2 + ["dkv"] * 2
    for kernel, timed in (("forward", "forward"), ("dq", "forward_backward"), ("dkv", "forward_backward")):
        rows = [r for r in record["sweep"] if r["kernel"] == kernel]
        assert all(r[f"{timed}_tflops"] > 0 for r in rows)
        fastest = min(rows, key=lambda r: r[f"{timed}_ms"])
        assert record["tuned"][kernel] == {k: fastest[k] for k in ("block_q", "block_k", "warps", "stages", "lowering")}
    compare = {r["core"]: r for r in record["compare"]}
    assert list(compare) == ["pallas-default", "pallas-tuned", "cudnn"] and "NVIDIA GPU" in compare["cudnn"]["error"]
    assert all(compare[c]["forward_backward_tflops"] > 0 for c in ("pallas-default", "pallas-tuned"))
    assert record["interpret_mode"] and record["tuned_line"].startswith("Tiling(Tile(32, 32, ")


def test_tune_attention_weighs_the_mosaic_kernels(tmp_path):
    """Each kernel's sweep also runs its Mosaic GPU tiles (interpreted where this jax can: >=
    0.11; else each is an error row naming the version), dk/dv at 64 x 64 only, and the tuned
    line names the lowering of a kernel whose fastest tile is Mosaic's."""
    out_file = tmp_path / "tune.json"
    assert tune(["--length", "64", "--head-dim", "64", "--heads", "2", "--kv-heads", "1", "--tokens", "64",
                 "--blocks", "64", "--warps", "4", "--stages", "2", "--mosaic-blocks", "64,128", "--steps", "1",
                 "--references", "none", "--out", str(out_file)]) == 0
    record = json.loads(out_file.read_text())
    tiles = [(r["kernel"], r["lowering"], r["block_k"]) for r in record["sweep"]]
    assert tiles == [("forward", "triton", 64), ("forward", "mosaic", 64), ("forward", "mosaic", 128),
                     ("dq", "triton", 64), ("dq", "mosaic", 64), ("dq", "mosaic", 128),
                     ("dkv", "triton", 64), ("dkv", "mosaic", 64)]
    mosaic = [r for r in record["sweep"] if r["lowering"] == "mosaic"]
    if GPU_INTERPRET:
        assert all("error" not in r for r in mosaic), mosaic
    else:
        assert all("GPU interpret mode (jax >= 0.11" in r["error"] for r in mosaic), mosaic
    named = record["tuned_line"].count(", lowering='mosaic')")
    assert named == sum(t["lowering"] == "mosaic" for t in record["tuned"].values())


def test_tune_attention_past_its_budget_keeps_the_default(tmp_path):
    out_file = tmp_path / "tune.json"
    assert tune(["--length", "64", "--head-dim", "16", "--heads", "2", "--kv-heads", "1", "--tokens", "64",
                 "--blocks", "32", "--warps", "4", "--stages", "2", "--mosaic-blocks", "none", "--steps", "1",
                 "--references", "none", "--budget", "0", "--out", str(out_file)]) == 0
    record = json.loads(out_file.read_text())
    assert [r["status"] for r in record["sweep"]] == ["skipped: past --budget"] * 3
    assert record["tuned"] == record["default"] and [r["core"] for r in record["compare"]] == ["pallas-default",
                                                                                                "pallas-tuned"]


def test_tune_attention_refuses_a_bad_grid():
    with pytest.raises(ConfigError, match="powers of two"):
        parse_args(["--blocks", "48"])
    with pytest.raises(ConfigError, match="--references"):
        parse_args(["--references", "flash"])
    with pytest.raises(ConfigError, match="--mosaic-blocks 32: powers of two of 64 or more"):
        parse_args(["--mosaic-blocks", "32"])


def test_heads_not_a_multiple_of_kv_heads_is_refused():
    """It ran (rc 0) with an einsum error as the row, recorded as a result."""
    for parse in (attention_args, parse_args):
        with pytest.raises(ConfigError, match=r"--heads 2 is not a multiple of --kv-heads 3 \(each kv head serves"):
            parse(["--heads", "2", "--kv-heads", "3"])
