import time

import pytest
import torch

from aitune.errors import ConfigError
from aitune.torch.profiling import Measurement, ProfilingConfig, SampleTiming, beats, measure, percentile


def test_percentile_matches_numpy_linear():
    values = [1, 2, 3, 4, 10]
    assert percentile(values, 50) == 3
    assert percentile(values, 90) == pytest.approx(7.6)
    assert percentile(values, 0) == 1 and percentile(values, 100) == 10


def test_measure_counts_rounds_and_orders_latencies():
    calls = []

    def run(sample):
        calls.append(sample)
        time.sleep(0.002 * sample)

    config = ProfilingConfig(warmup_rounds=2, warmup_s=0.0, min_rounds=5, max_rounds=5, time_budget_s=10)
    measurement = measure(run, [1, 3], [1, 4], torch.device("cpu"), config)
    assert len(calls) == (2 + 5) * 2 and measurement.rounds == 5
    slow, fast = measurement.samples[1], measurement.samples[0]
    assert slow.p50_ms > fast.p50_ms >= 2.0
    assert measurement.throughput == pytest.approx(5 / (measurement.median_round_ms / 1000))
    assert measurement.min_batch_latency_ms == fast.p50_ms and measurement.p50_ms == slow.p50_ms


def _measurement(round_ms, noise=0.02):
    timing = SampleTiming(1, round_ms, round_ms, round_ms, round_ms, 0.0, 10)
    return Measurement([timing], 10, [round_ms] * 10, noise)


def test_beats_needs_more_than_noise():
    assert beats(_measurement(1.0), _measurement(1.1))
    assert not beats(_measurement(1.0), _measurement(1.01))
    assert not beats(_measurement(1.0, noise=0.2), _measurement(1.1))
    assert beats(_measurement(1.0), _measurement(1.1), by_latency=True)


def test_profiling_config_validation():
    with pytest.raises(ConfigError):
        ProfilingConfig(min_rounds=0)
    with pytest.raises(ConfigError):
        ProfilingConfig(time_budget_s=-1)


def test_noisy_figures_are_flagged():
    from aitune.torch.evaluation import noise_note

    assert noise_note(_measurement(1.0, noise=0.02)) == ""
    assert "noisy measurement (±20%)" in noise_note(_measurement(1.0, noise=0.2))
