"""Compile the flash attention kernels for an H100 (or H200) on a machine with no GPU, and report
what ptxas says of each: registers, spilled bytes, wgmmas serialized for want of registers.

  pip install -e '.[gpu-compile]'    # jax's CUDA plugin, ptxas and libdevice (1.3 GB); no driver
  python -m tools.gpu_compile                               # H100; H 64, 128; default + Mosaic tiles
  python -m tools.gpu_compile --sweep --head-dims 128       # bench.tune_attention's grid of tiles
  python -m tools.gpu_compile --gpu h200 --out F.json

How: on a compile-only device of the GPU (tools/gpu_target.py: XLA's deviceless compilation
through jax's CUDA plugin) the kernels go through XLA's whole GPU pipeline: Triton and Mosaic
GPU lower them and ptxas assembles them for sm_90a. With
`--xla_gpu_ptx_compiler_extra_flags=-v` (Triton kernels) and MOSAIC_GPU_DUMP_PTXAS=1 (Mosaic
GPU) ptxas logs each kernel's resource use, which this tool reads from the process's own
stdout/stderr (fds 1 and 2, where the C++ logs go) around each compile. The kernels see the
target through `sharding.cores.building_for`, and Pallas's Triton lowering through an abstract
mesh of the target's device kind. Nothing runs: no time, no numerics (those need the GPU,
bench.tune_attention); a tile that spills or serializes its wgmmas is slow there for a reason
this report names. The persistent compilation cache is off here (`tools.gpu_target.devices`
turns it off), so no kernel skips ptxas.

Candidates, per head dim: the Triton tiles (`triton_tiling`) and each kernel of `mosaic_tiling`
and of the default (`default_tiling` for --gpu and --dtype: on Hopper in 16 bits at H = 64 and
128 the Mosaic GPU forward and dq beside the Triton dk/dv), each such kernel beside the
Triton tiles of the other two;
`--sweep` adds every Triton tile of --blocks x --warps x --stages (all three kernels at once)
and each kernel's Mosaic GPU tiles (block_q 64, block_k from --mosaic-blocks, dk/dv 64 only, x
--stages), a Mosaic kernel compiled beside the Triton other two so the log names it alone.
A tile that does not compile (Triton out of shared memory) records its error. Shapes: B 1, L
--length, N --heads, K --kv-heads, causal, --dtype; the gradient (forward, dq, dk/dv).

Why by hand: no library reports ptxas's resource use of jax's kernels; the log lines are
ptxas's own format (`Used N registers`, `N bytes spill stores`, warning C7510-C7515).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import os
import re
import sys
import tempfile
from collections.abc import Iterator

from cli import run_cli
from configs import ConfigError
from configs.parser import Parser
from tools.gpu_target import GPUS, check_plugin, compiler_versions, devices
from tools.measure import RESULTS, check_out, file_path, int_list, run_record, write_report

KERNELS = ("forward", "dq", "dkv")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = Parser(__doc__)
    p.add_argument("--gpu", default="h100", choices=sorted(GPUS), help="the GPU compiled for (default h100)")
    p.add_argument("--head-dims", type=int_list, default=[64, 128], help="H values (default 64,128)")
    p.add_argument("--length", type=int, default=4096, help="L (default 4096)")
    p.add_argument("--heads", type=int, default=32, help="N query heads (default 32)")
    p.add_argument("--kv-heads", type=int, default=8, help="K kv heads (default 8)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--sweep", action="store_true", help="every tile of the grid below, not only the defaults")
    p.add_argument("--blocks", type=int_list, default=[32, 64, 128], help="--sweep: block_q and block_k values")
    p.add_argument("--warps", type=int_list, default=[4, 8], help="--sweep: Triton num_warps values")
    p.add_argument("--stages", type=int_list, default=[2, 3], help="--sweep: Triton num_stages, Mosaic pipeline depth")
    p.add_argument("--mosaic-blocks", type=int_list, default=[64, 128], help="--sweep: Mosaic GPU block_k values")
    p.add_argument("--out", type=file_path, help="JSON record (default bench/results/gpu-compile-<gpu>.json)")
    args = p.parse_args(argv)
    for flag in ("head_dims", "blocks", "warps", "stages", "mosaic_blocks"):
        if not getattr(args, flag) or min(getattr(args, flag)) < 1:
            raise ConfigError(f"--{flag.replace('_', '-')} needs positive integers, e.g. 64,128")
    for flag, value in (("--length", args.length), ("--heads", args.heads), ("--kv-heads", args.kv_heads)):
        if value < 1:
            raise ConfigError(f"{flag} must be at least 1 (got {value})")
    if args.heads % args.kv_heads:
        raise ConfigError(f"--heads {args.heads} must be a multiple of --kv-heads {args.kv_heads}")
    check_out(args.out)
    return args


# XLA assembles the Triton kernels' PTX with the ptxas binary, whose verbose log this tool reads,
# unless it can load libnvJitLink, which then compiles in-process and logs nothing (a venv where
# torch's CUDA wheels bring libnvJitLink in: CI's newest pass, with the hf extra). So ptxas it is.
PTXAS = {"xla_gpu_libnvjitlink_mode": "LIB_NV_JIT_LINK_MODE_DISABLED"}


def ptxas_logs() -> None:
    """Before jax is imported: ptxas's verbose log from XLA (Triton kernels) and Mosaic GPU, and
    C++ info logs on with the verbose level of XLA's two ptxas callers (the ptxas binary, the
    library) raised, since XLA logs a clean ptxas run only at that level."""
    os.environ["XLA_FLAGS"] = f"{os.environ['XLA_FLAGS']} --xla_gpu_ptx_compiler_extra_flags=-v"
    callers = "subprocess_compilation=2,ptx_compiler_helpers=2"
    vmodule = ",".join(filter(None, (os.environ.get("TF_CPP_VMODULE"), callers)))
    os.environ.update(MOSAIC_GPU_DUMP_PTXAS="1", TF_CPP_MIN_LOG_LEVEL="0", TF_CPP_VMODULE=vmodule)


@contextlib.contextmanager
def captured_output() -> Iterator[list[str]]:
    """Fds 1 and 2 (C++ logs included) into a file for the block; its text lands in the list."""
    text: list[str] = []
    sys.stdout.flush(), sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as log:
        os.dup2(log.fileno(), 1), os.dup2(log.fileno(), 2)
        try:
            yield text
        finally:
            sys.stdout.flush(), sys.stderr.flush()
            os.dup2(saved[0], 1), os.dup2(saved[1], 2)
            os.close(saved[0]), os.close(saved[1])
            log.seek(0)
            text.append(log.read().decode(errors="replace"))


def ptxas_report(log: str) -> dict[str, dict]:
    """{function: registers, spill_stores, spill_loads (bytes per thread), wgmma_serialized (ptxas's
    reason, e.g. 'insufficient register resources', or False)} from ptxas -v's log."""
    report: dict[str, dict] = {}
    for m in re.finditer(r"Compiling entry function '(\w+)'.*?Used (\d+) registers", log, re.S):
        report.setdefault(m[1], {"registers": int(m[2]), "spill_stores": 0, "spill_loads": 0,
                                 "wgmma_serialized": False})
    for m in re.finditer(r"spilled to local memory in function '(\w+)', (\d+) bytes spill stores, "
                         r"(\d+) bytes spill loads", log):
        if m[1] in report:
            report[m[1]].update(spill_stores=int(m[2]), spill_loads=int(m[3]))
    for m in re.finditer(r"wgmma\.mma_async instructions are serialized due to ([^\n]*?) (?:for|in) the "
                         r"(?:wgmma pipeline in the )?function '(\w+)'", log):
        if m[2] in report:
            report[m[2]]["wgmma_serialized"] = m[1]
    return report


