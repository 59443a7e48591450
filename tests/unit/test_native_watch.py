"""The native reader behind the stale-weight watch and the value gate's finite check (NOTE [native watch] in
aitune/torch/check/native_watch.py): its sums equal what Python reads, the watch notices what the Python path notices
(a ``.data`` swap and a ``swap_tensors`` at once), a failed build or check is reported, kept and never takes the
caller down, and where it is off the watch still works, reading from Python.

On Linux with a C++ compiler and torch's headers the extension must build: the ``native`` fixture fails there
rather than skip, so a build that breaks fails these tests."""

import json
import sys
import weakref

import pytest
import torch
from torch import nn

from aitune.torch.check import guard as guard_module
from aitune.torch.check import native_watch
from aitune.torch.check.guard import FULL_SCAN_EVERY, StateWatch


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4)).eval()


@pytest.fixture
def native():
    """The session's extension (built once, in $AITUNE_NATIVE_DIR: tests/conftest.py). Skips only where it cannot be
    built here at all (not Linux, no compiler, no torch headers, switched off); fails where it should build and did
    not."""
    module = native_watch.native_module()
    if module is None:
        blocked = native_watch._unavailable()
        if blocked is not None:
            pytest.skip(f"native watch unavailable here: {blocked}")
        pytest.fail(f"the native watch should build here and did not: {native_watch.native_status()}")
    return module


@pytest.fixture
def fresh_state(monkeypatch):
    """A process that has not decided yet (the module-level memo emptied for this test, put back after)."""
    monkeypatch.setattr(native_watch, "_STATE", {})


def _weighted(values) -> int:
    return sum((index + 1) * value for index, value in enumerate(values)) % 2 ** 64


def test_the_reader_sums_what_python_reads_before_and_after_each_kind_of_change(native):
    net = _net()
    tensors = [*net.parameters(), *net.buffers()]
    reader = native_watch.state_reader(tensors)

    def python_sums():
        return sum(t._version for t in tensors), _weighted(t.data_ptr() for t in tensors)

    first = reader.state()
    assert first[:2] == python_sums()
    with torch.no_grad():
        net[3].bias.add_(1)  # the last tensor edited in place
    assert reader.state()[:2] == python_sums() and reader.state()[0] == first[0] + 1
    net[1].running_mean.data = net[1].running_mean.data.clone()  # one buffer's .data replaced
    assert reader.state()[:2] == python_sums() and reader.state()[1] != first[1]
    kinds = reader.state()[2]
    net[0].weight.data = net[0].weight.data.double()
    assert reader.state()[2] != kinds


def test_two_tensors_that_swap_their_data_change_the_pointer_sum(native):
    a, b = torch.ones(4), torch.zeros(4)
    reader = native_watch.state_reader([a, b])
    before = reader.state()
    a.data, b.data = b.data, a.data  # a plain sum of pointers would not change
    assert reader.state()[1] != before[1]


def test_the_watch_notices_a_data_swap_at_the_next_call_with_the_native_reader(native):
    net = _net()
    watch = StateWatch(net)
    assert watch.reader is not None
    nn.Linear(3, 3)  # parameters registered elsewhere: checked, nothing changed here
    assert watch.changed() is None and watch.changed() is None
    net[3].bias.data = net[3].bias.data.clone()  # not the first tensor: the Python path samples such a swap
    assert "'3.bias' holds new data" in watch.changed()


def test_swapped_tensor_implementations_are_read_as_they_are_now(native):
    """torch.utils.swap_tensors (nn.Module._apply's path for wrapper subclasses, and for every parameter under
    torch.__future__.set_swap_module_params_on_conversion) replaces the implementation behind a tensor object: the
    reader unpacks it anew on every call, never through a pointer to the old, freed one."""
    net = _net()
    watch = StateWatch(net)
    torch.utils.swap_tensors(net[3].weight, nn.Parameter(torch.randn(4, 32)))
    assert "'3.weight' holds new data" in watch.changed()
    from torch.testing._internal.two_tensor import TwoTensor

    linear = nn.Linear(4, 4)
    linear.weight = nn.Parameter(TwoTensor(torch.randn(4, 4), torch.randn(4, 4)))
    subclassed = StateWatch(linear)
    linear.to(torch.float64)  # swaps the subclass weight's implementation, frees the old one
    for _ in range(3):
        assert "is now float64" in subclassed.changed()


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


