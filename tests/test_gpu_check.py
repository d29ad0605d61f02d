"""bench/gpu.py (`make gpu-check`): the --cpu-smoke pipeline end to end, and the no-GPU line."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.gpu_mesh import label
from configs import get_preset
from conftest import GPU_INTERPRET, ROOT, child_env, run_module


def test_cpu_smoke_writes_real_numbers(tmp_path):
    out = tmp_path / "gpu.json"
    done = run_module("bench.gpu", "--cpu-smoke", "--out", str(out), "--profile-dir", str(tmp_path / "profile"))
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(out.read_text())
    assert report["smoke"] and "smoke run" in report["note"].lower()
    stages = report["stages"]
    assert not [name for name, r in stages.items() if "error" in r], stages
    assert stages["environment"]["backend"] == "cpu" and stages["environment"]["versions"]["jax"]
    assert not [v for v in stages["environment"]["cuda_versions"].values() if "nanobind" in str(v)]  # said plainly
    assert stages["ceilings"]["matmul_tflops"] > 0 and stages["ceilings"]["copy_gbps"] > 0

    from test_flash_attention import TOLERANCE

    check = stages["correctness"]
    assert check["verdict"] == "pass"
    pallas = [c for c in check["cases"] if c["core"] == "pallas"]
    assert {c["dtype"] for c in pallas} == {"bfloat16", "float32"} and len(pallas) >= 4
    assert [(c["dtype"], c["length"], c["head_dim"]) for c in pallas if c["head_dim"] != 64] == [("bfloat16", 100, 128)]
    for c in pallas:
        assert c["status"] == "pass" and 0 <= max(c["errors"].values()) < TOLERANCE[c["dtype"]], c
    assert {c["status"] for c in check["cases"] if c["core"] == "cudnn"} == {"unavailable on cpu"}
    mosaic = [c for c in check["cases"] if c["core"] == "pallas-mosaic"]
    assert {c["status"] for c in mosaic if c["dtype"] == "float32"} == {
        "n/a: flash attention: the Mosaic GPU forward takes bfloat16/float16 inputs (got float32); use the triton lowering"}
    for c in (c for c in mosaic if c["dtype"] == "bfloat16"):  # interpreted where this jax can (>= 0.11)
        if GPU_INTERPRET:
            assert c["status"] == "pass" and max(c["errors"].values()) < TOLERANCE["bfloat16"], c
        else:
            assert c["status"].startswith("n/a: flash attention: the Mosaic GPU kernels run on NVIDIA GPUs"), c
    assert [s["status"] for s in check["train_step"]] == ["pass", "pass", "unavailable on cpu"]

    rows = stages["attention"]["rows"]
    ran = [r for r in rows if r["core"] != "cudnn" and (GPU_INTERPRET or r["core"] != "pallas-mosaic")]
    assert {r["core"] for r in ran} >= {"pallas", "xla"}
    assert {(r["length"], r["head_dim"]) for r in rows} == {(128, 64), (128, 128)}  # bench_lengths, then bench_more
    assert all(r["forward_tflops"] > 0 and r["forward_backward_tflops"] > 0 for r in ran), ran
    training = stages["training"]["rows"]
    assert {r["remat"] for r in training} == {"none", "full"}
    assert all(r["status"] == "ok" and r["tokens_per_s"] > 0 for r in training), training

    flags = stages["flags"]["rows"]
    assert [(r["preset"], r["remat"], r["option"]) for r in flags] == [("tiny", "none", "xla_gpu_enable_dynamic_slice_fusion")]
    assert all(r["on"]["status"] == r["off"]["status"] == "ok" and r["ratio_off_to_on"] > 0 for r in flags), flags
    assert flags[0]["on"]["loss_first"] == flags[0]["off"]["loss_first"]  # the same step, compiled twice

    [profile] = stages["profile"]["cases"]
    assert {"attention", "mlp"} <= set(profile["scopes"]["scopes_ms"])
    assert profile["ops"]["total_ms"] > 0 and profile["ops"]["top_ops"]
    assert abs(sum(profile["ops"]["fractions"].values()) - 1) < 1e-6
    assert profile["ops"]["fractions"].get("matmul", 0) > 0
    assert stages["mesh"]["skipped"].startswith("one device")
    moe = stages["moe"]
    assert moe["preset"] == "moe-tiny" and "NVIDIA Hopper GPU" in moe["check"]["unavailable"]
    assert [n for n, w in moe["ffn"]["ways"].items() if "time_median_s" in w] == ["grouped", "loop", "batched"]
    assert all(w["routed_tflops"] > 0 for w in moe["ffn"]["ways"].values() if "time_median_s" in w)
    assert "mosaic: not run" in done.stdout
    assert "correctness" in done.stdout and "verdict: pass" in done.stdout


def test_mesh_stage_on_four_devices(tmp_path):
    """The mesh stage on 4 fake CPU devices (what a node's GPUs get): the five collectives over
    all four, their record beside the report read back by tools.bandwidth (as `tools.plan
    --bandwidth` reads it), and tiny (fp32 compute) on dp=4, fsdp=4, fsdp=2,tp=2 without and
    with sequence parallelism, and pp=2,dp=2 (1f1b): each trains, and its compiled collectives equal tools.traffic's contract on data,
    tensor and stage within 1%. Over fsdp XLA CPU reduces the gradients with an all-reduce (it
    lacks GPU's reduce-scatter pass, tests/test_hlo.py), so the census reads above the contract
    there, by less than the gradients' share again; but with sequence parallelism every region
    is manual over fsdp and reduce-scatters its own gradients (TensorParallel.gather_in_region,
    the embedding's and head's regions), and XLA CPU takes the tables' gathers out of the k = 4
    microbatch loop (each table's shard is the same in every microbatch; XLA GPU gathers them
    in each, as the contract counts: fsdp=2,tp=2 with SP at k = 4 read 0.997x it compiled for
    H100s): 3 of the 4 gathers of each table less."""
    from configs import ConfigError
    from tools.bandwidth import load

    out = tmp_path / "gpu.json"
    env = child_env(devices=4)
    done = subprocess.run([sys.executable, "-m", "bench.gpu", "--cpu-smoke", "--stages", "mesh", "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    mesh = json.loads(out.read_text())["stages"]["mesh"]
    link = mesh["interconnect"]
    assert [(x["op"], x["group"]) for x in link["summary"]] == [
        (op, 4) for op in ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "permute")]
    assert all(x["peak_busbw_GBps"] > 0 for x in link["summary"])
    record = json.loads(Path(link["record"]).read_text())
    assert set(record["fit"]["data"]) == {x["op"] for x in link["summary"]} and record["smoke"]
    with pytest.raises(ConfigError, match="measured on cpu devices"):  # tools.plan --bandwidth takes GPUs' only
        load(Path(link["record"]))
    rows = {label(r): r for r in mesh["strategies"]}
    assert list(rows) == ["dp=4", "fsdp=4", "fsdp=2,tp=2", "fsdp=2,tp=2 sp", "pp=2,dp=2"]
    assert all(r["status"] == "ok" and r["tokens_per_s"] > 0 and r["devices"] == 4 for r in rows.values()), rows
    assert {m: set(r["bytes_per_axis"]) for m, r in rows.items()} == {
        "dp=4": {"data"}, "fsdp=4": {"fsdp"}, "fsdp=2,tp=2": {"fsdp", "tensor"}, "fsdp=2,tp=2 sp": {"fsdp", "tensor"},
        "pp=2,dp=2": {"stage", "data"}}
    m = get_preset("tiny").model
    for name, r in rows.items():
        for axis, b in r["bytes_per_axis"].items():
            if axis == "fsdp" and name == "fsdp=2,tp=2 sp":
                k, f, t = r["batch_shape"][0], 2, 2
                hoisted = 2 * (k - 1) * 4 * m.vocab_size * m.d_model / (f * t) * (f - 1)  # fp32 on CPU
                assert b["census"] == pytest.approx(b["contract"] - hoisted, rel=1e-4), (r["mesh"], b)
            elif axis == "fsdp":
                assert 1 < b["ratio"] < 2, (r["mesh"], b)
            else:
                assert b["ratio"] == pytest.approx(1, abs=0.01), (r["mesh"], axis, b)
    assert "pp=2,dp=2" in done.stdout and "fsdp=2,tp=2 sp" in done.stdout and "census/contract" in done.stdout


def test_cores_limits_the_attention_stages(tmp_path):
    """--cores leaves a core out of the correctness and attention stages (xla must stay: it is
    the reference)."""
    from bench.gpu import parse_args
    from configs import ConfigError

    out = tmp_path / "gpu.json"
    done = run_module("bench.gpu", "--cpu-smoke", "--stages", "attention", "--cores", "xla,pallas", "--out", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(out.read_text())
    assert [r["core"] for r in report["stages"]["attention"]["rows"]] == ["pallas", "xla"] * 2  # H = 64, then 128
    assert report["sizes"]["cores"] == ["pallas", "xla"]
    with pytest.raises(ConfigError, match="--cores 'pallas,cudnn': choose from pallas,pallas-mosaic,cudnn,xla, xla "
                                          "among them"):
        parse_args(["--cores", "pallas,cudnn"])


def test_fp32_lengths_replace_the_correctness_stages_fp32_cases(tmp_path):
    """--fp32-lengths none drops the fp32 cases (Pallas Triton compiles about 2 minutes per fp32
    length on an H100); a list replaces the sizes' own; anything else is argparse's error."""
    from bench.gpu import parse_args
    from bench.gpu_sizes import GPU
    from configs import ConfigError

    out = tmp_path / "gpu.json"
    done = run_module("bench.gpu", "--cpu-smoke", "--stages", "environment", "--fp32-lengths", "none", "--out", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    assert json.loads(out.read_text())["sizes"]["check_fp32_lengths"] == []
    assert parse_args(["--fp32-lengths", "100,128"]).fp32_lengths == [100, 128]
    assert parse_args([]).fp32_lengths is None and GPU.check_fp32_lengths == (1500,)
    for bad in ("x", ""):
        with pytest.raises(SystemExit):  # argparse's error: not integers
            parse_args(["--fp32-lengths", bad])
    with pytest.raises(ConfigError, match="--fp32-lengths 0: must be >= 1"):
        parse_args(["--fp32-lengths", "0"])


def test_without_gpu_says_so_in_one_line(tmp_path):
    env = child_env(JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, "-m", "bench.gpu", "--out", str(tmp_path / "x.json")], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert len(done.stdout.strip().splitlines()) == 1 and "no GPU" in done.stdout
    assert not (tmp_path / "x.json").exists()


def h100_run_dir(tmp_path):
    """A run directory holding a real H100 trace: one step of 1b (remat full, cudnn core, 2
    microbatches of 8 x 2048 tokens) traced by train.py --profile-steps 2:3 on 2026-11-24."""
    import gzip
    import shutil

    data = ROOT / "tests" / "data" / "h100-profile"
    profile = tmp_path / "plugins" / "profile"
    (profile / "2026_11_24_08_27_06").mkdir(parents=True)
    shutil.copy(data / "perfetto_trace.json.gz", profile / "2026_11_24_08_27_06")
    (profile / "train_step.hlo.txt").write_bytes(gzip.decompress((data / "train_step.hlo.txt.gz").read_bytes()))
    return tmp_path


def test_an_h100_trace_is_summed_by_kernel(tmp_path):
    """GPU kernels carry no step and, inside CUDA graphs, name the graph: trace_summary assigns
    them to the step launched before them and finds fusions by kernel name; tools.op_kinds kinds the
    library kernels (cuBLAS nvjet, cuDNN attention, memcpy) by their names. Every kernel of the
    step is counted once: 520.7 ms, the sum of the trace's kernel durations."""
    from tools.op_kinds import op_breakdown
    from tools.trace_summary import summarize

    run_dir = h100_run_dir(tmp_path)
    s = summarize(run_dir)
    assert (s["steps"], s["devices"]) == (1, 1)
    assert abs(s["compute_ms"] - 520.66) < 0.05 and s["collective_ms"] == 0
    assert {"attention", "mlp", "head", "optimizer", "unattributed"} <= set(s["scopes_ms"])
    assert s["scopes_ms"]["mlp"]["compute"] > 100  # the MLP's fusions and Triton GEMMs, by kernel name

    ops = op_breakdown(run_dir)
    assert abs(ops["total_ms"] - s["compute_ms"]) < 1e-6
    kinds = {k: round(v, 1) for k, v in ops["kinds_ms"].items()}
    assert kinds == {"matmul": 333.4, "attention kernel": 69.1, "copy": 11.7, "elementwise/other": 106.4}, kinds
    assert ops["top_ops"][0]["kind"] == "matmul" and ops["top_ops"][0]["op"].startswith("nvjet")


def test_op_kinds_prints_the_breakdown(tmp_path, capsys):
    from tools.op_kinds import main

    assert main([str(h100_run_dir(tmp_path)), "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "520.66 ms of kernels per step per device" in out and "matmul                  333.39 ms   64.0%" in out
    assert out.count(" ms  matmul") + out.count(" ms  attention kernel") + out.count(" ms  elementwise") == 3


def test_every_gpu_case_builds_and_traces():
    """The GPU run's own cases (bench.gpu_sizes.GPU: training, flags and profile, at their real presets
    and batches) are valid runs: each parses and its train step traces (abstractly: nothing
    allocated or compiled) on 1 device and on 8, as on one GPU and on a node; the mesh stage's
    strategies on their meshes of 8. A renamed setting
    or a batch that no longer divides fails here on CPU, not on a lent GPU's clock."""
    import dataclasses

    import jax

    from bench.gpu_sizes import GPU
    from bench.gpu_mesh import meshes
    from bench.gpu_training import PROFILE_EXTRA
    from sharding.mesh import build_mesh, format_mesh, mesh_config, parse_mesh
    from tools.calibration import case_config
    from training.build import make_program

    cases = ([(p, o, [f"model.remat={r}"], None) for p, r, o in GPU.train_cases]
             + [(p, o, [f"model.remat={r}"], None) for p, r, o, _ in GPU.flag_cases]
             + [(p, o, list(PROFILE_EXTRA), None) for p, o in GPU.profile_cases]
             + [(GPU.mesh_case[0], GPU.mesh_case[1] + more, ["model.remat=full"], mesh) for mesh, more in meshes(8)])
    for preset, overrides, extra, mesh_text in cases:
        for n in (1, 8) if mesh_text is None else (8,):
            cfg = case_config(preset, overrides, extra, n)
            if mesh_text:
                cfg = dataclasses.replace(cfg, parallel=parse_mesh(mesh_text, cfg.parallel))
            mesh = build_mesh(cfg.parallel, jax.devices()[:n])
            program = make_program(dataclasses.replace(cfg, parallel=mesh_config(mesh, cfg.parallel)), mesh)
            with jax.set_mesh(mesh):  # the pipeline reads its stages from the mesh in context
                _, metrics = jax.eval_shape(program.step_fn, program.state, program.abstract_batch())
            assert metrics["loss"].shape == () and metrics["loss"].dtype == "float32", (preset, overrides, n)
            assert format_mesh(dict(mesh.shape)) == mesh_text or (mesh_text is None and dict(mesh.shape)["data"] == n)
