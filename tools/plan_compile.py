"""Compile the real train step for the plan (tools/plan.py: the dry run, and --search --confirm):
XLA's memory, FLOPs, collective census and attention core, on this process's devices or for
NVIDIA GPUs this machine does not have.

The model is built abstractly (`training.build.make_program`: no parameter is allocated) and
the step compiled ahead of time for the mesh's device count: fake CPU devices on a laptop, or
with `compile_for` ('h100', 'h200') XLA GPU's compile-only devices (tools/gpu_target.py), so that
XLA's memory is the GPU's and is judged against it.

Compiled for a GPU (so too a dry run on a GPU machine), XLA GPU's latency-hiding scheduler
spends the memory the GPU has spare on overlap: gathers and recomputed forwards started early,
their results held. Where XLA's peak is over the estimate by LHS_RECHECK x and LHS_RECHECK_GIB,
the step is compiled once more with the scheduler off (jax.jit's compiler_options, for that
compile only) and the figures give that peak too (`lhs_off`, the memory-minimal schedule: 1b
tp=4,dp=2 under remat full compiled for H100s, 24.6 GiB as compiled (jax 0.12.0.1), 11.2
without the scheduler, the estimate 11.1; a lower limit does not bring the scheduler down to
it: README, Plan a run). The recheck costs one more compile; tiny configs stay under the GiB
floor.
"""

from __future__ import annotations

import dataclasses
import sys

from configs import ConfigError, RunConfig, apply_overrides
from tools import estimate
from tools.shape import GiB

# XLA's peak over LHS_RECHECK x the estimate and over it by LHS_RECHECK_GIB (less is within the 1-2 GiB
# of CUDA and NCCL buffers the estimate leaves out): compiled again with the latency-hiding scheduler off
LHS_RECHECK, LHS_RECHECK_GIB = 1.1, 0.5
LHS_OFF = {"xla_gpu_enable_latency_hiding_scheduler": False}


def xla_figures(cfg: RunConfig, mesh, recheck_above: float | None = None) -> dict:
    """Compile the real step (pipelined too) on abstract inputs: memory, FLOPs and census per
    device, and the attention core compiled. A core this backend cannot run (cudnn on a
    laptop's CPU) is compiled as model.attention=auto: the plan says so beside XLA's memory.
    Compiled for a GPU with XLA's peak over `recheck_above` bytes: the memory of a second compile
    with XLA GPU's latency-hiding scheduler off, `lhs_off` (module docstring)."""
    from sharding.cores import core_problem, target
    from tools.hlo import compiled_census, summary
    from training.build import make_program, compile_step, xla_memory

    m = cfg.model
    if core_problem(m.attention, *target(), m.compute_dtype, m.head_dim):
        cfg = apply_overrides(cfg, ["model.attention=auto"])
    program = make_program(cfg, mesh)  # outside set_mesh (see its docstring)

    def memory(options: dict | None = None) -> tuple:
        executable, _, _ = compile_step(program.step_fn, mesh, program.state, program.abstract_batch(), options)
        found = xla_memory(executable)
        return executable, {k: found[k] for k in ("argument", "output", "alias", "temp")} | {"peak": found["static_peak"]}

    executable, mem = memory()
    cost = executable.cost_analysis()
    cost = (cost[0] if isinstance(cost, list) else cost) or {}  # none from a GPU compile without one
    rows = summary(compiled_census(executable, cfg, mesh))
    figures = {"platform": target()[0], "device_kind": mesh.devices.flat[0].device_kind,
               "attention": program.strategies.attention, "memory": mem, "flops_per_device": cost.get("flops"),
               "census": rows}
    if figures["platform"] == "gpu" and recheck_above is not None and mem["peak"] > recheck_above:
        print(f"plan: XLA's peak is {mem['peak'] / GiB:.1f} GiB, over the estimate by more than {LHS_RECHECK}x and "
              f"{LHS_RECHECK_GIB} GiB: compiling again with the latency-hiding scheduler off", file=sys.stderr,
              flush=True)
        figures["lhs_off"] = memory(LHS_OFF)[1]
    return figures


def recheck_above(cfg: RunConfig, mesh) -> float:
    """XLA's peak (bytes) above which a GPU compile of cfg on `mesh` is redone without the LHS."""
    from sharding.mesh import mesh_config

    meshed = dataclasses.replace(cfg, parallel=mesh_config(mesh, cfg.parallel))
    est = estimate.memory(meshed, dict(mesh.shape))["peak"]
    return max(LHS_RECHECK * est, est + LHS_RECHECK_GIB * GiB)


def compiled(cfg: RunConfig, compile_for: str | None = None) -> tuple[dict, object]:
    """(XLA's figures, the mesh) of cfg's step on the mesh of cfg.parallel: over this process's
    devices (fake CPU devices were requested by the caller), or, with `compile_for` a
    tools/gpu_target.py GPU, over that many of its compile-only devices."""
    from sharding.mesh import build_mesh

    if compile_for is None:
        mesh = build_mesh(cfg.parallel)
        return xla_figures(cfg, mesh, recheck_above(cfg, mesh)), mesh
    from sharding.cores import building_for
    from sharding.mesh import requested_devices
    from tools.gpu_target import GPUS, cudnn_fix, devices, listed

    target = GPUS[compile_for]
    compile_only = devices(target, requested_devices(cfg.parallel))
    mesh = build_mesh(cfg.parallel, compile_only)
    with building_for("gpu", target.capability), listed(compile_only):
        try:
            return xla_figures(cfg, mesh, recheck_above(cfg, mesh)), mesh
        except RuntimeError as e:
            if "cuDNN" not in str(e):
                raise
            raise ConfigError(f"--compile-for-gpu: the cudnn attention core does not compile here "
                              f"({str(e).strip().splitlines()[0]}): {cudnn_fix()}") from None
