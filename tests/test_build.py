"""Batch layout (microbatches per step) and its errors; the abstract program allocates nothing;
every mesh initialises the state one device does."""

import jax
import numpy as np
import pytest

from configs import ConfigError
from conftest import one_device_init, pipeline_devices, small_config
from sharding.mesh import build_mesh, parse_mesh
from training.build import make_program, batch_layout


@pytest.mark.parametrize(
    "mesh, sets, layout",
    [
        ("", [], (1, 16)),
        ("", ["train.micro_batch_size=4"], (4, 4)),
        ("dp=2,fsdp=2,tp=2", [], (1, 16)),  # 4 data-parallel ranks x 4 sequences
        ("dp=2,fsdp=2,tp=2", ["train.micro_batch_size=2"], (2, 8)),
        ("dp=2,tp=2,sp=2", ["train.micro_batch_size=1"], (8, 2)),
    ],
)
def test_batch_layout(mesh, sets, layout):
    cfg = small_config(mesh, *sets)
    devices = jax.devices()[:1] if not mesh else None
    assert batch_layout(cfg, build_mesh(cfg.parallel, devices)) == layout


@pytest.mark.parametrize(
    "mesh, sets, message",
    [
        ("dp=8", ["train.global_batch_size=12"], "train.global_batch_size=12 is not divisible by dp*fsdp*ep=8"),
        ("dp=2,fsdp=2,tp=2", ["train.micro_batch_size=3"], "train.micro_batch_size=3 does not divide"),
        ("fsdp=4,sp=2", ["train.seq_len=33"], "train.seq_len=33 is not divisible by sp=2"),
    ],
)
def test_batch_layout_errors(mesh, sets, message):
    cfg = small_config(mesh, *sets)
    with pytest.raises(ConfigError) as err:
        make_program(cfg, build_mesh(cfg.parallel))
    assert message in str(err.value)


def test_abstract_program_of_llama3_8b_allocates_nothing():
    """The 8B model on dp=2,fsdp=4 is only shapes: 32 GB of fp32 parameters never exist."""
    from configs import get_preset
    from model.transformer import count_params

    cfg = get_preset("llama3-8b")
    program = make_program(cfg, build_mesh(parse_mesh("dp=2,fsdp=4")))
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(program.state))
    assert count_params(program.state.params) == 8_030_261_248
    wq = program.shardings.params["blocks"]["attn"]["wq"]
    assert wq.spec == jax.sharding.PartitionSpec(None, "fsdp", None, None)
    assert program.batch_shape == (32, 8, 8192)  # the preset's micro_batch_size=1: one sequence per device per microbatch


MOE = ("model.n_experts=8", "model.experts_per_token=2", "model.expert_d_ff=64")


@pytest.mark.parametrize("mesh, sets", [
    ("dp=2,fsdp=2,tp=2", ("parallel.sequence_parallel=true",)),
    ("fsdp=2,sp=2,tp=2", ()),
    ("pp=2,fsdp=2,tp=2", ("parallel.schedule=interleaved", "parallel.virtual_stages=2", "model.n_layers=4")),
    ("fsdp=2,ep=2,tp=2", MOE),
    ("dp=2,tp=2", ("parallel.tp_impl=gspmd",)),
], ids=["dp-fsdp-tp-sp", "context", "pipeline", "experts", "gspmd"])
def test_every_mesh_initialises_the_state_one_device_does(mesh, sets):
    """A mesh's own init_fn (out_shardings: each device computes its shard of every random
    draw) gives bit for bit the state of one device (conftest.one_device_init), which the
    training tests start from instead of compiling each mesh's init."""
    cfg = small_config(mesh, *sets)
    mesh = build_mesh(cfg.parallel, pipeline_devices(cfg))
    program = make_program(cfg, mesh)
    with jax.set_mesh(mesh):
        own = jax.device_get(program.init_fn())
    one = jax.device_get(one_device_init(cfg, program))
    leaves = jax.tree_util.tree_leaves_with_path(one)
    assert len(leaves) == len(jax.tree.leaves(own)) > 10
    for (path, want), got in zip(leaves, jax.tree.leaves(own)):
        np.testing.assert_array_equal(got, want, err_msg=jax.tree_util.keystr(path))
