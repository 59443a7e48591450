"""Timing on CUDA (marked gpu; skipped without a CUDA device): calls are timed with CUDA events, not the CPU
clock."""

import pytest
import torch

from aitune.torch.measure import profiling

pytestmark = pytest.mark.gpu


def test_cuda_calls_are_timed_with_cuda_events():
    """With the CPU clock frozen (every reading 0 ns, so a CPU-clock timing would be 0.0 ms), a kernel that keeps
    the GPU busy for ~50M cycles still gets a positive time: it comes from CUDA events. ``measure`` on a CUDA
    device reports it too."""
    busy = lambda *_: torch.cuda._sleep(50_000_000)  # noqa: E731 - spins on the GPU; the CPU returns at once
    busy()
    torch.cuda.synchronize()
    with profiling.use_clock(lambda: 0):
        timer = profiling.Timer(torch.device("cuda"))
        assert timer.cuda and timer(busy) > 0.0
        config = profiling.ProfilingConfig(warmup_rounds=1, warmup_s=0.0, min_rounds=3, max_rounds=3)
        measurement = profiling.measure(busy, [None], [1], torch.device("cuda"), config)
    assert measurement.rounds == 3 and measurement.samples[0].p50_ms > 0.0
    with profiling.use_clock(lambda: 0):
        assert profiling.Timer(torch.device("cpu"))(busy) == 0.0  # the CPU path, for contrast
    torch.cuda.synchronize()
