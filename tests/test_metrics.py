"""FLOP counts and MFU against hand-computed figures."""

from types import SimpleNamespace

import pytest

from configs import get_preset
from training.metrics import IntervalTimer, flops_per_token, matmul_params, peak_flops, step_figures


def test_matmul_params_are_all_but_the_embedding_table_and_norms():
    m = get_preset("llama3-8b").model
    norms = (2 * m.n_layers + 1) * m.d_model
    assert matmul_params(m) == 8_030_261_248 - m.vocab_size * m.d_model - norms


def test_flops_per_token_llama3_8b():
    m = get_preset("llama3-8b").model
    # 6 * 7.5047e9 matmul weights + attention 3 * 32 layers * 4 * 8192 * 32 * 128 / 2
    expected = 6 * 7_504_658_432 + 3 * 32 * 4 * 8192 * 32 * 128 / 2
    assert flops_per_token(m, 8192) == pytest.approx(expected)
    assert flops_per_token(m, 8192) / 1e9 == pytest.approx(51.47, abs=0.01)


def test_mfu_uses_the_peak_table():
    h100 = SimpleNamespace(device_kind="NVIDIA H100 80GB HBM3")
    cpu = SimpleNamespace(device_kind="cpu")
    assert peak_flops(h100) == 989e12 and peak_flops(cpu) is None
    m = get_preset("tiny").model
    per_token = flops_per_token(m, 128)
    # Choose the step time that gives exactly 40% MFU on 8 devices.
    tokens, devices = 1 << 20, 8
    step_time = per_token * tokens / devices / (0.4 * 989e12)
    fig = step_figures(m, 128, tokens, step_time, devices, h100)
    assert fig["mfu"] == pytest.approx(0.4)
    assert fig["tflops_per_device"] == pytest.approx(0.4 * 989)
    assert fig["tokens_per_s"] == pytest.approx(tokens / step_time)
    assert step_figures(m, 128, tokens, step_time, devices, cpu)["mfu"] is None


def test_interval_timer_means_over_the_steps_since_the_last_lap(monkeypatch):
    clock = iter([10.0, 13.0, 19.0])
    monkeypatch.setattr("training.metrics.time.perf_counter", lambda: next(clock))
    timer = IntervalTimer(5)
    assert timer.lap(6) == 3.0  # the first step alone (it holds the compile)
    assert timer.lap(9) == 2.0  # 6 s over steps 7, 8 and 9
