"""The Mosaic GPU kernels (model/kernels/flash_mosaic.py, flash_mosaic_backward.py) without a
GPU: run in jax's GPU interpret mode (jax >= 0.11: shared memory, TMA copies, barriers and wgmma
simulated on CPU) against the xla core, and lowered for CUDA down to their Mosaic GPU custom
calls (every jax).

Each kernel takes either lowering whatever the others take, so the grid mixes them: all three
in Mosaic GPU, and the Mosaic forward with the Triton backward (whose dq, dk, dv then check the
Mosaic forward's lse). Tolerance: bf16's of tests/test_flash_attention.py (2e-2 of max |xla|;
observed up to 7.4e-3).
"""

import dataclasses
import re

import jax
import jax.numpy as jnp
import pytest

from configs import ConfigError
from conftest import GPU_INTERPRET
from model.kernels.flash_attention import Tile, Tiling, default_tiling, flash_attention, mosaic_tiling, triton_tiling
from sharding.cores import building_for
from test_flash_attention import assert_close, both, cuda_text, inputs, triton_launches

INTERPRETED = pytest.mark.skipif(not GPU_INTERPRET,
                                 reason=f"jax {jax.__version__} has no GPU interpret mode (jax >= 0.11)")


def mosaic(block_k: int = 64, stages: int = 2) -> Tile:
    return Tile(64, block_k, stages=stages, lowering="mosaic")


def hopper_default(h: int) -> Tiling:
    """`default_tiling` as a Hopper GPU in bf16 gets it."""
    with building_for("gpu", (9, 0)):
        return default_tiling(h, "bfloat16")


def forward_only(h: int, block_k: int) -> Tiling:
    """The Mosaic forward (this block_k) with the default Triton dq and dk/dv."""
    return dataclasses.replace(default_tiling(h), forward=mosaic(block_k))


@INTERPRETED
@pytest.mark.parametrize("dtype, causal, batch, length, heads, h, tiling", [
    # GQA, four q blocks: the unmasked and diagonal pipelines; dk/dv over G = 2 heads
    ("bfloat16", True, 1, 256, (2, 1), 64, Tiling(mosaic(), mosaic(), mosaic())),
    # padded keys masked in the forward's and dq's last kv tile; H = 128
    ("bfloat16", False, 1, 200, (2, 1), 128, mosaic_tiling(128)),
    # ragged causal, the forward's block_k 128 > block_q, dq's 128, three pipeline slots
    ("float16", True, 1, 130, (2, 2), 64, Tiling(mosaic(128, 3), mosaic(128), mosaic(stages=3))),
    # the Mosaic forward's lse through the Triton backward
    ("bfloat16", False, 1, 384, (2, 2), 64, forward_only(64, 128)),
    ("bfloat16", True, 1, 256, (4, 1), 128, forward_only(128, 64)),
    # the default on Hopper: Mosaic forward and dq, Triton dk/dv (64 x 128 at H = 128, 64 x 64 at 64); ragged
    ("bfloat16", True, 1, 200, (4, 2), 128, hopper_default(128)),
    ("bfloat16", True, 1, 200, (4, 2), 64, hopper_default(64)),
], ids=["all-causal-gqa", "all-full-padded-h128", "all-ragged-fp16", "forward-full", "forward-causal-gqa4",
        "hopper-default-h128", "hopper-default-h64"])
def test_matches_reference(dtype, causal, batch, length, heads, h, tiling):
    (n, kv_heads), dt = heads, jnp.dtype(dtype)
    q, k, v, d_out = inputs((batch, length, n, h), kv_heads, dt)
    got, xla = both(causal, tiling, q, k, v, d_out)
    assert_close(got, xla, "bfloat16")


@INTERPRETED
def test_pipeline_depth_changes_no_bit():
    """stages (a pipeline's slots) changes when tiles are copied, never the result: 2 and 3
    slots give the same out, dq, dk, dv."""
    q, k, v, d_out = inputs((1, 192, 1, 64), 1, jnp.bfloat16)
    two, three = (both(True, Tiling(mosaic(stages=s), mosaic(stages=s), mosaic(stages=s)), q, k, v, d_out)[0]
                  for s in (2, 3))
    assert all(jnp.array_equal(a, b) for a, b in zip(two, three))


