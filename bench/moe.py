"""Mixture of experts: step time over the expert axis, dropless vs capacity, grouped matmul vs a loop.

  python -m bench.moe                                  moe-tiny, ep 1 2 4 8 on 8 devices, both dispatches, 3 rounds
  python -m bench.moe --mid                            a mid-size MoE (MID below: D 256, 8 experts of F 384)
  python -m bench.moe --ep 1,2 --dispatch capacity --steps 5 --set model.capacity_factor=1.0
  python -m bench.moe --devices 1 --ep 1               one device (a single GPU): dispatches and the FFN only

Step cases: for each ep of --ep, the mesh ep=N,dp=D/N of the same D = --devices devices (on a
CPU host, fake devices requested before jax starts) and the same global batch, so every case
does the same work and only how it is split differs; for each dispatch of --dispatch
(`model.moe_dispatch`, model/moe.py): dropless (a dense [ep, n·min(k, E/ep), D] buffer, the
receiver sorts its rows and runs `jax.lax.ragged_dot`) or capacity (C = ceil(cf·n·k/E) slots
per expert, one batched einsum). Every case is built and compiled, run once, then all of them
are timed round-robin in one run (each of --steps rounds runs one step of each case, so a noisy
machine slows all alike); a row gives the median step time and its ratio to the first case
(the first ep, first dispatch: ep=1 dropless by default), XLA's memory per device of the
compiled step (`training.build.xla_memory`), the all-to-alls of the compiled HLO over `expert`
(tools/hlo.py: how many run per step, per MoE layer, forward and backward, and their bytes) and
the all-to-all bytes per device per step that `tools.traffic.expert` gives for the same case.

All-to-alls per MoE layer (sharding/expert_parallel.py): dispatch and combine forward, their
transposes backward: 4; dropless adds its int32 expert ids forward (ids have no gradient): 5.
XLA:CPU computes bf16 in fp32, so with a bf16 compute dtype the compiled CPU program's buffers
(and the census's bytes) are twice the estimate's; in fp32 the two agree (tests/test_bench.py).

FFN micro-benchmark (one device, no mesh; bench/moe_ffn.py): the experts alone on the rows one
device receives at ep=1 (--ffn-tokens tokens), forward and backward, grouped (ragged_dot),
mosaic (jax's Hopper kernels, model.expert_matmul=mosaic; on other devices the row says why it
cannot run), a dense loop and the capacity layout's batched einsum, timed round-robin over
--ffn-rounds rounds, ratios to grouped, with XLA's temporaries of each.

Bad input (a model without experts, an ep that does not divide the devices or model.n_experts, an
unknown dispatch, ...)
is one `error:` line before jax starts (sharding/checks.py). Writes
bench/results/moe-<config>[-mid].json. Fake CPU devices share the host's cores: the step times
compare the cases' work on this machine, not a GPU's all-to-all over NVLink; read the ratios.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
from typing import TYPE_CHECKING

from bench.common import attempt, failures, report_head
from bench.moe_ffn import ffn_bench, ffn_lines
from cli import add_run_args, request_fake_devices, run_cli, run_config
from configs import ConfigError, RunConfig, apply_overrides, get_preset
from configs.checks import CHOICES
from configs.parser import Parser
from model.kernels.grouped_matmul import TILE
from sharding.mesh import AXES, format_mesh, parse_mesh
from tools.traffic import expert as expert_bytes
from tools.measure import RESULTS, check_at_least, check_out, file_path, timed, write_report

if TYPE_CHECKING:
    import jax

# a mid-size MoE on moe-tiny's base: twice the width and the expert F (still small enough for a CPU)
MID = ["model.d_model=256", "model.n_heads=8", "model.n_kv_heads=4", "model.head_dim=32", "model.expert_d_ff=384"]


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = Parser(__doc__)
    add_run_args(p)
    p.add_argument("--ep", default="1,2,4,8", help="expert axis sizes (default 1,2,4,8); each divides --devices")
    p.add_argument("--devices", type=int, default=8, help="devices of every case: mesh ep=N,dp=devices/N (default 8)")
    p.add_argument("--dispatch", default="dropless,capacity",
                   help="model.moe_dispatch values, ratios to the first case (default dropless,capacity)")
    p.add_argument("--mid", action="store_true", help=f"the mid-size MoE: --set {' --set '.join(MID)} (before --set)")
    p.add_argument("--steps", type=int, default=3, help="timed rounds after the first step (default 3)")
    p.add_argument("--ffn-tokens", type=int, metavar="N",
                   help="tokens of the FFN micro-benchmark (default: one device's at ep=1, batch·L/devices); 0 skips it")
    p.add_argument("--ffn-rounds", type=int, default=10, help="timed rounds of the FFN micro-benchmark (default 10)")
    p.add_argument("--out", type=file_path, help="JSON report (default bench/results/moe-<config>[-mid].json)")
    return p.parse_args(argv)


def cases(args: argparse.Namespace) -> dict[tuple[int, str], RunConfig]:
    """{(ep, dispatch): checked config}, in the order of --ep then --dispatch. Refuses bad flags
    before jax."""
    if args.mesh:
        raise ConfigError(f"--mesh {args.mesh}: bench.moe builds its meshes ep=N,dp=devices/N itself; "
                          "choose N with --ep and the devices with --devices")
    check_at_least(args, 1, "--steps", "--ffn-rounds", "--devices")
    check_at_least(args, 0, "--ffn-tokens")
    check_out(args.out)
    try:
        sizes = list(dict.fromkeys(int(x) for x in args.ep.split(",") if x.strip()))
    except ValueError:
        raise ConfigError(f"--ep {args.ep!r}: expected integers, e.g. 1,2,4,8") from None
    if not sizes or min(sizes) < 1:
        raise ConfigError(f"--ep {args.ep!r}: sizes must be 1 or more, e.g. 1,2,4,8")
    for ep in sizes:
        if args.devices % ep:
            raise ConfigError(f"--ep {ep} does not divide the {args.devices} devices of every case "
                              f"(mesh ep={ep},dp={args.devices}/{ep}): choose ep among the divisors of --devices")
    dispatches = list(dict.fromkeys(x.strip() for x in args.dispatch.split(",") if x.strip()))
    if not dispatches or set(dispatches) - set(CHOICES["model.moe_dispatch"]):
        raise ConfigError(f"--dispatch {args.dispatch!r}: name one or both of {', '.join(CHOICES['model.moe_dispatch'])}")
    preset = get_preset(args.config or "moe-tiny")
    sets = MID if args.mid else []
    if not apply_overrides(preset, [*args.set, *sets]).model.n_experts:
        raise ConfigError(f"--config {args.config or 'moe-tiny'}: a model without experts (model.n_experts=0), and bench.moe "
                          "measures MoE layers; use --config moe-tiny (the default) or --set model.n_experts=8")
    # run_config checks every case (sharding/checks.py: ep divides n_experts, the batch splits over dp·ep)
    return {(ep, d): _case(args, preset, [*sets, f"model.moe_dispatch={d}"], ep) for ep in sizes for d in dispatches}


def _case(args: argparse.Namespace, preset: RunConfig, sets: list[str], ep: int) -> RunConfig:
    """One checked case on the mesh ep=N,dp=devices/N: a refusal names the bench's flags that made it."""
    mesh = f"ep={ep},dp={args.devices // ep}"
    try:
        return run_config(args, extra_sets=sets, base=dataclasses.replace(preset, parallel=parse_mesh(mesh, preset.parallel)))
    except ConfigError as e:
        raise ConfigError(f"--ep {ep} --devices {args.devices} (mesh {mesh}): {e}") from None


