"""Kernel providers, KernelOptimizer and plans on CPU: real SDPA kernels (math, CPU flash), never mocked.

Which kernel really ran is read from the PyTorch profiler's aten op names
(``aten::_scaled_dot_product_attention_math`` vs ``aten::_scaled_dot_product_flash_attention_for_cpu``).
"""

from __future__ import annotations

import json
import tempfile

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend
from torch.profiler import profile

from aitune.errors import ConfigError
from aitune.torch.backend import KernelSelectorBackendConfig, TorchInductorJitBackend
from aitune.torch.kernel_forge import KernelChoice, KernelOptimizationPlan, KernelOptimizer, PlannedModule
from aitune.torch.kernel_forge.kernel_provider import (
    ORIGINAL_SDPA,
    KernelProvider,
    SageAttentionKernelProvider,
    SDPACall,
    TorchSDPAKernelProvider,
    family_to_dict,
    kernel_provider_from_dict,
)
from aitune.torch.measure.profiling import ProfilingConfig
from aitune.torch.record.samples import record_graphs
from case_models import MHA, TwoTowers

MATH_OP = "aten::_scaled_dot_product_attention_math"
CPU_FLASH_OP = "aten::_scaled_dot_product_flash_attention_for_cpu"
FAST = ProfilingConfig(warmup_rounds=1, min_rounds=3, max_rounds=10, time_budget_s=0.05)


def attention_ops(function) -> set[str]:
    with profile() as prof, torch.no_grad():
        function()
    return {event.name for event in prof.events() if "scaled_dot_product" in event.name}


def qkv(shape=(2, 4, 16, 16), dtype=torch.float32):
    return tuple(torch.randn(shape, dtype=dtype) for _ in range(3))


def math_plan_for(call: SDPACall) -> KernelOptimizationPlan:
    """A hand-made plan sending ``call``'s family to PyTorch's math kernel (distinct from CPU's default flash)."""
    return KernelOptimizationPlan([KernelChoice(match=family_to_dict(call.family()),
                                                provider=TorchSDPAKernelProvider("math"), call_sites=("test",))])


# ---------------------------------------------------------------------------------------------- calls


def test_sdpa_call_binds_positional_and_keyword_arguments():
    q, k, v = qkv()
    mask = torch.ones(16, 16, dtype=torch.bool)
    call = SDPACall.from_args((q, k, v, mask), {"is_causal": False, "scale": 0.5})
    assert call.attn_mask is mask and call.scale == 0.5 and call.head_dim == 16 and call.query_heads == 4
    assert call.mask_kind() == "bool/2d"
    torch.testing.assert_close(call.run_original(), F.scaled_dot_product_attention(q, k, v, mask, scale=0.5),
                               rtol=0, atol=0)
    with pytest.raises(TypeError, match="unexpected keyword"):
        SDPACall.from_args((q, k, v), {"causal": True})


def test_family_ignores_batch_and_sequence_lengths_only():
    short = SDPACall(*qkv((2, 4, 16, 16)))
    long = SDPACall(*qkv((5, 4, 40, 16)))
    assert short.family() == long.family()
    assert SDPACall(*qkv((2, 4, 16, 32))).family() != short.family()
    assert SDPACall(*qkv(), is_causal=True).family() != short.family()
    assert SDPACall(*qkv(dtype=torch.float64)).family() != short.family()


# ---------------------------------------------------------------------------------------------- providers


@pytest.mark.parametrize("backend", ["math", "flash", SDPBackend.MATH, SDPBackend.FLASH_ATTENTION])
@pytest.mark.parametrize("kwargs", [{}, {"is_causal": True}, {"attn_mask": torch.rand(16, 16) > 0.3}, {"scale": 0.3}])
def test_torch_sdpa_providers_match_original_on_cpu(backend, kwargs):
    provider = TorchSDPAKernelProvider(backend)
    q, k, v = qkv()
    call = SDPACall(q, k, v, **kwargs)
    assert provider.supports(call).ok, provider.supports(call).reason
    torch.testing.assert_close(provider(q, k, v, **kwargs), call.run_original(), atol=1e-5, rtol=1e-4)


