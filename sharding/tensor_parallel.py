"""Megatron tensor parallelism written out with `jax.shard_map` over the `tensor` axis.

Each block has two tensor-parallel regions, each a column-parallel matmul then a row-parallel
one (T = size of the tensor axis, t = this device's index on it):

  attention  x [B, L, D] @ wq [D, N/T, H], wk/wv [D, K/T, H] -> q, k, v   column (heads split)
             attention core on the device's own N/T heads                no communication
             o [B, L, N/T, H] @ wo [N/T, H, D] -> partial [B, L, D]      row: sum over tensor
  mlp        x [B, L, D] @ w_gate, w_up [D, F/T] -> gate, up [B, L, F/T]  column (F split)
             silu(gate) * up @ w_down [F/T, D] -> partial [B, L, D]       row: sum over tensor

Collectives per layer, S = B·L·D elements of the compute dtype (B the local batch):

  setting                   forward                         backward
  plain                     2 all-reduce(S)                 2 all-reduce(S) (dx of each region)
  sequence_parallel         2 all-gather + 2 reduce-scatter the mirror image
  sequence_parallel+overlap 4 rings of T-1 collective-permutes of S/T, the same in backward

The embedding and the head are regions too (vocab split over tensor): the lookup ends in an
all-reduce (SP: reduce-scatter) of S, the head is column-parallel (backward: the all-reduce of
dx; SP: all-gather forward, reduce-scatter backward); per microbatch, not per layer.

Bytes per device: all-reduce 2S(T-1)/T; all-gather and reduce-scatter S(T-1)/T each, so SP
moves the same volume as plain TP; a ring moves (T-1)·S/T, the same again.

Column: the matmul needs the whole x on every device. Plain TP has it (x replicated over
tensor; `pcast` to varying is Megatron's "f": identity forward, all-reduce of dx backward).
SP holds x as [B, L/T, D] and all-gathers L first (backward: reduce-scatter of dx). Row: the
partial sums are all-reduced (plain; backward: nothing) or reduce-scattered over L (SP;
backward: all-gather), which leaves [B, L/T, D] for the norms and residual adds: their
activation memory is divided by T.

Overlap (collective matmul, SP only): the all-gather+matmul becomes T steps. At step s device t
multiplies the chunk of L it holds, (t+s) mod T, while it passes that chunk on to device t-1
with a collective-permute, so the next chunk's transfer hides behind this chunk's matmul.
Matmul+reduce-scatter is the mirror: at step s device t computes its partial of chunk
(t-1-s) mod T, adds the running sum received from t-1 and sends it to t+1; after T steps it
holds the full sum of chunk t. Autodiff turns each ring into the opposite ring.

GQA: the kv heads are split over tensor when T divides K. When K < T (K must divide T) the
kv weights are replicated and device t uses kv head t // (T/K) for its N/T query heads (all in
one group); their weight gradients are then summed over tensor, one all-reduce of D·K·H per
kv weight per layer.

The shard_map is manual over `tensor` only: data and fsdp stay automatic, so XLA still splits
the batch and gathers FSDP weights at the region's edge. Under SP it is manual over data and
fsdp too (XLA cannot partition an all-gather over `tensor` of a batch split on an automatic
axis: it would gather the batch); the weights' gradients are then summed over data and fsdp
inside the region (an all-reduce, where GSPMD reduce-scatters FSDP gradients on GPUs).

Backward collectives come from the manual-axis types (check_vma): `pcast` to varying
transposes to the all-reduce of dx, and a weight replicated over a manual axis gets its
gradient summed over it. A Pallas kernel cannot run under that typing (interpret mode cannot
type its loops), and the cudnn core runs the same way (`model/kernels/sharded.py`), so with either
fused core the attention region runs with check_vma=False (the
MLP's, the embedding's and the head's stay typed), where shard_map's transpose does the same at
the region's edge: an input not split over a manual axis has its cotangent summed over that
axis (x's dx: the same one all-reduce per region). Its row all-reduce is then written as
Megatron's "g" (`_sum_forward_only`): an unchecked psum would transpose to a second all-reduce.

tp_impl=gspmd runs the same per-device code without shard_map: the logical rules shard the
weights and XLA chooses and places the collectives.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from sharding.context_parallel import AXIS as CONTEXT_AXIS
from sharding.rules import axis_size, constrain, logical_to_spec, not_manual, varying_as

IMPLS = ("shard_map", "gspmd")
AXIS = "tensor"
# the checkpoint_name of a row-parallel region's sum: remat dots keeps it rather than the partial
# matmul output it sums, so the backward does not sum it again (model/remat.py)
SUM = "tensor_sum"
# Under SP (and context parallelism) the batch axes are manual too: XLA cannot partition an
# all-gather or reduce-scatter over a manual axis whose operand is split on an automatic one
# (it all-gathers the batch first).
BATCH_AXES = ("data", "fsdp", "expert")
Weights = dict[str, tuple[jax.Array, Sequence[str | None]]]


class Local:
    """A region with no tensor axis to handle: one device, or GSPMD placing the collectives."""

    def column(self, x: jax.Array, fn: Callable) -> tuple:
        return fn(x)

    def row(self, h: jax.Array, fn: Callable) -> jax.Array:
        return fn(h)

    def own_kv_heads(self, w: jax.Array, n_kv_heads: int) -> jax.Array:
        return w


@dataclass(frozen=True)
class Sharded:
    """The collectives of one device's tensor shard (called inside the shard_map)."""

    size: int  # T
    sequence_parallel: bool
    overlap: bool
    check_vma: bool = True

    def column(self, x: jax.Array, fn: Callable) -> tuple:
        """fn (L-local: [B, l, D] -> arrays [B, l, ...]) on the whole sequence."""
        if self.overlap:
            return self._gather_ring(x, fn)
        if self.sequence_parallel:
            return fn(lax.all_gather(x, AXIS, axis=1, tiled=True))  # [B, L/T, D] -> [B, L, D]
        return fn(lax.pcast(x, AXIS, to="varying") if self.check_vma else x)

    def row(self, h: jax.Array, fn: Callable) -> jax.Array:
        """fn(h) ([B, L, F/T] -> partial [B, L, D]) summed over tensor, the sum named `SUM`."""
        if self.overlap:
            summed = self._scatter_ring(h, fn)
        elif self.sequence_parallel:
            summed = lax.psum_scatter(fn(h), AXIS, scatter_dimension=1, tiled=True)  # -> [B, L/T, D]
        else:
            summed = lax.psum(fn(h), AXIS) if self.check_vma else _sum_forward_only(fn(h))
        return checkpoint_name(summed, SUM)

    def own_kv_heads(self, w: jax.Array, n_kv_heads: int) -> jax.Array:
        """This device's kv heads of w [D, K', H]: split already, or picked from all K."""
        if n_kv_heads % self.size == 0:
            return w
        return lax.dynamic_slice_in_dim(w, own_kv_head(AXIS, self.size, n_kv_heads), 1, axis=1)  # -> [D, 1, H]

    def _gather_ring(self, x: jax.Array, fn: Callable) -> tuple:
        t, n, chunk = lax.axis_index(AXIS), self.size, x.shape[1]
        to_left = [(i, (i - 1) % n) for i in range(n)]
        outs = None
        for s in range(n):
            incoming = lax.ppermute(x, AXIS, to_left) if s < n - 1 else None  # chunk (t+s+1) mod n
            parts = fn(x)
            if outs is None:  # [B, l, ...] -> zeros [B, L, ...]
                outs = jax.tree.map(lambda a: jnp.zeros((a.shape[0], n * chunk, *a.shape[2:]), a.dtype), parts)
            start = (t + s) % n * chunk
            outs = jax.tree.map(lambda o, a: lax.dynamic_update_slice_in_dim(o, a, start, axis=1), outs, parts)
            x = incoming
        return outs

    def _scatter_ring(self, h: jax.Array, fn: Callable) -> jax.Array:
        t, n = lax.axis_index(AXIS), self.size
        chunk = h.shape[1] // n
        to_right = [(i, (i + 1) % n) for i in range(n)]
        acc = None
        for s in range(n):
            part = fn(lax.dynamic_slice_in_dim(h, (t - 1 - s) % n * chunk, chunk, axis=1))
            acc = part if acc is None else acc + part
            if s < n - 1:
                acc = lax.ppermute(acc, AXIS, to_right)
        return acc  # [B, L/T, D]: the sum of chunk t


