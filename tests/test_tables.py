"""README's figure tables against bench/results/ (bench/tables.py): JSON and text only, no jax.

The first test is README's check that every figure quoted in its tables exists in
bench/results/: each marked block must equal the rendering of its record, so a figure typed by
hand, or left behind when a benchmark is re-run, fails it.
"""

import json
import re
import shutil

import pytest

from bench.figures import span, xla
from bench.tables import PROSE_ONLY, blocks, main, render
from configs import ConfigError
from conftest import ROOT, run_module

README = ROOT / "README.md"
RESULTS = ROOT / "bench" / "results"
STEP_CHANGE = "step-issue18-dp8-55231f2 step-issue18-dp8 step-issue18-fsdp4_tp2-55231f2 step-issue18-fsdp4_tp2"
TUNE = ["tune-attention-nvidia-h200-h128-warmup", "tune-attention-nvidia-h200-h128", "tune-attention-nvidia-h200-h64",
        "tune-attention-nvidia-h100-80gb-hbm3-h128", "tune-attention-nvidia-h100-80gb-hbm3-h64"]
GPU = ["gpu-nvidia-h100-80gb-hbm3-20261124", "gpu-nvidia-h200-20261126", "gpu-nvidia-h100-80gb-hbm3-20261126"]
MARKED = [*TUNE, "gpu-compile-h100", "pipeline-tiny-pp4", "step-125m-single step-tiny-single step-tiny-dp2_tp2", STEP_CHANGE, "tp-tiny",
          "context-tiny", "moe-tiny", "moe-tiny-mid", *GPU]


def test_every_readme_figure_block_is_its_records_rendering():
    text = README.read_text()
    found = blocks(text)
    assert [name for name, _, _ in found] == MARKED
    for name, start, end in found:
        assert text[start:end] == "\n" + render(name, RESULTS) + "\n\n", f"run python -m bench.tables ({name})"


