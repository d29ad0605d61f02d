"""Rematerialisation policies for each layer, scanned or unrolled, chosen by name (`model.remat`).

  none   keep every intermediate of every layer for the backward pass (fastest, most memory)
  full   keep only each layer's input [B, L, D]; recompute the whole layer in backward
         (about one extra forward: ~+33% FLOPs)
  dots   keep the outputs of matmuls without batch dimensions (the projections), recompute
         the elementwise work, norms and softmax; under tensor parallelism a row-parallel
         region's sum over tensor is kept in place of the partial output it sums
         (sharding.tensor_parallel.SUM), so the backward runs no all-reduce again
  attn   keep the tagged q, k, v and attention output (checkpoint_name tags in model/),
         recompute the MLP: a middle ground when the MLP hidden [B, L, F] dominates memory

The layer's checkpoint prevents CSE where the layers are unrolled (model.scan_layers=false): jax
then passes the recomputation's inputs through an optimization barrier, without which XLA merges
each layer's recomputed forward with the original one and keeps every intermediate, whatever
the policy (1b compiled for one H100, 8 x 2048 tokens: 40.16 GiB under full, dots and none
alike; with the barrier 22.69 under full, 33.19 under dots, and the scan's full 23.80; jax 0.11.2
and 0.12, bench/results/remat-unrolled-1b-h100-compiled.json). Inside the layer scan XLA cannot
merge across iterations, so the scan's checkpoint goes without (jax.checkpoint's own advice):
the barrier would only cost fusion there.

`stash_policy` is what a pipeline stage keeps of a whole chunk of layers between its forward
and its backward (the 1F1B family, pipeline/cells.py), where the kept values are stored in slots
and XLA cannot fuse, rematerialise or drop any of them as it does inside one program: remat
none there keeps the outputs of every operation but the cheap ones (`CHEAP`: elementwise
arithmetic, casts, reshapes, slices, transposes and row reductions), which the backward
recomputes: the matmuls', the attention kernels' (output and logsumexp), the collectives'
and any other's. So nothing costly or communicating runs twice, and nothing derived from the
weights alone (their slices, casts, transposes) is kept. Under full it keeps each layer's input
(`LAYER_INPUT`, named in model.transformer's layer loop), what the layer's own checkpoint keeps:
B recomputes each layer once. Keeping the chunk's input alone made B recompute the chunk's
forward and then each layer again, one forward more per chunk (0.60x the step on CPU when
dropped, bench/results/remat-full-1f1b-family.json).
"""

from __future__ import annotations

from typing import Callable

import jax

from configs.base import ConfigError
from sharding.context_parallel import KEPT_NAME  # context parallelism's kept out and lse
from sharding.tensor_parallel import SUM  # a row-parallel region's sum over tensor

POLICIES: dict[str, Callable | None] = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.save_from_both_policies(jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
                                                            jax.checkpoint_policies.save_only_these_names(SUM)),
    "attn": jax.checkpoint_policies.save_only_these_names("query", "key", "value", "attn_core"),
}


# Primitives whose outputs a chunk's backward recomputes under `stash_policy('none')` (names as in
# jax 0.10 to 0.12): no matmul, kernel or collective among them, and all of them fuse into the
# backward's consumers on XLA.
CHEAP = frozenset({
    "abs", "add", "and", "broadcast_in_dim", "concatenate", "convert_element_type", "copy",
    "copy_p", "cos", "div", "dynamic_slice", "dynamic_update_slice", "eq", "erf", "exp", "exp2",
    "expand_dims", "gather", "ge", "gt", "integer_pow", "iota", "le", "log", "log1p",
    "logistic", "lt", "max", "min", "mul", "name", "ne", "neg", "not", "or", "pad", "pow",
    "pvary", "reduce_max", "reduce_min", "reduce_sum", "rem", "reshape", "rev", "rsqrt",
    "scatter", "scatter-add", "select_n", "sharding_constraint", "sign", "sin", "slice",
    "split", "sqrt", "square", "squeeze", "stop_gradient", "sub", "tanh", "transpose",
})


def _costly(prim, *_, **params) -> bool:
    return prim.name not in CHEAP or params.get("name") == KEPT_NAME


def _policy(name: str) -> Callable | None:
    """POLICIES[name], or the error naming the choices."""
    if name not in POLICIES:
        raise ConfigError(f"--set model.remat={name}: unknown policy; choose one of {', '.join(POLICIES)}")
    return POLICIES[name]


LAYER_INPUT = "layer_input"  # each layer's input, tagged by Transformer.run_layers


def stash_policy(name: str) -> Callable | None:
    """The jax.checkpoint policy of a whole chunk whose residuals a pipeline stage stores between
    its forward and backward (module docstring): the layers' own policy under dots and attn,
    each layer's input under full (what the layer's own checkpoint keeps: B recomputes each
    layer once, not the chunk first), all but the `CHEAP` outputs under none."""
    if name == "full":
        return jax.checkpoint_policies.save_only_these_names(LAYER_INPUT)
    return _policy(name) or _costly


def stashed(fn: Callable, name: str) -> Callable:
    """`fn`, a pipeline chunk, as one jax.checkpoint by `stash_policy(name)`: a 1F1B cell's and a
    gpipe or interleaved tick's (pipeline/cells.py, pipeline/circular.py). No CSE barrier: the
    chunk runs inside the tick scan (module docstring)."""
    return jax.checkpoint(fn, prevent_cse=False, policy=stash_policy(name))


def remat(fn: Callable, name: str, prevent_cse: bool) -> Callable:
    """`fn` wrapped in jax.checkpoint with the named policy ('none' returns fn unchanged);
    prevent_cse where fn is not a scan body (module docstring)."""
    policy = _policy(name)
    return fn if policy is None else jax.checkpoint(fn, policy=policy, prevent_cse=prevent_cse)
