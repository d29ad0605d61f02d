"""Several processes: `jax.distributed.initialize` from explicit flags or SLURM's environment.

Explicit: `--coordinator host:port --num-processes N --process-id I` on every process (process
0 serves the coordinator at host:port). SLURM: with SLURM_NTASKS > 1, jax's own detection reads
SLURM_JOB_ID, SLURM_STEP_NODELIST (the coordinator is the first node, the port derived from the
job id), SLURM_NTASKS, SLURM_PROCID and SLURM_LOCALID; under `sbatch` without `srun` only
SLURM_JOB_NODELIST exists, and it is used in its place. A partial or non-integer set of these
is refused before jax starts, naming the variables. Each process says on stderr whom it waits
for before it joins, since initialize blocks until all have.

After initialize every process sees all devices (`jax.devices()`) and its own
(`jax.local_devices()`); sharding/mesh.py builds the hybrid mesh, training/data.py has each
process load only its rows of the global batch, process 0 alone logs and writes config.json,
and checkpoints are written by all processes together. On CPU, cross-process collectives use
gloo (the default in jax 0.10, set explicitly here).

`process_count` needs no jax: train.py calls it before importing jax, to give each process its
share of the fake CPU devices.
"""

from __future__ import annotations

import argparse
import os
import sys

from configs.base import ConfigError

EXPLICIT = ("coordinator", "num_processes", "process_id")
# What jax's SLURM detection (jax/_src/clusters/slurm_cluster.py) reads, integers all but the node list.
SLURM_INTEGERS = ("SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_JOB_ID")
SLURM_FIX = "run under srun, or pass --coordinator, --num-processes and --process-id"
JOIN_TIMEOUT = 300  # seconds jax.distributed.initialize waits for every process (jax's default)


def add_process_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--coordinator", metavar="HOST:PORT", help="process 0's address (several processes)")
    p.add_argument("--num-processes", type=int, help="number of processes (with --coordinator)")
    p.add_argument("--process-id", type=int, help="this process's index, 0..N-1 (with --coordinator)")


def process_count(args: argparse.Namespace) -> int:
    """Processes in this run: --num-processes, else SLURM_NTASKS, else 1 (checks the flags)."""
    given = [getattr(args, name) is not None for name in EXPLICIT]
    if any(given) and not all(given):
        raise ConfigError("--coordinator, --num-processes and --process-id go together: give all three")
    if all(given):
        check_coordinator(args.coordinator)
        if args.num_processes < 1:
            raise ConfigError(f"--num-processes {args.num_processes}: must be >= 1")
        if not 0 <= args.process_id < args.num_processes:
            raise ConfigError(f"--process-id {args.process_id}: must be in 0..{args.num_processes - 1}")
        return args.num_processes
    return slurm_tasks()


def slurm_tasks() -> int:
    """SLURM_NTASKS (1 when unset), after checking that jax can initialize from SLURM's
    environment when it is above 1: ConfigError naming the missing or non-integer variables."""
    tasks = os.environ.get("SLURM_NTASKS", "1")
    if not tasks.strip().isdecimal() or int(tasks) < 1:
        raise ConfigError(f"SLURM_NTASKS={tasks!r} is not a positive integer; {SLURM_FIX}")
    if int(tasks) == 1:
        return 1
    missing = [v for v in SLURM_INTEGERS if v not in os.environ]
    if not {"SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST"} & set(os.environ):
        missing.append("SLURM_STEP_NODELIST")
    bad = [f"{v}={os.environ[v]!r}" for v in SLURM_INTEGERS if v in os.environ and not os.environ[v].strip().isdecimal()]
    problems = ([f"missing {', '.join(missing)}"] if missing else []) + ([f"non-integer {', '.join(bad)}"] if bad else [])
    if problems:
        raise ConfigError(f"SLURM_NTASKS={tasks} asks for {tasks} processes, but the environment has "
                          f"{' and '.join(problems)} (jax's SLURM detection reads them); {SLURM_FIX}")
    return int(tasks)


def check_coordinator(address: str) -> None:
    """Refuse a --coordinator that is not HOST:PORT with a port number (jax fails on it obscurely)."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdecimal() or not 0 < int(port) < 2**16:
        raise ConfigError(f"--coordinator {address!r}: expected HOST:PORT, process 0's address and a port "
                          "number (1-65535), e.g. 10.0.0.1:1234")


def initialize(args: argparse.Namespace) -> None:
    """Join the other processes (no-op for one process). Call before anything touches devices."""
    if process_count(args) == 1:
        return
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if args.coordinator:
        _waiting(args.num_processes, args.coordinator, args.process_id)
        jax.distributed.initialize(args.coordinator, args.num_processes, args.process_id,
                                   initialization_timeout=JOIN_TIMEOUT)
        return
    if "SLURM_STEP_NODELIST" not in os.environ and "SLURM_JOB_NODELIST" in os.environ:
        os.environ["SLURM_STEP_NODELIST"] = os.environ["SLURM_JOB_NODELIST"]
    env = os.environ
    _waiting(int(env["SLURM_NTASKS"]), f"the first node of {env['SLURM_STEP_NODELIST']} (SLURM job "
             f"{env['SLURM_JOB_ID']})", int(env["SLURM_PROCID"]))
    jax.distributed.initialize(initialization_timeout=JOIN_TIMEOUT)


def _waiting(count: int, coordinator: str, index: int) -> None:
    """Say what initialize blocks on, so that a missing process reads as a wait, not a hang, and
    what ends it: jax aborts the process (a C++ check, no Python exception to catch) when the
    others have not joined within JOIN_TIMEOUT."""
    print(f"waiting for {count} processes at {coordinator} (process {index}; without them jax aborts this one "
          f"after {JOIN_TIMEOUT} s)", file=sys.stderr, flush=True)
