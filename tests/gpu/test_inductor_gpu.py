"""GPU checks of the core (run on the H200 through the device tool; skipped without CUDA)."""

import pytest
import torch

import aitune.torch as ait
from aitune.torch.backend import TorchInductorJitBackend, TorchInductorJitBackendConfig
from aitune.torch.profiling import ProfilingConfig

pytestmark = pytest.mark.gpu


class Gram(torch.nn.Module):
    def forward(self, x):
        return x @ x.transpose(-1, -2)


def test_c20_cuda_graph_outputs_stay_valid():
    model = Gram().cuda().eval()
    backend = TorchInductorJitBackend(TorchInductorJitBackendConfig(mode="reduce-overhead"))
    tuned = ait.Module(model, "gram", strategy=ait.OneBackendStrategy(backend, profiling_config=ProfilingConfig(
        time_budget_s=0.2)).enable_performance_validation(False))
    a, b = torch.randn(64, 64, device="cuda"), torch.randn(64, 64, device="cuda")
    ait.tune(tuned, [a], ignore_failing_modules=False, ready_batches=True)
    assert tuned.backends["graph0"].config.mode == "reduce-overhead"
    y_a = tuned(a)
    y_b = tuned(b)
    torch.testing.assert_close(y_a, model(a))
    torch.testing.assert_close(y_b, model(b))
