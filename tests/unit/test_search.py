"""Search: search spaces, successive halving, the time budget, expensive candidates, and
crashes remembered per environment. Backends here are real code (test subclasses of the eager backend, and
a child build step that really segfaults), not mocks."""

import ctypes

import pytest
import torch
from fake_clock import pause

import aitune.torch as ait
from aitune.torch.backend import TorchEagerBackend, TorchInductorJitBackend, TorchInductorJitBackendConfig
from aitune.torch.backend.compile_settings import parameter_freezing
from aitune.torch.backend.isolation import run_isolated


def _net():
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)).eval()


class Delayed(TorchEagerBackend):
    """Right, and slower than eager by a configurable pause on the fake clock (so the ranking is known whatever
    the machine's load; tests using it take the ``fake_clock`` fixture)."""

    name = "test_delayed"
    passthrough = False
    delay_s = 0.0

    def describe(self):
        return f"Delayed({self.delay_s})"

    def copy(self):
        copy = super().copy()
        copy.delay_s = self.delay_s
        return copy

    def _infer(self, args, kwargs):
        pause(self.delay_s)
        return super()._infer(args, kwargs)


def delayed(seconds):
    backend = Delayed()
    backend.delay_s = seconds
    return backend


def test_successive_halving_measures_only_the_finalists_at_full_length(fast_profiling, fake_clock):
    backends = [delayed(s) for s in (0.004, 0.0, 0.001, 0.002, 0.003)]
    strategy = ait.MaxThroughputStrategy(backends, profiling_config=fast_profiling)
    tuned = ait.Module(_net(), "halving", strategy=strategy)
    report = ait.tune(tuned, [torch.randn(b, 16) for b in (2, 4)], ready_batches=True)
    rows = [r for r in report.rows if r.backend == "test_delayed"]
    finalists = [r.description for r in rows if r.details.get("finalist")]
    assert sorted(finalists) == ["Delayed(0.0)", "Delayed(0.001)", "Delayed(0.002)"]
    others = [r for r in rows if r.details.get("finalist") is False]
    assert len(others) == 2 and all("not among the 3 finalists" in r.reason for r in others)
    assert all(r.status != "selected" for r in others)
    assert all("device_retained_bytes" not in r.details and "device_peak_bytes" not in r.details for r in rows)  # CUDA-only
    # 3 finalists + eager measured in full; all 5 delayed candidates and eager passed their checks
    assert "among 4 correct candidates (eager included) measured in full (6 passed their checks)" in \
        report.graphs[0].selection_reason
    # every finalist that lost says why: its figure against the selected one's
    selected = next(r for r in report.rows if r.status == "selected")
    losers = [r for r in rows if r.details.get("finalist") and r.status == "passed"]
    assert len(losers) == (3 if selected.backend == "eager" else 2)
    for row in losers:
        assert row.reason.startswith(f"not selected: {row.speedup:.2f}x eager against {selected.speedup:.2f}x eager "
                                     f"for the selected {selected.description}"), row.reason


def test_a_finalist_measured_below_a_non_finalist_says_which_quick_figure_made_it_a_finalist():
    """Rows of finalists show their full measurement and the others their quick one; where that makes a finalist
    look slower than a non-finalist (e.g. a 1.00x finalist beside a 1.06x non-finalist), the
    finalist's row gives its quick figure."""
    from aitune.torch.search.evaluation import Candidate
    from aitune.torch.report.rows import CandidateResult
    from aitune.torch.tune_strategy.base import _explain_finalists

    def candidate(name, quick, full=None):
        row = CandidateResult(module="m", graph="g", backend=name, description=name, speedup=full or quick,
                              details={"quick_speedup": quick})
        return Candidate(backend=None, row=row)

    slipped, held, other = candidate("slipped", 1.12, 1.00), candidate("held", 1.10, 1.09), candidate("other", 1.06)
    _explain_finalists([slipped, held], [other])
    assert slipped.row.reason.startswith("finalist on its quick measurement (1.12x eager)")
    assert held.row.reason == "" and other.row.reason == ""


def test_default_candidates_expand_search_spaces():
    from aitune.torch.tune_strategy.base import default_backends

    cpu = [b.describe() for b in default_backends("cpu")]
    assert "TorchInductorJitBackend()" in cpu and "TorchInductorJitBackend(freezing=True)" in cpu
    conv = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3)).eval()
    graph = ait.Module(conv, "conv")
    graph(torch.randn(2, 3, 8, 8))
    with_conv = [b.describe() for b in default_backends("cpu", conv, graph.graphs[0])]
    assert "TorchInductorJitBackend(freezing=True,memory_format=channels_last)" in with_conv
    cuda = [b.describe() for b in TorchInductorJitBackend().search_space(conv, graph.graphs[0], "cuda")]
    # NOTE [captured CUDA graphs]: aitune's own capture of the frozen compile (for a convnet channels-last) beside
    # reduce-overhead + freezing, without freezing the fallback (benchmarks/RESULTS.md, thirty-first session)
    assert cuda[:3] == ["TorchInductorJitBackend(fullgraph=True,freezing=True,memory_format=channels_last,"
                        "capture_cuda_graphs=True)",
                        "TorchInductorJitBackend(mode=reduce-overhead,freezing=True)",
                        "TorchInductorJitBackend(mode=reduce-overhead)"]
    assert any("max-autotune" in text for text in cuda)
    chosen = TorchInductorJitBackend(TorchInductorJitBackendConfig(mode="default"))
    assert chosen.search_space(conv, graph.graphs[0], "cpu") == [chosen]  # the user's choice is kept
    assert not any("conv_1x1_as_mm" in text for text in cuda)  # a 3x3 convolution only


