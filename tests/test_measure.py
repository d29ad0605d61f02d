"""tools/measure.py's timing: one compile call, a warm-up on a GPU only, then the timed calls."""

import time

import jax
import jax.numpy as jnp

from tools import measure


def counting(delay: float):
    calls = []

    def fn(x):
        calls.append(time.perf_counter())
        time.sleep(delay)
        return x + 1

    return fn, calls


def test_on_cpu_median_seconds_times_right_after_the_compile_call():
    fn, calls = counting(0.0)
    seconds = measure.median_seconds(fn, (jnp.zeros(4),), steps=3, inner=2)
    assert len(calls) == 1 + 3 * 2 and seconds >= 0


def test_on_a_gpu_median_seconds_warms_up_for_gpu_warmup_s(monkeypatch):
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(measure, "GPU_WARMUP_S", 0.05)
    fn, calls = counting(0.005)
    seconds = measure.median_seconds(fn, (jnp.zeros(4),), steps=3)
    warm = len(calls) - 1 - 3
    assert warm >= 5, calls  # about 0.05 s of 5 ms calls between the compile call and the timing
    assert calls[1 + warm] - calls[1] >= 0.045 and 0.004 < seconds < 0.05
