"""The experts alone on one device: the grouped matmul's implementations timed and checked.

Used by bench/moe.py (its FFN micro-benchmark, after the step cases) and by `make gpu-check`'s
moe stage (bench/gpu.py). One MoE layer's experts (model/moe.py) on the rows one device receives
at ep=1: --ffn-tokens tokens, k rows each, experts drawn uniformly, forward and backward (the
gradient of the rows and the three weights), in the compute dtype:
  grouped   model/moe.py `_grouped` with `jax.lax.ragged_dot`: sort the rows by expert, the
            grouped matmul, unsort
  mosaic    the same with jax's Hopper kernels (model/kernels/grouped_matmul.py), one row per
            tile given; on another device the row says why it cannot run
  loop      every expert applied to every row, masked to its own rows, summed (E times the FLOPs)
  batched   model/moe.py `_batched`, the capacity layout [E, C, D] with C = ceil(cf·rows/E)
Each is compiled, run once, then timed round-robin over `rounds` rounds (a noisy machine slows
all alike); a row gives the median, its ratio to grouped, the TFLOP/s of the routed work
(18·rows·D·F: three matmuls, forward and two backward, whatever a way computes besides) and
XLA's temporaries for the compiled program (where a dense lowering of ragged_dot shows: a copy
of the rows per expert). XLA:CPU lowers ragged_dot densely, so on a CPU grouped is no faster
than the loop; the ratios that matter are a GPU's.

`mosaic_check`: on a Hopper GPU, mosaic against grouped on the same rows with a quarter of them
padding (outside every group, as the dropless buffer's empty slots): the largest difference of
the outputs and of the four gradients, each over the reference's largest magnitude, within
2e-2 (bf16: both accumulate in fp32 and round the outputs to bf16, in different orders).
"""

from __future__ import annotations

import math
import statistics
from configs import RunConfig
from model.kernels.grouped_matmul import TILE, Tile

CHECK_TOLERANCE = 2e-2


def inputs(cfg: RunConfig, tokens: int, padding: float = 0.0) -> dict:
    """Weights {w_gate, w_up, w_down} [E, ...], rows [tokens·k, D], their experts `ids` (E for a
    padding row, a `padding` fraction of them), and the capacity layout's slots [1, E, C, D]."""
    import jax
    import jax.numpy as jnp

    from sharding.checks import expert_d_ff

    m = cfg.model
    e, d, f = m.n_experts, m.d_model, expert_d_ff(m)
    dtype = jnp.dtype(m.compute_dtype)
    n_rows = tokens * m.experts_per_token
    cap = math.ceil(m.capacity_factor * n_rows / e)
    keys = jax.random.split(jax.random.key(0), 6)
    w = {name: (jax.random.normal(key, (e, *shape), jnp.float32) * 0.02).astype(dtype)
         for name, key, shape in (("w_gate", keys[0], (d, f)), ("w_up", keys[1], (d, f)), ("w_down", keys[2], (f, d)))}
    ids = jax.random.randint(keys[4], (n_rows,), 0, e, jnp.int32)
    ids = jnp.where(jax.random.uniform(keys[5], (n_rows,)) < padding, e, ids)
    return {"w": w, "rows": jax.random.normal(keys[3], (n_rows, d), jnp.float32).astype(dtype), "ids": ids,
            "slots": jax.random.normal(keys[3], (1, e, cap, d), jnp.float32).astype(dtype),
            "experts": e, "d_model": d, "expert_d_ff": f}


def _fwd_bwd(fn):
    import jax
    import jax.numpy as jnp

    return jax.jit(jax.grad(lambda x, w: jnp.sum(jnp.square(fn(x, w).astype(jnp.float32))), argnums=(0, 1)))


def _ways(data: dict, tiles: tuple[Tile, ...]) -> tuple[dict, dict]:
    """{name: (fn(x, w), x)} of the ways that run here, and {name: why} of those that cannot."""
    import jax
    import jax.numpy as jnp

    from model.kernels.grouped_matmul import hopper, problem
    from model.mlp import swiglu
    from model.moe import _batched, _grouped
    from sharding.cores import target

    e, ids, rows = data["experts"], data["ids"], data["rows"]

    def loop(x, w):
        out = jnp.zeros_like(x)
        for i in range(e):
            y = jnp.dot(swiglu(jnp.dot(x, w["w_gate"][i]), jnp.dot(x, w["w_up"][i])), w["w_down"][i])
            out = out + jnp.where((ids == i)[:, None], y, 0)
        return out

    ways = {"grouped": (lambda x, w: _grouped(x, ids, e, w, jax.lax.ragged_dot), rows)}
    refused = {}
    why = problem(*target(), data["d_model"], data["expert_d_ff"], str(rows.dtype))
    for tile in tiles:
        name = "mosaic" if tile == TILE else f"mosaic {tile.text()}"
        if why:
            refused[name] = why
        else:
            ways[name] = (lambda x, w, tile=tile: _grouped(x, ids, e, w, hopper(tile)), rows)
    ways |= {"loop": (loop, rows), "batched": (_batched, data["slots"])}
    return ways, refused


