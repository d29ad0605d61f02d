"""The experts' grouped matmul: rows sorted by expert times each expert's weight, with a gradient.

Layout: x [R, K] (rows sorted by expert, `sizes` [G] rows per expert, padding rows after the
last group), w [G, K, N] -> y [R, N], y[r] = x[r] @ w[g(r)]; padding rows give 0. Its gradient
is three more grouped matmuls: dx = dy @ w[g]^T (ragged, the weight transposed) and
dw[g] = x_g^T @ dy_g (ragged along the contracting rows).

Two implementations (`model.expert_matmul`):
  ragged_dot  `jax.lax.ragged_dot` and its autodiff, what XLA makes of it. XLA:CPU and, unless
              cuDNN's ragged-dot fusion takes it (a newer XLA with cuDNN >= 9.22, forward and
              dx only), XLA:GPU too rewrite it into a dense batched dot of zero-padded
              operands: x copied once per group, [G, R, K], and G times the FLOPs. Compiled for
              an H100 (jax 0.12.0.1 deviceless, tools/gpu_target.py) a [16384, 4096] x
              [8, 4096, 14336] bf16 ragged_dot needs 1.07 GB of temporaries, that [8, 16384,
              4096] copy; tests/test_gpu_compile.py holds it.
  mosaic      jax's own Hopper kernels (jax.experimental.pallas.ops.gpu: `ragged_dot_mgpu`,
              TMA + wgmma, one output tile per (row block, column block) and a row block that
              straddles two groups visited once per group; `transposed_ragged_dot_mgpu` for
              dw), joined here by a `jax.custom_vjp`, which jax does not ship. No temporaries
              beyond the outputs; FLOPs proportional to R, padding rows included: the kernel
              sweeps every row block, and those past the last group compute a tile it never
              stores. Hopper only (sm_90a), 16-bit x and w, K and N multiples of the tile
              (`problem`). Never interpreted on CPU: there the tests check the gradient's
              algebra with XLA's ragged dots in the kernels' places (`with_gradient`).

The kernels leave the rows past the last group unwritten; `mosaic` zeroes them (a select on the
output, elementwise), so padding rows are 0 as under ragged_dot and no garbage reaches the
masks inside the dw kernel (which multiply neighbouring rows by 0, and NaN·0 is NaN).

Why by hand: jax ships the Hopper kernels but no gradient rule tying them together, and XLA's
GPU lowering of ragged_dot is dense on the cuDNN of the GPUs lent here (9.19). The tile
(`TILE`) is the kernels' own examples' middle choice, not yet timed: `make gpu-check`'s moe stage
times both implementations on a GPU (bench/moe_ffn.py). Compiled for an H100 (jax 0.12.0.1,
ptxas's log as tools/gpu_compile.py reads it, mixtral's D 4096 and F 14336) the gradient's
kernels assemble for sm_90a without spilling at TILE (155 registers a thread forward and dx,
181 dw) and at the moe stage's other tiles (64 rows: 90 and 103; 2 or 6 slots, 4 columns a
visit: as TILE).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from configs.base import ConfigError
from sharding.cores import target
from sharding.rules import varying_as

IMPLS = ("ragged_dot", "mosaic")
MOSAIC_DTYPES = ("bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class Tile:
    """The Hopper kernels' tiling: an output tile [block_m, block_n], K stepped by block_k through
    max_concurrent_steps shared-memory slots, tiles visited grid_block_n columns at a time."""

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    max_concurrent_steps: int = 4
    grid_block_n: int = 1

    def text(self) -> str:
        return f"{self.block_m}x{self.block_n}x{self.block_k} s{self.max_concurrent_steps} g{self.grid_block_n}"


TILE = Tile()


def problem(platform: str, capability: tuple[int, int] | None, k: int, n: int, dtype: str) -> str | None:
    """Why `mosaic` cannot multiply x [R, k] by w [G, k, n] in `dtype` on this device (None if it
    can; `sharding.cores.target` gives platform and capability): wgmma is Hopper's (sm_90a, not
    Blackwell's), the forward (contracting k) and dx (contracting n) step over block_k, and dw's
    output tiles [block_m, block_n] cover [k, n]."""
    if platform != "gpu" or capability != (9, 0):
        where = f"this GPU has compute capability {capability}" if platform == "gpu" else f"this backend is {platform}"
        return f"jax's Mosaic GPU ragged dot kernels need an NVIDIA Hopper GPU, 9.0 ({where}); use ragged_dot"
    if dtype not in MOSAIC_DTYPES:
        return f"takes {'/'.join(MOSAIC_DTYPES)} (compute dtype {dtype}); set model.compute_dtype=bfloat16"
    step = max(TILE.block_m, TILE.block_n, TILE.block_k)
    if k % step or n % step:
        return f"needs both dims of each expert weight per device multiples of {step} (got {k} x {n}); use ragged_dot"
    return None


def grouped_matmul(x: jax.Array, w: jax.Array, sizes: jax.Array, impl: str) -> jax.Array:
    """x [R, K] @ w[g] for the rows of each group g (`sizes` [G] int32, in order) -> [R, N]."""
    if impl == "ragged_dot":
        return jax.lax.ragged_dot(x, w, sizes)
    if why := problem(*target(), w.shape[1], w.shape[2], str(x.dtype)):
        raise ConfigError(f"--set model.expert_matmul=mosaic: {why}")
    return hopper()(x, w.astype(x.dtype), sizes.astype(jnp.int32))


def with_gradient(forward: Callable, backward_x: Callable, backward_w: Callable) -> Callable:
    """A grouped matmul f(x, w, sizes) from three kernels of the shapes of jax's Hopper ones:
    forward(x [R, K], w [G, K, N], sizes) -> [R, N]; backward_x(dy [R, N], w [G, K, N], sizes)
    -> [R, K] (w read transposed); backward_w(x [R, K], dy [R, N], sizes) -> [G, K, N], reading
    only the rows of the groups. Rows past sum(sizes) are zeroed in y and dx."""

    def rows_only(y: jax.Array, sizes: jax.Array, *like: jax.Array) -> jax.Array:
        kept = jnp.arange(y.shape[0]) < jnp.sum(sizes)
        return jnp.where(kept[:, None], varying_as(y, *like), jnp.zeros((), y.dtype))

    @jax.custom_vjp
    def f(x, w, sizes):
        return rows_only(forward(x, w, sizes), sizes, x, w)

    def f_fwd(x, w, sizes):
        return f(x, w, sizes), (x, w, sizes)

    def f_bwd(res, dy):
        x, w, sizes = res
        dx = rows_only(backward_x(dy, w, sizes), sizes, x)
        return dx, varying_as(backward_w(x, dy, sizes).astype(w.dtype), w), None

    f.defvjp(f_fwd, f_bwd)
    return f


@functools.cache
def hopper(tile: Tile = TILE) -> Callable:
    """The grouped matmul f(x, w, sizes) of jax's Hopper kernels at `tile`, with its gradient
    (imported on first use: they load Mosaic GPU)."""
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu, transposed_ragged_dot_mgpu

    kw = dataclasses.asdict(tile)

    def forward(x, w, sizes):
        return ragged_dot_mgpu.ragged_dot(x, w, group_sizes=sizes, **kw)

    def backward_x(dy, w, sizes):
        return ragged_dot_mgpu.ragged_dot(dy, w, group_sizes=sizes, transpose_rhs=True, **kw)

    def backward_w(x, dy, sizes):
        return transposed_ragged_dot_mgpu.transposed_ragged_dot(x, dy, group_sizes=sizes, **kw)

    return with_gradient(forward, backward_x, backward_w)


