"""A tuned module keeps the module's semantics on values, state and randomness the samples never showed
(pytorch/pytorch#126691, #195402, PR#159973, microsoft/onnxruntime#1533, #13626, pytorch/ao PR#3089; test names
keep the project's case numbers).

Each test forces one backend (OneBackendStrategy, no performance validation) and compares with eager; the
Inductor cases whose bad call could abort the process run that call in a subprocess, so a crash fails the test
instead of killing pytest.
"""

import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn as nn

import aitune.torch as ait
from aitune.torch.backend import (ONNXRuntimeBackend, TorchAOBackend, TorchAOBackendConfig, TorchEagerBackend,
                                  TorchInductorAotBackend, TorchInductorJitBackend)


def _ort():
    pytest.importorskip("onnxruntime")
    return ONNXRuntimeBackend()


def _torchao():
    pytest.importorskip("torchao")
    return TorchAOBackend(TorchAOBackendConfig(quantization="int8dq", compile=False))


BACKENDS = {"onnxruntime": _ort, "inductor_jit": TorchInductorJitBackend, "inductor_aot": TorchInductorAotBackend,
            "torchao": _torchao, "eager": TorchEagerBackend}


def tune_forced(model, name, backend, data, profiling):
    strategy = ait.OneBackendStrategy(backend, profiling_config=profiling).enable_performance_validation(False)
    tuned = ait.Module(model, name, strategy=strategy)
    report = ait.tune(tuned, data, ready_batches=True)
    assert not report.module_errors, report.module_errors
    assert {b.name for b in tuned.backends.values()} == {backend.name}
    return tuned


def _embedding():
    return nn.Sequential(nn.Embedding(1000, 32), nn.Flatten(), nn.Linear(32 * 8, 4)).eval()


def _bad_ids():
    bad = torch.randint(0, 1000, (2, 8))
    bad[0, 0], bad[1, 3] = -1, 1000
    return bad


# ---------------------------------------------------------------- indices outside the recorded range


@pytest.mark.parametrize("which", ["onnxruntime", "eager"])
def test_c39_invalid_indices_raise_eagers_index_error(which, fast_profiling):
    model = _embedding()
    tuned = tune_forced(model, "emb", BACKENDS[which](), [torch.randint(0, 1000, (b, 8)) for b in (2, 4)],
                        fast_profiling)
    with torch.no_grad(), pytest.raises(IndexError):  # inference: with autograd on, eager runs it anyway
        tuned(_bad_ids())
    ids = tuned.graphs[0].samples[0].leaves()[0]
    with torch.no_grad():
        torch.testing.assert_close(tuned(ids), model(ids))
    if which != "eager":
        assert tuned.stats["eager_fallbacks"].get("values") == 1
        assert tuned.backend_calls == 1


_C39_CHILD = textwrap.dedent("""
    import sys, torch, torch.nn as nn
    import aitune.torch as ait
    from aitune.torch.backend import TorchAOBackend, TorchInductorAotBackend, TorchInductorJitBackend
    from aitune.torch.measure.profiling import ProfilingConfig
    torch.manual_seed(0)
    backend = {"inductor_jit": TorchInductorJitBackend, "inductor_aot": TorchInductorAotBackend,
               "torchao": TorchAOBackend}[sys.argv[1]]()
    profiling = ProfilingConfig(warmup_rounds=1, warmup_s=0.0, min_rounds=3, max_rounds=20, time_budget_s=0.2)
    model = nn.Sequential(nn.Embedding(1000, 32), nn.Flatten(), nn.Linear(32 * 8, 4)).eval()
    strategy = ait.OneBackendStrategy(backend, profiling_config=profiling).enable_performance_validation(False)
    tuned = ait.Module(model, "emb", strategy=strategy)
    ait.tune(tuned, [torch.randint(0, 1000, (b, 8)) for b in (2, 4)], ready_batches=True)
    assert [b.name for b in tuned.backends.values()] == [sys.argv[1]], tuned.backends
    bad = torch.randint(0, 1000, (2, 8))
    bad[0, 0], bad[1, 3] = -1, 1000
    try:
        with torch.no_grad():  # inference: with autograd on, eager runs it anyway
            tuned(bad)
        print("RESULT returned values")
    except IndexError:
        print("RESULT IndexError", tuned.stats["eager_fallbacks"].get("values"))
""")


@pytest.mark.parametrize("which", ["inductor_jit", "inductor_aot", "torchao"])
def test_c39_invalid_indices_never_kill_the_process(which, tmp_path):
    if which == "torchao":
        pytest.importorskip("torchao")
    done = subprocess.run([sys.executable, "-c", _C39_CHILD, which], capture_output=True, text=True, timeout=600,
                          env={**__import__("os").environ, "AITUNE_CACHE_DIR": str(tmp_path)})
    assert done.returncode == 0, f"the process died ({done.returncode}): {done.stderr[-2000:]}"
    assert "RESULT IndexError 1" in done.stdout, done.stdout + done.stderr[-2000:]


