"""The benchmarks run end to end and write complete records (figures are not asserted: timing)."""

import importlib
import json
import os
import re

import pytest

from configs import ConfigError, RunConfig
from conftest import SMALL, run_module
from pipeline.schedule import lockstep_bubble, timetable
from tools.pipeline_figures import cell_costs

SETS = [a for s in SMALL for a in ("--set", s)]


def test_step_benchmark_writes_json(tmp_path):
    out_file = tmp_path / "step.json"
    out = run_module("bench.step", *SETS, "--mesh", "dp=2,tp=2", "--steps", "2",
                     "--compile-layers", "1,2", "--out", str(out_file))
    assert out.returncode == 0, out.stderr
    record = json.loads(out_file.read_text())
    assert record["config"]["parallel"]["data"] == 2 and record["config"]["parallel"]["tensor"] == 2
    assert len(record["throughput"]["step_times_s"]) == 2
    assert record["throughput"]["tokens_per_step"] == 16 * 32
    assert [r["n_layers"] for r in record["compile_scaling"]["rows"]] == [1, 2]
    assert record["throughput"]["loss_last"] < record["throughput"]["loss_first"]


def test_tp_benchmark_compares_four_variants(tmp_path):
    out_file = tmp_path / "tp.json"
    out = run_module("bench.tp", *SETS, "--tp", "2", "--rounds", "1", "--out", str(out_file))
    assert out.returncode == 0, out.stderr
    results = json.loads(out_file.read_text())["results"]["2"]
    assert set(results) == {"gspmd", "shard_map", "shard_map+sp", "shard_map+sp+overlap"}
    assert results["gspmd"]["ratio_to_gspmd"] == 1.0
    overlap = {c["kind"] for c in results["shard_map+sp+overlap"]["census"] if c["axes"] == "tensor"}
    assert "collective-permute" in overlap


def test_pipeline_benchmark_measures_the_bubble_of_every_schedule(tmp_path):
    """Three of the schedules (every one is one row of the same code): gpipe, interleaved, and
    zb-h1, whose lock-step bubble is its table's."""
    out_file = tmp_path / "pipeline.json"
    sets = [a for s in SMALL if not s.startswith(("model.n_layers", "train.global_batch_size")) for a in ("--set", s)]
    out = run_module("bench.pipeline", *sets, "--mesh", "pp=2", "--microbatches", "2", "--steps", "1",
                     "--schedules", "gpipe,interleaved,zb-h1",
                     "--profile", str(tmp_path / "profile"), "--out", str(out_file))
    assert out.returncode == 0, out.stderr
    record = json.loads(out_file.read_text())
    assert record["mesh"] == "pp=2" and record["command"].startswith("python -m bench.pipeline")
    assert record["config"]["model"]["n_layers"] == 4  # p·2 layers
    assert record["machine"]["devices"] == 2 and "xla_cpu_multi_thread_eigen=false" in record["machine"]["xla_flags"]
    (ref,) = record["one_device"]
    assert ref["microbatches"] == 2 and ref["micro_batch_size"] == 2 and ref["global_batch_size"] == 4
    rows = {r["schedule"]: r for r in record["schedules"]}
    assert list(rows) == ["gpipe", "interleaved", "zb-h1"] and all(r["microbatches"] == 2 and r["stages"] == 2 for r in rows.values())
    assert rows["interleaved"]["bubble"] < rows["gpipe"]["bubble"]
    zb = rows["zb-h1"]  # (p-1)/(3M+p-1); lock-step the same table with the heads over the stages weighed in
    assert zb["bubble"] == pytest.approx(1 / 7)
    cfg = RunConfig.from_dict(record["config"])
    assert zb["costs"] == cell_costs(cfg, {"stage": 2}) and zb["costs"]["head"] > 0
    table = timetable("zb-h1", 2, 2)
    assert zb["lockstep_bubble"] == pytest.approx(lockstep_bubble(table, zb["costs"]))
    assert lockstep_bubble(table, zb["costs"] | {"head": 0}) == pytest.approx(1 / 7)
    assert zb["lockstep_bubble"] < 1 / 7  # the same idle ticks, the head's busy work added to every stage
    for r in rows.values():
        assert r["temp_bytes"] > 0 and r["step_s"] > 0 and r["compile_s"] > 0
        assert r["one_device_s"] == ref["step_s"] and r["ideal_s"] == ref["step_s"] / 2
        assert abs(r["measured_bubble"] - (1 - r["ideal_s"] / r["step_s"])) < 1e-9
        assert -1.0 < r["measured_bubble"] < 1.0 and 0 < r["work_ratio"] < 50 and 0 < r["cpu_work_ratio"] < 50
        assert 0 <= r["lockstep_bubble"] < 1
        prof = r["profile"]
        assert prof["steps"] == 1 and len(prof["idle"]) == len(prof["waiting"]) == 2
        assert all(0 <= w <= i <= 1 for i, w in zip(prof["idle"], prof["waiting"]))


