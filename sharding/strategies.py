"""Which strategies a run applies on its mesh: one function, read top to bottom.

`parallelize(cfg, sizes)` is the one place that turns a config and a mesh shape into the
strategies of the step, as torchtitan's `parallelize_llama` applies TP, CP, activation
checkpointing and FSDP in turn. The model takes the result (`Transformer(cfg.model,
strategies)`), the step takes its schedule. Placement is not decided here: the logical rules
(sharding/rules.py) put the batch on (data, fsdp), the weights' D on fsdp and the layers on
stage for every run alike, and XLA derives the data and FSDP collectives from them (with k > 1
microbatches the step writes them, once per step: `accumulation`).

  tensor     the Megatron regions (attention, MLP, embedding, head) written with shard_map
             (sharding/tensor_parallel.py), with sequence parallelism and overlap as configured,
             or left to GSPMD (tp_impl=gspmd); plain per-device code where tp = 1. Their
             manual-axis typing is off around the Pallas core, whose interpreter cannot type
             its loops.
  context    sp > 1: attention over the `sequence` axis written out, a ring of K/V blocks or one
             all-gather (sharding/context_parallel.py), the sequence laid out in zigzag order
             at the input; None: one device's sequence, or XLA's all-gather (context_impl=gspmd)
  attention  the per-device core: xla | cudnn | pallas, model.attention=auto resolved for this
             device and mesh (sharding/cores.py; model/attention.py refuses a core where it cannot
             run); under context parallelism, the core of each block
  remat      the policy around each scanned layer (model/remat.py)
  schedule   pp > 1: the pipeline schedule over `stage` (pipeline/); None: the step's k
             microbatches run as a scan (training/step.py)
  accumulation  the batch axes over which the k microbatches run per device (their gradients
             summed locally, reduced once per step: training/step.py), and whether fsdp's
             weights are gathered once per step (parallel.fsdp_gather_once); () = XLA reduces
             the gradients (one device, k = 1, sp > 1 where the regions cannot nest)
  experts    n_experts > 0: how the MoE layers dispatch (dropless | capacity); their region is
             explicit over every token axis and `expert` (sharding/expert_parallel.py) whatever
             the mesh; None: a dense model
"""

from __future__ import annotations

from dataclasses import dataclass, field


from configs.base import ModelConfig, RunConfig
from sharding.cores import choose_core, target
from sharding.checks import accumulation_axes, check_run, explicit_context, explicit_tensor
from sharding.tensor_parallel import TensorParallel
from sharding.xla_flags import program_options


@dataclass(frozen=True)
class Strategies:
    """What one run applies; every field is decided by `parallelize`."""

    tensor: TensorParallel = field(default_factory=TensorParallel)
    context: str | None = None
    attention: str = "xla"
    remat: str = "none"
    schedule: str | None = None
    experts: str | None = None
    accumulation: tuple[str, ...] = ()
    fsdp_gather_once: bool = False

    @classmethod
    def single_device(cls, m: ModelConfig) -> Strategies:
        """A model on one device (tests, tools): its own core and remat, nothing to split."""
        return cls(attention=device_core(m, context=False), remat=m.remat,
                   experts=m.moe_dispatch if m.n_experts else None)

    def describe(self) -> str:
        """One line for the log, e.g. 'tensor shard_map+sp, context ring, attention xla, remat full,
        pipeline 1f1b, experts none', where the step accumulates itself e.g. ', accumulation
        data+fsdp (fsdp gathered once)', and its XLA options e.g. ', xla
        xla_gpu_pipeline_all_gather=COLLECTIVE_PIPELINING_MODE_OFF'."""
        t = self.tensor
        tensor = "+".join([t.impl] + ["sp"] * t.sequence_parallel + ["overlap"] * t.overlap)
        line = (f"tensor {tensor}, context {self.context or 'none'}, attention {self.attention}, remat {self.remat}, "
                f"pipeline {self.schedule or 'none'}, experts {self.experts or 'none'}")
        if self.accumulation:
            line += f", accumulation {'+'.join(self.accumulation)}" + " (fsdp gathered once)" * self.fsdp_gather_once
        options = " ".join(f"{k}={v if isinstance(v, str) else str(v).lower()}" for k, v in self.compiler_options.items())
        return line + f", xla {options}" * bool(options)

    @property
    def compiler_options(self) -> dict[str, str | bool]:
        """XLA options of this run's programs, over XLA_FLAGS (sharding.xla_flags.program_options)."""
        return program_options(self.tensor.sequence_parallel)


def parallelize(cfg: RunConfig, sizes: dict[str, int]) -> Strategies:
    """The strategies of `cfg` on a mesh of `sizes` ({axis: size}); refuses (ConfigError) what
    cannot run, through sharding/checks.py."""
    check_run(cfg, sizes)
    p, m = cfg.parallel, cfg.model
    context = explicit_context(cfg, sizes["sequence"])
    core = device_core(m, context=context is not None)
    regions = explicit_tensor(cfg, sizes["tensor"]) or context is not None  # shard_maps
    return Strategies(
        tensor=TensorParallel(p.tp_impl, p.sequence_parallel, p.tp_overlap, check_vma=core == "xla",
                              context=context is not None,
                              gather_in_checkpoint=m.remat != "none" and sizes["fsdp"] > 1 and regions,
                              gather_in_region=sizes["fsdp"] > 1 and (m.scan_layers or m.remat == "none")),
        context=context,
        attention=core,
        remat=m.remat,
        schedule=p.schedule if sizes["stage"] > 1 else None,
        experts=m.moe_dispatch if m.n_experts else None,
        accumulation=accumulation_axes(cfg, sizes),
        fsdp_gather_once=p.fsdp_gather_once and sizes["fsdp"] > 1 and "fsdp" in accumulation_axes(cfg, sizes),
    )


def device_core(m: ModelConfig, context: bool) -> str:
    """model.attention on the devices this process runs on (auto chosen by sharding/cores.py)."""
    return choose_core(m.attention, *target(), m.compute_dtype, m.head_dim, context)
