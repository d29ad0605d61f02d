"""The plan's report: the analytic model of a run on a mesh (tools/estimate.py, traffic.py,
roofline.py) beside XLA's figures of the compiled step when there are any, the link each
axis is timed on, and the verdict; as a dict (`plan`, which tools.plan prints as JSON) and as
the table `format_plan` prints. Pure arithmetic and text: the compile is tools/plan_compile.py's.
"""

from __future__ import annotations

import math

from configs import RunConfig
from sharding.mesh import format_mesh
from tools import estimate, roofline, traffic
from tools.bandwidth import Measured
from tools.links import Links, datasheet_link
from tools.oom import remedy
from tools.shape import GiB, core as device_core

LHS_OFF_FLAG = "XLA_FLAGS=--xla_gpu_enable_latency_hiding_scheduler=false"


def links_of(cfg: RunConfig, measured: Measured | None) -> Links | None:
    """The measured {axis: (latency_s, bytes_per_s)} for roofline.step_time, or None (datasheet)."""
    if measured is None:
        return None
    return {a: (link.latency_s, link.bytes_per_s) for a, link in measured.links(cfg.parallel.context_impl).items()}


def link_sources(cfg: RunConfig, sizes: dict[str, int], axes: list[str], measured: Measured | None) -> dict[str, str]:
    """{axis: 'measured FILE (...)' or 'datasheet NVLink 450 GB/s'} for each of `axes`."""
    found = measured.links(cfg.parallel.context_impl) if measured else {}
    return {a: measured.label(found[a]) if a in found else datasheet_link(sizes, a) for a in axes}


def plan(cfg: RunConfig, sizes: dict[str, int], gpu: roofline.GPU, xla: dict | None,
         measured: Measured | None = None) -> dict:
    """The whole report: the analytic model, XLA's figures (or None), the link of each axis
    (measured when `measured` covers it, else the datasheet) and the verdict."""
    mem = estimate.memory(cfg, sizes)
    time = roofline.step_time(cfg, sizes, gpu, links_of(cfg, measured))
    core = device_core(cfg, sizes)
    terms = {k: v for k, v in mem.items() if k != "peak"}
    unlike = [] if xla is None else not_judged(cfg, sizes, xla)
    judged = xla is not None and not unlike
    fits = mem["peak"] <= gpu.memory and (not judged or xla["memory"]["peak"] <= gpu.memory)
    costs = {"compute": time["compute_s"], **{f"{a} communication": s for a, s in time["comm_s"].items()}}
    xla_text = "" if xla is None else f", {xla['memory']['peak'] / GiB:.1f} GiB XLA" + (
        "" if judged else f" ({' and '.join(unlike)}: not judged)")
    verdict = (f"{'fits' if fits else 'does NOT fit'} on {gpu.name} ({mem['peak'] / GiB:.1f} GiB estimated"
               f"{xla_text}, of {gpu.memory / GiB:.1f} GiB); memory dominated by {max(terms, key=terms.get)}; "
               f"step time dominated by {max(costs, key=costs.get)}")
    if judged and "lhs_off" in xla:
        verdict += f"; {scheduler_note(xla, mem['peak'])}"
    if not fits:  # the estimate's remedy; or XLA's compile alone is over (the estimate fits)
        verdict += (f"; {remedy(cfg, sizes, gpu)}" if mem["peak"] > gpu.memory else
                    f"; {LHS_OFF_FLAG} fits, without the scheduler's overlap"
                    if xla.get("lhs_off", {}).get("peak", math.inf) <= gpu.memory else
                    "; XLA's compile needs more than the estimate: lower --set train.micro_batch_size")
    if core == "xla" and time["memory_s"] > time["matmul_s"]:
        fix = ("--set model.compute_dtype=bfloat16: in float32 model.attention=auto takes xla"
               if cfg.model.attention == "auto" else "--set model.attention=auto (cudnn; pallas under sp > 1)")
        verdict += ("; the xla core writes its [N, L, L] scores to HBM, so memory-bound kernels outweigh the "
                    f"matmuls: {fix}")
    return {"config": cfg.name, "mesh": format_mesh(sizes), "devices": math.prod(sizes.values()),
            "gpu": gpu.name, "attention": core, "memory": mem, "communication": traffic.communication(cfg, sizes),
            "all_to_all": traffic.expert(cfg, sizes), "census_note": census_note(cfg, xla),
            "links": link_sources(cfg, sizes, list(time["comm_s"]), measured), "rates": gpu.rates,
            "above_best_mfu": above_best_mfu(time["mfu_overlap"], gpu), "flops": roofline.flops(cfg, sizes),
            "time": time, "xla": xla, "fits": fits, "verdict": verdict}


def not_judged(cfg: RunConfig, sizes: dict[str, int], xla: dict) -> list[str]:
    """Why XLA's memory is not this run's GPU memory (none: it is). It is when compiled for a GPU,
    or like with like in fp32 on CPU (XLA CPU keeps a bf16 program's matmuls in fp32 buffers: up
    to twice a GPU's), and only when it compiled the attention core the GPU runs."""
    core = device_core(cfg, sizes)
    return ([f"{xla['platform']}'s fp32 buffers of a bf16 program"] * (xla["platform"] != "gpu" and
                                                                     cfg.model.compute_dtype != "float32")
            + [f"its {xla['attention']} core where the GPU takes {core}"] * (xla["attention"] != core))


