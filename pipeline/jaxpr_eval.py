"""Evaluate a jaxpr equation by equation, with its calls inlined: the machinery that
pipeline/split_backward.py builds B and W from (and a few facts it reads off jaxprs).

`flatten` retraces a jaxpr with every call-like equation (jit/pjit, checkpoint/remat, closed_call,
custom_jvp/vjp calls) inlined, so the split can send a call's equations to different sides (a
shard_map's body too, inlined inside a shard_map of the equation's own mesh and specs);
`bind` runs one equation in its own context (name scope, traceback), so b_fn and w_fn keep the
model's named scopes in profiles. Written by hand: jax's own `core.eval_jaxpr` evaluates a jaxpr
whole and keeps its calls as calls.

Internal JAX surface used (here, in pipeline/split_scan.py and in split_map.py only):
eqn.primitive.bind / get_bind_params, jax._src.source_info_util (optional: the equations' name
scopes, as core.eval_jaxpr sets them), the params of the call primitives, scan's
num_consts/num_carry (jax 0.10) or flat trees ft_in (jax 0.12: `scan_counts`), shard_map's
params (mesh, in_specs, out_specs, newly_manual_axes, check_vma) and avals'
manual_axis_type.varying (`run_map`, `varying`), jax.extend.core.{Literal, Var, ClosedJaxpr,
Jaxpr}. Checked on jax 0.10.2 and 0.12.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Sequence

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


def read(env: dict, v: Any) -> Any:
    """The value of a jaxpr operand: a literal's own, or a variable's from `env`."""
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


def bind(eqn, invals: Sequence[Any]) -> list[Any]:
    """Run one equation on `invals` in its own context; its outputs as a list."""
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


def run_map(params: dict, body: Callable, args: Sequence[Any], in_specs: Sequence[Any],
            out_specs: Sequence[Any]) -> list:
    """`body(*args) -> list` as a shard_map with a shard_map equation's mesh, manual axes and
    check_vma, and the given specs."""
    mapped = jax.shard_map(lambda *a: tuple(body(*a)), mesh=params["mesh"], in_specs=tuple(in_specs),
                           out_specs=tuple(out_specs), axis_names=set(params["newly_manual_axes"]),
                           check_vma=params["check_vma"])
    return list(mapped(*args))


def varying(aval) -> frozenset:
    """The manual mesh axes a value varies over (shard_map's check_vma types)."""
    kind = getattr(aval, "manual_axis_type", None)
    return frozenset(kind.varying) if kind is not None else frozenset()


def _inline_eval(jaxpr: Jaxpr, consts: Sequence[Any], args: Sequence[Any]) -> list[Any]:
    env: dict = {}
    for v, a in zip(jaxpr.constvars, consts):
        env[v] = a
    for v, a in zip(jaxpr.invars, args):
        env[v] = a
    for eqn in jaxpr.eqns:
        invals = [read(env, v) for v in eqn.invars]
        if eqn.primitive.name == "shard_map":  # its body inlined too, inside a shard_map of its own
            p = eqn.params
            outs = run_map(p, lambda *a, body=p["jaxpr"]: _inline_eval(body, [], a), invals,
                           p["in_specs"], p["out_specs"])
        elif (sub := _callee(eqn)) is not None:
            outs = _inline_eval(sub[0], sub[1], invals)
        else:
            outs = bind(eqn, invals)
        for v, o in zip(eqn.outvars, outs):
            env[v] = o
    return [read(env, v) for v in jaxpr.outvars]


def spec(aval) -> jax.ShapeDtypeStruct:
    """An abstract value as a ShapeDtypeStruct (to trace a jaxpr again)."""
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=getattr(aval, "weak_type", False))


def flatten(jaxpr: Jaxpr, consts: Sequence[Any]) -> tuple[Jaxpr, list]:
    """The same function with every call-like equation inlined (scan bodies are left for later)."""
    closed = jax.make_jaxpr(lambda *a: _inline_eval(jaxpr, consts, a))(*[spec(v.aval) for v in jaxpr.invars])
    return closed.jaxpr, list(closed.consts)


def is_var(v: Any) -> bool:
    """Whether a jaxpr operand is a variable that something may read (not a literal, not a drop)."""
    return isinstance(v, Var) and type(v).__name__ != "DropVar"


def as_out(val: Any, aval) -> Any:
    """A jaxpr output as an array of its aval (literal outputs are Python scalars)."""
    return jnp.broadcast_to(jnp.asarray(val, aval.dtype), aval.shape)


def var_order(jaxpr: Jaxpr) -> Callable:
    """A deterministic order of a jaxpr's variables (definition order)."""
    pos: dict = {}
    for v in [*jaxpr.constvars, *jaxpr.invars]:
        pos.setdefault(v, len(pos))
    for eqn in jaxpr.eqns:
        for o in eqn.outvars:
            pos.setdefault(o, len(pos))
    return lambda v: pos[v]


def nbytes(v) -> int:
    """Bytes of a jaxpr variable's value."""
    return int(np.prod(v.aval.shape)) * jnp.dtype(v.aval.dtype).itemsize


def scan_counts(params: dict) -> tuple[int, int]:
    """(consts, carries) of a scan equation: num_consts/num_carry params (jax <= 0.10), or the
    lengths of the flat trees ft_in = (consts, carry, xs) (jax 0.12)."""
    if "num_consts" in params:
        return params["num_consts"], params["num_carry"]
    consts, carry, _ = params["ft_in"].unpack()
    return len(consts), len(carry)


def equations(closed: Any) -> Iterator[Any]:
    """Every equation of a (closed) jaxpr and of its sub-jaxprs (scan bodies, remat, pjit, cond
    branches, shard_map bodies), each sub-jaxpr once (not times a scan's length)."""
    jaxpr = closed.jaxpr if isinstance(closed, ClosedJaxpr) else closed
    for eqn in jaxpr.eqns:
        yield eqn
        for p in eqn.params.values():
            for sub in (p if isinstance(p, (tuple, list)) else [p]):
                if isinstance(sub, (ClosedJaxpr, Jaxpr)):
                    yield from equations(sub)


def count_prims(closed: Any, name: str = "dot_general") -> int:
    """Equations named `name` in a (closed) jaxpr, counted through every sub-jaxpr (`equations`)."""
    return sum(eqn.primitive.name == name for eqn in equations(closed))
