"""Eager and Inductor JIT specifics: dynamic shapes from the recorded axes, autocast restoring output dtypes,
config validation, CUDA-only modes refused on CPU. The generic checks (outputs match eager, the module
unchanged, save/load) are in test_backend_contract.py."""

import pytest
import torch

from aitune.errors import ConfigError
from aitune.torch.backend import (
    TorchEagerBackend,
    TorchEagerBackendConfig,
    TorchInductorJitBackend,
    TorchInductorJitBackendConfig,
)
from aitune.torch.record.samples import record_graphs


class TinyEncoder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(16, 16)
        self.norm = torch.nn.LayerNorm(16)

    def forward(self, x, mask=None):
        h = self.norm(self.proj(x))
        if mask is not None:
            h = h * mask.unsqueeze(-1)
        return {"hidden": h, "pooled": (h.mean(1),)}


@pytest.fixture(scope="module")
def graph_and_model():
    torch.manual_seed(0)
    model = TinyEncoder().eval()
    calls = [((torch.randn(b, t, 16), torch.ones(b, t)), {}) for b, t in ((1, 4), (3, 9), (2, 6))]
    return model, record_graphs(model, calls)[0]


def test_inductor_resolves_dynamic_from_axes(graph_and_model, tmp_path):
    model, graph = graph_and_model
    built = TorchInductorJitBackend().build(model, graph, "cpu", tmp_path)
    assert built.build_info["dynamic"] is True and built.build_info["graph_breaks"] == 0


def test_eager_autocast_restores_output_dtype(graph_and_model, tmp_path):
    model, graph = graph_and_model
    backend = TorchEagerBackend(TorchEagerBackendConfig(autocast_enabled=True, autocast_dtype="bfloat16"))
    built = backend.build(model, graph, "cpu", tmp_path)
    x, mask = torch.randn(2, 5, 16), torch.ones(2, 5)
    out = built(x, mask)
    assert out["hidden"].dtype == torch.float32
    torch.testing.assert_close(out["hidden"], model(x, mask)["hidden"], atol=5e-2, rtol=5e-2)


def test_config_validation_and_serialisation():
    with pytest.raises(ConfigError, match="mode"):
        TorchInductorJitBackendConfig(mode="fastest")
    with pytest.raises(ConfigError, match="either mode or options"):
        TorchInductorJitBackendConfig(mode="default", options={"max_autotune": True})
    with pytest.raises(ConfigError, match="dtype"):
        TorchEagerBackendConfig(autocast_dtype="float17")
    config = TorchInductorJitBackendConfig(mode="max-autotune", fullgraph=True)
    restored = TorchInductorJitBackendConfig.from_dict(config.to_dict())
    assert restored == config and restored.key() == config.key()
    assert config.key() != TorchInductorJitBackendConfig().key()
    assert config.describe() == "mode=max-autotune,fullgraph=True"
    assert TorchInductorJitBackend(config).describe() == "TorchInductorJitBackend(mode=max-autotune,fullgraph=True)"


def test_reduce_overhead_refused_on_cpu(graph_and_model):
    model, graph = graph_and_model
    check = TorchInductorJitBackend(TorchInductorJitBackendConfig(mode="reduce-overhead")).supports(model, graph, "cpu")
    assert not check.ok and "CUDA" in check.reason