def test_a_failing_pipeline_case_keeps_the_others_rows(tmp_path):
    """gpipe's trace folder is taken by a file, so its case fails when it writes its HLO: its row
    holds the error, 1f1b's row and the one-device row are measured, the record is written, and
    the exit code is 1 with one line counting the failures."""
    out_file, profile = tmp_path / "pipeline.json", tmp_path / "profile"
    profile.mkdir()
    (profile / "gpipe-M2").write_text("not a folder")
    sets = [a for s in SMALL if not s.startswith(("model.n_layers", "train.global_batch_size")) for a in ("--set", s)]
    out = run_module("bench.pipeline", *sets, "--mesh", "pp=2", "--microbatches", "2", "--steps", "1",
                     "--schedules", "gpipe,1f1b", "--profile", str(profile), "--out", str(out_file))
    assert out.returncode == 1
    assert out.stderr.strip().splitlines() == [
        f"error: 1 of 3 cases failed (their errors are in {out_file}): "
        f"NotADirectoryError: [Errno 20] Not a directory: '{profile / 'gpipe-M2' / 'plugins' / 'profile'}'"]
    record = json.loads(out_file.read_text())
    gpipe, one_f = record["schedules"]
    assert gpipe["schedule"] == "gpipe" and gpipe["error"].startswith("NotADirectoryError") and "step_s" not in gpipe
    assert gpipe["bubble"] == pytest.approx(1 / 3)  # the timetable's figures need no run: (p-1)/(m+p-1)
    assert one_f["schedule"] == "1f1b" and "error" not in one_f and one_f["step_s"] > 0
    assert one_f["one_device_s"] == record["one_device"][0]["step_s"] > 0


@pytest.mark.parametrize("module", ["bench.pipeline", "bench.moe"])
def test_bad_input_inside_a_case_is_refused_not_recorded(tmp_path, module):
    """A case's ConfigError (here the cudnn core on a CPU, found when the case is built) is bad
    input: one `error:` line, exit 2, no record, where a case's runtime failure would be its
    row's error (exit 1)."""
    out_file = tmp_path / "out.json"
    sets = [a for s in SMALL if not s.startswith(("model.n_layers", "train.global_batch_size")) for a in ("--set", s)]
    extra = (["--mesh", "pp=2", "--microbatches", "2", "--schedules", "gpipe"] if module == "bench.pipeline" else
             ["--set", "model.n_layers=1", "--set", "data.source=synthetic", "--ep", "1", "--ffn-tokens", "0"])
    out = run_module(module, *sets, "--set", "model.attention=cudnn", "--steps", "1", *extra, "--out", str(out_file))
    assert out.returncode == 2 and out.stderr.startswith("error: "), out.stderr
    assert "model.attention=cudnn" in out.stderr and len(out.stderr.strip().splitlines()) == 1
    assert not out_file.exists()