def candidates(head_dim: int, args: argparse.Namespace) -> list[tuple[str, object]]:
    """[(kernel the candidate is for, or 'all'; Tiling)]: `triton_tiling` first, then each kernel
    of `mosaic_tiling` and of the default (`default_for`) beside the Triton other two, then
    --sweep's; no tiling twice. A program holds at most one Mosaic GPU kernel: ptxas names each
    of them anonymous_mosaic_gpu_kernel, so two in one log could not be told apart (the Hopper
    default has two: its rows are read from these candidates')."""
    from model.kernels.flash_attention import Tile, Tiling, mosaic_tiling, triton_tiling

    triton, mosaic, default = triton_tiling(head_dim), mosaic_tiling(head_dim), default_for(head_dim, args)
    found = [("all", triton)] + [(k, dataclasses.replace(triton, **{k: getattr(tiling, k)}))
                                 for tiling in (mosaic, default) for k in KERNELS]
    if args.sweep:
        found += [("all", Tiling.uniform(bq, bk, w, s))
                  for bq, bk, w, s in itertools.product(args.blocks, args.blocks, args.warps, args.stages)]
        for kernel, bk, s in itertools.product(KERNELS, args.mosaic_blocks, args.stages):
            if kernel != "dkv" or bk == 64:
                found.append((kernel, dataclasses.replace(triton, **{kernel: Tile(64, bk, stages=s, lowering="mosaic")})))
    unique: dict = {}
    for kernel, tiling in found:
        unique.setdefault(tiling, kernel)
    return [(kernel, tiling) for tiling, kernel in unique.items()]