def _fake_compiler(tmp_path, native) -> str:
    """A "compiler" that copies the session's built library to its ``-o`` target: the build path runs for real in
    seconds, and what it checks is a library that works."""
    script = tmp_path / "fake_cxx.py"
    script.write_text("import shutil, sys\n"
                      "args = sys.argv[1:]\n"
                      f"shutil.copy({native.__file__!r}, args[args.index('-o') + 1])\n")
    return f"{sys.executable} {script}"


def test_a_child_check_that_crashes_is_recorded_kept_and_not_retried(monkeypatch, tmp_path, native):
    monkeypatch.setattr(native_watch, "_STATE", {})  # (after the fixture's build: this process has not decided)
    monkeypatch.setenv(native_watch.DIR_VARIABLE, str(tmp_path / "native"))
    monkeypatch.setenv("CXX", _fake_compiler(tmp_path, native))
    monkeypatch.setattr(native_watch, "_CHECK", "import os; os.abort()")  # an extension that kills its importer
    status = native_watch.native_status()
    assert "its check in a child process failed (exit -6)" in status and "reads from Python" in status
    [verdict] = (tmp_path / "native").glob("*/verdict.json")
    assert json.loads(verdict.read_text())["ok"] is False
    assert not list((tmp_path / "native").glob("*/aitune_native_watch*"))  # the unchecked library is not kept
    calls = []
    monkeypatch.setattr(native_watch, "_run", lambda *args, **kwargs: calls.append(args))
    monkeypatch.setattr(native_watch, "_STATE", {})  # another process: the verdict is read, nothing runs again
    assert "exit -6" in native_watch.native_status() and calls == []
    assert StateWatch(_net()).reader is None


def test_a_working_build_is_kept_and_imported_by_later_processes(monkeypatch, tmp_path, native):
    monkeypatch.setattr(native_watch, "_STATE", {})  # (after the fixture's build: this process has not decided)
    monkeypatch.setenv(native_watch.DIR_VARIABLE, str(tmp_path / "native"))
    monkeypatch.setenv("CXX", _fake_compiler(tmp_path, native))
    assert native_watch.native_status(build=False).startswith("not built yet")
    assert not (tmp_path / "native").exists()  # asking did not build
    assert native_watch.native_status() == "in use (a served call's route, checks and weight watch in C)"
    [verdict] = (tmp_path / "native").glob("*/verdict.json")
    assert json.loads(verdict.read_text())["ok"] is True
    monkeypatch.setattr(native_watch, "_STATE", {})
    monkeypatch.setattr(native_watch, "_run", lambda *args, **kwargs: pytest.fail("rebuilt"))
    assert native_watch.native_status(build=False) == "in use (a served call's route, checks and weight watch in C)"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the native watch is built on Linux only")
def test_a_failed_build_and_an_unwritable_folder_never_take_the_caller_down(monkeypatch, fresh_state, tmp_path):
    monkeypatch.setenv(native_watch.DIR_VARIABLE, str(tmp_path / "native"))
    monkeypatch.setenv("CXX", "false")  # a "compiler" that fails every build
    status = native_watch.native_status()
    assert "the C++ build failed" in status and "the watch reads from Python" in status
    assert StateWatch(_net()).reader is None
    monkeypatch.setattr(native_watch, "_STATE", {})
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the folder would go")
    monkeypatch.setenv(native_watch.DIR_VARIABLE, str(blocked / "native"))
    assert "cannot write" in native_watch.native_status()
    monkeypatch.setattr(native_watch, "_STATE", {})
    monkeypatch.setattr(native_watch, "_load", lambda: 1 / 0)  # anything unexpected on the way
    assert "ZeroDivisionError" in native_watch.native_status() and StateWatch(_net()).reader is None


def test_inference_tensors_and_empty_lists_get_no_reader(native):
    with torch.inference_mode():
        inference = [torch.ones(2)]
    assert native_watch.state_reader(inference) is None  # no version counter to read
    assert native_watch.state_reader([]) is None
    with pytest.raises(TypeError, match="not a tensor"):
        native.StateReader([torch.ones(1), 3])