def test_on_cuda_aitunes_own_cuda_graphs_lead_for_fixed_shapes_and_reduce_overhead_for_a_dynamic_axis():
    """NOTE [captured CUDA graphs]: measured faster than reduce-overhead + freezing on ResNet-50 b1 and BERT-base b32
    (benchmarks/RESULTS.md, thirty-first session), ``capture_cuda_graphs`` + freezing leads the first tier, beside
    reduce-overhead + freezing, for a graph without a dynamic axis (one recorded shape);
    reduce-overhead without freezing stays the fallback (built when both fail their checks). A graph with a dynamic
    axis (the runner would capture every shape it meets, a memory pool each) keeps reduce-overhead + freezing first
    and the capture as an extra."""
    from aitune.torch.backend.ort_cuda_graph import recorded_shapes

    net = torch.nn.Sequential(torch.nn.Linear(4, 4)).eval()
    captured = "TorchInductorJitBackend(fullgraph=True,freezing=True,capture_cuda_graphs=True)"
    frozen = "TorchInductorJitBackend(mode=reduce-overhead,freezing=True)"
    fallback = "TorchInductorJitBackend(mode=reduce-overhead)"
    for batches, first_tier in (((2,), [captured, frozen]), ((1, 32), [frozen])):
        wrapped = ait.Module(net, f"net{len(batches)}")
        for batch in batches:
            wrapped(torch.randn(batch, 4))
        graph = wrapped.graphs[0]
        assert recorded_shapes(graph) == len(batches) and graph.is_dynamic == (len(batches) > 1)
        variants = TorchInductorJitBackend().search_space(net, graph, "cuda")
        assert [b.describe() for b in variants if b.search_tier == 0] == first_tier
        assert [b.describe() for b in variants if b.search_fallback] == [fallback]
        assert captured in [b.describe() for b in variants]
    assert recorded_shapes(None) == 0


def test_aitunes_own_cuda_graphs_need_a_cuda_device_and_inputs_left_as_they_are():
    """NOTE [captured CUDA graphs]: a graph without a cache is replayed on copies of its inputs, so a module that
    changes its inputs in place is refused, as are a device without CUDA and a module with forward hooks (its calls
    would all run eager); its weights count as baked (watched)."""
    from aitune.torch.record.samples import record_graphs

    class Center(torch.nn.Module):
        def forward(self, x):
            x.sub_(x.mean(-1, keepdim=True))
            return x

    captured = TorchInductorJitBackend(TorchInductorJitBackendConfig(capture_cuda_graphs=True, freezing=True))
    mutating = record_graphs(Center(), [((torch.randn(2, 5),), {})])[0]
    assert "inputs in place" in captured.supports(Center(), mutating, torch.device("cuda")).reason
    net = torch.nn.Sequential(torch.nn.Linear(5, 3)).eval()
    plain = record_graphs(net, [((torch.randn(2, 5),), {})])[0]
    assert captured.supports(net, plain, torch.device("cuda")).ok
    assert "needs a CUDA device" in captured.supports(net, plain, torch.device("cpu")).reason
    handle = net[0].register_forward_hook(lambda module, args, output: None)  # a replay would never run it
    try:
        assert "forward hooks" in captured.supports(net, plain, torch.device("cuda")).reason
    finally:
        handle.remove()
    assert captured.supports(net, plain, torch.device("cuda")).ok
    assert TorchInductorJitBackend(TorchInductorJitBackendConfig(capture_cuda_graphs=True)).bakes_weights


def test_a_convnet_with_1x1_convolutions_gets_them_as_matrix_multiplies_first_on_cuda_for_a_dynamic_axis():
    """On CUDA, for a graph with a dynamic axis (here more recorded batch sizes than ONNX Runtime's CUDA graphs
    lead for, ``MAX_SEARCH_SHAPES``), reduce-overhead + freezing with ``conv_1x1_as_mm`` is first-tier for a model with 1x1
    convolutions, beside reduce-overhead with and without freezing; for fixed shapes it is an extra; on CPU nothing
    changes."""
    from aitune.torch.backend.ort_cuda_graph import MAX_SEARCH_SHAPES

    net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.Conv2d(8, 4, 1)).eval()
    few = ait.Module(net, "net1x1few")
    few(torch.randn(2, 3, 8, 8))
    tiers = {b.describe(): b.search_tier for b in TorchInductorJitBackend().search_space(net, few.graphs[0], "cuda")}
    assert tiers["TorchInductorJitBackend(options={'conv_1x1_as_mm': True, 'triton.cudagraphs': True},"
                 "freezing=True)"] == 1
    wrapped = ait.Module(net, "net1x1")
    for batch in range(1, MAX_SEARCH_SHAPES + 2):
        wrapped(torch.randn(batch, 3, 8, 8))
    assert len(wrapped.graphs) == 1  # (one graph, its batch a dynamic axis)
    variants = TorchInductorJitBackend().search_space(net, wrapped.graphs[0], "cuda")
    tiers = {b.describe(): b.search_tier for b in variants}
    mm = "TorchInductorJitBackend(options={'conv_1x1_as_mm': True, 'triton.cudagraphs': True},freezing=True)"
    assert [text for text, tier in tiers.items() if tier == 0] == [
        "TorchInductorJitBackend(mode=reduce-overhead,freezing=True)", mm]
    assert tiers["TorchInductorJitBackend(fullgraph=True,freezing=True,capture_cuda_graphs=True)"] == 1
    assert tiers["TorchInductorJitBackend(mode=reduce-overhead,freezing=True,memory_format=channels_last)"] == 1
    [as_mm] = [b for b in variants if b.describe() == mm]  # what torch.compile gets: CUDA graphs, 1x1 as mm, freezing
    assert as_mm.config.compile_arguments() == (None, {"triton.cudagraphs": True, "conv_1x1_as_mm": True,
                                                      "freezing": True})
    fallbacks = [b.describe() for b in variants if b.search_fallback]
    assert fallbacks == ["TorchInductorJitBackend(mode=reduce-overhead)"]  # built when no freezing variant passes
    assert tiers[fallbacks[0]] == 1
    cpu = [b.describe() for b in TorchInductorJitBackend().search_space(net, wrapped.graphs[0], "cpu")]
    assert not any("conv_1x1_as_mm" in text for text in cpu)
    strided = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 1, stride=2)).eval()  # not lowered to a matrix multiply
    assert not any("conv_1x1_as_mm" in b.describe() for b in TorchInductorJitBackend().search_space(
        strided, wrapped.graphs[0], "cuda"))


