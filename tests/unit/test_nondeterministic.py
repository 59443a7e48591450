"""A ``forward`` that draws random numbers (NOTE [nondeterministic forward] in aitune/torch/check/context.py):
two eager runs on one input differ, so candidates are checked under one seed, without the fp32-parity rule
(eager's own distance from an fp32 run is then the spread of its draws), and eager is kept where no seed makes
eager repeat itself. A deterministic module is judged as before, and so is one whose two eager runs differ by
rounding only (NOTE [eager that repeats itself up to rounding])."""

import itertools

import pytest
import torch

import aitune.torch as ait
from aitune.torch.backend import (ONNXRuntimeBackend, TorchAOBackend, TorchEagerBackend, TorchEagerBackendConfig,
                                  TorchInductorAotBackend, TorchInductorJitBackend)
from aitune.torch.check.context import ROUNDING_SPREAD_MIN_SQNR_DB, GraphContext, rounding_spread
from aitune.torch.check.correctness import Tolerance
from aitune.torch.check.guard import GuardConfig, guard_for

NONDETERMINISTIC = "ToleranceExceededError: forward is nondeterministic"
BF16_AUTOCAST = TorchEagerBackendConfig(autocast_enabled=True, autocast_dtype=torch.bfloat16)


class Noisy(torch.nn.Module):
    """A linear layer plus standard normal noise drawn in ``forward``."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(32, 32)

    def forward(self, x):
        y = self.fc(x)
        return y + torch.randn_like(y)


class OwnGenerator(torch.nn.Module):
    """Noise from the module's own generator: no global seed makes two calls alike."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(32, 32)
        self.generator = torch.Generator().manual_seed(1)

    def forward(self, x):
        y = self.fc(x)
        return y + torch.randn(y.shape, generator=self.generator, dtype=y.dtype)


