"""Strategies on real backends plus three deliberately faulty test backends (real code, not mocks)."""

import pytest
import torch
from fake_clock import pause

import aitune.torch as ait
from aitune.errors import BackendBuildError, ConfigError, ToleranceExceededError, TuningError
from aitune.torch.backend import BuildMode, TorchEagerBackend, TorchInductorJitBackend


class OffByOneBackend(TorchEagerBackend):
    """Runs eager and adds 1: fast, but wrong."""

    name = "test_off_by_one"

    def _infer(self, args, kwargs):
        return super()._infer(args, kwargs) + 1


class CrashingBackend(TorchEagerBackend):
    """Fails to build with the kind of message a compiler gives."""

    name = "test_crashing"

    def _build(self, module, graph, device, workdir):
        raise RuntimeError("unsupported operator aten::weird_op in graph")


class SlowBackend(TorchEagerBackend):
    """Correct, but 20 ms slower than eager per call (on the fake clock: tests using it take ``fake_clock``)."""

    name = "test_slow"

    def _infer(self, args, kwargs):
        pause(0.02)
        return super()._infer(args, kwargs)


def _model():
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)).eval()


def _tune(strategy, model=None, data=None, **options):
    model = model or _model()
    wrapped = ait.Module(model, "net", strategy=strategy)
    data = data or [torch.randn(b, 16) for b in (1, 4)]
    report = ait.tune(wrapped, data, **options, ready_batches=True)
    return wrapped, model, report


def test_max_throughput_skips_wrong_crashing_and_slow(fast_profiling, fake_clock):
    strategy = ait.MaxThroughputStrategy([OffByOneBackend(), CrashingBackend(), SlowBackend()],
                                         profiling_config=fast_profiling)
    wrapped, model, report = _tune(strategy)
    rows = {row.description.split("(")[0]: row for row in report.rows}
    assert rows["OffByOneBackend"].status == "rejected (correctness)"
    assert "atol" in rows["OffByOneBackend"].reason
    assert rows["CrashingBackend"].status == "failed" and "aten::weird_op" in rows["CrashingBackend"].reason
    assert rows["CrashingBackend"].log_path.endswith("build.log")
    assert rows["SlowBackend"].status == "passed" and rows["SlowBackend"].speedup < 1.0
    assert rows["TorchEagerBackend"].status == "selected"
    x = torch.randn(3, 16)
    torch.testing.assert_close(wrapped(x), model(x))


def test_one_backend_strategy_raises_the_original_error(fast_profiling):
    with pytest.raises(BackendBuildError) as info:
        _tune(ait.OneBackendStrategy(CrashingBackend(), profiling_config=fast_profiling), ignore_failing_modules=False)
    assert isinstance(info.value.__cause__, RuntimeError)


def test_one_backend_strategy_raises_correctness_error(fast_profiling):
    wrapped = ait.Module(_model(), "net", strategy=ait.OneBackendStrategy(OffByOneBackend(),
                                                                          profiling_config=fast_profiling))
    report = ait.tune(wrapped, [torch.randn(2, 16)], ready_batches=True)  # the module falls back to eager
    assert "ToleranceExceededError" in report.module_errors["net"]
    assert wrapped.state is ait.ModuleState.PASSTHROUGH
    with pytest.raises(ToleranceExceededError):
        ait.tune(ait.Module(_model(), "net2", strategy=ait.OneBackendStrategy(OffByOneBackend())),
                 [torch.randn(2, 16)], ignore_failing_modules=False, ready_batches=True)


def test_first_wins_takes_first_passing_and_beating_eager(fast_profiling, fake_clock):
    strategy = ait.FirstWinsStrategy([CrashingBackend(), SlowBackend(), OffByOneBackend()],
                                     profiling_config=fast_profiling)
    _, _, report = _tune(strategy)
    statuses = [row.status for row in report.rows]
    assert statuses[:3] == ["failed", "rejected (performance)", "rejected (correctness)"]
    assert report.graphs[0].selected.startswith("TorchEagerBackend")


def test_first_wins_without_performance_validation_takes_slow(fast_profiling, fake_clock):
    strategy = ait.FirstWinsStrategy([SlowBackend(), TorchInductorJitBackend()], profiling_config=fast_profiling)
    strategy.enable_performance_validation(False)
    _, _, report = _tune(strategy)
    assert report.graphs[0].selected.startswith("SlowBackend")
    assert [row.status for row in report.rows] == ["selected", "skipped"]


def test_latency_budget(fast_profiling, fake_clock):
    with pytest.raises(ConfigError):
        ait.LatencyBudgetStrategy(0)
    impossible = ait.LatencyBudgetStrategy(1e-6, [SlowBackend()], profiling_config=fast_profiling)
    with pytest.raises(TuningError, match="latency budget"):
        ait.tune(ait.Module(_model(), "lb", strategy=impossible), [torch.randn(2, 16)],
                 ignore_failing_modules=False, ready_batches=True)
    _, _, report = _tune(ait.LatencyBudgetStrategy(10.0, [SlowBackend()], profiling_config=fast_profiling))
    slow = [row for row in report.rows if row.description.startswith("SlowBackend")][0]
    assert slow.status == "rejected (performance)" and "budget" in slow.reason