class Variant(TorchEagerBackend):
    """Two variants of one backend class: one returns wrong values (fails its check), one is right."""

    name = "test_variant"
    passthrough = False
    wrong = False
    tag = ""

    def describe(self):
        return f"Variant({self.tag})"

    def copy(self):
        copy = super().copy()
        copy.wrong, copy.tag = self.wrong, self.tag
        return copy

    def _infer(self, args, kwargs):
        out = super()._infer(args, kwargs)
        return out + 1.0 if self.wrong else out


def _fallback_search(first_wrong: bool, fast_profiling, **tune_kwargs):
    first, fallback = Variant(), Variant()
    first.wrong, first.tag, fallback.tag = first_wrong, "first", "fallback"
    fallback._tier, fallback._fallback = 1, True
    model = _net()
    tuned = ait.Module(model, "fallback", strategy=ait.MaxThroughputStrategy(
        [first, fallback], profiling_config=fast_profiling).enable_performance_validation(False))
    report = ait.tune(tuned, [torch.randn(4, 16)], ready_batches=True, **tune_kwargs)
    return {r.description: r for r in report.rows if r.backend == "test_variant"}, tuned, model


def test_a_fallback_variant_is_built_only_when_no_other_variant_of_its_backend_passes(fast_profiling):
    rows, tuned, model = _fallback_search(first_wrong=True, fast_profiling=fast_profiling)
    assert rows["Variant(first)"].status == "rejected (correctness)"
    assert rows["Variant(fallback)"].status in ("passed", "selected")  # promoted: built without a budget
    x = torch.randn(3, 16)
    with torch.no_grad():
        torch.testing.assert_close(tuned(x), model(x))
    rows, _, _ = _fallback_search(first_wrong=False, fast_profiling=fast_profiling)
    assert rows["Variant(first)"].status in ("passed", "selected")
    skipped = rows["Variant(fallback)"]  # not needed
    assert skipped.status == "skipped" and "fallback variant" in skipped.reason and "one did" in skipped.reason


@pytest.mark.parametrize("make", [lambda backends, profiling: ait.FirstWinsStrategy(backends, profiling_config=profiling),
                                  lambda backends, profiling: ait.LatencyBudgetStrategy(1e6, backends,
                                                                                        profiling_config=profiling)],
                         ids=["first-wins", "latency-budget"])
def test_every_strategy_builds_a_fallback_variant_when_no_other_variant_of_its_backend_passes(make, fast_profiling):
    first, fallback = Variant(), Variant()
    first.wrong, first.tag, fallback.tag = True, "first", "fallback"
    fallback._tier, fallback._fallback = 1, True
    model = _net()
    strategy = make([first, fallback], fast_profiling).enable_performance_validation(False)  # (built, not timed)
    report = ait.tune(ait.Module(model, "fallback", strategy=strategy), [torch.randn(4, 16)], ready_batches=True)
    rows = {r.description: r for r in report.rows if r.backend == "test_variant"}
    assert rows["Variant(first)"].status == "rejected (correctness)"
    assert rows["Variant(fallback)"].status in ("passed", "selected"), rows["Variant(fallback)"].reason


class PausedNet(torch.nn.Module):
    """``_net()`` whose eager forward pauses 2 ms on the fake clock; :class:`Unpaused` computes the same values
    without the pause, so it ranks first whatever the machine's load."""

    def __init__(self):
        super().__init__()
        self.net = _net()

    def forward(self, x):
        pause(0.002)
        return self.net(x)


class Unpaused(Variant):
    def _infer(self, args, kwargs):
        with torch.no_grad():
            out = self._callable.net(*args, *kwargs.values())
        return out + 1.0 if self.wrong else out


def test_a_promoted_fallback_that_won_is_rebuilt_by_a_re_tune(fast_profiling, fake_clock):
    """A fallback variant promoted in a tune (no other variant of its backend passed) and ranked first is rebuilt,
    promoted again, by a re-tune that reuses the ranking; it was skipped as an unneeded fallback there, and eager
    served the graph."""
    net, batches = PausedNet().eval(), [torch.randn(4, 16)]
    for tune in ("first", "re-tune"):
        first, fallback = Unpaused(), Unpaused()
        first.wrong, first.tag, fallback.tag = True, "first", "fallback"
        fallback._tier, fallback._fallback = 1, True
        tuned = ait.Module(net, tune, strategy=ait.MaxThroughputStrategy(
            [first, fallback], profiling_config=fast_profiling).enable_performance_validation(False))
        report = ait.tune(tuned, batches, ready_batches=True)
        rows = {r.description: r for r in report.rows if r.backend == "test_variant"}
        assert rows["Variant(fallback)"].status == "selected", (tune, rows["Variant(fallback)"].reason)
    assert "rebuilt: among the winners" in rows["Variant(fallback)"].reason


def test_a_fallback_variant_is_built_anyway_with_a_budget_of_at_least_60_s(fast_profiling):
    """README "Search": with a budget of >= 60 s the fallback variant is built as an extra even though an
    earlier variant of its backend passed; with less left it is skipped, saying how much was left. (The budget
    runs on the real clock: these tunes take seconds, far from either bound.)"""
    rows, _, _ = _fallback_search(first_wrong=False, fast_profiling=fast_profiling, time_budget_s=600)
    assert rows["Variant(first)"].status in ("passed", "selected")
    built = rows["Variant(fallback)"]
    assert built.status in ("passed", "selected"), built.reason
    assert built.comparison is not None and built.comparison["max_abs_error"] == 0.0  # built and checked
    assert built.measurement is not None
    rows, _, _ = _fallback_search(first_wrong=False, fast_profiling=fast_profiling, time_budget_s=30)
    skipped = rows["Variant(fallback)"]
    assert skipped.status == "skipped" and "fallback variant" in skipped.reason
    assert "s of the budget left" in skipped.reason and ">= 60 s" in skipped.reason


