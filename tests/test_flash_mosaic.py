"""The Mosaic GPU forward (model/kernels/flash_mosaic.py) without a GPU: run in jax's GPU
interpret mode (jax >= 0.11: shared memory, TMA copies, barriers and wgmma simulated on CPU)
against the xla core, and lowered for CUDA down to its Mosaic GPU custom call (every jax).

The gradient runs the Triton dq and dk/dv kernels (interpreted) on the Mosaic forward's lse, so
dq, dk, dv check that lse too. Tolerance: bf16's of tests/test_flash_attention.py (2e-2 of
max |xla|; observed up to 6e-3).
"""

import dataclasses
import re

import jax
import jax.numpy as jnp
import pytest

from configs import ConfigError
from conftest import GPU_INTERPRET
from model.kernels.flash_attention import Tile, Tiling, default_tiling, flash_attention, mosaic_tiling as default_mosaic
from test_flash_attention import assert_close, both, cuda_text, inputs, triton_launches

INTERPRETED = pytest.mark.skipif(not GPU_INTERPRET,
                                 reason=f"jax {jax.__version__} has no GPU interpret mode (jax >= 0.11)")


def mosaic_tiling(h: int, block_k: int = 64, stages: int = 2) -> Tiling:
    """flash_attention.mosaic_tiling with this block_k and pipeline depth."""
    return dataclasses.replace(default_mosaic(h), forward=Tile(64, block_k, stages=stages, lowering="mosaic"))


@INTERPRETED
@pytest.mark.parametrize("dtype, causal, batch, length, heads, h, block_k", [
    ("bfloat16", True, 1, 256, (2, 1), 64, 64),  # GQA, four q blocks: unmasked and diagonal pipelines
    ("bfloat16", False, 2, 200, (4, 2), 128, 64),  # padded keys masked in the last kv tile
    ("float16", True, 1, 130, (2, 2), 64, 128),  # ragged, block_k 128 > block_q
    ("bfloat16", False, 1, 384, (2, 2), 64, 128),  # three kv tiles through a 2-slot pipeline
])
def test_matches_reference(dtype, causal, batch, length, heads, h, block_k):
    (n, kv_heads), dt = heads, jnp.dtype(dtype)
    q, k, v, d_out = inputs((batch, length, n, h), kv_heads, dt)
    mosaic, xla = both(causal, mosaic_tiling(h, block_k), q, k, v, d_out)
    assert_close(mosaic, xla, "bfloat16")


@INTERPRETED
def test_deeper_pipeline_is_the_same_forward():
    """stages (the pipeline's slots) changes when tiles are copied, never the result: 2 and 3
    slots give the same bits."""
    q, k, v, _ = inputs((1, 512, 2, 64), 1, jnp.bfloat16)
    two, three = (flash_attention(q, k, v, causal=True, tiling=mosaic_tiling(64, stages=s)) for s in (2, 3))
    assert jnp.array_equal(two, three)


@pytest.mark.parametrize("causal", [True, False])
def test_lowers_to_one_mosaic_gpu_kernel_and_two_triton_ones(causal):
    """The GPU path on this CPU (test_flash_attention.py's `cuda_text`): the forward lowers
    to jax's Mosaic GPU custom call (the Mosaic lowering ran: the kernel's layouts, tiles and
    wgmma shapes were accepted), the backward to the Triton dq and dk/dv kernels."""
    b, length, n, kv_heads, h = 1, 512, 4, 2, 128
    q, k, v, _ = inputs((b, length, n, h), kv_heads, jnp.bfloat16)
    tiling = mosaic_tiling(h, 128)
    loss = lambda q, k, v: flash_attention(q, k, v, causal=causal, tiling=tiling).astype(jnp.float32).sum()  # noqa: E731
    text = cuda_text(jax.grad(loss, argnums=(0, 1, 2)), q, k, v)
    assert set(triton_launches(text)) == {"dq_kernel", "dkv_kernel"}
    assert len(re.findall(r"custom_call @mosaic_gpu", text)) == 1


@pytest.mark.parametrize("dtype, h, tile, message", [
    ("float32", 64, Tile(64, 64, lowering="mosaic"), "the Mosaic GPU forward takes bfloat16/float16 inputs"),
    ("bfloat16", 32, Tile(64, 64, lowering="mosaic"), "needs a head dim that is a multiple of 64 (got 32)"),
    ("bfloat16", 64, Tile(128, 64, lowering="mosaic"), "needs block_q=64 and block_k a multiple of 64 (got 128, 64)"),
    ("bfloat16", 64, Tile(64, 64, lowering="cuda"), "the forward tile's lowering='cuda': the forward takes triton"),
])
def test_bad_mosaic_tile_is_one_error(dtype, h, tile, message):
    q, k, v, _ = inputs((1, 128, 2, h), 2, jnp.dtype(dtype))
    with pytest.raises(ConfigError, match=re.escape(message)):
        flash_attention(q, k, v, tiling=dataclasses.replace(default_tiling(h), forward=tile))


def test_backward_kernels_have_no_mosaic_form():
    q, k, v, _ = inputs((1, 128, 2, 64), 2, jnp.bfloat16)
    tiling = dataclasses.replace(default_tiling(64), dq=Tile(64, 64, lowering="mosaic"))
    with pytest.raises(ConfigError, match="the dq tile's lowering='mosaic': the forward takes triton or mosaic, "
                                          "dq and dk/dv triton"):
        flash_attention(q, k, v, tiling=tiling)


@pytest.mark.skipif(GPU_INTERPRET, reason="this jax interprets Mosaic GPU kernels on CPU")
def test_without_interpret_mode_the_cpu_refuses_by_version():
    q, k, v, _ = inputs((1, 128, 2, 64), 2, jnp.bfloat16)
    with pytest.raises(ConfigError, match=r"on CPU in jax.s GPU interpret mode \(jax >= 0.11; this is jax "):
        flash_attention(q, k, v, tiling=mosaic_tiling(64))