def own_kv_head(axes: str | tuple[str, ...], devices: int, n_kv_heads: int) -> jax.Array:
    """The one kv head this device's query heads read when the heads are split over `axes`
    (`devices` of them, more than the kv heads K): devices/K devices share each kv head."""
    return lax.axis_index(axes) * n_kv_heads // devices


@jax.custom_vjp
def _sum_forward_only(x: jax.Array) -> jax.Array:
    """Megatron's "g" in an unchecked region: all-reduce forward, no collective backward.
    Unchecked, shard_map's transpose divides the cotangent of an output replicated over tensor
    by T, and psum's own transpose, another psum, sums the T shares back: an all-reduce whose
    result every device already has (g). Here the backward multiplies by T instead."""
    return lax.psum(x, AXIS)


_sum_forward_only.defvjp(lambda x: (lax.psum(x, AXIS), None), lambda _, g: (g * lax.axis_size(AXIS),))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _gathered_forward_only(w: jax.Array, spec: P) -> jax.Array:
    """w laid out as `spec` (FSDP's all-gather) forward; the cotangent passes unconstrained, so
    GSPMD reduce-scatters the gradient over fsdp as before. A plain constraint transposes to
    one on the cotangent: in the layer scan XLA GPU then all-reduced each layer's gradient over
    data and fsdp whole (125m scanned on dp=2,fsdp=2,tp=2: 127 MB of all-reduce for 80 MB of
    reduce-scatter)."""
    return lax.with_sharding_constraint(w, spec)


