"""The table of each benchmark's record, as README shows it (bench/tables.py puts them in README).

One function per benchmark, record -> Markdown table (or, for bench.step, one figure sentence
per record); every number comes from the record, rounded as each function's docstring states.
Hand-written because no library renders these records: each benchmark writes its own JSON shape.
"""

from __future__ import annotations

import shlex

from bench.moe import per_layer_text
from bench.tp import VARIANTS, tensor_collectives
from tools.shape import DTYPE_BYTES
from tools.calibration import scanned
from tools.gpu_compile import tile_text

MIB = 2**20
SHORT = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def row(*cells: object) -> str:
    return "| " + " | ".join(map(str, cells)) + " |"


def header(*names: str) -> str:
    return row(*names) + "\n|" + "---|" * len(names)


def joined(values: list, spec: str) -> str:
    """'a / b / c', each value formatted by `spec`."""
    return " / ".join(format(v, spec) for v in values)


def column(rows: list[dict], key: str, spec: str, unit: float = 1) -> str:
    """'a / b / c' of the rows' `key`, in `unit`s, each formatted by `spec`."""
    return joined([r[key] / unit for r in rows], spec)


def span(values: list[float], spec: str) -> str:
    """'lo-hi' of `values`, each formatted by `spec`; one figure where they print alike."""
    lo, hi = f"{min(values):{spec}}", f"{max(values):{spec}}"
    return lo if lo == hi else f"{lo}-{hi}"


def xla(memory: dict, name: str) -> int:
    """XLA's `name` bytes (argument, temp) from a record's memory analysis; records written before
    training.build.xla_memory shortened the names hold `<name>_size_in_bytes`."""
    return memory[name] if name in memory else memory[f"{name}_size_in_bytes"]


def mib(n: float) -> str:
    """The step table's MiB: one decimal under 10 MiB, whole above."""
    return f"{n / MIB:.1f} MiB" if n < 10 * MIB else f"{n / MIB:.0f} MiB"


def bench_command(record: dict) -> str:
    """The record's command without its `--out FILE` (the marker names the file)."""
    words = shlex.split(record["command"])
    if "--out" in words:
        i = words.index("--out")
        del words[i:i + 2]
    return shlex.join(words)


def step_figure(record: dict, records: list[dict]) -> str:
    """One bench.step record as README's sentence: compile scaling when it has one, the step and
    throughput on one device, or the memory beside the same config's one-device record.
    Seconds: 2 decimals (compile 1); ms and tok/s whole; ratio 2 decimals; MiB as `mib`."""
    t, env, cfg = record["throughput"], record["environment"], record["config"]
    mem = t["memory_analysis"]
    if "compile_scaling" in record:
        rows = record["compile_scaling"]["rows"]
        first, last = rows[0]["n_layers"], rows[-1]["n_layers"]
        dtype = cfg["model"]["param_dtype"]
        return (f"compile (lower + compile) at {joined([r['n_layers'] for r in rows], 'd')} layers: "
                f"{joined([r['total_s'] for r in rows], '.2f')} s; **{last} layers = "
                f"{record['compile_scaling']['ratio_largest_to_smallest']:.2f}x {first} layers** (scanned layers). "
                f"Step {t['step_time_median_s']:.2f} s, XLA memory per device: arguments {mib(xla(mem, 'argument'))} "
                f"({t['n_params'] / 1e6:.0f}M params x {3 * DTYPE_BYTES[dtype]} bytes: {SHORT[dtype]} params + "
                f"two Adam moments), temp {mib(xla(mem, 'temp'))}")
    if record["mesh"] == "single device":
        return (f"{t['step_time_median_s'] * 1e3:.0f} ms/step median, {t['tokens_per_s']:,.0f} tok/s, "
                f"compile {t['compile_s']:.1f} s, temp {mib(xla(mem, 'temp'))} per device")
    single = next(r for r in records if r["mesh"] == "single device" and r["config"]["name"] == cfg["name"])
    one_mem, tp = single["throughput"]["memory_analysis"], cfg["parallel"]["tensor"]
    devices = (f"{env['mesh_devices']} fake devices sharing the {env['cpu_count']} cores" if env["backend"] == "cpu"
               else f"{env['mesh_devices']} {env['device_kind']} devices")
    return (f"{t['step_time_median_s'] * 1e3:.0f} ms/step on {devices}; arguments per device "
            f"{mib(xla(mem, 'argument'))} vs {mib(xla(one_mem, 'argument'))} on one device (tp={tp}: 1/{tp} of the "
            f"weights and moments per device) and temp {mib(xla(mem, 'temp'))} vs {mib(xla(one_mem, 'temp'))}")


