"""Split a stage's backward into B (input gradient) and W (weight gradient), for zero-bubble
pipeline schedules (Qi et al. 2023, ZB-H1), generic over the stage function.

    y, b_fn, w_fn, residuals = split_vjp(f, params, x)   # f(params, x) -> y
    dx, stash = b_fn(residuals, g)                        # g: cotangent of y
    dparams = w_fn(residuals, stash)

`residuals` (jax.vjp's residuals, including the params and x where the pullback reads them) and
`stash` are flat tuples of arrays, so a pipeline can hold them in preallocated buffers across the
ticks of a `lax.scan` and call b_fn and w_fn in different `lax.switch` branches. b_fn and w_fn
are pure functions of their arguments (they close only over the static split and the pullback's
constants, which depend on f and the shapes, not on the values of params and x): made once, they
serve the residuals of every microbatch of the same shapes (tests/test_split_backward.py runs M
microbatches that way).

How: the pullback of `jax.vjp(f, params, x)` is traced to a jaxpr bwd(residuals, g) ->
(dparams, dx) and split by dataflow, with no autodiff of our own:

  * calls (jit/pjit, checkpoint/remat, closed_call, custom_jvp/vjp calls) are inlined, at every
    level, so their equations can go to different sides;
  * B = every equation that the dx outputs depend on (reverse liveness from dx);
  * W = every other equation that dparams depend on; a value W reads that B computes (or g, or
    a scan carry that B owns) becomes a stash output of B;
  * a `scan` equation with outputs on both sides (the backward scan over stacked layers, whose
    dx carry is B and whose per-layer weight-gradient ys / accumulated const-gradient carries
    are W) is split into two scans of the same length and direction: B's carries are the
    closure (fixpoint) of the carries the dx side needs, W's the rest; the B scan emits, per
    iteration, the values its body computes that the W body reads (stacked over the
    iterations: the stash), and the W scan takes them as xs. This recurses into nested scans
    (a stash value of an inner scan becomes a per-iteration value of the outer one);
  * a `shard_map` equation (an explicit tensor-parallel, context or expert region) is split the
    same way into a B shard_map and a W shard_map over the same mesh and manual axes
    (pipeline/split_map.py): a body stash value leaves B per device, split over the manual axes
    it varies over (all of them in a region without check_vma), and enters W with the same
    type. Kept whole, a region on the dx path ran wholly in B: zb-h1 under explicit TP had no
    matmul left in W (tiny pp=2,tp=2: B 18, W 0; now 11 and 7, as on pp=2);
  * then (shrink_stash=True, the default) a W equation moves to B where that makes the stash
    smaller: all its inputs are values B has anyway, and what W then needs of its outputs is
    smaller than the inputs only it read from the stash (`_shrink_stash`, greedy). Example: with
    remat 'dots' the attention core's output p @ v is recomputed in the backward for dW_o only;
    in W it would make B stash the [b, h, L, L] probabilities, in B it stashes [b, L, h, d].

Every equation of the pullback runs exactly once, in B or in W: B + W do the pullback's work
(dot_general for dot_general, and the same compiled FLOPs for an unrolled stack), and W holds no
dot that dx depends on. What W needs that it cannot read from `residuals` is in the stash: the
output cotangent dy of each matmul (and of each norm, for its scale's gradient), plus, where the
layer is rematerialised, the recomputed forward activations that the dW = x^T dy matmuls read
(they are B's work: recomputing them in W would cost their matmuls twice). The stash is what
ZB-H1 must keep between B and W; `stash_bytes` measures it. Measured (tests/test_split_backward.py):

  MLP stack x + relu(x w1) w2, L layers (batch B, width D, hidden H), fp32:
    remat none / dots_saveable:  B 2 dots, W 2, pullback 4; stash L·B·(D+H)·4 bytes (dy2, dy1)
    remat nothing_saveable:      B 3 dots, W 2, pullback 5; stash L·B·(D+2H)·4 (+ relu(x w1))
  The project's Transformer blocks (tests' small config, attention xla), per scanned block:
    remat none:  B 11 dots, W 7, pullback 18; stash = the 9 dy's (7 matmuls, 2 norms)
    remat full:  B 19, W 7, pullback 26;  dots: B 13, W 7, pullback 20
    MoE (4 experts, remat full), dropless: dot_general B 17 / W 4 / pullback 21 and
    ragged_dot_general B 6 / W 3 / 9; capacity dispatch: B 23 / W 7 / 30
  (dot counts are of equations in the jaxprs, scan bodies once.)
Besides the stash, W reads some residuals (`SplitVJP.w_reads`; a schedule may free the others
after B): with remat 'full' none at all, without remat the saved inputs of the weight matmuls.

Limits:
  * primitives other than scan, shard_map and the inlined calls are atomic: a `cond`/`while`
    equation whose outputs feed dx runs wholly in B (a weight-gradient dot inside it then costs
    B time, not W time; nothing runs twice). The project's models have none in the backward.
  * the cotangent g has the structure of f's output (any pytree); has_aux as jax.vjp's.
  * moving equations to B (shrink_stash) puts some weight-gradient work in B when that saves
    stash memory (the norm scales' reductions, elementwise; an MoE router's dW = x^T dlogits,
    [D, E], which frees the [T, D] input only it reads); never a dot that dx needs in W, never
    twice. shrink_stash=False keeps all weight-gradient work in W. The greedy choice is per
    equation, not a min-cut: a chain whose first step grows and a later step shrinks the stash
    is not moved. Nothing is recomputed in W to save stash (e.g. a norm's output from its saved
    input): every equation stays in one place.
  * equations that neither dx nor dparams depend on are dropped (dead code, e.g. a debug
    callback in the backward).
  * B + W equal the pullback's work, but XLA may fuse the two programs differently (the fp32
    results agree to rounding, not bitwise).
  * the split is made at trace time, once per call of split_vjp (a trace of the pullback plus
    one per scan body and fixpoint step: milliseconds to seconds, no runtime cost).
  * internal JAX surface used: pipeline/jaxpr_eval.py lists it (equation binding, name scopes,
    the params of scan and of the call primitives), plus the pullback object of jax.vjp being a
    pytree whose leaves are its residuals. Checked on jax 0.10.2 and 0.12.

Files: this one is the entry point (split_vjp); pipeline/split_plan.py splits one jaxpr (and
holds `_shrink_stash`), pipeline/split_scan.py a scan equation, pipeline/split_map.py a shard_map
equation, pipeline/jaxpr_eval.py evaluates equations with calls inlined.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pipeline.jaxpr_eval import flatten, spec
from pipeline.split_plan import split_jaxpr


class SplitVJP(NamedTuple):
    y: Any  # f(params, x)
    b_fn: Callable  # (residuals, g) -> (dx, stash)
    w_fn: Callable  # (residuals, stash) -> dparams
    residuals: tuple  # flat tuple of arrays

    @property
    def b_reads(self) -> tuple[bool, ...]:
        """Which residuals b_fn reads (the others may be passed as anything of their shape)."""
        return tuple(self.b_fn.plan.b_invars[:len(self.residuals)])

    @property
    def w_reads(self) -> tuple[bool, ...]:
        """Which residuals w_fn reads: a schedule can free the others after B."""
        return tuple(self.w_fn.plan.w_invars[:len(self.residuals)])


def split_vjp(f: Callable, params: Any, x: Any, *, has_aux: bool = False, shrink_stash: bool = True) -> SplitVJP:
    """jax.vjp(f, params, x) with its pullback split into B (dx) and W (dparams); see the module
    docstring. Works under jit / inside a scan (the split is static, made at trace time).
    has_aux: f returns (output, aux) as for jax.vjp; SplitVJP.y is then (output, aux) and g the
    cotangent of the output. shrink_stash: move W equations into B where that shrinks the stash
    (`_shrink_stash`); False leaves in W everything dx does not need."""
    if has_aux:
        y, pullback, aux = jax.vjp(f, params, x, has_aux=True)
    else:
        y, pullback = jax.vjp(f, params, x)
    residuals, tree = jax.tree.flatten(pullback)
    y_flat, y_tree = jax.tree.flatten(y)
    p_tree = jax.tree.structure(params)
    x_tree = jax.tree.structure(x)
    n_r = len(residuals)

    def bwd(res, g):
        dp, dx = jax.tree.unflatten(tree, res)(jax.tree.unflatten(y_tree, g))
        return [*jax.tree.leaves(dp), *jax.tree.leaves(dx)]

    closed = jax.make_jaxpr(bwd)([spec(jax.typeof(r)) for r in residuals], [spec(jax.typeof(v)) for v in y_flat])
    jaxpr, consts = flatten(closed.jaxpr, closed.consts)
    n_p = p_tree.num_leaves
    n_out = len(jaxpr.outvars)
    w_out = [i < n_p for i in range(n_out)]
    b_out = [i >= n_p for i in range(n_out)]
    direct = [i < n_r for i in range(len(jaxpr.invars))]  # W reads residuals, not g
    plan = split_jaxpr(jaxpr, consts, b_out, w_out, direct, shrink_stash)

    def b_fn(res, g):
        res = list(res)
        g_flat = jax.tree.leaves(g)
        inputs = dict(zip(jaxpr.invars, [*res, *g_flat]))
        dx, stash = plan.eval_b(inputs)
        return jax.tree.unflatten(x_tree, dx), tuple(stash)

    def w_fn(res, stash):
        inputs = dict(zip(jaxpr.invars[:n_r], list(res)))
        dp = plan.eval_w(inputs, list(stash))
        return jax.tree.unflatten(p_tree, dp)

    b_fn.plan = w_fn.plan = plan  # for inspection
    return SplitVJP((y, aux) if has_aux else y, b_fn, w_fn, tuple(residuals))


def stash_bytes(stash: Sequence[Any]) -> int:
    """Bytes of a stash (arrays or ShapeDtypeStructs, e.g. from jax.eval_shape(b_fn, ...))."""
    return sum(int(np.prod(s.shape)) * jnp.dtype(s.dtype).itemsize for s in jax.tree.leaves(stash))
