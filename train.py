"""meshtrain: train a sharded transformer.

  python train.py                                  tiny preset, stdlib corpus, CPU, ~2 minutes
  python train.py --mesh dp=8,tp=8                 64 devices (fake CPU devices on a laptop)
  python train.py --config 125m --set train.lr=3e-4 --run-dir runs/a
  python train.py --run-dir runs/a                 resume runs/a from its latest checkpoint
  python train.py --run-dir runs/a --eval-only     held-out loss of runs/a's latest checkpoint
  python train.py --config llama3-8b --mesh dp=8,tp=8 --dry-run   plan only (tools/plan.py)
      [--bandwidth FILE.json]                     on links measured by python -m tools.collectives

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
from typing import NoReturn

from cli import (add_run_args, check_run_dir, holds_checkpoint, make_run_dir, request_fake_devices, run_dir_path,
                 run_cli, run_config, saved_config)
from configs import ConfigError, RunConfig
from configs.checks import parse_window
from configs.parser import Parser
from sharding.checks import explicit_context
from sharding.cores import choose_core, device_capability
from sharding.mesh import format_mesh
from tools.bandwidth import add_bandwidth_arg, load
from tools.calibration import add_calibration_arg, rated_gpu
from training.distributed import add_process_args, process_count
from training.metrics import param_counts


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = Parser(__doc__)
    add_run_args(p)
    p.add_argument("--steps", type=int, help="shortcut for --set train.steps=N")
    p.add_argument("--run-dir", type=run_dir_path,
                   help="output directory (default runs/<preset>-<time>); resumes from its latest checkpoint")
    p.add_argument("--profile-steps", help="START:END, trace these steps with jax.profiler")
    p.add_argument("--dry-run", action="store_true",
                   help="compile the step abstractly and print the plan (memory, collectives, time); train nothing")
    p.add_argument("--eval-only", action="store_true",
                   help="evaluate the latest checkpoint of --run-dir on the held-out data; train nothing")
    p.add_argument("--gpu", help="with --dry-run: GPU to estimate for, h100|h200|a100 (default h100)")
    p.add_argument("--json", action="store_true", help="with --dry-run: print the plan as JSON")
    add_bandwidth_arg(p)
    add_calibration_arg(p)
    add_process_args(p)
    return p.parse_args(argv)


def resolve_config(args: argparse.Namespace) -> RunConfig:
    """The preset's config, or a resumed run's saved one, then --steps, --profile-steps, --set.
    The saved profile window is not taken: it names steps of the invocation that traced them."""
    shortcuts = [f"train.steps={args.steps}"] if args.steps is not None else []
    if args.profile_steps:
        shortcuts.append(f"train.profile_steps={args.profile_steps}")
    base = None if args.config else saved_config(args.run_dir)
    if base is not None:
        base = dataclasses.replace(base, train=dataclasses.replace(base.train, profile_steps=""))
    return run_config(args, shortcuts, base=base)


def check_eval_only(args: argparse.Namespace) -> None:
    """--eval-only needs a run directory that holds a checkpoint, and no --dry-run, --steps or
    --profile-steps (it trains nothing)."""
    if args.dry_run:
        raise ConfigError("--eval-only and --dry-run: choose one (--dry-run compiles the train step, runs nothing)")
    for flag, given in (("--steps", args.steps), ("--profile-steps", args.profile_steps)):
        if given is not None:
            raise ConfigError(f"{flag} with --eval-only: evaluation trains no step; drop {flag}")
    if not holds_checkpoint(args.run_dir):
        where = f"--run-dir {args.run_dir} holds no checkpoint" if args.run_dir else "no --run-dir given"
        raise ConfigError(f"--eval-only: {where}; name the directory of a run that saved one "
                          "(train.checkpoint_every > 0), e.g. --run-dir runs/tiny-20260101-120000")


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    cfg = resolve_config(args)
    check_flags(args)
    measured = load(args.bandwidth) if args.bandwidth else None
    gpu = rated_gpu(args.gpu or "h100", args.calibration)
    processes = process_count(args)
    fake = request_fake_devices(cfg, processes)
    if args.dry_run:
        from tools.plan import dry_run

        return dry_run(cfg, gpu, args.json, measured)
    run_dir = chosen_run_dir(args, cfg, processes)

    import jax  # noqa: E402 -- after XLA_FLAGS is final

    from sharding.mesh import build_mesh, mesh_config
    from training.build import make_program
    from training.data import load_tokens
    from training.evaluate import evaluate_run
    from training.distributed import initialize

    initialize(args)
    mesh = build_mesh(cfg.parallel)  # a backend jax cannot start: one error line (check_backend)
    if fake and jax.default_backend() == "cpu":
        print(f"CPU platform: running mesh {format_mesh(dict(mesh.shape))} on {fake} fake host devices "
              f"per process ({jax.process_count()} process(es))")
    cfg = dataclasses.replace(cfg, parallel=mesh_config(mesh, cfg.parallel))
    # The abstract program checks the config against the mesh, and the data is read, before
    # anything is written: a rejected config or a bad data.path neither creates the run
    # directory nor overwrites its config.json, nor creates its checkpoints/.
    program = make_program(cfg, mesh)
    corpus = load_tokens(cfg.data, cfg.model.vocab_size)
    if args.eval_only:
        return evaluate_run(cfg, mesh, program, corpus, run_dir)
    if cfg.train.eval_every:  # a held-out part, then a corpus, shorter than one window: refused before any write
        program.held_out(corpus.eval)
    program.batches(corpus.train, cfg.data.seed)
    return train_in(make_run_dir(run_dir, fresh=args.run_dir is None), cfg, mesh, program, corpus)


def check_flags(args: argparse.Namespace) -> None:
    """The flags that mean something only with --dry-run, and --eval-only's needs: refused before
    anything else."""
    for flag, given, what in (("--bandwidth", args.bandwidth, "sets the links of the plan's step time"),
                              ("--calibration", args.calibration, "sets the rates of the plan's step time"),
                              ("--gpu", args.gpu, "names the GPU the plan is for"),
                              ("--json", args.json, "prints the plan as JSON")):
        if given and not args.dry_run:
            raise ConfigError(f"{flag} is for --dry-run: it {what}; add --dry-run or drop {flag}")
    if args.eval_only:
        check_eval_only(args)


def chosen_run_dir(args: argparse.Namespace, cfg: RunConfig, processes: int) -> Path:
    """--run-dir, or runs/NAME-<start time> for a single process; checked (before jax starts)."""
    if processes > 1 and args.run_dir is None:
        raise ConfigError(f"a run of {processes} processes needs --run-dir: each would name its own default "
                          "(runs/NAME-<its start time>), and the checkpoints are one directory they all write; "
                          f"give a folder they share, e.g. --run-dir runs/{cfg.name}")
    run_dir = args.run_dir or Path("runs") / f"{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    check_run_dir(run_dir)
    if not cfg.train.checkpoint_every and not args.eval_only and holds_checkpoint(run_dir):
        raise ConfigError(f"--run-dir {run_dir} holds checkpoints, and train.checkpoint_every=0 would neither resume "
                          "from them nor save: resume with train.checkpoint_every >= 1, or choose a new --run-dir")
    return run_dir


def train_in(run_dir: Path, cfg: RunConfig, mesh, program, corpus) -> int:
    """Train in the created `run_dir`: exit code 0, or 1 when training stopped on bad steps; a
    full disk or an out-of-memory device is one ConfigError naming the fix."""
    import jax

    from tools.oom import advice, is_disk_full, is_out_of_memory
    from training.checkpoint import Checkpointer
    from training.loop import TrainingStopped

    checkpoints = Checkpointer(run_dir / "checkpoints", cfg) if cfg.train.checkpoint_every else None
    try:
        records, job = build_and_train(cfg, mesh, program, corpus, run_dir, checkpoints)
    except TrainingStopped as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except Exception as e:  # XLA reports a failed device allocation as an XlaRuntimeError
        if is_disk_full(e):
            raise ConfigError(f"no space left on the disk of {run_dir} while saving a checkpoint: free space, lower "
                              "train.keep_checkpoints, or resume elsewhere (copy the run directory); the next resume "
                              "starts from the last complete checkpoint") from None
        if not is_out_of_memory(e):
            raise
        device = jax.devices()[0]
        limit = (device.memory_stats() or {}).get("bytes_limit", 0)
        raise ConfigError(advice(cfg, dict(mesh.shape), limit, device.device_kind)) from None
    finally:
        if checkpoints:
            checkpoints.close()
    if job is not None and int(job.state.step) == cfg.train.steps:  # a one-step run logs no record, only its compile
        loss = f"final loss {records[-1]['loss']:.4f} " if records else ""
        print(f"done: {loss}after {cfg.train.steps} steps; metrics in {run_dir}")
    return 0


def core_hint(cfg: RunConfig, platform: str, capability: tuple[int, int] | None) -> str:
    """A note when a GPU run is set to the xla attention core where model.attention=auto (the
    default) would fuse it: the speed-up the H100 record of `make gpu-check` measured."""
    m, context = cfg.model, explicit_context(cfg, cfg.parallel.sequence) is not None
    fused = choose_core("auto", platform, capability, m.compute_dtype, m.head_dim, context)
    if m.attention != "xla" or fused == "xla":
        return ""
    return (f"note: model.attention=xla on a GPU writes its [N, L, L] scores to HBM; on one H100 the fused "
            f"cudnn core ran attention forward + backward 8.6x as fast (L = 8192: 496 against 57 TFLOP/s, "
            f"bench/results/gpu-nvidia-h100-80gb-hbm3-20261124.json): --set model.attention=auto ({fused} here)")


def check_resume(cfg: RunConfig, step: int, run_dir: Path) -> bool:
    """Whether a run restored at `step` has steps left to train (False: it has run all of
    train.steps, and says so). A lowered --steps, or a --profile-steps window that starts before
    `step` (it would be skipped, no trace), is refused before config.json is rewritten."""
    t = cfg.train
    if step > t.steps:
        raise ConfigError(f"--run-dir {run_dir} is at step {step}, past train.steps={t.steps}: pass --steps "
                          f"N > {step} to train on, or choose a new --run-dir")
    if step == t.steps:
        print(f"done already: {run_dir} is at step {step} = train.steps; pass --steps N > {step} to train on")
        return False
    window = parse_window(t.profile_steps)
    if window and window[0] < step:
        raise ConfigError(f"--profile-steps {t.profile_steps} starts before step {step}, where this run resumes: "
                          f"trace later steps, e.g. --profile-steps {step}:{min(step + 2, t.steps)}")
    return True


def build_and_train(cfg: RunConfig, mesh, program, corpus, run_dir: Path, checkpoints
                    ) -> tuple[list[dict], object | None]:
    """Build the job (restoring the latest checkpoint), save and print the config, train; job is
    None when the restored run had no step left (`check_resume`)."""
    import jax

    from training.build import build
    from training.loop import train

    job = build(cfg, mesh, corpus, restore=checkpoints.restore_latest if checkpoints else None, program=program)
    if not check_resume(cfg, int(job.state.step), run_dir):
        return [], None
    text = json.dumps(cfg.to_dict(), indent=2)
    if jax.process_index() == 0:
        (run_dir / "config.json").write_text(text + "\n")
        print(f"config ({run_dir / 'config.json'}):\n{text}")
        print(f"XLA_FLAGS: {os.environ.get('XLA_FLAGS', '')}  (python -m sharding.xla_flags says why)")
        hint = core_hint(cfg, jax.default_backend(), device_capability())
        if hint:
            print(hint)
    k, b, length = job.batches.shape
    active = f" ({param_counts(cfg.model)[1] / 1e6:.2f}M active)" if cfg.model.n_experts else ""
    print(
        f"{cfg.name}: {job.n_params / 1e6:.2f}M parameters{active} | mesh {format_mesh(dict(mesh.shape))} "
        f"on {mesh.size} {jax.devices()[0].platform} device(s) | batch {k}x{b}x{length} tokens\n"
        f"strategies: {program.strategies.describe()}"
    )
    return train(job, run_dir, checkpoints), job


def cli() -> NoReturn:
    """The installed `meshtrain` command: train.py's arguments."""
    run_cli(main)


if __name__ == "__main__":
    cli()
