"""Presets: one Python function per model size.

`tiny` is the CPU demo (byte-level, trains in minutes on two cores). The others carry the
published shapes: `125m` (GPT-3 small widths with SwiGLU), `1b` (Llama 3.2 1B widths),
`llama3-8b` (8.03B parameters) and `llama3-70b` (70.6B). The large ones are for planning and
GPUs; they are built abstractly (`nnx.eval_shape`) when no memory should be allocated.

Mixture of experts (model/moe.py): `moe-tiny` is tiny with every layer MoE, 8 experts of half
tiny's F, top-2 (the active FFN is tiny's F: about tiny's step time, plus the routing);
`mixtral-8x7b` carries Mixtral 8x7B's shapes (46.7B parameters, 12.9B active:
training.metrics.param_counts). A DeepSeek-V3-like preset is left out: its first 3 dense
layers and multi-head latent attention have no config field here.
"""

from __future__ import annotations

from typing import Callable

from configs.base import ConfigError, DataConfig, ModelConfig, ParallelConfig, RunConfig, TrainConfig


def tiny() -> RunConfig:
    return RunConfig(name="tiny")


def gpt_125m() -> RunConfig:
    return RunConfig(
        name="125m",
        model=ModelConfig(
            vocab_size=32768, d_model=768, n_layers=12, n_heads=12, n_kv_heads=12,
            head_dim=64, d_ff=2048,
            scan_layers=False,  # unrolled, as 1b (below): 73 ms a step against the scan's 100 on one H100
        ),
        train=TrainConfig(seq_len=1024, global_batch_size=64, lr=6e-4, warmup_steps=100, steps=1000),
    )


def llama_1b() -> RunConfig:
    return RunConfig(
        name="1b",
        model=ModelConfig(
            vocab_size=32768, d_model=2048, n_layers=16, n_heads=32, n_kv_heads=8,
            head_dim=64, d_ff=8192, rope_theta=500_000.0,
            # Unrolled: under remat none (the default) the layer scan's stacking copies cost a
            # quarter of the step, and the stacks memory: one GPU's step 431 ms unrolled against
            # 579 (H100), 414 against 513 (H200), 40 GiB against 58 (bench/results/
            # gpu-nvidia-*-20261126.json, scan-vs-unrolled-*.json). 16 layers compile in seconds.
            scan_layers=False,
        ),
        train=TrainConfig(seq_len=2048, global_batch_size=64, lr=3e-4, warmup_steps=200, steps=1000),
    )


def llama3_8b() -> RunConfig:
    return RunConfig(
        name="llama3-8b",
        model=ModelConfig(
            vocab_size=128256, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8,
            head_dim=128, d_ff=14336, rope_theta=500_000.0, remat="full",
        ),
        # One 8192-token sequence per microbatch and full remat: fits 80 GB on fsdp=8 and dp=8,tp=8.
        train=TrainConfig(seq_len=8192, global_batch_size=256, micro_batch_size=1, lr=3e-4, warmup_steps=2000,
                          steps=10000),
        data=DataConfig(source="synthetic"),
    )


def llama3_70b() -> RunConfig:
    return RunConfig(
        name="llama3-70b",
        model=ModelConfig(
            vocab_size=128256, d_model=8192, n_layers=80, n_heads=64, n_kv_heads=8,
            head_dim=128, d_ff=28672, rope_theta=500_000.0, remat="full",
        ),
        train=TrainConfig(seq_len=8192, global_batch_size=512, lr=1.5e-4, warmup_steps=2000, steps=10000),
        data=DataConfig(source="synthetic"),
        # Set for a pipeline on the layout README plans for 512 H100s, pp=2,dp=16,fsdp=2,tp=8: 1f1b, 8
        # microbatches (tests/test_plan.py checks it fits); `tools.plan --search` ranks FSDP meshes first.
        parallel=ParallelConfig(schedule="1f1b", microbatches=8),
    )


def moe_tiny() -> RunConfig:
    """tiny with 8 experts of F 192, top 2 (tiny's active FFN). Capacity dispatch (cf 2): XLA:CPU
    lowers the dropless path's ragged_dot densely, every row through every local expert (E/k
    times the FLOPs: 3x tiny's step time on one CPU core), where capacity's batched matmul is
    about 1.5x tiny's. XLA GPU lowers it densely too (model/kernels/grouped_matmul.py); jax's
    Hopper kernels (model.expert_matmul=mosaic), which compute the routed rows only, need expert
    dims in multiples of 128, as mixtral-8x7b's are."""
    return RunConfig(name="moe-tiny", model=ModelConfig(n_experts=8, experts_per_token=2, expert_d_ff=192,
                                                        moe_dispatch="capacity", capacity_factor=2.0))


def mixtral_8x7b() -> RunConfig:
    return RunConfig(
        name="mixtral-8x7b",
        model=ModelConfig(
            vocab_size=32000, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128,
            d_ff=14336, rope_theta=1_000_000.0, remat="full", n_experts=8, experts_per_token=2,
        ),
        # 1024 x 4096 = 4M tokens per step, as llama3-70b's 512 x 8192
        train=TrainConfig(seq_len=4096, global_batch_size=1024, micro_batch_size=1, lr=3e-4, warmup_steps=2000,
                          steps=10000),
        data=DataConfig(source="synthetic"),
    )


PRESETS: dict[str, Callable[[], RunConfig]] = {
    "tiny": tiny,
    "125m": gpt_125m,
    "1b": llama_1b,
    "llama3-8b": llama3_8b,
    "llama3-70b": llama3_70b,
    "moe-tiny": moe_tiny,
    "mixtral-8x7b": mixtral_8x7b,
}


def get_preset(name: str) -> RunConfig:
    if name not in PRESETS:
        raise ConfigError(f"--config {name!r} is not a preset; choose one of: {', '.join(PRESETS)}")
    return PRESETS[name]()