# ------------------------------------------------------------------------------------------ non-finite inputs


class Saturating(nn.Module):
    """Ops whose kernels treat nan differently (relu, clamp, max-pooling, max, argmax), after a Linear (which
    TorchAO quantizes)."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        x = self.proj(x)
        pooled = nn.functional.max_pool1d(x.unsqueeze(1), 2).squeeze(1)
        return torch.cat([x.relu(), x.clamp(-1, 1), pooled, x.amax(1, keepdim=True),
                          x.argmax(1, keepdim=True).float()], 1)


@pytest.mark.parametrize("which", list(BACKENDS))
def test_nonfinite_inputs_give_eagers_nonfinite_outputs(which, fast_profiling):
    model = Saturating().eval()
    tuned = tune_forced(model, "sat", BACKENDS[which](), [torch.randn(b, 8) for b in (2, 4)], fast_profiling)
    x = torch.randn(3, 8)
    x[0, 2], x[1, 5], x[2, 1] = float("nan"), float("inf"), -float("inf")
    with torch.no_grad():
        torch.testing.assert_close(tuned(x), model(x), equal_nan=True, atol=0, rtol=0)
    if which != "eager":
        assert tuned.stats["eager_fallbacks"].get("values") == 1


# --------------------------------------------------- quantized activations meeting an outlier channel


def _sqnr_db(out, ref):
    return float(10 * torch.log10(ref.pow(2).mean() / (out - ref).pow(2).mean().clamp_min(1e-30)))


def test_c40_quantized_candidate_does_not_serve_an_outlier_channel(fast_profiling):
    net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64)).eval()
    with torch.no_grad():
        net[0].weight[:, 7] *= 0.01
    tuned = tune_forced(net, "q", _torchao(), [torch.randn(b, 64) for b in (8, 16)], fast_profiling)
    later = torch.randn(16, 64)
    later[:, 7] *= 100
    ordinary = torch.randn(16, 64)
    with torch.no_grad():
        for _ in range(3):
            out, ref = tuned(later), net(later)
            assert _sqnr_db(out, ref) >= 20
            assert float(nn.functional.cosine_similarity(out.flatten(), ref.flatten(), 0)) >= 0.99
        served, expected = tuned(ordinary), net(ordinary)
    assert tuned.stats["eager_fallbacks"].get("values") == 3
    assert tuned.backend_calls == 1  # ordinary inputs are still the quantized candidate's
    assert _sqnr_db(served, expected) >= 20


# ------------------------------------------------------------------------------------------ state outside parameters


class Monitor(nn.Module):
    """Keeps a running mean in a plain tensor attribute, a call counter and a cache dict (none a buffer)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 4)
        self.mean = torch.zeros(8)
        self.count = 0
        self.cache = {}

    def forward(self, x):
        self.count += 1
        self.mean = 0.9 * self.mean + 0.1 * x.detach().mean(0)
        self.cache[self.count] = x.shape[0]
        return self.lin(x)


@pytest.mark.parametrize("which", list(BACKENDS))
def test_tuning_leaves_attribute_state_as_the_users_calls_left_it(which, fast_profiling):
    model = Monitor().eval()
    with torch.no_grad():  # the user's own calls
        model(torch.randn(2, 8))
        model(torch.randn(3, 8))
    mean, cache, mean_object, cache_object = model.mean.clone(), dict(model.cache), model.mean, model.cache
    tuned = tune_forced(model, "monitor", BACKENDS[which](), [torch.randn(b, 8) for b in (2, 4)], fast_profiling)
    assert model.count == 2 and model.cache == cache and model.cache is cache_object
    assert model.mean is mean_object and torch.equal(model.mean, mean)
    graph = tuned.graphs[0]
    assert graph.stateful
    for name in ("mean", "count", "cache"):
        assert f"attribute `{name}`" in graph.describe()["stateful_reason"]


# ------------------------------------------------------------- attention with fully masked rows (padding)


class PaddedAttn(nn.Module):
    def forward(self, q, k, v, keep):  # keep: bool [B, 1, Lq, Lk], True = attend
        return nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=keep)


def _padded_attention_batch():
    q, k, v = (torch.randn(2, 4, 8, 16) for _ in range(3))
    keep = torch.ones(2, 1, 8, 8, dtype=torch.bool)
    keep[:, :, :, 6:] = False  # padded keys
    keep[1, :, 5:, :] = False  # padded queries: these rows have every key masked
    return q, k, v, keep


