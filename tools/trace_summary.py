"""Where a step's time went, from the `--profile-steps` trace of a run.

  python train.py --steps 3 --profile-steps 1:3 --run-dir runs/p
  python -m tools.trace_summary runs/p            (--json for machines)

Reads the newest RUN_DIR/plugins/profile/*/perfetto_trace.json.gz (Chrome trace JSON, written
beside the .xplane.pb by training/profiling.py) and RUN_DIR/plugins/profile/train_step.hlo.txt
(the compiled step's HLO). On CPU every op event of the train step carries its HLO instruction
name, device and step (run_id). On a GPU the events are kernels on the /device:GPU:N process,
with no step: a kernel belongs to the step whose launch on the host (`... Execute
(jit_train_step)`) last began before the host's launch call of that kernel (cuLaunchKernel,
cuGraphLaunch: the event with the kernel's correlation id; the host runs ahead of the GPU). A kernel
launched inside a command buffer (CUDA graph) names the buffer, not its instruction: a fusion's
kernel is then found by its own name (the instruction's, '.' written '_'), and a library kernel
(cuBLAS, cuDNN, NCCL) is counted under the scope `unattributed`, its kind read from its name
(`kernel_kind`). XLA_FLAGS=--xla_gpu_enable_command_buffer= turns the buffers off, so that
every kernel names its instruction. The HLO gives each instruction's opcode and its op_name
metadata, whose path holds the named scopes of the model and step (embedding, attention, mlp,
head, optimizer; forward and its transpose alike). Per step, averaged over the traced steps and
the devices:

  scope table   op time per scope, split into compute and collectives; 'other' = no scope
                (the loss, gradient accumulation, copies between scan iterations)
  collectives   all-reduce, all-gather, reduce-scatter, all-to-all, collective-permute
  exposed       collective time on a device during which no compute op of that device runs,
                as a fraction of its collective time (0: all hidden, 1: none hidden)

A PNG (summary.png, next to the trace) draws the scope bars and a timeline of one step on
device 0. On fake CPU devices all "devices" share the host's cores and collectives are memory
copies, so read the split, not the absolute times.
"""

from __future__ import annotations

import bisect
import gzip
import json
import re
import zlib
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from configs import ConfigError
from configs.parser import Parser
from tools.hlo import KINDS
from tools.hlo_text import INSTRUCTION, OP_NAME

SCOPES = ("embedding", "attention", "mlp", "head", "optimizer")
_SCOPE = re.compile(r"(?:^|[/(])(" + "|".join(SCOPES) + r")(?=[/)]|$)")


def hlo_ops(hlo_text: str) -> dict[str, tuple[str, str]]:
    """{instruction name: (kind: a collective kind or 'compute', scope or 'other')}."""
    ops = {}
    for line in hlo_text.splitlines():
        m = INSTRUCTION.match(line)
        if m:
            name, _, opcode, rest = m.groups()
            opcode = opcode.removesuffix("-start").removesuffix("-done")
            path = OP_NAME.search(rest)
            scope = _SCOPE.search(path.group(1)) if path else None
            ops[name] = (opcode if opcode in KINDS else "compute", scope.group(1) if scope else "other")
    return ops


def find_trace(run_dir: Path) -> tuple[Path, Path]:
    traces = sorted((run_dir / "plugins" / "profile").glob("*/perfetto_trace.json.gz"))
    hlo = run_dir / "plugins" / "profile" / "train_step.hlo.txt"
    if not traces or not hlo.exists():
        raise ConfigError(f"{run_dir}: no profile found; run train.py with --profile-steps A:B --run-dir {run_dir}")
    return traces[-1], hlo


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def _overlap(a: tuple[float, float], covered: list[tuple[float, float]]) -> float:
    return sum(max(0.0, min(a[1], b) - max(a[0], s)) for s, b in covered)


