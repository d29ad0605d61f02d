"""train.py end to end, through a subprocess, as a user runs it; and cli.run_cli, which every entry
point exits through."""

import gc
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import SMALL, child_env, run_module, small_config

ROOT = Path(__file__).resolve().parents[1]


def train(*args: str, fake_devices: bool = False) -> subprocess.CompletedProcess:
    env = child_env() if fake_devices else dict(os.environ)  # child_env: train.py sets the count itself
    sets = [a for s in SMALL for a in ("--set", s)]
    return subprocess.run(
        [sys.executable, "train.py", *sets, *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )


def test_mesh_dp8_tp8_on_fake_devices(tmp_path):
    out = train("--steps", "3", "--mesh", "dp=8,tp=8", "--run-dir", str(tmp_path), fake_devices=True)
    assert out.returncode == 0, out.stderr
    assert "running mesh dp=8,tp=8 on 64 fake host devices" in out.stdout
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["parallel"] == {"stage": 1, "data": 8, "fsdp": 1, "expert": 1, "sequence": 1, "tensor": 8,
                                  "tp_impl": "shard_map", "sequence_parallel": False, "tp_overlap": False,
                                  "context_impl": "ring", "schedule": "gpipe", "microbatches": 0, "virtual_stages": 1,
                                  "fsdp_gather_once": False}
    assert config["model"]["d_model"] == 64 and config["train"]["steps"] == 3
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [3]
    for key in ("loss", "tokens_per_s", "step_time_s", "lr", "grad_norm", "tflops_per_device", "mfu"):
        assert key in records[0]
    assert 4.0 < records[0]["loss"] < 6.0 and records[0]["tokens_per_s"] > 0
    assert list(tmp_path.glob("events.out.tfevents*")), "no TensorBoard event file"
    assert "step 3/3" in out.stdout and "tok/s" in out.stdout


def test_log_lines_and_profile_window(tmp_path):
    out = train("--steps", "4", "--set", "train.log_every=1", "--profile-steps", "1:3",
                "--run-dir", str(tmp_path))
    assert out.returncode == 0, out.stderr
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [2, 3, 4]  # step 1 is reported as the compile
    assert list(tmp_path.glob("plugins/profile/*/*.xplane.pb")), "no profiler trace"


def test_run_cli_exits_with_the_entrys_code_and_freezes_what_is_left(monkeypatch, capsys):
    """cli.run_cli: entry's exit code; a ConfigError one `error:` line and 2; entry run under
    cli.GC_THRESHOLDS; after a return, the objects left frozen out of the collector (gc.freeze),
    which spares the exit its last walk."""
    from cli import GC_THRESHOLDS, run_cli
    from configs import ConfigError

    def refuse(argv):
        raise ConfigError("--set x: no")

    monkeypatch.setattr(sys, "argv", ["tool", "--flag"])
    thresholds, argvs = [], []
    monkeypatch.setattr(gc, "set_threshold", lambda *t: thresholds.append(t))  # this worker keeps its own
    frozen = gc.get_freeze_count()
    with pytest.raises(SystemExit) as refused:
        run_cli(refuse)
    assert refused.value.code == 2 and capsys.readouterr().err == "error: --set x: no\n"
    assert gc.get_freeze_count() == frozen
    try:
        with pytest.raises(SystemExit) as done:
            run_cli(lambda argv: argvs.append(argv) or 3)
        assert done.value.code == 3 and argvs == [["--flag"]] and thresholds == [GC_THRESHOLDS] * 2
        assert gc.get_freeze_count() > frozen + 10_000
    finally:
        gc.unfreeze()  # back in reach for the rest of this worker's tests


@pytest.mark.parametrize(
    "args, message",
    [
        (["--mesh", "dp=2,xp=4"], "axes are pp dp fsdp ep sp tp"),
        (["--set", "model.n_layer=2"], "did you mean model.n_layers"),
        (["--mesh", "dp=3"], "train.global_batch_size=16 is not divisible by dp*fsdp*ep=3"),
        (["--set", "data.source=text", "--set", "data.path=/no/such/dir"], "data.path"),
        (["--mesh", "dp=2", "--set", "parallel.sequence_parallel=true"], "add tp=2 or more to --mesh"),
        # Value rules (configs/checks.py), refused before jax is imported.
        (["--set", "train.log_every=0"], "--set train.log_every=0: must be >= 1"),
        (["--set", "parallel.data=0"], "--set parallel.data=0: must be >= 1, or -1"),
        (["--set", "parallel.data=-1", "--set", "parallel.tensor=-1"], "only one mesh axis may fill"),
        (["--mesh", "dp=0"], "--mesh 'dp=0': size of dp must be positive"),
        (["--set", "train.global_batch_size=0"], "--set train.global_batch_size=0: must be >= 1"),
        (["--set", "model.n_layers=0"], "--set model.n_layers=0: must be >= 1"),
        (["--set", "model.n_kv_heads=0"], "--set model.n_kv_heads=0: must be >= 1"),
        (["--set", "model.compute_dtype=float8"], "--set model.compute_dtype=float8: choose one of float32"),
        (["--set", "train.seq_len=0"], "--set train.seq_len=0: must be >= 1"),
        (["--steps", "-1"], "--steps -1: must be >= 1"),
        (["--set", "train.lr=-1"], "--set train.lr=-1.0: must be > 0"),
        # Context parallelism (sharding/checks.py check_context).
        (["--set", "parallel.context_impl=zigzag"], "--set parallel.context_impl=zigzag: choose one of ring"),
        (["--mesh", "dp=2,sp=4", "--set", "train.seq_len=20"], "train.seq_len=20 is not divisible by 2·sp=8"),
        (["--mesh", "pp=2,dp=2,sp=2", "--set", "parallel.schedule=1f1b"], "use parallel.context_impl=allgather"),
        (["--mesh", "dp=4,sp=2", "--set", "model.attention=cudnn"], "use model.attention=pallas or xla"),
        # Experts (sharding/checks.py check_experts, configs/checks.py).
        (["--config", "moe-tiny", "--mesh", "ep=3", "--set", "train.global_batch_size=48"],
         "model.n_experts=8 is not divisible by ep=3"),
        (["--config", "moe-tiny", "--set", "model.experts_per_token=9"], "model.experts_per_token=9 is more than model.n_experts=8"),
        (["--config", "moe-tiny", "--set", "model.capacity_factor=0"], "--set model.capacity_factor=0.0: must be > 0"),
        (["--mesh", "dp=4,ep=2"], "--mesh ep=2 with model.n_experts=0"),
        (["--config", "moe-tiny", "--set", "model.moe_dispatch=dropless", "--set", "model.expert_matmul=mosaic"],
         "--set model.expert_matmul=mosaic: jax's Mosaic GPU ragged dot kernels need an NVIDIA Hopper GPU, 9.0 "
         "(this backend is cpu); use ragged_dot"),
        (["--config", "moe-tiny", "--set", "model.expert_matmul=mosaic", "--set", "model.moe_dispatch=capacity"],
         "the grouped matmul runs the dropless dispatch only"),
        (["--config", "moe-tiny", "--set", "model.expert_matmul=cutlass"], "choose one of ragged_dot, mosaic"),
        (["--set", "train.lr=nan"], "--set train.lr=nan: expected a finite float"),
        (["--steps", "3", "--profile-steps", "10:13"], "--profile-steps 10:13 does not fit in --steps 3"),
        (["--profile-steps", "1:100", "--steps", "3"], "--profile-steps 1:100 does not fit in --steps 3"),
        (["--profile-steps", "3:1"], "--profile-steps '3:1': expected START:END"),
        # Evaluation (configs/checks.py, training/data.py held_out, train.py --eval-only).
        (["--set", "train.eval_every=-1"], "--set train.eval_every=-1: must be >= 0 (0 = no evaluation)"),
        (["--set", "train.eval_batches=0"], "--set train.eval_batches=0: must be >= 1"),
        (["--set", "train.eval_every=5", "--set", "data.source=text", "--set", "data.path={file}"],
         "the held-out part of the corpus has 0 tokens, fewer than one window of train.seq_len=32 + 1"),
        (["--set", "train.eval_every=0", "--set", "data.source=text", "--set", "data.path={file}"],
         "the corpus has 16 tokens, fewer than train.seq_len=32 + 1"),
        (["--eval-only"], "--eval-only: --run-dir {run} holds no checkpoint"),
        (["--eval-only", "--dry-run"], "--eval-only and --dry-run: choose one"),
        (["--eval-only", "--steps", "10"], "--steps with --eval-only: evaluation trains no step; drop --steps"),
        (["--json"], "--json is for --dry-run: it prints the plan as JSON; add --dry-run or drop --json"),
        # The run directory itself.
        (["--run-dir", "{file}"], "is a file: name a directory"),
        (["--run-dir", "{file}/run"], "is a file, not a directory"),
    ],
)
def test_bad_input_is_one_clear_line(args, message, tmp_path):
    """rc 2, one `error:` line naming the flag and the fix, no traceback, nothing written."""
    run_dir, file = tmp_path / "run", tmp_path / "file"
    run_dir.mkdir()
    file.write_text("not a directory\n")
    args = [a.format(file=file) for a in args]
    message = message.format(run=run_dir)
    if "--run-dir" not in args:
        args += ["--run-dir", str(run_dir)]
    out = train(*args, fake_devices=True)
    assert out.returncode == 2, out.stderr
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0], out.stderr
    assert "Traceback" not in out.stderr
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == ["file", "run"]


