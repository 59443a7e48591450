"""Faults that only show on inputs tuning never saw (pytorch/pytorch#191499, #183546, #148748,
microsoft/onnxscript#989; test names keep the project's case numbers), and
the kinds behind them caught for other ops: value-range dependence and size dependence.

Each real-backend case forces its backend (OneBackendStrategy, no performance validation): after tuning,
either the backend runs and matches eager on the case's later input, or it was rejected during tuning (no
test asserts that a backend fails). The kind tests use deliberately faulty backends — real code with a
real fault, like tests/unit/test_strategies.py's — to show that the probes catch the fault's kind.
"""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import aitune.torch as ait
from aitune.torch.backend import (TorchEagerBackend, TorchEagerBackendConfig, TorchInductorAotBackend,
                                  TorchInductorJitBackend)
from aitune.torch.record.samples import record_graphs


def forced(backend, profiling):
    return ait.OneBackendStrategy(backend, profiling_config=profiling).enable_performance_validation(False)


def tune_forced(model, name, backend, data, profiling):
    tuned = ait.Module(model, name, strategy=forced(backend, profiling))
    report = ait.tune(tuned, data, ready_batches=True)
    row = report.rows[0]
    if name in report.module_errors:  # rejected or failed during tuning, with a reason; no assertion on which
        assert row.reason and row.status in ("failed", "rejected (correctness)")
        assert tuned.state is ait.ModuleState.PASSTHROUGH
    else:
        assert {b.name for b in tuned.backends.values()} == {backend.name}
        assert row.probes is not None and row.probes["checked"] > 0  # checked beyond the recorded samples
    return tuned, report


# ----------------------------------------------------------- integer image reduction on a narrower range


class Stretch(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, img):
        flat = img.flatten(1)
        lo = flat.amin(1).view(-1, 1, 1, 1).float()
        hi = flat.amax(1).view(-1, 1, 1, 1).float()
        return self.conv((img.float() - lo) / (hi - lo).clamp_min(1))


@pytest.mark.parametrize("backend", [TorchInductorJitBackend(), TorchInductorAotBackend()],
                         ids=["inductor_jit", "inductor_aot"])
def test_c31_integer_image_reduction_on_a_narrower_value_range(backend, fast_profiling):
    model = Stretch().eval()
    tuning = [torch.randint(0, 256, (b, 3, 16, 16), dtype=torch.uint8) for b in (2, 4)]
    tuned, report = tune_forced(model, "stretch", backend, tuning, fast_profiling)
    later = torch.randint(40, 201, (3, 3, 16, 16), dtype=torch.uint8)
    with torch.no_grad():
        torch.testing.assert_close(tuned(later), model(later), atol=1e-4, rtol=1e-3)


# ------------------------------------------------------------------- antialiased resize at unseen sizes


class Stem(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x):
        return self.conv(F.interpolate(x, scale_factor=0.5, mode="bilinear", antialias=True))


def test_c32_antialiased_resize_at_sizes_never_recorded(fast_profiling):
    pytest.importorskip("onnxruntime")
    from aitune.torch.backend import ONNXRuntimeBackend

    model = Stem().eval()
    tuning = [torch.rand(2, 3, 32, 32), torch.rand(4, 3, 64, 48), torch.rand(3, 3, 40, 64)]
    tuned, report = tune_forced(model, "stem", ONNXRuntimeBackend(), tuning, fast_profiling)
    later = torch.rand(2, 3, 33, 47)
    with torch.no_grad():
        torch.testing.assert_close(tuned(later), model(later), atol=1e-4, rtol=1e-3)
    row = report.rows[0]
    if row.status == "rejected (correctness)":
        assert row.reason.startswith("probe size")  # caught by a size probe, and the reason names its shape


# ------------------------------------------------------------------------- outputs holding a KV cache