@dataclass(frozen=True)
class OpEvent:
    """One op (CPU) or kernel (GPU) of the train step: its step, device, HLO instruction (or, for
    an unattributed GPU kernel, the kernel's name) and its span in us."""

    step: object
    device: int
    op: str
    ts: float
    dur: float


# Library kernels by name (lower case): (kind, substrings); NCCL's by the collective in its name.
LIBRARY_KERNELS = (("attention kernel", ("sdpa", "fmha", "flash", "cudnn")),
                   ("matmul", ("nvjet", "gemm", "cublas", "cutlass", "xmma")), ("copy", ("memcpy", "memset")))
NCCL_KINDS = {"allreduce": "all-reduce", "allgather": "all-gather", "reducescatter": "reduce-scatter",
              "alltoall": "all-to-all", "sendrecv": "collective-permute"}


def kernel_kind(name: str) -> str:
    """A GPU kernel's kind from its name: a collective kind (KINDS) for NCCL's, else attention
    kernel, matmul, copy, or elementwise/other."""
    low = name.lower().replace("_", "")
    if "nccl" in low:
        return next((kind for key, kind in NCCL_KINDS.items() if key in low), "collective-permute")
    return next((kind for kind, keys in LIBRARY_KERNELS if any(k in low for k in keys)), "elementwise/other")


def op_events(events: list, ops: dict) -> list[OpEvent]:
    """The train step's op events of a trace (module docstring: CPU and GPU)."""
    processes = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    fused = {re.sub(r"[.\-]", "_", name): name for name in ops}
    launches = sorted(e["ts"] for e in events
                      if e.get("ph") == "X" and e.get("name", "").endswith("Execute (jit_train_step)"))
    # the host's launch call of each GPU kernel (cuLaunchKernel, cuGraphLaunch), by correlation id
    launched = {e["args"]["correlation_id"]: e["ts"] for e in events if e.get("ph") == "X"
                and "correlation_id" in e.get("args", {}) and not processes.get(e["pid"], "").startswith("/device:")}
    found = []
    for e in events:
        args = e.get("args", {})
        if e.get("ph") != "X" or "train_step" not in args.get("hlo_module", ""):
            continue
        if "run_id" in args:  # CPU
            if args.get("hlo_op") in ops:
                found.append(OpEvent(args["run_id"], int(args["device_ordinal"]), args["hlo_op"], e["ts"], e["dur"]))
            continue
        gpu = re.match(r"/device:GPU:(\d+)", processes.get(e["pid"], ""))
        if gpu:
            op = args.get("hlo_op") if args.get("hlo_op") in ops else fused.get(e["name"], e["name"])
            at = launched.get(args.get("correlation_id"), e["ts"])
            found.append(OpEvent(bisect.bisect_right(launches, at) - 1, int(gpu.group(1)), op, e["ts"], e["dur"]))
    return found


def whole_steps(found: list[OpEvent]) -> list:
    """The steps of the trace holding at least half the ops of the fullest (a step cut by the
    trace's window holds fewer)."""
    runs = defaultdict(int)
    for e in found:
        runs[e.step] += 1
    return [r for r, n in runs.items() if n >= max(runs.values()) / 2]


def _fix(run_dir: Path) -> str:
    return f"re-record it with train.py --profile-steps A:B --run-dir {run_dir}"


def read_hlo(path: Path, run_dir: Path) -> str:
    """The compiled step's HLO text beside the trace; a damaged file (unreadable, not text, not
    HLO) is a ConfigError naming it and the fix."""
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path} is damaged ({e}); {_fix(run_dir)}") from None
    if "HloModule" not in text:
        raise ConfigError(f"{path} is not a compiled step's HLO text (no HloModule); {_fix(run_dir)}")
    return text