def step_table(records: list[dict]) -> str:
    """bench.step records, one row each: the command and its figures (`step_figure`)."""
    return "\n".join([header("command", "figure"),
                      *(row(f"`{bench_command(r)}`", step_figure(r, records)) for r in records)])


def pipeline_table(record: dict) -> str:
    """bench.pipeline: per schedule, its M's bubbles (3 decimals), work ratios (2 decimals) and
    temp MiB (1 decimal); then the measured bubble of every case (2 decimals)."""
    by_schedule: dict[str, list[dict]] = {}
    for r in record["schedules"]:
        name = r["schedule"] + (f" V={r['virtual_stages']}" if r["virtual_stages"] > 1 else "")
        by_schedule.setdefault(name, []).append(r)
    lines = [header("schedule", "M", "bubble: table ; lock-step", "work ratio (step / one device)",
                    "the same in CPU time", "temp per device (MiB)")]
    for name, rs in by_schedule.items():
        lines.append(row(name, column(rs, "microbatches", "g"),
                         f"{column(rs, 'bubble', '.3f')} ; {column(rs, 'lockstep_bubble', '.3f')}",
                         column(rs, "work_ratio", ".2f"), column(rs, "cpu_work_ratio", ".2f"),
                         column(rs, "temp_bytes", ".1f", MIB)))
    machine = record["machine"]
    lines += ["", f'The "measured bubble" 1 - (one device / {machine["devices"]}) / step, every case: '
                  f'{span([r["measured_bubble"] for r in record["schedules"]], ".2f")}; the core floor '
                  f'1 - cores/devices: {machine["core_floor"]:.2f}.']
    return "\n".join(lines)


def tp_table(record: dict) -> str:
    """bench.tp: per T, each variant's step time over gspmd's (2 decimals) and MiB over `tensor`
    (1 decimal); then how many fewer bytes the explicit regions move (whole percent)."""
    results = record["results"]
    lines = [header("T", "gspmd", "shard_map", "shard_map + SP", "shard_map + SP + overlap",
                    "MiB over `tensor` per step (gspmd / shard_map / SP / overlap)")]
    fewer = []
    for tp, variants in results.items():
        tensor = [sum(c["bytes_per_device"] for c in tensor_collectives(variants[v])) for v in VARIANTS]
        fewer += [100 * (1 - b / tensor[0]) for b in tensor[1:]]
        lines.append(row(tp, *(f"{variants[v]['ratio_to_gspmd']:.2f}" for v in VARIANTS),
                         joined([b / MIB for b in tensor], ".1f")))
    lines += ["", f"The explicit regions move {span(fewer, '.0f')}% fewer bytes over `tensor` "
                  "than GSPMD's placement."]
    return "\n".join(lines)


def context_table(record: dict) -> str:
    """bench.context: per sp, each way's step time over the baseline way's (2 decimals), temp MiB
    (1 decimal) with its ratio to the smallest sp (2 decimals) and the estimated K/V MiB (1
    decimal; 0 on the single device); then how much faster than the baseline a way is that is faster
    at every sp (whole percent)."""
    base, by_sp = record["baseline_impl"], {}
    for r in record["rows"]:
        by_sp.setdefault(r["sp"], []).append(r)
    ways = [r["impl"] for r in record["rows"] if r["sp"] == max(by_sp)]
    names = " / ".join(ways)
    lines = [header("sp", "L", f"step time, ratio to {base}: {names}",
                    f"temp MiB per device: {names} (ratio to {record['temp_ratio_to']})",
                    f"K/V MiB over `sequence` per step (estimate): {names}")]
    for sp, rs in by_sp.items():
        temp = f"{column(rs, 'temp_bytes', '.1f', MIB)} ({column(rs, 'temp_ratio', '.2f')})"
        if rs[0]["impl"] is None:
            lines.append(row(sp, rs[0]["seq_len"], "single device", temp, 0))
        else:
            lines.append(row(sp, rs[0]["seq_len"], column(rs, "step_ratio", ".2f"), temp,
                             column(rs, "kv_bytes_estimate", ".1f", MIB)))
    for way in ways[1:]:
        ratios = [r["step_ratio"] for r in record["rows"] if r["impl"] == way]
        if max(ratios) < 1:
            faster = span([100 * (1 - x) for x in ratios], ".0f")
            lines += ["", f"At every sp > 1, {way} is {faster}% faster than {base}."]
    return "\n".join(lines)


