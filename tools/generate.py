"""Text from a trained run: restore its latest checkpoint and decode with a KV cache.

  python -m tools.generate --run-dir RUN --prompt "def fib(n):" [--max-new-tokens N]
      [--temperature T] [--top-p P] [--seed S] [--mesh dp=2,tp=2]

The prompt is UTF-8 bytes (the byte-level vocabulary of data.source stdlib | text | synthetic);
the output is decoded with errors='replace'. A run on data.source=tokens has no tokenizer and is
refused. Prompt + new tokens must fit the positions the model was trained on (train.seq_len):
rotary extrapolates further, the model's quality does not. Default --max-new-tokens fills them.

Mesh: the run's data, fsdp and tensor axes (or --mesh with dp, fsdp, tp only); the run's stage,
sequence and expert axes are left out (the checkpoint restores onto any mesh). A MoE run's
experts all sit on every device and route dropless, whatever model.moe_dispatch it trained with.
Each of the dp·fsdp batch rows decodes the prompt with its own random stream. The cache
layout, its bytes and the collectives of a step are model/decode.py's.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys

from cli import holds_checkpoint, request_fake_devices, run_cli, run_dir_path, saved_config
from configs import ConfigError, RunConfig
from configs.base import BYTE_SOURCES
from configs.parser import Parser
from sharding.mesh import AXES, check_backend, format_mesh, parse_mesh

KEPT_AXES = ("data", "fsdp", "tensor")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = Parser(__doc__)
    p.add_argument("--run-dir", type=run_dir_path, required=True, help="a training run directory with checkpoints")
    p.add_argument("--prompt", required=True, help="text to continue (UTF-8 bytes)")
    p.add_argument("--max-new-tokens", type=int, help="tokens to generate (default: up to train.seq_len)")
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy (default 0.8)")
    p.add_argument("--top-p", type=float, default=0.95, help="nucleus: sample from the smallest set of "
                   "tokens holding this much probability, in (0, 1] (default 0.95)")
    p.add_argument("--seed", type=int, default=0, help="random seed of the sampling (default 0)")
    p.add_argument("--mesh", default="", help="dp, fsdp, tp sizes (default: the run's)")
    return p.parse_args(argv)


def checked(args: argparse.Namespace) -> tuple[RunConfig, bytes, int]:
    """The run's config on the decode mesh, the prompt's bytes and the new-token count; every
    refusal a ConfigError, before jax is imported."""
    if not 0 <= args.temperature < float("inf"):  # nan too
        raise ConfigError(f"--temperature {args.temperature}: must be finite and >= 0 (0 is greedy)")
    if not 0 < args.top_p <= 1:
        raise ConfigError(f"--top-p {args.top_p}: must be in (0, 1] (1 samples from every token)")
    cfg = saved_config(args.run_dir)
    if cfg is None or not holds_checkpoint(args.run_dir):
        raise ConfigError(f"--run-dir {args.run_dir}: no config.json and checkpoints/<step> there; "
                          f"train first (python train.py --run-dir {args.run_dir})")
    m, limit = cfg.model, cfg.train.seq_len
    if cfg.data.source not in BYTE_SOURCES or m.vocab_size < 256:
        raise ConfigError(f"--run-dir {args.run_dir}: trained on data.source={cfg.data.source} with vocab "
                          f"{m.vocab_size}, not bytes: there is no tokenizer for a text --prompt")
    prompt = args.prompt.encode(errors="surrogateescape")  # the bytes given, valid UTF-8 or not
    new = limit - len(prompt) if args.max_new_tokens is None else args.max_new_tokens
    if not prompt or len(prompt) >= limit:
        raise ConfigError(f"--prompt is {len(prompt)} bytes: give 1 to {limit - 1} (the model was trained on "
                          f"train.seq_len={limit} positions)")
    if new < 1 or len(prompt) + new > limit:
        raise ConfigError(f"--max-new-tokens {new}: the prompt's {len(prompt)} bytes + the new tokens must fit "
                          f"the model's train.seq_len={limit} positions; give 1 to {limit - len(prompt)}")
    parallel = parse_mesh(args.mesh, cfg.parallel) if args.mesh else cfg.parallel
    dropped = [a for a in AXES if a not in KEPT_AXES and getattr(parallel, a) != 1]
    if args.mesh and dropped:
        raise ConfigError(f"--mesh {args.mesh}: decoding uses dp, fsdp and tp only")
    parallel = dataclasses.replace(parallel, **{a: 1 for a in dropped}, sequence_parallel=False, tp_overlap=False,
                                   tp_impl="gspmd")
    return dataclasses.replace(cfg, parallel=parallel), prompt, new


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    cfg, prompt, new = checked(args)
    request_fake_devices(cfg)

    import jax  # noqa: E402 -- after XLA_FLAGS is final
    import numpy as np

    from model.decode import Decoder, cache_bytes
    from sharding.mesh import build_mesh, mesh_config
    from training.build import make_program
    from training.checkpoint import Checkpointer

    check_backend()
    n = math.prod(getattr(cfg.parallel, a) for a in AXES)  # negative when one axis is -1 (fill)
    mesh = build_mesh(cfg.parallel, jax.devices()[:n] if n > 0 else None)
    parallel = mesh_config(mesh, cfg.parallel)  # the training batch means nothing here: one row per dp·fsdp rank
    train = dataclasses.replace(cfg.train, global_batch_size=parallel.data * parallel.fsdp, micro_batch_size=0)
    cfg = dataclasses.replace(cfg, parallel=parallel, train=train)
    checkpointer = Checkpointer(args.run_dir / "checkpoints", cfg, read_only=True)
    state = checkpointer.restore_latest(make_program(cfg, mesh))
    checkpointer.close()
    if state is None:
        raise ConfigError(f"--run-dir {args.run_dir}: no checkpoint could be restored")
    m, rows = cfg.model, cfg.parallel.data * cfg.parallel.fsdp
    decoder = Decoder(m, mesh, rows, len(prompt), new, args.temperature, args.top_p)
    compile_s = decoder.compile(state.params)
    out = decoder.generate(state.params, np.tile(np.frombuffer(prompt, np.uint8), (rows, 1)), args.seed)

    length, dtype = len(prompt) + new, np.dtype(m.compute_dtype)
    held = sum(c.nbytes for c in out.cache.values())
    per_device = sum(c.addressable_shards[0].data.nbytes for c in out.cache.values())
    formula = cache_bytes(m, rows, length)
    assert held == formula, f"the cache holds {held} bytes, the formula says {formula}"
    print(f"mesh {format_mesh(dict(mesh.shape))} (tensor impl gspmd, xla core) | {rows} row(s) x {length} positions")
    print(f"KV cache {held:,} bytes = 2·X·K·H·L·B·bytes = 2·{m.n_layers}·{m.n_kv_heads}·{m.head_dim}·{length}·"
          f"{rows}·{dtype.itemsize} ({dtype.name}); {per_device:,} per device")
    steps = rows * (new - 1)
    rate = f"{steps / out.decode_s:,.0f} tok/s" if new > 1 else "no decode step"
    print(f"compile {compile_s:.1f} s | prefill {len(prompt)} tokens {out.prefill_s * 1e3:.1f} ms | "
          f"decode {new - 1} steps x {rows} row(s): {rate}")
    for row, tokens in enumerate(out.tokens):
        tokens = np.where(tokens < 256, tokens, 0xFF).astype(np.uint8)  # ids past the bytes: invalid UTF-8
        text = (prompt + tokens.tobytes()).decode("utf-8", errors="replace")
        print(f"--- sample {row} ---\n{text}")
        if args.temperature == 0:
            break  # greedy: every row is the same
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    run_cli(main)