def read_trace(path: Path, run_dir: Path) -> list[dict]:
    """The events of the gzipped Chrome trace at `path` (a list, or {"traceEvents": list}); a
    damaged file (cut short, not gzip, not a trace) is a ConfigError naming it and the fix."""
    fix = _fix(run_dir)
    try:
        with gzip.open(path) as f:
            events = json.load(f)
    except (OSError, EOFError, ValueError, zlib.error) as e:  # OSError: BadGzipFile; ValueError: not JSON
        raise ConfigError(f"{path} is damaged ({e}); {fix}") from None
    events = events.get("traceEvents") if isinstance(events, dict) else events
    if not isinstance(events, list) or not all(isinstance(e, dict) for e in events):
        raise ConfigError(f"{path} is not a Chrome trace (no traceEvents list of events); {fix}")
    return events


def read_profile(run_dir: Path) -> tuple[Path, str, dict[str, tuple[str, str]], list[OpEvent]]:
    """(the trace's path, the compiled step's HLO text, its {instruction: (kind, scope)}
    (`hlo_ops`), the train step's op events)."""
    trace_path, hlo_path = find_trace(run_dir)
    events = read_trace(trace_path, run_dir)
    hlo = read_hlo(hlo_path, run_dir)
    ops = hlo_ops(hlo)
    found = op_events(events, ops)
    if not found:
        raise ConfigError(f"{trace_path}: no op of the train step in the trace; trace steps after the first "
                          "(--profile-steps 2:4) so that the step is compiled before the trace starts")
    return trace_path, hlo, ops, found


def _step_events(run_dir: Path) -> tuple[Path, dict, list[OpEvent]]:
    """(the trace's path, {op: (kind, scope)} with the unattributed GPU kernels, the op events)."""
    trace_path, _, ops, found = read_profile(run_dir)
    for e in found:
        if e.op not in ops:  # an unattributed GPU kernel
            kind = kernel_kind(e.op)
            ops[e.op] = (kind if kind in KINDS else "compute", "unattributed")
    return trace_path, ops, found


def summarize(run_dir: Path) -> dict:
    """Per-step times (ms) per scope and kind, the exposed communication and one step's events."""
    trace_path, ops, step_events = _step_events(run_dir)
    steps = whole_steps(step_events)
    devices = sorted({e.device for e in step_events})
    per = len(steps) * len(devices) * 1e3  # trace times are in us: ms per step per device
    scopes: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    by_device: dict[tuple, list] = defaultdict(list)
    for e in step_events:
        if e.step not in steps:
            continue
        kind, scope = ops[e.op]
        group = "compute" if kind == "compute" else "collective"
        scopes[scope][group] += e.dur / per
        by_device[(e.device, group)].append((e.ts, e.ts + e.dur))
    comm = sum(s["collective"] for s in scopes.values())
    exposed = sum(b - a - _overlap((a, b), _union(by_device[(d, "compute")]))
                  for d in devices for a, b in _union(by_device[(d, "collective")])) / per
    timeline = [(e.ts, e.dur, *ops[e.op]) for e in step_events if e.step == steps[0] and e.device == devices[0]]
    return {"trace": str(trace_path), "steps": len(steps), "devices": len(devices),
            "scopes_ms": {s: dict(v) for s, v in sorted(scopes.items())},
            "compute_ms": sum(s["compute"] for s in scopes.values()), "collective_ms": comm,
            "exposed_collective_ms": exposed, "exposed_fraction": exposed / comm if comm else 0.0,
            "timeline": timeline}


