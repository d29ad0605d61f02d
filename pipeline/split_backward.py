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
  * primitives other than scan and the inlined calls are atomic: a `cond`/`while` equation whose
    outputs feed dx runs wholly in B (a weight-gradient dot inside it then costs B time, not
    W time; nothing runs twice). The project's models have none in the backward.
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
  * internal JAX surface used (this module only): eqn.primitive.bind/get_bind_params,
    jax._src.source_info_util (optional: the equations' name scopes, as core.eval_jaxpr sets them),
    eqn.params of scan (jaxpr, length, reverse, unroll, and num_consts/num_carry on jax 0.10
    or the flat trees ft_in on jax 0.12: `_scan_counts`) and of the call
    primitives, jax.extend.core.{Literal, Var, ClosedJaxpr, Jaxpr}, and the pullback object of
    jax.vjp being a pytree whose leaves are its residuals. Checked on jax 0.10.2 and 0.12.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal, Var

try:  # internal: only to carry the equations' name scopes into b_fn / w_fn
    from jax._src import source_info_util as _source_info
except ImportError:  # pragma: no cover
    _source_info = None

# Call-like primitives whose body is inlined before splitting: (param holding the body).
_CALL_PARAMS = ("jaxpr", "call_jaxpr", "fun_jaxpr")
_CALLS = {"pjit", "jit", "closed_call", "core_call", "checkpoint", "remat", "remat2", "custom_jvp_call",
          "custom_vjp_call", "custom_vjp_call_jaxpr", "custom_lin"}


# ---------------------------------------------------------------------------------------------
# Evaluation helpers


def _read(env: dict, v: Any) -> Any:
    return v.val if isinstance(v, Literal) else env[v]


def _context(eqn) -> contextlib.ExitStack:
    """The equation's context (as core.eval_jaxpr sets it): its name scope (so that b_fn and w_fn
    keep the model's named scopes in profiles), traceback and JaxprEqnContext, where present."""
    stack = contextlib.ExitStack()
    info = getattr(eqn, "source_info", None)
    if _source_info is not None and info is not None:
        stack.enter_context(_source_info.user_context(
            info.traceback, name_stack=_source_info.current_name_stack() + info.name_stack))
    ctx = getattr(eqn, "ctx", None)
    if ctx is not None and hasattr(ctx, "manager"):
        stack.enter_context(ctx.manager)
    return stack


def _bind(eqn, invals: Sequence[Any]) -> list[Any]:
    params = eqn.primitive.get_bind_params(eqn.params)
    with _context(eqn):
        out = eqn.primitive.bind(*invals, **params)
    return list(out) if eqn.primitive.multiple_results else [out]


def _callee(eqn) -> tuple[Jaxpr, list] | None:
    """The body of a call-like equation (jaxpr, consts), or None."""
    if eqn.primitive.name not in _CALLS:
        return None
    for name in _CALL_PARAMS:
        body = eqn.params.get(name)
        if isinstance(body, ClosedJaxpr):
            body_j, consts = body.jaxpr, list(body.consts)
        elif isinstance(body, Jaxpr):
            body_j, consts = body, []
        else:
            continue
        if len(body_j.invars) == len(eqn.invars) and len(body_j.outvars) == len(eqn.outvars):
            return body_j, consts
    return None


def _inline_eval(jaxpr: Jaxpr, consts: Sequence[Any], args: Sequence[Any]) -> list[Any]:
    env: dict = {}
    for v, a in zip(jaxpr.constvars, consts):
        env[v] = a
    for v, a in zip(jaxpr.invars, args):
        env[v] = a
    for eqn in jaxpr.eqns:
        invals = [_read(env, v) for v in eqn.invars]
        sub = _callee(eqn)
        outs = _inline_eval(sub[0], sub[1], invals) if sub is not None else _bind(eqn, invals)
        for v, o in zip(eqn.outvars, outs):
            env[v] = o
    return [_read(env, v) for v in jaxpr.outvars]


def _spec(aval) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=getattr(aval, "weak_type", False))


def _flatten(jaxpr: Jaxpr, consts: Sequence[Any]) -> tuple[Jaxpr, list]:
    """The same function with every call-like equation inlined (scan bodies are left for later)."""
    closed = jax.make_jaxpr(lambda *a: _inline_eval(jaxpr, consts, a))(*[_spec(v.aval) for v in jaxpr.invars])
    return closed.jaxpr, list(closed.consts)


