"""JIT inspect mode on CUDA: outputs stay eager's, and the synchronisation puts GPU time where it belongs
(NOTE [inspection timing]): a caller's queued kernels are the caller's, a module's kernels are its own."""

import pytest
import torch

import aitune.torch.jit as jit
from aitune.torch.jit import inspection, runtime

pytestmark = pytest.mark.gpu


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(1))

    def forward(self, x):
        return x[:1, :1] * self.scale


class Heavy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(4096, 4096) / 64)

    def forward(self, x):
        for _ in range(8):
            x = x @ self.weight
        return x


class Caller(torch.nn.Module):
    """Queues heavy work of its own, then calls a tiny module, then a heavy one."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(4096, 4096) / 64)
        self.tiny = Tiny()
        self.heavy = Heavy()

    def forward(self, x):
        for _ in range(8):
            x = x @ self.weight  # queued, not finished, when tiny is called
        return self.heavy(x) + self.tiny(x)


@pytest.fixture(autouse=True)
def _jit_off():
    jit.reset()
    yield
    jit.reset()


def test_cuda_time_goes_to_the_module_that_queued_it():
    model = Caller().cuda().eval()
    x = torch.randn(4096, 4096, device="cuda")
    with torch.no_grad():
        expected = model(x)
        runtime.enable_inspection()
        outputs = [model(x) for _ in range(3)]
    assert all(torch.equal(output, expected) for output in outputs)
    nodes = {node.name: node for node in inspection.modules()}
    caller, tiny, heavy = nodes["Caller"], nodes["Caller.tiny"], nodes["Caller.heavy"]
    assert caller.calls == tiny.calls == heavy.calls == 3
    # Same work in the caller and in heavy (8 matmuls each); tiny's share is nothing once the caller's queue
    # was drained before it started.
    assert tiny.total_s < 0.1 * caller.self_s and tiny.total_s < 0.1 * heavy.self_s
    assert 0.3 < caller.self_s / heavy.self_s < 3.0
    assert inspection.to_dict()["modules"][0]["device"] == "cuda:0"
