"""Reduced precision only on request: an fp32 model on hardware with native bf16 gets an Inductor
variant with bf16 autocast in the default search. It is built, checked and shown ("would be N x eager, SQNR,
cosine"), but selected only with ``allow_reduced_precision=True`` or ``allow_quantization=True``, or when the
user lists it."""

import pytest
import torch

import aitune.torch as ait
from aitune.errors import ConfigError, ToleranceExceededError
from aitune.torch.backend import (TorchEagerBackend, TorchEagerBackendConfig, TorchInductorJitBackend,
                                  TorchInductorJitBackendConfig, inductor_jit)
from aitune.torch.check.correctness import OutputComparator, Tolerance, comparator_for
from aitune.torch.common.environment import native_bf16

BF16_CONFIG = TorchInductorJitBackendConfig(freezing=True, autocast_enabled=True, autocast_dtype=torch.bfloat16)
needs_native_bf16 = pytest.mark.skipif(not native_bf16(torch.device("cpu")),
                                       reason="this CPU has neither AMX nor AVX-512 BF16: bf16 would be emulated")


class WideMLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(128, 512), torch.nn.GELU(), torch.nn.Linear(512, 64))

    def forward(self, x):
        return self.body(x)


def _recorded_graph(model):
    wrapped = ait.Module(model, "mlp")
    wrapped(torch.randn(4, 128, dtype=next(model.parameters()).dtype))
    return wrapped.graphs[0]


def test_the_search_adds_a_bf16_variant_only_for_fp32_models_on_native_bf16(monkeypatch):
    model = WideMLP().eval()
    graph = _recorded_graph(model)
    monkeypatch.setattr(inductor_jit, "native_bf16", lambda device: True)
    variants = TorchInductorJitBackend().search_space(model, graph, "cpu")
    reduced = [variant for variant in variants if variant.reduces_precision]
    assert [variant.config for variant in reduced] == [BF16_CONFIG]
    assert reduced[0].search_tier == 0 and reduced[0].low_precision  # tried by default, fp16/bf16 tolerances
    cuda = [v for v in TorchInductorJitBackend().search_space(model, graph, "cuda") if v.reduces_precision]
    assert [(v.config.mode, v.search_tier) for v in cuda] == [("reduce-overhead", 0)]

    bf16_model = WideMLP().eval().to(torch.bfloat16)  # already 16-bit: nothing to gain, nothing to ask
    assert not any(v.reduces_precision for v in
                   TorchInductorJitBackend().search_space(bf16_model, _recorded_graph(bf16_model), "cpu"))
    monkeypatch.setattr(inductor_jit, "native_bf16", lambda device: False)  # emulated bf16 is slower
    assert not any(v.reduces_precision for v in TorchInductorJitBackend().search_space(model, graph, "cpu"))


def test_permission_follows_allow_quantization_unless_set():
    assert not ait.MaxThroughputStrategy().reduced_precision_allowed
    assert ait.MaxThroughputStrategy(allow_quantization=True).reduced_precision_allowed
    assert not ait.MaxThroughputStrategy(allow_quantization=True,
                                         allow_reduced_precision=False).reduced_precision_allowed
    assert ait.MaxThroughputStrategy(allow_reduced_precision=True).reduced_precision_allowed
    assert not ait.MaxThroughputStrategy(allow_reduced_precision=True).quantization_allowed
    assert ait.MaxThroughputStrategy([TorchInductorJitBackend(BF16_CONFIG)]).reduced_precision_allowed  # listed
    assert not ait.FirstWinsStrategy().enable_reduced_precision(False).reduced_precision_allowed
    with pytest.raises(ConfigError, match="allow_reduced_precision must be True, False or None"):
        ait.MaxThroughputStrategy(allow_reduced_precision="yes")


def test_reduced_precision_comparisons_record_sqnr_and_cosine():
    expected = torch.randn(64, 32)
    close = expected.to(torch.bfloat16).float()
    comparator = OutputComparator(low_precision=True)
    comparator.compare(expected, close)
    result = comparator.result()
    assert result.metric == "allclose"  # judged by the fp16/bf16 tolerances, not by the quantization floors
    signal = expected.pow(2).sum() / (expected - close).pow(2).sum()
    assert result.min_sqnr_db == pytest.approx(10 * torch.log10(signal).item(), rel=1e-3)
    assert result.min_cosine == pytest.approx(
        torch.nn.functional.cosine_similarity(expected.flatten(), close.flatten(), dim=0).item(), abs=1e-6)
    assert OutputComparator().result().min_cosine is None  # fp32 comparisons stay allclose-only


def _tune(strategy):
    model = WideMLP().eval()
    tuned = ait.Module(model, "mlp", strategy=strategy)
    torch.manual_seed(0)
    report = ait.tune(tuned, [torch.randn(b, 128) for b in (8, 16)], ready_batches=True)
    row = next(r for r in report.rows if r.backend == "inductor_jit")
    return model, tuned, row, report


