"""`make gpu-check`'s printed table (bench/gpu.py): a few lines per stage from its result, the
full figures being in the JSON record."""

from __future__ import annotations

from bench.gpu_mesh import label
from bench.moe_ffn import ffn_lines


def summary_lines(name: str, r: dict) -> list[str]:
    """The short printed table of one stage."""
    if "error" in r or "skipped" in r:
        return [f"    error: {r['error']}" if "error" in r else f"    skipped: {r['skipped']}"]
    if name == "environment":
        return [f"    {r['device_count']} x {r['device_kind']} ({r['backend']}), jax {r['versions']['jax']}, "
                f"cuda {r['cuda_versions']}"]
    if name == "ceilings":
        frac = r["matmul_fraction_of_peak"]
        return [f"    matmul {r['matmul_tflops']:.4g} TFLOP/s" + (f" ({100 * frac:.0f}% of peak)" if frac else "")
                + f", copy {r['copy_gbps']:.4g} GB/s"]
    if name == "correctness":
        lines = [f"    {c['core']:<14}{c['dtype']:<9}L={c['length']:<6}" + (
            f"{c['status']:<5} max err {max(c['errors'].values()):.2e} (tol {c['tolerance']:g})"
            if "errors" in c else c["status"] + (f" {c['error']}" if "error" in c else "")) for c in r["cases"]]
        lines += [f"    step {s['core']:<14}" + (f"loss {s['loss']:.4f} {s['status']}" if "loss" in s else s["status"])
                  for s in r["train_step"]]
        return lines + [f"    verdict: {r['verdict']}"]
    if name == "attention":
        return [f"    {x['core']:<14}L={x['length']:<6}" + (
            f"fwd {x['forward_tflops']:8.4g}  fwd+bwd {x['forward_backward_tflops']:8.4g} TFLOP/s"
            if "forward_tflops" in x else x.get("status") or x.get("error", "")) for x in r["rows"]]
    if name == "training":
        return [f"    {x['preset']:<5}remat={x['remat']:<5}" + "".join(
            f"{o.split('=')[0].split('.')[-1]}={o.split('=')[1]} " for o in x["overrides"] if o.startswith("model.")) + (
            f"{x['tokens_per_s']:>12,.0f} tok/s {x['tflops_per_device']:8.4g} TFLOP/s/dev"
            + (f" MFU {100 * x['mfu']:.1f}%" if x["mfu"] else "")
            + (f" peak {x['peak_memory_bytes_per_device'] / 2**30:.1f} GiB"
               if x["peak_memory_bytes_per_device"] else "")
            if x["status"] == "ok" else f"{x['status']}: {x['error']}") for x in r["rows"]]
    if name == "moe":
        c = r["check"]
        check = (f"    mosaic vs ragged_dot ({c['padding_rows']} of {c['rows']} rows padding): "
                 f"{'pass' if c['ok'] else 'FAIL'}, max relative error {max(c['relative_error'].values()):.2e} "
                 f"(tol {c['tolerance']:g})" if "ok" in c else f"    mosaic: not run: {c['unavailable']}")
        return [check, *ffn_lines(r["ffn"])]
    if name == "mesh":
        link = r["interconnect"]
        lines = ([f"    interconnect: {link['error']}"] if "error" in link else
                 [f"    {x['op']:<15}n={x['group']:<3}peak busbw {x['peak_busbw_GBps']:8.4g} GB/s, floor "
                  f"{x['latency_floor_us']:.1f} us" for x in link["summary"]] + [f"    record: {link['record']}"])
        return lines + [f"    {label(x):<19}" + (
            f"{x['tokens_per_s']:>12,.0f} tok/s MFU {100 * (x['mfu'] or 0):.1f}%  census/contract "
            + ", ".join(f"{a} {v['ratio']:.3f}" for a, v in x["bytes_per_axis"].items() if v["ratio"] is not None)
            if x["status"] == "ok" else f"{x['status']}: {x['error']}") for x in r["strategies"]]
    if name == "flags":
        return [f"    {x['preset']:<5}remat={x['remat']:<5}{x['option']}: " + (
            f"off / on {x['ratio_off_to_on']:.3f} ({x['off']['step_time_median_s'] * 1e3:.1f} ms vs "
            f"{x['on']['step_time_median_s'] * 1e3:.1f} ms)" if "ratio_off_to_on" in x
            else f"on {x['on']['status']}, off {x['off']['status']}") for x in r["rows"]]
    if name == "profile":
        return [line for c in r["cases"] for line in (
            [f"    {c['preset']} remat={c['remat']}{'' if c['scan_layers'] else ' unrolled'}: {c['ops']['total_ms']:.1f} ms"]
            + [f"      {k:<18}{100 * v:5.1f}%" for k, v in sorted(c["ops"]["fractions"].items(), key=lambda kv: -kv[1])])]
    return []