def _is_var(v: Any) -> bool:
    return isinstance(v, Var) and type(v).__name__ != "DropVar"


def _as_out(val: Any, aval) -> Any:
    """A jaxpr output as an array of its aval (literal outputs are Python scalars)."""
    return jnp.broadcast_to(jnp.asarray(val, aval.dtype), aval.shape)


# ---------------------------------------------------------------------------------------------
# The split of one jaxpr (the pullback, or a scan body)


@dataclass
class _Plan:
    jaxpr: Jaxpr
    consts: list
    b_out: list[bool]  # outputs B computes
    w_out: list[bool]  # outputs W computes
    b_eqns: list[int] = field(default_factory=list)
    w_eqns: list[int] = field(default_factory=list)
    scans: dict = field(default_factory=dict)  # eqn index -> _ScanSplit
    stash_vars: list = field(default_factory=list)  # values of B (or B-side inputs) that W reads
    b_invars: list[bool] = field(default_factory=list)  # inputs B reads
    w_invars: list[bool] = field(default_factory=list)  # inputs W reads directly (not stashed)

    @property
    def n_stash(self) -> int:
        return len(self.stash_vars) + sum(s.body.n_stash for s in self._stash_scans())

    def _stash_scans(self) -> list:
        return [self.scans[i] for i in self.b_eqns if i in self.scans and self.scans[i].has_w]

    # -- evaluation

    def _run(self, env: dict, eqns: Sequence[int], split_scan: Callable) -> None:
        """Evaluate the equations `eqns` into env; a split scan's outputs come from
        split_scan(index) (None where this side does not compute them)."""
        for i in eqns:
            eqn = self.jaxpr.eqns[i]
            outs = split_scan(i) if i in self.scans else _bind(eqn, [_read(env, v) for v in eqn.invars])
            for v, o in zip(eqn.outvars, outs):
                if o is not None:
                    env[v] = o

    def eval_b(self, inputs: dict) -> tuple[list, list]:
        """inputs: invar -> value (at least the inputs B reads). Returns (B outputs, stash)."""
        env = dict(zip(self.jaxpr.constvars, self.consts))
        env.update(inputs)
        inner: list = []

        def scan_b(i: int) -> list:
            outs, stash = self.scans[i].run_b(env)
            inner.extend(stash)
            return outs

        self._run(env, self.b_eqns, scan_b)
        outs = [_as_out(_read(env, v), v.aval) for v, b in zip(self.jaxpr.outvars, self.b_out) if b]
        stash = [env[v] for v in self.stash_vars] + inner
        return outs, stash

    def eval_w(self, inputs: dict, stash: Sequence[Any]) -> list:
        """inputs: invar -> value (at least the inputs W reads directly); stash from eval_b."""
        env = dict(zip(self.jaxpr.constvars, self.consts))
        env.update(inputs)
        n = len(self.stash_vars)
        env.update(zip(self.stash_vars, stash[:n]))
        inner = {}
        for i in self.b_eqns:  # the stash of split scans, in B's order
            if i in self.scans and self.scans[i].has_w:
                k = self.scans[i].body.n_stash
                inner[i] = list(stash[n:n + k])
                n += k
        assert n == len(stash), (n, len(stash))
        self._run(env, self.w_eqns, lambda i: self.scans[i].run_w(env, inner.get(i, [])))
        return [_as_out(_read(env, v), v.aval) for v, w in zip(self.jaxpr.outvars, self.w_out) if w]


