"""Expert parallelism: the MoE layer as one shard_map region, tokens sent to their experts and
back with all-to-alls over the `expert` axis.

Layout (ep = size of the expert axis, E experts, E/ep per device, t = tp):

  x            [B, L, D]        the block's activations, split over every token axis (data,
                                fsdp, expert, sequence; L over tensor too under SP)
  router       [D, E]           replicated (FSDP: gathered, see Gradients)
  w_gate, w_up [E/ep, D, F/t]   E split over expert, F over tensor
  w_down       [E/ep, F/t, D]

Inside the region every device routes its own n tokens (model/moe.py): each of the n·k
(token, expert) assignments gets a destination device (the expert's rank on `expert`) and a
slot in a send buffer [ep, S, D]; one `all_to_all` over `expert` delivers row block j to device
j (dispatch), the device runs its E/ep experts on the ep·S rows it received, and a second
all_to_all sends the outputs back to the slots they came from (combine). Autodiff transposes
each into the other: backward is 2 more all-to-alls of the same size.

  dropless   S = n·min(k, E/ep): the most rows one device can send another (every token can
             pick at most min(k, E/ep) of one device's experts), so nothing is ever dropped and
             ep·S ≥ n·k rows travel (padding: ep·min(k, E/ep)/k of the routed rows). XLA:CPU has
             no ragged all-to-all (`ragged_all_to_all` is GPU/TPU only), so the buffer is dense.
             The expert ids of the rows travel beside them: one int32 all-to-all of [ep, S].
  capacity   S = (E/ep)·C, C = ceil(cf·n·k/E) rows per expert per source device, expert-major:
             row i of a block belongs to local expert i // C, so no ids travel; assignments past
             an expert's C are dropped (the token keeps its residual only).

Bytes per device per MoE layer, c = bytes of the compute dtype: each activation all-to-all
moves (ep-1)/ep · ep·S·D·c; 2 forward, 2 backward; dropless adds (ep-1)/ep · ep·S·4 forward.

Tensor parallelism: the experts' F is split over tensor and the region does Megatron's column /
row by hand (sharding/tensor_parallel.Sharded): every tensor rank routes the same tokens (x
gathered over L under SP), computes its F/t share of each routed row, and the combined output
is summed (all-reduce, or reduce-scatter under SP) over tensor, one per MoE layer forward and
backward, as the dense MLP's. The region is explicit whatever `tp_impl` says: GSPMD cannot
partition the dispatch.

Gradients: the router is replicated over every manual axis, so its gradient is summed over all
of them (check_vma's typing); expert weights are split over `expert` and summed over the other
token axes. FSDP-split weights (D over fsdp) come in as each device's shard and are all-gathered
inside the region (TensorParallel.gather_in_region, tensor_parallel.gathered_inside, as the SP
regions do), so their gradients are reduce-scattered over fsdp before the sum over data:
compiled for H100s, moe-tiny on dp=2,fsdp=2,ep=2 had all-reduced the experts' whole gradient
over data and fsdp together (3.5 MB), and moves 0.88x the bytes in all now; mixtral-8x7b (2
layers) on that mesh 0.81x (bench/results/moe-region-fsdp-h100-compiled.json). Unrolled under
a remat policy (gather_in_region off) XLA still gathers them at the region's edge.

Router statistics (the load-balancing loss, the z-loss, the load) are over the whole batch:
`Experts.total` sums them over the token axes, so the loss equals the single-device run's.

Nested in a region manual over batch axes (the step's accumulation region, training/step.py, or
a pipeline's engine, pipeline/engine.py: data, fsdp and, with the context parallelism written
out, sequence) the region is manual over the token axes left (expert, sequence, and tensor:
sharding.rules.not_manual); the statistics are summed over the outer region's axes too, so
each device's objective holds the whole batch's router losses, and the psum's transpose sums
their cotangents back (`Experts.total`). The router's and experts' gradients are then each
device's own sums over those axes, reduced once per step by the outer region. Both outer
regions are manual over `expert` too (sharding.checks.accumulation_axes): the experts' weights
arrive as each device's E/ep, the all-to-alls run over the outer axis, and the region is then
manual over tensor alone (or not needed) and runs unchecked, as the tensor-parallel region
beside sequence does (the outer, unchecked region's cotangents carry no type over `expert`):
the tensor sums are Megatron's forward-only ones (sharding/tensor_parallel.Sharded).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Callable

import jax
from jax import lax
from jax.sharding import PartitionSpec as P

from sharding.accumulation import FSDP
from sharding.context_parallel import AXIS as CONTEXT_AXIS
from sharding.rules import axis_size, logical_to_spec, not_manual
from sharding.tensor_parallel import (AXIS as TENSOR_AXIS, BATCH_AXES, Local, Sharded, TensorParallel, Weights,
                                      fsdp_manual, gathering)

AXIS = "expert"
TOKEN_AXES = (*BATCH_AXES, CONTEXT_AXIS)  # every axis that splits the tokens


@dataclass(frozen=True)
class Experts:
    """The collectives of one device's share of the MoE layer (called inside the region)."""

    size: int = 1  # ep
    token_axes: tuple[str, ...] = ()  # the manual axes that split the tokens
    tensor: Local | Sharded = field(default_factory=Local)
    outer: tuple[str, ...] = ()  # those of them manual outside the region (the step's or a pipeline's)

    def all_to_all(self, buf: jax.Array) -> jax.Array:
        """[ep, S, ...]: block j goes to device j; block i of the result came from device i."""
        return lax.all_to_all(buf, AXIS, 0, 0) if self.size > 1 else buf

    def total(self, x: jax.Array) -> jax.Array:
        """The sum of x over every device's tokens (a psum over the token axes). Over the axes
        manual outside the region (`outer`) the region's sum is then typed varying (the
        region's types know only its own axes) and summed again: the transpose of that psum is
        a psum of the cotangent over them, each device's objective holding the whole batch's
        statistics."""
        inner = tuple(a for a in self.token_axes if a not in self.outer)
        x = lax.psum(x, inner) if inner else x
        return lax.psum(lax.pcast(x, self.outer, to="varying"), self.outer) if self.outer else x

    def same_on_tensor(self, x: jax.Array) -> jax.Array:
        """x, computed alike by every tensor rank, typed as replicated (a mean over tensor: each
        rank's share of its gradient is 1/t, summed back by the router's gradient sum)."""
        return lax.pmean(x, TENSOR_AXIS) if isinstance(self.tensor, Sharded) else x


