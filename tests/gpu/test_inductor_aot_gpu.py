"""TorchInductorAotBackend on CUDA (GPU machine only).

With some torch and CUDA builds, ``aoti_load_package`` of any CUDA AOTInductor package kills the process
with SIGSEGV. The backend loads the package first in a child process,
so the expected outcomes are: a working artifact that matches eager, or a BackendBuildError that names the
signal while this (parent) process lives on. The second is reported as xfail with the reason.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from aitune.errors import BackendBuildError
from aitune.torch.backend import BackendState, TorchInductorAotBackend
from aitune.torch.backend.inductor_aot import TorchInductorAotBackendConfig
from aitune.torch.check.correctness import OutputComparator, Tolerance
from aitune.torch.record.samples import record_graphs

pytestmark = pytest.mark.gpu


class TinyMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 16))

    def forward(self, x):
        return self.net(x)


def test_cuda_build_matches_eager_or_fails_cleanly(tmp_path):
    torch.manual_seed(0)
    module = TinyMLP().cuda().eval()
    calls = [((torch.randn(batch, 32, device="cuda"),), {}) for batch in (2, 8)]
    graph = record_graphs(module, calls)[0]
    backend = TorchInductorAotBackend(TorchInductorAotBackendConfig(build_timeout_s=600))
    try:
        backend.build(module, graph, "cuda", tmp_path)
    except BackendBuildError as exc:
        assert "child process failed" in str(exc)
        log_tail = exc.log_path.read_text()[-2000:] if exc.log_path and exc.log_path.is_file() else ""
        print(f"build failed cleanly: {exc}\n--- child log tail ---\n{log_tail}")
        pytest.xfail(f"AOTInductor CUDA build failed in the child, parent alive: {exc.args[0]}")
    assert backend.state is BackendState.ACTIVE
    for batch in (2, 5, 8):
        x = torch.randn(batch, 32, device="cuda")
        with torch.no_grad():
            expected = module(x.clone())
        OutputComparator(Tolerance(atol=1e-3, rtol=1e-3)).compare(expected, backend(x))
