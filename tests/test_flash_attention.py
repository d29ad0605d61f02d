"""The Pallas flash attention kernel (interpret mode on CPU) against the xla reference core, and
its GPU path lowered to Triton on the CPU (`test_lowers_to_triton_with_each_kernels_tile`).

Grid (`test_matches_reference`): out, dq, dk, dv against xla on an all-pairs design over dtype
(fp32, bf16) x causal/full x (N, K) = (4, 4) and GQA (8, 2) x H = 64, 128 x L = 128, 384, 1000
x B = 1, 3: every value of each axis meets every value of every other axis at least once, and L
= 1000 (no multiple of the blocks: padded and masked) runs in both dtypes under both masks.
`grid()` picks the points greedily, cheapest first on ties: 8 points instead of the 96 of the
full product (a full product would take several minutes of the suite's 15 on a 2-core CPU;
the random shapes and padded-key cases below cover the rest). Tiles are the defaults
(`default_tiling`): forward and dq 128 x 64, dk/dv 128 x 128 at H = 64 and 64 x 128 at H = 128,
so L = 384 and 1000 take several q and kv blocks, bq != bk is covered, and L = 1000 ends in a
ragged block.

Tolerances, on max |pallas - xla| / max |xla| per output (max |xla| floored at 1e-3):
  fp32  1e-5   (observed up to 2e-6)
  bf16  2e-2   (observed up to 7e-3: both cores round inputs, p and outputs to bf16's 8 bits)
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import Phase, given, settings, strategies as st

from configs import ConfigError
from model.attention import xla_attention
from model.kernels.flash_attention import Tile, Tiling, flash_attention
from model.kernels.sharded import sharded_flash_attention
from sharding.mesh import build_mesh, parse_mesh

TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2}


def inputs(shape_q, kv_heads, dtype, seed=0):
    """q, k, v and a cotangent dO, normal(0, 1)."""
    b, length, n, h = shape_q
    keys = jax.random.split(jax.random.key(seed), 4)
    shapes = (shape_q, (b, length, kv_heads, h), (b, length, kv_heads, h), shape_q)
    return [jax.random.normal(key, s, jnp.float32).astype(dtype) for key, s in zip(keys, shapes)]


def out_and_grads(core, q, k, v, d_out):
    out, vjp = jax.vjp(core, q, k, v)
    return (out, *vjp(d_out))


def both(causal, tiling, q, k, v, d_out):
    """(pallas, xla) out, dq, dk, dv, in one jitted program (one compile per case)."""

    @jax.jit
    def run(q, k, v, d_out):
        pallas = lambda q, k, v: flash_attention(q, k, v, causal=causal, tiling=tiling)  # noqa: E731
        return (out_and_grads(pallas, q, k, v, d_out),
                out_and_grads(lambda q, k, v: xla_attention(q, k, v, causal), q, k, v, d_out))

    return run(q, k, v, d_out)


def assert_close(got, want, dtype):
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert np.isfinite(a).all(), name
        error = np.abs(a - b).max() / max(np.abs(b).max(), 1e-3)  # L = 1: dq, dk are exactly 0
        assert error < TOLERANCE[dtype], f"{name}: relative error {error:.2e}"


GRID = {"dtype": ("float32", "bfloat16"), "causal": (True, False), "heads": ((4, 4), (8, 2)),
        "h": (64, 128), "length": (128, 384, 1000), "batch": (1, 3)}


def covers(point: dict) -> set:
    """What a point tests: each pair of its axis values, and (dtype, mask) at the ragged L = 1000."""
    pairs = {((a, point[a]), (b, point[b])) for a, b in itertools.combinations(GRID, 2)}
    return pairs | ({("ragged", point["dtype"], point["causal"])} if point["length"] == 1000 else set())


def grid() -> list:
    """The all-pairs points (module docstring), each with a readable id."""
    candidates = [dict(zip(GRID, values)) for values in itertools.product(*GRID.values())]
    todo, points = set().union(*map(covers, candidates)), []
    cost = lambda p: p["length"] ** 2 * p["batch"] * p["h"] * p["heads"][0]  # noqa: E731
    while todo:
        best = max(candidates, key=lambda p: (len(covers(p) & todo), -cost(p)))
        todo -= covers(best)
        n, k = best["heads"]
        name = (f"{best['dtype']}-{'causal' if best['causal'] else 'full'}-N{n}K{k}-H{best['h']}"
                f"-L{best['length']}-B{best['batch']}")
        points.append(pytest.param(*best.values(), id=name))
    return points


@pytest.mark.parametrize("dtype, causal, heads, h, length, batch", grid())
def test_matches_reference(dtype, causal, heads, h, length, batch):
    (n, kv_heads), dt = heads, jnp.dtype(dtype)
    q, k, v, d_out = inputs((batch, length, n, h), kv_heads, dt)
    pallas, xla = both(causal, None, q, k, v, d_out)
    assert_close(pallas, xla, dtype)


@settings(max_examples=5, deadline=None, derandomize=True, phases=(Phase.generate,))  # each example compiles: no shrinking
@given(
    batch=st.integers(1, 2), length=st.integers(1, 80), kv_heads=st.integers(1, 2),
    groups=st.integers(1, 3), h=st.sampled_from([8, 16, 32]), causal=st.booleans(),
    blocks=st.sampled_from([(16, 16), (16, 32), (32, 16), (64, 64)]),
)
def test_random_small_shapes(batch, length, kv_heads, groups, h, causal, blocks):
    q, k, v, d_out = inputs((batch, length, kv_heads * groups, h), kv_heads, jnp.float32, seed=length)
    pallas, xla = both(causal, Tiling.uniform(*blocks), q, k, v, d_out)
    assert_close(pallas, xla, "float32")


# Padded keys, fp32 on every path (the bf16 points of the grid are too coarse to see them: a
# missing padding mask moves bf16 results by less than its tolerance at 3 of 4 ragged points).
# Each case is ragged in its own way, all with full and causal masks:
#   L=100, 32 x 32: the last kv block holds 28 padded keys;
#   L=70,  64 x 16: kv blocks 5..7 are wholly padding, block 4 partly; the last q block has 6 real rows;
#   L=40,  16 x 64 (bq < bk), GQA, B=2: one kv block, 24 of its 64 keys padding.
# Full attention is where the padding mask works; one causal case checks that the causal mask
# alone hides the padded keys (as the grid's fp32 L = 1000 causal points do at default blocks).
# The mixed cases give the three kernels different tiles (forward 64 x 16, dq 16 x 32, dk/dv
# 32 x 64): L = 70 pads to 128, a multiple of every block, and each kernel sweeps its own grid.
MIXED = Tiling(Tile(64, 16), Tile(16, 32), Tile(32, 64))
PADDED = [pytest.param(100, Tiling.uniform(32, 32), (2, 2), 1, False, id="L100-full"),
          pytest.param(70, Tiling.uniform(64, 16), (2, 1), 1, False, id="L70-full"),
          pytest.param(40, Tiling.uniform(16, 64), (4, 2), 2, False, id="L40-full-GQA"),
          pytest.param(70, Tiling.uniform(64, 16), (2, 1), 1, True, id="L70-causal"),
          pytest.param(70, MIXED, (4, 2), 1, False, id="L70-full-GQA-mixed"),
          pytest.param(70, MIXED, (4, 2), 1, True, id="L70-causal-GQA-mixed")]


@pytest.mark.parametrize("length, tiling, heads, batch, causal", PADDED)
def test_padded_keys_fp32(length, tiling, heads, batch, causal):
    """out, dq, dk, dv at a length that is no multiple of the blocks, against xla in fp32 (1e-5):
    the forward and dq sweeps' padding mask, and the dk/dv sweep's reliance on dO = 0 rows."""
    (n, kv_heads), h = heads, 16
    q, k, v, d_out = inputs((batch, length, n, h), kv_heads, jnp.float32, seed=length)
    pallas, xla = both(causal, tiling, q, k, v, d_out)
    assert_close(pallas, xla, "float32")


def visited_tiles(monkeypatch, fn, *args) -> dict:
    """{(q_start, k_start): times} of the [bq, bk] tiles whose scores the kernels computed while
    running fn(*args): every kernel sweep step computes its tile's scores once (`_scores`), so
    this counts the tiles each kernel actually visits at run time, skipped ones absent."""
    from collections import Counter

    from model.kernels import flash_kernels

    seen, scores = Counter(), flash_kernels._scores

    def counting(plan, q, k, q_start, k_start, masked, **layout):
        jax.debug.callback(lambda i, j: seen.update([(int(i), int(j))]), q_start, k_start)
        return scores(plan, q, k, q_start, k_start, masked, **layout)

    monkeypatch.setattr(flash_kernels, "_scores", counting)
    jax.block_until_ready(fn(*args))
    jax.effects_barrier()
    return dict(seen)


@pytest.mark.parametrize("blocks", [(16, 16), (32, 16), (16, 32)])
def test_causal_skips_blocks_above_the_diagonal(monkeypatch, blocks):
    """README: causal blocks above the diagonal are skipped, about half the FLOPs. At L = 128
    (one head, B = 1) the forward visits each tile holding a visible key exactly once, and the
    forward + backward (dq and dk/dv sweeps) exactly three times; no other tile is visited.
    With 16 x 16 blocks that is 36 of 64 tiles (n(n+1)/2 of n^2), with full attention all 64."""
    (bq, bk), length = blocks, 128
    q, k, v, _ = inputs((1, length, 1, 16), 1, jnp.float32)
    tiles = [(i, j) for i in range(0, length, bq) for j in range(0, length, bk)]
    needed = [(i, j) for i, j in tiles if j <= i + bq - 1]  # the tile's first key <= its last row

    def grad(causal):
        return jax.jit(jax.grad(lambda q, k, v: flash_attention(
            q, k, v, causal=causal, tiling=Tiling.uniform(bq, bk)).sum(), argnums=(0, 1, 2)))

    forward = jax.jit(lambda q, k, v: flash_attention(q, k, v, causal=True, tiling=Tiling.uniform(bq, bk)))
    assert visited_tiles(monkeypatch, forward, q, k, v) == dict.fromkeys(needed, 1)
    assert visited_tiles(monkeypatch, grad(True), q, k, v) == dict.fromkeys(needed, 3)
    assert visited_tiles(monkeypatch, grad(False), q, k, v) == dict.fromkeys(tiles, 3)
    assert len(needed) / len(tiles) <= 0.5 + max(bq, bk) / length  # about half: the diagonal's excess


def mesh_of(spec: str):
    """The mesh `spec` on the first devices it needs (conftest gives 8)."""
    parallel = parse_mesh(spec)
    size = parallel.stage * parallel.data * parallel.fsdp * parallel.expert * parallel.sequence * parallel.tensor
    return build_mesh(parallel, jax.devices()[:size])


def array_shapes(hlo: str) -> list[tuple[int, ...]]:
    """Every tensor<AxBx..xT> type in StableHLO text, as a shape."""
    import re

    return [tuple(int(d) for d in m.split("x")[:-1]) for m in re.findall(r"tensor<([0-9x]+x?[a-z0-9]+)>", hlo)]


def test_no_length_squared_intermediate():
    """Lowered HLO (the interpreted kernels are inlined as loops) of the forward and of the
    gradient at L = 1000: no array has L*L elements or more, nor two dimensions >= L; the
    xla core's does (the detector works), and the kernel's [bq, bk] score tile is there."""
    length, (bq, bk) = 1000, (128, 64)
    q, k, v, _ = inputs((1, length, 2, 64), 2, jnp.float32)
    pallas = lambda q, k, v: flash_attention(q, k, v, tiling=Tiling.uniform(bq, bk))  # noqa: E731

    def grad(core):
        return jax.grad(lambda q, k, v: core(q, k, v).sum(), argnums=(0, 1, 2))

    for fn in (pallas, grad(pallas)):
        shapes = array_shapes(jax.jit(fn).lower(q, k, v).as_text())
        assert (bq, bk) in shapes
        assert max(np.prod(s) for s in shapes) < length * length
        assert not [s for s in shapes if sum(d >= length for d in s) >= 2]
    reference = array_shapes(jax.jit(xla_attention).lower(q, k, v).as_text())
    assert max(np.prod(s) for s in reference) >= length * length


def cuda_text(fn, *args) -> str:
    """fn(*args) lowered for CUDA on this CPU machine, as it lowers on one H100 (StableHLO text).
    Only lowering (jax -> Triton IR, or Mosaic GPU's): compiling that to PTX needs the GPU."""
    from sharding.cores import building_for

    h100 = jax.sharding.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="gpu")
    with (building_for("gpu", (9, 0)),
          jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",), abstract_device=h100))):
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def triton_launches(text: str) -> dict[str, dict]:
    """{kernel name: its Triton launch (grid, warps, stages, and whether its IR calls libdevice's
    expf / exp2f)} in `cuda_text`'s lowering."""
    import re

    launches = {}
    for call in re.findall(r"custom_call @__gpu\$xla\.gpu\.triton.*", text):
        number = {key: int(re.search(rf"{key} = (\d+)", call).group(1))
                  for key in ("grid_x", "grid_y", "grid_z", "num_warps", "num_stages")}
        ir = re.search(r'ir = "(.*?)", name', call).group(1)
        launches[re.search(r'name = "(\w+)"', call).group(1)] = {
            "grid": (number["grid_x"], number["grid_y"], number["grid_z"]), "warps": number["num_warps"],
            "stages": number["num_stages"], "expf": "__nv_expf" in ir, "exp2f": "__nv_exp2f" in ir}
    return launches


@pytest.mark.parametrize("causal", [True, False])
def test_lowers_to_triton_with_each_kernels_tile(causal):
    """The GPU path without a GPU: value and gradient lower to three Triton kernels (forward, dq,
    dk/dv), each launched with its own tile's grid, warps and stages: grid (B, heads, L / block)
    with the q heads for forward and dq and the kv heads for dk/dv. Every exponential is exp2
    (libdevice's exp2f, never its range-reduced expf: flash_kernels.py's docstring)."""
    b, length, n, kv_heads, h = 2, 512, 4, 2, 128
    q, k, v, _ = inputs((b, length, n, h), kv_heads, jnp.bfloat16)
    tiling = Tiling(forward=Tile(128, 64, 8, 3), dq=Tile(64, 32, 4, 2), dkv=Tile(32, 128, 8, 4))
    loss = lambda q, k, v: flash_attention(q, k, v, causal=causal, tiling=tiling).astype(jnp.float32).sum()  # noqa: E731
    launches = triton_launches(cuda_text(jax.grad(loss, argnums=(0, 1, 2)), q, k, v))
    assert launches == {
        "forward_kernel": {"grid": (b, n, length // 128), "warps": 8, "stages": 3, "expf": False, "exp2f": True},
        "dq_kernel": {"grid": (b, n, length // 64), "warps": 4, "stages": 2, "expf": False, "exp2f": True},
        "dkv_kernel": {"grid": (b, kv_heads, length // 128), "warps": 8, "stages": 4, "expf": False, "exp2f": True},
    }


def test_bad_block_size_says_power_of_two():
    q, k, v, _ = inputs((1, 64, 2, 16), 2, jnp.float32)
    with pytest.raises(ConfigError, match="the dq tile's block_k=48 must be a power of two"):
        flash_attention(q, k, v, tiling=Tiling(Tile(64, 64), Tile(64, 48), Tile(64, 64)))


@pytest.mark.parametrize("mesh", ["dp=2,tp=2", "fsdp=2,tp=4", "tp=8"])
def test_sharded_core_matches_reference(mesh):
    """Per-device kernels under shard_map: kv heads split (tp=2), replicated and sliced (tp 4, 8)."""
    mesh = mesh_of(mesh)
    q, k, v, d_out = inputs((2, 64, 8, 16), 2, jnp.float32)
    with jax.set_mesh(mesh):
        got = jax.jit(out_and_grads, static_argnums=0)(sharded_flash_attention, q, k, v, d_out)
    want = jax.jit(out_and_grads, static_argnums=0)(xla_attention, q, k, v, d_out)
    assert_close(got, want, "float32")


def test_sharded_core_refuses_kv_heads_it_cannot_slice():
    mesh = mesh_of("dp=4,tp=2")
    q, k, v, _ = inputs((4, 16, 12, 16), 3, jnp.float32)  # 6 q heads per device span 2 of 3 kv heads
    with jax.set_mesh(mesh), pytest.raises(ConfigError, match="n_kv_heads=3"):
        jax.jit(sharded_flash_attention)(q, k, v)


@pytest.mark.parametrize("tp_flags", [[], ["parallel.sequence_parallel=true"], ["parallel.tp_impl=gspmd"]],
                         ids=["shard_map", "shard_map-sp", "gspmd"])
def test_model_step_with_pallas_equals_xla(tp_flags, corpus):
    """One training step's loss and gradients on dp=2,tp=2: attention=pallas vs attention=xla,
    for each way of running the tensor-parallel regions."""
    import functools

    from conftest import small_config, start
    from training.step import loss_and_grads

    results = []
    for core in ("xla", "pallas"):
        cfg = small_config("dp=2,tp=2", f"model.attention={core}", *tp_flags)
        mesh = mesh_of("dp=2,tp=2")
        job = start(cfg, mesh, corpus)
        with jax.set_mesh(mesh):
            grad_fn = jax.jit(functools.partial(loss_and_grads, graphdef=job.graphdef, cfg=cfg,
                                                schedule=job.strategies.schedule))
            results.append(jax.device_get(grad_fn(job.state.params, batch=job.batches(0))))
    (loss_xla, grads_xla, _), (loss_pallas, grads_pallas, _) = results
    np.testing.assert_allclose(loss_pallas, loss_xla, rtol=1e-6)
    flat = jax.tree_util.tree_leaves_with_path(grads_xla)
    for (path, want), got in zip(flat, jax.tree.leaves(grads_pallas)):
        np.testing.assert_allclose(got, want, atol=1e-7, rtol=1e-4, err_msg=jax.tree_util.keystr(path))


def test_a_jitted_kernel_call_traces_once_in_a_fresh_process():
    """A fresh process (the setting registers once per process, so this session's imports could
    hide it): a jitted function over the kernel, called twice, is traced once. On jax >= 0.11 the
    interpreter's first trace imported a module that registers a trace-context setting, and the
    second call traced and compiled again (model/kernels/__init__.py imports it up front)."""
    import subprocess
    import sys

    from conftest import ROOT, child_env

    script = (
        "import jax, jax.numpy as jnp\n"
        "from model.kernels.flash_attention import flash_attention\n"
        "traces = []\n"
        "@jax.jit\n"
        "def f(q):\n"
        "    traces.append(1)\n"
        "    return flash_attention(q, q, q, causal=True)\n"
        "q = jnp.ones((1, 16, 2, 8), jnp.float32)\n"
        "f(q).block_until_ready(); f(q).block_until_ready()\n"
        "print(len(traces))\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=child_env(),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["1"]