def test_every_row_s_json_keeps_the_seconds_of_each_phase_after_its_build(fast_profiling):
    """README "Search": each row's JSON (the report file on disk) keeps ``details.phase_s``: seconds of check,
    probes, measure (and round_trip for AOT artifacts), each >= 0."""
    import json

    strategy = ait.MaxThroughputStrategy([Variant()], profiling_config=fast_profiling)
    report = ait.tune(ait.Module(_net(), "phases", strategy=strategy), [torch.randn(2, 16), torch.randn(4, 16)],
                      ready_batches=True)
    saved = json.loads(open(report.path).read())
    [row] = [r for g in saved["graphs"] for r in g["candidates"] if r["backend"] == "test_variant"]
    phases = row["details"]["phase_s"]
    assert set(phases) == {"check", "probes", "measure"}  # a JIT candidate: no round trip
    assert all(isinstance(seconds, float) and seconds >= 0.0 for seconds in phases.values())
    assert sum(phases.values()) <= saved["duration_s"]


def test_tuning_raises_dynamo_s_recompile_limit_to_64_and_never_lowers_it(fast_profiling):
    """README "Search": aitune raises dynamo's ``recompile_limit`` to 64 for the process when it tunes with
    Inductor (NOTE [recompile limit]); a higher limit the user set is kept."""
    import torch._dynamo.config as dynamo_config

    def tune_inductor(name):
        strategy = ait.OneBackendStrategy(TorchInductorJitBackend(), profiling_config=fast_profiling,
                                          probe_config=ait.ProbeConfig(enabled=False))
        tuned = ait.Module(_net(), name, strategy=strategy.enable_performance_validation(False))
        report = ait.tune(tuned, [torch.randn(2, 16)], ready_batches=True)
        assert report.graphs[0].selected.startswith("TorchInductorJitBackend"), report.rows[0].reason

    with dynamo_config.patch(recompile_limit=8):  # dynamo's default; the user's value is restored on exit
        tune_inductor("limit")
        assert dynamo_config.recompile_limit == 64
    with dynamo_config.patch(recompile_limit=100):
        tune_inductor("kept")
        assert dynamo_config.recompile_limit == 100