def test_c34_outputs_holding_a_key_value_cache(fast_profiling):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    lm = transformers.LlamaForCausalLM(cfg).eval()
    tuned = ait.Module(lm, "lm", strategy=forced(TorchInductorJitBackend(), fast_profiling))
    data = [{"input_ids": torch.randint(0, 64, (b, 8))} for b in (2, 4)]
    report = ait.tune(lambda batch: tuned(**batch), data, ready_batches=True)
    row = report.rows[0]
    assert "expected" not in row.reason or "got" not in row.reason  # never "expected X, got X"
    assert row.status == "selected", row.reason
    assert tuned.backends["graph0"].name == "inductor_jit"
    leaves = [leaf["path"] for leaf in row.comparison["leaves"]]
    assert "logits" in leaves and any(path.startswith("cache") for path in leaves), leaves  # opened leaf by leaf
    ids = torch.randint(0, 64, (3, 8))
    with torch.no_grad():
        out, expected = tuned(input_ids=ids), lm(input_ids=ids)
    torch.testing.assert_close(out.logits, expected.logits, atol=1e-4, rtol=1e-3)
    assert type(out.past_key_values) is type(expected.past_key_values)


# --------------------------------------------------------- floor division on grid-aligned values


class Buckets(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.proj = nn.Embedding(200, 16), nn.Linear(16, 8)

    def forward(self, t):
        return self.proj(self.emb(torch.div(t, 0.1, rounding_mode="floor").long().clamp(0, 199)))


def _c35_backends():
    backends = [TorchInductorJitBackend(), TorchInductorAotBackend()]
    try:
        import onnxruntime  # noqa: F401
        from aitune.torch.backend import ONNXRuntimeBackend

        backends.append(ONNXRuntimeBackend())
    except ImportError:
        pass
    return backends


@pytest.mark.parametrize("backend", _c35_backends(), ids=lambda b: b.name)
def test_c35_floor_division_on_grid_aligned_values(backend, fast_profiling):
    model = Buckets().eval()
    tuning = [torch.rand(2, 16) * 19, torch.rand(4, 32) * 19]
    tuned, report = tune_forced(model, "buckets", backend, tuning, fast_profiling)
    later = torch.randint(0, 190, (2, 16)).float() * 0.1
    with torch.no_grad():
        torch.testing.assert_close(tuned(later), model(later))  # caught during tuning, or by the guard


# ------------------------------------------------------------------------------------------ the kinds


class FloorViaDivideBackend(TorchEagerBackend):
    """Computes floor(t / 0.1) as floor(t * 10): what a compiler's strength reduction does. Exact on
    continuous values almost everywhere, wrong on many 0.1-grid values (value-grid dependence)."""

    name = "test_floor_via_multiply"
    passthrough = False

    def _infer(self, args, kwargs):
        module, t = self.module, kwargs["t"]
        return module.proj(module.emb(torch.floor(t * 10.0).long().clamp(0, 199)))


class EvenSizesOnlyPool(TorchEagerBackend):
    """An average pool that assumes even spatial sizes (pairs of pixels reshaped): right at every recorded
    size, wrong at odd sizes inside the range (size dependence, another op than the antialiased resize)."""

    name = "test_even_sizes_pool"
    passthrough = False

    def _infer(self, args, kwargs):
        x = kwargs["x"]
        b, c, h, w = x.shape
        pooled = x[:, :, : h - h % 2, : w - w % 2].reshape(b, c, h // 2, 2, w // 2, 2).mean((3, 5))
        return self.module.head(pooled.mean((2, 3)))


class Pool(nn.Module):
    def __init__(self):
        super().__init__()
        self.head = nn.Linear(3, 5)

    def forward(self, x):
        return self.head(F.avg_pool2d(x, 2, ceil_mode=True).mean((2, 3)))


class SaturatingBackend(TorchEagerBackend):
    """Accumulates the sum of squares in a register that saturates at 2000: right for the recorded values,
    wrong once they are larger (value-range dependence, another op than the image reduction's min/max)."""

    name = "test_saturating"
    passthrough = False

    def _infer(self, args, kwargs):
        x = kwargs["x"]
        energy = (x * x).sum(-1, keepdim=True).clamp(max=2000.0)
        return self.module.proj(x / energy.sqrt().clamp_min(1e-6))


class Normalize(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 4)

    def forward(self, x):
        energy = (x * x).sum(-1, keepdim=True)
        return self.proj(x / energy.sqrt().clamp_min(1e-6))


@pytest.mark.parametrize("make_case", ["grid", "size", "range"])
def test_probes_catch_the_kind_behind_each_case_for_other_ops(make_case, fast_profiling, tmp_path):
    if make_case == "grid":
        model, backend = Buckets().eval(), FloorViaDivideBackend()
        data = [torch.rand(2, 16) * 19, torch.rand(4, 32) * 19]
        expected_kind = "float-grid"
    elif make_case == "size":
        model, backend = Pool().eval(), EvenSizesOnlyPool()
        data = [torch.rand(2, 3, 32, 32), torch.rand(4, 3, 64, 48)]
        expected_kind = "size"
    else:
        model, backend = Normalize().eval(), SaturatingBackend()
        data = [torch.randn(2, 8) * 3, torch.randn(4, 8) * 3]
        expected_kind = "float-scale-up"
    # The fault is invisible on the recorded samples: checking them alone would let it through.
    graph = record_graphs(model, [((x,), {}) for x in data])[0]
    built = backend.copy().build(model, graph, "cpu", tmp_path)
    with torch.no_grad():
        for x in data:
            torch.testing.assert_close(built(x), model(x), atol=1e-4, rtol=1e-3)
    tuned = ait.Module(model, "kind", strategy=ait.MaxThroughputStrategy([backend], profiling_config=fast_profiling))
    report = ait.tune(tuned, data, ready_batches=True)
    row = next(r for r in report.rows if r.backend == backend.name)
    assert row.status == "rejected (correctness)"
    assert row.reason.startswith(f"probe {expected_kind} ("), row.reason
    assert tuned.backends["graph0"].name == "eager"


class Picky(nn.Module):
    """Eager itself raises on lengths that are not multiples of 4: probes of such sizes say nothing."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        if x.shape[1] % 4:
            raise ValueError("length must be a multiple of 4")
        return self.fc(x.view(x.shape[0], -1, 4)).flatten(1)


def test_a_probe_eager_cannot_run_is_dropped(fast_profiling):
    model = Picky().eval()
    tuned = ait.Module(model, "picky", strategy=forced(TorchInductorJitBackend(), fast_profiling))
    report = ait.tune(tuned, [torch.randn(2, 8), torch.randn(2, 16)], ready_batches=True)
    row = report.rows[0]
    assert row.status == "selected", row.reason  # the odd-length probes were dropped, not held against it
    assert row.probes["checked"] >= 1
    x = torch.randn(2, 12)
    with torch.no_grad():
        torch.testing.assert_close(tuned(x), model(x))


# ------------------------------------------------------------------------------------------ rule 6


class LessAccurateBackend(TorchEagerBackend):
    """No structural fault, only rounding: the exact fp32 result plus 3.5x eager's own rounding error, as a
    transformation that reorders floating-point work can be (BatchNorm folded into a convolution). At the
    recorded magnitudes that is inside the bf16 tolerance; at 10x them it misses atol/rtol and rule 5's 2x."""

    name = "test_less_accurate"
    passthrough = False

    def _infer(self, args, kwargs):
        x = (list(args) + list(kwargs.values()))[0]
        exact = copy.deepcopy(self.module).float()(x.float())
        return (exact + 3.5 * (self.module(x).float() - exact)).to(x.dtype)


class FaultAtLargeValues(TorchEagerBackend):
    """Exact, except that once its inputs pass a magnitude only the x10 probe reaches, a few output elements come
    from a wrong branch (a baked-in clamp, a saturating kernel): 4 of 64 elements off by ~10 % of the scale."""

    name = "test_fault_at_large_values"
    passthrough = False

    def _infer(self, args, kwargs):
        x = (list(args) + list(kwargs.values()))[0]
        out = self.module(x)
        if x.abs().amax() > 8:
            out = out.clone()
            out.view(-1)[:4] += 0.1 * out.abs().amax()
        return out


def _bf16_mlp():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8)).eval().to(torch.bfloat16)
    data = [torch.randn(2, 8).clamp(-3, 3).to(torch.bfloat16), torch.randn(4, 8).clamp(-3, 3).to(torch.bfloat16)]
    return model, data


