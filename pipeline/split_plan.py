"""The split of one call-free jaxpr (the pullback, a scan or shard_map body) into B and W by
dataflow: which equations each side runs, what B stashes for W, and the evaluation of either side.

B is the reverse liveness from B's outputs (dx); W the equations, not in B, that W's outputs
(dparams) depend on; a value W reads that B defines is stashed. A scan or shard_map equation
with outputs on both sides is split into two (pipeline/split_scan.py, split_map.py), which split
their bodies with this same function. `shrink_stash` then moves W equations into B where that
shrinks the stash. The why and the measured results are in pipeline/split_backward.py's docstring.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from jax.extend.core import Jaxpr

from pipeline.jaxpr_eval import as_out, bind, is_var, nbytes, read, var_order, varying
from pipeline.split_map import MapSplit
from pipeline.split_scan import ScanSplit

# equations split in two (their bodies by split_jaxpr) where they have outputs on both sides
SPLITS = {"scan": ScanSplit, "shard_map": MapSplit}


@dataclass
class Plan:
    """Which equations of `jaxpr` run in B and which in W (indices, program order), the scan and
    shard_map equations split in two, and the values B stashes for W; `eval_b` / `eval_w` run
    either side."""

    jaxpr: Jaxpr
    consts: list
    b_out: list[bool]  # outputs B computes
    w_out: list[bool]  # outputs W computes
    b_eqns: list[int] = field(default_factory=list)
    w_eqns: list[int] = field(default_factory=list)
    splits: dict = field(default_factory=dict)  # eqn index -> ScanSplit or MapSplit
    stash_vars: list = field(default_factory=list)  # values of B (or B-side inputs) that W reads
    b_invars: list[bool] = field(default_factory=list)  # inputs B reads
    w_invars: list[bool] = field(default_factory=list)  # inputs W reads directly (not stashed)

    @property
    def n_stash(self) -> int:
        return len(self.stash_vars) + sum(s.body.n_stash for s in self._stash_splits())

    def stash_varying(self) -> list[frozenset]:
        """The manual mesh axes each stash value varies over, in eval_b's order."""
        inner = [t for split in self._stash_splits() for t in split.stash_varying()]
        return [varying(v.aval) for v in self.stash_vars] + inner

    def _stash_splits(self) -> list:
        return [self.splits[i] for i in self.b_eqns if i in self.splits and self.splits[i].has_w]

    # -- evaluation

    def _run(self, env: dict, eqns: Sequence[int], run_split: Callable) -> None:
        """Evaluate the equations `eqns` into env; a split equation's outputs come from
        run_split(index) (None where this side does not compute them)."""
        for i in eqns:
            eqn = self.jaxpr.eqns[i]
            outs = run_split(i) if i in self.splits else bind(eqn, [read(env, v) for v in eqn.invars])
            for v, o in zip(eqn.outvars, outs):
                if o is not None:
                    env[v] = o

    def eval_b(self, inputs: dict) -> tuple[list, list]:
        """inputs: invar -> value (at least the inputs B reads). Returns (B outputs, stash)."""
        env = dict(zip(self.jaxpr.constvars, self.consts))
        env.update(inputs)
        inner: list = []

        def split_b(i: int) -> list:
            outs, stash = self.splits[i].run_b(env)
            inner.extend(stash)
            return outs

        self._run(env, self.b_eqns, split_b)
        outs = [as_out(read(env, v), v.aval) for v, b in zip(self.jaxpr.outvars, self.b_out) if b]
        stash = [env[v] for v in self.stash_vars] + inner
        return outs, stash

    def eval_w(self, inputs: dict, stash: Sequence[Any]) -> list:
        """inputs: invar -> value (at least the inputs W reads directly); stash from eval_b."""
        env = dict(zip(self.jaxpr.constvars, self.consts))
        env.update(inputs)
        n = len(self.stash_vars)
        env.update(zip(self.stash_vars, stash[:n]))
        inner = {}
        for i in self.b_eqns:  # the stash of split equations, in B's order
            if i in self.splits and self.splits[i].has_w:
                k = self.splits[i].body.n_stash
                inner[i] = list(stash[n:n + k])
                n += k
        assert n == len(stash), (n, len(stash))
        self._run(env, self.w_eqns, lambda i: self.splits[i].run_w(env, inner.get(i, [])))
        return [as_out(read(env, v), v.aval) for v, w in zip(self.jaxpr.outvars, self.w_out) if w]


