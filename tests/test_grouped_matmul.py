"""The experts' grouped matmul (model/kernels/grouped_matmul.py).

jax's Hopper kernels cannot run or be interpreted here, so the gradient rule that joins them
(`with_gradient`) is checked with XLA's ragged dots in their places, shaped as the kernels are
and leaving NaN where the kernels leave rows unwritten: value and gradients equal autodiff of
`jax.lax.ragged_dot`, padding rows and empty groups included. Where `mosaic` may run is checked
as a pure function; its compilation for an H100 is tests/test_gpu_compile.py's.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import run_module
from model.kernels.grouped_matmul import grouped_matmul, problem, with_gradient
from tools.gpu_target import cudnn_compiles, plugin_installed

ROWS_CONTRACTED = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(((0,), (0,)), ((), ())), lhs_ragged_dimensions=[0], rhs_group_dimensions=[])


def unwritten_past_groups(y: jax.Array, sizes: jax.Array) -> jax.Array:
    """y with NaN in the rows past the last group: what the kernels leave there."""
    return jnp.where((jnp.arange(y.shape[0]) < jnp.sum(sizes))[:, None], y, jnp.nan)


def forward(x, w, sizes):
    return unwritten_past_groups(jax.lax.ragged_dot(x, w, sizes), sizes)


def backward_x(dy, w, sizes):
    return unwritten_past_groups(jax.lax.ragged_dot(dy, jnp.swapaxes(w, 1, 2), sizes), sizes)


def backward_w(x, dy, sizes):
    return jax.lax.ragged_dot_general(x, dy, sizes, ROWS_CONTRACTED)


@pytest.mark.parametrize("sizes", [[5, 0, 7, 3], [4, 4, 4, 4], [0, 0, 9, 0]], ids=["padded", "full", "one-group"])
def test_the_kernels_gradient_rule_equals_autodiff_of_ragged_dot(sizes):
    """x [16, 8] @ w [4, 8, 12] in fp32; the loss weights every output row, padding rows too, so
    a padding row's value or cotangent that leaked would show (as NaN from the stand-ins)."""
    keys = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(keys[0], (16, 8))
    w = jax.random.normal(keys[1], (4, 8, 12))
    probe = jax.random.normal(keys[2], (16, 12))
    sizes = jnp.asarray(sizes, jnp.int32)
    ours = with_gradient(forward, backward_x, backward_w)

    def loss(f):
        return lambda x, w: jnp.sum(jnp.sin(f(x, w, sizes)) * probe)

    np.testing.assert_allclose(ours(x, w, sizes), jax.lax.ragged_dot(x, w, sizes), rtol=1e-6, atol=1e-6)
    got = jax.grad(loss(ours), argnums=(0, 1))(x, w)
    want = jax.grad(loss(jax.lax.ragged_dot), argnums=(0, 1))(x, w)
    for g, r in zip(got, want):
        assert np.isfinite(g).all()
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5)
    assert not np.asarray(ours(x, w, sizes))[int(jnp.sum(sizes)):].any()  # padding rows: 0


def test_ragged_dot_is_xlas():
    x, w = jnp.ones((6, 4)), jnp.arange(2 * 4 * 3, dtype=jnp.float32).reshape(2, 4, 3)
    sizes = jnp.asarray([2, 3], jnp.int32)
    np.testing.assert_array_equal(grouped_matmul(x, w, sizes, "ragged_dot"), jax.lax.ragged_dot(x, w, sizes))


@pytest.mark.parametrize("device, k, n, dtype, message", [
    (("cpu", None), 4096, 14336, "bfloat16", "this backend is cpu"),
    (("gpu", (8, 0)), 4096, 14336, "bfloat16", "compute capability (8, 0)"),
    (("gpu", (10, 0)), 4096, 14336, "bfloat16", "compute capability (10, 0)"),
    (("gpu", (9, 0)), 4096, 14336, "float32", "set model.compute_dtype=bfloat16"),
    (("gpu", (9, 0)), 4096, 14336 // 8, "bfloat16", None),
    (("gpu", (9, 0)), 4096, 1000, "bfloat16", "multiples of 128 (got 4096 x 1000)"),
    (("gpu", (9, 0)), 96, 256, "float16", "multiples of 128 (got 96 x 256)"),
])
def test_where_the_hopper_kernels_run(device, k, n, dtype, message):
    why = problem(*device, k, n, dtype)
    assert why is None if message is None else message in why


@pytest.mark.skipif(not plugin_installed(), reason="jax's CUDA plugin is not installed (pip install -e '.[gpu-compile]')")
def test_an_expert_step_compiles_for_an_h100_with_the_hopper_kernels_and_saves_the_dense_copy():
    """moe-tiny (D 128, expert F 256, dropless) on ep=2, compiled by XLA GPU for two H100s on this
    CPU machine (tools.plan --compile-for-gpu; jax's kernels lowered by Mosaic GPU and assembled
    for sm_90a) under each expert_matmul. XLA's ragged_dot is a dense dot over zero-padded
    operands, the received rows copied once per local expert; the kernels need no such copy, so
    the peak drops by at least one: (E/ep)·R·D bf16 bytes, R = ep·n·min(k, E/ep) rows received,
    n = 2048 tokens per device (measured with jax 0.12: 287.4 MB against 228.6 MB)."""
    peaks = {}
    for impl in ("ragged_dot", "mosaic"):
        done = run_module("tools.plan", "--config", "moe-tiny", "--mesh", "ep=2", "--set", "model.d_model=128",
                          "--set", "model.expert_d_ff=256", "--set", "train.seq_len=512", "--set",
                          "train.global_batch_size=8", "--set", "model.moe_dispatch=dropless",
                          "--set", f"model.expert_matmul={impl}", "--compile-for-gpu", "--json",
                          *([] if cudnn_compiles() else ["--set", "model.attention=pallas"]))
        assert done.returncode == 0, done.stderr[-3000:]
        peaks[impl] = json.loads(done.stdout)["xla"]["memory"]["peak"]
    ep, experts, k, d, tokens = 2, 8, 2, 128, 8 * 512 // 2
    received = ep * tokens * min(k, experts // ep)
    assert peaks["ragged_dot"] - peaks["mosaic"] >= experts // ep * received * d * 2, peaks