@pytest.mark.parametrize("entry", ["train", "tools.convert", "tools.generate"])
def test_an_empty_run_dir_is_refused(entry, capsys):
    """`--run-dir "$RUN"` with RUN unset: Path('') is the current directory, which would become
    the run's (config.json, checkpoints/, metrics written there, or resumed from)."""
    import importlib

    module = importlib.import_module(entry)
    args = {"train": [], "tools.convert": ["--from-hf", "hf"], "tools.generate": ["--prompt", "x"]}[entry]
    with pytest.raises(SystemExit) as exit_:
        module.parse_args([*args, "--run-dir", " "])
    assert exit_.value.code == 2
    assert "argument --run-dir: empty; name the run's directory, e.g. --run-dir runs/try" in capsys.readouterr().err


def test_unwritable_run_dir_parent_is_refused(tmp_path, monkeypatch):
    """A place this process cannot write (checked with os.access: as root, chmod would not do)."""
    import cli as entry

    monkeypatch.setattr(entry.os, "access", lambda path, mode: False)
    with pytest.raises(entry.ConfigError) as err:
        entry.check_run_dir(tmp_path / "run")
    assert f"--run-dir {tmp_path / 'run'}: {tmp_path} is not writable" in str(err.value)


@pytest.mark.parametrize("folder", ["/proc/meshtrain-probe", "/proc"])
def test_a_place_whose_mode_bits_pass_but_refuses_writes_is_refused(folder, monkeypatch):
    """Root passes os.access everywhere (monkeypatched here as for root), yet /proc takes no new
    folder or file: the check tries one, so the measurement or run never starts (bench.step's
    record used to fail to write only after measuring)."""
    import cli as entry

    monkeypatch.setattr(entry.os, "access", lambda path, mode: True)
    with pytest.raises(entry.ConfigError, match=r"^--out /proc/meshtrain-probe/x.json: cannot write in /proc \("):
        entry.check_creatable(Path(folder), "--out /proc/meshtrain-probe/x.json", "--out")