def test_scaled_probes_allow_rounding_grown_at_magnitudes_never_sent(fast_profiling):
    model, data = _bf16_mlp()
    tuned = ait.Module(model, "rounding", strategy=forced(LessAccurateBackend(), fast_profiling))
    report = ait.tune(tuned, data, ready_batches=True)
    row = report.rows[0]
    assert row.status == "selected", row.reason
    assert row.probes["judged_at_scale"] >= 1 and row.probes["passed"] == row.probes["checked"]
    assert "judged at the probe's scale" in report.describe()
    # the row's errors are those of rules 3 and 5 (samples and probes at the user's magnitudes)
    assert row.comparison["max_rel_error"] < 0.02


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scaled_probes_still_catch_a_fault_in_a_few_elements(dtype, fast_profiling):
    model, data = _bf16_mlp()
    model, data = model.to(dtype), [x.to(dtype) for x in data]
    tuned = ait.Module(model, "fault", strategy=forced(FaultAtLargeValues(), fast_profiling))
    report = ait.tune(tuned, data, ready_batches=True)
    row = report.rows[0]
    assert row.status == "rejected (correctness)" and row.reason.startswith("probe float-scale-up"), row.reason
    if dtype == torch.bfloat16:  # rule 6 was tried (an fp32 leaf of an exact eager gets no third chance)
        assert "at the probe's scale (rule 6)" in row.reason
    assert tuned.state is ait.ModuleState.PASSTHROUGH


