"""Quantization only on request: with the default candidates a quantizing
backend is measured and shown but not selected; allow_quantization=True (or listing it yourself) allows it."""

import pytest
import torch
from fake_clock import pause

import aitune.torch as ait
from aitune.torch.backend import TorchEagerBackend



class PausedMLP(torch.nn.Module):
    """Eager pays a 3 ms pause (on the fake clock); the 'quantizing' test backend below skips it, so it always wins
    on speed."""

    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))

    def forward(self, x):
        pause(0.003)
        return self.body(x)


class FakeInt8Backend(TorchEagerBackend):
    """A quantizing candidate (judged by SQNR/cosine): the MLP with weights rounded to 1/64 — close to eager,
    not equal — and without the pause, so it is the fastest."""

    name = "test_fake_int8"
    passthrough = False
    is_quantizing = True

    def _build(self, module, graph, device, workdir):
        import copy

        super()._build(module, graph, device, workdir)
        self._rounded = copy.deepcopy(module.body)
        with torch.no_grad():
            for parameter in self._rounded.parameters():
                parameter.copy_(torch.round(parameter * 64) / 64)
        self.build_info["quantized_modules"] = 2

    def _infer(self, args, kwargs):
        return self._rounded(kwargs["x"])


def _tune(strategy):
    tuned = ait.Module(PausedMLP().eval(), "mlp", strategy=strategy)
    report = ait.tune(tuned, [torch.randn(b, 32) for b in (2, 4)], ready_batches=True)
    return tuned, next(r for r in report.rows if r.backend == "test_fake_int8")


def test_default_candidates_show_but_never_select_quantization(fast_profiling, fake_clock, monkeypatch):
    from aitune.torch.tune_strategy import base

    monkeypatch.setattr(base, "default_backends", lambda device, module=None, graph=None: [FakeInt8Backend()])
    tuned, row = _tune(ait.MaxThroughputStrategy(profiling_config=fast_profiling))
    assert row.status == "passed" and row.speedup > 1.5
    assert "would be" in row.reason and "SQNR" in row.reason and "allow_quantization=True" in row.reason
    assert tuned.backends["graph0"].name == "eager"


@pytest.mark.parametrize("how", ["switch", "listed"])
def test_allowed_quantization_is_selected(how, fast_profiling, fake_clock):
    if how == "switch":
        strategy = ait.MaxThroughputStrategy([FakeInt8Backend()], profiling_config=fast_profiling,
                                             allow_quantization=True)
    else:  # listing a quantizing backend yourself is asking for it
        strategy = ait.MaxThroughputStrategy([FakeInt8Backend()], profiling_config=fast_profiling)
    tuned, row = _tune(strategy)
    assert row.status == "selected"
    assert tuned.backends["graph0"].name == "test_fake_int8"


def test_listed_but_explicitly_forbidden(fast_profiling, fake_clock):
    strategy = ait.FirstWinsStrategy([FakeInt8Backend()], profiling_config=fast_profiling).enable_quantization(False)
    tuned, row = _tune(strategy)
    assert row.status == "passed" and "would be" in row.reason
    assert tuned.backends["graph0"].name == "eager"