def default_for(head_dim: int, args: argparse.Namespace):
    """`default_tiling` as --gpu in --dtype gets it."""
    from model.kernels.flash_attention import default_tiling
    from sharding.cores import building_for

    with building_for("gpu", GPUS[args.gpu].capability):
        return default_tiling(head_dim, args.dtype)


def own_rows(rows: list[dict], head_dim: int, tiling) -> list[dict]:
    """Each kernel's row of `tiling` among the compiled rows (every kernel's tile was compiled in
    some candidate: `candidates`)."""
    return [next(r for r in rows if tile_key(r) == (head_dim, k, tile_text(dataclasses.asdict(getattr(tiling, k)))))
            for k in KERNELS]


def compile_log(tiling, head_dim: int, args: argparse.Namespace, device, abstract) -> tuple[str, str | None]:
    """ptxas's log of compiling the gradient of flash attention under `tiling` for `device`, and
    the compile's error line (None when it compiled)."""
    import jax
    import jax.numpy as jnp

    from model.kernels.flash_attention import flash_attention
    from sharding.cores import building_for

    gpu = GPUS[args.gpu]
    placed = jax.sharding.SingleDeviceSharding(device)
    q = jax.ShapeDtypeStruct((1, args.length, args.heads, head_dim), jnp.dtype(args.dtype), sharding=placed)
    kv = jax.ShapeDtypeStruct((1, args.length, args.kv_heads, head_dim), jnp.dtype(args.dtype), sharding=placed)

    def loss(q, k, v):
        return flash_attention(q, k, v, causal=True, tiling=tiling).astype(jnp.float32).sum()

    error = None
    with captured_output() as log:
        try:
            with building_for("gpu", gpu.capability), jax.sharding.use_abstract_mesh(abstract):
                jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, kv, kv).compile(compiler_options=PTXAS)
        except (ConfigError, jax.errors.JaxRuntimeError, ValueError) as e:
            error = str(e).strip().splitlines()[0][:300]
    return log[0], error


def rows_for(kernel: str, tiling, log: str, error: str | None, head_dim: int) -> list[dict]:
    """One row per kernel the candidate is for: its tile and what ptxas said of it."""
    from model.kernels import flash_kernels

    names = {getattr(flash_kernels, f"{k}_kernel").__name__: k for k in KERNELS}
    report = ptxas_report(log)
    rows = []
    for k in KERNELS if kernel == "all" else (kernel,):
        tile = getattr(tiling, k)
        name = "anonymous_mosaic_gpu_kernel" if tile.lowering == "mosaic" else next(n for n, v in names.items() if v == k)
        found = report.get(name)
        row = {"head_dim": head_dim, "kernel": k, **dataclasses.asdict(tile)}
        if tile.lowering == "mosaic":
            row.pop("warps")
        if found:
            row.update(found, clean=not (found["spill_stores"] or found["wgmma_serialized"]))
        else:
            row.update(compile_error=f"the program did not compile: {error}" if error else "ptxas reported nothing for it",
                       clean=False)
        rows.append(row)
    return rows


def tile_key(row: dict) -> tuple:
    """A kernel's tile, once per head dim (the sweep meets the default tiles again)."""
    return row["head_dim"], row["kernel"], tile_text(row)


def tile_text(tile: dict) -> str:
    """A row's or Tile's (as a dict) tile: 'triton 128x64 w8 s3', 'mosaic 64x64 s2' (a Mosaic
    kernel is one warpgroup: its warps are not part of it)."""
    warps = f" w{tile['warps']}" if tile["lowering"] == "triton" else ""
    return f"{tile['lowering']} {tile['block_q']}x{tile['block_k']}{warps} s{tile['stages']}"