def test_the_write_probe_leaves_nothing_behind(tmp_path):
    import cli as entry

    entry.check_creatable(tmp_path / "a" / "b", "--out x", "--out")
    entry.check_creatable(tmp_path, "--out x", "--out")
    assert list(tmp_path.iterdir()) == []


def test_mesh_larger_than_the_devices_present(tmp_path):
    """As on a GPU node, the devices are what they are (8 here: XLA_FLAGS fixes the count), so a
    mesh of 16 is refused with sizes that fit, before anything is written."""
    out = train("--mesh", "dp=16", "--run-dir", str(tmp_path / "run"))
    assert out.returncode == 2, out.stderr
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "needs 16 devices but 8 are available" in errors[0] and "dp=8" in errors[0]
    assert "Traceback" not in out.stderr and not (tmp_path / "run").exists()


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A run of 2 steps, evaluated and checkpointed at step 2."""
    run = tmp_path_factory.mktemp("trained")
    out = train("--steps", "2", "--set", "train.eval_every=2", "--set", "train.eval_batches=1", "--run-dir", str(run))
    assert out.returncode == 0, out.stderr
    assert "eval 2/2 | held-out loss" in out.stdout and "bits/byte" in out.stdout
    return run


def test_eval_only_scores_the_latest_checkpoint(trained):
    """Training evaluates at its last step; --eval-only on the run directory restores that
    step's checkpoint, trains nothing and logs the same held-out loss again."""
    again = train("--eval-only", "--run-dir", str(trained))
    assert again.returncode == 0, again.stderr
    assert "resumed from" in again.stdout and "eval 2/" in again.stdout and "held-out loss" in again.stdout
    records = [json.loads(line) for line in (trained / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], "loss" in r) for r in records] == [(2, True), (2, False), (2, False)]
    assert records[1]["eval_loss"] == records[2]["eval_loss"] and records[1]["eval_bpb"] is not None
    assert "eval_only" not in records[1]
    assert {k: records[2][k] for k in ("eval_only", "eval_batches", "seq_len", "data_source", "mesh")} == {
        "eval_only": True, "eval_batches": 1, "seq_len": 32, "data_source": "stdlib", "mesh": "dp=8"}


