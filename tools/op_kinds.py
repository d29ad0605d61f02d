"""Kernel time of a profile by kind: attention kernels, matmuls, collectives, copies, the rest.

  python -m tools.op_kinds runs/p [--top 10] [--json]     (a run written with --profile-steps)

Where tools/trace_summary.py sums a trace by the model's scopes (embedding, attention, mlp,
...), this sums the same op events (trace_summary's `read_profile`: CPU ops, or GPU kernels
given the step of their launch) by what each op does, read from the compiled HLO: a cuDNN fmha
or Pallas (Triton, Mosaic) custom call, or a dot of the xla core's einsums, is an attention
kernel; any other dot, cuBLAS call or fusion around a dot a matmul; all-reduce, all-gather and
the other collectives (tools/hlo.py's KINDS) collectives; `copy` copies; everything else
elementwise/other. A GPU kernel that names no instruction (a library kernel inside a CUDA
graph) is kinded by its name (trace_summary's `kernel_kind`). `make gpu-check`'s profile stage
records this breakdown; the percentages of its README table are from here.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path

from configs.parser import Parser
from tools.hlo import KINDS
from tools.hlo_text import HEADER, INSTRUCTION
from tools.measure import check_at_least
from tools.trace_summary import kernel_kind, read_profile, whole_steps

# The xla core's two einsums (model/attention.py), forward and transposed.
_XLA_CORE = ("blnh,bmnh->bnlm", "bnlm,bmnh->blnh")


def op_kinds(hlo_text: str) -> dict[str, str]:
    """{instruction: attention kernel | matmul | collective | copy | elementwise/other} of compiled HLO.

    Attention kernel: a cuDNN fmha or Pallas (Triton/Mosaic) custom call, or a dot of the xla
    core's einsums. Matmul: any other dot, cuBLAS custom call, or fusion around a dot."""
    with_dot, lines, current = set(), [], None
    for line in hlo_text.splitlines():
        head, m = HEADER.match(line), INSTRUCTION.match(line)
        if head and "(" in line:
            current = head.group(1)
        elif m:
            name, _, opcode, rest = m.groups()
            lines.append((name, opcode, rest))
            if opcode in ("dot", "convolution"):
                with_dot.add(current)
    kinds = {}
    for name, opcode, rest in lines:
        base = re.sub(r"-(start|done|update)$", "", opcode)
        target = re.search(r'custom_call_target="([^"]+)"', rest)
        target = target.group(1).lower() if target else ""
        calls = re.search(r"calls=%?([\w.\-]+)", rest)
        dot = opcode in ("dot", "convolution") or (opcode == "fusion" and calls and calls.group(1) in with_dot)
        if opcode in ("while", "conditional", "call"):
            kinds[name] = "control flow"  # its event spans its body's ops: not counted
        elif base in KINDS:
            kinds[name] = "collective"
        elif any(t in target for t in ("fmha", "triton", "mosaic")) or (dot and any(e in rest for e in _XLA_CORE)):
            kinds[name] = "attention kernel"
        elif dot or any(t in target for t in ("gemm", "matmul", "cublas")):
            kinds[name] = "matmul"
        elif opcode == "copy":
            kinds[name] = "copy"
        else:
            kinds[name] = "elementwise/other"
    return kinds


def op_breakdown(run_dir: Path, top: int = 10) -> dict:
    """Per step and device: ms per op kind, their fractions, and the `top` ops by time. The op
    events and their steps as tools/trace_summary.py reads them (CPU ops, GPU kernels; a GPU
    kernel that names no instruction is kinded by its name, `kernel_kind`)."""
    _, hlo, scopes, found = read_profile(run_dir)
    kinds = op_kinds(hlo)
    found = [e for e in found if kinds.get(e.op) != "control flow"]
    for e in found:
        if e.op not in kinds:
            kind = kernel_kind(e.op)
            kinds[e.op] = "collective" if kind in KINDS else kind
    steps = whole_steps(found) if found else []
    devices = len({e.device for e in found}) or 1
    per_op = defaultdict(float)
    for e in found:
        if e.step in steps:
            per_op[e.op] += e.dur / 1e3 / len(steps) / devices  # us -> ms per step per device
    by_kind = defaultdict(float)
    for name, ms in per_op.items():
        by_kind[kinds[name]] += ms
    total = sum(by_kind.values())
    ranked = sorted(per_op.items(), key=lambda kv: -kv[1])[:top]
    return {"steps": len(steps), "devices": devices, "total_ms": total, "kinds_ms": dict(by_kind),
            "fractions": {k: v / total for k, v in by_kind.items()} if total else {},
            "top_ops": [{"op": n, "kind": kinds[n], "scope": scopes.get(n, ("", "unattributed"))[1], "ms": ms}
                        for n, ms in ranked]}


def format_breakdown(ops: dict) -> str:
    lines = [f"{ops['steps']} step(s) x {ops['devices']} device(s): {ops['total_ms']:.2f} ms of kernels per step per device"]
    for kind, ms in sorted(ops["kinds_ms"].items(), key=lambda kv: -kv[1]):
        lines.append(f"  {kind:<20}{ms:>10.2f} ms  {100 * ops['fractions'][kind]:5.1f}%")
    lines.append("top ops:")
    lines += [f"  {r['ms']:>10.2f} ms  {r['kind']:<20}{r['scope']:<14}{r['op'][:70]}" for r in ops["top_ops"]]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    p = Parser(__doc__)
    p.add_argument("run_dir", type=Path, help="a run directory written with --profile-steps")
    p.add_argument("--top", type=int, default=10, help="the ops listed, slowest first (default 10)")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    args = p.parse_args(argv)
    check_at_least(args, 1, "--top")
    ops = op_breakdown(args.run_dir, args.top)
    print(json.dumps(ops, indent=1) if args.json else format_breakdown(ops))
    return 0


if __name__ == "__main__":
    from cli import run_cli

    run_cli(main)