def test_torch_sdpa_provider_pins_the_kernel_it_names():
    q, k, v = qkv()
    assert attention_ops(lambda: TorchSDPAKernelProvider("math")(q, k, v)) >= {MATH_OP}
    assert CPU_FLASH_OP not in attention_ops(lambda: TorchSDPAKernelProvider("math")(q, k, v))
    assert CPU_FLASH_OP in attention_ops(lambda: TorchSDPAKernelProvider("flash")(q, k, v))


@pytest.mark.parametrize("backend", ["efficient", "cudnn", SDPBackend.EFFICIENT_ATTENTION])
def test_cuda_only_sdpa_kernels_are_refused_on_cpu(backend):
    provider = TorchSDPAKernelProvider(backend)
    check = provider.supports(SDPACall(*qkv()))
    assert not check.ok and "no CPU implementation" in check.reason
    assert not provider.check_device("cpu").ok


def test_cpu_flash_refuses_what_its_kernel_cannot_take():
    provider = TorchSDPAKernelProvider("flash")
    three_d = SDPACall(*qkv((2, 16, 16)))
    assert "4-D" in provider.supports(three_d).reason
    dropout = SDPACall(*qkv(), dropout_p=0.1)
    assert "dropout" in provider.supports(dropout).reason
    q, k, _ = qkv()
    assert "head dims" in provider.supports(SDPACall(q, k, torch.randn(2, 4, 16, 32))).reason


def test_unknown_sdpa_backend_name_is_a_config_error():
    with pytest.raises(ConfigError, match="flash"):
        TorchSDPAKernelProvider("fastest")


def test_sage_refuses_on_cpu_with_a_reason():
    provider = SageAttentionKernelProvider()
    call = SDPACall(*qkv((1, 2, 32, 64), dtype=torch.float16))
    check = provider.supports(call)
    assert not check.ok
    assert "sageattention" in check.reason or "CUDA" in check.reason
    assert not provider.check_device("cpu").ok and "CUDA" in provider.check_device("cpu").reason
    assert not provider.accepts(call)


@pytest.mark.parametrize("make_call, reason", [
    (lambda: SDPACall(*qkv((1, 2, 32, 64), dtype=torch.float32)), "float16/bfloat16"),
    (lambda: SDPACall(*qkv((1, 2, 32, 64), dtype=torch.float16),
                      attn_mask=torch.ones(32, 32, dtype=torch.bool)), "attn_mask"),
    (lambda: SDPACall(*qkv((1, 2, 32, 160), dtype=torch.float16)), "head_dim 64, 96 or 128, not 160"),
    (lambda: SDPACall(*qkv((1, 2, 32, 512), dtype=torch.float16)), "not 512"),
    (lambda: SDPACall(*qkv((1, 2, 32, 64), dtype=torch.float16), dropout_p=0.1), "dropout"),
    (lambda: SDPACall(torch.randn(1, 2, 8, 64).half(), *qkv((1, 2, 32, 64), dtype=torch.float16)[1:],
                      is_causal=True), "causal"),
    (lambda: SDPACall(*qkv((2, 32, 64), dtype=torch.float16)), "4-D"),
    (lambda: SDPACall(torch.randn(1, 4, 32, 64).half(), *qkv((1, 2, 32, 64), dtype=torch.float16)[1:]),
     "enable_gqa"),
    (lambda: SDPACall(*qkv((1, 2, 32, 64), dtype=torch.float16)), "CUDA only"),
])
def test_sage_call_level_refusals(make_call, reason):
    """Unsupported calls are refused up front (checked on CPU tensors: device is checked last)."""
    check = SageAttentionKernelProvider().check_call(make_call())
    assert not check.ok and reason in check.reason


def test_providers_round_trip_as_plain_data():
    for provider in (TorchSDPAKernelProvider("cudnn"), TorchSDPAKernelProvider(SDPBackend.MATH),
                     SageAttentionKernelProvider()):
        payload = json.loads(json.dumps(provider.to_dict()))
        assert kernel_provider_from_dict(payload) == provider
    with pytest.raises(ConfigError, match="unknown kernel provider type"):
        kernel_provider_from_dict({"type": "os.system", "data": {}})


# ---------------------------------------------------------------------------------------------- plans