def stage_idle(run_dir: Path, stage_of: dict[int, int]) -> dict:
    """Per pipeline stage, how much of each traced train step it runs none of its own compute
    ops: `idle` (1 - its compute time / the step) and `waiting`, the part of the step it spends
    in collectives (collective-permutes, all-reduces) with no compute of its own running; the
    step = from the first to the last op of that step on any device. `stage_of`: {device
    ordinal: stage}; a stage's figures are the mean over its devices and the traced steps.
    Ops a schedule runs on masked inputs (gpipe's idle cells compute on zeros) count as compute."""
    trace_path, ops, step_events = _step_events(run_dir)
    spans: dict[object, list[float]] = {}
    groups: dict[tuple, list] = defaultdict(list)
    for e in step_events:
        run, device = e.step, e.device
        a, b = e.ts, e.ts + e.dur
        lo, hi = spans.get(run, (a, b))
        spans[run] = [min(lo, a), max(hi, b)]
        kind = "compute" if ops[e.op][0] == "compute" else "collective"
        groups[(run, device, kind)].append((a, b))
    per_stage: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for run, (lo, hi) in spans.items():
        step = hi - lo
        for device, stage in stage_of.items():
            compute = _union(groups[(run, device, "compute")])
            busy = sum(b - a for a, b in compute)
            waiting = sum(b - a - _overlap((a, b), compute) for a, b in _union(groups[(run, device, "collective")]))
            per_stage[stage].append((1 - busy / step if step else 0.0, waiting / step if step else 0.0))
    stages = sorted(per_stage)
    mean = lambda xs: sum(xs) / len(xs) if xs else 0.0  # noqa: E731
    return {"trace": str(trace_path), "steps": len(spans),
            "step_ms": mean([hi - lo for lo, hi in spans.values()]) / 1e3,
            "idle": [mean([i for i, _ in per_stage[s]]) for s in stages],
            "waiting": [mean([w for _, w in per_stage[s]]) for s in stages]}


def draw(summary: dict, out: Path) -> None:
    """Bars per scope (compute, collectives) and device 0's timeline of one step, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(summary["scopes_ms"])
    colors = dict(zip(names, plt.get_cmap("tab10").colors))
    fig, (bars, line) = plt.subplots(2, 1, figsize=(10, 6))
    compute = [summary["scopes_ms"][n].get("compute", 0) for n in names]
    comm = [summary["scopes_ms"][n].get("collective", 0) for n in names]
    bars.barh(names, compute, color=[colors[n] for n in names], label="compute")
    bars.barh(names, comm, left=compute, color="black", label="collectives")
    bars.set_xlabel("ms per step per device")
    bars.legend()
    bars.set_title(f"compute {summary['compute_ms']:.1f} ms, collectives {summary['collective_ms']:.1f} ms, "
                   f"{100 * summary['exposed_fraction']:.0f}% of it exposed")
    if summary["timeline"]:
        t0 = min(t for t, *_ in summary["timeline"])
        for ts, dur, kind, scope in summary["timeline"]:
            row = 1 if kind == "compute" else 0
            line.broken_barh([((ts - t0) / 1e3, dur / 1e3)], (row, 0.8), color=colors.get(scope, "grey"))
        line.set_yticks([0.4, 1.4], ["collectives", "compute"])
        line.set_xlabel("ms since the step's first op (device 0; colour = scope as above)")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def format_summary(s: dict) -> str:
    lines = [f"{s['trace']}: {s['steps']} step(s) x {s['devices']} device(s); ms per step per device",
             f"{'scope':<12}{'compute':>10}{'collective':>12}"]
    for name, v in s["scopes_ms"].items():
        lines.append(f"{name:<12}{v.get('compute', 0):>10.2f}{v.get('collective', 0):>12.2f}")
    lines.append(f"{'total':<12}{s['compute_ms']:>10.2f}{s['collective_ms']:>12.2f}")
    lines.append(f"exposed (not overlapped) communication: {s['exposed_collective_ms']:.2f} ms, "
                 f"{100 * s['exposed_fraction']:.0f}% of the collective time")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    p = Parser(__doc__)
    p.add_argument("run_dir", type=Path, help="a run directory written with --profile-steps")
    p.add_argument("--json", action="store_true", help="print JSON (without the timeline) instead of the table")
    args = p.parse_args(argv)
    summary = summarize(args.run_dir)
    png = Path(summary["trace"]).parent / "summary.png"
    draw(summary, png)
    if args.json:
        print(json.dumps({k: v for k, v in summary.items() if k != "timeline"} | {"png": str(png)}, indent=1))
    else:
        print(format_summary(summary) + f"\nchart: {png}")
    return 0


if __name__ == "__main__":
    from cli import run_cli

    run_cli(main)
