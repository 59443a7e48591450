"""The tuning cache (aitune.torch.search.cache.BuildCache) with a real AOT backend (ONNX Runtime, CPU EP).

Each test uses its own cache folder (``cache_dir_path=tmp_path``). ONNX Runtime builds take a few
seconds here; the tests build at most twice each.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import aitune.torch as ait
from aitune.torch.backend import (
    ONNXRuntimeBackend,
    ONNXRuntimeBackendConfig,
    TorchEagerBackend,
    TorchInductorAotBackend,
)
from aitune.torch.search.cache import ENTRY_FILE, BuildCache
from aitune.torch.measure.profiling import ProfilingConfig
from aitune.torch.record.samples import record_graphs

FAST = ProfilingConfig(warmup_rounds=1, min_rounds=3, max_rounds=10, time_budget_s=0.1)

needs_ort = pytest.mark.skipif(not ONNXRuntimeBackend.availability().ok,
                               reason=ONNXRuntimeBackend.availability().reason)


class Small(nn.Module):
    """x [B, 8] float32 -> [B, 4]."""

    def __init__(self, eps: float = 1e-5):
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.norm = nn.LayerNorm(16, eps=eps)
        self.b = nn.Linear(16, 4)

    def forward(self, x):
        return self.b(self.norm(torch.relu(self.a(x))))


DATA = [torch.randn(2, 8, generator=torch.Generator().manual_seed(0)),
        torch.randn(4, 8, generator=torch.Generator().manual_seed(1))]
PROBE = torch.randn(3, 8, generator=torch.Generator().manual_seed(2))


def small(seed: int = 0, **kwargs) -> Small:
    torch.manual_seed(seed)
    return Small(**kwargs).eval()


def tune(module: nn.Module, cache_dir, backend):
    wrapper = ait.Module(module, "small", strategy=ait.OneBackendStrategy(
        backend, profiling_config=FAST).enable_performance_validation(False))
    report = ait.tune(wrapper, DATA, cache_dir_path=cache_dir, ready_batches=True)
    assert not report.module_errors, report.module_errors
    row = next(row for row in report.rows if row.backend == backend.name)
    return wrapper, row, report


def entries(cache_dir) -> list:
    return sorted((cache_dir / "builds").glob(f"*/*/{ENTRY_FILE}"))


@needs_ort
def test_a_second_tune_reuses_the_aot_build_and_a_changed_weight_misses(tmp_path):
    first, first_row, _ = tune(small(), tmp_path, ONNXRuntimeBackend())
    assert first_row.status == "selected" and not first_row.cached
    assert len(entries(tmp_path)) == 1

    second, second_row, report = tune(small(), tmp_path, ONNXRuntimeBackend())  # same class, same weights
    assert second_row.status == "selected" and second_row.cached
    assert "selected (cached)" in report.table()
    assert second_row.build_s < first_row.build_s  # restoring an artifact vs exporting it: seconds vs ms
    backend = second.backends["graph0"]
    assert backend.build_info["cached"] and backend.build_info["cache_entry"] == str(entries(tmp_path)[0].parent)
    with torch.no_grad():
        torch.testing.assert_close(second(PROBE), first(PROBE), rtol=0, atol=0)
    assert len(entries(tmp_path)) == 1

    changed = small()
    with torch.no_grad():
        changed.a.weight[0, 0] += 1.0
    third, third_row, _ = tune(changed, tmp_path, ONNXRuntimeBackend())
    assert not third_row.cached and len(entries(tmp_path)) == 2
    with torch.no_grad():  # the new build runs the changed weight, not the cached artifact
        expected = changed(PROBE)
        torch.testing.assert_close(third(PROBE), expected, rtol=1e-4, atol=1e-5)
        assert not torch.allclose(first(PROBE), expected, atol=1e-4)


@needs_ort
def test_a_corrupted_cache_entry_is_rebuilt_never_trusted(tmp_path, caplog):
    tune(small(), tmp_path, ONNXRuntimeBackend())
    (entry_file,) = entries(tmp_path)
    artifacts = sorted(p for p in (entry_file.parent / "artifacts").rglob("*") if p.is_file())
    assert artifacts
    data = bytearray(artifacts[0].read_bytes())
    data[len(data) // 2] ^= 0xFF
    artifacts[0].write_bytes(bytes(data))

    with caplog.at_level("WARNING", logger="aitune"):
        wrapper, row, _ = tune(small(), tmp_path, ONNXRuntimeBackend())
    assert not row.cached and row.status == "selected"
    assert any("is corrupted or stale" in record.getMessage() and "does not match its sha256" in record.getMessage()
               for record in caplog.records)
    with torch.no_grad():
        torch.testing.assert_close(wrapper(PROBE), small()(PROBE), rtol=1e-4, atol=1e-5)
    # The rebuilt entry replaced the corrupted one and is reused next time.
    assert len(entries(tmp_path)) == 1
    _, row, _ = tune(small(), tmp_path, ONNXRuntimeBackend())
    assert row.cached

    # An unreadable entry.json is rebuilt as well.
    (entry_file,) = entries(tmp_path)
    entry_file.write_text("{ not json")
    _, row, _ = tune(small(), tmp_path, ONNXRuntimeBackend())
    assert not row.cached and json.loads(entries(tmp_path)[0].read_text())["backend"] == "onnxruntime"


def test_jit_backends_are_never_cached(tmp_path):
    for _ in range(2):
        _, row, _ = tune(small(), tmp_path, TorchEagerBackend())
        assert not row.cached
    assert entries(tmp_path) == []


def test_the_key_covers_weights_flags_attributes_shapes_backend_and_config(tmp_path):
    def key(module, calls=((DATA[0],), (DATA[1],)), backend=None, cache=None):
        graph = record_graphs(module, [(args, {}) for args in calls])[0]
        backend = backend or TorchInductorAotBackend()
        return (cache or BuildCache(tmp_path)).key(backend, module, graph, "cpu")

    base = key(small())
    assert key(small()) == base == key(small(), cache=BuildCache(tmp_path / "other"))  # stable, not per object
    changed = small()
    with torch.no_grad():
        changed.b.bias[0] += 1e-3
    trained = small().train()
    different = {
        "weights": key(changed),
        "training flag": key(trained),
        "attribute (LayerNorm eps)": key(small(eps=1e-3)),
        "sample shapes": key(small(), calls=((DATA[0],), (torch.randn(6, 8),))),
        "backend": key(small(), backend=ONNXRuntimeBackend()),
        "backend config": key(small(), backend=ONNXRuntimeBackend(ONNXRuntimeBackendConfig(use_dynamo=False))),
    }
    assert len(set(different.values()) | {base}) == len(different) + 1, different
    assert key(small(), backend=ONNXRuntimeBackend()) == different["backend"]
