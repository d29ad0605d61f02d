"""The command line shared by every entry point (train.py, tools/, bench/); imports no jax.

`--config`, `--mesh` and `--set` make a checked RunConfig (configs/checks.py: every value;
sharding/mesh.py: the mesh spec); `request_fake_devices` sets XLA_FLAGS before jax is
imported (on CPU, as many fake host devices as the mesh needs; on GPUs the defaults of
sharding/xla_flags.py); `run_cli` turns a ConfigError into one `error:` line and exit code 2.
The run directory is checked here too, before anything is built or written.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import itertools
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Callable, NoReturn

from configs import PRESETS, ConfigError, RunConfig, apply_overrides, get_preset
from configs.checks import check_values
from sharding.checks import check_run
from sharding.mesh import AXES, parse_mesh, requested_devices
from sharding.xla_flags import FAKE_DEVICES, with_flags

def add_run_args(p: argparse.ArgumentParser) -> None:
    """--config, --mesh and --set: what every entry point (train.py, bench/) takes."""
    p.add_argument("--config", help=f"preset: {', '.join(PRESETS)} (default tiny; train.py resumes "
                   "from the config saved in --run-dir when it holds one)")
    p.add_argument("--mesh", default="", help="axis sizes, e.g. dp=8,tp=8; axes pp dp fsdp sp tp; one may be -1")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field, e.g. --set model.n_layers=8 (repeatable)")


def run_config(args: argparse.Namespace, extra_sets: list[str] = (), base: RunConfig | None = None) -> RunConfig:
    """`base` (default: the preset of --config) with --set (then `extra_sets`) applied and --mesh
    as the mesh, every value checked (configs/checks.py) and, when the mesh has no -1 axis, every
    shape rule on it (sharding/checks.py), all before jax is imported."""
    cfg = apply_overrides(base or get_preset(args.config or "tiny"), [*args.set, *extra_sets])
    cfg = dataclasses.replace(cfg, parallel=parse_mesh(args.mesh, cfg.parallel)) if args.mesh else cfg
    check_values(cfg)
    sizes = {a: getattr(cfg.parallel, a) for a in AXES}
    if -1 not in sizes.values():
        check_run(cfg, sizes)
    return cfg


RUN_KEYS = {f.name for f in dataclasses.fields(RunConfig)}  # what marks a config.json as a run's


def run_dir_path(text: str) -> Path:
    """argparse type of --run-dir: a Path, refusing an empty one (an unset shell variable), which
    Path would read as the current directory and fill with a run."""
    if not text.strip():
        raise argparse.ArgumentTypeError("empty; name the run's directory, e.g. --run-dir runs/try (a new "
                                         "one, or an earlier run's to resume)")
    return Path(text)


def saved_config(run_dir: Path | None) -> RunConfig | None:
    """The config.json of an existing run directory (the base config of a resume), or None."""
    path = run_dir / "config.json" if run_dir else None
    if path is None or not path.exists():
        return None
    saved = _own_config(path)
    try:
        return RunConfig.from_dict(saved)
    except (TypeError, KeyError, ValueError) as e:
        raise ConfigError(f"{path} was written by another meshtrain version ({e}); to train on in this "
                          "directory, pass train.py --config and --set explicitly (config.json is then rewritten)") from None


def _own_config(path: Path) -> dict:
    """The JSON of `path`, refused unless it is a meshtrain run's config: a run directory must not
    overwrite someone else's config.json (a Hugging Face model directory holds one too)."""
    try:
        saved = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path} cannot be read as JSON ({e}); choose another --run-dir") from None
    missing = RUN_KEYS - set(saved) if isinstance(saved, dict) else RUN_KEYS
    if missing:
        raise ConfigError(f"{path} is not a meshtrain run's config (it lacks {', '.join(sorted(missing))}; "
                          "a Hugging Face model directory?): choose another --run-dir, which will not overwrite it")
    return saved


def holds_checkpoint(run_dir: Path | None) -> bool:
    """Whether `run_dir` has a saved step, checkpoints/<step> (training/checkpoint.py)."""
    saved = run_dir / "checkpoints" if run_dir else None
    return bool(saved and saved.is_dir() and any(p.name.isdigit() for p in saved.iterdir()))


def check_run_dir(run_dir: Path) -> None:
    """Refuse, before jax is imported, a run directory that cannot be one: a file, a path through
    a file, a place this process cannot write, a checkpoints/ that is a file, or a config.json
    that is not a meshtrain run's (it would be overwritten)."""
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"--run-dir {run_dir} is a file: name a directory (a new one, or an earlier run's to resume)")
    check_creatable(run_dir, f"--run-dir {run_dir}", "--run-dir")
    checkpoints = run_dir / "checkpoints"
    if checkpoints.exists() and not checkpoints.is_dir():
        raise ConfigError(f"--run-dir {run_dir}: {checkpoints} is a file where checkpoints are saved; "
                          "move it away or choose another --run-dir")
    if (run_dir / "config.json").exists():
        _own_config(run_dir / "config.json")


