"""One scan equation of a split (the backward scan over the stacked layers), split into a B
scan and a W scan of the same length and direction (pipeline/split_backward.py's docstring).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax

from pipeline.jaxpr_eval import flatten, read, scan_counts


class ScanSplit:
    """One scan equation of a plan, split into a B scan and a W scan.

    B's carries Kb: the carries whose final value B needs, closed under "the B body reads this
    carry's input". W's carries Kw: those W needs, not in Kb, closed likewise. The B scan returns
    its outputs plus, stacked over iterations, the body stash; the W scan reads that stash as xs.
    `split_body` is the planner that split this scan's jaxpr (split_plan.split_jaxpr): the body
    is split by the same rules, recursively for nested scans.
    """

    def __init__(self, eqn, b_used: Sequence[bool], shrink: bool, split_body: Callable):
        p = eqn.params
        self.eqn, self.shrink, self.split_body = eqn, shrink, split_body
        self.nc, self.nk = scan_counts(p)
        self.length, self.reverse, self.unroll = p["length"], p["reverse"], p["unroll"]
        body_j, body_c = flatten(p["jaxpr"].jaxpr, p["jaxpr"].consts)
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

    def stash_varying(self) -> list[frozenset]:
        """The manual mesh axes each stacked stash array varies over (its body value's)."""
        return self.body.stash_varying()

    @property
    def b_outs(self) -> list[bool]:
        return [k in self.kb for k in range(self.nk)] + list(self.yb)

    @property
    def has_b(self) -> bool:
        return bool(self.kb) or any(self.yb)

    def _body_plan(self, kb: set, yb: list, kw: set, yw: list):
        b_out = [k in kb for k in range(self.nk)] + list(yb)
        w_out = [k in kw for k in range(self.nk)] + list(yw)
        direct = [True] * self.nc + [k in kw for k in range(self.nk)] + [True] * self.nx
        return self.split_body(self.body_j, self.body_c, b_out, w_out, direct, self.shrink)

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
        ins = [read(env, v) if u else None for v, u in zip(self.eqn.invars, uses)]
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
        return self._outputs(kb, carry, self.yb, ys), list(stash)

    def run_w(self, env: dict, stash: Sequence[Any]) -> list:
        """The W scan, reading B's stacked stash. Returns the equation's outputs (None where W
        does not compute them)."""
        body = self.body
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
        return self._outputs(kw, carry, self.yw, ys)

    def _outputs(self, carries: Sequence[int], carry: Sequence[Any], ys_mask: Sequence[bool],
                 ys: Sequence[Any]) -> list:
        """The equation's outputs from one side's scan: its final `carries` and its ys (those of
        `ys_mask`), None where the other side computes them."""
        out: list = [None] * len(self.eqn.outvars)
        for k, c in zip(carries, carry):
            out[k] = c
        for j, y in zip([j for j in range(self.ny) if ys_mask[j]], ys):
            out[self.nk + j] = y
        return out