def _plan(jaxpr: Jaxpr, consts: list, b_out: Sequence[bool], w_out: Sequence[bool],
          w_direct: Sequence[bool], shrink: bool) -> _Plan:
    """Split `jaxpr` (call-free): B computes the outputs b_out, W those of w_out; W may read the
    inputs marked w_direct itself, any other value it needs from B comes through the stash."""
    plan = _Plan(jaxpr, consts, list(b_out), list(w_out))
    eqns = jaxpr.eqns
    # B: reverse liveness from B's outputs
    need_b = {v for v, b in zip(jaxpr.outvars, b_out) if b and _is_var(v)}
    b_set: list[int] = []
    for i in reversed(range(len(eqns))):
        eqn = eqns[i]
        used = [_is_var(o) and o in need_b for o in eqn.outvars]
        if not any(used):
            continue
        b_set.append(i)
        if eqn.primitive.name == "scan":
            split = _ScanSplit(eqn, used, shrink)
            plan.scans[i] = split
            ins = [v for v, u in zip(eqn.invars, split.b_in) if u]
        else:
            ins = eqn.invars
        need_b.update(v for v in ins if _is_var(v))
    plan.b_eqns = sorted(b_set)
    in_b = set(plan.b_eqns)
    # the values B defines (for a split scan, only the outputs its B part computes)
    b_defined = {v for v, d in zip(jaxpr.invars, w_direct) if not d}
    for i in plan.b_eqns:
        eqn = eqns[i]
        keep = plan.scans[i].b_outs if i in plan.scans else [True] * len(eqn.outvars)
        b_defined.update(o for o, k in zip(eqn.outvars, keep) if k and _is_var(o))
    # W: reverse liveness from W's outputs over what B does not compute
    need_w = {v for v, w in zip(jaxpr.outvars, w_out) if w and _is_var(v)}
    w_set: list[int] = []
    for i in reversed(range(len(eqns))):
        eqn = eqns[i]
        if eqn.primitive.name == "scan":
            split = plan.scans.get(i)
            b_outs = split.b_outs if split else [False] * len(eqn.outvars)
            want = [_is_var(o) and o in need_w and not bo for o, bo in zip(eqn.outvars, b_outs)]
            if not any(want):
                continue
            if split is None:
                split = plan.scans[i] = _ScanSplit(eqn, [False] * len(eqn.outvars), shrink)
            split.add_w(want)
            w_set.append(i)
            need_w.update(v for v, u in zip(eqn.invars, split.w_in) if u and _is_var(v))
        elif i not in in_b and any(_is_var(o) and o in need_w for o in eqn.outvars):
            w_set.append(i)
            need_w.update(v for v in eqn.invars if _is_var(v))
    # how many W equations (and W outputs) read each value
    uses: dict = {}
    for i in w_set:
        eqn = eqns[i]
        mask = plan.scans[i].w_in if i in plan.scans else [True] * len(eqn.invars)
        for v in {v for v, u in zip(eqn.invars, mask) if u and _is_var(v)}:
            uses[v] = uses.get(v, 0) + 1
    for v, w in zip(jaxpr.outvars, w_out):
        if w and _is_var(v):
            uses[v] = uses.get(v, 0) + 1
    if shrink:
        _shrink_stash(jaxpr, plan, b_set, w_set, b_defined, need_b, uses)
    plan.b_eqns = sorted(b_set)
    plan.w_eqns = sorted(w_set)
    plan.stash_vars = sorted((v for v, n in uses.items() if n and v in b_defined), key=_order(jaxpr))
    plan.b_invars = [v in need_b for v in jaxpr.invars]
    plan.w_invars = [bool(uses.get(v)) and d for v, d in zip(jaxpr.invars, w_direct)]
    return plan


def _nbytes(v) -> int:
    return int(np.prod(v.aval.shape)) * jnp.dtype(v.aval.dtype).itemsize


def _shrink_stash(jaxpr: Jaxpr, plan: _Plan, b_set: list, w_set: list, b_defined: set, need_b: set,
                  uses: dict) -> None:
    """Move W equations into B where that makes the stash smaller (greedy, in program order,
    until nothing moves): an equation whose inputs B has anyway, whose outputs W keeps are
    smaller than the inputs only it reads from the stash. E.g. the recomputed attention output
    p @ v under a policy that saves neither (only dW_o reads it): W would need the [b, h, L, L]
    probabilities from B; B computes p @ v and stashes the [b, L, h, d] output instead. A moved
    equation runs in B, once; the total work is unchanged."""
    have = b_defined | (need_b & set(jaxpr.invars)) | set(jaxpr.constvars)
    moved = True
    while moved:
        moved = False
        for i in sorted(w_set):
            eqn = jaxpr.eqns[i]
            ins = {v for v in eqn.invars if _is_var(v)}
            if i in plan.scans or not ins <= have:
                continue
            freed = sum(_nbytes(v) for v in ins if v in b_defined and uses.get(v) == 1)
            kept = sum(_nbytes(o) for o in eqn.outvars if _is_var(o) and uses.get(o))
            if kept >= freed:
                continue
            w_set.remove(i)
            b_set.append(i)
            for v in ins:
                uses[v] -= 1
            outs = {o for o in eqn.outvars if _is_var(o)}
            b_defined |= outs
            have |= outs
            moved = True


