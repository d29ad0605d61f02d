"""configs/: dotted overrides, presets, dict round trip, and no jax on import."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from configs import PRESETS, RunConfig, apply_overrides, get_preset
from configs.base import ConfigError
from configs.checks import CHOICES, FREE, RULES, check_values
from configs.overrides import all_keys

ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------- apply_overrides


def test_override_int_field():
    cfg = apply_overrides(RunConfig(), ["model.n_layers=8"])
    assert cfg.model.n_layers == 8
    assert isinstance(cfg.model.n_layers, int)
    # Everything else is untouched.
    assert cfg.model.d_model == RunConfig().model.d_model == 128
    assert cfg.train == RunConfig().train


def test_override_int_accepts_underscores_and_whitespace():
    cfg = apply_overrides(RunConfig(), [" train.steps = 1_000 "])
    assert cfg.train.steps == 1000


def test_override_float_fields():
    cfg = apply_overrides(RunConfig(), ["train.lr=3e-4", "train.z_loss=1e-4"])
    assert cfg.train.lr == pytest.approx(3e-4)
    assert cfg.train.z_loss == pytest.approx(1e-4)
    assert isinstance(cfg.train.lr, float)
    # A float field given an integer literal still becomes a float.
    cfg = apply_overrides(RunConfig(), ["train.grad_clip=2"])
    assert cfg.train.grad_clip == 2.0 and isinstance(cfg.train.grad_clip, float)


def test_override_str_fields():
    cfg = apply_overrides(RunConfig(), ["data.source=synthetic", "model.attention=cudnn"])
    assert cfg.data.source == "synthetic"
    assert cfg.model.attention == "cudnn"
    # A str field keeps digits as text (the converter does not coerce them to int).
    cfg = apply_overrides(RunConfig(), ["train.profile_steps=5:8", "data.path=/tmp/a=b"])
    assert cfg.train.profile_steps == "5:8"
    assert cfg.data.path == "/tmp/a=b"  # only the first '=' separates key from value


def test_bool_conversion():
    """The bool fields (parallel.sequence_parallel, parallel.tp_overlap) take true/false, 1/0,
    yes/no, on/off in any case; anything else is an error naming the field and the type."""
    for text, value in [("true", True), ("False", False), ("1", True), ("off", False), ("yes", True)]:
        cfg = apply_overrides(RunConfig(), [f"parallel.sequence_parallel={text}", f"parallel.tp_overlap={text}"])
        assert cfg.parallel.sequence_parallel is value and cfg.parallel.tp_overlap is value
    with pytest.raises(ConfigError) as err:
        apply_overrides(RunConfig(), ["parallel.sequence_parallel=maybe"])
    assert "parallel.sequence_parallel" in str(err.value) and "bool" in str(err.value)


def test_overrides_apply_in_order():
    cfg = apply_overrides(
        RunConfig(), ["model.n_layers=8", "train.lr=1e-3", "model.n_layers=2", "parallel.tensor=4"]
    )
    assert cfg.model.n_layers == 2  # the later value wins
    assert cfg.train.lr == pytest.approx(1e-3)
    assert cfg.parallel.tensor == 4
    assert cfg.name == "tiny"


def test_overrides_return_new_config():
    base = RunConfig()
    cfg = apply_overrides(base, ["model.n_layers=8"])
    assert base.model.n_layers == 4
    assert cfg is not base
    assert apply_overrides(base, []) == base


def test_unknown_key_lists_close_matches():
    with pytest.raises(ConfigError) as err:
        apply_overrides(RunConfig(), ["model.n_layer=8"])
    assert "model.n_layer" in str(err.value)
    assert "model.n_layers" in str(err.value)
    assert "did you mean" in str(err.value)


def test_unknown_key_without_close_match():
    with pytest.raises(ConfigError) as err:
        apply_overrides(RunConfig(), ["zzzz.qqqq=1"])
    assert "zzzz.qqqq" in str(err.value)


def test_unknown_section_only_key():
    with pytest.raises(ConfigError):
        apply_overrides(RunConfig(), ["name=foo"])


@pytest.mark.parametrize(
    "item, key, kind",
    [
        ("model.n_layers=abc", "model.n_layers", "int"),
        ("model.n_layers=1.5", "model.n_layers", "int"),
        ("train.lr=fast", "train.lr", "float"),
        ("parallel.data=", "parallel.data", "int"),
    ],
)
def test_wrong_value_type(item, key, kind):
    with pytest.raises(ConfigError) as err:
        apply_overrides(RunConfig(), [item])
    msg = str(err.value)
    assert key in msg
    assert kind in msg


def test_missing_equals():
    with pytest.raises(ConfigError) as err:
        apply_overrides(RunConfig(), ["model.n_layers"])
    assert "model.n_layers" in str(err.value)
    assert "=" in str(err.value)


def test_error_in_later_override_still_raises():
    with pytest.raises(ConfigError):
        apply_overrides(RunConfig(), ["model.n_layers=8", "train.lr=fast"])


def test_config_error_is_value_error():
    assert issubclass(ConfigError, ValueError)


# ---------------------------------------------------------------- presets


def test_preset_names():
    assert {"tiny", "125m", "1b", "llama3-8b", "llama3-70b"} <= set(PRESETS)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_get_preset_name_matches_key(name):
    cfg = get_preset(name)
    assert isinstance(cfg, RunConfig)
    assert cfg.name == name


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_shapes_consistent(name):
    m = get_preset(name).model
    assert m.n_heads % m.n_kv_heads == 0
    assert m.vocab_size >= 256


def test_preset_known_shapes():
    m = get_preset("llama3-8b").model
    assert (m.d_model, m.n_layers, m.n_heads, m.n_kv_heads, m.head_dim, m.d_ff) == (
        4096, 32, 32, 8, 128, 14336,
    )
    assert get_preset("125m").model.d_model == 768
    assert get_preset("tiny") == RunConfig()


def test_unknown_preset_lists_presets():
    with pytest.raises(ConfigError) as err:
        get_preset("huge")
    msg = str(err.value)
    assert "huge" in msg
    for name in PRESETS:
        assert name in msg


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_dict_round_trip(name):
    cfg = get_preset(name)
    d = cfg.to_dict()
    assert d["name"] == name
    assert d["model"]["n_layers"] == cfg.model.n_layers
    assert RunConfig.from_dict(d) == cfg


def test_dict_round_trip_after_overrides():
    cfg = apply_overrides(get_preset("1b"), ["train.lr=1e-5", "data.source=text", "parallel.data=-1"])
    assert RunConfig.from_dict(cfg.to_dict()) == cfg
    assert RunConfig.from_dict(cfg.to_dict()).parallel.data == -1


# ---------------------------------------------------------------- check_values


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_pass_the_value_checks(name):
    check_values(get_preset(name))


def test_every_field_has_a_value_rule():
    """A new numeric, dtype or named-choice field needs its rule in configs/checks.py."""
    cfg = RunConfig()
    for key in all_keys(cfg):
        section, field = key.split(".")
        if key in FREE or isinstance(getattr(getattr(cfg, section), field), bool):
            continue
        assert key in RULES or key in CHOICES, f"{key} has no rule in configs/checks.py"


def test_choices_agree_with_the_modules_that_use_them():
    from model.kernels.grouped_matmul import IMPLS as EXPERT_MATMULS
    from model.moe import DISPATCH
    from model.remat import POLICIES
    from pipeline.tables import SCHEDULES
    from sharding import context_parallel
    from sharding.cores import CORES
    from sharding.tensor_parallel import IMPLS

    assert CHOICES["model.attention"] == CORES
    assert CHOICES["model.remat"] == tuple(POLICIES)
    assert CHOICES["parallel.schedule"] == SCHEDULES
    assert CHOICES["parallel.tp_impl"] == IMPLS
    assert CHOICES["parallel.context_impl"] == (*context_parallel.IMPLS, "gspmd")
    assert CHOICES["model.moe_dispatch"] == DISPATCH
    assert CHOICES["model.expert_matmul"] == EXPERT_MATMULS


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["train.log_every=0"], "--set train.log_every=0: must be >= 1"),
        (["train.steps=0"], "--steps 0: must be >= 1"),
        (["train.seq_len=0"], "--set train.seq_len=0: must be >= 1"),
        (["train.global_batch_size=-4"], "--set train.global_batch_size=-4: must be >= 1"),
        (["train.micro_batch_size=-1"], "must be >= 0 (0 = no accumulation)"),
        (["train.lr=0"], "--set train.lr=0.0: must be > 0"),
        (["train.lr=inf"], "--set train.lr=inf: expected a finite float"),
        (["train.min_lr_ratio=1.5"], "--set train.min_lr_ratio=1.5: must be in [0, 1]"),
        (["train.b2=1"], "--set train.b2=1.0: must be in [0, 1)"),
        (["train.max_bad_steps=0"], "--set train.max_bad_steps=0: must be >= 1"),
        (["train.keep_checkpoints=0"], "--set train.keep_checkpoints=0: must be >= 1"),
        (["model.d_ff=0"], "--set model.d_ff=0: must be >= 1"),
        (["model.norm_eps=0"], "--set model.norm_eps=0.0: must be > 0"),
        (["model.param_dtype=int8"], "--set model.param_dtype=int8: choose one of float32, bfloat16, float16"),
        (["model.remat=some"], "--set model.remat=some: choose one of none, full, dots, attn"),
        (["data.source=web"], "--set data.source=web: choose one of stdlib"),
        (["data.seed=-1"], "--set data.seed=-1: must be >= 0"),
        (["parallel.fsdp=0"], "--set parallel.fsdp=0: must be >= 1, or -1 to fill"),
        (["parallel.tensor=-2"], "--set parallel.tensor=-2: must be >= 1, or -1 to fill"),
        (["parallel.data=-1", "parallel.stage=-1"], "parallel.stage and parallel.data are all -1"),
        (["parallel.schedule=zigzag"], "--set parallel.schedule=zigzag: choose one of gpipe"),
        (["parallel.virtual_stages=0"], "--set parallel.virtual_stages=0: must be >= 1"),
        (["train.steps=3", "train.profile_steps=3:5"], "--profile-steps 3:5 does not fit in --steps 3"),
        (["train.steps=3", "train.profile_steps=0:4"], "--profile-steps 0:4 does not fit in --steps 3"),
        (["train.profile_steps=5"], "--profile-steps '5': expected START:END"),
    ],
)
def test_bad_values_name_the_flag_and_the_fix(overrides, message):
    with pytest.raises(ConfigError) as err:
        check_values(apply_overrides(RunConfig(), overrides))
    assert message in str(err.value)


@pytest.mark.parametrize("overrides", [
    ["train.micro_batch_size=0", "train.grad_clip=0", "train.checkpoint_every=0", "train.warmup_steps=0"],
    ["parallel.data=-1", "parallel.microbatches=0", "train.z_loss=0", "train.weight_decay=0"],
    ["train.steps=3", "train.profile_steps=0:3", "train.min_lr_ratio=0", "train.b1=0"],
])
def test_documented_zeros_and_edges_are_accepted(overrides):
    check_values(apply_overrides(RunConfig(), overrides))


def test_saved_config_of_the_wrong_type_is_refused():
    d = RunConfig().to_dict()
    d["train"]["steps"] = "200"
    with pytest.raises(ConfigError) as err:
        check_values(RunConfig.from_dict(d))
    assert "--steps 200: expected a finite int, got '200'" in str(err.value)


# ---------------------------------------------------------------- no jax on import


def test_configs_and_mesh_import_without_jax():
    proc = subprocess.run(
        [sys.executable, "-c", "import configs, configs.checks, sharding.mesh, sys; assert 'jax' not in sys.modules"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
