"""The one table from logical axis names to mesh axes, and the functions that apply it.

Model code names dimensions only logically (DESIGN.md's vocabulary); this table decides where
each lands on the mesh. A parallelism strategy is a change of this table, not of the model:

  batch -> (data, fsdp, expert)  DP and FSDP split the batch; FSDP also splits weights on
                          `embed`, so XLA all-gathers each layer's weights before use (fwd and
                          bwd) and reduce-scatters its gradients: 3P(N-1)/N per step per device
                          (with k > 1 microbatches the step gathers and reduces itself, the
                          gradients once per step: training/step.py).
                          `expert` splits the batch too: to every parameter but the experts'
                          it is one more data axis (gradients reduced over it).
  experts -> expert       E of the MoE layers' expert weights [E, D, F]: each device of the
                          expert axis holds E/ep experts (sharding/expert_parallel.py).
  embed -> (fsdp, stage)  ZeRO-3: parameters, gradients and optimizer state all 1/N per device.
                          Pipelined, the weights outside the stacked layers (embedding, head)
                          are split over stage too, after fsdp: every stage uses them whole
                          in the step (pipeline/engine.py gathers them once; the 1F1B family's
                          head only its vocabulary columns: pipeline/head.py), but each stores,
                          and updates, 1/p of them. A block weight's `layers` dimension comes
                          first and takes stage, so its `embed` gets fsdp alone (below).
  heads, kv_heads, mlp, vocab -> tensor
                          Megatron-style TP through GSPMD: column/row-parallel matmuls, XLA
                          inserts the all-reduces (2 forward + 2 backward per layer).
  length -> sequence      activations split along L; attention gathers K and V over `sequence`.
  sp_length -> (sequence, tensor)  L of the activations between blocks under sequence
                          parallelism (sharding/tensor_parallel.py): norms and residuals hold
                          L/(sp·tp) rows, each sequence device's L/sp split again over tensor.
  layers -> stage         the stacked layers [X, ...] are split in p contiguous blocks of X/p:
                          stage s holds its own layers and never gathers the others (pipeline/).

Mesh axes of size 1 drop out of every spec, and so does an axis that an earlier dimension of
the array took (a mesh axis splits one dimension at most). A dimension that the mesh does not
divide is an error naming the dimension, except kv_heads: with fewer KV heads than the tensor
axis they are replicated (each device keeps all K heads; their weights are small under GQA); and
`embed`'s stage, which is left out where fsdp·stage does not divide D (the tables then stored
whole over stage, as before 2026-12-02).
"""

from __future__ import annotations

import math
from typing import Collection, Sequence

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from configs.base import ConfigError

RULES: dict[str, tuple[str, ...]] = {
    "batch": ("data", "fsdp", "expert"),
    "experts": ("expert",),
    "length": ("sequence",),
    "sp_length": ("sequence", "tensor"),
    "embed": ("fsdp", "stage"),
    "act_embed": (),
    "heads": ("tensor",),
    "kv_heads": ("tensor",),
    "mlp": ("tensor",),
    "vocab": ("tensor",),
    "layers": ("stage",),
    "head_dim": (),
    "norm": (),
}

# Dimensions replicated, instead of refused, when the mesh does not divide them.
REPLICATE_IF_INDIVISIBLE = {"kv_heads"}
# Mesh axes a dimension takes only where they divide it with the others (left out, not refused).
OPTIONAL = {"embed": ("stage",)}

# The config field behind each logical dimension, named in divisibility errors.
FIELD = {
    "batch": "train.global_batch_size", "length": "train.seq_len", "sp_length": "train.seq_len",
    "embed": "model.d_model",
    "heads": "model.n_heads", "mlp": "model.d_ff", "vocab": "model.vocab_size",
    "experts": "model.n_experts",
}


