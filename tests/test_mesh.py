"""sharding/mesh.py: parse, resolve, format, hybrid split (pure) and build_mesh (8 fake CPUs)."""

from __future__ import annotations

import math

import pytest

from configs.base import ConfigError, ParallelConfig
from sharding.mesh import (
    AXES,
    build_mesh,
    format_mesh,
    mesh_config,
    parse_mesh,
    requested_devices,
    resolve_shape,
    split_hybrid,
)


def sizes_of(cfg: ParallelConfig) -> tuple[int, ...]:
    return tuple(getattr(cfg, a) for a in AXES)


# ---------------------------------------------------------------- parse_mesh


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("dp=8,tp=8", (1, 8, 1, 1, 1, 8)),
        ("data=2,tensor=4", (1, 2, 1, 1, 1, 4)),
        ("pp=2,fsdp=2,sp=2", (2, 1, 2, 1, 2, 1)),
        ("stage=2,data=3,fsdp=5,expert=13,sequence=7,tensor=11", (2, 3, 5, 13, 7, 11)),
        ("dp=2,ep=4", (1, 2, 1, 4, 1, 1)),
        ("tp=2, dp=4", (1, 4, 1, 1, 1, 2)),  # spaces and any order
        ("dp=-1,tp=2", (1, -1, 1, 1, 1, 2)),
        ("", (1, 1, 1, 1, 1, 1)),
    ],
)
def test_parse_mesh(spec, expected):
    cfg = parse_mesh(spec)
    assert isinstance(cfg, ParallelConfig)
    assert sizes_of(cfg) == expected


def test_parse_mesh_missing_axes_are_one():
    cfg = parse_mesh("tp=4")
    assert cfg == ParallelConfig(data=1, tensor=4)
    assert (cfg.stage, cfg.data, cfg.fsdp, cfg.sequence) == (1, 1, 1, 1)


def test_parse_mesh_keeps_the_tensor_parallel_flags():
    base = ParallelConfig(fsdp=4, sequence_parallel=True, tp_overlap=True)
    assert parse_mesh("tp=8", base) == ParallelConfig(data=1, tensor=8, sequence_parallel=True, tp_overlap=True)


def test_default_mesh_is_data_parallel_over_every_device():
    assert resolve_shape(ParallelConfig(), 8) == {"stage": 1, "data": 8, "fsdp": 1, "expert": 1, "sequence": 1, "tensor": 1}
    assert resolve_shape(ParallelConfig(), 1)["data"] == 1


@pytest.mark.parametrize("spec", ["xp=2", "dp=2,model=4", "tensors=2", "dp2", "dp:2"])
def test_parse_mesh_unknown_axis(spec):
    with pytest.raises(ConfigError) as err:
        parse_mesh(spec)
    assert "axes are" in str(err.value)


def test_parse_mesh_two_fills():
    with pytest.raises(ConfigError) as err:
        parse_mesh("dp=-1,tp=-1")
    assert "-1" in str(err.value)


@pytest.mark.parametrize("spec", ["dp=0", "tp=0,dp=2", "dp=-2", "dp=abc", "dp=2.5", "dp="])
def test_parse_mesh_bad_size(spec):
    with pytest.raises(ConfigError) as err:
        parse_mesh(spec)
    assert "size of" in str(err.value)


@pytest.mark.parametrize("spec", ["dp=2,dp=2", "dp=2,data=4", "tp=2,tensor=2", "pp=1,stage=1"])
def test_parse_mesh_axis_twice(spec):
    with pytest.raises(ConfigError) as err:
        parse_mesh(spec)
    assert "twice" in str(err.value)


# ---------------------------------------------------------------- resolve / requested / format


def test_resolve_shape_exact():
    shape = resolve_shape(parse_mesh("dp=2,fsdp=2,tp=2"), 8)
    assert list(shape) == list(AXES)
    assert shape == {"stage": 1, "data": 2, "fsdp": 2, "expert": 1, "sequence": 1, "tensor": 2}