def moe_table(record: dict) -> str:
    """bench.moe: per (ep, dp), each dispatch's step time over the first case's (2 decimals; the
    first case's seconds, 2 decimals), temp MiB (1 decimal), all-to-alls per MoE layer and their
    MiB per step, compiled and estimated (1 decimal; "-" and 0 where a case has none); how many
    times faster capacity is than dropless at the same ep (1 decimal); then the FFN alone (ms 1
    decimal, ratios 2 decimals; mosaic's where it ran)."""
    by_mesh: dict[tuple[int, int], list[dict]] = {}
    for r in record["rows"]:
        by_mesh.setdefault((r["ep"], r["dp"]), []).append(r)
    dispatches = " / ".join(r["dispatch"] for r in next(iter(by_mesh.values())))
    lines = [header("ep, dp", f"step time, ratio to {record['baseline']}: {dispatches}",
                    f"temp MiB per device: {dispatches}", f"all-to-alls per MoE layer (fwd + bwd): {dispatches}",
                    f"all-to-all MiB per step, compiled (estimate): {dispatches}")]
    first = record["rows"][0]
    for (ep, dp), rs in by_mesh.items():
        ratios = [f"{r['step_ratio']:.2f}" + (f" ({r['step_time_median_s']:.2f} s)" if r is first else "")
                  for r in rs]
        moved = [f"{r['all_to_all']['bytes_per_device'] / MIB:.1f} ({r['all_to_all_bytes_estimate'] / MIB:.1f})"
                 if r["all_to_all"]["per_step"] else "0" for r in rs]
        lines.append(row(f"{ep}, {dp}", " / ".join(ratios), column(rs, "temp_bytes", ".1f", MIB),
                         " / ".join(per_layer_text(r["all_to_all"]) for r in rs), " / ".join(moved)))
    speedup = []
    for rs in by_mesh.values():
        step = {r["dispatch"]: r["step_time_median_s"] for r in rs}
        speedup.append(step["dropless"] / step["capacity"])
    ffn, ways = record["ffn"], record["ffn"]["ways"]
    grouped_ms = ways["grouped"]["time_median_s"] * 1e3
    lines += ["", f"Capacity dispatch is {span(speedup, '.1f')}x as fast as dropless at the same ep.",
              "", f"FFN alone ({ffn['tokens']} tokens x k = {ffn['rows']} rows, {ffn['experts']} experts, "
                  f"{SHORT[ffn['dtype']]}, {ffn['device'].upper()}): grouped {grouped_ms:.1f} ms, dense loop "
                  f"{ways['loop']['ratio_to_grouped']:.2f}x, batched {ways['batched']['ratio_to_grouped']:.2f}x"
                  + (f", mosaic {ways['mosaic']['ratio_to_grouped']:.2f}x" if "ratio_to_grouped" in ways.get("mosaic", {})
                     else "") + "."]
    return "\n".join(lines)


