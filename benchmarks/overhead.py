"""Wrapper overhead per call: tuned ``ait.Module`` vs calling the chosen backend directly (CPU, median µs).

A tiny module keeps the backend's own time small, so the difference is the wrapper's work: normalising
the call, finding the graph, the routing checks. Target (issue 2): <= 20 µs median.

    python -m benchmarks.overhead
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

import aitune.torch as ait
from aitune.torch.backend import TorchEagerBackend, TorchInductorJitBackend
from aitune.torch.measure.profiling import ProfilingConfig


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, input_ids, attention_mask=None, scale: float = 1.0):
        return self.fc(input_ids * attention_mask) * scale


def median_us(function, calls: int = 20000) -> float:
    for _ in range(500):
        function()
    samples = []
    for _ in range(calls):
        started = time.perf_counter_ns()
        function()
        samples.append(time.perf_counter_ns() - started)
    return statistics.median(samples) / 1000


def main() -> int:
    x, mask = torch.randn(4, 8), torch.ones(4, 8)
    for backend in (TorchEagerBackend(), TorchInductorJitBackend()):
        module = Tiny().eval()
        strategy = ait.OneBackendStrategy(backend, profiling_config=ProfilingConfig(time_budget_s=0.2))
        tuned = ait.Module(module, "tiny", strategy=strategy.enable_performance_validation(False))
        ait.tune(lambda batch: tuned(**batch), [{"input_ids": x, "attention_mask": mask}], ready_batches=True)
        chosen = tuned.backends["graph0"]
        kwargs = {"input_ids": x, "attention_mask": mask}
        with torch.no_grad():
            direct = median_us(lambda: chosen._infer((), kwargs))
            wrapped = median_us(lambda: tuned(input_ids=x, attention_mask=mask))
        print(f"{backend.describe():28s} direct {direct:7.1f} µs   tuned Module {wrapped:7.1f} µs   "
              f"overhead {wrapped - direct:5.1f} µs (target <= 20 µs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
