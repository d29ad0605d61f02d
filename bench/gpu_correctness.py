"""`make gpu-check`'s correctness stage (bench/gpu.py): the fused attention cores against xla.

Per point (dtype, L; causal GQA): out, dq, dk, dv of pallas, pallas-mosaic (its kernels in
Mosaic GPU, bench/attention.py) and cudnn against the xla core's, computed once per point, as
max |core - xla| / max |xla| per output, at the tolerances of tests/test_flash_attention.py; fp32
runs under jax.default_matmul_precision('highest') so TF32 does not stand in for fp32 (cuDNN takes
fp16/bf16 only, and a core that refuses its inputs or the device, as the Mosaic GPU kernels do
fp32, is recorded 'n/a' with its reason). Then one
optimizer step of the tiny preset per core, its loss against xla's. Off a GPU cudnn is
recorded as unavailable.
"""

from __future__ import annotations

import time

from bench.common import error_text
from configs import ConfigError

# The tolerances of tests/test_flash_attention.py: max |core - xla| / max |xla| per output.
TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2}


def _out_and_grads(core, q, k, v, d_out):
    import jax

    out, vjp = jax.vjp(core, q, k, v)
    return (out, *vjp(d_out))


def relative_errors(got, want) -> dict:
    """max |got - want| / max |want| (floored at 1e-3) for out, dq, dk, dv; inf if non-finite."""
    import numpy as np

    errors = {}
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        errors[name] = float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-3)) if np.isfinite(a).all() else float("inf")
    return errors


def check_point(dtype: str, length: int, heads: tuple[int, int, int], cores: tuple[str, ...]) -> list[dict]:
    """One point: each of `cores` (of pallas, pallas-mosaic, cudnn; xla is the reference) against
    xla (computed once) on causal GQA attention, value and gradients; one row per core."""
    import jax
    import jax.numpy as jnp

    from bench.attention import core_fn

    row = {"dtype": dtype, "length": length, "heads": heads[0], "kv_heads": heads[1],
           "head_dim": heads[2], "causal": True, "tolerance": TOLERANCE[dtype]}
    n, kv, h = heads
    keys = jax.random.split(jax.random.key(length), 4)
    shapes = [(1, length, n, h), (1, length, kv, h), (1, length, kv, h), (1, length, n, h)]
    q, k, v, d_out = (jax.random.normal(key, s, jnp.float32).astype(dtype) for key, s in zip(keys, shapes))
    want, rows = None, []
    for core in (c for c in cores if c != "xla"):
        if core == "cudnn" and jax.default_backend() != "gpu":
            rows.append({"core": core} | row | {"status": "unavailable on cpu"})
            continue
        if core == "cudnn" and dtype == "float32":
            rows.append({"core": core} | row | {"status": "n/a: cuDNN fused attention takes fp16/bf16 only"})
            continue
        start = time.perf_counter()
        try:
            with jax.default_matmul_precision("highest" if dtype == "float32" else "default"):
                if want is None:
                    want = jax.jit(lambda *a: _out_and_grads(core_fn("xla", True), *a))(q, k, v, d_out)
                got = jax.jit(lambda *a, c=core: _out_and_grads(core_fn(c, True), *a))(q, k, v, d_out)
            errors = relative_errors(got, want)
        except ConfigError as err:  # the core refuses these inputs or this device (Mosaic GPU: fp32, pre-Hopper)
            rows.append({"core": core} | row | {"status": f"n/a: {err}"})
            continue
        except Exception as err:  # noqa: BLE001
            rows.append({"core": core} | row | {"status": "error", "error": error_text(err)})
            continue
        rows.append({"core": core} | row | {"errors": errors, "seconds": time.perf_counter() - start,
                                              "status": "pass" if max(errors.values()) < TOLERANCE[dtype] else "fail"})
    return rows


def train_one_step(core: str, tiny_sets: tuple[str, ...]) -> dict:
    """One optimizer step of the tiny preset with model.attention=core: loss and grad norm."""
    import jax

    from configs import apply_overrides, get_preset
    from sharding.mesh import build_mesh
    from training.build import build

    cfg = apply_overrides(get_preset("tiny"), [*tiny_sets, f"model.attention={core}"])
    mesh = build_mesh(cfg.parallel, jax.devices()[:1])
    job = build(cfg, mesh)
    with jax.set_mesh(mesh):
        _, metrics = job.step_fn(job.state, job.batches(0))
    return {"loss": float(metrics["loss"]), "grad_norm": float(metrics["grad_norm"]),
            "compute_dtype": cfg.model.compute_dtype}


def train_steps_check(tiny_sets: tuple[str, ...]) -> list[dict]:
    """train_one_step for every core; each loss against xla's within the compute dtype's tolerance."""
    import jax

    rows = []
    for core in ("xla", "pallas", "cudnn"):
        if core == "cudnn" and jax.default_backend() != "gpu":
            rows.append({"core": core, "status": "unavailable on cpu"})
            continue
        try:
            rows.append({"core": core} | train_one_step(core, tiny_sets))
        except Exception as err:  # noqa: BLE001
            rows.append({"core": core, "status": "error", "error": error_text(err)})
    ref = rows[0].get("loss")
    for r in rows:
        if "loss" in r and ref is not None:
            r["loss_relative_to_xla"] = abs(r["loss"] - ref) / abs(ref)
            ok = r["loss_relative_to_xla"] < TOLERANCE[r["compute_dtype"]] and abs(r["grad_norm"]) < float("inf")
            r["status"] = "pass" if ok else "fail"
    return rows


def correctness(lengths: tuple[int, ...], fp32_lengths: tuple[int, ...], heads: tuple[int, int, int],
                more: tuple[tuple[int, int], ...], tiny_sets: tuple[str, ...], cores: tuple[str, ...]) -> dict:
    """The stage's record: every point (bf16 at `lengths`, fp32 at `fp32_lengths`; heads N, K,
    H; then bf16 at each (L, H) of `more`, N and K as before), the tiny train
    step per core, and a pass/fail verdict over what ran."""
    n, kv, _ = heads
    points = ([("bfloat16", length, heads) for length in lengths] + [("float32", length, heads) for length in fp32_lengths]
              + [("bfloat16", length, (n, kv, h)) for length, h in more])
    cases = [row for dtype, length, point_heads in points for row in check_point(dtype, length, point_heads, cores)]
    steps = train_steps_check(tiny_sets)
    judged = [r["status"] for r in cases + steps if r["status"] in ("pass", "fail", "error")]
    return {"tolerance": TOLERANCE, "cases": cases, "train_step": steps,
            "verdict": "pass" if judged and all(s == "pass" for s in judged) else "fail"}