def test_tables_hold_the_records_figures():
    step = render("step-125m-single step-tiny-single step-tiny-dp2_tp2", RESULTS)
    assert "3.27 / 3.63 / 3.80 s; **32 layers = 1.16x 2 layers**" in step
    assert "| 487 ms/step median, 8,413 tok/s, compile 3.4 s, temp 445 MiB per device |" in step
    assert "arguments per device 4.7 MiB vs 9.4 MiB on one device" in step
    change = render(STEP_CHANGE, RESULTS).splitlines()
    assert change[0] == "| mesh | step before: median (min-max) | after | after / before |"
    assert change[2] == "| `dp=8` | 2.14 s (2.04-2.93) at 55231f2 | 1.53 s (1.48-1.86) | 0.72 |"
    assert change[3] == "| `fsdp=4,tp=2` | 1.21 s (1.17-1.28) at 55231f2 | 0.91 s (0.88-0.96) | 0.75 |"
    expected = {
        "pipeline-tiny-pp4": ["| 1f1b | 4 / 8 / 16 | 0.429 / 0.273 / 0.158 ; 0.510 / 0.417 / 0.355 | 1.04 / 0.81 / 0.75 |",
                              "| zbv V=2 | 4 / 8 / 16 | 0.111 / 0.059 / 0.030 ; 0.155 / 0.109 / 0.084 | 0.96 / 0.83 / 0.83 |",
                              "every case: 0.61-0.80; the core floor 1 - cores/devices: 0.50."],
        "tp-tiny": ["| 8 | 1.00 | 0.94 | 0.72 | 0.89 | 84.1 / 63.3 / 63.6 / 63.6 |", "move 24-40% fewer bytes"],
        "context-tiny": ["| 1 | 512 | single device | 129.0 (1.00) | 0 |",
                         "At every sp > 1, allgather is 5-37% faster than ring."],
        "moe-tiny": ["| 4, 2 | 1.25 / 0.40 | 158.1 / 70.8 | 5 (3+2) / 4 (2+2) | 24.0 (12.0) / 7.5 (3.8) |",
                     "Capacity dispatch is 2.0-3.1x as fast as dropless", "grouped 65.1 ms, dense loop 1.03x, batched 0.21x."],
        "moe-tiny-mid": ["| 1, 8 | 1.00 (8.34 s) / 0.44 |"],
        "gpu-compile-h100": ["| 128 | dkv | triton 64x128 w8 s3 | 255 registers | mosaic 64x64 s2 | 255 registers, "
                             "spills 564 B | 20 / 38 |", "| 128 | dq | mosaic 64x64 s2 | 182 registers | mosaic 64x64 s2 | "
                             "182 registers |", "Compiled for NVIDIA H100 80GB HBM3 on a CPU machine"],
        "gpu-nvidia-h100-80gb-hbm3-20261124": [
            "bf16 8192³ GEMM 699 TFLOP/s (71% of peak, __cublas$lt$matmul), copy 2.88 TB/s; correctness pass (10 checks).",
            "| 8192 | 338 / 196 | 521 / 496 | 42 / 57 |", "| 1b, dots | 68,560 | 455 | 46.1% | 478 / 450 ms | 0.94 |",
            "Profile (1b, 2 steps: 582 ms of kernels a step): matmul 45%, elementwise/other 30%, copy 17%, "
            "attention kernel 9% of the kernel time."],
        "gpu-nvidia-h200-20261126": [
            "| 4096 | 225 / 274 | 257 / 263 | 313 / 417 | 44 / 59 |", "| 1b, none | 63,914 | 425 | 42.9% | 513 / 380 ms | 0.74 |",
            "| 1b, none, unrolled | 79,117 | 526 | 53.1% | 414 / 380 ms | 0.92 |"],
        "tune-attention-nvidia-h200-h128-warmup": [
            "| forward | triton 128x64 w8 s2: 228 | mosaic 64x64 s2: 401 | triton 128x64 w4 s2: 370 | mosaic 64x64 s2: 401 |",
            "| dkv | triton 64x128 w8 s2: 354 | triton 64x128 w8 s3: 360 | triton 64x128 w8 s3: 360 | mosaic 64x64 s2: 288 |",
            "| pallas-tuned | 364 / 360 | 0.81 |", "| cudnn | 429 / 443 | 1.00 |"],
        "tune-attention-nvidia-h200-h64": ["| pallas-tuned | 180 / 237 | - |"],
        "gpu-nvidia-h100-80gb-hbm3-20261126": [
            "| 8192 | 398 / 416 | 402 / 312 | 486 / 485 | 42 / 58 |", "| 1b, none | 56,585 | 376 | 38.0% | 579 / 410 ms | 0.71 |",
            "| 1b, none, unrolled | 76,019 | 505 | 51.1% | 431 / 410 ms | 0.95 |",
            "Profile (1b, none, 2 steps: 585 ms of kernels a step): matmul 45%, elementwise/other 30%, copy 16%",
            "Profile (1b, none, unrolled, 2 steps: 428 ms of kernels a step): matmul 65%, elementwise/other 21%, "
            "attention kernel 14%, copy 0%"],
        "tune-attention-nvidia-h100-80gb-hbm3-h128": [
            "| dkv | triton 64x128 w8 s3: 378 | triton 64x128 w8 s3: 378 | triton 64x128 w8 s3: 378 | mosaic 64x64 s2: 295 |",
            "| pallas-default | 373 / 377 | 0.90 |", "| pallas-tuned | 357 / 372 | 0.88 |"],
        "tune-attention-nvidia-h100-80gb-hbm3-h64": [
            "| forward | triton 128x64 w4 s2: 240 | mosaic 64x64 s2: 303 | triton 128x64 w8 s3: 289 | mosaic 64x64 s2: 303 |",
            "| pallas-default | 242 / 254 | 0.81 |", "| pallas-tuned | 295 / 295 | 0.94 |", "| cudnn | 288 / 313 | 1.00 |"],
    }
    for name, figures in expected.items():
        table = render(name, RESULTS)
        for figure in figures:
            assert figure in table, (name, figure)


def test_a_gpu_record_names_the_head_dim_of_an_attention_row_at_another():
    """bench.gpu's attention stage adds H = 64 at L = 4096 after the H = 128 lengths: its row
    says so, the H = 128 rows read as before."""
    from bench.figures import gpu_table

    record = json.loads((RESULTS / "gpu-nvidia-h100-80gb-hbm3-20261126.json").read_text())
    rows = record["stages"]["attention"]["rows"]
    rows += [r | {"head_dim": 64, "forward_tflops": r["forward_tflops"] / 2} for r in rows if r["length"] == 4096]
    table = gpu_table(record)
    assert "| 4096 | 364 / 374 | 378 / 291 | 463 / 418 | 41 / 55 |" in table
    assert "| 4096, H = 64 | 182 / 374 | 189 / 291 | 231 / 418 | 20 / 55 |" in table


def test_memory_fields_of_old_and_new_records():
    assert xla({"temp_size_in_bytes": 7}, "temp") == 7
    assert xla({"temp": 5, "temp_size_in_bytes": 7}, "temp") == 5


