"""meshtrain: train a sharded transformer.

  python train.py                                  tiny preset, stdlib corpus, CPU, ~2 minutes
  python train.py --mesh dp=8,tp=8                 64 devices (fake CPU devices on a laptop)
  python train.py --config 125m --set train.lr=3e-4 --run-dir runs/a
  python train.py --run-dir runs/a                 resume runs/a from its latest checkpoint
  python train.py --config llama3-8b --mesh dp=8,tp=8 --dry-run   plan only (tools/plan.py)

Arguments are parsed, and the config and mesh shape checked, before jax is imported: on CPU
this script sets XLA's host device count to what the mesh needs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Callable, NoReturn

from configs import PRESETS, ConfigError, RunConfig, apply_overrides, get_preset
from configs.checks import check_values
from sharding.mesh import format_mesh, parse_mesh, requested_devices
from sharding.xla_flags import FAKE_DEVICES, with_flags
from training.distributed import add_process_args, process_count


def add_run_args(p: argparse.ArgumentParser) -> None:
    """--config, --mesh and --set: what every entry point (train.py, bench/) takes."""
    p.add_argument("--config", help=f"preset: {', '.join(PRESETS)} (default tiny, or the config "
                   "saved in --run-dir when it holds one)")
    p.add_argument("--mesh", default="", help="axis sizes, e.g. dp=8,tp=8; axes pp dp fsdp sp tp; one may be -1")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field, e.g. --set model.n_layers=8 (repeatable)")


def run_config(args: argparse.Namespace, extra_sets: list[str] = (), base: RunConfig | None = None) -> RunConfig:
    """`base` (default: the preset of --config) with --set (then `extra_sets`) applied and --mesh
    as the mesh, every value checked (configs/checks.py)."""
    cfg = apply_overrides(base or get_preset(args.config or "tiny"), [*args.set, *extra_sets])
    cfg = dataclasses.replace(cfg, parallel=parse_mesh(args.mesh, cfg.parallel)) if args.mesh else cfg
    check_values(cfg)
    return cfg


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_args(p)
    p.add_argument("--steps", type=int, help="shortcut for --set train.steps=N")
    p.add_argument("--run-dir", type=Path,
                   help="output directory (default runs/<preset>-<time>); resumes from its latest checkpoint")
    p.add_argument("--profile-steps", help="START:END, trace these steps with jax.profiler")
    p.add_argument("--dry-run", action="store_true",
                   help="compile the step abstractly and print the plan (memory, collectives, time); train nothing")
    p.add_argument("--gpu", default="h100", help="with --dry-run: GPU to estimate for, h100|h200|a100")
    p.add_argument("--json", action="store_true", help="with --dry-run: print the plan as JSON")
    add_process_args(p)
    return p.parse_args(argv)


def saved_config(run_dir: Path | None) -> RunConfig | None:
    """The config.json of an existing run directory (the base config of a resume), or None."""
    path = run_dir / "config.json" if run_dir else None
    if path is None or not path.exists():
        return None
    try:
        return RunConfig.from_dict(json.loads(path.read_text()))
    except (TypeError, KeyError, ValueError) as e:
        raise ConfigError(f"{path} is not a config of this version ({e}): pass --config and --set explicitly") from None


def resolve_config(args: argparse.Namespace) -> RunConfig:
    shortcuts = [f"train.steps={args.steps}"] if args.steps is not None else []
    if args.profile_steps:
        shortcuts.append(f"train.profile_steps={args.profile_steps}")
    return run_config(args, shortcuts, base=None if args.config else saved_config(args.run_dir))


def check_run_dir(run_dir: Path) -> None:
    """Refuse, before jax is imported, a run directory that cannot be one: a file, a path through
    a file, or a place this process cannot write."""
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"--run-dir {run_dir} is a file: name a directory (a new one, or an earlier run's to resume)")
    existing = next(p for p in (run_dir, *run_dir.parents) if p.exists())
    if not existing.is_dir():
        raise ConfigError(f"--run-dir {run_dir}: {existing} is a file, not a directory; choose another --run-dir")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"--run-dir {run_dir}: {existing} is not writable; choose a --run-dir you can write")


def make_run_dir(run_dir: Path) -> None:
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
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


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    cfg = resolve_config(args)
    fake = request_fake_devices(cfg, process_count(args))
    if args.dry_run:
        from tools.plan import dry_run

        return dry_run(cfg, args.gpu, args.json)
    run_dir = args.run_dir or Path("runs") / f"{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    check_run_dir(run_dir)

    import jax  # noqa: E402 -- after XLA_FLAGS is final

    from sharding.mesh import build_mesh, mesh_config
    from tools.oom import advice, is_out_of_memory
    from training.build import abstract
    from training.checkpoint import Checkpointer
    from training.data import load_tokens
    from training.distributed import initialize
    from training.loop import TrainingStopped

    initialize(args)
    mesh = build_mesh(cfg.parallel)
    if fake and jax.default_backend() == "cpu":
        print(f"CPU platform: running mesh {format_mesh(dict(mesh.shape))} on {fake} fake host devices "
              f"per process ({jax.process_count()} process(es))")
    cfg = dataclasses.replace(cfg, parallel=mesh_config(mesh, cfg.parallel))
    make_run_dir(run_dir)
    # The abstract program checks the config against the mesh, and the data is read, before
    # anything is written: a rejected config or a bad data.path never overwrites the run
    # directory's config.json nor creates its checkpoints/.
    program = abstract(cfg, mesh)
    tokens = load_tokens(cfg.data, cfg.model.vocab_size)
    checkpoints = Checkpointer(run_dir / "checkpoints", cfg) if cfg.train.checkpoint_every else None
    try:
        records, job = build_and_train(cfg, mesh, program, tokens, run_dir, checkpoints)
    except TrainingStopped as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except Exception as e:  # XLA reports a failed device allocation as an XlaRuntimeError
        if not is_out_of_memory(e):
            raise
        device = jax.devices()[0]
        limit = (device.memory_stats() or {}).get("bytes_limit", 0)
        raise ConfigError(advice(cfg, dict(mesh.shape), limit, device.device_kind)) from None
    finally:
        if checkpoints:
            checkpoints.close()
    if records and int(job.state.step) == cfg.train.steps:
        print(f"done: final loss {records[-1]['loss']:.4f} after {cfg.train.steps} steps; metrics in {run_dir}")
    return 0


def build_and_train(cfg: RunConfig, mesh, program, tokens, run_dir: Path, checkpoints) -> tuple[list[dict], object]:
    """Build the job (restoring the latest checkpoint), save and print the config, train."""
    import jax

    from training.build import build
    from training.loop import train

    job = build(cfg, mesh, tokens, restore=checkpoints.restore_latest if checkpoints else None, program=program)
    text = json.dumps(cfg.to_dict(), indent=2)
    if jax.process_index() == 0:
        (run_dir / "config.json").write_text(text + "\n")
        print(f"config ({run_dir / 'config.json'}):\n{text}")
        print(f"XLA_FLAGS: {os.environ.get('XLA_FLAGS', '')}  (python -m sharding.xla_flags says why)")
    k, b, length = job.batches.shape
    print(
        f"{cfg.name}: {job.n_params / 1e6:.2f}M parameters | mesh {format_mesh(dict(mesh.shape))} "
        f"on {mesh.size} {jax.devices()[0].platform} device(s) | batch {k}x{b}x{length} tokens"
    )
    return train(job, run_dir, checkpoints), job


def run_cli(entry: Callable[[list[str]], int]) -> NoReturn:
    """Exit with entry's code; a ConfigError is one `error:` line and exit code 2, no traceback."""
    try:
        sys.exit(entry(sys.argv[1:]))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)


def cli() -> NoReturn:
    """The installed `meshtrain` command: train.py's arguments."""
    run_cli(main)


if __name__ == "__main__":
    cli()