def test_plan_dispatch_is_scoped_to_the_module_forward():
    """The tuned module gets the plan; another module and a direct SDPA call behave as before."""
    torch.manual_seed(0)
    tuned, untouched = MHA(64, 4).eval(), MHA(64, 4).eval()
    x = torch.randn(2, 16, 64)
    q, k, v = qkv()
    plan = math_plan_for(SDPACall(q, k, v))
    assert CPU_FLASH_OP in attention_ops(lambda: tuned(x))
    with torch.no_grad():
        expected = tuned(x)
    with plan.apply(tuned):
        assert F.scaled_dot_product_attention is ORIGINAL_SDPA  # nothing global was patched
        ops = attention_ops(lambda: tuned(x))
        assert MATH_OP in ops and CPU_FLASH_OP not in ops
        assert CPU_FLASH_OP in attention_ops(lambda: untouched(x))
        assert CPU_FLASH_OP in attention_ops(lambda: F.scaled_dot_product_attention(q, k, v))
        with torch.no_grad():
            torch.testing.assert_close(tuned(x), expected, atol=1e-5, rtol=1e-4)
    assert not tuned._forward_pre_hooks and not tuned._forward_hooks
    assert CPU_FLASH_OP in attention_ops(lambda: tuned(x))


def test_dispatch_is_decided_per_call():
    """A masked call is another family: it stays on the original SDPA inside the same module."""
    module = MHA(64, 4).eval()
    x = torch.randn(2, 16, 64)
    plan = math_plan_for(SDPACall(*qkv()))
    with plan.apply(module):
        assert MATH_OP in attention_ops(lambda: module(x))
        masked = attention_ops(lambda: module(x, torch.rand(16, 16) > 0.2))
        assert CPU_FLASH_OP in masked and MATH_OP not in masked


def test_unsupported_calls_of_a_planned_family_go_to_the_original_sdpa():
    """A plan that sends fp16 CPU calls of head_dim 64 to SageAttention: the provider refuses each call
    (no CUDA) and the original SDPA runs, bit for bit (no exception mid-inference)."""
    module = MHA(128, 2).eval().half()
    x = torch.randn(2, 8, 128).half()
    call = SDPACall(*qkv((2, 2, 8, 64), dtype=torch.float16))
    plan = KernelOptimizationPlan([KernelChoice(match=family_to_dict(call.family()),
                                                provider=SageAttentionKernelProvider())])
    with torch.no_grad():
        expected = module(x)
    assert plan.provider_for(call) is None
    with plan.apply(module), torch.no_grad():
        torch.testing.assert_close(module(x), expected, rtol=0, atol=0)


def test_plan_json_round_trip(tmp_path):
    plan = math_plan_for(SDPACall(*qkv()))
    path = plan.save(tmp_path / "plan.json")
    restored = KernelOptimizationPlan.load(path)
    assert restored.to_dict() == plan.to_dict()
    assert restored.providers == (TorchSDPAKernelProvider("math"),)
    json.loads(path.read_text())  # strict JSON
    with pytest.raises(ConfigError, match="newer"):
        KernelOptimizationPlan.from_dict({**plan.to_dict(), "version": 99})
    with pytest.raises(ConfigError, match="not an aitune kernel plan"):
        KernelOptimizationPlan.from_dict({"choices": []})


def test_a_plan_compiles_through_torch_compile():
    """A JIT delegate compiles the dispatch: math decomposes into bmm, no SDPA kernel, no graph break."""
    module = MHA(64, 4).eval()
    graph = record_graphs(module, [((torch.randn(2, 16, 64),), {}), ((torch.randn(3, 24, 64),), {})])[0]
    plan = math_plan_for(SDPACall(*qkv()))
    backend = TorchInductorJitBackend().build(PlannedModule(module, plan), graph, "cpu", tempfile.mkdtemp())
    assert backend.build_info["graph_breaks"] == 0
    probe = torch.randn(4, 20, 64)  # a shape not recorded
    assert not attention_ops(lambda: backend(probe))  # decomposed by the math kernel choice
    with torch.no_grad():
        torch.testing.assert_close(backend(probe), module(probe), atol=1e-5, rtol=1e-4)


# ---------------------------------------------------------------------------------------------- optimizer


class WrongScaleProvider(KernelProvider):
    """A real (but wrong) SDPA implementation: twice the softmax scale. Must be found incorrect."""

    @property
    def name(self) -> str:
        return "wrong_scale"

    def run(self, call):
        scale = 2.0 / call.head_dim ** 0.5
        return ORIGINAL_SDPA(call.query, call.key, call.value, attn_mask=call.attn_mask, scale=scale)