def gpu_table(record: dict) -> str:
    """bench.gpu on a GPU: the ceilings (TFLOP/s 0 decimals, TB/s 2) and the correctness verdict;
    attention TFLOP/s per length and core, forward / forward + backward (0 decimals; a row at
    another head dim than the first row's names it); training
    per case (", unrolled": model.scan_layers=false): tokens/s (0 decimals), TFLOP/s per device
    (0), MFU (% 1 decimal), the measured and
    estimated step (ms 0 decimals) and their ratio (2 decimals); per profiled case, its kernel
    time a step (ms 0 decimals) and the fraction of it by kind (% 0 decimals)."""
    st = record["stages"]
    env, c, check = st["environment"], st["ceilings"], st["correctness"]
    judged = [r for r in check["cases"] + check["train_step"] if r["status"] in ("pass", "fail", "error")]
    lines = [f"{env['device_kind']}, jax {env['versions']['jax']}, cuDNN {env['cuda_versions']['cudnn']}: bf16 "
             f"8192³ GEMM {c['matmul_tflops']:.0f} TFLOP/s ({100 * c['matmul_fraction_of_peak']:.0f}% of peak, "
             f"{c['matmul_kernel']}), copy {c['copy_gbps'] / 1e3:.2f} TB/s; correctness {check['verdict']} "
             f"({len(judged)} checks).", ""]
    rows = st["attention"]["rows"]
    cores = list(dict.fromkeys(r["core"] for r in rows))
    lines.append(header("L", *[f"{core}: fwd / fwd+bwd TFLOP/s" for core in cores]))
    first_h = rows[0]["head_dim"]
    for length, h in dict.fromkeys((r["length"], r["head_dim"]) for r in rows):
        at = {r["core"]: r for r in rows if (r["length"], r["head_dim"]) == (length, h)}
        lines.append(row(length if h == first_h else f"{length}, H = {h}",
                         *[f"{at[k]['forward_tflops']:.0f} / {at[k]['forward_backward_tflops']:.0f}" for k in cores]))
    estimate = {(r["preset"], r["remat"], r.get("scan_layers", True)): r
                for r in record.get("estimate", {}).get("rows", [])}
    lines += ["", header("preset, remat", "tokens/s", "TFLOP/s per device", "MFU", "step measured / estimated",
                         "estimate / measured")]
    for r in st["training"]["rows"]:
        scan = scanned(r)
        case = f"{r['preset']}, {r['remat']}" + ("" if scan else ", unrolled")
        if r["status"] != "ok":
            lines.append(row(case, r["status"], "", "", "", ""))
            continue
        e = estimate.get((r["preset"], r["remat"], scan))
        lines.append(row(case, f"{r['tokens_per_s']:,.0f}", f"{r['tflops_per_device']:.0f}",
                         f"{100 * r['mfu']:.1f}%", f"{1e3 * r['step_time_median_s']:.0f} / "
                         + (f"{1e3 * e['estimate_s']:.0f} ms" if e else "-"), f"{e['ratio']:.2f}" if e else "-"))
    profile = st.get("profile", {})
    cases = [p for p in profile.get("cases", [profile]) if "ops" in p]  # older records: one case, no "cases"
    lines += [""] if cases else []
    for p in cases:
        kinds = sorted(p["ops"]["fractions"].items(), key=lambda kv: -kv[1])
        case = p["preset"] + (f", {p['remat']}" if "remat" in p else "") + ("" if p.get("scan_layers", True) else ", unrolled")
        lines.append(f"Profile ({case}, {p['ops']['steps']} steps: {p['ops']['total_ms']:.0f} ms of kernels a step): "
                     + ", ".join(f"{name} {100 * f:.0f}%" for name, f in kinds) + " of the kernel time.")
    return "\n".join(lines)