def check_creatable(folder: Path, where: str, flag: str) -> None:
    """Refuse a folder that cannot be made or written: a path through a file, or its nearest
    existing ancestor (itself, if it exists) not writable by this process. `where` starts the
    message ('--out x.json'), `flag` names the fix."""
    existing = next(p for p in (folder, *folder.parents) if p.exists())
    if not existing.is_dir():
        raise ConfigError(f"{where}: {existing} is a file, not a directory; choose another {flag}")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"{where}: {existing} is not writable; choose another {flag}")
    # os.access trusts the mode bits, which root passes everywhere (/proc, a read-only mount):
    # try it. An existing folder takes a temporary file; otherwise its first missing folder is
    # made and removed again (another process making it at the same moment is no refusal).
    try:
        if existing == folder:
            tempfile.TemporaryFile(dir=folder).close()
        else:
            probe = existing / folder.relative_to(existing).parts[0]
            try:
                probe.mkdir()
            except FileExistsError:
                pass
            else:
                with contextlib.suppress(OSError):  # another process writes in it already
                    probe.rmdir()
    except OSError as e:
        raise ConfigError(f"{where}: cannot write in {existing} ({e.strerror}); choose another {flag}") from None


def make_run_dir(run_dir: Path, fresh: bool = False) -> Path:
    """Create `run_dir` (an existing one is a resume) and return it. fresh (the default name of a
    new run): claim a directory of its own, `run_dir`, else `run_dir-2`, ..., so that two runs
    started in the same second never share one."""
    try:
        if not fresh:
            run_dir.mkdir(parents=True, exist_ok=True)
            return run_dir
        run_dir.parent.mkdir(parents=True, exist_ok=True)
        for n in itertools.count(1):
            claimed = run_dir if n == 1 else run_dir.with_name(f"{run_dir.name}-{n}")
            try:
                claimed.mkdir()
                return claimed
            except FileExistsError:
                continue
    except OSError as e:
        raise ConfigError(f"--run-dir {run_dir}: cannot create it ({e.strerror}); choose another --run-dir") from None


def request_fake_devices(cfg: RunConfig, processes: int = 1) -> int | None:
    """Set XLA_FLAGS before jax is imported: meshtrain's workarounds, and a host platform with
    this process's share of the mesh's devices; returns that number, or None if not requested."""
    current = os.environ.get("XLA_FLAGS", "")
    needed = requested_devices(cfg.parallel)
    if not needed or needed == 1 or FAKE_DEVICES in current:
        os.environ["XLA_FLAGS"] = with_flags(current)
        return None
    if needed % processes:
        raise ConfigError(f"--mesh needs {needed} devices, not divisible by {processes} processes")
    needed //= processes
    os.environ["XLA_FLAGS"] = with_flags(current, needed)
    return needed


GC_THRESHOLDS = (100_000, 50, 100)  # Python's default: (700, 10, 10) to 3.12, (2000, 10, 10) on 3.13


def run_cli(entry: Callable[[list[str]], int]) -> NoReturn:
    """Exit with entry's code; a ConfigError is one `error:` line and exit code 2, no traceback.

    While entry runs, Python's cyclic collector runs its young generation every 100,000
    allocations instead of every 700 (`GC_THRESHOLDS`; cycles are still collected): tracing and
    lowering a train step allocate millions of short-lived objects, and each young collection
    also walks what survived into the older ones. Alternated three times each (jax 0.12.1, 2
    cores): a 5-step train.py run of the tests' small model on dp=2,tp=2 took 5.05 s instead of
    5.61 s, tools.plan's H100 compile of tiny on pp=2,dp=2 4.71 s instead of 5.05 s.

    After entry returns, what it left is frozen out of the collector's reach (`gc.freeze`) before
    the interpreter exits: Python's finalization otherwise walks every object jax and flax made
    for one last cyclic collection. A tiny train.py run (jax 0.12.1, Python 3.12) took 0.47-0.51 s
    from its last line to its exit, 0.12 s so. Entry has closed its files and checkpoints by then
    (the logger, the checkpointer); what is only refcounted is still freed.
    """
    gc.set_threshold(*GC_THRESHOLDS)
    try:
        code = entry(sys.argv[1:])
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    gc.freeze()
    sys.exit(code)