_gathered_forward_only.defvjp(lambda w, spec: (lax.with_sharding_constraint(w, spec), None),
                              lambda spec, _, g: (g,))


@dataclass(frozen=True)
class TensorParallel:
    """How the model's tensor-parallel regions run (decided by sharding/strategies.py).

    gather_in_checkpoint (set under a remat policy with fsdp > 1): each region first lays its
    weights out as their in_specs (whole over fsdp; forward only: `_gathered_forward_only`), so
    that FSDP's all-gather is a value of the layer's checkpoint. Left to the shard_map's edge,
    the gather is redone for the recompute, whose inputs pass an optimization barrier, and
    again for the transpose, which reads the primal weights; unrolled, the recompute also re-ran
    tensor all-reduces. Compiled for H100s under remat full: unrolled on fsdp=4,tp=2
    (bench/results/fsdp-tp-remat-h100-compiled.json) 125m's fsdp bytes 0.68x, tensor 1.20x the
    contract to 1.00x, peak memory 0.90x; 1b 0.58x, 1.20x to 1.00x, 0.78x. In the layer scan
    (fsdp-tp-remat-scan-h100-compiled.json) the fsdp bytes 0.86x (125m) and 0.90x (llama3-8b
    and -70b with 4 and 2 layers; the rest was the head's second gather, see `logits`) at the
    same memory (0.99-1.00x). Not under remat none: the gathered weights would be kept whole as
    residuals from each layer's forward to its backward (the head's, gathered so under every
    policy, lives from the loss's forward to its backward, next to each other). XLA CPU's fp32
    program holds one more copy of the device's layer weights with it (tests/test_plan.py
    counts it)."""

    impl: str = "shard_map"
    sequence_parallel: bool = False
    overlap: bool = False
    check_vma: bool = True  # False around the fused cores, pallas and cudnn (see the module docstring)
    context: bool = False  # context parallelism: the regions are manual over `sequence` too
    gather_in_checkpoint: bool = False  # the layers run under a remat policy: gather weights in it (region)

    @property
    def activation_names(self) -> tuple[str, str, str]:
        """Logical names of [B, L, D] between the regions (L over tensor under SP)."""
        return ("batch", "sp_length" if self.sequence_parallel else "length", "act_embed")

    def manual_axes(self) -> tuple[str, ...]:
        """The mesh axes the regions are manual over: tensor where it is explicit (shard_map,
        tp > 1); under sequence parallelism or context parallelism the batch axes too (see
        BATCH_AXES), and `sequence` under context parallelism; less the axes an enclosing
        region has made manual already (the step's accumulation region: the batch axes)."""
        tensor = self.impl == "shard_map" and axis_size(AXIS) > 1
        context = self.context and axis_size(CONTEXT_AXIS) > 1
        manual = (AXIS,) if tensor else ()
        if context or (tensor and self.sequence_parallel):
            manual = (*BATCH_AXES, *manual, *(CONTEXT_AXIS,) * context)
        return not_manual(manual)

    def region(self, fn: Callable, x: jax.Array, weights: Weights, *consts: jax.Array,
               kernel: bool = False) -> jax.Array:
        """fn(ops, x, {name: weight}, *consts) -> [B, L, D], on each device's tensor shard.
        kernel: fn runs the attention core, so the region is typed only if the core can be
        (`check_vma`); the others always are.

        weights: {name: (array, logical names)}; consts (e.g. rotary tables) are replicated,
        or under context parallelism split over `sequence` on their first axis like the rows
        (fn sees its L/sp rows and writes the attention over the axis itself).
        """
        mesh, size = jax.sharding.get_abstract_mesh(), axis_size(AXIS)
        arrays = {name: a for name, (a, _) in weights.items()}
        tensor = self.impl == "shard_map" and size > 1
        manual = self.manual_axes()
        if not manual:
            return fn(Local(), x, arrays, *consts)
        within = (AXIS,) if tensor else ()
        specs = {name: logical_to_spec(names, a.shape, mesh, within=within) for name, (a, names) in weights.items()}
        if self.gather_in_checkpoint:  # FSDP's gather as a value of the layer's checkpoint (class docstring)
            arrays = {name: _gathered_forward_only(a, specs[name]) for name, a in arrays.items()}
        x_spec = logical_to_spec(self.activation_names, x.shape, mesh, within=manual)
        const_spec = P(CONTEXT_AXIS) if CONTEXT_AXIS in manual else P()
        # nested in a region manual over sequence (the step's accumulation), the attention's ring
        # or all-gather over it would type x as varying there, and the layer scan's transpose,
        # whose cotangent comes from that unchecked region, refuses the mismatch: run it unchecked
        check_vma = not kernel or (self.check_vma and CONTEXT_AXIS not in mesh.manual_axes)
        ops = Sharded(size, self.sequence_parallel, self.overlap, check_vma) if tensor else Local()
        body = jax.shard_map(
            functools.partial(fn, ops), in_specs=(x_spec, specs, *(const_spec,) * len(consts)),
            out_specs=x_spec, axis_names=set(manual), check_vma=check_vma,
        )
        return body(x, arrays, *consts)

    def logits(self, x: jax.Array, head: jax.Array) -> jax.Array:
        """x [B, L, D] ([B, L/T, D] under SP) @ head [D, V] ('embed', 'vocab') -> fp32 logits
        [B, L, V], V split over tensor: the head as one column-parallel region (plain: dx
        all-reduced in backward; SP: x all-gathered forward, dx reduce-scattered backward, the
        gathered x kept for the weight gradient rather than gathered again).

        Under fsdp the head is gathered before the region, forward only, in the compute dtype
        (pinned to its fsdp split first, so that GSPMD casts the shard rather than gathering
        fp32): the gathered head is then what the backward reads. Left to the region's edge,
        the transpose read the primal, fsdp-split head and gathered it again, per microbatch:
        on llama3-8b (fsdp=4,tp=2, 2 microbatches) 0.79 GB per step more than the contract's
        one gather, 1.10x its fsdp bytes; now 1.000x, at 0.94x XLA's peak
        (bench/results/head-gather-fsdp-tp-h100-compiled.json)."""
        mesh, size = jax.sharding.get_abstract_mesh(), axis_size(AXIS)

        if self.impl == "gspmd" or size == 1:
            return head_matmul(x, head)
        manual = self.manual_axes()
        ops = Sharded(size, self.sequence_parallel, self.overlap)
        x_spec = logical_to_spec(self.activation_names, x.shape, mesh, within=manual)
        w_spec = logical_to_spec(("embed", "vocab"), head.shape, mesh, within=(AXIS,))
        head = _gathered_forward_only(constrain(head, ("embed", "vocab")), w_spec)  # FSDP's gather (docstring)
        out_spec = logical_to_spec(("batch", "length", "vocab"), (*x.shape[:2], head.shape[1]), mesh, within=manual)
        body = jax.shard_map(lambda x, w: ops.column(x, lambda x: head_matmul(x, w)),
                             in_specs=(x_spec, w_spec), out_specs=out_spec, axis_names=set(manual))
        return body(x, head)