def test_every_record_readme_names_is_marked_or_prose_only():
    text = README.read_text()
    named = {stem for stem in re.findall(r"([\w-]+)\.json", text) if (RESULTS / f"{stem}.json").is_file()}
    named |= set(re.findall(r"bench/results/([\w-]+)\.json", text))
    marked = {stem for name, _, _ in blocks(text) for stem in name.split()}
    assert marked == {"gpu-compile-h100", "pipeline-tiny-pp4", "step-125m-single", "step-tiny-single", "step-tiny-dp2_tp2", "tp-tiny",
                      "context-tiny", "moe-tiny", "moe-tiny-mid", *GPU, *TUNE, *STEP_CHANGE.split()}
    assert named - marked == set(PROSE_ONLY)
    assert not marked & set(PROSE_ONLY)


def copy(tmp_path):
    """README and the records it quotes, as the checkout lays them out."""
    shutil.copytree(RESULTS, tmp_path / "bench" / "results")
    shutil.copy(README, tmp_path / "README.md")
    return tmp_path / "README.md"


def test_check_names_a_stale_block_and_rewriting_fixes_it(tmp_path):
    readme = copy(tmp_path)
    assert run_module("bench.tables", "--check", "--readme", str(readme)).returncode == 0
    stale = README.read_text().replace("| 4, 2 | 1.25 / 0.40 |", "| 4, 2 | 1.26 / 0.40 |")
    readme.write_text(stale)
    out = run_module("bench.tables", "--check", "--readme", str(readme))
    assert out.returncode == 1
    assert out.stdout.splitlines() == [f"{readme}: <!-- figures: moe-tiny --> differs from its record; "
                                       f"run: python -m bench.tables --readme {readme}"]
    assert readme.read_text() == stale
    out = run_module("bench.tables", "--readme", str(readme))
    assert out.returncode == 0 and "1 figure block(s) rewritten" in out.stdout
    assert readme.read_text() == README.read_text()


def assert_refused(readme, expected: str) -> None:
    """Both modes: exit code 2, one `error:` line naming `expected`, README as it was."""
    before = readme.read_text()
    for args in (["--check"], []):
        out = run_module("bench.tables", *args, "--readme", str(readme))
        assert out.returncode == 2
        assert out.stderr.splitlines() == [out.stderr.strip()] and out.stderr.startswith("error: ")
        assert expected in out.stderr and "Traceback" not in out.stderr
        assert readme.read_text() == before


def test_a_missing_record_is_one_error_line(tmp_path):
    readme = copy(tmp_path)
    readme.write_text(README.read_text().replace("| 4, 2 | 1.25 / 0.40 |", "| 4, 2 | 1.26 / 0.40 |"))
    (tmp_path / "bench" / "results" / "tp-tiny.json").unlink()
    assert_refused(readme, "<!-- figures: tp-tiny -->: no record")


def test_a_record_with_a_failed_case_renders_no_table(tmp_path):
    """bench.pipeline keeps the other rows when a case fails (bench.common.attempt); such a
    record is not README's figures."""
    readme = copy(tmp_path)
    path = tmp_path / "bench" / "results" / "pipeline-tiny-pp4.json"
    record = json.loads(path.read_text())
    record["schedules"][1] = {key: record["schedules"][1][key] for key in ("schedule", "microbatches")} | {
        "error": "XlaRuntimeError: RESOURCE_EXHAUSTED: Out of memory"}
    path.write_text(json.dumps(record))
    assert_refused(readme, f"{path}: 1 failed case(s), the first: XlaRuntimeError: RESOURCE_EXHAUSTED")


def test_an_unclosed_marker_is_one_error_line(tmp_path):
    readme = copy(tmp_path)
    text = README.read_text()
    last = text.rindex("<!-- /figures -->")
    readme.write_text(text[:last] + text[last + len("<!-- /figures -->"):])
    assert_refused(readme, f"<!-- figures: {MARKED[-1]} --> is never closed")


@pytest.mark.parametrize("mode", [["--check"], []])
def test_a_readme_without_figure_blocks_is_refused(tmp_path, mode):
    readme = tmp_path / "empty.txt"
    readme.write_text("# no tables here\n")
    with pytest.raises(ConfigError, match=f"--readme {readme}: no <!-- figures: NAME --> .* block, so no table to "):
        main([*mode, "--readme", str(readme)])
    assert readme.read_text() == "# no tables here\n"


def test_a_readme_that_is_a_directory_or_missing_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=f"--readme {tmp_path}: a directory; name the README file, e.g. --readme "
                                          f"{tmp_path}/README.md"):
        main(["--check", "--readme", str(tmp_path)])
    with pytest.raises(ConfigError, match=f"--readme {tmp_path}/nope.md: no such file"):
        main(["--check", "--readme", str(tmp_path / "nope.md")])


def test_a_span_that_prints_as_one_figure_is_one_figure():
    assert span([1.21, 1.24], ".1f") == "1.2" and span([1.0, 2.04], ".1f") == "1.0-2.0"