def test_pipeline_benchmark_refuses_bad_input_in_one_line():
    for args in (["--mesh", "dp=2"], ["--microbatches", "x"], ["--mesh", "pp=4", "--microbatches", "2"],
                 ["--microbatches", "0"], ["--microbatches", "2q"], ["--schedules", "zb-h2"], ["--steps", "0"]):
        out = run_module("bench.pipeline", *args)
        assert out.returncode == 2 and out.stderr.startswith("error: "), (args, out.stderr)
        assert len(out.stderr.strip().splitlines()) == 1, out.stderr


def test_context_benchmark_compares_ring_and_allgather_as_l_grows(tmp_path):
    out_file = tmp_path / "context.json"
    out = run_module("bench.context", *SETS, "--sp", "1,2", "--tokens-per-device", "16", "--impls", "ring,allgather",
                     "--steps", "1", "--out", str(out_file))
    assert out.returncode == 0, out.stderr
    record = json.loads(out_file.read_text())
    assert record["command"].startswith("python -m bench.context") and record["mesh"] == "sp=1,2"
    assert record["baseline_impl"] == "ring" and record["temp_ratio_to"] == "sp=1"
    rows = {(r["sp"], r["impl"]): r for r in record["rows"]}
    assert set(rows) == {(1, None), (2, "ring"), (2, "allgather")}
    assert rows[1, None]["seq_len"] == 16 and rows[2, "ring"]["seq_len"] == 32
    assert rows[2, "ring"]["step_ratio"] == 1.0 and rows[1, None]["kv_bytes_estimate"] == 0
    for key in ("step_time_median_s", "temp_bytes", "static_peak_bytes", "temp_ratio", "kv_bytes_estimate",
                "sequence_bytes_estimate", "step_ratio"):
        assert rows[2, "ring"][key] > 0 and rows[2, "allgather"][key] > 0, key


def test_a_failing_context_case_keeps_the_others_rows(tmp_path, monkeypatch, capsys):
    """sp=2's ways fail (an out-of-memory stand-in raised where they would be measured): sp=1 and
    sp=4 are measured and written, sp=2's rows hold the error, and the exit code is 1."""
    from bench import context

    real = context.measure

    def measure(todo, mesh, steps):
        if mesh.devices.size == 2:
            raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1.0GiB")
        return real(todo, mesh, steps)

    monkeypatch.setattr(context, "measure", measure)
    monkeypatch.setenv("XLA_FLAGS", os.environ["XLA_FLAGS"])  # main asks for its fake devices there: put back after
    out_file = tmp_path / "context.json"
    code = context.main([*SETS, "--sp", "1,2,4", "--tokens-per-device", "16", "--impls", "ring", "--steps", "1",
                         "--out", str(out_file)])
    assert code == 1
    assert capsys.readouterr().err.strip() == (f"error: 1 of 3 cases failed (their errors are in {out_file}): "
                                               "RuntimeError: RESOURCE_EXHAUSTED: Out of memory while trying to "
                                               "allocate 1.0GiB")
    rows = {r["sp"]: r for r in json.loads(out_file.read_text())["rows"]}
    assert rows[2] == {"sp": 2, "seq_len": 32, "impl": "ring",
                       "error": "RuntimeError: RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1.0GiB"}
    assert rows[1]["step_time_median_s"] > 0 and rows[4]["step_ratio"] == 1.0 and rows[4]["temp_ratio"] > 0


