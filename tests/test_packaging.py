"""The wheel that `pip install .` builds holds every package, and runs from outside the checkout."""

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from conftest import child_env

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("bench", "configs", "model", "pipeline", "sharding", "tools", "training")


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> tuple[Path, Path]:
    """(the wheel, a folder it is installed into with --target), built from a copy of this
    checkout (setuptools would reuse a stale build/ folder of the checkout itself)."""
    out = tmp_path_factory.mktemp("wheel")
    source = out / "source"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(
        ".git", ".venv*", "build", "runs", "__pycache__", "*.egg-info", ".pytest_cache", ".hypothesis"))
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(source)],
                           capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stderr[-3000:]
    (wheel,) = out.glob("meshtrain-*.whl")
    target = out / "site"
    install = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target),
                              str(wheel)], capture_output=True, text=True, timeout=600)
    assert install.returncode == 0, install.stderr[-3000:]
    return wheel, target


def test_wheel_holds_every_module(installed):
    wheel, _ = installed
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {"train.py", "cli.py"} | {
        p.relative_to(ROOT).as_posix() for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")
    }
    assert expected <= names, sorted(expected - names)
    assert any(n.endswith("entry_points.txt") for n in names)


def _outside(target: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    """python args... in `cwd` (not the checkout) with only the installed copy importable."""
    env = child_env(PYTHONPATH=str(target))
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def test_installed_copy_imports_and_runs_outside_the_checkout(installed, tmp_path):
    _, target = installed
    code = "import training.step, pipeline.one_f_one_b, train; print(training.step.__file__, train.__file__)"
    done = _outside(target, tmp_path, "-c", code)
    assert done.returncode == 0, done.stderr[-3000:]
    assert all(Path(f).is_relative_to(target) for f in done.stdout.split())
    schedule = _outside(target, tmp_path, "-m", "pipeline.schedule", "--schedule", "1f1b", "--stages", "2",
                        "--microbatches", "4")
    assert schedule.returncode == 0, schedule.stderr[-3000:]
    assert "bubble" in schedule.stdout
    run = _outside(target, tmp_path, "-m", "train", "--steps", "2", "--run-dir", str(tmp_path / "run"),
                   "--set", "train.log_every=1", "--set", "train.checkpoint_every=0")
    assert run.returncode == 0, run.stderr[-3000:]
    assert "done: final loss" in run.stdout and (tmp_path / "run" / "config.json").exists()
