"""The run configuration: four frozen dataclasses and their whole-run container.

This module imports no jax: `train.py` builds and validates the config (and the mesh shape)
before jax is imported, so that it can still choose the number of fake CPU devices.

Every field can be set from the command line with `--set section.field=value`
(see `configs.overrides`); the resolved config is printed and saved with each run.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


class ConfigError(ValueError):
    """A user-facing configuration mistake; the message names the flag and the fix."""


@dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of the Llama-style decoder."""

    vocab_size: int = 256
    d_model: int = 128  # D
    n_layers: int = 4  # X
    n_heads: int = 8  # N
    n_kv_heads: int = 2  # K (grouped-query attention: K divides N)
    head_dim: int = 16  # H
    d_ff: int = 384  # F (SwiGLU hidden)
    rope_theta: float = 10_000.0
    norm_eps: float = 1e-5
    init_std: float = 0.02
    attention: str = "auto"  # auto (by device: sharding/cores.py) | xla (reference) | cudnn (GPU) | pallas
    param_dtype: str = "float32"
    compute_dtype: str = "bfloat16"
    remat: str = "none"  # none | full | dots | attn (model/remat.py POLICIES)
    scan_layers: bool = True  # one lax.scan over the stacked layers; False: a Python loop (unrolled)
    # Mixture of experts (model/moe.py); n_experts = 0 is a dense model.
    n_experts: int = 0  # E routed experts per MoE layer
    experts_per_token: int = 2  # k (top-k routing)
    moe_every: int = 1  # every k-th layer is MoE (the last of each group of k), the rest dense
    n_shared_experts: int = 0  # experts every token passes through (a dense SwiGLU of n·expert_d_ff)
    expert_d_ff: int = 0  # F of one expert; 0 = d_ff
    moe_dispatch: str = "dropless"  # dropless | capacity (each expert takes cf·tokens·k/E per device)
    capacity_factor: float = 1.25  # cf, for moe_dispatch=capacity
    expert_matmul: str = "ragged_dot"  # dropless's grouped matmul: ragged_dot (XLA) | mosaic (jax's Hopper kernels)
    router_aux_loss: float = 0.01  # weight of the load-balancing loss (Switch form)
    router_z_loss: float = 0.001  # weight of the router z-loss (logsumexp of router logits, squared)


@dataclass(frozen=True)
class TrainConfig:
    """Optimisation, batch, logging, checkpoints (training/checkpoint.py) and evaluation."""

    steps: int = 200
    seq_len: int = 128  # L
    global_batch_size: int = 32  # sequences per optimizer update
    micro_batch_size: int = 0  # sequences per data-parallel rank per microbatch; 0 = no accumulation
    lr: float = 3e-3
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 20
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # global-norm clip; 0 disables
    z_loss: float = 0.0  # weight of logsumexp(logits)^2 in the loss
    seed: int = 0
    log_every: int = 10
    profile_steps: str = ""  # START:END, a window of steps traced with jax.profiler
    checkpoint_every: int = 100  # save every N steps and at the last step; 0 = no checkpoints
    keep_checkpoints: int = 3  # the newest k complete checkpoints are kept
    max_bad_steps: int = 5  # stop after this many non-finite (skipped) steps in a row
    # Held-out evaluation (training/evaluate.py): every N steps and at the last step; 0 = none.
    eval_every: int = 100
    eval_batches: int = 4  # global batches of held-out windows per evaluation (the same each time)


BYTE_SOURCES = ("stdlib", "text")  # data.source of one token per byte: bits per byte = loss / ln 2


@dataclass(frozen=True)
class DataConfig:
    """Where the tokens come from.

    source: stdlib (this Python's own standard library .py files, as bytes), text (a file or a
    directory of files, as bytes), tokens (a pretokenized .bin file of `token_dtype`),
    synthetic (uniform random tokens).
    """

    source: str = "stdlib"
    path: str = ""
    token_dtype: str = "uint16"  # for source=tokens: uint16 | uint32
    seed: int = 1234


@dataclass(frozen=True)
class ParallelConfig:
    """Size of each mesh axis, outermost first; -1 (at most one) fills the remaining devices.

    The default (no --mesh) is pure data parallelism over every visible device: one device on
    a laptop, dp=8 on an 8-GPU node.

    Tensor parallelism (sharding/tensor_parallel.py): `tp_impl` shard_map writes the Megatron
    collectives by hand, gspmd leaves them to XLA; `sequence_parallel` splits the activations
    between blocks along L over `tensor`; `tp_overlap` turns SP's all-gather/reduce-scatter into
    rings of collective-permutes overlapped with the matmul chunks.

    Expert parallelism (sharding/expert_parallel.py, with expert > 1): the experts of each MoE
    layer split over `expert`, tokens sent to them and back with all-to-alls; every other
    parameter treats `expert` as one more data axis.

    Context parallelism (sharding/context_parallel.py, with sequence > 1): `context_impl` ring
    passes K/V blocks around the sequence axis, allgather gathers them once per layer, gspmd
    leaves attention over a split L to XLA (which all-gathers K and V).

    Pipeline parallelism (pipeline/, with stage > 1): `schedule` gpipe | interleaved | 1f1b |
    interleaved-1f1b | zb-h1 | zbv (pipeline/tables.py), `microbatches` M per step (0 = the
    number of stages), `virtual_stages` V chunks of layers per device for interleaved and
    interleaved-1f1b (2 for zbv).

    Gradient accumulation (training/step.py; k > 1 microbatches, pp = 1, dense, sp = 1): the
    microbatches' gradients are summed on each device and all-reduced over data once per step;
    over fsdp XLA's ZeRO-3 gathers and reduce-scatters each layer in every microbatch. With
    `fsdp_gather_once` the weights are all-gathered (compute dtype, bf16 by default) over fsdp
    once per step, before the microbatch loop, kept through it, and the summed gradients
    reduce-scattered once (the memory of whole weights of the device's tensor shard and a whole
    fp32 gradient accumulator; at k = 1 too).
    """

    stage: int = 1
    data: int = -1
    fsdp: int = 1
    expert: int = 1
    sequence: int = 1
    tensor: int = 1
    tp_impl: str = "shard_map"  # shard_map | gspmd
    sequence_parallel: bool = False
    tp_overlap: bool = False
    context_impl: str = "ring"  # ring | allgather | gspmd: attention over the sequence axis (sp > 1)
    schedule: str = "gpipe"  # gpipe | interleaved | 1f1b | interleaved-1f1b | zb-h1 | zbv
    microbatches: int = 0  # M; 0 = pp
    virtual_stages: int = 1  # V: interleaved, interleaved-1f1b; 2 for zbv
    fsdp_gather_once: bool = False  # fsdp weights gathered once per step, not per microbatch


@dataclass(frozen=True)
class RunConfig:
    name: str = "tiny"
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "RunConfig":
        return cls(
            name=d["name"],
            model=ModelConfig(**d["model"]),
            train=TrainConfig(**d["train"]),
            data=DataConfig(**d["data"]),
            parallel=ParallelConfig(**d["parallel"]),
        )
