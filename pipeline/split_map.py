"""One shard_map equation of a split (an explicit tensor-parallel, context-parallel or expert
region in the pullback), split into a B shard_map and a W shard_map over the same mesh and
manual axes (pipeline/split_backward.py's docstring).

Without this a region would be atomic, and every region the input gradient flows through would
run whole in B: under explicit TP (tp_impl=shard_map, the default) zb-h1's W held no matmul at
all (tiny pp=2,tp=2: B 18 dots, W 0), the weight gradients done in B and nothing left to fill
the bubble with.

The body (per-device shapes, collectives over the manual axes) is split by the same rules as a
jaxpr (split_plan.split_jaxpr). A stash value of the body is per device: it leaves B's
shard_map with a leading axis of size 1 per device, split over the manual axes it varies over
(its aval's `manual_axis_type.varying`; replicated where it varies over none; over every manual
axis in a region without check_vma, whose values carry no such type), and enters W's with the
same spec, so W's body sees it with the type B's had. The stash of a region is then one array
per body stash value, the leading axis the product of those axes' sizes: per device, the body
value itself.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from jax.sharding import PartitionSpec as P

from pipeline.jaxpr_eval import read, run_map


class MapSplit:
    """A shard_map equation of a plan, split into a B shard_map and a W shard_map. B computes the
    outputs `b_outs`, W those it is asked for by `add_w`; W reads the equation's inputs directly
    (what it needs of the body's B values comes through the stash)."""

    def __init__(self, eqn, b_used: Sequence[bool], shrink: bool, split_body: Callable):
        self.eqn, self.shrink, self.split_body = eqn, shrink, split_body
        assert not eqn.params["jaxpr"].constvars, "a shard_map body with constvars"
        self.b_outs = list(b_used)
        self.w_outs = [False] * len(eqn.outvars)
        self.body = self._plan()
        self.has_w = False

    @property
    def has_b(self) -> bool:
        return any(self.b_outs)

    def _plan(self):
        return self.split_body(self.eqn.params["jaxpr"], [], self.b_outs, self.w_outs,
                               [True] * len(self.eqn.invars), self.shrink)

    def add_w(self, want: Sequence[bool]) -> None:
        self.w_outs = [w or (a and not b) for w, a, b in zip(self.w_outs, want, self.b_outs)]
        self.body = self._plan()
        self.has_w = any(self.w_outs)

    @property
    def b_in(self) -> list[bool]:
        """Which of the equation's inputs the B shard_map reads."""
        return list(self.body.b_invars)

    @property
    def w_in(self) -> list[bool]:
        """Which of the equation's inputs the W shard_map reads."""
        return list(self.body.w_invars)

    def _inputs(self, env: dict, uses: Sequence[bool]) -> tuple[list, list, list]:
        """(body invars, values, in_specs) of the inputs marked `uses`."""
        picked = [j for j, u in enumerate(uses) if u]
        return ([self.eqn.params["jaxpr"].invars[j] for j in picked],
                [read(env, self.eqn.invars[j]) for j in picked],
                [self.eqn.params["in_specs"][j] for j in picked])

    def stash_specs(self) -> list[P]:
        """The spec of each per-device stash value with a leading axis of 1 added: that axis
        split over the manual axes the value varies over; in an unchecked region (check_vma
        False, as the fused attention cores run) over every manual axis, its values untyped."""
        p = self.eqn.params
        names = tuple(a for a in p["mesh"].axis_names if a in p["newly_manual_axes"])
        specs = []
        for vary in self.body.stash_varying():
            axes = tuple(a for a in names if a in vary) if p["check_vma"] else names
            specs.append(P(axes) if axes else P())
        return specs

    def stash_varying(self) -> list[frozenset]:
        """The manual axes of the enclosing context each global stash array varies over."""
        return [frozenset(v) - self.eqn.params["newly_manual_axes"] for v in self.body.stash_varying()]

    def _outputs(self, mask: Sequence[bool], values: Sequence[Any]) -> list:
        out: list = [None] * len(self.eqn.outvars)
        for j, v in zip([j for j, m in enumerate(mask) if m], values):
            out[j] = v
        return out

    def run_b(self, env: dict) -> tuple[list, list]:
        """The B shard_map. Returns (the equation's outputs, None where B does not compute them;
        the stash, one global array per body stash value)."""
        if not self.has_b:
            return [None] * len(self.eqn.outvars), []
        invars, args, in_specs = self._inputs(env, self.b_in)
        out_specs = [s for s, b in zip(self.eqn.params["out_specs"], self.b_outs) if b]
        n = sum(self.b_outs)

        def body(*a):
            outs, stash = self.body.eval_b(dict(zip(invars, a)))
            return [*outs, *(s[None] for s in stash)]

        outs = run_map(self.eqn.params, body, args, in_specs, [*out_specs, *self.stash_specs()])
        return self._outputs(self.b_outs, outs[:n]), outs[n:]

    def run_w(self, env: dict, stash: Sequence[Any]) -> list:
        """The W shard_map, reading B's stash. Returns the equation's outputs (None where W does
        not compute them)."""
        invars, args, in_specs = self._inputs(env, self.w_in)
        out_specs = [s for s, w in zip(self.eqn.params["out_specs"], self.w_outs) if w]

        def body(*a):
            inputs, st = a[:len(invars)], a[len(invars):]
            return self.body.eval_w(dict(zip(invars, inputs)), [s[0] for s in st])

        outs = run_map(self.eqn.params, body, [*args, *stash], [*in_specs, *self.stash_specs()], out_specs)
        return self._outputs(self.w_outs, outs)