def test_min_latency_prefers_eager_over_slow(fast_profiling, fake_clock):
    _, _, report = _tune(ait.MinLatencyStrategy([SlowBackend()], profiling_config=fast_profiling))
    assert report.graphs[0].selected.startswith("TorchEagerBackend")


def test_strategy_bad_input():
    with pytest.raises(ConfigError, match="empty"):
        ait.MaxThroughputStrategy([])
    with pytest.raises(ConfigError, match="not an aitune backend"):
        ait.MaxThroughputStrategy(["inductor"])
    with pytest.raises(ConfigError):
        ait.OneBackendStrategy(None)
    with pytest.raises(ConfigError):
        ait.MaxThroughputStrategy().enable_performance_validation(True, min_speedup_ratio=0)


def test_unavailable_backend_is_a_row_not_a_crash(fast_profiling):
    from aitune.torch.backend import TensorRTBackend

    _, _, report = _tune(ait.MaxThroughputStrategy([TensorRTBackend()], profiling_config=fast_profiling))
    row = report.rows[0]
    assert row.status in ("unavailable", "unsupported") and row.reason
    assert report.graphs[0].selected.startswith("TorchEagerBackend")


class UnloadableAotBackend(TorchEagerBackend):
    """Declares AOT but its artifact cannot be loaded back."""

    name = "test_unloadable_aot"
    build_mode = BuildMode.AOT

    def _load(self, directory, metadata, module, graph, device):
        raise RuntimeError("argument type mismatch in the saved artifact")


class DriftingAotBackend(TorchEagerBackend):
    """Declares AOT; the loaded artifact computes something else than the built one."""

    name = "test_drifting_aot"
    build_mode = BuildMode.AOT

    def _load(self, directory, metadata, module, graph, device):
        self._callable = lambda input: torch.zeros(input.shape[0], 4)  # loads fine, computes something else


def test_aot_candidates_must_round_trip_before_selection(fast_profiling):
    strategy = ait.MaxThroughputStrategy([UnloadableAotBackend(), DriftingAotBackend()],
                                         profiling_config=fast_profiling)
    wrapped, model, report = _tune(strategy)
    rows = {row.backend: row for row in report.rows}
    assert rows["test_unloadable_aot"].status == "failed"
    assert rows["test_unloadable_aot"].reason.startswith("not saveable") and "argument type mismatch" in \
        rows["test_unloadable_aot"].reason
    assert rows["test_drifting_aot"].status == "failed" and "not saveable" in rows["test_drifting_aot"].reason
    assert "ToleranceExceededError" in rows["test_drifting_aot"].reason
    assert rows["eager"].status == "selected"
    x = torch.randn(2, 16)
    torch.testing.assert_close(wrapped(x), model(x))


def test_failed_build_log_holds_the_traceback(fast_profiling):
    _, _, report = _tune(ait.MaxThroughputStrategy([CrashingBackend()], profiling_config=fast_profiling))
    row = [r for r in report.rows if r.backend == "test_crashing"][0]
    log = open(row.log_path).read()
    assert "Traceback" in log and "aten::weird_op" in log


class BrokenEligibilityBackend(TorchEagerBackend):
    """Its supports() itself raises: that must be a row, not a failed module."""

    name = "test_broken_supports"

    def _supports(self, module, graph, device):
        raise KeyError("no such preset")


def test_a_raising_supports_is_a_row(fast_profiling, fake_clock):
    strategy = ait.MaxThroughputStrategy([BrokenEligibilityBackend(), SlowBackend()], profiling_config=fast_profiling)
    wrapped, model, report = _tune(strategy)
    rows = {row.backend: row for row in report.rows}
    assert rows["test_broken_supports"].status == "failed" and "no such preset" in rows["test_broken_supports"].reason
    assert rows["test_slow"].status == "passed" and not report.module_errors


def test_eager_with_cuda_graphs_is_not_the_plain_passthrough():
    from aitune.torch.backend import TorchEagerBackendConfig
    from aitune.torch.tune_strategy.base import _simplicity

    assert TorchEagerBackend().passthrough and _simplicity(TorchEagerBackend()) == (0, 0)
    graphs = TorchEagerBackend(TorchEagerBackendConfig(use_cuda_graphs=True))
    assert not graphs.passthrough and _simplicity(graphs) > (0, 0)


