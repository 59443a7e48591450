"""Attention kernels and TorchAO on CUDA (GPU machine only; skipped without CUDA).

Covers: PyTorch's flash / cuDNN / memory-efficient SDPA providers against the original SDPA; SageAttention
(head_dim 160 and masks refused per call, patching scoped to the tuned module, the caller's
key tensor untouched); KernelSelectorBackend with SageAttention + Inductor JIT; TorchAO fp8 / int4 / int8
presets on CUDA (SQNR/cosine). Speed is measured in ``benchmarks/attention_kernels.py``, never asserted.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from aitune.errors import ToleranceExceededError

from aitune.torch.backend import KernelSelectorBackend, KernelSelectorBackendConfig, TorchAOBackend, \
    TorchAOBackendConfig, TorchInductorJitBackend
from aitune.torch.check.correctness import OutputComparator, Tolerance, cosine_similarity
from aitune.torch.kernel_forge import KernelOptimizer
from aitune.torch.kernel_forge.kernel_provider import (
    ORIGINAL_SDPA,
    KernelProvider,
    SageAttentionKernelProvider,
    SDPACall,
    TorchSDPAKernelProvider,
)
from aitune.torch.measure.profiling import ProfilingConfig
from aitune.torch.record.samples import record_graphs
from case_models import MHA, TwoTowers

pytestmark = pytest.mark.gpu

ATTENTION_TOLERANCE = Tolerance(low_precision_atol=2e-2, low_precision_rtol=2e-2)
FAST = ProfilingConfig(warmup_rounds=2, min_rounds=5, max_rounds=50, time_budget_s=0.2)


def capability() -> tuple[int, int]:
    return torch.cuda.get_device_capability() if torch.cuda.is_available() else (0, 0)


SAGE = SageAttentionKernelProvider.availability()
needs_sage = pytest.mark.skipif(not SAGE.ok, reason=f"SageAttention unavailable: {SAGE.reason}")


def assert_attention_close(expected: torch.Tensor, actual: torch.Tensor) -> None:
    comparator = OutputComparator(ATTENTION_TOLERANCE)
    comparator.compare(expected, actual)
    assert cosine_similarity(expected.float().cpu(), actual.float().cpu()) >= 0.999


@pytest.mark.parametrize("backend", ["flash", "cudnn", "efficient", "math"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_sdpa_providers_match_the_original(backend, head_dim):
    provider = TorchSDPAKernelProvider(backend)
    q, k, v = (torch.randn(2, 8, 256, head_dim, device="cuda", dtype=torch.float16) for _ in range(3))
    call = SDPACall(q, k, v, is_causal=True)
    check = provider.supports(call)
    if not check.ok:
        pytest.skip(f"{provider.name} refuses this call here: {check.reason}")
    assert_attention_close(call.run_original(), provider(q, k, v, is_causal=True))


def test_flash_refuses_fp32_with_torchs_reason():
    q = torch.randn(1, 2, 64, 64, device="cuda")
    check = TorchSDPAKernelProvider("flash").supports(SDPACall(q, q, q))
    assert not check.ok and "flash" in check.reason


@needs_sage
def test_sage_matches_sdpa_and_leaves_the_key_untouched():
    q, k, v = (torch.randn(2, 8, 1024, 128, device="cuda", dtype=torch.float16) for _ in range(3))
    key_before = k.clone()
    provider = SageAttentionKernelProvider()
    assert provider.supports(SDPACall(q, k, v)).ok
    assert_attention_close(F.scaled_dot_product_attention(q, k, v), provider(q, k, v))
    assert torch.equal(k, key_before)


@needs_sage
def test_c24_two_towers_dispatch_per_call_and_scope():
    torch.manual_seed(0)
    model = TwoTowers().cuda().half().eval()
    elsewhere = MHA(2048, 4).cuda().half().eval()
    x = torch.randn(2, 256, 1024, device="cuda", dtype=torch.float16)
    y = torch.randn(2, 256, 1280, device="cuda", dtype=torch.float16)
    mask = torch.rand(2, 1, 256, 256, device="cuda") > 0.1
    z = torch.randn(2, 256, 2048, device="cuda", dtype=torch.float16)
    ones = torch.ones(1, 2, 8, 64, device="cuda", dtype=torch.float16)
    with torch.no_grad():
        expected_a, expected_b = model(x, y, mask)
        expected_elsewhere = elsewhere(z)
        expected_direct = F.scaled_dot_product_attention(ones, ones, ones)
    plan = KernelOptimizer(SageAttentionKernelProvider(), profiling=FAST).make_plan(model, [((x, y, mask), {})])
    refused = [row for row in plan.candidates if row["status"] == "refused"]
    assert any("160" in row["reason"] or "attn_mask" in row["reason"] for row in refused)
    for choice in plan.choices:  # only tower a's family may be swapped
        assert choice.match["head_dim"] == 128 and choice.match["attn_mask"] == "none"
    with plan.apply(model), torch.no_grad():
        got_a, got_b = model(x, y, mask)
        direct = F.scaled_dot_product_attention(ones, ones, ones)
        got_elsewhere = elsewhere(z)
    assert_attention_close(expected_a, got_a)
    torch.testing.assert_close(got_b, expected_b, rtol=0, atol=0)  # head_dim 160 + mask: original SDPA
    torch.testing.assert_close(got_elsewhere, expected_elsewhere, rtol=0, atol=0)
    torch.testing.assert_close(direct, expected_direct, rtol=0, atol=0)
    print(plan.describe())


@needs_sage
def test_kernel_selector_with_sage_and_inductor(tmp_path):
    torch.manual_seed(0)
    model = MHA(1024, 8).cuda().half().eval()
    calls = [((torch.randn(2, 1024, 1024, device="cuda", dtype=torch.float16),), {})]
    graph = record_graphs(model, calls)[0]
    backend = KernelSelectorBackend(
        config=KernelSelectorBackendConfig(kernel_providers=SageAttentionKernelProvider(), time_budget_s=0.2),
        delegate_backend=TorchInductorJitBackend(),
    ).build(model, graph, "cuda", tmp_path)
    sample = graph.samples[0].clone()
    with torch.no_grad():
        expected = model(*sample.args, **sample.kwargs)
    assert_attention_close(expected, backend(*sample.args, **sample.kwargs))
    print(backend.plan.describe())


class SlowLaunchEfficientProvider(KernelProvider):
    """Test provider: PyTorch's memory-efficient SDPA kernel behind 5 ms of Python (``time.sleep``) per call.

    Its kernel beats the math kernel by far; called from Python, its launch cost makes it lose.
    """

    @property
    def name(self) -> str:
        return "slow_launch_efficient"

    def run(self, call):
        time.sleep(0.005)
        with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
            return ORIGINAL_SDPA(call.query, call.key, call.value, **call.kwargs())


class SynchronizingProvider(KernelProvider):
    """Test provider: the original SDPA, then a host synchronisation, which CUDA graph capture forbids."""

    @property
    def name(self) -> str:
        return "synchronizing"

    def run(self, call):
        output = ORIGINAL_SDPA(call.query, call.key, call.value, **call.kwargs())
        torch.cuda.synchronize()
        return output


def timed_rows(plan, provider: str) -> list[dict]:
    return [row for row in plan.candidates if row["provider"] == provider and "original_ms" in row]


def test_providers_are_judged_by_their_kernels_inside_cuda_graphs():
    """Issue "Search": inside CUDA graphs the 5 ms of Python vanish and the faster kernel wins; timed
    eagerly the same provider loses. The original here is PyTorch's math kernel (pinned around make_plan)."""
    torch.manual_seed(0)
    model = MHA(1024, 16).cuda().half().eval()
    x = torch.randn(4, 2048, 1024, device="cuda", dtype=torch.float16)
    with torch.no_grad(), sdpa_kernel([SDPBackend.MATH]):
        expected = model(x)
        eager_plan = KernelOptimizer(SlowLaunchEfficientProvider(), profiling=FAST, timing="eager").make_plan(
            model, [((x,), {})])
        graph_plan = KernelOptimizer(SlowLaunchEfficientProvider(), profiling=FAST).make_plan(model, [((x,), {})])
    assert eager_plan.is_empty
    assert [row["status"] for row in timed_rows(eager_plan, "slow_launch_efficient")] == ["not faster"]
    assert all(row["timing"] == "eager" for row in timed_rows(eager_plan, "slow_launch_efficient"))
    [choice] = graph_plan.choices
    assert choice.provider.name == "slow_launch_efficient" and choice.speedup > 1.5
    assert choice.provider_ms < 1.0  # per call, ms: the sleep is not in the graph
    rows = timed_rows(graph_plan, "slow_launch_efficient") + timed_rows(graph_plan, "original")
    assert rows and all(row["timing"] == "cuda graph" for row in rows)
    with graph_plan.apply(model), torch.no_grad():
        assert_attention_close(expected, model(x))
    print(graph_plan.describe())