def test_scaled_probes_still_catch_a_value_dependent_fault(fast_profiling):
    """SaturatingBackend (above), in bf16 so that rule 6 is tried: wrong by a sizable fraction of the output at
    10x magnitudes, far beyond 4x eager's own rounding there."""
    model = Normalize().eval().to(torch.bfloat16)
    data = [(torch.randn(2, 8) * 3).to(torch.bfloat16), (torch.randn(4, 8) * 3).to(torch.bfloat16)]
    tuned = ait.Module(model, "saturating", strategy=forced(SaturatingBackend(), fast_profiling))
    report = ait.tune(tuned, data, ready_batches=True)
    assert report.rows[0].status == "rejected (correctness)", report.rows[0].reason
    assert "at the probe's scale (rule 6)" in report.rows[0].reason
    assert tuned.state is ait.ModuleState.PASSTHROUGH




class WritesIntoItsInput(TorchEagerBackend):
    """Eager's outputs, right to the last bit, but the input is then used as scratch space (zeroed in place):
    what an artifact that reuses its input buffer does. Eager leaves the caller's tensor alone."""

    name = "test_writes_into_input"
    passthrough = False

    def _infer(self, args, kwargs):
        out = super()._infer(args, kwargs)
        for leaf in list(args) + list(kwargs.values()):
            if isinstance(leaf, torch.Tensor):
                leaf.zero_()
        return out


def test_a_candidate_writing_into_the_callers_tensors_is_rejected(fast_profiling):
    """README "By value": a candidate that writes into the caller's tensors where eager does not is rejected
    (its outputs equal eager's: only the input check can catch it), and eager runs after tuning."""
    model = nn.Sequential(nn.Linear(8, 4)).eval()
    data = [torch.randn(2, 8), torch.randn(4, 8)]
    tuned = ait.Module(model, "scratch", strategy=forced(WritesIntoItsInput(), fast_profiling))
    report = ait.tune(tuned, data, ready_batches=True)
    row = report.rows[0]
    assert row.status == "rejected (correctness)"
    assert "the candidate writes into its input 'input' (eager leaves it unchanged)" in row.reason, row.reason
    assert tuned.state is ait.ModuleState.PASSTHROUGH
    x = torch.randn(3, 8)
    kept = x.clone()
    with torch.no_grad():
        torch.testing.assert_close(tuned(x), model(kept))
    assert torch.equal(x, kept)  # the caller's tensor is intact


# ------------------------------------------------------------------------------------------ probes: bounds