@needs_native_bf16
@pytest.mark.parametrize("allowed", [False, True])
def test_the_default_search_shows_bf16_and_selects_it_only_when_allowed(allowed, fast_profiling, monkeypatch,
                                                                        tmp_path):
    from aitune.torch.tune_strategy import base

    monkeypatch.setattr(base, "default_backends", lambda device, module=None, graph=None: [
        variant for variant in TorchInductorJitBackend().search_space(module, graph, device)
        if variant.reduces_precision])
    strategy = ait.FirstWinsStrategy(profiling_config=fast_profiling, allow_quantization=allowed)
    model, tuned, row, report = _tune(strategy.enable_performance_validation(False))
    assert row.comparison["metric"] == "allclose" and row.comparison["min_sqnr_db"] > 30  # bf16: ~45 dB
    assert f"(SQNR {row.comparison['min_sqnr_db']:.1f} dB)" in report.describe()  # the table quotes it
    x = torch.randn(5, 128)  # a batch size tuning never saw
    with torch.no_grad():
        expected, actual = model(x), tuned(x)
    assert actual.dtype == torch.float32  # autocast's bf16 output is cast back to eager's dtype
    if allowed:
        assert row.status == "selected" and tuned.backends["graph0"].reduces_precision
        assert not torch.equal(actual, expected)  # it really ran in bf16 ...
        torch.testing.assert_close(actual, expected, atol=2e-2, rtol=2e-2)  # ... within bf16's accuracy
        path = ait.save(tuned, tmp_path / "mlp.ait")  # the checkpoint keeps the autocast configuration
        loaded = ait.load(model, path)
        assert loaded.backends["graph0"].reduces_precision
        with torch.no_grad():
            torch.testing.assert_close(loaded(x), actual, atol=1e-3, rtol=1e-3)
    else:
        assert row.status == "passed" and tuned.backends["graph0"].name == "eager"
        assert "would be SQNR" in row.reason and "cosine" in row.reason
        assert "allow_reduced_precision=True" in row.reason
        assert torch.equal(actual, expected)


class Cancellation(torch.nn.Module):
    """``x (W + D)^T - x W^T``: small fp32 outputs (|out| <= ~2) that are the difference of two large products
    (~1e3), which bf16 rounds to a few units each, so a bf16-autocast run is off by far more than its
    tolerance while shapes, dtypes and finiteness all match eager."""

    def __init__(self):
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        base = torch.randn(32, 64, generator=generator) * 300
        self.big, self.shifted = torch.nn.Linear(64, 32, bias=False), torch.nn.Linear(64, 32, bias=False)
        with torch.no_grad():
            self.big.weight.copy_(base)
            self.shifted.weight.copy_(base + torch.randn(32, 64, generator=generator) * 0.05)

    def forward(self, x):
        return self.shifted(x) - self.big(x)


def test_reduced_precision_leaves_are_judged_by_the_fp16_bf16_tolerances():
    expected = torch.rand(64, 32) * 2.3
    comparator = OutputComparator(low_precision=True)
    comparator.compare(expected, expected + 0.005)  # inside atol=rtol=1e-2
    with pytest.raises(ToleranceExceededError, match="atol=0.01") as caught:
        OutputComparator(low_precision=True).compare(expected, expected + 6.0)
    assert caught.value.max_abs_error == pytest.approx(6.0, abs=1e-4)
    eager_bf16 = TorchEagerBackend(TorchEagerBackendConfig(autocast_enabled=True, autocast_dtype="bfloat16"))
    with pytest.raises(ToleranceExceededError):  # the run-time guard's comparator is the same one
        comparator_for(eager_bf16, Tolerance()).compare(expected, expected + 6.0)


def test_a_bf16_candidate_far_from_eager_is_rejected_even_when_reduced_precision_is_allowed(fast_profiling):
    model = Cancellation().eval()
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            bf16_error = (model(x).float() - expected).abs().max().item()
    assert bf16_error > 1.0 and expected.abs().max().item() < 5  # the premise: bf16 is far off here
    eager_bf16 = TorchEagerBackend(TorchEagerBackendConfig(autocast_enabled=True, autocast_dtype="bfloat16"))
    strategy = ait.FirstWinsStrategy([eager_bf16], profiling_config=fast_profiling, allow_reduced_precision=True)
    tuned = ait.Module(model, "cancel", strategy=strategy.enable_performance_validation(False))
    report = ait.tune(tuned, [x, x[:3]], ready_batches=True)
    row = next(r for r in report.rows if r.backend == "eager" and r.status != "selected")
    assert row.status == "rejected (correctness)" and "atol=0.01" in row.reason
    assert not tuned.backends["graph0"].reduces_precision
    with torch.no_grad():
        assert torch.equal(tuned(x), model(x))
