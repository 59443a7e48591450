"""KernelSelectorBackend on CPU: real SDPA kernels (math, CPU flash) and a real Inductor JIT delegate.

One Inductor build is shared through a module-scoped fixture; the checkpoint round trip recompiles once.
The generic checks (outputs match eager, the module unchanged, save -> load in a fresh process), with the
default config and with an ONNX Runtime delegate, run in test_backend_contract.py.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler import profile

from aitune.errors import ConfigError
from aitune.torch.backend import (
    BackendConfig,
    BackendState,
    BuildMode,
    KernelSelectorBackend,
    KernelSelectorBackendConfig,
    TorchInductorAotBackend,
    TorchInductorJitBackend,
)
from aitune.torch.kernel_forge import KernelChoice, KernelOptimizationPlan
from aitune.torch.kernel_forge.kernel_provider import (
    SageAttentionKernelProvider,
    SDPACall,
    TorchSDPAKernelProvider,
    family_to_dict,
)
from aitune.torch.record.samples import record_graphs

CPU_PROVIDERS = [TorchSDPAKernelProvider("math"), TorchSDPAKernelProvider("flash")]


class Block(nn.Module):
    """A tiny pre-norm attention block: x [B, T, 64] -> [B, T, 64], 4 heads of 16."""

    def __init__(self, dim: int = 64, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.norm = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.norm(x)).view(B, T, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.out(attended.transpose(1, 2).reshape(B, T, C))


@pytest.fixture(scope="module")
def block():
    torch.manual_seed(0)
    return Block().eval()


@pytest.fixture(scope="module")
def graph(block):
    return record_graphs(block, [((torch.randn(2, 16, 64),), {}), ((torch.randn(3, 24, 64),), {})])[0]


@pytest.fixture(scope="module")
def built(block, graph, tmp_path_factory):
    config = KernelSelectorBackendConfig(kernel_providers=CPU_PROVIDERS, time_budget_s=0.05, warmup_rounds=1)
    workdir = tmp_path_factory.mktemp("kernel_selector")
    backend = KernelSelectorBackend(config, delegate_backend=TorchInductorJitBackend()).build(block, graph, "cpu",
                                                                                           workdir)
    return backend, workdir


def test_brief_snippet_runs_as_written():
    from aitune.torch.backend import KernelSelectorBackend, KernelSelectorBackendConfig, TorchInductorJitBackend
    from aitune.torch.kernel_forge.kernel_provider import SageAttentionKernelProvider

    backend = KernelSelectorBackend(
        config=KernelSelectorBackendConfig(
            kernel_providers=SageAttentionKernelProvider(),
        ),
        delegate_backend=TorchInductorJitBackend(),
    )
    assert backend.name == "kernel_selector"
    assert backend.config.kernel_providers == [SageAttentionKernelProvider()]
    assert backend.build_mode is BuildMode.JIT
    assert isinstance(backend.delegate, TorchInductorJitBackend)


def test_default_delegate_and_build_mode_follow_the_delegate():
    assert isinstance(KernelSelectorBackend().delegate, TorchInductorJitBackend)
    aot = KernelSelectorBackend(delegate_backend=TorchInductorAotBackend())
    assert aot.build_mode is BuildMode.AOT
    assert KernelSelectorBackend.build_mode is BuildMode.JIT  # the class default is untouched


def test_config_round_trips_and_validates():
    config = KernelSelectorBackendConfig(kernel_providers=[TorchSDPAKernelProvider("cudnn"),
                                                           SageAttentionKernelProvider()], atol=0.05)
    restored = BackendConfig.from_dict(json.loads(json.dumps(config.to_dict())))
    assert restored == config and restored.key() == config.key()
    assert KernelSelectorBackendConfig().key() != config.key()
    assert [p.name for p in KernelSelectorBackendConfig().providers()] == [
        "torch_sdpa_cudnn", "torch_sdpa_flash", "torch_sdpa_efficient", "torch_sdpa_math"]
    with pytest.raises(ConfigError, match="empty"):
        KernelSelectorBackendConfig(kernel_providers=[])
    with pytest.raises(ConfigError, match="not a KernelProvider"):
        KernelSelectorBackendConfig(kernel_providers=["sage"])
    with pytest.raises(ConfigError, match="min_cosine"):
        KernelSelectorBackendConfig(min_cosine=1.5)
    with pytest.raises(ConfigError, match="delegate_backend"):
        KernelSelectorBackend(delegate_backend="inductor_jit")


def test_copy_copies_the_delegate():
    blueprint = KernelSelectorBackend(KernelSelectorBackendConfig(kernel_providers=CPU_PROVIDERS))
    copied = blueprint.copy()
    assert copied is not blueprint and copied.delegate is not blueprint.delegate
    assert copied.config == blueprint.config and copied.key() == blueprint.key()
    assert copied.state is BackendState.INIT and copied.delegate.state is BackendState.INIT


def test_refused_when_no_provider_can_run_here(block, graph):
    """Only SageAttention on a CPU run: refused up front with the reason."""
    backend = KernelSelectorBackend(KernelSelectorBackendConfig(kernel_providers=SageAttentionKernelProvider()))
    check = backend.supports(block, graph, torch.device("cpu"))
    assert not check.ok and "sage_attention" in check.reason
    assert KernelSelectorBackend(KernelSelectorBackendConfig(kernel_providers=CPU_PROVIDERS)).supports(
        block, graph, torch.device("cpu")).ok


def test_build_writes_and_reports_the_plan(built):
    backend, workdir = built
    plan = KernelOptimizationPlan.load(workdir / "kernel_plan.json")
    assert plan.to_dict() == backend.plan.to_dict()
    providers = {row["provider"] for row in plan.candidates}
    assert {"torch_sdpa_math", "torch_sdpa_flash", "original"} <= providers
    info = backend.build_info["kernel_plan"]
    assert info["choices"] == len(plan) and len(info["swapped_call_sites"]) == sum(
        len(choice.call_sites) for choice in plan.choices)
    assert backend.build_info["delegate"]["name"] == "inductor_jit"


def test_build_removes_its_hooks_and_restores_sdpa(built, block):
    assert not block._forward_pre_hooks and not block._forward_hooks
    assert F.scaled_dot_product_attention is torch._C._nn.scaled_dot_product_attention


def test_checkpoint_round_trip_restores_the_plan(built, block, graph, tmp_path):
    """save(); replace the saved plan by a non-empty one (math kernel for the block's calls); load: the
    restored JIT delegate runs with that plan active (math decomposes into bmm: no SDPA kernel runs)."""
    backend, _ = built
    metadata = json.loads(json.dumps(backend.save(tmp_path)))
    assert metadata["plan_active_at_inference"] is True and metadata["delegate_backend"]["name"] == "inductor_jit"
    sample = graph.samples[0].clone()
    call = SDPACall(*(torch.randn(2, 4, 16, 16) for _ in range(3)), is_causal=True)
    plan = KernelOptimizationPlan([KernelChoice(match=family_to_dict(call.family()),
                                                provider=TorchSDPAKernelProvider("math"))])
    plan.save(tmp_path / metadata["kernel_plan"])
    config = BackendConfig.from_dict(backend.config.to_dict())
    restored = KernelSelectorBackend.from_checkpoint(tmp_path, config, metadata, block, graph, "cpu")
    assert restored.state is BackendState.ACTIVE and restored.build_mode is BuildMode.JIT
    assert restored.plan.to_dict() == plan.to_dict()
    with profile() as prof, torch.no_grad():
        output = restored(*sample.args, **sample.kwargs)
    assert not [e.name for e in prof.events() if "scaled_dot_product" in e.name]
    with torch.no_grad():
        torch.testing.assert_close(output, block(*sample.args, **sample.kwargs), atol=1e-4, rtol=1e-3)
    assert not block._forward_pre_hooks and not block._forward_hooks


def test_a_checkpoint_entry_records_the_delegates_packages(built, graph, monkeypatch):
    """A graph's manifest entry lists every package its backend runs on, the delegate's included (the kernel
    selector's own class requires none): ait.load compares each with what is installed where it loads."""
    from aitune.torch.checkpoint.manifest import graph_entry
    from aitune.torch.common.requirements import Requirement

    backend, _ = built
    json_requirement = Requirement("json", ("json",), "all", declared=False)
    monkeypatch.setattr(TorchInductorJitBackend, "requirements", (json_requirement,))
    entry = graph_entry(graph, backend, "block", base="modules/block/graphs/graph0", metadata={}, artifacts=[],
                        samples={"file": "samples.safetensors", "count": 2, "batch_sizes": [2, 3]}, tune_row=None)
    assert entry["packages"] == {"json": "unknown"}  # the delegate's (stdlib json has no distribution: "unknown")
    assert "json" not in KernelSelectorBackend.availability().versions