def test_1x1_convolutions_as_matrix_multiplies_with_freezing_match_eager(fast_profiling):
    """The option plumbing of the CUDA variant (options + freezing), run on CPU without CUDA graphs."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.BatchNorm2d(16), torch.nn.ReLU(),
                                torch.nn.Conv2d(16, 8, 1)).eval()
    backend = TorchInductorJitBackend(TorchInductorJitBackendConfig(options={"conv_1x1_as_mm": True}, freezing=True))
    tuned = ait.Module(model, "mm1x1", strategy=ait.OneBackendStrategy(backend, profiling_config=fast_profiling)
                       .enable_performance_validation(False))
    ait.tune(tuned, [torch.randn(2, 3, 12, 12)], ignore_failing_modules=False, ready_batches=True)
    assert tuned.backends["graph0"].config.options == {"conv_1x1_as_mm": True}
    x = torch.randn(2, 3, 12, 12)
    with torch.no_grad():
        torch.testing.assert_close(tuned(x), model(x), atol=1e-4, rtol=1e-3)


def test_onnxruntime_optimization_level_is_a_budgeted_variant_that_matches_eager(fast_profiling):
    from aitune.torch.backend import ONNXRuntimeBackend
    from aitune.torch.tune_strategy.base import default_backends

    variants = {b.describe(): b for b in default_backends("cpu")}
    extended = variants["ONNXRuntimeBackend(graph_optimization_level=extended)"]
    assert extended.search_tier == 1 and variants["ONNXRuntimeBackend()"].search_tier == 0
    model = _net()
    chosen = ONNXRuntimeBackend(extended.config)  # as a user would ask for it: tried without a budget
    tuned = ait.Module(model, "ort-extended", strategy=ait.OneBackendStrategy(
        chosen, profiling_config=fast_profiling).enable_performance_validation(False))
    ait.tune(tuned, [torch.randn(2, 16), torch.randn(5, 16)], ignore_failing_modules=False, ready_batches=True)
    assert isinstance(tuned.backends["graph0"], ONNXRuntimeBackend)
    x = torch.randn(3, 16)
    with torch.no_grad():
        torch.testing.assert_close(tuned(x), model(x), atol=1e-5, rtol=1e-4)


def test_the_bert_fusion_variant_says_what_it_fused_and_matches_eager(fast_profiling):
    """ONNX Runtime's transformer optimizer on a real (tiny) BERT encoder: the row names the fusions, the report's
    ONNX path is the fused graph the session runs, and the outputs match eager."""
    from transformers import BertConfig, BertModel

    from aitune.torch.backend import ONNXRuntimeBackend
    from aitune.torch.backend.ort import ONNXRuntimeBackendConfig, transformer_fusion_note

    class Encoder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.bert = BertModel(BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                             intermediate_size=64))

        def forward(self, input_ids, attention_mask):
            return self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state

    torch.manual_seed(0)
    model = Encoder().eval()
    backend = ONNXRuntimeBackend(ONNXRuntimeBackendConfig(transformer_fusions="bert"))
    tuned = ait.Module(model, "tiny-bert", strategy=ait.OneBackendStrategy(backend, profiling_config=fast_profiling)
                       .enable_performance_validation(False))
    ids = torch.randint(0, 100, (2, 16))
    report = ait.tune(lambda item: tuned(**item), [{"input_ids": ids, "attention_mask": torch.ones_like(ids)}],
                      ignore_failing_modules=False, ready_batches=True)
    [row] = [r for r in report.rows if r.backend == "onnxruntime"]
    counts = row.details["transformer_fusions"]
    assert counts.get("SkipLayerNormalization", 0) > 0 and "transformer fusions: " in row.reason
    assert row.details["onnx_path"].endswith("fused_model.onnx")
    other = torch.randint(0, 100, (2, 16))
    mask = torch.ones_like(other)
    with torch.no_grad():
        torch.testing.assert_close(tuned(input_ids=other, attention_mask=mask), model(other, mask),
                                   atol=1e-4, rtol=1e-3)
    # fusions the session makes itself (as on MiniLM, where symbolic shape inference failed): said so
    note = transformer_fusion_note({"BiasGelu": 6, "LayerNormalization": 13})
    assert "fused no attention" in note and "same graph as the default variant" in note
    assert "fused no attention" not in transformer_fusion_note({"Attention": 6, "LayerNormalization": 13})


def test_channels_last_variant_matches_eager_and_leaves_the_module_alone(fast_profiling):
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(),
                                torch.nn.Conv2d(8, 4, 3, padding=1)).eval()
    backend = TorchInductorJitBackend(TorchInductorJitBackendConfig(freezing=True, memory_format="channels_last"))
    tuned = ait.Module(model, "cl", strategy=ait.OneBackendStrategy(backend, profiling_config=fast_profiling)
                       .enable_performance_validation(False))
    ait.tune(tuned, [torch.randn(2, 3, 16, 16)], ignore_failing_modules=False, ready_batches=True)
    x = torch.randn(2, 3, 16, 16)
    out = tuned(x)
    with torch.no_grad():
        torch.testing.assert_close(out, model(x), atol=1e-4, rtol=1e-3)
    assert out.is_contiguous()  # eager's layout, not the compiled copy's
    assert model[0].weight.is_contiguous()  # the user's module keeps its memory format
    assert tuned.backends["graph0"].bakes_weights


@pytest.mark.parametrize("freezing", [True, False])
def test_freezing_variant_really_folds_the_weights(freezing, fast_profiling):
    """torch.compile(options={"freezing": True}) alone leaves the parameters as graph inputs (Dynamo decides
    that while tracing, from the global Inductor config): NOTE [freezing is decided while Dynamo traces]. A
    frozen build no longer reads the module's weights, so an in-place edit after the build does not reach it;
    an unfrozen build follows the edit."""
    model = _net()
    backend = TorchInductorJitBackend(TorchInductorJitBackendConfig(freezing=freezing))
    tuned = ait.Module(model, f"frozen-{freezing}", strategy=ait.OneBackendStrategy(
        backend, profiling_config=fast_profiling).enable_performance_validation(False))
    x = torch.randn(2, 16)
    ait.tune(tuned, [x], ignore_failing_modules=False, ready_batches=True)
    built = tuned.backends["graph0"]
    before = built.run((x,), {})
    with torch.no_grad():
        model[0].weight.mul_(2.0)
        after = built.run((x,), {})
        edited = model(x)
    if freezing:
        torch.testing.assert_close(after, before)  # folded at build: the edit is not seen
        assert not torch.allclose(after, edited, atol=1e-4)
    else:
        torch.testing.assert_close(after, edited, atol=1e-4, rtol=1e-3)


_FREEZING_SEEN: list = []  # torch._inductor.config.freezing at the start of each compile


def _see_freezing(_args) -> None:
    _FREEZING_SEEN.append(torch._inductor.config.freezing)


@pytest.mark.parametrize("backend_name", ["inductor_jit", "torchao"])
def test_a_freezing_variant_sets_the_global_flag_only_for_compiles_during_its_calls(backend_name, fast_profiling):
    """NOTE [freezing per compile]: Inductor and TorchAO ``freezing`` variants turn ``torch._inductor.config.freezing``
    on for every compile that starts during a call of theirs (a new input shape recompiles) and for no other
    compile; the flag is off between compiles."""
    if backend_name == "torchao":
        from aitune.torch.backend import TorchAOBackend, TorchAOBackendConfig

        if not TorchAOBackend.availability().ok:
            pytest.skip(TorchAOBackend.availability().reason)
        backend = TorchAOBackend(TorchAOBackendConfig(quantization="int8wo", compile=True, freezing=True,
                                                      fullgraph=False))
    else:
        backend = TorchInductorJitBackend(TorchInductorJitBackendConfig(freezing=True, fullgraph=False))
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)).eval()
    tuned = ait.Module(model, f"observed-{backend_name}", strategy=ait.OneBackendStrategy(
        backend, profiling_config=fast_profiling).enable_performance_validation(False),
        guard=ait.GuardConfig(enabled=False))
    x = torch.randn(2, 16)
    assert torch._inductor.config.freezing is False
    with parameter_freezing(True):  # aitune's compile-start callback registered first: this test's runs after it
        pass
    handler = torch._dynamo.callback_handler
    handler.register_start_callback(_see_freezing)
    try:
        _FREEZING_SEEN.clear()
        ait.tune(tuned, [x], ignore_failing_modules=False, ready_batches=True)
        assert _FREEZING_SEEN and all(_FREEZING_SEEN)  # the build's compiles
        assert torch._inductor.config.freezing is False  # tuning gave it back
        _FREEZING_SEEN.clear()
        other = torch.compile(lambda value: value * 2 + 1, backend="eager")
        with torch.no_grad():
            other(x)  # another compile, outside the frozen callable's calls: the flag stays off
        assert _FREEZING_SEEN == [False]
    finally:
        if _see_freezing in handler.start_callbacks:
            handler.remove_start_callback(_see_freezing)
    # torch._dynamo.reset() drops the compiled code and the callbacks: the next call compiles again, frozen
    torch._dynamo.reset()
    built = tuned.backends["graph0"]
    with parameter_freezing(True):  # registers aitune's callbacks again, ahead of this test's
        pass
    handler.register_start_callback(_see_freezing)
    _FREEZING_SEEN.clear()
    try:
        with torch.no_grad():
            built.run((x,), {})
    finally:
        handler.remove_start_callback(_see_freezing)
    assert _FREEZING_SEEN and all(_FREEZING_SEEN), _FREEZING_SEEN
    with torch.no_grad():
        before = built.run((x,), {})
        torch.testing.assert_close(before, model(x), atol=1e-2, rtol=0.05)  # (int8 weights for TorchAO)
        model[0].weight.add_(1.0)  # folded into the recompiled graph: the artifact does not see the edit
        try:
            after, edited = built.run((x,), {}), model(x)
        finally:
            model[0].weight.sub_(1.0)
    torch.testing.assert_close(after, before)
    assert not torch.allclose(after, edited, atol=1e-3)
    assert torch._inductor.config.freezing is False


def test_the_freezing_flag_never_outlives_a_frozen_call_when_another_thread_ends_the_compiles():
    """NOTE [freezing per compile]: Dynamo runs the start and end callbacks when its count of compiles in progress
    (CUDA-graph recordings included) leaves and returns to zero, which can happen in two threads: a frozen call
    recording a CUDA graph in thread A while thread B compiles. The flag A's call may hold is given back when the
    call ends, and a recording alone never sets it; a later compile in A is not frozen."""
    import threading

    from torch._dynamo.callback import CallbackTrigger

    frozen = parameter_freezing(True)
    handler = torch._dynamo.callback_handler
    recording, compiling, finished = threading.Event(), threading.Event(), threading.Event()
    seen = {}

    def slow_backend(gm, _inputs):
        compiling.set()
        finished.wait(10)
        return gm.forward

    def thread_a():
        with frozen:
            with handler.install_callbacks(CallbackTrigger.CUDAGRAPH_RECORDING, "recording"):
                recording.set()
                compiling.wait(10)
                seen["during the recording"] = torch._inductor.config.freezing
        finished.set()
        seen["after the call"] = torch._inductor.config.freezing
        flags = []
        later = torch.compile(lambda value: value - 1, backend=lambda gm, _: flags.append(
            torch._inductor.config.freezing) or gm.forward)
        with torch.no_grad():
            later(torch.randn(3))
        seen["a later compile"] = flags

    def thread_b():
        recording.wait(10)
        with torch.no_grad():
            torch.compile(lambda value: value * 2 + 1, backend=slow_backend)(torch.randn(3))

    threads = [threading.Thread(target=thread_a), threading.Thread(target=thread_b)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert seen == {"during the recording": False, "after the call": False, "a later compile": [False]}


def test_a_flag_set_by_a_compile_whose_end_callback_runs_elsewhere_is_given_back_when_the_call_ends():
    """NOTE [freezing per compile]: thread A's frozen call compiles (its start callback sets the flag); thread B
    starts a CUDA-graph recording before that compile ends, so Dynamo's end callbacks run in B, later. The flag stays
    on in A for the rest of A's call and A's call gives it back when it ends."""
    import threading

    from torch._dynamo.callback import CallbackTrigger

    frozen = parameter_freezing(True)
    handler = torch._dynamo.callback_handler
    compiling, recording, call_ended = threading.Event(), threading.Event(), threading.Event()
    seen = {}

    def waiting_backend(gm, _inputs):
        seen["in the compile"] = torch._inductor.config.freezing
        compiling.set()
        recording.wait(10)
        return gm.forward

    def thread_a():
        with frozen:
            with torch.no_grad():
                torch.compile(lambda value: value * 3 - 1, backend=waiting_backend)(torch.randn(3))
            seen["after the compile, in the call"] = torch._inductor.config.freezing
        seen["after the call"] = torch._inductor.config.freezing
        call_ended.set()

    def thread_b():
        compiling.wait(10)
        with handler.install_callbacks(CallbackTrigger.CUDAGRAPH_RECORDING, "recording"):
            recording.set()
            call_ended.wait(10)

    threads = [threading.Thread(target=thread_a), threading.Thread(target=thread_b)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert seen == {"in the compile": True, "after the compile, in the call": True, "after the call": False}


def test_a_frozen_variant_retuned_after_new_weights_uses_them(fast_profiling):
    """NOTE [a frozen compile per build]: after load_state_dict (same parameter objects, new values) a re-tune
    must fold the new weights in, not reuse Dynamo's entry with the old ones."""
    model = _net()
    backend = TorchInductorJitBackend(TorchInductorJitBackendConfig(freezing=True))
    tuned = ait.Module(model, "refrozen", strategy=ait.OneBackendStrategy(
        backend, profiling_config=fast_profiling).enable_performance_validation(False))
    data = [torch.randn(2, 16), torch.randn(4, 16)]
    ait.tune(tuned, data, ignore_failing_modules=False, ready_batches=True)
    torch.manual_seed(1)
    model.load_state_dict({k: torch.randn_like(v) for k, v in model.state_dict().items()})
    assert tuned.needs_retune
    tuned.enable_recording(force=True)
    report = ait.tune(tuned, data, ignore_failing_modules=False, ready_batches=True)
    row = next(r for r in report.rows if r.backend == "inductor_jit")
    assert row.status == "selected", row.reason
    x = torch.randn(4, 16)
    with torch.no_grad():
        torch.testing.assert_close(tuned.backends["graph0"].run((x,), {}), model(x), atol=1e-4, rtol=1e-3)
    assert not tuned.needs_retune