@pytest.mark.parametrize("which", ["onnxruntime"])
def test_c09_fully_masked_attention_rows_give_eagers_values(which, fast_profiling):
    """Exporters lower a boolean SDPA mask to an additive one (pytorch/pytorch PR#159973, microsoft/onnxscript
    PR#2479): on a row with every key masked the backend may give NaN or the mean of ``v`` where eager gives its
    own answer. Whatever the backend computes, the user gets eager's values there, NaN positions included."""
    torch.manual_seed(0)
    model = PaddedAttn().eval()
    backend = BACKENDS[which]()
    strategy = ait.OneBackendStrategy(backend, profiling_config=fast_profiling).enable_performance_validation(False)
    tuned = ait.Module(model, "attn", strategy=strategy)
    report = ait.tune(lambda batch: tuned(*batch), [_padded_attention_batch() for _ in range(2)],
                      ready_batches=True)
    row = report.rows[0]
    assert row.backend == backend.name
    later = _padded_attention_batch()
    with torch.no_grad():
        out, expected = tuned(*later), model(*later)
    torch.testing.assert_close(out, expected, equal_nan=True, atol=1e-4, rtol=1e-3)
    masked = expected[1, :, 5:]  # the fully masked rows: [H, 3, D]
    torch.testing.assert_close(out[1, :, 5:], masked, equal_nan=True, atol=1e-4, rtol=1e-3)
    if row.status == "selected":  # the backend agreed with eager on the masked rows, and it serves the call
        assert tuned.state is ait.ModuleState.TUNED and tuned.backends["graph0"].name == backend.name
        assert tuned.stats["backend_calls"] == 1
    else:  # rejected on the recorded samples, with a reason that names the disagreement on those rows
        assert row.status == "rejected (correctness)", (row.status, row.reason)
        assert tuned.state is ait.ModuleState.PASSTHROUGH and tuned.stats["backend_calls"] == 0
        assert report.module_errors["attn"] == row.reason
        assert row.reason.startswith("ToleranceExceededError: output <root>: "), row.reason
        # exactly the values of the fully masked rows: non-finite where eager is finite, or off by more than
        # the tolerance
        assert (f"{masked.numel()} non-finite values where eager is finite" in row.reason
                or f"{masked.numel()} of {expected.numel()} values off by more than atol=0.0001" in row.reason), \
            row.reason


# --------------------------------------------------------------------- zero-size batch and spatial input


class Pooler(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(32, 32)

    def forward(self, x):  # [B, 8, H, W] -> [B, 32]
        y = nn.functional.interpolate(x, scale_factor=2.0, mode="bilinear")
        return self.fc(y.flatten(2).mean(-1).repeat(1, 4))


@pytest.mark.parametrize("which", ["onnxruntime"])
def test_c15_zero_size_batch_and_spatial_input_through_a_backend(which, fast_profiling):
    """Exported graphs mishandle empty batches (microsoft/onnxruntime#13626, #20026) and compiled resizes of an
    empty spatial dim read out of bounds (pytorch/pytorch#197095): a zero-size call gets eager's empty result or
    eager's error, and the other calls still go to the backend."""
    torch.manual_seed(0)
    model = Pooler().eval()
    tuned = tune_forced(model, "pooler", BACKENDS[which](), [torch.randn(b, 8, 7, 7) for b in (2, 4)],
                        fast_profiling)
    with torch.no_grad():
        x = torch.randn(3, 8, 7, 7)
        torch.testing.assert_close(tuned(x), model(x), atol=1e-4, rtol=1e-3)
        assert tuned.stats["backend_calls"] == 1 and tuned.stats["eager_fallbacks"] == {}
        empty = torch.randn(0, 8, 7, 7)
        out, expected = tuned(empty), model(empty)
        assert out.shape == expected.shape == (0, 32) and out.dtype == expected.dtype == torch.float32
        torch.testing.assert_close(out, expected)
        assert tuned.stats["eager_fallbacks"] == {"empty": 1}
        bad = torch.randn(2, 8, 0, 7)  # zero-size spatial dim
        try:
            expected = model(bad)
        except Exception as exc:  # noqa: BLE001 -- eager's error, whatever it is, is the one the user gets
            with pytest.raises(type(exc)) as raised:
                tuned(bad)
            assert str(raised.value) == str(exc)
        else:
            torch.testing.assert_close(tuned(bad), expected, equal_nan=True)
        assert tuned.stats["eager_fallbacks"] == {"empty": 2}
        torch.testing.assert_close(tuned(x), model(x), atol=1e-4, rtol=1e-3)
        assert tuned.stats["backend_calls"] == 2  # the zero-size calls did not take the backend off the module