def print_rows(rows: list[dict]) -> None:
    print(f"{'H':>4} {'kernel':<8} {'tile':<22} {'regs':>5} {'spill st/ld':>12}  wgmma")
    for r in rows:
        if "registers" in r:
            spill = f"{r['spill_stores']}/{r['spill_loads']}"
            wgmma = f"serialized: {r['wgmma_serialized']}" if r["wgmma_serialized"] else "ok"
            print(f"{r['head_dim']:>4} {r['kernel']:<8} {tile_text(r):<22} {r['registers']:>5} {spill:>12}  {wgmma}")
        else:
            print(f"{r['head_dim']:>4} {r['kernel']:<8} {tile_text(r):<22} error: {r['compile_error']}")


def preference(row: dict) -> tuple:
    """Sort key of the clean tiles, first = suggested: the largest score tile; then the larger
    block a program owns (q rows for forward and dq, keys for dk/dv), whose swept tiles it reuses;
    then fewer warps and stages. A rule of thumb for tiles ptxas accepts cleanly, not a timing."""
    owned = row["block_k"] if row["kernel"] == "dkv" else row["block_q"]
    return -row["block_q"] * row["block_k"], -owned, row.get("warps", 4), row["stages"]


def summary(rows: list[dict], defaults: list[dict], mosaic: list[dict]) -> dict:
    """Per H and kernel: the default tile (`default_tiling`) and `mosaic_tiling`'s, with their
    verdicts, and the clean tiles, suggested first."""
    out: dict = {}
    for r, m in zip(defaults, mosaic):
        clean = sorted((x for x in rows if x["head_dim"] == r["head_dim"] and x["kernel"] == r["kernel"] and x["clean"]),
                       key=preference)
        out[f"h{r['head_dim']}-{r['kernel']}"] = {"default": tile_text(r), "default_clean": r["clean"],
                                                 "mosaic": tile_text(m), "mosaic_clean": m["clean"],
                                                 "tiles": sum(x["head_dim"] == r["head_dim"] and x["kernel"] == r["kernel"]
                                                              for x in rows),
                                                 "clean_tiles": [tile_text(x) for x in clean]}
    return out


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    gpu = GPUS[args.gpu]
    check_plugin("tools.gpu_compile")
    ptxas_logs()
    with captured_output():
        device = devices(gpu, 1)[0]
    import jax

    from tools.measure import environment

    abstract = jax.sharding.AbstractMesh((1,), ("x",), axis_types=(jax.sharding.AxisType.Auto,),
                                         abstract_device=jax.sharding.AbstractDevice(
                                             device_kind=gpu.kind, num_cores=gpu.sms, platform="gpu"))
    from model.kernels.flash_attention import mosaic_tiling

    rows, defaults, mosaic = [], [], []
    for head_dim in args.head_dims:
        todo = candidates(head_dim, args)
        for i, (kernel, tiling) in enumerate(todo):
            print(f"H {head_dim}: compiling {i + 1}/{len(todo)}", file=sys.stderr, flush=True)
            found = rows_for(kernel, tiling, *compile_log(tiling, head_dim, args, device, abstract), head_dim)
            rows += [r for r in found if tile_key(r) not in {tile_key(x) for x in rows}]
        defaults += own_rows(rows, head_dim, default_for(head_dim, args))
        mosaic += own_rows(rows, head_dim, mosaic_tiling(head_dim))
    print_rows(rows)
    report = {**run_record("tools.gpu_compile", argv), "gpu": dataclasses.asdict(gpu),
              "environment": {**environment(jax.devices()), "compiled_for": gpu.kind,
                              "compilers": compiler_versions()},
              "shape": {"length": args.length, "heads": args.heads, "kv_heads": args.kv_heads, "dtype": args.dtype,
                        "causal": True}, "rows": rows, "summary": summary(rows, defaults, mosaic)}
    for key, s in report["summary"].items():
        print(f"{key}: default {s['default']} {'clean' if s['default_clean'] else 'NOT clean'}; "
              f"{len(s['clean_tiles'])} clean tiles, suggested first: {', '.join(s['clean_tiles'][:3]) or 'none'}")
    write_report(report, args.out or RESULTS / f"gpu-compile-{args.gpu}.json")
    return 0


if __name__ == "__main__":
    run_cli(main)