def test_expensive_candidates_need_a_budget_and_a_spent_budget_skips(fast_profiling, fake_clock):
    expensive = TorchInductorJitBackend(TorchInductorJitBackendConfig(mode="max-autotune-no-cudagraphs"))
    assert expensive.expensive
    strategy = ait.MaxThroughputStrategy([expensive, delayed(0.0)], profiling_config=fast_profiling)
    report = ait.tune(ait.Module(_net(), "budget", strategy=strategy), [torch.randn(2, 16)], ready_batches=True)
    row = next(r for r in report.rows if r.backend == "inductor_jit")
    assert row.status == "skipped" and "no time budget was given" in row.reason
    strategy = ait.MaxThroughputStrategy([delayed(0.0), delayed(0.001)], profiling_config=fast_profiling)
    report = ait.tune(ait.Module(_net(), "spent", strategy=strategy), [torch.randn(2, 16)], time_budget_s=1e-6, ready_batches=True)
    assert [r.status for r in report.rows if r.backend == "test_delayed"] == ["skipped", "skipped"]
    assert "time budget spent" in report.rows[0].reason
    assert report.graphs[0].selected.startswith("TorchEagerBackend")


def segfault_step() -> dict:
    ctypes.string_at(0)  # reads address 0: SIGSEGV
    return {}


