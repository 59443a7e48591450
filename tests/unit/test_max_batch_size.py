"""aitune.torch.search.max_batch_size: the search's memory accounting, limits, bisection and restoration."""

import torch
from torch import nn

from aitune.torch.search.max_batch_size import MaxBatchSizeSearch, batch_of, find_max_batch_size, peak_tensor_bytes
from aitune.torch.record.samples import record_graphs


def _graph(module, sizes=(1, 2), width=16):
    from aitune.torch.record.samples import Recorder

    recorder = Recorder(module)
    with torch.no_grad():
        for size in sizes:
            recorder.record(module, (torch.randn(size, width),), {}, batch_size=size)
    return list(recorder.graphs.values())[0]


def test_peak_bytes_counts_live_tensors_once():
    linear = nn.Linear(256, 1024)
    x = torch.randn(64, 256)
    with torch.no_grad():
        peak = peak_tensor_bytes(lambda: torch.relu(linear(x)))
    assert peak == 2 * 64 * 1024 * 4  # linear's output and relu's, both alive at the end; no input counted
    with torch.no_grad():
        assert peak_tensor_bytes(lambda: x.view(-1)) == 0  # a view allocates nothing


def test_batch_of_slices_and_repeats_batch_axes():
    graph = _graph(nn.Linear(16, 4))
    sample = graph.samples[-1]
    grown = batch_of(graph, sample, 5)
    (grown_x,), (x,) = grown.leaves(), sample.leaves()
    assert grown_x.shape == (5, 16) and torch.equal(grown_x[2], x[0]) and torch.equal(grown_x[:2], x)
    assert batch_of(graph, sample, 1).leaves()[0].shape == (1, 16)


def test_memory_budget_stops_and_bisects():
    module = nn.Sequential(nn.Linear(16, 256), nn.ReLU())
    graph = _graph(module)
    per_item = 2 * 256 * 4 + 16 * 4  # two activations + the input
    budget = per_item * 100
    report = find_max_batch_size(module, graph, torch.device("cpu"), MaxBatchSizeSearch(max_memory_bytes=budget))
    assert report["status"] == "found" and report["max_batch_size"] == 100
    assert "over memory budget at batch 128" in report["stopped_by"]
    assert [t["batch_size"] for t in report["trials"]][:8] == [2, 4, 8, 16, 32, 64, 128, 96]
    assert graph.tensor_specs[0].max_shape[0] == 100 and any(s.batch_size == 100 for s in graph.samples)


def test_cap_latency_and_skips_restore_state():
    module = nn.Linear(16, 4)
    before = {k: v.clone() for k, v in module.state_dict().items()}
    capped = find_max_batch_size(module, _graph(module), torch.device("cpu"), MaxBatchSizeSearch(max_batch_size=12))
    assert capped["max_batch_size"] == 12 and capped["stopped_by"] == "the max_batch_size cap of 12"
    slow = find_max_batch_size(module, _graph(module), torch.device("cpu"),
                               MaxBatchSizeSearch(latency_limit_ms=1e-9))
    assert slow["status"] == "failed" and "over latency limit" in slow["reason"]
    static = record_graphs(module, [((torch.randn(2, 16),), {})])[0]
    assert find_max_batch_size(module, static, torch.device("cpu"), MaxBatchSizeSearch())["status"] == "skipped"
    assert all(torch.equal(v, before[k]) for k, v in module.state_dict().items())