def ffn_bench(cfg: RunConfig, tokens: int, rounds: int, tiles: tuple[Tile, ...] = ()) -> dict:
    """The module docstring's ways, `tiles` the mosaic rows (none: no mosaic row), timed
    round-robin; ratios to grouped."""
    import jax

    from training.build import xla_memory
    from tools.measure import timed

    data = inputs(cfg, tokens)
    ways, refused = _ways(data, tiles)
    compiled, times = {}, {name: [] for name in ways}
    for name, (fn, x) in ways.items():
        compiled[name] = _fwd_bwd(fn).lower(x, data["w"]).compile()
        jax.block_until_ready(compiled[name](x, data["w"]))
    for _ in range(rounds):
        for name, (_, x) in ways.items():
            times[name].append(timed(compiled[name], x, data["w"])[1])
    base = statistics.median(times["grouped"])
    routed = 18 * data["rows"].shape[0] * data["d_model"] * data["expert_d_ff"]
    rows = {name: {"time_median_s": statistics.median(t), "times_s": t,
                   "ratio_to_grouped": statistics.median(t) / base,
                   "routed_tflops": routed / statistics.median(t) / 1e12,
                   "temp_bytes": xla_memory(compiled[name])["temp"]} for name, t in times.items()}
    return {"tokens": tokens, "rows": data["rows"].shape[0], "capacity_rows": data["slots"].shape[1] * data["slots"].shape[2],
            "experts": data["experts"], "d_model": data["d_model"], "expert_d_ff": data["expert_d_ff"],
            "dtype": cfg.model.compute_dtype, "device": str(jax.devices()[0].device_kind), "rounds": rounds,
            "routed_flops": routed, "ways": rows | {name: {"unavailable": why} for name, why in refused.items()}}


def mosaic_check(cfg: RunConfig, tokens: int) -> dict:
    """mosaic against grouped (ragged_dot) with a quarter of the rows padding: the module
    docstring's relative differences, and `ok` (all within CHECK_TOLERANCE); where mosaic cannot
    run, {"unavailable": why}."""
    import jax
    import jax.numpy as jnp

    from model.kernels.grouped_matmul import hopper, problem
    from model.moe import _grouped
    from sharding.cores import target

    data = inputs(cfg, tokens, padding=0.25)
    if why := problem(*target(), data["d_model"], data["expert_d_ff"], str(data["rows"].dtype)):
        return {"unavailable": why}
    e, ids = data["experts"], data["ids"]

    def value_and_grads(matmul):
        def y_and_loss(x, w):
            y = _grouped(x, ids, e, w, matmul)
            return jnp.sum(y.astype(jnp.float32) * jnp.cos(x.astype(jnp.float32))), y

        (_, y), (dx, dw) = jax.jit(jax.value_and_grad(y_and_loss, argnums=(0, 1), has_aux=True))(data["rows"], data["w"])
        return {"y": y, "dx": dx, **dw}

    ours, ref = value_and_grads(hopper()), value_and_grads(jax.lax.ragged_dot)

    def relative(a, b):
        a, b = (jnp.asarray(v, jnp.float32) for v in (a, b))
        return float(jnp.max(jnp.abs(a - b)) / jnp.maximum(jnp.max(jnp.abs(b)), 1e-30))

    errors = {name: relative(ours[name], ref[name]) for name in ref}
    padding_rows = int(jnp.sum(ids == e))
    return {"rows": data["rows"].shape[0], "padding_rows": padding_rows, "relative_error": errors,
            "tolerance": CHECK_TOLERANCE, "ok": all(v <= CHECK_TOLERANCE for v in errors.values())}


def ffn_lines(ffn: dict) -> list[str]:
    """ffn_bench's rows as text: time, ratio, routed TFLOP/s, XLA's temporaries (or why not run)."""
    lines = []
    for name, w in ffn["ways"].items():
        if "unavailable" in w:
            lines.append(f"  {name:<22} not run: {w['unavailable']}")
        else:
            lines.append(f"  {name:<22} {w['time_median_s'] * 1e3:>9.2f} ms  {w['ratio_to_grouped']:5.2f}x grouped  "
                         f"{w['routed_tflops']:7.2f} routed TFLOP/s  temp {w['temp_bytes'] / 2**20:9.1f} MiB")
    return lines