def split_jaxpr(jaxpr: Jaxpr, consts: list, b_out: Sequence[bool], w_out: Sequence[bool],
          w_direct: Sequence[bool], shrink: bool) -> Plan:
    """Split `jaxpr` (call-free): B computes the outputs b_out, W those of w_out; W may read the
    inputs marked w_direct itself, any other value it needs from B comes through the stash."""
    plan = Plan(jaxpr, consts, list(b_out), list(w_out))
    eqns = jaxpr.eqns
    # B: reverse liveness from B's outputs
    need_b = {v for v, b in zip(jaxpr.outvars, b_out) if b and is_var(v)}
    b_set: list[int] = []
    for i in reversed(range(len(eqns))):
        eqn = eqns[i]
        used = [is_var(o) and o in need_b for o in eqn.outvars]
        if not any(used):
            continue
        b_set.append(i)
        if eqn.primitive.name in SPLITS:
            split = SPLITS[eqn.primitive.name](eqn, used, shrink, split_jaxpr)
            plan.splits[i] = split
            ins = [v for v, u in zip(eqn.invars, split.b_in) if u]
        else:
            ins = eqn.invars
        need_b.update(v for v in ins if is_var(v))
    plan.b_eqns = sorted(b_set)
    in_b = set(plan.b_eqns)
    # the values B defines (for a split equation, only the outputs its B part computes)
    b_defined = {v for v, d in zip(jaxpr.invars, w_direct) if not d}
    for i in plan.b_eqns:
        eqn = eqns[i]
        keep = plan.splits[i].b_outs if i in plan.splits else [True] * len(eqn.outvars)
        b_defined.update(o for o, k in zip(eqn.outvars, keep) if k and is_var(o))
    # W: reverse liveness from W's outputs over what B does not compute
    need_w = {v for v, w in zip(jaxpr.outvars, w_out) if w and is_var(v)}
    w_set: list[int] = []
    for i in reversed(range(len(eqns))):
        eqn = eqns[i]
        if eqn.primitive.name in SPLITS:
            split = plan.splits.get(i)
            b_outs = split.b_outs if split else [False] * len(eqn.outvars)
            want = [is_var(o) and o in need_w and not bo for o, bo in zip(eqn.outvars, b_outs)]
            if not any(want):
                continue
            if split is None:
                split = SPLITS[eqn.primitive.name](eqn, [False] * len(eqn.outvars), shrink, split_jaxpr)
                plan.splits[i] = split
            split.add_w(want)
            w_set.append(i)
            need_w.update(v for v, u in zip(eqn.invars, split.w_in) if u and is_var(v))
        elif i not in in_b and any(is_var(o) and o in need_w for o in eqn.outvars):
            w_set.append(i)
            need_w.update(v for v in eqn.invars if is_var(v))
    # how many W equations (and W outputs) read each value
    uses: dict = {}
    for i in w_set:
        eqn = eqns[i]
        mask = plan.splits[i].w_in if i in plan.splits else [True] * len(eqn.invars)
        for v in {v for v, u in zip(eqn.invars, mask) if u and is_var(v)}:
            uses[v] = uses.get(v, 0) + 1
    for v, w in zip(jaxpr.outvars, w_out):
        if w and is_var(v):
            uses[v] = uses.get(v, 0) + 1
    if shrink:
        _shrink_stash(jaxpr, plan, b_set, w_set, b_defined, need_b, uses)
    plan.b_eqns = sorted(b_set)
    plan.w_eqns = sorted(w_set)
    plan.stash_vars = sorted((v for v, n in uses.items() if n and v in b_defined), key=var_order(jaxpr))
    plan.b_invars = [v in need_b for v in jaxpr.invars]
    plan.w_invars = [bool(uses.get(v)) and d for v, d in zip(jaxpr.invars, w_direct)]
    return plan


def _shrink_stash(jaxpr: Jaxpr, plan: Plan, b_set: list, w_set: list, b_defined: set, need_b: set,
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
            ins = {v for v in eqn.invars if is_var(v)}
            if i in plan.splits or not ins <= have:
                continue
            freed = sum(nbytes(v) for v in ins if v in b_defined and uses.get(v) == 1)
            kept = sum(nbytes(o) for o in eqn.outvars if is_var(o) and uses.get(o))
            if kept >= freed:
                continue
            w_set.remove(i)
            b_set.append(i)
            for v in ins:
                uses[v] -= 1
            outs = {o for o in eqn.outvars if is_var(o)}
            b_defined |= outs
            have |= outs
            moved = True