def all_to_alls(compiled, mesh: jax.sharding.Mesh, moe_layers: int) -> dict:
    """The all-to-alls of a compiled step (tools/hlo.py): per step, per MoE layer, forward and
    backward (backward: jax's `transpose(` in the op's name), bytes per device per step."""
    from tools.hlo import census

    found = [c for c in census(compiled.as_text(), dict(mesh.shape)) if c.kind == "all-to-all"]
    backward = sum(c.trips for c in found if "transpose(" in c.op_name)
    count = sum(c.trips for c in found)
    return {"per_step": count, "per_moe_layer": count / moe_layers,
            "forward_per_moe_layer": (count - backward) / moe_layers, "backward_per_moe_layer": backward / moe_layers,
            "axes": sorted({"+".join(c.axes) for c in found}),
            "dtypes": sorted({c.dtype for c in found}),
            "bytes_per_device": sum(c.bytes_per_step for c in found)}


def measure(todo: dict[tuple[int, str], RunConfig], meshes: dict[int, jax.sharding.Mesh], steps: int) -> dict:
    """Build, compile and run once every case, then time `steps` rounds round-robin over all of them."""
    import jax

    from training.build import build, compile_step, xla_memory

    def prepare(cfg: RunConfig, mesh: jax.sharding.Mesh) -> dict:
        job = build(cfg, mesh)  # outside jax.set_mesh (training.build.make_program)
        with jax.set_mesh(mesh):
            batch = jax.block_until_ready(job.batches(0))
            compiled, _, compile_s = compile_step(job.step_fn, mesh, job.state, batch)
            state, _ = jax.block_until_ready(compiled(job.state, batch))  # donates job.state
        moe_layers = cfg.model.n_layers // cfg.model.moe_every
        return {"compiled": compiled, "state": state, "batch": batch, "times": [], "compile_s": compile_s,
                "all_to_all": all_to_alls(compiled, mesh, moe_layers), "memory": xla_memory(compiled)}

    runs = {}
    for (ep, d), cfg in todo.items():
        runs[ep, d] = attempt(prepare, cfg, meshes[ep])  # a case that fails is its row's error
        if "error" not in runs[ep, d]:
            print(f"ep={ep} {d}: compiled in {runs[ep, d]['compile_s']:.1f} s", flush=True)
    for _ in range(steps):
        for (ep, _d), run in ((key, run) for key, run in runs.items() if "error" not in run):
            with jax.set_mesh(meshes[ep]):
                (run["state"], metrics), seconds = timed(run["compiled"], run["state"], run["batch"])
            run["times"].append(seconds)
            run["loss"] = float(metrics["loss"])
    return runs


