"""The embedding and the head with the vocabulary split over `tensor` (Megatron's vocab-parallel
embedding and column-parallel head), each one shard_map region; T = the tensor axis' size.

  embedding  table [V/T, D] per device, tokens [B, L] -> [B, L, D] ([B, L/T, D] under SP): each
             device takes the tokens that fall in its V/T rows (zeros elsewhere), then an
             all-reduce of [B, L, D] over tensor (SP: a reduce-scatter over L). Backward: a
             local scatter-add into the table's gradient (SP: after an all-gather of dx).
  head       x [B, L, D] @ head [D, V/T] -> fp32 logits [B, L, V/T]: column-parallel, x whole
             on every device (plain: x replicated, dx all-reduced backward; SP: x all-gathered
             forward, dx reduce-scattered backward, the gathered x kept for dW).

Per microbatch, not per layer: S = B·L·D elements, all-reduce 2S(T-1)/T elements per device,
all-gather and reduce-scatter S(T-1)/T each. Memory: the fp32 logits stay split over tensor,
[B, L, V/T] per device, never gathered whole; the table and the head hold V/T rows each.

`head_matmul` is the head's matmul with its backward in the compute dtype (its docstring); it
is also the head on one device and under tp_impl=gspmd.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax
from jax.typing import DTypeLike

from sharding.context_parallel import AXIS as CONTEXT_AXIS
from sharding.rules import axis_size, constrain, logical_to_spec, not_manual, varying_as
from sharding.tensor_parallel import (AXIS, BATCH_AXES, FSDP, Sharded, TensorParallel, fsdp_manual,
                                      gathered_forward_only, gathered_inside)


def vocab_parallel_take(table: jax.Array, tokens: jax.Array, sequence_parallel: bool = False,
                        dtype: DTypeLike | None = None) -> jax.Array:
    """table [V, D] (V split over tensor, D over fsdp as stored), tokens [B, L] -> [B, L, D] ([B, L/T, D] under SP), as
    one region over tensor: each device takes the tokens that fall in its V/T rows (zeros
    elsewhere), then a psum of [B, L, D] over tensor, 2·B·L·D·(T-1)/T elements (under SP a
    reduce-scatter over L, half that; backward an all-gather of dx); backward otherwise a local
    scatter-add. Under SP, GSPMD's own lookup would all-gather the whole table over data and
    tensor every step (V·D: 525M for Llama 3). The batch and sequence axes are manual too: with
    them automatic, XLA partitions the backward scatter-add by all-gathering dx and the tokens
    over them instead of summing the table's gradient there; and the region takes the table's
    fsdp shard and gathers it itself (tensor_parallel.gathered_inside: its gradient is
    reduce-scattered over fsdp, then summed over the other batch axes). `dtype`: the rows are
    cast to it as taken, before any collective (default: the table's); the transpose from an
    fp32 table then scatters an fp32 gradient (pipeline/cells.py's `embed_grad`) behind the same
    collectives."""
    dtype = dtype or table.dtype
    mesh, manual = jax.sharding.get_abstract_mesh(), _take_region_axes()
    fsdp = axis_size(AXIS) > 1 and fsdp_manual(manual)
    if not fsdp:  # whole over fsdp before the lookup: gathered (or stored so) outside its region
        table = constrain(table, ("vocab", None))
    if axis_size(AXIS) == 1:
        return jnp.take(table, tokens, axis=0).astype(dtype)
    table_spec = logical_to_spec(("vocab", "embed"), table.shape, mesh, within=(AXIS, FSDP) if fsdp else (AXIS,))

    def local(rows: jax.Array, ids: jax.Array) -> jax.Array:
        if fsdp:
            rows = gathered_inside(rows, table_spec, manual)
        idx = ids - lax.axis_index(AXIS) * rows.shape[0]
        mine = (idx >= 0) & (idx < rows.shape[0])
        x = jnp.take(rows, jnp.clip(idx, 0, rows.shape[0] - 1), axis=0).astype(dtype)
        x = jnp.where(mine[..., None], x, jnp.zeros_like(x))
        return lax.psum_scatter(x, AXIS, scatter_dimension=1, tiled=True) if sequence_parallel else lax.psum(x, AXIS)

    ids_spec = logical_to_spec(("batch", "length"), tokens.shape, mesh, within=manual)
    out_names = ("batch", "sp_length" if sequence_parallel else "length", "act_embed")
    out_spec = logical_to_spec(out_names, (*tokens.shape, table.shape[1]), mesh, within=manual)
    return jax.shard_map(local, in_specs=(table_spec, ids_spec), out_specs=out_spec,
                         axis_names=set(manual))(table, tokens)


def _take_region_axes() -> tuple[str, ...]:
    """The axes `vocab_parallel_take`'s region makes manual: tensor, and the batch and sequence
    axes the context has not already made manual."""
    return not_manual((*BATCH_AXES, CONTEXT_AXIS, AXIS))


def take_grad_reduced() -> bool:
    """Whether the transpose of `vocab_parallel_take` all-reduces the table's gradient: its
    region is manual over a batch or sequence axis of size > 1 that the context leaves to XLA,
    over which the table is replicated (no region around it, or one that leaves such an axis
    to XLA: the pipelines' engine leaves sequence under context_impl=gspmd)."""
    if axis_size(AXIS) == 1:
        return False
    sizes = dict(jax.sharding.get_abstract_mesh().shape)
    return any(sizes[a] > 1 for a in _take_region_axes() if a != AXIS)


def vocab_parallel_logits(tp: TensorParallel, x: jax.Array, head: jax.Array, dx_dtype: DTypeLike | None = None
                          ) -> jax.Array:
    """x [B, L, D] ([B, L/T, D] under SP) @ head [D, V] ('embed', 'vocab') -> fp32 logits
    [B, L, V], V split over tensor where `tp` runs its regions with shard_map (else one
    `head_matmul` that GSPMD partitions); `dx_dtype`: head_matmul's.

    Where the region is manual over fsdp (SP, context parallelism) it takes the head's fsdp
    shard and gathers it itself (tensor_parallel.gathered_inside: the gradient reduce-scattered
    over fsdp before the sum over data or sequence; the gathered head is what the backward
    reads). Otherwise, under fsdp the head is gathered before the region, forward only, in the
    compute dtype (pinned to its fsdp split first, so that GSPMD casts the shard rather than gathering fp32):
    the gathered head is then what the backward reads. Left to the region's edge, the transpose
    read the primal, fsdp-split head and gathered it again, per microbatch: on llama3-8b
    (fsdp=4,tp=2, 2 microbatches) 0.79 GB per step more than the contract's one gather, 1.10x
    its fsdp bytes; now 1.000x, at 0.94x XLA's peak
    (bench/results/head-gather-fsdp-tp-h100-compiled.json)."""
    mesh, size = jax.sharding.get_abstract_mesh(), axis_size(AXIS)
    if tp.impl == "gspmd" or size == 1:
        return head_matmul(x, head, dx_dtype)
    manual = tp.manual_axes()
    fsdp = fsdp_manual(manual)
    ops = Sharded(size, tp.sequence_parallel, tp.overlap)
    x_spec = logical_to_spec(tp.activation_names, x.shape, mesh, within=manual)
    w_spec = logical_to_spec(("embed", "vocab"), head.shape, mesh, within=(AXIS, FSDP) if fsdp else (AXIS,))
    if not fsdp:
        head = gathered_forward_only(constrain(head, ("embed", "vocab")), w_spec)  # FSDP's gather (docstring)
    out_spec = logical_to_spec(("batch", "length", "vocab"), (*x.shape[:2], head.shape[1]), mesh, within=manual)

    def local(x: jax.Array, w: jax.Array) -> jax.Array:
        if fsdp:
            w = gathered_inside(w, w_spec, manual)
        return ops.column(x, lambda x: head_matmul(x, w, dx_dtype))

    body = jax.shard_map(local, in_specs=(x_spec, w_spec), out_specs=out_spec, axis_names=set(manual))
    return body(x, head)


def head_matmul(x: jax.Array, w: jax.Array, dx_dtype: DTypeLike | None = None) -> jax.Array:
    """x [B, L, D] @ head [D, V] -> fp32 logits [B, L, V], both operands in the compute dtype.
    The backward takes the logits' gradient g in the compute dtype, as every other activation's,
    so that its two matmuls run in it with fp32 accumulation: dx = g·Wᵀ [B, L, D] and dW = xᵀ·g
    [D, V], written with x first so that dW leaves its matmul in the weight's layout. Autodiff of
    the fp32 output would widen W and x to fp32 (on XLA CPU 3.5x the forward matmul's time; on a
    GPU off the bf16 tensor cores) and compute gᵀ·x, [V, D], then transpose it (on XLA CPU a
    strided pass over V·D elements, 20% of a dp=8 step's op time). In fp32 compute this is
    autodiff's backward up to the order of dW's sums. Inside a shard_map each operand is first
    made varying over the manual axes the other varies over, as the einsum would, so that the
    rule's gradients have their operands' types and autodiff transposes that step as before.
    `dx_dtype` (default x's): the dtype dx leaves its fp32 accumulation in, fp32 where dx is a
    partial sum that others complete (pipeline/head.py)."""
    return _head_matmul(varying_as(x, w), varying_as(w, x), None if dx_dtype is None else jnp.dtype(dx_dtype))


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def _head_matmul(x: jax.Array, w: jax.Array, dx_dtype: jnp.dtype | None) -> jax.Array:
    return jnp.einsum("bld,dv->blv", x, w, preferred_element_type=jnp.float32)


def _head_forward(x: jax.Array, w: jax.Array, dx_dtype: jnp.dtype | None) -> tuple[jax.Array, tuple]:
    return _head_matmul(x, w, dx_dtype), (x, w)


def _head_backward(dx_dtype: jnp.dtype | None, saved: tuple, g: jax.Array) -> tuple[jax.Array, jax.Array]:
    x, w = saved
    g = g.astype(x.dtype)
    dx = jnp.einsum("blv,dv->bld", g, w, preferred_element_type=jnp.float32).astype(dx_dtype or x.dtype)
    dw = jnp.einsum("bld,blv->dv", x, g, preferred_element_type=jnp.float32).astype(w.dtype)
    return dx, dw


_head_matmul.defvjp(_head_forward, _head_backward)