def _contents(run: Path) -> dict[str, bytes]:
    return {p.relative_to(run).as_posix(): p.read_bytes() if p.is_file() else b"" for p in sorted(run.rglob("*"))}


@pytest.mark.parametrize(
    "args, rc, message",
    [
        (["--steps", "1"], 2, "error: --run-dir {run} is at step 2, past train.steps=1: pass --steps N > 2"),
        (["--steps", "2"], 0, "done already: {run} is at step 2 = train.steps; pass --steps N > 2"),
        (["--steps", "3", "--set", "train.checkpoint_every=0"], 2,
         "error: --run-dir {run} holds checkpoints, and train.checkpoint_every=0 would neither resume"),
        (["--steps", "4", "--profile-steps", "0:2"], 2,
         "error: --profile-steps 0:2 starts before step 2, where this run resumes: trace later steps, e.g. "
         "--profile-steps 2:4"),
    ],
)
def test_a_resume_with_nothing_to_do_changes_nothing(trained, args, rc, message):
    """A resume whose steps or profile window lie behind the checkpoint (step 2), or that would
    ignore the checkpoints, says so in one line and leaves every file of the run as it was
    (config.json was once rewritten with the lowered train.steps)."""
    before = _contents(trained)
    out = train(*args, "--run-dir", str(trained))
    assert out.returncode == rc, out.stderr
    assert message.format(run=trained) in out.stdout + out.stderr and "Traceback" not in out.stderr
    if rc:  # the error alone, after jax started (orbax's warning of meshtrain's handler came first)
        assert len(out.stderr.splitlines()) == 1, out.stderr
    assert _contents(trained) == before


def test_a_resume_does_not_take_the_saved_profile_window(tmp_path):
    """A run traced with --profile-steps 1:3 resumes at step 4 without it (the saved window would
    be an error naming a flag not given); a new window can be given."""
    import dataclasses

    import train as entry

    cfg = small_config()
    saved = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, profile_steps="1:3"))
    (tmp_path / "config.json").write_text(json.dumps(saved.to_dict()))
    assert entry.resolve_config(entry.parse_args(["--run-dir", str(tmp_path)])).train.profile_steps == ""
    again = entry.parse_args(["--run-dir", str(tmp_path), "--steps", "9", "--profile-steps", "5:7"])
    assert entry.resolve_config(again).train.profile_steps == "5:7"


def test_a_run_dir_holding_what_is_not_a_run_is_refused(tmp_path):
    """A config.json that is not a run's (a Hugging Face model directory) is never overwritten,
    --config given or not; checkpoints/ as a file is refused before a step trains; a config
    refused after jax is imported leaves no run directory behind."""
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], "hidden_size": 64}')
    for extra in ([], ["--config", "tiny"]):
        out = train(*extra, "--run-dir", str(hf))
        assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
        assert (f"error: {hf / 'config.json'} is not a meshtrain run's config (it lacks data, model, name, parallel, "
                "train; a Hugging Face model directory?): choose another --run-dir") in out.stderr
    assert _contents(hf) == {"config.json": b'{"architectures": ["LlamaForCausalLM"], "hidden_size": 64}'}
    run = tmp_path / "run"
    run.mkdir()
    (run / "checkpoints").write_text("")
    out = train("--run-dir", str(run))
    assert out.returncode == 2 and f"{run / 'checkpoints'} is a file where checkpoints are saved" in out.stderr
    assert _contents(run) == {"checkpoints": b""}
    out = train("--set", "model.n_kv_heads=3", "--run-dir", str(tmp_path / "new"))  # refused by make_program
    assert out.returncode == 2 and "model.n_heads=8 is not a multiple of model.n_kv_heads=3" in out.stderr
    assert not (tmp_path / "new").exists()