@pytest.mark.parametrize(
    "spec, n, axis, value",
    [
        ("dp=-1,tp=2", 8, "data", 4),
        ("dp=-1", 64, "data", 64),
        ("tp=-1,dp=2", 8, "tensor", 4),
        ("pp=2,fsdp=-1,tp=4", 64, "fsdp", 8),
        ("tp=8,dp=-1", 8, "data", 1),
    ],
)
def test_resolve_shape_fills(spec, n, axis, value):
    shape = resolve_shape(parse_mesh(spec), n)
    assert shape[axis] == value
    assert math.prod(shape.values()) == n


def test_resolve_shape_mismatch_names_counts():
    with pytest.raises(ConfigError) as err:
        resolve_shape(parse_mesh("dp=8,tp=8"), 8)
    msg = str(err.value)
    assert "64" in msg  # needed
    assert "8 are available" in msg or "8 devices" in msg
    assert "dp=8,tp=8" in msg


def test_resolve_shape_mismatch_suggests_data():
    with pytest.raises(ConfigError) as err:
        resolve_shape(parse_mesh("dp=4,tp=2"), 16)
    msg = str(err.value)
    assert "needs 8 devices" in msg and "16" in msg
    assert "dp=8,tp=2" in msg  # the suggestion keeps tp and grows dp


def test_resolve_shape_fill_does_not_divide():
    with pytest.raises(ConfigError) as err:
        resolve_shape(parse_mesh("dp=-1,tp=3"), 8)
    msg = str(err.value)
    assert "3" in msg and "8" in msg


def test_resolve_shape_fill_on_one_device_offers_a_full_mesh():
    """One device (a laptop's CPU): no fixed product divides it but 1, so the fix that works is a
    size for the -1 axis too, which makes request_fake_devices make that many fake devices."""
    with pytest.raises(ConfigError, match=r"divisor of 1, or give tp a size too \(e.g. --mesh dp=2,tp=2: on CPU"):
        resolve_shape(parse_mesh("dp=2,tp=-1"), 1)


@pytest.mark.parametrize(
    "spec, n",
    [("dp=8,tp=8", 64), ("data=2,tensor=4", 8), ("pp=2,fsdp=2,sp=2", 8), ("", 1), ("dp=-1,tp=2", None)],
)
def test_requested_devices(spec, n):
    assert requested_devices(parse_mesh(spec)) == n


@pytest.mark.parametrize(
    "shape, text",
    [
        ({"stage": 1, "data": 8, "fsdp": 1, "expert": 1, "sequence": 1, "tensor": 8}, "dp=8,tp=8"),
        ({"stage": 2, "data": 1, "fsdp": 2, "expert": 1, "sequence": 2, "tensor": 1}, "pp=2,fsdp=2,sp=2"),
        ({"stage": 1, "data": 1, "fsdp": 1, "expert": 1, "sequence": 1, "tensor": 1}, "single device"),
        ({"stage": 1, "data": -1, "fsdp": 1, "expert": 1, "sequence": 1, "tensor": 2}, "dp=-1,tp=2"),
    ],
)
def test_format_mesh(shape, text):
    assert format_mesh(shape) == text


@pytest.mark.parametrize("spec", ["dp=8,tp=8", "pp=2,fsdp=2,sp=2", "pp=2,dp=3,fsdp=5,sp=7,tp=11"])
def test_format_parse_round_trip(spec):
    cfg = parse_mesh(spec)
    assert parse_mesh(format_mesh(resolve_shape(cfg, requested_devices(cfg)))) == cfg


# ---------------------------------------------------------------- split_hybrid


def _shape(spec: str) -> dict[str, int]:
    cfg = parse_mesh(spec)
    return resolve_shape(cfg, requested_devices(cfg))


def test_split_hybrid_data_tensor():
    ici, dcn = split_hybrid(_shape("data=2,tensor=4"), 4)
    assert ici == [1, 1, 1, 1, 1, 4]
    assert dcn == [1, 2, 1, 1, 1, 1]