def region(fn: Callable, x: jax.Array, weights: Weights, tp: TensorParallel) -> tuple[jax.Array, dict]:
    """fn(experts, x, {name: weight}) -> (y [like x], {name: scalar}) on each device's tokens and
    experts; one device (no mesh, or every token axis of size 1) calls fn directly."""
    mesh = jax.sharding.get_abstract_mesh()
    arrays = {name: a for name, (a, _) in weights.items()}
    split = tuple(a for a in (*TOKEN_AXES, TENSOR_AXIS) if axis_size(a) > 1)
    manual = not_manual(split)  # nested in the step's or a pipeline's region: its axes are manual already
    # nested in a region manual over `expert` (the step's accumulation region, a pipeline's), the all-to-alls
    # type y as varying over it, and the cotangent from that unchecked region carries no such
    # type: run unchecked, as TensorParallel.region does nested over sequence
    checked = AXIS in manual or AXIS not in split
    tensor = axis_size(TENSOR_AXIS)
    ops = Experts(
        size=axis_size(AXIS),
        token_axes=tuple(a for a in split if a in TOKEN_AXES),  # the outer ones too: the psums reach them
        tensor=Sharded(tensor, tp.sequence_parallel, tp.overlap, checked) if tensor > 1 else Local(),
        outer=tuple(a for a in split if a in TOKEN_AXES and a not in manual),
    )
    if not manual:
        return fn(ops, x, arrays)
    fsdp = tp.gather_in_region and fsdp_manual(manual)  # each device's fsdp shard in, gathered inside
    # the experts split over expert and tensor outside, if so; over fsdp too where gathered inside
    weight_axes = tuple(a for a in (AXIS, TENSOR_AXIS) if a in manual) + (FSDP,) * fsdp
    specs = {name: logical_to_spec(names, a.shape, mesh, within=weight_axes) for name, (a, names) in weights.items()}
    x_spec = logical_to_spec(tp.activation_names, x.shape, mesh, within=manual)
    if fsdp:
        fn = gathering(fn, weights, specs, manual, checked)
    body = jax.shard_map(functools.partial(fn, ops), in_specs=(x_spec, specs), out_specs=(x_spec, P()),
                         axis_names=set(manual), check_vma=checked)
    return body(x, arrays)
