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

The embedding and the head are regions too, the vocabulary split over tensor, per microbatch
rather than per layer (sharding/vocab_parallel.py).

Bytes per device: all-reduce 2S(T-1)/T; all-gather and reduce-scatter S(T-1)/T each, so SP
moves the same volume as plain TP; a ring moves (T-1)·S/T, the same again.

Column: the matmul needs the whole x on every device. Plain TP has it (x replicated over
tensor; `pcast` to varying is Megatron's "f": identity forward, all-reduce of dx backward).
SP holds x as [B, L/T, D] and all-gathers L first (backward: reduce-scatter of dx). Row: the
partial sums are all-reduced (plain; backward: nothing) or reduce-scattered over L (SP;
backward: all-gather), which leaves [B, L/T, D] for the norms and residual adds: their
activation memory is divided by T.

Overlap (collective matmul, SP only): the all-gather+matmul and the matmul+reduce-scatter each
become a ring of T steps whose collective-permutes hide behind the matmuls
(sharding/collective_matmul.py).

GQA: the kv heads are split over tensor when T divides K. When K < T (K must divide T) the
kv weights are replicated and device t uses kv head t // (T/K) for its N/T query heads (all in
one group); their weight gradients are then summed over tensor, one all-reduce of D·K·H per
kv weight per layer.

The shard_map is manual over `tensor` only: data and fsdp stay automatic, so XLA still splits
the batch and gathers FSDP weights at the region's edge. Under SP it is manual over data and
fsdp too (XLA cannot partition an all-gather over `tensor` of a batch split on an automatic
axis: it would gather the batch). Such a region takes each weight as the device's fsdp shard and
all-gathers it itself, so that its transpose reduce-scatters the gradient over fsdp before the
sum over the other batch axes (TensorParallel.gather_in_region).

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
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from sharding.accumulation import FSDP, automatic, gather
from sharding.collective_matmul import gather_ring, scatter_ring
from sharding.context_parallel import AXIS as CONTEXT_AXIS
from sharding.rules import axis_size, logical_to_spec, not_manual

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
            return gather_ring(x, fn, AXIS, self.size)
        if self.sequence_parallel:
            return fn(lax.all_gather(x, AXIS, axis=1, tiled=True))  # [B, L/T, D] -> [B, L, D]
        return fn(lax.pcast(x, AXIS, to="varying") if self.check_vma else x)

    def row(self, h: jax.Array, fn: Callable) -> jax.Array:
        """fn(h) ([B, L, F/T] -> partial [B, L, D]) summed over tensor, the sum named `SUM`."""
        if self.overlap:
            summed = scatter_ring(h, fn, AXIS, self.size)
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
def gathered_forward_only(w: jax.Array, spec: P) -> jax.Array:
    """w laid out as `spec` (FSDP's all-gather) forward; the cotangent passes unconstrained, so
    GSPMD reduce-scatters the gradient over fsdp as before. A plain constraint transposes to
    one on the cotangent: in the layer scan XLA GPU then all-reduced each layer's gradient over
    data and fsdp whole (125m scanned on dp=2,fsdp=2,tp=2: 127 MB of all-reduce for 80 MB of
    reduce-scatter)."""
    return lax.with_sharding_constraint(w, spec)


gathered_forward_only.defvjp(lambda w, spec: (lax.with_sharding_constraint(w, spec), None),
                              lambda spec, _, g: (g,))


def fsdp_manual(manual: Sequence[str]) -> bool:
    """Whether a region manual over `manual` holds fsdp (of size > 1) itself: it then takes its
    weights as each device's fsdp shard and gathers them (`gathered_inside`)."""
    return FSDP in manual and axis_size(FSDP) > 1


def gathered_inside(w: jax.Array, spec: P, manual: Sequence[str], split: P = P(), typed: bool = True) -> jax.Array:
    """In a region manual over fsdp (and the rest of `manual`): w, the device's fsdp shard laid
    out as `spec`, all-gathered whole over fsdp (sharding/accumulation.gather, on each shard of
    the automatic axes `split` names). The transpose reduce-scatters its gradient over fsdp; the
    region's edge then sums the shard over its other batch axes of size > 1. In a typed region
    (`typed`, check_vma) w is made varying over them before the gather: after it, the sum would
    be of the whole gradient; unchecked, the edge sums each input's cotangent as it came in."""
    if typed:  # over the other axes it is not varying over already (the experts are, over `expert`)
        varying = jax.typeof(w).manual_axis_type.varying
        others = tuple(a for a in manual if a not in (FSDP, AXIS, *varying) and axis_size(a) > 1)
        w = lax.pcast(w, others, to="varying") if others else w
    return gather(spec, w, split)


def gathering(fn: Callable, weights: Weights, specs: dict[str, P], manual: Sequence[str], typed: bool) -> Callable:
    """fn with its weights (`weights`: {name: (array, logical names)}, laid out as `specs`)
    `gathered_inside` first, each on its shards of the axes the region leaves automatic."""
    mesh = jax.sharding.get_abstract_mesh()
    splits = {name: logical_to_spec(names, a.shape, mesh, within=automatic(manual))
              for name, (a, names) in weights.items()}

    def gathered(ops, x, arrays, *consts):
        whole = {name: gathered_inside(w, specs[name], manual, splits[name], typed) for name, w in arrays.items()}
        return fn(ops, x, whole, *consts)

    return gathered


