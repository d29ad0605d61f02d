"""sharding/checks.py: one jax-free home for the shape rules, which the search and the step share."""

import dataclasses
import subprocess
import sys

import pytest

from configs import ConfigError
from conftest import ROOT, small_config
from sharding.checks import check_run
from sharding.mesh import AXES, build_mesh
from tools.search import meshes, pipelined, valid
from training.build import make_program


def test_checks_import_no_jax():
    code = "import sys, sharding.checks, cli, tools.search, tools.roofline; print('jax' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr


def test_search_ranks_exactly_the_meshes_the_step_accepts():
    """Every mesh of 8 devices: tools.search.valid says yes iff training.build.make_program builds it
    (with the settings the search would run it with)."""
    cfg = small_config("", "model.n_layers=4", "model.n_heads=4", "model.n_kv_heads=2", "train.seq_len=24")
    accepted = {tuple(s.values()) for s in meshes(cfg, 8)}
    for sizes in ({a: n for a, n in zip(AXES, combo)} for combo in _all_meshes(8)):
        run = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, **sizes))
        if sizes["stage"] > 1:  # 1f1b, with the all-gather context parallelism under sp > 1
            run = pipelined(run, sizes, sizes["stage"])
        try:
            make_program(run, build_mesh(run.parallel))
            builds = True
        except ConfigError:
            builds = False
        assert builds == (tuple(sizes.values()) in accepted) == valid(cfg, sizes), sizes


def _all_meshes(n: int):
    def split(rest: int, axes: int):
        if axes == 1:
            yield (rest,)
            return
        for d in (d for d in range(1, rest + 1) if rest % d == 0):
            for tail in split(rest // d, axes - 1):
                yield (d, *tail)
    return split(n, len(AXES))


@pytest.mark.parametrize("sets, sizes, message", [
    (["model.n_heads=6", "model.n_kv_heads=4"], {}, "model.n_heads=6 is not a multiple of model.n_kv_heads=4"),
    (["model.head_dim=7"], {}, "model.head_dim=7 must be even"),
    (["model.d_model=60"], {"fsdp": 8}, "model.d_model=60 is not divisible by fsdp=8"),
    (["train.micro_batch_size=2"], {"stage": 2, "data": 4}, "train.micro_batch_size=2 with pp=2"),
    (["parallel.virtual_stages=2"], {}, "use 1, or more with --set parallel.schedule=interleaved"),
    (["parallel.fsdp_gather_once=true"], {"data": 8}, "parallel.fsdp_gather_once=true needs fsdp > 1"),
    (["parallel.fsdp_gather_once=true", "model.n_experts=4"], {"fsdp": 2, "expert": 2, "sequence": 2},
     "with sp > 1 context_impl ring or allgather and no expert axis"),
    (["parallel.fsdp_gather_once=true", "parallel.context_impl=gspmd"], {"fsdp": 2, "sequence": 2},
     "with sp > 1 context_impl ring or allgather"),
])
def test_rules_name_the_field(sets, sizes, message):
    cfg = small_config("", *sets)
    with pytest.raises(ConfigError, match=message):
        check_run(cfg, {a: 1 for a in AXES} | sizes)


@pytest.mark.parametrize("sizes, sets, axes", [
    ({"data": 2, "sequence": 4}, [], ("data", "sequence")),
    ({"sequence": 8}, ["parallel.context_impl=allgather"], ("sequence",)),
    ({"fsdp": 2, "sequence": 4}, ["parallel.fsdp_gather_once=true"], ("fsdp", "sequence")),
    ({"data": 2, "sequence": 2, "tensor": 2}, [], ("data", "sequence")),
    ({"fsdp": 2, "sequence": 2, "tensor": 2}, ["parallel.fsdp_gather_once=true"], ("fsdp", "sequence")),
    ({"data": 2, "sequence": 4}, ["parallel.context_impl=gspmd"], ()),  # XLA's all-gather sees the whole L
    ({"fsdp": 2, "sequence": 4}, [], ()),  # XLA's ZeRO-3: fsdp would be manual inside, before sequence
    # pipelines: manual over data and sequence (pipeline/engine.py), or data alone beside XLA's all-gather
    ({"stage": 2, "data": 2, "sequence": 2}, ["parallel.schedule=1f1b", "parallel.context_impl=allgather"],
     ("data", "sequence")),
    ({"stage": 2, "data": 2, "sequence": 2}, ["parallel.context_impl=gspmd"], ("data",)),
    ({"stage": 2, "fsdp": 2, "sequence": 2}, [], ("fsdp", "sequence")),
    # experts: `expert` in the step's region and a pipeline's engine (its MoE regions nest, manual
    # over what is left), not beside XLA's ZeRO-3 (fsdp would be manual inside, before expert);
    # never `sequence` after it (jax 0.12 aborts)
    ({"data": 2, "expert": 2, "sequence": 2}, ["model.n_experts=4"], ()),
    ({"stage": 2, "data": 2, "expert": 2, "sequence": 2}, ["model.n_experts=4"], ("data", "expert")),
    ({"data": 2, "expert": 2}, ["model.n_experts=4", "train.micro_batch_size=2"], ("data", "expert")),
    ({"expert": 4, "tensor": 2}, ["model.n_experts=4", "train.micro_batch_size=1"], ("expert",)),
    ({"fsdp": 2, "expert": 2}, ["model.n_experts=4", "parallel.fsdp_gather_once=true"], ("fsdp", "expert")),
    ({"data": 2, "fsdp": 2, "expert": 2}, ["model.n_experts=4"], ("data",)),
    ({"stage": 2, "fsdp": 2, "expert": 2}, ["model.n_experts=4"], ("fsdp", "expert")),
    ({"data": 2, "sequence": 4}, ["train.micro_batch_size=0"], ()),  # one microbatch: nothing to accumulate
])
def test_sequence_and_expert_join_the_accumulation_region_where_they_can(sizes, sets, axes):
    """sharding.checks.accumulation_axes under context and expert parallelism (k = 2
    microbatches unless said): the step's region is manual over sequence or expert too where
    the model's regions can nest in it."""
    from sharding.checks import accumulation_axes

    cfg = small_config("", "train.global_batch_size=16", "train.micro_batch_size=4", *sets)
    assert accumulation_axes(cfg, {a: 1 for a in AXES} | sizes) == axes
