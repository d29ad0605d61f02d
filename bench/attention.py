"""Benchmark the attention cores alone: TFLOP/s of the forward and of forward + backward.

  python -m bench.attention                 # GPU: pallas, pallas-mosaic, cudnn, xla; L 1k-16k; H 64, 128
  python -m bench.attention --lengths 128,256 --head-dims 64 --heads 2 --tokens 256 --steps 2
                                            # CPU: pallas interpreted; proves the script only

Shapes: q [B, L, N, H], k/v [B, L, K, H], B = max(1, --tokens // L) so that every length holds
about the same number of tokens. FLOPs are counted as in the FlashAttention papers, from the
two matmuls of each head: forward 4·B·N·L²·H, halved for the causal mask; backward 2.5 x the
forward, so forward + backward is 3.5 x. The forward is `core(q, k, v)`, forward + backward the
gradient of `sum(core(q, k, v))` for q, k and v; each is compiled, run once, then timed over
--steps calls (median, each waited for with `jax.block_until_ready`).

`pallas-mosaic` is the pallas core with its three kernels in Mosaic GPU instead of Triton
(flash_attention.mosaic_tiling: model/kernels/flash_mosaic.py, flash_mosaic_backward.py): beside
`pallas`, it says which lowering the kernels should take (bench.tune_attention weighs them one
kernel at a time).

References (`--cores`, not run by default): jax's own Pallas GPU attention kernels,
jax.experimental.pallas.ops.gpu: `jax-triton` (`attention.mha`, Triton lowering; no GQA, so K
and V are repeated to N heads first) and `jax-mgpu` (`attention_mgpu.attention`, FlashAttention-3
in Mosaic GPU, Hopper only; q scaled by 1/sqrt(H) first, as it applies no scale; its backward
has no causal mask yet). They say what each lowering reaches at the same shapes as ours.

A core that cannot run (cudnn off an NVIDIA GPU, xla's [B, N, L, L] scores out of memory) gets
its error in its row and the run goes on. On CPU pallas runs in interpret mode: a loop of HLO
slices, orders of magnitude slower than a compiled kernel; such a run proves the script works
and its figures mean nothing.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from bench.common import error_text
from cli import run_cli
from sharding.mesh import check_backend
from configs import ConfigError
from configs.parser import Parser
from tools.measure import RESULTS, check_at_least, check_out, environment, file_path, int_list, median_seconds, run_record, write_report

CORES = ("pallas", "pallas-mosaic", "cudnn", "xla")
REFERENCES = ("jax-triton", "jax-mgpu")
PASSES = ("forward", "forward_backward")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = Parser(__doc__)
    p.add_argument("--cores", default=",".join(CORES), help=f"comma-separated, of {','.join(CORES + REFERENCES)}")
    p.add_argument("--lengths", type=int_list, default=[1024, 4096, 8192, 16384], help="L values")
    p.add_argument("--head-dims", type=int_list, default=[64, 128], help="H values")
    p.add_argument("--heads", type=int, default=16, help="N query heads (default 16)")
    p.add_argument("--kv-heads", type=int, default=0, help="K kv heads (default: N, no grouping)")
    p.add_argument("--tokens", type=int, default=16384,
                   help="tokens per call: B = max(1, T // L) sequences of each length (default 16384)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--masks", default="causal,full", help="comma-separated, of causal,full (default both)")
    p.add_argument("--steps", type=int, default=10, help="timed calls per measurement (default 10)")
    p.add_argument("--out", type=file_path, help="JSON report (default bench/results/attention-<device>.json)")
    args = p.parse_args(argv)
    args.cores = [c for c in args.cores.split(",") if c]
    args.masks = [m for m in args.masks.split(",") if m]
    for flag, given, known in (("--cores", args.cores, CORES + REFERENCES), ("--masks", args.masks, ("causal", "full"))):
        if not given or set(given) - set(known):
            raise ConfigError(f"{flag} {','.join(given)!r}: choose from {','.join(known)}")
    check_at_least(args, 1, "--lengths", "--head-dims", "--heads", "--tokens", "--steps")
    check_at_least(args, 0, "--kv-heads")
    if args.kv_heads:
        check_groups(args.heads, args.kv_heads)
    check_out(args.out)
    return args


def check_groups(heads: int, kv_heads: int) -> None:
    """--heads a multiple of --kv-heads: each kv head serves a group of query heads (GQA)."""
    if heads % kv_heads:
        raise ConfigError(f"--heads {heads} is not a multiple of --kv-heads {kv_heads} (each kv head serves a group "
                          "of query heads): change one of them")


def core_fn(name: str, causal: bool):
    """core(q, k, v) -> out for one of CORES or REFERENCES and one mask."""
    import jax
    import jax.numpy as jnp

    from model.attention import xla_attention
    from model.kernels.flash_attention import flash_attention, mosaic_tiling

    if name == "pallas":
        return lambda q, k, v: flash_attention(q, k, v, causal=causal)
    if name == "pallas-mosaic":
        return lambda q, k, v: flash_attention(q, k, v, causal=causal, tiling=mosaic_tiling(q.shape[-1]))
    if name in ("cudnn", *REFERENCES) and jax.default_backend() != "gpu":
        raise ConfigError(f"{name} needs an NVIDIA GPU (this backend is {jax.default_backend()})")
    if name == "cudnn":
        return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn")
    if name == "jax-triton":
        from jax.experimental.pallas.ops.gpu import attention as triton_attention

        def mha(q, k, v):
            groups = q.shape[2] // k.shape[2]
            k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
            return triton_attention.mha(q, k, v, None, sm_scale=q.shape[-1] ** -0.5, causal=causal)

        return mha
    if name == "jax-mgpu":
        from jax.experimental.pallas.ops.gpu import attention_mgpu

        config = attention_mgpu.TuningConfig(block_q=128, block_kv=128, max_concurrent_steps=2, causal=causal,
                                             block_q_dkv=64, block_kv_dkv=64, block_q_dq=64, block_kv_dq=64)
        return lambda q, k, v: attention_mgpu.attention((q * q.shape[-1] ** -0.5).astype(q.dtype), k, v, config)
    return lambda q, k, v: xla_attention(q, k, v, causal)


def measure(core: str, make_fn, causal: bool, length: int, head_dim: int, args: argparse.Namespace,
            passes: tuple[str, ...] = PASSES) -> dict:
    """One row: shapes, the time and TFLOP/s of each of `passes` (forward, forward_backward) of
    the core make_fn() returns (or the error, make_fn's too)."""
    import jax
    import jax.numpy as jnp

    batch, kv_heads = max(1, args.tokens // length), args.kv_heads or args.heads
    row = {"core": core, "causal": causal, "length": length, "head_dim": head_dim, "batch": batch,
           "heads": args.heads, "kv_heads": kv_heads, "dtype": args.dtype}
    forward_flops = 4 * batch * args.heads * length**2 * head_dim / (2 if causal else 1)
    keys = jax.random.split(jax.random.key(0), 3)
    shapes = [(batch, length, n, head_dim) for n in (args.heads, kv_heads, kv_heads)]
    q, k, v = (jax.random.normal(key, s, jnp.float32).astype(args.dtype) for key, s in zip(keys, shapes))
    try:
        fn = make_fn()
        grad = jax.grad(lambda q, k, v: fn(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2))
        for name, program, flops in (("forward", fn, forward_flops), ("forward_backward", grad, 3.5 * forward_flops)):
            if name not in passes:
                continue
            seconds = median_seconds(jax.jit(program), (q, k, v), args.steps)
            row |= {f"{name}_ms": seconds * 1e3, f"{name}_tflops": flops / seconds / 1e12}
    except Exception as err:  # noqa: BLE001 -- a core that cannot run here is a result, not a crash
        row["error"] = error_text(err)
    return row


def print_rows(rows: list[dict]) -> None:
    print(f"  {'core':<14}{'mask':<7}{'L':>6}{'H':>5}{'B':>5}  {'fwd ms':>10}{'TFLOP/s':>9}  {'fwd+bwd ms':>11}{'TFLOP/s':>9}")
    for r in rows:
        head = f"  {r['core']:<14}{'causal' if r['causal'] else 'full':<7}{r['length']:>6}{r['head_dim']:>5}{r['batch']:>5}  "
        if "error" in r:
            print(head + r["error"])
        else:
            print(head + f"{r['forward_ms']:>10.3f}{r['forward_tflops']:>9.3g}  "
                         f"{r['forward_backward_ms']:>11.3f}{r['forward_backward_tflops']:>9.3g}")


def default_out(backend: str, device_kind: str) -> Path:
    name = "cpu-interpret-smoke" if backend == "cpu" else device_kind.lower().replace(" ", "-")
    return RESULTS / f"attention-{name}.json"


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    import jax

    check_backend()

    rows = [measure(core, lambda: core_fn(core, mask == "causal"), mask == "causal", length, h, args)
            for length in args.lengths for h in args.head_dims for mask in args.masks for core in args.cores]
    print_rows(rows)
    env = environment(jax.devices()[:1])  # one device: no sharding here
    report = run_record("bench.attention", argv) | {
        "environment": env,
        "flops": "forward 4*B*N*L^2*H (halved if causal); forward+backward 3.5x forward",
        "interpret_mode": env["backend"] != "gpu" and any(c.startswith("pallas") for c in args.cores),
        "rows": rows,
    }
    if report["interpret_mode"]:
        report["note"] = "pallas ran in interpret mode (no GPU): a smoke run of the script, not a performance figure"
        print(f"\nnote: {report['note']}")
    write_report(report, args.out or default_out(env["backend"], env["device_kind"]))
    return 0


if __name__ == "__main__":
    run_cli(main)