def test_moe_benchmark_times_ep_cases_and_counts_all_to_alls(tmp_path):
    """ep=1,2 dropless on 8 devices (dp=8; dp=4,ep=2), fp32 so the compiled buffers match the
    estimate's dtype. The compiled step's all-to-alls over `expert` per MoE layer at ep=2: 3
    forward (dispatch, the int32 expert ids, combine) and 2 backward (the transposes of dispatch
    and combine; the ids carry no gradient), their bytes equal to tools.traffic.expert."""
    out_file = tmp_path / "moe.json"
    sets = [a for s in SMALL if not s.startswith("model.n_layers") for a in ("--set", s)]
    out = run_module("bench.moe", *sets, "--set", "model.n_layers=1", "--set", "model.expert_d_ff=64",
                     "--set", "data.source=synthetic", "--ep", "1,2", "--dispatch", "dropless", "--steps", "1",
                     "--ffn-tokens", "16", "--ffn-rounds", "1", "--out", str(out_file))
    assert out.returncode == 0, out.stderr
    record = json.loads(out_file.read_text())
    assert record["command"].startswith("python -m bench.moe") and record["mesh"] == "dp=8;dp=4,ep=2"
    assert record["baseline"] == "ep=1 dropless" and record["config"]["model"]["n_experts"] == 8
    rows = {(r["ep"], r["dispatch"]): r for r in record["rows"]}
    assert list(rows) == [(1, "dropless"), (2, "dropless")]
    assert rows[1, "dropless"]["step_ratio"] == 1.0 and rows[2, "dropless"]["step_ratio"] > 0
    assert rows[1, "dropless"]["all_to_all"]["per_step"] == 0
    a2a = rows[2, "dropless"]["all_to_all"]
    assert (a2a["per_moe_layer"], a2a["forward_per_moe_layer"], a2a["backward_per_moe_layer"]) == (5, 3, 2)
    assert a2a["axes"] == ["expert"] and a2a["dtypes"] == ["f32", "s32"]
    assert a2a["bytes_per_device"] == rows[2, "dropless"]["all_to_all_bytes_estimate"] > 0
    ffn = record["ffn"]
    assert list(ffn["ways"]) == ["grouped", "loop", "batched", "mosaic"]
    assert ffn["ways"]["grouped"]["ratio_to_grouped"] == 1.0
    assert "NVIDIA Hopper GPU" in ffn["ways"]["mosaic"]["unavailable"]  # jax's kernels: not on a CPU
    assert ffn["routed_flops"] == 18 * ffn["rows"] * ffn["d_model"] * ffn["expert_d_ff"]
    # XLA:CPU lowers ragged_dot densely: the rows copied once per expert, fp32 here
    assert ffn["ways"]["grouped"]["temp_bytes"] >= ffn["experts"] * ffn["rows"] * ffn["d_model"] * 4


def test_a_failing_moe_case_keeps_the_others_rows(tmp_path, monkeypatch, capsys):
    """ep=2's build fails (an out-of-memory stand-in): ep=1 is measured and written with its
    figures, ep=2's row holds the error, and the exit code is 1."""
    from bench import moe
    from training import build as build_module

    real = build_module.build

    def build(cfg, mesh, *args, **kwargs):
        if cfg.parallel.expert == 2:
            raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 2.0GiB")
        return real(cfg, mesh, *args, **kwargs)

    monkeypatch.setattr(build_module, "build", build)
    monkeypatch.setenv("XLA_FLAGS", os.environ["XLA_FLAGS"])  # main asks for its fake devices there: put back after
    out_file = tmp_path / "moe.json"
    sets = [a for s in SMALL if not s.startswith("model.n_layers") for a in ("--set", s)]
    code = moe.main([*sets, "--set", "model.n_layers=1", "--set", "model.expert_d_ff=64", "--set",
                     "data.source=synthetic", "--ep", "1,2", "--dispatch", "dropless", "--steps", "1",
                     "--ffn-tokens", "0", "--out", str(out_file)])
    assert code == 1 and capsys.readouterr().err.startswith(f"error: 1 of 2 cases failed (their errors are in {out_file})")
    one, two = json.loads(out_file.read_text())["rows"]
    assert one["ep"] == 1 and one["step_ratio"] == 1.0 and one["step_time_median_s"] > 0
    assert two == {"ep": 2, "dp": 4, "dispatch": "dropless",
                   "error": "RuntimeError: RESOURCE_EXHAUSTED: Out of memory while trying to allocate 2.0GiB"}