def _order(jaxpr: Jaxpr) -> Callable:
    """A deterministic order of a jaxpr's variables (definition order)."""
    pos: dict = {}
    for v in [*jaxpr.constvars, *jaxpr.invars]:
        pos.setdefault(v, len(pos))
    for eqn in jaxpr.eqns:
        for o in eqn.outvars:
            pos.setdefault(o, len(pos))
    return lambda v: pos[v]


def _scan_counts(params: dict) -> tuple[int, int]:
    """(consts, carries) of a scan equation: num_consts/num_carry params (jax <= 0.10), or the
    lengths of the flat trees ft_in = (consts, carry, xs) (jax 0.12)."""
    if "num_consts" in params:
        return params["num_consts"], params["num_carry"]
    consts, carry, _ = params["ft_in"].unpack()
    return len(consts), len(carry)


class _ScanSplit:
    """One scan equation of a plan, split into a B scan and a W scan.

    B's carries Kb: the carries whose final value B needs, closed under "the B body reads this
    carry's input". W's carries Kw: those W needs, not in Kb, closed likewise. The B scan returns
    its outputs plus, stacked over iterations, the body stash; the W scan reads that stash as xs.
    """

    def __init__(self, eqn, b_used: Sequence[bool], shrink: bool):
        p = eqn.params
        self.eqn, self.shrink = eqn, shrink
        self.nc, self.nk = _scan_counts(p)
        self.length, self.reverse, self.unroll = p["length"], p["reverse"], p["unroll"]
        body_j, body_c = _flatten(p["jaxpr"].jaxpr, p["jaxpr"].consts)
        self.body_j, self.body_c = body_j, body_c
        n_in, n_out = len(eqn.invars), len(eqn.outvars)
        self.nx = n_in - self.nc - self.nk
        self.ny = n_out - self.nk
        kb = {k for k in range(self.nk) if b_used[k]}
        yb = list(b_used[self.nk:])
        while True:
            body = self._body_plan(kb, yb, set(), [False] * self.ny)
            more = {k for k in range(self.nk) if body.b_invars[self.nc + k]} - kb
            if not more:
                break
            kb |= more
        self.kb, self.yb = kb, yb
        self.kw: set = set()
        self.yw = [False] * self.ny
        self.body = body
        self.has_w = False

    @property
    def b_outs(self) -> list[bool]:
        return [k in self.kb for k in range(self.nk)] + list(self.yb)

    @property
    def has_b(self) -> bool:
        return bool(self.kb) or any(self.yb)

    def _body_plan(self, kb: set, yb: list, kw: set, yw: list) -> _Plan:
        b_out = [k in kb for k in range(self.nk)] + list(yb)
        w_out = [k in kw for k in range(self.nk)] + list(yw)
        direct = [True] * self.nc + [k in kw for k in range(self.nk)] + [True] * self.nx
        return _plan(self.body_j, self.body_c, b_out, w_out, direct, self.shrink)

    def add_w(self, want: Sequence[bool]) -> None:
        kw = self.kw | {k for k in range(self.nk) if want[k] and k not in self.kb}
        yw = [a or b for a, b in zip(self.yw, want[self.nk:])]
        while True:
            body = self._body_plan(self.kb, self.yb, kw, yw)
            reads = {k for k in range(self.nk) if body.w_invars[self.nc + k]} | {
                k for k in range(self.nk) if body.jaxpr.invars[self.nc + k] in body.stash_vars and k not in self.kb}
            more = reads - kw
            if not more:
                break
            kw |= more
        self.kw, self.yw, self.body = kw, yw, body
        self.has_w = bool(kw) or any(yw)

    @property
    def b_in(self) -> list[bool]:
        """Which of the equation's inputs the B scan reads."""
        bi = self.body.b_invars
        return [bi[j] for j in range(self.nc)] + [k in self.kb for k in range(self.nk)] + \
            [bi[self.nc + self.nk + j] for j in range(self.nx)]

    @property
    def w_in(self) -> list[bool]:
        """Which of the equation's inputs the W scan reads."""
        wi = self.body.w_invars
        return [wi[j] for j in range(self.nc)] + [k in self.kw for k in range(self.nk)] + \
            [wi[self.nc + self.nk + j] for j in range(self.nx)]

    def _split_invars(self):
        iv = self.body_j.invars
        return iv[:self.nc], iv[self.nc:self.nc + self.nk], iv[self.nc + self.nk:]

    def _scan_args(self, env: dict, uses: Sequence[bool], body_uses: Sequence[bool], carries: Any) -> tuple:
        """What one side's scan reads: (its body consts {var: value}, the body's carry and xs
        invars, the side's carry indices, its xs indices, the initial carries, the xs)."""
        c_in, k_in, x_in = self._split_invars()
        ins = [_read(env, v) if u else None for v, u in zip(self.eqn.invars, uses)]
        consts = {c_in[j]: ins[j] for j in range(self.nc) if body_uses[j]}
        ks = sorted(carries)
        xj = [j for j in range(self.nx) if body_uses[self.nc + self.nk + j]]
        return (consts, k_in, x_in, ks, xj, [ins[self.nc + k] for k in ks],
                [ins[self.nc + self.nk + j] for j in xj])

    def run_b(self, env: dict) -> tuple[list, list]:
        """The B scan. Returns (the equation's outputs, None where B does not compute them; the
        stacked stash)."""
        eqn, body = self.eqn, self.body
        if not self.has_b:
            return [None] * len(eqn.outvars), []
        consts, k_in, x_in, kb, xj, init, xs = self._scan_args(env, self.b_in, body.b_invars, self.kb)

        def step(carry, x):
            inputs = dict(consts)
            inputs.update(zip([k_in[k] for k in kb], carry))
            inputs.update(zip([x_in[j] for j in xj], x))
            outs, stash = body.eval_b(inputs)
            return outs[:len(kb)], (outs[len(kb):], stash)

        carry, (ys, stash) = jax.lax.scan(step, init, xs, length=self.length, reverse=self.reverse,
                                          unroll=self.unroll)
        out: list = [None] * len(eqn.outvars)
        for k, c in zip(kb, carry):
            out[k] = c
        for j, y in zip([j for j in range(self.ny) if self.yb[j]], ys):
            out[self.nk + j] = y
        return out, list(stash)

    def run_w(self, env: dict, stash: Sequence[Any]) -> list:
        """The W scan, reading B's stacked stash. Returns the equation's outputs (None where W
        does not compute them)."""
        eqn, body = self.eqn, self.body
        consts, k_in, x_in, kw, xj, init, xs = self._scan_args(env, self.w_in, body.w_invars, self.kw)

        def step(carry, x):
            xv, st = x
            inputs = dict(consts)
            inputs.update(zip([k_in[k] for k in kw], carry))
            inputs.update(zip([x_in[j] for j in xj], xv))
            outs = body.eval_w(inputs, st)
            return outs[:len(kw)], outs[len(kw):]

        carry, ys = jax.lax.scan(step, init, (xs, list(stash)), length=self.length, reverse=self.reverse,
                                 unroll=self.unroll)
        out: list = [None] * len(eqn.outvars)
        for k, c in zip(kw, carry):
            out[k] = c
        for j, y in zip([j for j in range(self.ny) if self.yw[j]], ys):
            out[self.nk + j] = y
        return out