class Plain(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(32, 32)

    def forward(self, x):
        return torch.nn.functional.gelu(self.fc(x))


def _tune(model, backends, dtype, fast_profiling, tmp_path, features=32, scale=1.0, extras=True):
    """Tune ``model`` on two batches (4 and 8 rows of ``features`` standard normals times ``scale``); ``extras``:
    quantized and reduced-precision variants allowed."""
    strategy = ait.FirstWinsStrategy(backends, profiling_config=fast_profiling, allow_quantization=extras,
                                     allow_reduced_precision=extras,
                                     probe_config=ait.ProbeConfig(max_probes=2)).enable_performance_validation(False)
    tuned = ait.Module(model, "m", strategy=strategy)
    report = ait.tune(tuned, [scale * torch.randn(b, features, dtype=dtype) for b in (4, 8)], ready_batches=True,
                      cache_dir_path=tmp_path / "cache")
    return tuned, report


def _accepted(report):
    return [row for row in report.rows if row.status in ("passed", "selected")]


def _noise_statistics(tuned, model, dtype):
    """Mean and standard deviation of ``tuned(x) - fc(x)`` over many calls (eager: 0 and 1)."""
    x = torch.randn(8, 32, dtype=dtype)
    with torch.no_grad():
        clean = model.fc(x).float()
        residuals = torch.stack([tuned(x).float() - clean for _ in range(100)])
    return float(residuals.mean()), float(residuals.std()), residuals


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16_model", "fp32_model"])
def test_no_candidate_of_a_random_forward_passes_on_a_rule_eager_itself_fails(dtype, fast_profiling, tmp_path):
    model = Noisy().eval().to(dtype)
    backends = [TorchInductorJitBackend(), TorchInductorAotBackend(), TorchAOBackend(),
                TorchEagerBackend(BF16_AUTOCAST)]
    if dtype == torch.float32:
        backends.insert(2, ONNXRuntimeBackend())  # ONNX Runtime binds no bf16 inputs
    tuned, report = _tune(model, backends, dtype, fast_profiling, tmp_path)
    graph = tuned.graphs[0]
    assert graph.nondeterministic.startswith("two eager runs on one input differ")
    assert "candidates are checked under that seed" in graph.nondeterministic
    assert report.graphs[0].spec["nondeterministic"] == graph.nondeterministic
    assert "forward is nondeterministic: two eager runs" in report.describe()
    rows = {row.backend: row for row in report.rows if row.description != "TorchEagerBackend()"}
    # The fp32-parity rule accepted the bf16 ones at SQNR -3 dB (eager's own distance from an fp32 run is its
    # noise): it is off here, and no accepted row passed by it.
    for row in _accepted(report):
        assert "fp32-parity" not in str((row.comparison or {}).get("metric"))
        assert (row.comparison or {}).get("max_abs_error", 0.0) < 0.1  # the same draws as eager, rounding only
    # Inductor (its own random generator) and ONNX Runtime (its own RandomNormalLike) draw other numbers than
    # eager: rejected, and the reason says why.
    for name in ("inductor_jit", "inductor_aot") + (("onnxruntime",) if dtype == torch.float32 else ()):
        assert rows[name].status == "rejected (correctness)", rows[name]
        assert rows[name].reason.startswith(NONDETERMINISTIC), rows[name].reason
    if rows["torchao"].status != "passed":
        assert rows["torchao"].reason.startswith(NONDETERMINISTIC)
    # The tuned module's noise is eager's: mean 0, standard deviation 1, and a fresh draw on every call.
    mean, std, residuals = _noise_statistics(tuned, model, dtype)
    assert abs(mean) < 0.05 and 0.9 < std < 1.1
    assert not torch.equal(residuals[0], residuals[1])


def test_a_forward_no_seed_controls_keeps_eager_with_the_reason(fast_profiling, tmp_path):
    model = OwnGenerator().eval()
    tuned, report = _tune(model, [TorchEagerBackend(BF16_AUTOCAST), TorchInductorJitBackend()], torch.float32,
                          fast_profiling, tmp_path)
    assert "even under a fixed seed: eager is kept" in tuned.graphs[0].nondeterministic
    candidates = [row for row in report.rows if row.description != "TorchEagerBackend()"]
    assert {row.status for row in candidates} == {"rejected (correctness)"}
    for row in candidates:
        assert row.reason.startswith("CorrectnessError: forward is nondeterministic: two eager runs"), row.reason
        assert "eager is kept" in row.reason
    assert report.graphs[0].selected == "TorchEagerBackend()"


def test_references_of_a_random_forward_are_seeded_and_leave_the_callers_generator_alone(tmp_path):
    model = Noisy().eval()
    tuned = ait.Module(model, "m")
    tuned(torch.randn(4, 32))
    graph = tuned.graphs[0]
    state = torch.get_rng_state()
    context = GraphContext.from_eager(model, "m", graph, torch.device("cpu"), tmp_path)
    assert torch.equal(torch.get_rng_state(), state)  # detection and seeded references draw on a forked stream
    assert context.seeded and graph.nondeterministic is not None
    assert context.fp32_reference(0) is None  # rule 5 is off for such a graph
    # a probe's reference and the samples' are made under the same seed as a candidate's checked call
    sample = graph.samples[0].clone()
    with torch.no_grad(), context.rng():
        again = model(*sample.args, **sample.kwargs)
    assert torch.equal(again, context.reference_outputs[0].leaves[0].tensor())
    assert torch.equal(context.run_eager(graph.samples[0]), again)
    # no run-time guard: two runs of the graph cannot be compared
    assert guard_for(GuardConfig(), graph, TorchEagerBackend(BF16_AUTOCAST), Tolerance(), None, set()) is None


def test_a_deterministic_module_is_judged_as_before(fast_profiling, tmp_path):
    model = Plain().eval().to(torch.bfloat16)
    tuned, report = _tune(model, [TorchInductorJitBackend(), TorchEagerBackend(BF16_AUTOCAST)], torch.bfloat16,
                          fast_profiling, tmp_path)
    graph = tuned.graphs[0]
    assert graph.nondeterministic is None and report.graphs[0].spec["nondeterministic"] is None
    assert "nondeterministic" not in report.describe()
    assert report.graphs[0].selected == "TorchInductorJitBackend()"  # first passing candidate, as before
    x = torch.randn(8, 32, dtype=torch.bfloat16)
    with torch.no_grad():
        torch.testing.assert_close(tuned(x), model(x), atol=1e-2, rtol=1e-2)
    state = torch.get_rng_state()
    context = GraphContext.from_eager(model, "m", graph, torch.device("cpu"), tmp_path)
    assert not context.seeded and torch.equal(torch.get_rng_state(), state)
    assert guard_for(GuardConfig(), graph, TorchEagerBackend(BF16_AUTOCAST), Tolerance(), None, set()) is not None


_CALLS = itertools.count()


class ReorderedSums(torch.nn.Module):
    """A bf16 linear layer whose sum over the input features runs in one of two orders (as a split-K matmul or an
    atomic reduction may): two calls on one input in different orders differ by rounding only, up to ~0.09 here,
    more than the default tolerance. No random number is drawn: a module-level counter picks the order, chunked at
    the calls in ``chunked``. After ``ait.tune``'s recording (calls 0, 1: one per dataset item), tuning's unseeded
    pair is calls 2, 3, its references calls 4, 5 and its seeded repeat call 6; every later call (the candidate's)
    takes the plain order, as accurate as eager's best run. The default: the unseeded pair differs, the
    references sum in chunks, and so does the seeded repeat when 6 is in ``chunked`` (the pair agrees), else not."""

    def __init__(self, chunked=(2, 4, 5)):
        super().__init__()
        self.fc = torch.nn.Linear(256, 64)
        self.chunked = tuple(chunked)

    def forward(self, x):
        return self.compute(x, next(_CALLS) in self.chunked)

    def compute(self, x, chunked: bool):
        if not chunked:
            return self.fc(x)
        weight = self.fc.weight
        return sum(x[:, i:i + 8] @ weight[:, i:i + 8].T for i in range(0, 256, 8)) + self.fc.bias


class SameModule(TorchEagerBackend):
    """The module itself, as a non-eager candidate: it computes what eager computes, in either order."""

    name = "test_same_module"
    passthrough = False


class SmallNoise(torch.nn.Module):
    """A bf16 linear layer plus noise 50x below its outputs: a random draw small enough to look like rounding."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(256, 64)

    def forward(self, x):
        y = self.fc(x)
        return y + 0.02 * torch.randn_like(y)


def _tune_one(model, fast_profiling, tmp_path):
    return _tune(model, [SameModule()], torch.bfloat16, fast_profiling, tmp_path, features=256, scale=4.0,
                 extras=False)


@pytest.mark.parametrize("chunked, spill", [((2, 4, 5), None), ((2, 4, 5, 6), None), ((2, 4, 5), "0")],
                         ids=["seeded-pair-differs", "seeded-pair-agrees", "spilled-references"])
def test_eager_that_differs_by_rounding_only_is_judged_as_deterministic(chunked, spill, fast_profiling, tmp_path,
                                                                        monkeypatch):
    global _CALLS
    _CALLS = itertools.count()  # the order of calls the class docstring describes
    if spill is not None:  # references kept in files: rounding_spread reads them a chunk at a time
        monkeypatch.setenv("AITUNE_REFERENCE_SPILL_BYTES", spill)
    torch.manual_seed(0)
    model = ReorderedSums(chunked).eval().to(torch.bfloat16)
    tuned, report = _tune_one(model, fast_profiling, tmp_path)
    graph = tuned.graphs[0]
    assert graph.nondeterministic is None  # not "eager is kept": the candidate was compared with eager
    assert graph.rounding_spread.startswith("max abs ") and "SQNR >= " in graph.rounding_spread
    sqnr = float(graph.rounding_spread.split("SQNR >= ")[1].split(" dB")[0])
    assert ROUNDING_SPREAD_MIN_SQNR_DB <= sqnr < 60
    assert report.graphs[0].selected == "SameModule()"
    assert "two eager runs differ by rounding only (max abs" in report.describe()
    # eager's own runs disagree: no run-time guard, which could retire a correct backend on eager's spread
    assert guard_for(GuardConfig(), graph, SameModule(), Tolerance(), None, set()) is None


def test_a_small_random_draw_is_not_taken_for_rounding(fast_profiling, tmp_path):
    """Noise from torch's generator, small enough to pass the rounding floors between two unseeded runs, moves the
    generator's state: the graph takes the seeded path (rule 5 off), not the rounding one."""
    torch.manual_seed(0)
    model = SmallNoise().eval().to(torch.bfloat16)
    x = 4 * torch.randn(8, 256, dtype=torch.bfloat16)
    with torch.no_grad():
        assert rounding_spread(model(x), model(x)) is not None  # between unseeded runs it looks like rounding
    tuned, report = _tune_one(model, fast_profiling, tmp_path)
    graph = tuned.graphs[0]
    assert graph.rounding_spread is None
    assert "under a fixed seed eager repeats itself" in graph.nondeterministic


def test_rounding_spread_tells_rounding_from_random_draws():
    torch.manual_seed(0)
    model = ReorderedSums().eval().to(torch.bfloat16)
    x = 4 * torch.randn(8, 256, dtype=torch.bfloat16)
    with torch.no_grad():
        first, second = model.compute(x, False), model.compute(x, True)
    assert not torch.equal(first, second)
    assert rounding_spread({"y": first, "n": 3}, {"y": second, "n": 3}).startswith("max abs ")
    assert rounding_spread({"y": first, "n": 3}, {"y": second, "n": 4}) is None  # another constant
    dropped = torch.nn.functional.dropout(first.float(), 0.1).to(torch.bfloat16)
    assert rounding_spread(first, dropped) is None  # a draw of the output's own scale
    redrawn = first.clone()
    redrawn[3] = torch.randn(64, dtype=torch.bfloat16) * first.abs().max()
    assert rounding_spread(first, redrawn) is None  # one row redrawn: the element bound fails whatever the SQNR
    assert rounding_spread(first, first.clone()) == "runs identical"
    inf = first.clone()
    inf[0, 0] = float("inf")
    assert rounding_spread(first, inf) is None  # non-finite where the other is finite
    numpy = pytest.importorskip("numpy")
    assert rounding_spread([first, numpy.ones(3)], [first, numpy.ones(3)]) is None  # not judged equal, no error


class ErraticRepeat(ReorderedSums):
    """As :class:`ReorderedSums`, but the seeded repeat (call 6) is far off: not rounding, whatever the first pair."""

    def forward(self, x):
        count = next(_CALLS)
        return self.compute(x, count in (2, 4, 5)) * (3.0 if count == 6 else 1.0)


def test_rounding_needs_the_seeded_pair_to_differ_by_rounding_too(fast_profiling, tmp_path):
    global _CALLS
    _CALLS = itertools.count()
    torch.manual_seed(0)
    tuned, report = _tune_one(ErraticRepeat().eval().to(torch.bfloat16), fast_profiling, tmp_path)
    graph = tuned.graphs[0]
    assert graph.rounding_spread is None
    assert "eager differs between runs even under a fixed seed: eager is kept" in graph.nondeterministic
    assert report.graphs[0].selected == "TorchEagerBackend()"