@pytest.mark.parametrize("causal", [True, False])
def test_lowers_to_mosaic_gpu_kernels(causal):
    """The GPU path on this CPU (test_flash_attention.py's `cuda_text`): the Mosaic lowering
    ran for each kernel (layouts, tiles, transposed wgmma operands and TMA copies accepted) and
    the gradient holds three Mosaic GPU custom calls and no Triton kernel; with only the forward
    in Mosaic, one custom call and the Triton dq and dk/dv kernels; with no tiling given (the
    Hopper default at H = 128 and 64), two custom calls and the Triton dk/dv kernel."""
    b, length, n, kv_heads = 1, 512, 4, 2
    for h, tiling, mosaics, tritons in ((128, mosaic_tiling(128), 3, set()),
                                        (128, forward_only(128, 128), 1, {"dq_kernel", "dkv_kernel"}),
                                        (128, None, 2, {"dkv_kernel"}), (64, None, 2, {"dkv_kernel"})):
        q, k, v, _ = inputs((b, length, n, h), kv_heads, jnp.bfloat16)
        loss = lambda q, k, v, t=tiling: flash_attention(q, k, v, causal=causal, tiling=t).astype(jnp.float32).sum()  # noqa: E731
        text = cuda_text(jax.grad(loss, argnums=(0, 1, 2)), q, k, v)
        assert len(re.findall(r"custom_call @mosaic_gpu", text)) == mosaics
        assert set(triton_launches(text)) == tritons


def test_the_default_is_mosaic_forward_and_dq_only_on_hopper_in_16_bits_at_h64_and_h128():
    """default_tiling by device, dtype and head dim (its docstring holds the H100/H200 figures)."""
    hopper = hopper_default(128)
    assert (hopper.forward, hopper.dq) == (mosaic_tiling(128).forward, mosaic_tiling(128).dq)
    assert hopper.dkv == triton_tiling(128).dkv == Tile(64, 128, 8, 3)
    assert hopper_default(64) == Tiling(mosaic(64, 2), mosaic(64, 3), Tile(64, 64, 4, 3))  # the H100 sweep's
    with building_for("gpu", (9, 0)):
        assert default_tiling(128, "float16") == hopper
        assert default_tiling(128, "float32") == triton_tiling(128)  # Mosaic takes 16-bit inputs only
        assert default_tiling(64, "float32") == triton_tiling(64)
        assert default_tiling(256, "bfloat16") == triton_tiling(256)  # not measured
    for platform, capability in (("gpu", (8, 0)), ("gpu", (10, 0)), ("cpu", None)):  # not measured there
        with building_for(platform, capability):
            assert default_tiling(128, "bfloat16") == triton_tiling(128)
            assert default_tiling(64, "bfloat16") == triton_tiling(64)
    for h in (32, 64, 128, 256):
        tiling = triton_tiling(h)
        assert {t.lowering for t in (tiling.forward, tiling.dq, tiling.dkv)} == {"triton"}


@pytest.mark.parametrize("dtype, h, kernel, tile, message", [
    ("float32", 64, "forward", mosaic(), "the Mosaic GPU forward takes bfloat16/float16 inputs"),
    ("bfloat16", 32, "dq", mosaic(), "the Mosaic GPU dq kernel needs a head dim that is a multiple of 64 (got 32)"),
    ("bfloat16", 64, "forward", Tile(128, 64, lowering="mosaic"),
     "the Mosaic GPU forward needs block_q=64 and block_k a multiple of 64 (got 128, 64)"),
    ("bfloat16", 64, "dkv", mosaic(128), "the Mosaic GPU dk/dv kernel needs block_q=64 and block_k=64 (got 64, 128)"),
    ("bfloat16", 64, "dq", Tile(64, 64, lowering="cuda"), "the dq tile's lowering='cuda': choose triton or mosaic"),
])
def test_bad_mosaic_tile_is_one_error(dtype, h, kernel, tile, message):
    q, k, v, _ = inputs((1, 128, 2, h), 2, jnp.dtype(dtype))
    with pytest.raises(ConfigError, match=re.escape(message)):
        flash_attention(q, k, v, tiling=dataclasses.replace(default_tiling(h), **{kernel: tile}))


@pytest.mark.skipif(GPU_INTERPRET, reason="this jax interprets Mosaic GPU kernels on CPU")
def test_without_interpret_mode_the_cpu_refuses_by_version():
    q, k, v, _ = inputs((1, 128, 2, 64), 2, jnp.bfloat16)
    with pytest.raises(ConfigError, match=r"on CPU in jax.s GPU interpret mode \(jax >= 0.11; this is jax "):
        flash_attention(q, k, v, tiling=mosaic_tiling(64))