def rows(todo: dict[tuple[int, str], RunConfig], runs: dict) -> list[dict]:
    """One row per case: its figures and their ratio to the first case that ran (or its error)."""
    ran = [r for r in runs.values() if "error" not in r]
    base = statistics.median(ran[0]["times"]) if ran else None
    out = []
    for (ep, d), cfg in todo.items():
        r = runs[ep, d]
        if "error" in r:
            out.append({"ep": ep, "dp": cfg.parallel.data, "dispatch": d, "error": r["error"]})
            continue
        median = statistics.median(r["times"])
        sizes = {a: getattr(cfg.parallel, a) for a in AXES}
        out.append({
            "ep": ep, "dp": cfg.parallel.data, "dispatch": d,
            "step_time_median_s": median, "step_times_s": r["times"], "step_ratio": median / base,
            "compile_s": r["compile_s"], "loss_after_rounds": r["loss"],
            "temp_bytes": r["memory"]["temp"], "static_peak_bytes": r["memory"]["static_peak"],
            "all_to_all": r["all_to_all"], "all_to_all_bytes_estimate": expert_bytes(cfg, sizes),
            "memory_analysis": r["memory"],
        })
    return out


def per_layer_text(a: dict) -> str:
    """A case's all-to-alls per MoE layer, '5 (3+2)' (forward + backward), or '-' where it has none."""
    return f"{a['per_moe_layer']:g} ({a['forward_per_moe_layer']:g}+{a['backward_per_moe_layer']:g})" if a["per_step"] else "-"


def print_table(table: list[dict], first: str) -> None:
    mib = 2**20
    print(f"  {'ep':>3} {'dp':>3}  {'dispatch':<9} {'step (median)':>14} {'vs ' + first:>18} {'temp MiB':>9} "
          f"{'peak MiB':>9}  {'a2a/layer (fwd+bwd)':>19} {'a2a MiB':>8} {'estimate':>9}")
    for r in table:
        if "error" in r:
            print(f"  {r['ep']:>3} {r['dp']:>3}  {r['dispatch']:<9} {r['error']}")
            continue
        a = r["all_to_all"]
        print(f"  {r['ep']:>3} {r['dp']:>3}  {r['dispatch']:<9} {r['step_time_median_s'] * 1e3:>11.1f} ms "
              f"{r['step_ratio']:>17.2f}x {r['temp_bytes'] / mib:>9.1f} {r['static_peak_bytes'] / mib:>9.1f}  "
              f"{per_layer_text(a):>19} {a['bytes_per_device'] / mib:>8.2f} {r['all_to_all_bytes_estimate'] / mib:>9.2f}")


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    todo = cases(args)
    first_cfg = next(iter(todo.values()))
    fake = request_fake_devices(first_cfg)  # every case has --devices devices

    import jax  # noqa: E402 -- after XLA_FLAGS is final

    from sharding.mesh import build_mesh, check_backend

    check_backend()
    # every mesh first: more devices than exist is refused before anything runs
    meshes = {ep: build_mesh(cfg.parallel, jax.devices()[:args.devices]) for (ep, _), cfg in todo.items()}
    if fake and jax.default_backend() == "cpu":
        print(f"CPU platform: meshes {', '.join(format_mesh(dict(m.shape)) for m in meshes.values())} "
              f"on {fake} fake host devices")
    table = rows(todo, measure(todo, meshes, args.steps))
    first = next((f"ep={r['ep']} {r['dispatch']}" for r in table if "error" not in r), "-")
    print_table(table, first)
    tokens = args.ffn_tokens
    if tokens is None:
        tokens = first_cfg.train.global_batch_size * first_cfg.train.seq_len // args.devices
    ffn = ffn_bench(first_cfg, tokens, args.ffn_rounds, (TILE,)) if tokens else None
    if ffn:
        print(f"FFN alone, {ffn['rows']} rows ({tokens} tokens x k) of {ffn['experts']} experts, "
              f"forward + backward on {ffn['device']}:")
        print("\n".join(ffn_lines(ffn)))
    eps = list(dict.fromkeys(ep for ep, _ in todo))
    mesh_text = ";".join(format_mesh(dict(meshes[ep].shape)) for ep in eps)
    head = report_head("bench.moe", argv, first_cfg, meshes[eps[-1]], mesh_text)
    report = head | {"devices": args.devices, "steps": args.steps, "mid": args.mid, "baseline": first,
                     "rows": table, "ffn": ffn}
    name = first_cfg.name.removeprefix("moe-") + ("-mid" if args.mid else "")
    out = args.out or RESULTS / f"moe-{name}.json"
    write_report(report, out)
    return failures(table, out)


if __name__ == "__main__":
    run_cli(main)