def logical_to_spec(names: Sequence[str | None], shape: Sequence[int], mesh,
                    within: Collection[str] | None = None) -> P:
    """PartitionSpec for an array of `shape` whose dimensions carry logical `names`.

    `within`: use only these mesh axes (e.g. the manual axes of a shard_map); default all.
    """
    sizes = {a: n for a, n in dict(mesh.shape).items() if within is None or a in within}
    spec, taken = [], set()
    for name, dim in zip(names, shape):
        axes = tuple(a for a in RULES[name] if sizes.get(a, 1) > 1 and a not in taken) if name else ()
        if dim % math.prod(sizes[a] for a in axes):
            axes = tuple(a for a in axes if a not in OPTIONAL.get(name, ()))
        split = math.prod(sizes[a] for a in axes)
        if dim % split:
            if name in REPLICATE_IF_INDIVISIBLE:
                axes = ()
            else:
                raise ConfigError(
                    f"{FIELD.get(name, name)}: dimension {name!r} of size {dim} is not divisible "
                    f"by the mesh axes {'x'.join(axes)} = {split}; change it or the --mesh"
                )
        taken.update(axes)
        spec.append(axes[0] if len(axes) == 1 else (axes or None))
    return P(*spec)


def param_shardings(params: nnx.State, mesh: Mesh) -> nnx.State:
    """NamedSharding for every parameter, from its `out_sharding` logical names."""

    def one(var: nnx.Variable) -> NamedSharding:
        names = var.get_metadata().get("out_sharding") or (None,) * var.ndim
        return NamedSharding(mesh, logical_to_spec(names, var.shape, mesh))

    return jax.tree.map(one, params, is_leaf=lambda x: isinstance(x, nnx.Variable))


def data_sharding(mesh: Mesh, shape: Sequence[int]) -> NamedSharding:
    """Token batches [..., B, L]: B over (data, fsdp, expert), L over sequence; leading dims replicated."""
    names = (None,) * (len(shape) - 2) + ("batch", "length")
    return NamedSharding(mesh, logical_to_spec(names, shape, mesh))


def axis_size(name: str) -> int:
    """The size of mesh axis `name` in the mesh in context (1 outside a mesh or without it)."""
    mesh = jax.sharding.get_abstract_mesh()
    return 1 if mesh.empty else dict(mesh.shape).get(name, 1)


def auto_axes() -> list[str]:
    """The axes of the mesh in context that XLA still partitions (not manual in a shard_map)."""
    mesh = jax.sharding.get_abstract_mesh()
    return [] if mesh.empty else [a for a in mesh.axis_names if a not in mesh.manual_axes]


def not_manual(axes: Sequence[str]) -> tuple[str, ...]:
    """`axes` less those already manual in the context (a region nested in the step's
    accumulation region, which is manual over the batch axes: training/step.py). Nested, the
    axes of size 1 are left out too: Shardy (jax 0.12) refuses an inner manual axis that comes
    before an outer one in the mesh (e.g. data of size 1 inside a region over fsdp)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not set(mesh.manual_axes) & set(axes):  # not nested (or in a pipeline's stage)
        return tuple(axes)
    sizes = dict(mesh.shape)
    return tuple(a for a in axes if a not in mesh.manual_axes and sizes[a] > 1)


def varying_as(y: jax.Array, *like: jax.Array) -> jax.Array:
    """y made varying over the manual axes (inside a shard_map) that any of `like` varies over, as
    an op of y with them would make it: a custom_vjp rule's results, or a kernel's output, which
    carries no such type, must have their operands' for autodiff to transpose them."""
    axes = set().union(*(jax.typeof(a).manual_axis_type.varying for a in like))
    missing = tuple(sorted(axes - jax.typeof(y).manual_axis_type.varying))
    return jax.lax.pcast(y, missing, to="varying") if missing else y


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """Pin an activation's sharding by logical names (no-op outside a mesh context).

    Inside a shard_map the manual axes are already fixed by its specs: only the others are
    constrained (e.g. batch over data inside the tensor-parallel regions).
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    return jax.lax.with_sharding_constraint(x, logical_to_spec(names, x.shape, mesh, auto_axes()))