class CrashingAotBuild(TorchEagerBackend):
    """Its (child-process) build step segfaults, as AOTInductor's package load does with some torch builds."""

    name = "test_crashing_child"
    passthrough = False
    runs = 0

    def _build(self, module, graph, device, workdir):
        CrashingAotBuild.runs += 1
        run_isolated(f"{__name__}:segfault_step", {}, timeout_s=120, log_path=workdir / "child.log")


def test_a_candidate_that_crashed_is_remembered_and_skipped(fast_profiling, tmp_path):
    from aitune.torch.search.crashes import CrashRegistry

    CrashingAotBuild.runs = 0
    for attempt in range(2):
        strategy = ait.MaxThroughputStrategy([CrashingAotBuild()], profiling_config=fast_profiling)
        report = ait.tune(ait.Module(_net(), f"crash{attempt}", strategy=strategy), [torch.randn(2, 16)],
                          cache_dir_path=tmp_path, ready_batches=True)
        row = report.rows[0]
        if attempt == 0:
            assert row.status == "failed" and "SIGSEGV" in row.reason
        else:
            assert row.status == "skipped" and "crashed this environment before (SIGSEGV" in row.reason
            assert "child.log" in row.reason or "build.log" in row.reason
    assert CrashingAotBuild.runs == 1  # the second tune never started the build
    registry = CrashRegistry(tmp_path / "crashes.json")
    assert [entry["backend"] for entry in registry.entries()] == ["test_crashing_child"]
    assert registry.clear() == 1 and registry.entries() == []


def test_aitune_env_lists_and_clears_recorded_crashes(tmp_path, monkeypatch, capsys):
    from aitune.cli import main
    from aitune.torch.search.crashes import CrashRegistry

    monkeypatch.setenv("AITUNE_CACHE_DIR", str(tmp_path))
    CrashRegistry(tmp_path / "crashes.json").record(CrashingAotBuild(), "cpu", "SIGSEGV", "killed by signal SIGSEGV",
                                                    str(tmp_path / "child.log"))
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert "crashed their build child" in out and "CrashingAotBuild" in out and "SIGSEGV" in out
    assert main(["env", "--clear-crashes"]) == 0
    assert "forgot 1 recorded crash" in capsys.readouterr().out
    assert CrashRegistry(tmp_path / "crashes.json").entries() == []


class CountedDelayed(Delayed):
    """A Delayed backend that counts its builds and can be made to fail them (``broken``)."""

    name = "test_counted_delayed"
    builds: list = []
    broken: set = set()

    def _build(self, module, graph, device, workdir):
        CountedDelayed.builds.append(self.delay_s)
        if self.delay_s in CountedDelayed.broken:
            raise RuntimeError("this build is broken today")
        super()._build(module, graph, device, workdir)


def counted(seconds):
    backend = CountedDelayed()
    backend.delay_s = seconds
    return backend


def _ranked_tune(net, batches, fast_profiling, name, **tune_kwargs):
    strategy = ait.MaxThroughputStrategy([counted(0.004), counted(0.0), counted(0.002)], profiling_config=fast_profiling)
    strategy.enable_performance_validation(False)  # the ranking among the candidates is what is tested
    for key, value in tune_kwargs.pop("strategy_calls", {}).items():
        getattr(strategy, key)(value)
    CountedDelayed.builds = []
    tuned = ait.Module(net, name, strategy=strategy)
    report = ait.tune(tuned, batches, ready_batches=True, **tune_kwargs)
    return tuned, report, sorted(CountedDelayed.builds)


def test_a_retune_in_the_same_environment_rebuilds_only_the_earlier_winner(fast_profiling, fake_clock):
    net = _net()
    batches = [torch.randn(2, 16), torch.randn(4, 16)]
    _, first, builds = _ranked_tune(net, batches, fast_profiling, "first")
    assert builds == [0.0, 0.002, 0.004]
    assert first.graphs[0].selected == "Delayed(0.0)"

    tuned, second, builds = _ranked_tune(net, batches, fast_profiling, "second")
    assert builds == [0.0]  # the two slower candidates were not rebuilt
    rows = {r.description: r for r in second.rows}
    assert rows["Delayed(0.0)"].status == "selected" and "rebuilt: among the winners" in rows["Delayed(0.0)"].reason
    for slower in ("Delayed(0.004)", "Delayed(0.002)"):
        assert rows[slower].status == "skipped"
        assert "not rebuilt: Delayed(0.0) ranked first" in rows[slower].reason
        assert "enable_ranking_reuse(False)" in rows[slower].reason
    reason = second.graphs[0].selection_reason
    assert "highest throughput (paired speed-up over eager) among 1 correct candidate" in reason and "no candidate passed" not in reason
    probe = torch.randn(3, 16)
    with torch.no_grad():
        torch.testing.assert_close(tuned(probe), net(probe))


class NeedsTwoInputs(Delayed):
    """Unsupported for a one-input graph (a real supports() answer, found without building)."""

    name = "test_needs_two_inputs"

    def _supports(self, module, graph, device):
        from aitune.torch.backend.base import Check

        return Check(len(graph.tensor_specs) >= 2, "needs two tensor inputs")


def test_a_retune_keeps_unsupported_rows_as_they_are(fast_profiling, fake_clock):
    net, batches = _net(), [torch.randn(2, 16)]
    for name in ("first", "second"):
        strategy = ait.MaxThroughputStrategy([counted(0.0), NeedsTwoInputs()], profiling_config=fast_profiling)
        report = ait.tune(ait.Module(net, name, strategy=strategy), batches, ready_batches=True)
        row = next(r for r in report.rows if r.backend == "test_needs_two_inputs")
        assert row.status == "unsupported" and "needs two tensor inputs" in row.reason
    assert "rebuilt: among the winners" in next(r for r in report.rows if r.backend == "test_counted_delayed").reason


