"""Mixture of experts: a router, E SwiGLU experts, top-k tokens per expert, optional shared experts.

Layout (E experts, F = expert F, k experts per token):
  router       [D, E]     ('embed', None)            fp32 logits
  w_gate, w_up [E, D, F]  ('experts', 'embed', 'mlp')
  w_down       [E, F, D]  ('experts', 'mlp', 'embed')
  shared       a dense SwiGLU (model/mlp.py) of F·n_shared_experts, every token through it

Routing: softmax over the E router logits, the top k kept and renormalised to sum to 1
(Mixtral's rule, and the presets' models'; DeepSeek-V3's sigmoid scores with a balancing bias
replace the auxiliary loss by a bias update outside the gradient, which this reference does not
model). Assignments are ordered choice-major (every token's first choice before any second
choice), so under a capacity the first choices are kept first (GShard's priority).

Losses, over the whole batch (sharding/expert_parallel.Experts.total), reported per MoE layer:
  aux   E · Σ_e f_e · P_e, f_e the fraction of the n·k assignments routed to e, P_e the mean
        router probability of e (Switch Transformer's, with f over k choices): 1 when uniform
  z     mean over tokens of logsumexp(router logits)² (ST-MoE's router z-loss)
and the statistics dropped (fraction of assignments dropped by the capacity) and load (the
busiest expert's assignments over the mean).

Dispatch (the collectives are sharding/expert_parallel.py's): each assignment gets a device
(its expert's rank on `expert`) and a slot in that device's block of the send buffer [ep, S, D];
the experts run on what arrives, and the outputs go back to the same slots, weighted by the
gates and summed over the k choices.
  dropless  slots in arrival order per device; the receiver sorts its rows by expert and runs
            the grouped matmul (model/kernels/grouped_matmul.py, `model.expert_matmul`:
            `jax.lax.ragged_dot`, which XLA lowers densely on CPU and on the GPUs lent here,
            every row through every local expert; or jax's Hopper kernels, whose FLOPs follow
            the rows). Padding rows, sorted last, are outside every group: 0 out.
  capacity  C = ceil(cf·n·k/E) slots per expert, expert-major, so the receiver's rows are
            already grouped [E/ep, ep·C] and run as one batched matmul; the overflow is dropped.

Memory per MoE layer and device, n tokens: the send and receive buffers, 2·ep·S·D, their
outputs the same, and the experts' hidden [ep·S, 3·F/t] (gate, up, their product).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from configs.base import ConfigError, ModelConfig
from model.kernels.grouped_matmul import grouped_matmul, problem
from model.layers import param, softmax
from model.mlp import MLP, swiglu
from sharding.checks import expert_d_ff
from sharding.cores import target
from sharding.expert_parallel import Experts, region
from sharding.tensor_parallel import TensorParallel

DISPATCH = ("dropless", "capacity")
NAMES = {
    "router": ("embed", None),
    "w_gate": ("experts", "embed", "mlp"),
    "w_up": ("experts", "embed", "mlp"),
    "w_down": ("experts", "mlp", "embed"),
}
STATS = ("aux", "z", "dropped", "load")


def no_stats(m: ModelConfig) -> dict[str, jax.Array]:
    """Zero router statistics of a model's structure ({} for a dense model): accumulators' start."""
    return {name: jnp.zeros((), jnp.float32) for name in STATS} if m.n_experts else {}


def router_loss(stats: dict[str, jax.Array], m: ModelConfig) -> jax.Array | float:
    """The router losses' part of the objective: aux and z weighted by model.router_aux_loss and
    model.router_z_loss (0 for a dense model)."""
    return m.router_aux_loss * stats["aux"] + m.router_z_loss * stats["z"] if stats else 0.0


class MoE(nnx.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel, dispatch: str, *, rngs: nnx.Rngs):
        e, d, f = cfg.n_experts, cfg.d_model, expert_d_ff(cfg)
        if cfg.expert_matmul == "mosaic" and (why := problem(*target(), d, f, cfg.compute_dtype)):
            raise ConfigError(f"--set model.expert_matmul=mosaic: {why}")  # before any weight exists
        dtype = jnp.dtype(cfg.param_dtype)
        out_std = cfg.init_std / (2 * cfg.n_layers) ** 0.5
        self.router = param(rngs, (d, e), NAMES["router"], cfg.init_std, dtype)
        self.w_gate = param(rngs, (e, d, f), NAMES["w_gate"], cfg.init_std, dtype)
        self.w_up = param(rngs, (e, d, f), NAMES["w_up"], cfg.init_std, dtype)
        self.w_down = param(rngs, (e, f, d), NAMES["w_down"], out_std, dtype)
        shared = dataclasses.replace(cfg, d_ff=cfg.n_shared_experts * f)
        self.shared = MLP(shared, tp, rngs=rngs) if cfg.n_shared_experts else None
        self.routing = Routing(e, cfg.experts_per_token, dispatch, cfg.capacity_factor, cfg.expert_matmul)
        self.tp = tp

    def __call__(self, x: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
        """x [B, L, D] -> (y [B, L, D], {stat: fp32 scalar})."""
        weights = {name: (getattr(self, name)[...], names) for name, names in NAMES.items()}
        y, stats = region(self.routing, x, weights, self.tp)
        if self.shared is not None:
            y = y + self.shared(x)
        return y, stats


@dataclasses.dataclass(frozen=True)
class Routing:
    """One device's MoE layer, given its tokens and experts (called inside the region)."""

    n_experts: int
    k: int
    dispatch: str
    capacity_factor: float
    matmul: str  # model.expert_matmul

    def __call__(self, ops: Experts, x: jax.Array, w: dict) -> tuple[jax.Array, dict]:
        tokens = ops.tensor.column(x, lambda x: x)  # [B, L, D] (gathered over L under SP)
        b, l, d = tokens.shape
        tokens = tokens.reshape(b * l, d)
        gates, experts, stats = self.route(ops, tokens, w["router"])
        y, kept = self.experts(ops, tokens, gates, experts, w)
        stats["dropped"] = 1 - ops.total(jnp.sum(kept, dtype=jnp.float32)) / ops.total(jnp.float32(kept.size))
        y = ops.tensor.row(y.reshape(b, l, d), lambda h: h)  # summed over tensor
        return y, {name: ops.same_on_tensor(v) for name, v in stats.items()}

    def route(self, ops: Experts, tokens: jax.Array, router: jax.Array) -> tuple:
        """tokens [n, D] -> gates [n, k] (renormalised), experts [n, k] int, and the losses."""
        e, k = self.n_experts, self.k
        logits = jnp.einsum("nd,de->ne", tokens.astype(jnp.float32), router.astype(jnp.float32))
        probs = softmax(logits, axis=-1)
        top, experts = jax.lax.top_k(probs, k)
        gates = top / jnp.sum(top, axis=-1, keepdims=True)
        n_all = ops.total(jnp.float32(tokens.shape[0]))
        counts = ops.total(jnp.sum(jax.nn.one_hot(experts, e, dtype=jnp.float32), axis=(0, 1)))  # [E]
        mean_prob = ops.total(jnp.sum(probs, axis=0)) / n_all
        stats = {
            "aux": e * jnp.sum(counts / (n_all * k) * mean_prob),
            "z": ops.total(jnp.sum(jax.nn.logsumexp(logits, axis=-1) ** 2)) / n_all,
            "load": jnp.max(counts) / jnp.mean(counts),
        }
        return gates, experts, stats

    def experts(self, ops: Experts, tokens: jax.Array, gates: jax.Array, experts: jax.Array,
                w: dict) -> tuple[jax.Array, jax.Array]:
        """Send each token's k rows to their experts, run them, bring them back: [n, D], and
        which of the k·n assignments were kept [k·n] bool."""
        n, d = tokens.shape
        ep, local = ops.size, self.n_experts // ops.size
        expert = experts.T.reshape(-1)  # [k·n], choice-major: assignment a = j·n + token
        dest, mine = expert // local, expert % local
        if self.dispatch == "capacity":
            cap = math.ceil(self.capacity_factor * n * self.k / self.n_experts)
            slot = _rank_within(expert, self.n_experts)
            kept = slot < cap
            slot, size = mine * cap + slot, local * cap
        else:
            slot = _rank_within(dest, ep)
            kept, size = jnp.ones_like(slot, bool), n * min(self.k, local)
        slot = jnp.where(kept, slot, size)  # out of range: dropped by the scatter
        rows = jnp.tile(tokens, (self.k, 1))  # [k·n, D], the row of each assignment
        send = jnp.zeros((ep, size, d), tokens.dtype).at[dest, slot].set(rows, mode="drop")
        received = ops.all_to_all(send)  # [ep, S, D]: block i from device i
        if self.dispatch == "capacity":
            out = _batched(received.reshape(ep, local, -1, d), w)
        else:
            ids = jnp.full((ep, size), local, jnp.int32).at[dest, slot].set(mine, mode="drop")
            matmul = functools.partial(grouped_matmul, impl=self.matmul)
            out = _grouped(received.reshape(-1, d), ops.all_to_all(ids).reshape(-1), local, w, matmul)
        back = ops.all_to_all(out.reshape(ep, size, d))  # the outputs, in the slots they left
        picked = back.at[dest, slot].get(mode="fill", fill_value=0)  # [k·n, D]; dropped: 0
        weighted = picked * gates.T.reshape(-1, 1).astype(picked.dtype)
        return jnp.sum(weighted.reshape(self.k, n, d), axis=0), kept