class Tagger(nn.Module):
    """Floats, a padding mask and token ids over a dynamic length, and a context of its own length: many probe
    kinds (14 with no bound)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(32, 8)
        self.proj = nn.Linear(8, 8)

    def forward(self, x, mask, ids, context):
        return (self.proj(x) + self.emb(ids) + context.mean(1, keepdim=True)) * mask.unsqueeze(-1)


def _tagger_batch(batch, length, context_length):
    return {"x": torch.randn(batch, length, 8), "mask": torch.rand(batch, length) > 0.2,
            "ids": torch.randint(0, 32, (batch, length)), "context": torch.randn(batch, context_length, 8)}


def test_probe_defaults_are_12_per_graph_and_10_s_per_candidate_and_a_tune_keeps_to_them(fast_profiling):
    """README "Probes": default up to 12 probes per graph and 10 s per candidate; a graph offering more than
    12 gets 12 checked."""
    from aitune.torch.check.probes import ProbeConfig, make_probes

    assert (ProbeConfig().max_probes, ProbeConfig().max_seconds) == (12, 10.0)
    assert ait.ProbeConfig is ProbeConfig
    model = Tagger().eval()
    data = [_tagger_batch(2, 6, 5), _tagger_batch(4, 10, 3), _tagger_batch(3, 16, 12)]
    graph = record_graphs(model, [((), batch) for batch in data])[0]

    def run_eager(sample):
        with torch.no_grad():
            return model(*sample.args, **sample.kwargs)

    assert len(make_probes(graph, run_eager, ProbeConfig(max_probes=100)).probes) > 12  # the bound matters here
    strategy = ait.OneBackendStrategy(WritesNothing(), profiling_config=fast_profiling)
    tuned = ait.Module(model, "tagger", strategy=strategy.enable_performance_validation(False))
    report = ait.tune(tuned, data, ready_batches=True)
    row = report.rows[0]
    assert row.status == "selected", row.reason
    assert row.probes["checked"] == row.probes["passed"] == 12 and row.probes["not_run"] == 0


class WritesNothing(TorchEagerBackend):
    """Eager as a (non-passthrough) candidate: probes run on it like on any other."""

    name = "test_eager_candidate"
    passthrough = False


class EvenSizesOnlyAccepted(EvenSizesOnlyPool):
    """EvenSizesOnlyPool (above), with an accepted range that says so: odd spatial sizes are refused."""

    name = "test_even_sizes_accepted"
    seen: list = []

    def rejects(self, leaves):
        h, w = leaves[0].shape[-2:]
        return None if h % 2 == 0 and w % 2 == 0 else f"odd spatial size {h}x{w}"

    def _infer(self, args, kwargs):
        EvenSizesOnlyAccepted.seen.append(tuple(kwargs["x"].shape))
        return super()._infer(args, kwargs)


def test_a_probe_outside_an_artifacts_accepted_range_is_not_run_on_it(fast_profiling):
    """README "Probes": a probe the artifact's ``accepts`` refuses is counted ``not_accepted`` and never run on it
    (the backend would be wrong there); such calls run eager after tuning."""
    model = Pool().eval()
    data = [torch.rand(2, 3, 32, 32), torch.rand(4, 3, 64, 48)]
    EvenSizesOnlyAccepted.seen = []
    tuned = ait.Module(model, "accepted", strategy=forced(EvenSizesOnlyAccepted(), fast_profiling))
    report = ait.tune(tuned, data, ready_batches=True)
    row = report.rows[0]
    assert row.status == "selected", row.reason
    assert row.probes["not_accepted"] >= 1 and row.probes["passed"] == row.probes["checked"] >= 1
    assert EvenSizesOnlyAccepted.seen and all(h % 2 == 0 and w % 2 == 0 for *_, h, w in EvenSizesOnlyAccepted.seen)
    x = torch.rand(3, 3, 33, 41)
    with torch.no_grad():
        torch.testing.assert_close(tuned(x), model(x))
    assert tuned.stats["eager_fallbacks"] == {"range": 1}


class AutocastFaultOnSaturatedOutputs(TorchEagerBackend):
    """bf16 autocast (a reduced-precision candidate) whose outputs, once its inputs pass a magnitude only the x10
    probe reaches, are off by 0.05 in 4 elements: on a sigmoid output, whose magnitude does not grow with the
    input, rule 6 must not loosen atol for it."""

    name = "test_autocast_fault_on_saturated_outputs"
    passthrough = False

    def __init__(self, config=None):
        super().__init__(config or TorchEagerBackendConfig(autocast_enabled=True, autocast_dtype="bfloat16"))

    def _infer(self, args, kwargs):
        x = (list(args) + list(kwargs.values()))[0]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = self.module(x).float()
        if x.abs().amax() > 8:
            out.view(-1)[:4] -= 0.05
        return out


def test_rule_6_does_not_loosen_atol_for_outputs_that_do_not_grow(fast_profiling):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Sigmoid()).eval()
    data = [torch.randn(2, 8).clamp(-3, 3), torch.randn(4, 8).clamp(-3, 3)]
    strategy = forced(AutocastFaultOnSaturatedOutputs(), fast_profiling).enable_reduced_precision(True)
    tuned = ait.Module(model, "sigmoid", strategy=strategy)
    report = ait.tune(tuned, data, ready_batches=True)
    row = report.rows[0]
    assert row.status == "rejected (correctness)" and row.reason.startswith("probe float-scale-up"), row.reason
    assert "at the probe's scale (rule 6)" in row.reason