def test_the_reader_holds_its_tensors_until_it_is_dropped(native):
    import gc

    tensors = [torch.ones(3) for _ in range(4)]
    alive = [weakref.ref(tensor) for tensor in tensors]
    reader = native_watch.state_reader(tensors)
    del tensors
    gc.collect()
    assert all(ref() is not None for ref in alive) and reader.state()[0] == 0
    del reader
    gc.collect()
    assert all(ref() is None for ref in alive)  # and released with it


def test_the_watch_reads_no_version_per_tensor_from_python_when_native(monkeypatch, native):
    """The reason for the extension: with it, a served call does not read each tensor's version from Python."""
    net = _net()
    watch = StateWatch(net)
    reads = []
    monkeypatch.setattr(guard_module, "VERSION", lambda tensor: reads.append(tensor) or tensor._version)
    for _ in range(3):
        assert watch.changed() is None
    assert reads == []


def test_all_finite_answers_for_small_contiguous_cpu_floats_and_leaves_the_rest_to_torch(native):
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
                   torch.ones(2, dtype=torch.complex64), torch.ones(native_watch.ALL_FINITE_MAX_ELEMENTS + 1)):
        assert check(unread) is None, unread.shape
    with pytest.raises(TypeError, match="not a tensor"):
        native.all_finite([1.0])


def test_a_gate_for_a_graph_recorded_on_the_cpu_uses_the_native_check(native):
    from aitune.torch.backend.accepted import ValueGate
    from aitune.torch.record.samples import record_graphs

    module = nn.Linear(4, 2).eval()
    [graph] = record_graphs(module, [((torch.randn(3, 4),), {})])
    gate = ValueGate.for_graph(graph, quantizing=False)
    assert gate.native_finite is not None and gate.native_finite(torch.ones(2)) is True
    assert "nan/inf" in gate.rejects([torch.tensor([[1.0, float("nan"), 0.0, 0.0]])])


def test_a_storage_resized_in_place_is_noticed_at_the_next_call(native):
    """Every data pointer is read on every call: a storage resized in place (new memory, the same storage object, no
    version bump), which a CUDA-graph capture would still read at the old address, is noticed at once."""
    net = _net()
    watch = StateWatch(net)
    assert watch.reader is not None and watch.changed() is None
    net[1].running_var.untyped_storage().resize_(64 * 4)
    assert "'1.running_var' holds new data" in watch.changed()


@pytest.mark.parametrize("where", ["a submodule's __dict__", "a weight"])
def test_a_reader_in_a_reference_cycle_is_collected(native, where):
    """The readers take part in the garbage collector: a cycle through what they hold (a submodule's __dict__, held
    by the attribute reader; a weight, held by the weight watch's reader) back to them is freed once nothing else
    holds it."""
    import gc

    from aitune.torch.check.baked_state import BakedState

    net = _net()
    holder = type("Holder", (), {})()
    holder.watch, holder.baked = StateWatch(net), BakedState(net)
    assert holder.watch.reader is not None and holder.baked.attribute_reader is not None
    assert gc.is_tracked(holder.baked.attribute_reader.__self__) and gc.is_tracked(holder.watch.reader.__self__)
    owner = net[1] if where == "a submodule's __dict__" else net[0].weight  # (net[1]: a BatchNorm, `training` read)
    assert any(attributes is vars(net[1]) for attributes in holder.baked.fast_dicts)
    owner.owner = holder  # -> holder -> the readers -> that __dict__ / that weight
    alive = weakref.ref(net)
    del net, holder, owner
    gc.collect()
    assert alive() is None


def test_a_reader_that_fails_hands_the_watch_to_python(native):
    """Should the reader raise (a tensor swapped for one whose data pointer torch will not hand out; simulated here by
    a reader that raises), the watch drops it and reads from Python from then on, noticing what Python notices."""
    net = _net()
    watch = StateWatch(net)

    def failing():
        raise RuntimeError("storage cannot be read")

    watch.reader = failing
    assert watch.changed() is None and watch.reader is None
    with torch.no_grad():
        net[0].weight.add_(1)
    assert "'0.weight' was changed in place" in watch.changed()
