"""Explicit tensor parallelism (sharding/tensor_parallel.py): equal to one device, and bad input.

Equality uses conftest.assert_same_run (fp32 compute; tolerances stated there): the loss and
every gradient of step 0 and the losses of 5 steps equal the single-device run.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs.base import ConfigError
from conftest import assert_same_run, run_steps, small_config
from sharding.mesh import build_mesh
from sharding.tensor_parallel import AXIS, Sharded
from training.build import make_program

SP = "parallel.sequence_parallel=true"
OVERLAP = "parallel.tp_overlap=true"


def _devices(cfg) -> int:
    p = cfg.parallel
    return max(p.data, 1) * p.fsdp * p.expert * p.sequence * p.tensor


@pytest.mark.parametrize(
    "mesh, flags",
    [
        ("tp=8", []),
        ("tp=4", [SP]),
        ("dp=2,tp=4", [SP, OVERLAP]),
        ("fsdp=2,tp=4", []),
        ("fsdp=2,tp=4", [SP]),
        ("dp=2,tp=4", ["parallel.tp_impl=gspmd", SP]),
        ("dp=2,tp=4", [SP, "model.remat=attn"]),
        ("fsdp=2,tp=4", ["model.remat=full", "model.scan_layers=false"]),
        ("dp=2,fsdp=2,tp=2", ["model.remat=full"]),
        ("dp=2,tp=4", ["model.remat=dots"]),
    ],
    ids=["tp8", "tp4-sp", "dp2-tp4-overlap", "fsdp2-tp4", "fsdp2-tp4-sp", "dp2-tp4-gspmd-sp", "dp2-tp4-sp-remat",
         "fsdp2-tp4-unrolled-full", "dp2-fsdp2-tp2-full", "dp2-tp4-dots"],
)
def test_tensor_parallel_equals_single_device(mesh, flags, reference, corpus):
    cfg = small_config(mesh, *flags)
    assert_same_run(run_steps(cfg, corpus, jax.devices()[: _devices(cfg)]), reference)


@pytest.mark.parametrize("scan", [False, True])
def test_remat_full_gathers_fsdp_weights_no_more_than_none(scan):
    """fsdp=2,tp=2: under remat full the regions' weights are gathered inside the layer's
    checkpoint (TensorParallel.gather_in_checkpoint), so the recompute and the backward share
    one gather, and the step's fsdp all-gathers move no more than under remat none (at the
    shard_map's edge they moved 1.93x unrolled and 1.33x scanned: the recompute gathered
    again)."""
    import dataclasses

    from sharding.mesh import mesh_config
    from tools.hlo import step_census

    gathered = {}
    for remat in ("none", "full"):
        cfg = small_config("fsdp=2,tp=2", f"model.remat={remat}", f"model.scan_layers={str(scan).lower()}",
                           "train.micro_batch_size=4", "train.global_batch_size=16")
        mesh = build_mesh(cfg.parallel, jax.devices()[:4])
        ops = step_census(dataclasses.replace(cfg, parallel=mesh_config(mesh, cfg.parallel)), mesh)
        gathered[remat] = sum(c.bytes_per_step for c in ops if c.axes == ("fsdp",) and c.kind == "all-gather")
    assert 0 < gathered["full"] <= gathered["none"], gathered


@pytest.mark.parametrize("sequence_parallel", [False, True])
@pytest.mark.parametrize("tp", [2, 4])
def test_column_then_row_equals_the_dense_matmuls(tp, sequence_parallel):
    """The region primitives alone: x @ w1 (column) @ w2 (row), summed over tensor, equals the
    unsharded product; with overlap the rings give the same numbers as all-gather/reduce-scatter."""
    from jax.sharding import AxisType, PartitionSpec as P

    mesh = jax.make_mesh((tp,), (AXIS,), axis_types=(AxisType.Auto,), devices=jax.devices()[:tp])
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 8, 16)).astype(np.float32)  # [B, L, D]
    w1 = rng.normal(size=(16, 12)).astype(np.float32)  # [D, F]
    w2 = rng.normal(size=(12, 16)).astype(np.float32)  # [F, D]
    want = np.einsum("blf,fd->bld", np.einsum("bld,df->blf", x, w1), w2)
    x_spec = P(None, AXIS) if sequence_parallel else P()
    for overlap in [False, True] if sequence_parallel else [False]:
        ops = Sharded(tp, sequence_parallel, overlap)

        def local(x, w1, w2):
            (h,) = ops.column(x, lambda x: (jnp.einsum("bld,df->blf", x, w1),))
            return ops.row(h, lambda h: jnp.einsum("blf,fd->bld", h, w2))

        fn = jax.shard_map(local, mesh=mesh, in_specs=(x_spec, P(None, AXIS), P(AXIS)), out_specs=x_spec)
        np.testing.assert_allclose(jax.jit(fn)(x, w1, w2), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "mesh, overrides, message",
    [
        ("dp=8", [SP], "parallel.sequence_parallel=true needs a tensor axis: add tp=2 or more"),
        ("tp=4", [OVERLAP, SP, "train.seq_len=30"], "train.seq_len=30 is not divisible by tp=4"),
        ("tp=4", [OVERLAP], "add --set parallel.sequence_parallel=true"),
        ("tp=4", [OVERLAP, SP, "parallel.tp_impl=gspmd"], "set parallel.tp_impl=shard_map"),
        ("sp=2,tp=4", [SP, "parallel.context_impl=gspmd"], "use parallel.context_impl=ring or allgather"),
        ("sp=2,tp=4", [SP, "train.seq_len=36"], "use a multiple of 16"),
        ("tp=4", ["model.n_heads=6", "model.n_kv_heads=2"], "model.n_heads=6 is not divisible by tp=4"),
        ("tp=2", ["model.n_heads=6", "model.n_kv_heads=3", "model.d_ff=128"], "model.n_kv_heads=3 and tp=2"),
        ("tp=2", ["parallel.tp_impl=megatron"], "choose one of shard_map, gspmd"),
    ],
)
def test_bad_tensor_parallel_settings_are_clear_errors(mesh, overrides, message):
    cfg = small_config(mesh, *overrides)
    with pytest.raises(ConfigError) as err:
        make_program(cfg, build_mesh(cfg.parallel, jax.devices()[: _devices(cfg)]))
    assert message in str(err.value)
