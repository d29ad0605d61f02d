"""The value rules of every config field, checked in one place before anything is built.

`check_values(cfg)` is the one check of single values: each numeric field's range, each
dtype and each named choice, the type of every field (a saved config.json may hold anything),
at most one mesh axis of -1, and the --profile-steps window against the number of steps.
`train.run_config` calls it, the one road from the command line to a RunConfig (train.py,
bench/, tools/), so bad input is refused before jax is imported and before the run directory
is touched. Rules that relate a config to the mesh or to other fields (divisibility, flags that
need an axis) stay with the code that needs them (training/build.py, sharding/, pipeline/).

No jax here: train.py checks its arguments before it imports jax.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import typing
from typing import Callable

from configs.base import ConfigError, RunConfig

Rule = tuple[str, Callable[[float], bool]]  # (what the value must be, as the message says it; test)


def at_least(n: int) -> Rule:
    return f">= {n}", lambda v: v >= n


POSITIVE: Rule = ("> 0", lambda v: v > 0)
AXIS: Rule = (">= 1, or -1 to fill with the remaining devices", lambda v: v >= 1 or v == -1)
FRACTION: Rule = ("in [0, 1]", lambda v: 0 <= v <= 1)
BETA: Rule = ("in [0, 1)", lambda v: 0 <= v < 1)

DTYPES = ("float32", "bfloat16", "float16")  # float8 has no matmul path here; float64 needs jax x64
# The named choices; the modules that consume them hold the same tuples (tests/test_config.py
# checks that they agree): sharding.cores.CORES, model.remat.POLICIES,
# sharding.tensor_parallel.IMPLS, pipeline.tables.SCHEDULES, training/data.py,
# sharding.context_parallel.IMPLS (+ gspmd),
# model.moe.DISPATCH, model.kernels.grouped_matmul.IMPLS.
CHOICES: dict[str, tuple[str, ...]] = {
    "model.attention": ("auto", "xla", "cudnn", "pallas"),
    "model.param_dtype": DTYPES,
    "model.compute_dtype": DTYPES,
    "model.remat": ("none", "full", "dots", "attn"),
    "model.moe_dispatch": ("dropless", "capacity"),
    "model.expert_matmul": ("ragged_dot", "mosaic"),
    "data.source": ("stdlib", "text", "tokens", "synthetic"),
    "data.token_dtype": ("uint16", "uint32"),
    "parallel.tp_impl": ("shard_map", "gspmd"),
    "parallel.schedule": ("gpipe", "interleaved", "1f1b", "interleaved-1f1b", "zb-h1", "zbv"),
    "parallel.context_impl": ("ring", "allgather", "gspmd"),
}

RULES: dict[str, Rule] = {
    "model.vocab_size": at_least(1),
    "model.d_model": at_least(1),
    "model.n_layers": at_least(1),
    "model.n_heads": at_least(1),
    "model.n_kv_heads": at_least(1),
    "model.head_dim": at_least(1),
    "model.d_ff": at_least(1),
    "model.rope_theta": POSITIVE,
    "model.norm_eps": POSITIVE,  # 0 divides by zero on an all-zero row
    "model.init_std": POSITIVE,
    "model.n_experts": at_least(0),
    "model.experts_per_token": at_least(1),
    "model.moe_every": at_least(1),
    "model.n_shared_experts": at_least(0),
    "model.expert_d_ff": at_least(0),
    "model.capacity_factor": POSITIVE,
    "model.router_aux_loss": at_least(0),
    "model.router_z_loss": at_least(0),
    "train.steps": at_least(1),
    "train.seq_len": at_least(1),
    "train.global_batch_size": at_least(1),
    "train.micro_batch_size": at_least(0),
    "train.lr": POSITIVE,  # no opt-in for lr <= 0: AdamW steps along -lr * update, so it would ascend
    "train.min_lr_ratio": FRACTION,
    "train.warmup_steps": at_least(0),
    "train.weight_decay": at_least(0),
    "train.b1": BETA,
    "train.b2": BETA,
    "train.eps": POSITIVE,
    "train.grad_clip": at_least(0),
    "train.z_loss": at_least(0),
    "train.seed": at_least(0),
    "train.log_every": at_least(1),
    "train.checkpoint_every": at_least(0),
    "train.keep_checkpoints": at_least(1),
    "train.max_bad_steps": at_least(1),
    "train.eval_every": at_least(0),
    "train.eval_batches": at_least(1),
    "data.seed": at_least(0),  # numpy's generators refuse negative seeds
    "parallel.stage": AXIS,
    "parallel.data": AXIS,
    "parallel.fsdp": AXIS,
    "parallel.expert": AXIS,
    "parallel.sequence": AXIS,
    "parallel.tensor": AXIS,
    "parallel.microbatches": at_least(0),
    "parallel.virtual_stages": at_least(1),
}

# What 0 means where 0 is allowed, said with the rule.
NOTES = {
    "model.n_experts": "0 = a dense model",
    "model.expert_d_ff": "0 = model.d_ff",
    "train.micro_batch_size": "0 = no accumulation",
    "train.grad_clip": "0 disables clipping",
    "train.checkpoint_every": "0 = no checkpoints",
    "train.eval_every": "0 = no evaluation",
    "parallel.microbatches": "0 = the number of stages",
}
# Fields with no value rule: free text, or parsed below (profile_steps), or any bool.
FREE = {"name", "data.path", "train.profile_steps"}
# Keys with a flag of their own: the message names the flag.
FLAGS = {"train.steps": "--steps", "train.profile_steps": "--profile-steps"}
MESH_AXES = ("stage", "data", "fsdp", "expert", "sequence", "tensor")


def parse_window(text: str) -> tuple[int, int] | None:
    """'5:8' -> (5, 8): trace steps 5, 6 and 7. '' -> None."""
    if not text:
        return None
    start, sep, end = text.partition(":")
    try:
        window = int(start), int(end)
    except ValueError:
        window = None
    if not sep or window is None or not 0 <= window[0] < window[1]:
        raise ConfigError(f"--profile-steps {text!r}: expected START:END with 0 <= START < END, e.g. 5:8")
    return window


def flag(key: str, value: object) -> str:
    """How the user sets `key` to `value`: '--steps -1', or '--set train.lr=-1.0'."""
    return f"{FLAGS[key]} {value}" if key in FLAGS else f"--set {key}={value}"


@functools.cache
def _hints(cls: type) -> dict[str, type]:
    """cls's field types, resolved once: the annotations are strings (`from __future__ import
    annotations`), and resolving them on every check made `tools.plan --search`, which checks
    thousands of candidate configs, spend most of its time in typing.get_type_hints."""
    return typing.get_type_hints(cls)


def _fields(cfg: RunConfig):
    """(dotted key, value, annotated type) of every leaf field."""
    for section in dataclasses.fields(cfg):
        value = getattr(cfg, section.name)
        if not dataclasses.is_dataclass(value):
            yield section.name, value, _hints(RunConfig)[section.name]
            continue
        hints = _hints(type(value))
        for f in dataclasses.fields(value):
            yield f"{section.name}.{f.name}", getattr(value, f.name), hints[f.name]


def _type_ok(value: object, kind: type) -> bool:
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, kind)


def check_values(cfg: RunConfig) -> None:
    """Every field's value on its own, as a ConfigError naming the flag and the fix."""
    for key, value, kind in _fields(cfg):
        if not _type_ok(value, kind):
            raise ConfigError(f"{flag(key, value)}: expected a finite {kind.__name__}, got {value!r}")
        if key in CHOICES and value not in CHOICES[key]:
            raise ConfigError(f"{flag(key, value)}: choose one of {', '.join(CHOICES[key])}")
        if key in RULES and not RULES[key][1](value):
            note = f" ({NOTES[key]})" if key in NOTES else ""
            raise ConfigError(f"{flag(key, value)}: must be {RULES[key][0]}{note}")
    fills = [a for a in MESH_AXES if getattr(cfg.parallel, a) == -1]
    if len(fills) > 1:
        raise ConfigError(
            f"parallel.{' and parallel.'.join(fills)} are all -1: only one mesh axis may fill the "
            "remaining devices; give the others a size (--mesh or --set parallel.<axis>=N)"
        )
    check_profile_window(cfg.train.profile_steps, cfg.train.steps)


def check_profile_window(text: str, steps: int) -> None:
    """The --profile-steps window must lie inside the run's steps 0..steps-1: a window that
    starts later traces nothing, and one that ends later would never stop its trace."""
    window = parse_window(text)
    if window and window[1] > steps:
        raise ConfigError(
            f"--profile-steps {text} does not fit in --steps {steps} (steps 0..{steps - 1} run): "
            f"choose START:END with END <= {steps}, e.g. --profile-steps {max(0, steps - 2)}:{steps}"
        )