def _rank_within(group: jax.Array, groups: int) -> jax.Array:
    """For each element of `group` [m] (ints < groups): how many earlier elements share its group.
    The running count is read at the element's own group by an index (take_along_axis), not by
    summing it masked with the one-hot: XLA GPU (jax 0.12.1) rewrote that sum into a gather its
    emitter cannot lower ("Non-simplified HLO Gather", an abort) in the layer scan under
    capacity dispatch (moe-tiny on dp=2, dp=4, fsdp=4,sp=2; unrolled or dropless, it compiled)."""
    onehot = jax.nn.one_hot(group, groups, dtype=jnp.int32)  # [m, G]
    return jnp.take_along_axis(jnp.cumsum(onehot, axis=0) - 1, group[:, None], axis=1)[:, 0]


def _batched(rows: jax.Array, w: dict) -> jax.Array:
    """rows [ep, E/ep, C, D] grouped by local expert -> outputs of the same shape."""
    grouped = jnp.swapaxes(rows, 0, 1).reshape(rows.shape[1], -1, rows.shape[-1])  # [E/ep, ep·C, D]
    hidden = swiglu(jnp.einsum("ecd,edf->ecf", grouped, w["w_gate"]), jnp.einsum("ecd,edf->ecf", grouped, w["w_up"]))
    out = jnp.einsum("ecf,efd->ecd", hidden, w["w_down"]).reshape(rows.shape[1], rows.shape[0], -1, rows.shape[-1])
    return jnp.swapaxes(out, 0, 1)


def _grouped(rows: jax.Array, ids: jax.Array, local: int, w: dict, matmul: Callable) -> jax.Array:
    """rows [R, D] of local experts `ids` [R] (`local` = an empty row) -> outputs [R, D], by the
    grouped matmul `matmul`(x, w, sizes) (model/kernels/grouped_matmul.py)."""
    order = jnp.argsort(ids, stable=True)
    sizes = jnp.sum(jax.nn.one_hot(ids, local, dtype=jnp.int32), axis=0)  # empty rows count nowhere
    sorted_rows = rows[order]
    hidden = swiglu(matmul(sorted_rows, w["w_gate"], sizes), matmul(sorted_rows, w["w_up"], sizes))
    out = matmul(hidden, w["w_down"], sizes)
    return jnp.zeros_like(out).at[order].set(out)