def scheduler_note(xla: dict, estimated: float) -> str:
    """What XLA's peak is without its latency-hiding scheduler (`lhs_off`, tools/plan_compile.py), and
    so how much of it the scheduler holds: gathers and recomputed forwards it starts early to
    overlap collectives, their results held, up to its memory limit (XLA GPU: 95% of 80% of the
    GPU's memory, less the step's inputs and outputs). A tighter limit does not bring it down
    to the peak without it (README, Plan a run: 1.01-1.24x that peak with the limit just above
    it, compiled for H100s)."""
    off, peak = xla["lhs_off"]["peak"], xla["memory"]["peak"]
    if off > 0.95 * peak:
        return (f"XLA's peak without its latency-hiding scheduler is {off / GiB:.1f} GiB too "
                f"({off / estimated:.2f}x the estimate): not the scheduler's")
    return (f"XLA's latency-hiding scheduler holds {(peak - off) / GiB:.1f} GiB to overlap collectives; "
            f"without it ({LHS_OFF_FLAG}) XLA's peak is {off / GiB:.1f} GiB ({off / estimated:.2f}x the estimate)")


def census_note(cfg: RunConfig, xla: dict | None) -> str:
    """Why a CPU census of a 16-bit program shows up to twice the contract (tools/traffic.py
    counts what XLA GPU moves)."""
    if xla is None or xla["platform"] != "cpu" or cfg.model.compute_dtype == "float32":
        return ""
    return (f"XLA CPU computes {cfg.model.compute_dtype} matmuls in fp32 and moves their fp32 results: the census "
            "of the activations (tensor, sequence, stage) and of gradients reduced per microbatch is up to twice "
            "the contract, which counts what XLA GPU moves")


def above_best_mfu(mfu: float, gpu: roofline.GPU) -> str:
    """Why a plan's MFU may pass the best published for its GPU, or '' when it does not."""
    if mfu <= gpu.best_mfu:
        return ""
    return (f"MFU {100 * mfu:.0f}% overlapped is above the best published on {gpu.name} ({100 * gpu.best_mfu:.0f}%): "
            "the roofline counts matmuls, attention and memory-bound kernels at their best rates, communication "
            "fully hidden, and no kernel launches or host gaps; read it as a bound")


def format_plan(report: dict) -> str:
    xla, mem, t = report["xla"], report["memory"], report["time"]
    lines = [f"plan: {report['config']} on {report['mesh']} ({report['devices']} x {report['gpu']}; "
             f"attention {report['attention']})"]
    if xla and xla["platform"] == "gpu":
        lines.append(f"  (XLA: compiled by XLA GPU for {report['devices']} x {xla['device_kind']})")
    lines.append(f"\n  {'memory per device':<28}{'estimate':>12}{'XLA':>12}")
    xmem = xla["memory"] if xla else {}
    for name, value in mem.items():
        lines.append(f"  {name:<28}{value / GiB:>10.2f} G{'':>12}" if name != "peak" else
                     f"  {'peak':<28}{value / GiB:>10.2f} G{xmem.get('peak', 0) / GiB:>10.2f} G")
    for k in ("argument", "output", "alias", "temp"):
        if k in xmem:
            lines.append(f"  {'  XLA ' + k:<28}{'':>12}{xmem[k] / GiB:>10.2f} G")
    if xla and "lhs_off" in xla:
        lines.append(f"  {'  XLA peak, LHS off':<28}{'':>12}{xla['lhs_off']['peak'] / GiB:>10.2f} G")
    lines.append(f"\n  {'communication per step':<28}{'contract':>12}{'XLA census':>12}")
    census = {}
    for r in (xla or {}).get("census", []):
        census[r["axes"]] = census.get(r["axes"], 0) + r["bytes_per_device"]
    for axis in sorted(set(report["communication"]) | set(census), key=lambda a: a.split("+")[0]):
        contract = report["communication"].get(axis)
        lines.append(f"  {axis:<28}{'-' if contract is None else f'{contract / GiB:.3f} G':>12}"
                     f"{(f'{census[axis] / GiB:.3f} G' if axis in census else '-'):>12}")
    if report.get("all_to_all"):  # the expert axis's dispatch and combine, of its contract above
        lines.append(f"  {'  of which all-to-all':<28}{report['all_to_all'] / GiB:>10.3f} G")
    if report["census_note"]:
        lines.append(f"  ({report['census_note']})")
    f = report["flops"]
    lines.append(f"\n  {'FLOPs per device per step':<28}{f['model_per_device']:>12.3e}"
                 f"{(xla or {}).get('flops_per_device') or float('nan'):>12.3e}")
    lines.append(f"  {'  (hardware, with remat)':<28}{f['hardware_per_device']:>12.3e}")
    if f.get("padding_per_device"):
        lines.append(f"  {'  (of which expert padding)':<28}{f['padding_per_device']:>12.3e}")
    comm = ", ".join(f"{a} {s * 1e3:.0f} ms" for a, s in t["comm_s"].items()) or "none"
    lines.append("\n  links: " + ("; ".join(f"{a} {src}" for a, src in report["links"].items()) or "none"))
    lines += [f"  rates: {report['rates']}",
              f"  compute {t['compute_s'] * 1e3:.0f} ms (matmuls {t['matmul_s'] * 1e3:.0f}, attention "
              f"{t['attention_s'] * 1e3:.0f}, memory-bound {t['memory_s'] * 1e3:.0f}); communication {comm}; "
              f"bubble {100 * t['bubble']:.0f}%" + (f" ({100 * t['bubble_without_head']:.0f}% without the head's "
                                                     "cells: pipeline/schedule.py, Head)" if t["bubble"] else ""),
              f"  step time {t['no_overlap_s']:.2f} s not overlapped, {t['overlap_s']:.2f} s overlapped; "
              f"MFU {100 * t['mfu_no_overlap']:.1f}% / {100 * t['mfu_overlap']:.1f}%"]
    if report["above_best_mfu"]:
        lines.append(f"  {report['above_best_mfu']}")
    lines.append(f"\nverdict: {report['verdict']}")
    return "\n".join(lines)
