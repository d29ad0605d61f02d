"""tools/collectives.py on 8 fake CPU devices (mesh dp=2,tp=4): every program compiles to exactly
its one collective (kind, axes, group, bytes), nccl-tests' bandwidth arithmetic, the fitted
latency + bandwidth model, the record and its plot, and bad input as one `error:` line."""

import json

import pytest

from configs import ConfigError
from conftest import ROOT, child_env, run_module
from sharding.mesh import build_mesh, parse_mesh
from tools import collective_programs, collectives
from tools.busbw import OPS, Row, bandwidths, fit_model, message_count, summarize
from tools.collectives import parse_sizes
from tools.hlo import census

GROUPS = [(("tensor",), 4), (("data", "tensor"), 8)]
SIZE = 64 * 2**10  # bytes: 16K f32 elements, a multiple of every group size


@pytest.fixture(scope="module")
def mesh():
    return build_mesh(parse_mesh("dp=2,tp=4"))


@pytest.mark.parametrize("axes,n", GROUPS, ids=["tensor", "data+tensor"])
@pytest.mark.parametrize("name", list(OPS))
def test_program_is_one_collective(mesh, name, axes, n):
    """The census of the compiled program: one collective of the op's kind over `axes`, group n
    (2 for a permute's pairs), nccl-tests' S elements, and the bytes per device that busbw's
    factor gives (census' ring formulas = nccl-tests' bus factors)."""
    op = OPS[name]
    count = message_count(op, SIZE, 4, n)
    spec = collective_programs.input_spec(mesh, op, axes, n, count, "f32")
    [c] = census(collective_programs.program(mesh, op, axes, n).lower(spec).compile().as_text(), dict(mesh.shape))
    assert (c.kind, c.axes, c.group, c.dtype, c.elements) == (op.kind, axes, 2 if name == "permute" else n, "f32",
                                                              SIZE // 4)
    assert c.bytes_per_run == pytest.approx(SIZE * op.factor(n))
    assert collective_programs.check_program(mesh, op, axes, count, "f32") is None


def test_check_cli():
    out = run_module("tools.collectives", "--mesh", "dp=2,tp=4", "--check", "--sizes", "1K:2K")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert len(lines) == 5 * 3 * 2 and all(ln.startswith("ok ") for ln in lines)  # ops x (dp, tp, dp+tp) x sizes
    assert "all-gather     data+tensor      n=8   f32[256]" in out.stdout


def test_check_fails_on_a_second_collective(mesh, monkeypatch, capsys):
    """A program with more than its one collective fails --check: exit 1, the reason per program."""
    from jax import lax

    monkeypatch.setattr(collective_programs, "body", lambda op, axes, n: lambda x: lax.psum(lax.psum(x, axes) * 2, axes))
    assert collectives.run_check(mesh, [OPS["all-reduce"]], [("tensor",)], [SIZE], "f32") == 1
    out = capsys.readouterr().out
    assert "FAIL all-reduce" in out and "collectives check failed: 1 program(s)" in out


def test_bandwidth_arithmetic():
    """1 MiB in 1 ms: algbw 1.048576 GB/s; busbw x 2(n-1)/n, (n-1)/n or 1."""
    mib = 2**20
    assert bandwidths(mib, 1e-3, OPS["all-reduce"].factor(4)) == pytest.approx((1.048576, 1.048576 * 1.5))
    assert bandwidths(mib, 1e-3, OPS["all-reduce"].factor(8))[1] == pytest.approx(1.048576 * 1.75)
    for name in ("all-gather", "reduce-scatter", "all-to-all"):
        assert bandwidths(mib, 1e-3, OPS[name].factor(4))[1] == pytest.approx(1.048576 * 0.75)
    assert bandwidths(mib, 2e-3, OPS["permute"].factor(8)) == pytest.approx((0.524288, 0.524288))


def test_message_count_and_sizes():
    assert parse_sizes("1K:8K") == [1024, 2048, 4096, 8192]
    assert parse_sizes("3K:20K") == [4096, 8192, 16384]
    assert parse_sizes("4M") == [4 * 2**20]
    assert message_count(OPS["all-gather"], 1000, 4, 8) == 248  # 250 elements, down to a multiple of 8
    assert message_count(OPS["all-reduce"], 1000, 4, 8) == 250
    assert message_count(OPS["all-to-all"], 4, 4, 8) == 8  # at least one element per rank
    assert OPS["all-gather"].input_count(256, 8) == 32


def test_fit_recovers_synthetic_timings():
    """t = 7 us + S·factor / 180 GB/s, with +-1% alternating noise: the fit gives both back."""
    sizes = [2**k for k in range(10, 27)]
    factor = OPS["all-reduce"].factor(8)
    times = [(7e-6 + s * factor / 180e9) * (1 + 0.01 * (-1) ** i) for i, s in enumerate(sizes)]
    fit = fit_model(sizes, times, factor)
    assert fit["busbw_GBps"] == pytest.approx(180, rel=0.02)
    assert fit["latency_us"] == pytest.approx(7, rel=0.05)
    assert fit_model(sizes[:3], [3e-5, 2e-5, 1e-5], factor)["busbw_GBps"] is None  # no growth: no bandwidth


def test_summary_floor_and_half_peak():
    rows = [Row("permute", "tensor", 4, s, s // 4, t, s / t / 1e3, s / t / 1e3)
            for s, t in [(1024, 10.0), (2048, 10.0), (4096, 11.0), (8192, 12.0)]]
    s = summarize(rows)
    assert s["latency_floor_us"] == 10.0
    assert s["peak_busbw_GBps"] == pytest.approx(8192 / 12e3)
    assert s["half_peak_size"] == 4096  # 0.372 GB/s >= 0.683 / 2; 2048 B gives 0.205


def test_record_and_plot(tmp_path):
    out, png = tmp_path / "c.json", tmp_path / "c.png"
    run = run_module("tools.collectives", "--mesh", "dp=2,tp=4", "--sizes", "1K:4K", "--ops", "all-reduce,permute",
                     "--axes", "tp,dp+tp", "--iters", "2", "--out", str(out), "--png", str(png))
    assert run.returncode == 0, run.stderr
    assert "smoke run on CPU" in run.stdout and "# all-reduce over data+tensor (n=8), f32" in run.stdout
    record = json.loads(out.read_text())
    assert record["command"].startswith("python -m tools.collectives --mesh dp=2,tp=4")
    assert record["environment"]["backend"] == "cpu" and record["mesh"] == "dp=2,tp=4"
    assert record["smoke"].startswith("smoke run on CPU")
    assert len(record["rows"]) == 2 * 2 * 3 and len(record["summary"]) == 4
    assert set(record["fit"]) == {"tensor", "data+tensor"}
    assert set(record["fit"]["tensor"]["permute"]) == {"latency_us", "busbw_GBps"}
    assert png.stat().st_size > 0


@pytest.mark.parametrize("args,message", [
    (["--ops", "all-reduce,bcast"], "unknown op bcast"),
    (["--axes", "tensor,model"], "'model' is not a mesh axis"),
    (["--axes", "fsdp"], "axis fsdp has size 1"),
    (["--sizes", "1K:lots"], "'lots' is not a size; write a positive number"),
    (["--sizes", "2G"], "above this device's limit of 1024 MiB"),
    (["--mesh", "dp=2,tp=2"], "needs 4 devices but 8 are available"),
])
def test_bad_input_is_one_error_line(args, message):
    """The test session's 8 fake devices are kept (fake_devices=False), so dp=2,tp=2 does not match."""
    out = run_module("tools.collectives", "--mesh", "dp=2,tp=4", *args, "--check", fake_devices=False)
    assert out.returncode == 2
    assert out.stderr.startswith("error: ") and out.stderr.count("\n") == 1 and message in out.stderr, out.stderr


def test_a_size_below_the_smallest_message_is_refused():
    """In process, before anything compiles: all-gather over data+tensor (n=8) splits f32 in 8."""
    with pytest.raises(ConfigError, match="--sizes: 1 B is below the smallest message .* 32 B; start --sizes at 32"):
        collectives.main(["--mesh", "dp=2,tp=4", "--sizes", "1"])
    assert collectives.smallest_message([OPS["all-reduce"]], [8], 2) == 2


def test_an_out_under_a_file_is_refused_before_measuring(tmp_path):
    (tmp_path / "afile").write_text("")
    with pytest.raises(ConfigError, match=f"--out {tmp_path}/afile/x.json: {tmp_path}/afile is a file"):
        collectives.parse_args(["--mesh", "dp=2", "--out", str(tmp_path / "afile" / "x.json")])
    (tmp_path / "pics.png").mkdir()
    with pytest.raises(ConfigError, match=f"--png {tmp_path}/pics.png is a directory"):
        collectives.parse_args(["--mesh", "dp=2", "--png", str(tmp_path / "pics.png")])
    with pytest.raises(SystemExit):  # argparse: not a .png name (matplotlib would write busbw.png)
        collectives.parse_args(["--mesh", "dp=2", "--png", str(tmp_path / "busbw")])


def test_two_processes_run_the_sweep_and_agree_with_one(tmp_path):
    """2 processes x 4 fake CPU devices (gloo, 127.0.0.1) run a small sweep on dp=2,tp=4; process
    0 alone writes the record, whose table (op, axes, group, size, count) is the one-process
    run's. Timings differ (a network of processes instead of one address space) and are not
    compared."""
    import socket
    import subprocess
    import sys

    def free_port() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    sweep = ["--mesh", "dp=2,tp=4", "--sizes", "1K:4K", "--ops", "all-reduce,all-gather,permute", "--iters", "2"]
    one = run_module("tools.collectives", *sweep, "--out", str(tmp_path / "one.json"))
    assert one.returncode == 0, one.stderr
    env = child_env()
    coordinator = f"127.0.0.1:{free_port()}"
    procs = [subprocess.Popen(
        [sys.executable, "-m", "tools.collectives", *sweep, "--out", str(tmp_path / "two.json"),
         "--coordinator", coordinator, "--num-processes", "2", "--process-id", str(i)],
        cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for i in range(2)]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert "busbw" in outs[0] and "busbw" not in outs[1]  # process 0 prints the tables

    def table(path):
        rows = json.loads(path.read_text())["rows"]
        return sorted((r["op"], r["axes"], r["group"], r["size"], r["count"]) for r in rows)

    assert table(tmp_path / "two.json") == table(tmp_path / "one.json") != []
