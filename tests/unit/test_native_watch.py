"""The stale-weight watch's native reader (NOTE [native watch] in aitune/torch/check/native_watch.py): its sums equal
what Python reads, the watch notices what the Python path notices (and a ``.data`` swap at once), and where it cannot
be built or is switched off the watch still works, reading from Python."""

import json
import sys

import pytest
import torch
from torch import nn

from aitune.torch.check import guard as guard_module
from aitune.torch.check import native_watch
from aitune.torch.check.guard import FULL_SCAN_EVERY, StateWatch

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the native watch is built on Linux only")


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4)).eval()


@pytest.fixture
def native():
    """The session's native module (built once, in $AITUNE_NATIVE_DIR: tests/conftest.py); skips where this machine
    cannot build it, naming why."""
    module = native_watch.native_module()
    if module is None:
        pytest.skip(f"native watch unavailable: {native_watch.native_status()}")
    return module


@pytest.fixture
def fresh_state(monkeypatch):
    """A process that has not decided yet (the module-level memo emptied for this test, put back after)."""
    monkeypatch.setattr(native_watch, "_STATE", {})


@linux_only
def test_the_reader_sums_what_python_reads_before_and_after_each_kind_of_change(native):
    net = _net()
    tensors = [*net.parameters(), *net.buffers()]
    reader = native_watch.state_reader(tensors)

    def python_sums():
        return sum(t._version for t in tensors), sum(t.data_ptr() for t in tensors)

    first = reader()
    assert first[:2] == python_sums()
    with torch.no_grad():
        net[3].bias.add_(1)  # the last tensor edited in place
    assert reader()[:2] == python_sums() and reader()[0] == first[0] + 1
    net[1].running_mean.data = net[1].running_mean.data.clone()  # one buffer's .data replaced
    assert reader()[:2] == python_sums() and reader()[1] != first[1]
    kinds = reader()[2]
    net[0].weight.data = net[0].weight.data.double()
    assert reader()[2] != kinds


@linux_only
def test_the_watch_notices_a_data_swap_at_the_next_call_with_the_native_reader(native):
    net = _net()
    watch = StateWatch(net)
    assert watch.reader is not None
    nn.Linear(3, 3)  # parameters registered elsewhere: checked, nothing changed here
    assert watch.changed() is None and watch.changed() is None
    net[3].bias.data = net[3].bias.data.clone()  # not the first tensor: the Python path samples such a swap
    assert "'3.bias' holds new data" in watch.changed()


def test_without_the_native_reader_the_watch_reads_from_python(monkeypatch, fresh_state):
    monkeypatch.setenv(native_watch.ENV_SWITCH, "0")
    assert "switched off by AITUNE_NATIVE_WATCH" in native_watch.native_status()
    net = _net()
    watch = StateWatch(net)
    assert watch.reader is None
    with torch.no_grad():
        net[3].weight.mul_(2)
    assert "'3.weight' was changed in place" in watch.changed()
    swapped = StateWatch(_net())
    swapped.module[3].bias.data = swapped.module[3].bias.data.clone()
    reasons = [swapped.changed() for _ in range(FULL_SCAN_EVERY)]  # the sampled pointer scan: within 16 calls
    assert reasons[-1] is not None and "holds new data" in reasons[-1]


@linux_only
def test_a_failed_build_is_reported_kept_and_not_retried(monkeypatch, fresh_state, tmp_path):
    monkeypatch.setenv(native_watch.DIR_VARIABLE, str(tmp_path / "native"))
    monkeypatch.setenv("CXX", "false")  # a "compiler" that fails every build
    status = native_watch.native_status()
    assert "the C++ build failed" in status and "the watch reads from Python" in status
    verdicts = list((tmp_path / "native").glob("*/verdict.json"))
    assert len(verdicts) == 1 and json.loads(verdicts[0].read_text())["ok"] is False
    calls = []
    monkeypatch.setattr(native_watch.subprocess, "run", lambda *a, **k: calls.append(a))
    monkeypatch.setattr(native_watch, "_STATE", {})  # another process: the verdict is read, nothing is rebuilt
    assert "the C++ build failed" in native_watch.native_status() and calls == []
    assert StateWatch(_net()).reader is None


@linux_only
def test_inference_tensors_and_empty_lists_get_no_reader(native):
    with torch.inference_mode():
        inference = [torch.ones(2)]
    assert native_watch.state_reader(inference) is None  # no version counter to read
    assert native_watch.state_reader([]) is None
    with pytest.raises(TypeError, match="not a tensor"):
        native.StateReader([torch.ones(1), 3])


@linux_only
def test_the_reader_holds_its_tensors_until_it_is_dropped(native):
    import gc
    import weakref

    tensors = [torch.ones(3) for _ in range(4)]
    alive = [weakref.ref(tensor) for tensor in tensors]
    reader = native_watch.state_reader(tensors)
    del tensors
    gc.collect()
    assert all(ref() is not None for ref in alive) and reader()[0] == 0  # its TensorImpls are still the tensors'
    del reader
    gc.collect()
    assert all(ref() is None for ref in alive)  # and released with it


def test_the_watch_module_reads_no_version_per_tensor_when_native(monkeypatch, native):
    """The reason for the extension: with it, a served call does not read each tensor's version from Python."""
    net = _net()
    watch = StateWatch(net)
    reads = []
    monkeypatch.setattr(guard_module, "VERSION", lambda tensor: reads.append(tensor) or tensor._version)
    for _ in range(3):
        assert watch.changed() is None
    assert reads == []


@linux_only
def test_all_finite_answers_for_contiguous_cpu_floats_and_leaves_the_rest_to_torch(native):
    check = native_watch.all_finite_check()
    for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        values = torch.randn(3, 1001).to(dtype)
        assert check(values) is True
        for bad in (float("nan"), float("inf"), float("-inf")):
            spoiled = values.clone()
            spoiled[2, 1000] = bad  # the last element: no part of the loop skipped
            assert check(spoiled) is False, (dtype, bad)
        assert check(torch.full((8,), torch.finfo(dtype).max, dtype=dtype)) is True  # huge but finite
    assert check(torch.empty(0)) is True
    for unread in (torch.ones(4, 4).t(), torch.ones(3, dtype=torch.int64), torch.ones(2, device="meta"),
                   torch.ones(2, dtype=torch.complex64)):
        assert check(unread) is None, unread
    with pytest.raises(TypeError, match="not a tensor"):
        check([1.0])


def test_a_gate_for_a_graph_recorded_on_the_cpu_uses_the_native_check_where_built(native):
    from aitune.torch.backend.accepted import ValueGate
    from aitune.torch.record.samples import record_graphs

    module = nn.Linear(4, 2).eval()
    [graph] = record_graphs(module, [((torch.randn(3, 4),), {})])
    gate = ValueGate.for_graph(graph, quantizing=False)
    assert gate.native_finite is native.all_finite
    assert "nan/inf" in gate.rejects([torch.tensor([[1.0, float("nan"), 0.0, 0.0]])])