def head_matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [B, L, D] @ head [D, V] -> fp32 logits [B, L, V], both operands in the compute dtype.
    The backward takes the logits' gradient g in the compute dtype, as every other activation's,
    so that its two matmuls run in it with fp32 accumulation: dx = g·Wᵀ [B, L, D] and dW = xᵀ·g
    [D, V], written with x first so that dW leaves its matmul in the weight's layout. Autodiff of
    the fp32 output would widen W and x to fp32 (on XLA CPU 3.5x the forward matmul's time; on a
    GPU off the bf16 tensor cores) and compute gᵀ·x, [V, D], then transpose it (on XLA CPU a
    strided pass over V·D elements, 20% of a dp=8 step's op time). In fp32 compute this is
    autodiff's backward up to the order of dW's sums. Inside a shard_map each operand is first
    made varying over the manual axes the other varies over, as the einsum would, so that the
    rule's gradients have their operands' types and autodiff transposes that step as before."""
    return _head_matmul(varying_as(x, w), varying_as(w, x))


@jax.custom_vjp
def _head_matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    return jnp.einsum("bld,dv->blv", x, w, preferred_element_type=jnp.float32)


def _head_forward(x: jax.Array, w: jax.Array) -> tuple[jax.Array, tuple]:
    return _head_matmul(x, w), (x, w)


def _head_backward(saved: tuple, g: jax.Array) -> tuple[jax.Array, jax.Array]:
    x, w = saved
    g = g.astype(x.dtype)
    dx = jnp.einsum("blv,dv->bld", g, w, preferred_element_type=jnp.float32).astype(x.dtype)
    dw = jnp.einsum("bld,blv->dv", x, g, preferred_element_type=jnp.float32).astype(w.dtype)
    return dx, dw


_head_matmul.defvjp(_head_forward, _head_backward)


def vocab_parallel_take(table: jax.Array, tokens: jax.Array, sequence_parallel: bool = False) -> jax.Array:
    """table [V, D] (V split over tensor), tokens [B, L] -> [B, L, D] ([B, L/T, D] under SP), as
    one region over tensor: each device takes the tokens that fall in its V/T rows (zeros
    elsewhere), then a psum of [B, L, D] over tensor, 2·B·L·D·(T-1)/T elements (under SP a
    reduce-scatter over L, half that; backward an all-gather of dx); backward otherwise a local
    scatter-add. Megatron's vocab-parallel embedding. Under SP, GSPMD's own lookup would
    all-gather the whole table over data and tensor every step (V·D: 525M for Llama 3). The
    batch and sequence axes are manual too: with them automatic, XLA partitions the backward
    scatter-add by all-gathering dx and the tokens over them instead of summing the table's
    gradient there."""
    if axis_size(AXIS) == 1:
        return jnp.take(table, tokens, axis=0)
    mesh, manual = jax.sharding.get_abstract_mesh(), not_manual((*BATCH_AXES, CONTEXT_AXIS, AXIS))  # see below

    def local(rows: jax.Array, ids: jax.Array) -> jax.Array:
        idx = ids - lax.axis_index(AXIS) * rows.shape[0]
        mine = (idx >= 0) & (idx < rows.shape[0])
        x = jnp.take(rows, jnp.clip(idx, 0, rows.shape[0] - 1), axis=0)
        x = jnp.where(mine[..., None], x, jnp.zeros_like(x))
        return lax.psum_scatter(x, AXIS, scatter_dimension=1, tiled=True) if sequence_parallel else lax.psum(x, AXIS)

    ids_spec = logical_to_spec(("batch", "length"), tokens.shape, mesh, within=manual)
    out_names = ("batch", "sp_length" if sequence_parallel else "length", "act_embed")
    out_spec = logical_to_spec(out_names, (*tokens.shape, table.shape[1]), mesh, within=manual)
    return jax.shard_map(local, in_specs=(P(AXIS, None), ids_spec), out_specs=out_spec, axis_names=set(manual),
                         )(table, tokens)