@dataclass(frozen=True)
class TensorParallel:
    """How the model's tensor-parallel regions run (decided by sharding/strategies.py).

    gather_in_checkpoint (set under a remat policy with fsdp > 1): each region first lays its
    weights out as their in_specs (whole over fsdp; forward only: `gathered_forward_only`), so
    that FSDP's all-gather is a value of the layer's checkpoint. Left to the shard_map's edge,
    the gather is redone for the recompute, whose inputs pass an optimization barrier, and
    again for the transpose, which reads the primal weights; unrolled, the recompute also re-ran
    tensor all-reduces. Compiled for H100s under remat full: unrolled on fsdp=4,tp=2
    (bench/results/fsdp-tp-remat-h100-compiled.json) 125m's fsdp bytes 0.68x, tensor 1.20x the
    contract to 1.00x, peak memory 0.90x; 1b 0.58x, 1.20x to 1.00x, 0.78x. In the layer scan
    (fsdp-tp-remat-scan-h100-compiled.json) the fsdp bytes 0.86x (125m) and 0.90x (llama3-8b
    and -70b with 4 and 2 layers; the rest was the head's second gather, see
    vocab_parallel.vocab_parallel_logits) at the same memory (0.99-1.00x). Not under remat none: the gathered weights would be kept whole as
    residuals from each layer's forward to its backward (the head's, gathered so under every
    policy, lives from the loss's forward to its backward, next to each other). XLA CPU's fp32
    program holds one more copy of the device's layer weights with it (tests/test_plan.py
    counts it).

    gather_in_region (set with fsdp > 1 where the layers are scanned or under remat none): a
    region manual over fsdp (under SP, or context parallelism) takes each weight as the
    device's fsdp shard and all-gathers it inside (`gathering`), so that the transpose
    reduce-scatters each gradient over fsdp and then sums the shard over the region's other
    batch axes: ZeRO-3's reduction, and data's on 1/f of it. Given the weight whole over fsdp,
    the region's transpose summed the whole gradient over all its batch axes in one
    all-reduce, and XLA GPU split that into a reduce-scatter only where fsdp was the one axis
    or the layers unrolled beside `sequence`. Compiled for H100s: 125m scanned on fsdp=4,sp=2
    (ring, remat none) moved 297 MB of all-reduce over fsdp+sequence, 1.90 GB in all; now
    1.73 GB, what the unrolled layers move; on dp=2,fsdp=2,tp=2 with SP (unrolled) the 203 MB
    all-reduce over data+fsdp (the layers', the embedding's and head's: their regions gather
    the same way, sharding/vocab_parallel.py) is a reduce-scatter and an all-reduce of 67.6 MB
    each (bench/results/region-fsdp-h100-compiled.json). Unrolled under a remat policy
    gather_in_checkpoint's one gather stays: gathered inside the checkpoint, the recompute
    would gather again."""

    impl: str = "shard_map"
    sequence_parallel: bool = False
    overlap: bool = False
    check_vma: bool = True  # False around the fused cores, pallas and cudnn (see the module docstring)
    context: bool = False  # context parallelism: the regions are manual over `sequence` too
    gather_in_checkpoint: bool = False  # the layers run under a remat policy: gather weights in it (region)
    gather_in_region: bool = False  # a region manual over fsdp gathers its weights itself (class docstring)

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
        fsdp = self.gather_in_region and fsdp_manual(manual)
        within = (AXIS,) * tensor + (FSDP,) * fsdp
        specs = {name: logical_to_spec(names, a.shape, mesh, within=within) for name, (a, names) in weights.items()}
        if self.gather_in_checkpoint and not fsdp:  # FSDP's gather as a value of the layer's checkpoint (class docstring)
            arrays = {name: gathered_forward_only(a, specs[name]) for name, a in arrays.items()}
        x_spec = logical_to_spec(self.activation_names, x.shape, mesh, within=manual)
        const_spec = P(CONTEXT_AXIS) if CONTEXT_AXIS in manual else P()
        # nested in a region manual over sequence (the step's accumulation), the attention's ring
        # or all-gather over it would type x as varying there, and the layer scan's transpose,
        # whose cotangent comes from that unchecked region, refuses the mismatch: run it unchecked
        check_vma = not kernel or (self.check_vma and CONTEXT_AXIS not in mesh.manual_axes)
        ops = Sharded(size, self.sequence_parallel, self.overlap, check_vma) if tensor else Local()
        if fsdp:  # each device's fsdp shard in, gathered inside (class docstring)
            fn = gathering(fn, weights, specs, manual, check_vma)
        body = jax.shard_map(
            functools.partial(fn, ops), in_specs=(x_spec, specs, *(const_spec,) * len(consts)),
            out_specs=x_spec, axis_names=set(manual), check_vma=check_vma,
        )
        return body(x, arrays, *consts)
