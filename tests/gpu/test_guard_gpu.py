"""The run-time guard on a GPU: a check of a CUDA backend times the backend's own run until its output is ready
(NOTE [guard cost] in aitune/torch/check/guard.py), not its launch alone (marked gpu)."""

import pytest
import torch

from aitune.torch.backend import TorchEagerBackend
from aitune.torch.check.guard import GuardConfig, RuntimeGuard

pytestmark = pytest.mark.gpu


class Heavy(torch.nn.Module):
    """Milliseconds of device work behind a launch of tens of µs: ten chained 2048² matrix products."""

    def forward(self, x):
        for _ in range(10):
            x = torch.tanh(x @ x)
        return x


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_noisy_rows_check_times_the_backends_run_until_its_output_is_ready():
    model, x = Heavy(), torch.randn(2048, 2048, device="cuda") / 64
    with torch.no_grad():
        model(x)  # (cuBLAS warm)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        expected = model(x)
        end.record()
        torch.cuda.synchronize()
        device_s = start.elapsed_time(end) / 1000
        guard = RuntimeGuard("graph0", GuardConfig(), lambda eager, actual, chosen: torch.testing.assert_close(
            actual, eager), {(x.shape,)}, speedup=0.01, serving_s=1.0, serving_noisy=True)
        backend = TorchEagerBackend()
        for _ in range(3):
            output, replacement = guard.check(backend, lambda chosen: model(x), lambda: model(x), [x])
            assert replacement is backend
            torch.testing.assert_close(output, expected)
    # the least backend run covers its device time (an unwaited launch would be ~1000x shorter), and the
    # whole check (backend, eager, comparison) at least twice that
    assert guard.backend_s >= 0.8 * device_s, (guard.backend_s, device_s)
    assert guard.least_s >= 1.6 * device_s, (guard.least_s, device_s)
