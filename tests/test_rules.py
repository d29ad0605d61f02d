"""The logical->mesh table: golden parameter shardings, size-1 axes, divisibility errors.

The golden file pins the PartitionSpec of every parameter of the tiny preset on two meshes, so
that any change of the rules or of the model's annotations shows up in review. Regenerate it
after an intended change with MESHTRAIN_UPDATE_GOLDEN=1 pytest tests/test_rules.py.
"""

import json
import os
from pathlib import Path

import jax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from configs import ConfigError, get_preset
from model.transformer import Transformer
from sharding.mesh import build_mesh, parse_mesh
from sharding.rules import logical_to_spec, param_shardings

GOLDEN = Path(__file__).parent / "golden_shardings.json"
GOLDEN_MESHES = ["dp=2,fsdp=2,tp=2", "fsdp=2,tp=4", "pp=2,fsdp=2,tp=2"]


def spec_table(mesh_spec: str) -> dict[str, str]:
    cfg = get_preset("tiny").model
    params = nnx.state(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
    shardings = param_shardings(params, build_mesh(parse_mesh(mesh_spec)))
    flat = jax.tree_util.tree_leaves_with_path(shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
    return {jax.tree_util.keystr(path): str(s.spec) for path, s in flat}


def test_golden_parameter_shardings():
    tables = {mesh: spec_table(mesh) for mesh in GOLDEN_MESHES}
    if os.environ.get("MESHTRAIN_UPDATE_GOLDEN"):
        GOLDEN.write_text(json.dumps(tables, indent=2, sort_keys=True) + "\n")
    assert tables == json.loads(GOLDEN.read_text())


def test_golden_table_says_what_the_design_says():
    """Spot checks against DESIGN.md, independent of the golden file."""
    t = spec_table("dp=2,fsdp=2,tp=2")
    assert t["['blocks']['attn']['wq']"] == str(P(None, "fsdp", "tensor", None))
    assert t["['blocks']['mlp']['w_down']"] == str(P(None, "tensor", "fsdp"))
    assert t["['head']"] == str(P("fsdp", "tensor"))
    assert t["['embed']['table']"] == str(P("tensor", "fsdp"))
    assert t["['final_norm']['scale']"] == str(P(None))
    # tiny has 2 kv heads: split over tp=2, replicated (not refused) over tp=4.
    assert t["['blocks']['attn']['wk']"] == str(P(None, "fsdp", "tensor", None))
    assert spec_table("fsdp=2,tp=4")["['blocks']['attn']['wk']"] == str(P(None, "fsdp", None, None))


def test_pipelined_tables_are_split_over_stage_after_fsdp():
    """Pipelined, the embedding's and head's D is split over fsdp and then stage (each stage
    stores 1/p of the weights every stage uses: pipeline/stage_weights.py); a block weight's
    `layers` takes stage first, so its `embed` keeps fsdp alone; the final norm stays whole."""
    t = spec_table("pp=2,fsdp=2,tp=2")
    assert t["['embed']['table']"] == str(P("tensor", ("fsdp", "stage")))
    assert t["['head']"] == str(P(("fsdp", "stage"), "tensor"))
    assert t["['blocks']['attn']['wq']"] == str(P("stage", "fsdp", "tensor", None))
    assert t["['blocks']['mlp']['w_down']"] == str(P("stage", "tensor", "fsdp"))
    assert t["['final_norm']['scale']"] == str(P(None))


@pytest.mark.parametrize("mesh, spec", [("pp=8", P(None, None)), ("pp=2,fsdp=4", P(None, "fsdp")),
                                        ("pp=2,dp=2,fsdp=2", P(None, ("fsdp", "stage")))])
def test_stage_leaves_a_table_it_does_not_divide(mesh, spec):
    """D = 36: fsdp·stage must divide it for the stage split; where it does not, the table is
    stored whole over stage (not refused), fsdp's split kept."""
    assert logical_to_spec(("vocab", "embed"), (64, 36), build_mesh(parse_mesh(mesh))) == spec


def test_size_one_axes_drop_out():
    mesh = build_mesh(parse_mesh("tp=8"))
    assert logical_to_spec(("batch", "length", "act_embed"), (8, 16, 32), mesh) == P(None, None, None)
    assert logical_to_spec(("embed", "mlp"), (32, 64), mesh) == P(None, "tensor")
    mesh = build_mesh(parse_mesh("dp=2,fsdp=4"))
    assert logical_to_spec(("batch", "length"), (8, 16), mesh) == P(("data", "fsdp"), None)


@pytest.mark.parametrize(
    "mesh, names, shape, field",
    [
        ("tp=8", ("embed", "heads", None), (64, 12, 8), "model.n_heads"),
        ("tp=8", ("embed", "mlp"), (64, 100), "model.d_ff"),
        ("tp=8", ("vocab", "embed"), (260, 64), "model.vocab_size"),
        ("fsdp=8", ("embed", "mlp"), (36, 64), "model.d_model"),
        ("dp=8", ("batch", "length"), (12, 16), "train.global_batch_size"),
        ("dp=2,sp=4", ("batch", "length"), (8, 10), "train.seq_len"),
    ],
)
def test_indivisible_dimension_is_a_clear_error(mesh, names, shape, field):
    with pytest.raises(ConfigError) as err:
        logical_to_spec(names, shape, build_mesh(parse_mesh(mesh)))
    assert field in str(err.value) and "--mesh" in str(err.value)