class BrokenProvider(KernelProvider):
    """A provider whose kernel raises: a failed row, never a crash of the optimizer."""

    @property
    def name(self) -> str:
        return "broken"

    def run(self, call):
        raise RuntimeError("kernel launch failed")


def test_optimizer_finds_call_sites_per_module_and_shape():
    model = TwoTowers(64, 80, 4).eval()
    calls = [((torch.randn(2, 16, 64), torch.randn(2, 16, 80), torch.rand(2, 1, 16, 16) > 0.2), {}),
             ((torch.randn(2, 16, 64), torch.randn(2, 16, 80), torch.rand(2, 1, 16, 16) > 0.2), {}),
             ((torch.randn(3, 8, 64), torch.randn(3, 8, 80), torch.rand(3, 1, 8, 8) > 0.2), {})]
    records = KernelOptimizer(TorchSDPAKernelProvider("math")).find_calls(model, calls)
    by_module = {(r.module_name, tuple(r.call.query.shape)): r for r in records}
    assert set(by_module) == {("a", (2, 4, 16, 16)), ("b", (2, 4, 16, 20)), ("a", (3, 4, 8, 16)),
                              ("b", (3, 4, 8, 20))}
    assert by_module[("a", (2, 4, 16, 16))].count == 2
    assert all("forward" in r.call_site and r.call_site.endswith("in forward") for r in records)
    assert by_module[("b", (2, 4, 16, 20))].call.attn_mask is not None


def test_identical_layers_share_one_example():
    """Layers with the same code and shapes keep one example (memory), all their names, and the count."""
    model = nn.Sequential(MHA(64, 4), MHA(64, 4)).eval()
    records = KernelOptimizer(TorchSDPAKernelProvider("math")).find_calls(model, [((torch.randn(2, 16, 64),), {})])
    assert len(records) == 1
    assert records[0].module_names == ["0", "1"] and records[0].count == 2
    assert records[0].label.endswith("[0 +1 more]")


def test_optimizer_keeps_only_correct_and_faster_choices():
    model = TwoTowers(64, 80, 4).eval()
    calls = [((torch.randn(2, 16, 64), torch.randn(2, 16, 80), torch.rand(2, 1, 16, 16) > 0.2), {}),
             ((torch.randn(3, 8, 64), torch.randn(3, 8, 80), torch.rand(3, 1, 8, 8) > 0.2), {})]
    providers = [TorchSDPAKernelProvider("math"), TorchSDPAKernelProvider("flash"),
                 TorchSDPAKernelProvider("efficient"), SageAttentionKernelProvider(), WrongScaleProvider(),
                 BrokenProvider()]
    plan = KernelOptimizer(providers, profiling=FAST).make_plan(model, calls)
    rows = plan.candidates
    status = {(row["provider"], row["status"]) for row in rows}
    assert ("torch_sdpa_efficient", "refused") in status and ("sage_attention", "refused") in status
    assert ("wrong_scale", "incorrect") in status and ("broken", "failed") in status
    assert not any(row["provider"] in ("wrong_scale", "broken") and row["status"] in ("chosen", "faster")
                   for row in rows)
    for choice in plan.choices:  # whatever timing decided, a choice is correct everywhere and faster
        assert choice.provider.name in ("torch_sdpa_math", "torch_sdpa_flash")
        assert choice.speedup > 1.0 and choice.min_cosine >= 0.999
        family_rows = [row for row in rows if row["family"] == choice.match and row["provider"] == choice.provider.name]
        assert family_rows and all(row["status"] == "chosen" for row in family_rows)
    restored = KernelOptimizationPlan.from_json(plan.to_json())
    assert restored.to_dict() == plan.to_dict()
    x, y, mask = calls[0][0]
    with torch.no_grad():
        expected = model(x, y, mask)
    with restored.apply(model), torch.no_grad():
        for got, want in zip(model(x, y, mask), expected):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_a_plan_may_be_empty():
    """Nothing can run here (efficient: CUDA only): an empty plan, and the module behaves exactly as before."""
    module = MHA(64, 4).eval()
    x = torch.randn(2, 16, 64)
    plan = KernelOptimizer(TorchSDPAKernelProvider("efficient"), profiling=FAST).make_plan(module, [((x,), {})])
    assert plan.is_empty and len(plan) == 0
    assert [row["status"] for row in plan.candidates] == ["refused"]
    with torch.no_grad():
        expected = module(x)
    with plan.apply(module), torch.no_grad():
        torch.testing.assert_close(module(x), expected, rtol=0, atol=0)
    assert "empty plan" in plan.describe()