class Cancel(torch.nn.Module):
    """fp16: two large, nearly equal projections subtracted — eager fp16 loses digits to cancellation."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(64, 16)
        self.b = torch.nn.Linear(64, 16)
        with torch.no_grad():
            self.a.weight.mul_(40)
            self.b.weight.copy_(self.a.weight + 0.01 * torch.randn_like(self.a.weight))
            self.b.bias.copy_(self.a.bias)

    def forward(self, x):
        return self.a(x) - self.b(x)


class Fp32ComputeBackend(TorchEagerBackend):
    """Runs a float32 copy and returns fp16: more accurate than eager fp16, yet far from it in places."""

    name = "test_fp32_compute"

    def _build(self, module, graph, device, workdir):
        import copy

        super()._build(module, graph, device, workdir)
        self._module32 = copy.deepcopy(module).float()

    def _infer(self, args, kwargs):
        with torch.no_grad():
            return self._module32(*[a.float() for a in args], **{k: v.float() for k, v in kwargs.items()}).half()


class SloppyFp16Backend(TorchEagerBackend):
    """fp16 with large extra error: must stay rejected."""

    name = "test_sloppy_fp16"

    def _infer(self, args, kwargs):
        out = super()._infer(args, kwargs)
        return out + (torch.randn_like(out.float()) * 5.0).half()


def test_fp16_candidates_judged_against_an_fp32_run(fast_profiling):
    torch.manual_seed(0)
    model = Cancel().half().eval()
    data = [torch.randn(b, 64).half() * 10 for b in (2, 4)]
    strategy = ait.MaxThroughputStrategy([Fp32ComputeBackend(), SloppyFp16Backend()], profiling_config=fast_profiling)
    wrapped = ait.Module(model, "half", strategy=strategy)
    report = ait.tune(wrapped, data, ready_batches=True)
    rows = {row.backend: row for row in report.rows}
    assert rows["test_fp32_compute"].status in ("passed", "selected"), rows["test_fp32_compute"].reason
    assert rows["test_fp32_compute"].comparison["metric"] == "allclose+fp32-parity"
    assert rows["test_fp32_compute"].comparison["max_abs_error"] > 1e-2  # the plain rule alone would reject it
    assert rows["test_sloppy_fp16"].status == "rejected (correctness)" and "RMSE" in rows["test_sloppy_fp16"].reason
    assert model.a.weight.dtype == torch.float16  # the fp32 copy never touched the user's module


class CancelSeeingFlags(Cancel):
    """Cancel, noting the cuDNN autotuner setting and the dtype of every call in ``SEEN`` (a class attribute:
    deep copies such as the fp32 one note there too)."""

    SEEN: list = []
    IN_CANDIDATE = False

    def forward(self, x):
        if not self.IN_CANDIDATE:
            self.SEEN.append((x.dtype, torch.backends.cudnn.benchmark))
        return super().forward(x)


class Fp32ComputeNotNoted(Fp32ComputeBackend):
    """Fp32ComputeBackend whose own (candidate) calls CancelSeeingFlags does not note."""

    def _infer(self, args, kwargs):
        CancelSeeingFlags.IN_CANDIDATE = True
        try:
            return super()._infer(args, kwargs)
        finally:
            CancelSeeingFlags.IN_CANDIDATE = False


def test_reference_calls_run_without_cudnn_autotuning_and_keep_the_users_setting(fast_profiling, monkeypatch):
    # NOTE [no cuDNN autotuning for references]: the fp32 copy's first call timed every cuDNN algorithm (gigabytes
    # of workspace on a GPU); here the flag each call saw is the observable, on any machine
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", True)
    torch.manual_seed(0)
    model = CancelSeeingFlags().half().eval()
    monkeypatch.setattr(CancelSeeingFlags, "SEEN", [])
    data = [torch.randn(b, 64).half() * 10 for b in (2, 4)]
    strategy = ait.MaxThroughputStrategy([Fp32ComputeNotNoted()], profiling_config=fast_profiling)
    report = ait.tune(ait.Module(model, "flags", strategy=strategy), data, ready_batches=True)
    assert report.rows[0].comparison["metric"] == "allclose+fp32-parity"  # rule 5 ran: the fp32 copy was called
    fp32_calls = [benchmark for dtype, benchmark in CancelSeeingFlags.SEEN if dtype == torch.float32]
    assert fp32_calls and not any(fp32_calls)
    assert (torch.float16, True) in CancelSeeingFlags.SEEN  # the recorded calls ran as the user set them
    assert (torch.float16, False) in CancelSeeingFlags.SEEN  # probes' eager references: one-off shapes, no autotuning
    assert torch.backends.cudnn.benchmark is True


def test_the_strategy_description_says_when_the_defaults_may_quantize():
    # the demo's strategy allows quantization: its description must not read like the plain defaults
    assert ait.MaxThroughputStrategy().describe() == "MaxThroughputStrategy(<defaults>)"
    assert ait.MaxThroughputStrategy(allow_quantization=True).describe() == \
        "MaxThroughputStrategy(<defaults>, quantization allowed, reduced precision allowed)"
    assert ait.MaxThroughputStrategy(allow_reduced_precision=True).describe() == \
        "MaxThroughputStrategy(<defaults>, reduced precision allowed)"