def test_split_hybrid_data_fsdp_tensor():
    sizes = _shape("data=4,fsdp=2,tensor=2")
    ici, dcn = split_hybrid(sizes, 8)
    assert math.prod(ici) == 8
    assert [i * d for i, d in zip(ici, dcn)] == list(sizes.values())
    assert ici[-1] == 2 and dcn[-1] == 1  # tensor wholly local
    assert ici == [1, 2, 2, 1, 1, 2]
    assert dcn == [1, 2, 1, 1, 1, 1]


@pytest.mark.parametrize(
    "spec, local",
    [
        ("dp=8,tp=8", 8),
        ("pp=4,dp=2,sp=2,tp=4", 8),
        ("dp=16", 8),
        ("pp=2,fsdp=4,tp=2", 4),
        ("dp=2,sp=2,tp=2", 8),
        ("dp=4,ep=4,tp=2", 8),
        ("dp=4", 1),
    ],
)
def test_split_hybrid_products(spec, local):
    sizes = _shape(spec)
    ici, dcn = split_hybrid(sizes, local)
    assert math.prod(ici) == local
    assert [i * d for i, d in zip(ici, dcn)] == list(sizes.values())
    # Local devices are filled innermost first: once an axis crosses nodes, every outer axis
    # is wholly cross-node.
    crossed = False
    for i, d in zip(reversed(ici), reversed(dcn)):
        if crossed:
            assert i == 1
        crossed = crossed or d > 1


def test_split_hybrid_sequence_local_before_data():
    ici, dcn = split_hybrid(_shape("dp=4,sp=2,tp=2"), 4)
    assert ici == [1, 1, 1, 1, 2, 2]
    assert dcn == [1, 4, 1, 1, 1, 1]


@pytest.mark.parametrize("spec, local", [("dp=1,tp=8", 4), ("tp=16", 8), ("dp=2,tp=6", 4)])
def test_split_hybrid_refuses_cross_node_tensor(spec, local):
    with pytest.raises(ConfigError) as err:
        split_hybrid(_shape(spec), local)
    msg = str(err.value)
    assert "tensor" in msg or "tp" in msg
    assert str(local) in msg


def test_split_hybrid_refuses_untiled():
    with pytest.raises(ConfigError):
        split_hybrid(_shape("dp=3"), 2)


# ---------------------------------------------------------------- build_mesh (8 fake devices)


def test_build_mesh_dp_fsdp_tp():
    import jax

    assert jax.device_count() == 8, "tests need XLA_FLAGS=--xla_force_host_platform_device_count=8"
    mesh = build_mesh(parse_mesh("dp=2,fsdp=2,tp=2"))
    assert mesh.axis_names == ("stage", "data", "fsdp", "expert", "sequence", "tensor")
    assert dict(mesh.shape) == {"stage": 1, "data": 2, "fsdp": 2, "expert": 1, "sequence": 1, "tensor": 2}
    assert mesh.devices.shape == (1, 2, 2, 1, 1, 2)
    assert mesh.devices.size == 8 and len(set(mesh.devices.flat)) == 8
    assert tuple(mesh.axis_types) == (jax.sharding.AxisType.Auto,) * 6
    flags = ParallelConfig(data=-1, sequence_parallel=True, tp_impl="gspmd")
    assert mesh_config(mesh, flags) == ParallelConfig(
        data=2, fsdp=2, tensor=2, sequence_parallel=True, tp_impl="gspmd"
    )


def test_build_mesh_fill():
    import jax

    mesh = build_mesh(parse_mesh("dp=-1,tp=2"))
    assert dict(mesh.shape) == {"stage": 1, "data": 4, "fsdp": 1, "expert": 1, "sequence": 1, "tensor": 2}
    assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)


def test_build_mesh_subset_of_devices():
    import jax

    devices = jax.devices()[:4]
    mesh = build_mesh(parse_mesh("pp=2,sp=2"), devices=devices)
    assert dict(mesh.shape) == {"stage": 2, "data": 1, "fsdp": 1, "expert": 1, "sequence": 2, "tensor": 1}
    assert set(mesh.devices.flat) == set(devices)


def test_build_mesh_wrong_count():
    with pytest.raises(ConfigError) as err:
        build_mesh(parse_mesh("dp=4,tp=4"))
    assert "16" in str(err.value) and "8" in str(err.value)