def test_moe_benchmark_refuses_bad_input_in_one_line():
    for args in (["--ep", "3"], ["--ep", "8", "--set", "model.n_experts=4"], ["--dispatch", "sorted"],
                 ["--mesh", "ep=2"]):
        out = run_module("bench.moe", *args)
        assert out.returncode == 2 and out.stderr.startswith("error: "), out.stderr
        assert len(out.stderr.strip().splitlines()) == 1, out.stderr


@pytest.mark.parametrize("module, args, message", [
    ("bench.attention", ["--heads", "0"], "--heads 0: must be >= 1"),
    ("bench.attention", ["--lengths", "128,0"], "--lengths 128,0: must be >= 1"),
    ("bench.attention", ["--kv-heads", "-1"], "--kv-heads -1: must be >= 0"),
    ("bench.attention", ["--masks", "causal,bogus"], "--masks 'causal,bogus': choose from causal,full"),
    ("bench.attention", ["--cores", "flash"], "--cores 'flash': choose from pallas,"),
    ("bench.attention", ["--steps", "0"], "--steps 0: must be >= 1"),
    ("bench.tune_attention", ["--length", "0"], "--length 0: must be >= 1"),
    ("bench.tune_attention", ["--tokens", "-4"], "--tokens -4: must be >= 1"),
    ("bench.moe", ["--ffn-tokens", "-1"], "--ffn-tokens -1: must be >= 0"),
    ("bench.moe", ["--ffn-rounds", "0"], "--ffn-rounds 0: must be >= 1"),
    ("bench.context", ["--tokens-per-device", "0"], "--tokens-per-device 0: must be >= 1"),
    ("bench.gpu", ["--budget", "-5"], "--budget -5.0: must be >= 1"),
    ("bench.step", ["--steps", "0"], "--steps 0: must be >= 1"),
    ("bench.tp", ["--rounds", "0"], "--rounds 0: must be >= 1"),
    ("bench.context", ["--impls", "ring,bogus"], "--impls 'ring,bogus': name one or more of ring, allgather, gspmd"),
    ("bench.tp", ["--mesh", "dp=2"], "--mesh dp=2: bench.tp runs each variant on tp=T alone, T from --tp; drop --mesh"),
    ("bench.tp", ["--tp", "2,3"], "--tp 3: model.n_heads=8 is not divisible by tp=3; choose another --tp, or change "
     "the model with --set"),
    ("bench.step", ["--mesh", "pp=2", "--compile-layers", "2,3"],
     "--compile-layers 2,3: 3 layers on this run: model.n_layers=3 is not divisible by pp"),
    ("bench.context", ["--tokens-per-device", "3"], "--tokens-per-device 3: ring and allgather lay each device's tokens"),
    ("bench.moe", ["--ep", "3", "--devices", "6"], "--ep 3 --devices 6 (mesh ep=3,dp=2): train.global_batch_size=32 is "
     "not divisible by dp*fsdp*ep=6"),
    ("bench.pipeline", ["--profile", "/dev/null/trace"], "--profile /dev/null/trace: /dev/null is a file, not a directory"),
    ("bench.pipeline", ["--microbatches", "3"], "--schedules gpipe --microbatches 3 (--mesh pp=4): "
     "parallel.microbatches=3 is fewer than the pp=4 stages"),
    ("bench.pipeline", ["--schedules", "interleaved", "--microbatches", "6"], "--schedules interleaved "
     "--microbatches 6 (--mesh pp=4): parallel.microbatches=6 with schedule=interleaved must be a multiple of pp=4"),
    ("bench.moe", ["--config", "tiny", "--ep", "2"], "--config tiny: a model without experts (model.n_experts=0), "
     "and bench.moe measures MoE layers; use --config moe-tiny"),
    ("bench.moe", ["--set", "model.n_experts=0", "--devices", "1", "--ep", "1"], "--config moe-tiny: a model without"),
])
def test_bad_numbers_are_refused_by_flag_before_jax(module, args, message):
    """In process: each bench refuses the flag by name before it imports jax or measures anything."""
    main = importlib.import_module(module).main
    with pytest.raises(ConfigError, match=re.escape(message)):
        main([*args, "--out", "/tmp/unused.json"])