def test_optimizer_does_not_change_the_module_or_samples():
    module = MHA(64, 4).eval()
    x = torch.randn(2, 16, 64)
    x_copy = x.clone()
    state = {name: value.clone() for name, value in module.state_dict().items()}
    KernelOptimizer([TorchSDPAKernelProvider("math")], profiling=FAST).make_plan(module, [((x,), {})])
    assert torch.equal(x, x_copy)
    assert all(torch.equal(state[name], value) for name, value in module.state_dict().items())
    assert not module._forward_pre_hooks and not module._forward_hooks


def test_optimizer_rejects_bad_arguments():
    with pytest.raises(ConfigError, match="at least one"):
        KernelOptimizer([])
    with pytest.raises(ConfigError, match="not a KernelProvider"):
        KernelOptimizer(["flash"])
    with pytest.raises(ConfigError, match="min_cosine"):
        KernelOptimizer(TorchSDPAKernelProvider("math"), min_cosine=2.0)
    with pytest.raises(ConfigError, match="timing must be one of auto, cuda_graph, eager"):
        KernelOptimizer(TorchSDPAKernelProvider("math"), timing="graphs")
    with pytest.raises(ConfigError, match="timing must be one of"):
        KernelSelectorBackendConfig(timing="graphs")


def test_timing_in_cuda_graphs_needs_a_cuda_device_and_cpu_calls_are_timed_eagerly():
    module = MHA(64, 4).eval()
    samples = [((torch.randn(2, 16, 64),), {})]
    optimizer = KernelOptimizer(TorchSDPAKernelProvider("math"), profiling=FAST, timing="cuda_graph")
    with pytest.raises(ConfigError, match="timing='cuda_graph' needs a CUDA device, the calls run on cpu"):
        optimizer.make_plan(module, samples)
    plan = KernelOptimizer(TorchSDPAKernelProvider("math"), profiling=FAST).make_plan(module, samples)
    timed = [row for row in plan.candidates if "original_ms" in row]
    assert {row["provider"] for row in timed} == {"original", "torch_sdpa_math"}
    assert all(row["timing"] == "eager" and row["original_ms"] > 0 for row in timed)
    assert "| timed |" in plan.describe() and "| eager |" in plan.describe()


def test_kernel_forge_does_not_import_the_backend_layer():
    """kernel_forge sits below the backends (the kernel selector builds on it): no import from backend/."""
    import ast
    from pathlib import Path

    import aitune.torch.kernel_forge as kernel_forge

    for path in Path(kernel_forge.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not any(name.startswith("aitune.torch.backend") for name in names), f"{path.name}: {names}"


def test_requirements_are_still_importable_from_the_backend_base():
    import aitune.torch.backend.base as base
    import aitune.torch.common.requirements as requirements

    for name in ("Requirement", "Check", "probe_requirement", "check_requirements", "validate_flags",
                 "torch_version_at_least"):
        assert getattr(base, name) is getattr(requirements, name)


def test_a_kernel_selectors_packages_are_its_own_its_delegates_and_its_providers(monkeypatch):
    """The build cache and earlier rankings are keyed by the packages a candidate runs on: for the kernel selector
    those of its delegate and of its kernel providers too (before, only its own, which are none)."""
    from aitune.torch.backend import KernelSelectorBackend, ONNXRuntimeBackend
    from aitune.torch.common.requirements import Check, package_versions
    from aitune.torch.kernel_forge.sage_attention import SageAttentionKernelProvider

    monkeypatch.setattr(SageAttentionKernelProvider, "availability",
                        classmethod(lambda cls: Check(True, "", {"sageattention": "1.0.6"})))
    selector = KernelSelectorBackend(KernelSelectorBackendConfig(kernel_providers=[SageAttentionKernelProvider()]),
                                     delegate_backend=ONNXRuntimeBackend())
    versions = package_versions(selector)
    assert versions["sageattention"] == "1.0.6"
    assert versions["onnxruntime"] == ONNXRuntimeBackend.availability().versions["onnxruntime"]
    assert package_versions(ONNXRuntimeBackend()) == ONNXRuntimeBackend.availability().versions