# ---------------------------------------------------------------------------------------------
# Public API


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

    closed = jax.make_jaxpr(bwd)([_spec(jax.typeof(r)) for r in residuals], [_spec(jax.typeof(v)) for v in y_flat])
    jaxpr, consts = _flatten(closed.jaxpr, closed.consts)
    n_p = p_tree.num_leaves
    n_out = len(jaxpr.outvars)
    w_out = [i < n_p for i in range(n_out)]
    b_out = [i >= n_p for i in range(n_out)]
    direct = [i < n_r for i in range(len(jaxpr.invars))]  # W reads residuals, not g
    plan = _plan(jaxpr, consts, b_out, w_out, direct, shrink_stash)

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


def count_prims(closed: Any, name: str = "dot_general") -> int:
    """Equations named `name` in a (closed) jaxpr, counted through every sub-jaxpr (scan bodies,
    remat, pjit, cond branches), each once (not times a scan's length)."""
    jaxpr = closed.jaxpr if isinstance(closed, ClosedJaxpr) else closed
    n = 0
    for eqn in jaxpr.eqns:
        n += eqn.primitive.name == name
        for p in eqn.params.values():
            for sub in (p if isinstance(p, (tuple, list)) else [p]):
                if isinstance(sub, (ClosedJaxpr, Jaxpr)):
                    n += count_prims(sub, name)
    return n