@pytest.mark.parametrize("module", ["bench.attention", "bench.tune_attention", "bench.moe", "bench.context"])
def test_an_out_that_cannot_be_written_is_refused_before_measuring(module, tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("")
    main = importlib.import_module(module).main
    with pytest.raises(ConfigError, match=re.escape(f"--out {afile}/x.json: {afile} is a file, not a directory")):
        main(["--out", str(afile / "x.json")])
    with pytest.raises(ConfigError, match=re.escape(f"--out {tmp_path} is a directory: name the file")):
        main(["--out", str(tmp_path)])


@pytest.mark.parametrize("module", ["bench.attention", "bench.checkpoint", "bench.context", "bench.gpu", "bench.moe",
                                    "bench.pipeline", "bench.step", "bench.tp", "bench.tune_attention",
                                    "tools.collectives"])
def test_an_out_ending_in_a_separator_is_refused(module, tmp_path, capsys):
    """`--out DIR/` names a folder: refused by the flag (Path would drop the slash and write a file
    named DIR), and nothing is created."""
    main = importlib.import_module(module).main
    with pytest.raises(SystemExit) as stop:
        main(["--out", f"{tmp_path}/absent/"])
    assert stop.value.code == 2
    assert f"argument --out: {tmp_path}/absent/ names a folder; name the file to write, e.g. " \
           f"{tmp_path}/absent/record.json" in capsys.readouterr().err
    assert not (tmp_path / "absent").exists()


def test_a_failing_compile_case_of_bench_step_is_its_rows_error(capsys, monkeypatch):
    """bench.step's compile scaling keeps the counts that compiled when one fails (here the
    2-layer compile raises, an out-of-memory stand-in), and its printed table says which; a
    ConfigError (bad input) is not a case's failure: it stops the run."""
    import jax

    from bench.step import compile_scaling, print_report
    from conftest import small_config
    from sharding.mesh import build_mesh
    from training import build as build_module

    real = build_module.compile_step

    def compile_step(step_fn, mesh, state, batch, *rest):
        if len(jax.tree.leaves(state.params)[0]) == 2:  # the stacked layers of model.n_layers=2
            raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while compiling")
        return real(step_fn, mesh, state, batch, *rest)

    monkeypatch.setattr(build_module, "compile_step", compile_step)
    cfg = small_config()
    mesh = build_mesh(cfg.parallel, jax.devices()[:1])
    scaling = compile_scaling(cfg, mesh, [1, 2])
    ok, bad = scaling["rows"]
    assert ok["n_layers"] == 1 and ok["total_s"] == ok["lower_s"] + ok["compile_s"] > 0
    assert bad == {"n_layers": 2, "error": "RuntimeError: RESOURCE_EXHAUSTED: Out of memory while compiling"}
    assert scaling["ratio_largest_to_smallest"] is None  # one count compiled: nothing to weigh
    print_report({"environment": {}, "config": {"name": "tiny"}, "mesh": "single device",
                  "throughput": {"error": "XlaRuntimeError: RESOURCE_EXHAUSTED"}, "compile_scaling": scaling})
    printed = capsys.readouterr().out
    assert "step: XlaRuntimeError: RESOURCE_EXHAUSTED" in printed and f"2  {bad['error']}" in printed
    with pytest.raises(ConfigError):
        compile_scaling(cfg, mesh, [0])


def test_default_record_names_match_the_committed_ones():
    """A README command rerun without --out writes the file README's table reads."""
    from bench.common import default_out
    from configs import get_preset

    tiny = get_preset("tiny")
    assert default_out("step", tiny, "single device").name == "step-tiny-single.json"
    assert default_out("step", tiny, "dp=2,tp=2").name == "step-tiny-dp2_tp2.json"