def test_a_call_that_cannot_be_captured_is_timed_eagerly_and_capture_works_after():
    torch.manual_seed(0)
    model = MHA(1024, 8).cuda().half().eval()
    x = torch.randn(2, 512, 1024, device="cuda", dtype=torch.float16)
    plan = KernelOptimizer([SynchronizingProvider(), TorchSDPAKernelProvider("efficient")],
                           profiling=FAST).make_plan(model, [((x,), {})])
    [syncing] = timed_rows(plan, "synchronizing")
    assert syncing["timing"].startswith("eager: CUDA graph capture failed (")
    assert syncing["provider_ms"] > 0 and syncing["original_ms"] > 0
    assert syncing["status"] in ("not faster", "faster", "chosen")
    [efficient] = timed_rows(plan, "torch_sdpa_efficient")  # timed after the failed capture
    assert efficient["timing"] == "cuda graph"
    assert [row["timing"] for row in timed_rows(plan, "original")] == ["cuda graph"]
    with torch.no_grad():  # the device still works, graphs included
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = model(x)
        graph.replay()
        torch.testing.assert_close(out, model(x), rtol=0, atol=0)


@pytest.mark.parametrize("preset", ["int8wo", "int8dq", "fp8wo", "fp8dq", "fp8dq_row", "int4wo"])
def test_torchao_presets_on_cuda(preset, tmp_path):
    torch.manual_seed(0)
    available = TorchAOBackend.availability()
    if not available.ok:
        pytest.skip(available.reason)
    model = nn.Sequential(nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 1024)).cuda().bfloat16().eval()
    graph = record_graphs(model, [((torch.randn(32, 1024, device="cuda", dtype=torch.bfloat16),), {})])[0]
    backend = TorchAOBackend(TorchAOBackendConfig(quantization=preset))
    check = backend.supports(model, graph, torch.device("cuda"))
    if not check.ok:
        assert preset in ("fp8wo", "fp8dq", "fp8dq_row", "int4wo") and capability() < (8, 9)
        pytest.skip(check.reason)
    before = {name: value.clone() for name, value in model.state_dict().items()}
    backend.build(model, graph, "cuda", tmp_path)
    sample = graph.samples[0].clone()
    with torch.no_grad():
        expected = model(*sample.args, **sample.kwargs)
    comparator = OutputComparator(quantized=True)
    try:
        comparator.compare(expected, backend(*sample.args, **sample.kwargs))
    except ToleranceExceededError as exc:
        # A coarse preset may legitimately miss the floor on random weights (int4wo: SQNR
        # around 11 dB); then the checker must say so with the metric and the floor (no preset must pass).
        assert "SQNR" in str(exc) and "floor" in str(exc)
    else:
        assert comparator.result().min_sqnr_db >= 20.0
    assert all(torch.equal(before[name], value) for name, value in model.state_dict().items())


def test_default_torchao_preset_runs_on_this_gpu():
    from aitune.torch.backend.ao import default_preset

    preset = default_preset("cuda")
    assert preset == ("fp8dq_row" if capability() >= (8, 9) else "int8wo")
    fp16_model = nn.Sequential(nn.Linear(8, 8)).cuda().half()
    assert default_preset("cuda", fp16_model) == ("fp8dq" if capability() >= (8, 9) else "int8wo")