def gpu_compile_table(record: dict) -> str:
    """tools.gpu_compile: per head dim and kernel, what ptxas says of the default tile and of
    mosaic_tiling's (registers; bytes spilled a thread; wgmmas serialized), and how many of the
    sweep's tiles are clean; then the GPU and the compilers."""
    found = {(r["head_dim"], r["kernel"], r["lowering"], r["block_q"], r["block_k"], r.get("warps"), r["stages"]): r
             for r in record["rows"]}

    def said(h: int, kernel: str, tile: str) -> str:
        lowering, blocks, *rest = tile.split()
        bq, bk = map(int, blocks.split("x"))
        warps = int(rest[0][1:]) if len(rest) == 2 else None
        r = found[h, kernel, lowering, bq, bk, warps, int(rest[-1][1:])]
        if "registers" not in r:
            return "does not compile"
        text = f"{r['registers']} registers" + (f", spills {r['spill_stores']} B" if r["spill_stores"] else "")
        return text + (", wgmmas serialized" if r["wgmma_serialized"] else "")

    lines = [header("H", "kernel", "default tile", "ptxas", "Mosaic GPU tile", "ptxas", "clean tiles / compiled")]
    for key, s in record["summary"].items():
        h, kernel = int(key.split("-")[0][1:]), key.split("-")[1]
        lines.append(row(h, kernel, s["default"], said(h, kernel, s["default"]), s["mosaic"],
                         said(h, kernel, s["mosaic"]), f"{len(s['clean_tiles'])} / {s['tiles']}"))
    env, shape = record["environment"], record["shape"]
    compilers = ", ".join(f"{name} {v}" for name, v in env["compilers"].items())
    lines += ["", f"Compiled for {env['compiled_for']} on a CPU machine ({compilers}; jax {env['versions']['jax']}): "
                  f"the gradient at L = {shape['length']}, N = {shape['heads']}, K = {shape['kv_heads']}, "
                  f"{SHORT[shape['dtype']]}, causal; `{bench_command(record)}`."]
    return "\n".join(lines)


def step_change_table(pairs: list[tuple[str, dict, dict]]) -> str:
    """bench.step records of one command before and after a change: (commit of `before`, before,
    after) per mesh, one row each. Seconds 2 decimals, ratio 2 decimals."""
    def step(t: dict) -> str:
        return f"{t['step_time_median_s']:.2f} s ({t['step_time_min_s']:.2f}-{t['step_time_max_s']:.2f})"

    lines = [header("mesh", "step before: median (min-max)", "after", "after / before")]
    for commit, before, after in pairs:
        b, a = before["throughput"], after["throughput"]
        lines.append(row(f"`{after['mesh']}`", f"{step(b)} at {commit}", step(a),
                         f"{a['step_time_median_s'] / b['step_time_median_s']:.2f}"))
    return "\n".join(lines)


def tune_table(record: dict) -> str:
    """bench.tune_attention: per kernel, the tile it started from, the fastest tile, and the
    fastest of each lowering, with TFLOP/s (0 decimals; the forward's forward alone, dq's and
    dk/dv's forward + backward); then the start, tuned and reference tilings together, forward
    / forward + backward TFLOP/s and the ratio of forward + backward to cudnn's (2 decimals)."""
    shape, env = record["shape"], record["environment"]
    lines = [f"{env['device_kind']}, jax {env['versions']['jax']}: H = {shape['head_dim']}, L = {shape['length']}, "
             f"N = {shape['heads']}, K = {shape['kv_heads']}, B = {shape['batch']}, "
             f"{'causal' if shape['causal'] else 'full'}, {SHORT[shape['dtype']]}.", "",
             header("kernel", "start tile", "fastest", "fastest triton", "fastest mosaic")]
    for kernel in ("forward", "dq", "dkv"):
        key = "forward_tflops" if kernel == "forward" else "forward_backward_tflops"
        ran = [r for r in record["sweep"] if r["kernel"] == kernel and key in r]
        start = next(r for r in ran if tile_text(r) == tile_text(record["default"][kernel]))

        def best(rows: list[dict]) -> str:
            top = max(rows, key=lambda r: r[key], default=None)
            return f"{tile_text(top)}: {top[key]:.0f}" if top else "-"

        lines.append(row(kernel, f"{tile_text(start)}: {start[key]:.0f}", best(ran),
                         *(best([r for r in ran if r["lowering"] == lowering]) for lowering in ("triton", "mosaic"))))
    lines += ["", header("tiling", "forward / forward + backward TFLOP/s", "fwd+bwd / cudnn")]
    cudnn = next((r for r in record["compare"] if r["core"] == "cudnn" and "error" not in r), None)
    for r in record["compare"]:
        if "error" in r:
            lines.append(row(r["core"], r["error"], "-"))
            continue
        ratio = f"{r['forward_backward_tflops'] / cudnn['forward_backward_tflops']:.2f}" if cudnn else "-"
        lines.append(row(r["core"], f"{r['forward_tflops']:.0f} / {r['forward_backward_tflops']:.0f}", ratio))
    return "\n".join(lines + ["", f"Tuned: `{record['tuned_line']}`."])