def test_new_runs_never_share_a_default_run_dir(tmp_path):
    """Two runs started in the same second get runs/NAME-TIME and runs/NAME-TIME-2 (they once
    shared one: config.json overwritten, metrics interleaved); a named --run-dir is used as it is."""
    import cli as entry

    base = tmp_path / "runs" / "tiny-20260101-120000"
    claimed = [entry.make_run_dir(base, fresh=True) for _ in range(3)]
    assert claimed == [base, base.with_name(base.name + "-2"), base.with_name(base.name + "-3")]
    assert all(p.is_dir() for p in claimed) and entry.make_run_dir(base) == base


def test_a_backend_jax_cannot_start_is_one_line(monkeypatch):
    """JAX_PLATFORMS=cuda on a machine without CUDA ended in a bare AssertionError from jax."""
    import jax

    import sharding.mesh as entry
    from configs import ConfigError

    def no_backend():
        raise RuntimeError("Unable to initialize backend 'cuda': no CUDA-capable device is detected")

    monkeypatch.setattr(jax, "devices", no_backend)
    monkeypatch.setenv("JAX_PLATFORMS", "cuda")
    with pytest.raises(ConfigError, match=r"^jax could not start its backend \(Unable to initialize backend 'cuda'.*\); "
                                          r"JAX_PLATFORMS=cuda names a platform jax cannot start here"):
        entry.check_backend()


@pytest.mark.parametrize("args", [["bench.step", "--steps", "1"], ["bench.attention", "--lengths", "128"],
                                  ["bench.moe", "--ep", "1"], ["tools.collectives", "--mesh", "dp=2"],
                                  ["tools.generate", "--prompt", "a"], ["tools.plan", "--config", "tiny"],
                                  ["tools.topology"], ["tools.convert", "--to-hf"]],
                         ids=["bench.step", "bench.attention", "bench.moe", "tools.collectives", "tools.generate",
                              "tools.plan", "tools.topology", "tools.convert"])
def test_every_entry_point_names_a_backend_jax_cannot_start(tmp_path, monkeypatch, args):
    """Not only train.py (above): the benches and tools meet the backend through
    sharding.mesh.check_backend (build_mesh calls it), one error line and nothing written."""
    (tmp_path / "config.json").write_text(json.dumps(small_config().to_dict()))
    (tmp_path / "checkpoints" / "5").mkdir(parents=True)
    where = {"tools.generate": ["--run-dir", str(tmp_path)], "tools.plan": [], "tools.topology": [],
             "tools.convert": [str(tmp_path), "--out", str(tmp_path / "hf")]}.get(args[0], ["--out", str(tmp_path / "out.json")])
    monkeypatch.setenv("JAX_PLATFORMS", "bogus")
    out = run_module(*args, *where)
    assert out.returncode == 2 and out.stderr.startswith("error: jax could not start its backend (Unable to "
                                                        "initialize backend 'bogus'"), out.stderr
    assert out.stderr.strip().endswith("JAX_PLATFORMS=bogus names a platform jax cannot start here: unset it, or set cpu")
    assert len(out.stderr.strip().splitlines()) == 1 and not (tmp_path / "out.json").exists()
    assert not (tmp_path / "hf").exists()


ENTRY_POINTS = ["train", "pipeline.schedule", *(f"tools.{m}" for m in (
    "collectives", "convert", "generate", "gpu_compile", "hlo", "op_kinds", "plan", "topology", "trace_summary",
    "wheel_relay")),
    *(f"bench.{m}" for m in ("attention", "checkpoint", "context", "gpu", "moe", "pipeline", "step", "tables", "tp",
                             "tune_attention"))]


def test_every_entry_point_is_listed_here():
    """The list below is every module with a main() that builds configs.parser.Parser."""
    root = Path(__file__).resolve().parents[1]
    found = {".".join(p.relative_to(root).with_suffix("").parts) for p in root.glob("[a-z]*/*.py")
             if "Parser(" in p.read_text() and "\ndef main(" in p.read_text()}
    found |= {"train"}
    assert found == set(ENTRY_POINTS)


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_a_flag_argparse_refuses_is_one_error_line(entry, capsys):
    """argparse's own refusals (an unknown flag, a bad int) follow the bad-input rule too: one
    `error:` line, exit 2, no usage block (configs.parser.Parser)."""
    import importlib

    main = importlib.import_module(entry).main
    with pytest.raises(SystemExit) as stop:
        main(["--bogus"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert "unrecognized arguments: --bogus" in err or " required" in err, err