def test_a_ranking_is_not_reused_for_new_weights_a_budget_an_opt_out_or_a_failing_winner(fast_profiling, fake_clock):
    net = _net()
    batches = [torch.randn(2, 16)]
    _ranked_tune(net, batches, fast_profiling, "first")
    assert _ranked_tune(net, batches, fast_profiling, "again")[2] == [0.0]
    # every case below searches all three candidates again
    assert _ranked_tune(net, batches, fast_profiling, "opt-out",
                        strategy_calls={"enable_ranking_reuse": False})[2] == [0.0, 0.002, 0.004]
    assert _ranked_tune(net, batches, fast_profiling, "budget", time_budget_s=600)[2] == [0.0, 0.002, 0.004]
    CountedDelayed.broken = {0.0}
    try:
        _, report, builds = _ranked_tune(net, batches, fast_profiling, "broken")
    finally:
        CountedDelayed.broken = set()
    assert builds == [0.0, 0.002, 0.004]  # the winner failed (built once), then the full search built the others
    assert report.graphs[0].selected == "Delayed(0.002)"
    assert {r.description: r.status for r in report.rows}["Delayed(0.0)"] == "failed"
    # the full search after the failure recorded a new ranking: Delayed(0.002) first
    assert _ranked_tune(net, batches, fast_profiling, "after")[2] == [0.002]
    with torch.no_grad():
        net[0].weight.add_(0.5)  # new weights: a new module fingerprint
    assert _ranked_tune(net, batches, fast_profiling, "new-weights")[2] == [0.0, 0.002, 0.004]


def test_aitune_env_lists_and_clears_rankings(fast_profiling, fake_clock, tmp_path, monkeypatch, capsys):
    from aitune.cli import main

    monkeypatch.setenv("AITUNE_CACHE_DIR", str(tmp_path))
    net, batches = _net(), [torch.randn(2, 16)]
    _ranked_tune(net, batches, fast_profiling, "listed")
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert "1 ranking(s) of earlier searches" in out and "listed" in out and "Delayed(0.0)" in out
    assert "MaxThroughputStrategy(Delayed(0.004), Delayed(0.0)" in out  # the strategy the ranking belongs to
    assert main(["env", "--clear-rankings"]) == 0
    assert "forgot 1 ranking(s)" in capsys.readouterr().out
    assert _ranked_tune(net, batches, fast_profiling, "relisted")[2] == [0.0, 0.002, 0.004]  # a full search again


class _Scaled(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.eps = 1e-6  # a float attribute, as an RMSNorm's variance_epsilon

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


def test_a_build_traces_float_attributes_as_torch_does_so_a_changing_one_compiles_nothing(fast_profiling):
    """NOTE [floats as torch traces them] in aitune/torch/backend/compile_settings.py: the build compiles with torch's
    ``specialize_float`` (off), so ``eps`` is a graph input from the first compile: every value gives eager's result
    and none compiles again (a build that specialised floats left later recompiles in another setting, which
    crashed on CUDA)."""
    from torch._dynamo.utils import counters

    model = _Scaled().eval()
    tuned = ait.Module(model, "scaled", strategy=ait.OneBackendStrategy(
        TorchInductorJitBackend(), profiling_config=fast_profiling).enable_performance_validation(False),
        guard=ait.GuardConfig(enabled=False))
    specialised = []
    real_compile = torch._dynamo.eval_frame.OptimizedModule.__call__

    def spy(self, *args, **kwargs):
        specialised.append(torch._dynamo.config.specialize_float)
        return real_compile(self, *args, **kwargs)

    torch._dynamo.eval_frame.OptimizedModule.__call__ = spy
    try:
        ait.tune(tuned, [torch.randn(2, 8), torch.randn(3, 8)], ignore_failing_modules=False, ready_batches=True)
    finally:
        torch._dynamo.eval_frame.OptimizedModule.__call__ = real_compile
    assert specialised and not any(specialised)  # every build call ran under torch's setting
    built = tuned.backends["graph0"]
    assert built.build_info["dynamic"] is True  # two batch sizes: one dynamic-shape graph
    x = torch.randn(5, 8)

    def compiles_for(eps: float) -> int:
        model.eps = eps
        before = counters["stats"]["unique_graphs"]
        with torch.no_grad():
            torch.testing.assert_close(built.run((x,), {}), model(x))
        return counters["stats"]["unique_graphs"] - before

    try:
        assert [compiles_for(eps) for eps in (1e-6, 1e-3, 1e-2, 0.5, 2.0)] == [0, 0, 0, 0, 0]
    finally:
        model.eps = 1e-6


def test_a_ranking_is_not_reused_once_a_candidates_package_changed(fast_profiling, fake_clock, monkeypatch):
    """Another build or version of a backend's package (onnxruntime-gpu brought beside onnxruntime) makes a re-tune
    search every candidate again: the packages' versions are part of the ranking's key. Before, on the GPU
    machine, a re-tune after onnxruntime-gpu was installed skipped every ONNX Runtime variant on the strength of a
    ranking made while their builds could not reach the CUDA EP."""
    from aitune.torch.common.requirements import Check

    def packages(label):
        available = Check(True, "", {"fakeort": label})
        monkeypatch.setattr(CountedDelayed, "availability", classmethod(lambda cls: available))

    net, batches = _net(), [torch.randn(2, 16)]
    packages("1.30.0")
    assert _ranked_tune(net, batches, fast_profiling, "first")[2] == [0.0, 0.002, 0.004]
    assert _ranked_tune(net, batches, fast_profiling, "same packages")[2] == [0.0]
    packages("1.30.0 (fakeort-gpu)")
    assert _ranked_tune(net, batches, fast_profiling, "another build")[2] == [0.0, 0.002, 0.004]
    assert _ranked_tune(net, batches, fast_profiling, "again")[2] == [0.0]
