"""The public accessors through which tune() and ait.save/ait.load read and set a wrapper's tuned state."""

from __future__ import annotations

import copy
import gc
import pickle
import weakref

import pytest
import torch
from torch import nn

import aitune.torch as ait
from aitune.errors import BackendRuntimeError
from aitune.torch.backend import TorchEagerBackend, TorchInductorJitBackend
from aitune.torch.checkpoint import ExtractedFiles
from aitune.torch.measure.profiling import ProfilingConfig

FAST = ProfilingConfig(warmup_rounds=1, min_rounds=3, max_rounds=10, time_budget_s=0.1)


def test_tuned_state_through_accessors(tmp_path):
    module = ait.Module(nn.Linear(4, 2), "linear", max_samples=3,
                        strategy=ait.OneBackendStrategy(TorchEagerBackend(), profiling_config=FAST))
    assert module.max_samples == 3 and module.tuned_graphs() == [] and module.tune_rows == {}
    ait.tune(module, [torch.randn(2, 4), torch.randn(3, 4), torch.randn(2, 3, 4)], cache_dir_path=tmp_path, ready_batches=True)
    tuned = module.tuned_graphs()
    assert [graph.name for graph, _ in tuned] == ["graph0", "graph1"]
    assert all(backend.name == "eager" for _, backend in tuned)
    assert set(module.tune_rows) == {"graph0", "graph1"} and module.tune_rows["graph0"]["status"] == "selected"

    module.install_tuned(tuned[:1], tune_rows={"graph0": {"status": "selected"}}, eager_fallback_error="no eager")
    assert module.state is ait.ModuleState.TUNED and [graph.name for graph in module.graphs] == ["graph0"]
    assert module.tune_rows == {"graph0": {"status": "selected"}}
    with pytest.raises(BackendRuntimeError, match="no eager"):
        module(torch.randn(2, 3, 4))  # graph1 is no longer tuned: it would run eager, which is refused

    module.mark_failed("ValueError: broken")
    assert module.state is ait.ModuleState.PASSTHROUGH and module.tuning_error == "ValueError: broken"
    assert module.tuned_graphs() == []


def test_extracted_files_live_while_a_user_does(tmp_path):
    root = tmp_path / "extracted"
    root.mkdir()
    (root / "model.onnx").write_bytes(b"artifact")

    class Backend:
        pass

    files, user = ExtractedFiles(root), Backend()
    files.keep_alive_while(user)
    user_ref = weakref.ref(user)
    del files
    gc.collect()
    assert (root / "model.onnx").exists()  # the user still needs them
    del user
    gc.collect()
    assert user_ref() is None and not root.exists()


def test_copies_and_pickles_of_a_wrapped_module_are_the_wrapped_module_untuned():
    # wrapt's proxy refused them (NotImplementedError: object proxy must define __deepcopy__()), so a model holding
    # an ait.Module could not be copied: no eager twin, no float32 copy for correctness rule 5
    import copy
    import pickle

    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU()).eval()
    model[0] = ait.Module(model[0], "linear")
    x = torch.randn(2, 4)
    for twin in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert type(twin[0]) is nn.Linear and twin[0].weight.data_ptr() != model[0].weight.data_ptr()
        with torch.no_grad():
            torch.testing.assert_close(twin(x), model(x), rtol=0, atol=0)
    shallow = copy.copy(model[0])
    assert type(shallow) is nn.Linear and shallow.weight is model[0].weight


def test_a_wrapped_module_that_does_not_answer_for_its_wrapper_is_not_copied():
    # after ait.load into a module without weights, or with other weights than the answering checkpoint, the
    # wrapped module is not the model that answers: a copy of it would silently be another model
    import copy
    import pickle

    wrapped = ait.Module(nn.Linear(4, 3).eval(), "linear")
    wrapped._set_tuned([], eager_fallback_error="its weights are on 'meta'")  # what ait.load sets in those cases
    for make_copy in (copy.deepcopy, copy.copy, pickle.dumps):
        with pytest.raises(TypeError, match="its weights are on 'meta'"):
            make_copy(wrapped)


class Driven(nn.Module):
    """A module driven by methods of its own that call it (as transformers' ``generate`` does)."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.name = "the module's own name"  # the wrapper has a ``name`` too: the methods must read this one
        self.steps = 0

    def forward(self, x):
        return self.linear(x)

    def loop(self, x, steps):
        for _ in range(steps):
            x = self.step(x)
        return x

    def step(self, x):
        self.steps += 1  # an assignment in a method reaches the module
        return torch.tanh(self.__call__(x) if self.steps % 2 else self(x))

    def looked_up_on_the_type(self, x):
        return getattr(type(self), "step")(self, x)

    def own_name(self):
        return self.name

    def copied(self):
        return copy.deepcopy(self)


def test_methods_of_the_wrapped_modules_class_call_the_wrapper_when_they_call_the_module(tmp_path):
    """NOTE [own calls] (aitune/torch/common/own_calls.py): a whole model wrapped and driven by a method of its own
    is recorded and served; the method sees the module's attributes, not the wrapper's."""
    torch.manual_seed(0)
    module = Driven().eval()
    eager = Driven().eval()
    eager.load_state_dict(module.state_dict())
    wrapped = ait.Module(module, "driven", strategy=ait.OneBackendStrategy(TorchInductorJitBackend(),
                                                                           profiling_config=FAST)
                            .enable_performance_validation(False))
    x = torch.randn(2, 4)
    with torch.no_grad():
        ait.tune(lambda v: wrapped.loop(v, 3), [x], cache_dir_path=tmp_path, ready_batches=True)
        assert [graph.num_calls for graph in wrapped.graphs] == [3]  # both call forms of step were recorded
        assert wrapped.own_name() == "the module's own name"
        calls, steps = wrapped.backend_calls, module.steps
        assert torch.allclose(wrapped.loop(x, 4), eager.loop(x, 4), atol=1e-6)
        assert module.steps == steps + 4
        assert wrapped.looked_up_on_the_type(x).shape == (2, 4)
        assert wrapped.backend_calls - calls == 5
        module.loop(x, 2)  # the module itself, not reached through the wrapper, runs eagerly
        wrapped.forward(x)  # torch.nn.Module's own names are the module's (forward runs eagerly)
        assert wrapped.backend_calls - calls == 5
    assert isinstance(wrapped.loop.__self__, Driven) and wrapped.loop.__self__.__dict__ is module.__dict__
    assert wrapped.state_dict.__self__ is module and wrapped.to("cpu") is module  # nn.Module's API: unchanged
    assert vars(module).keys() == vars(eager).keys()  # nothing of aitune's was stored in the module
    copied = wrapped.copied()  # a copy an own method makes is a plain module of the module's class
    assert type(copied) is Driven and type(pickle.loads(pickle.dumps(wrapped.loop.__self__))) is Driven
    with torch.no_grad():
        copied.linear.weight.zero_()
        calls = wrapped.backend_calls
        assert torch.equal(copied(x), copied.linear.bias.expand(2, 4)) and wrapped.backend_calls == calls


class Keyed(nn.Module):
    def __init_subclass__(cls, key, **kwargs):  # refuses subclasses without a key
        super().__init_subclass__(**kwargs)

    def forward(self, x):
        return x + 1

    def twice(self, x):
        return self(self(x))


def test_a_class_that_refuses_subclasses_keeps_its_methods_bound_to_the_module():
    wrapped = ait.Module(Keyed.__new__(Keyed), "keyed")
    nn.Module.__init__(wrapped.__wrapped__)
    assert wrapped.twice.__self__ is wrapped.__wrapped__  # eager, as before: no error on reading it
    assert torch.equal(wrapped.twice(torch.zeros(1)), torch.full((1,), 2.0))


class EqualMeta(type(nn.Module)):
    def __eq__(cls, other):  # (and so no __hash__: its classes are unhashable, which torch does not mind)
        return cls is other


class Unhashable(nn.Module, metaclass=EqualMeta):
    def forward(self, x):
        return x * 3

    def twice(self, x):
        return self(self(x))


def test_a_module_class_that_is_unhashable_is_viewed_too(tmp_path):
    wrapped = ait.Module(Unhashable(), "unhashable", strategy=ait.OneBackendStrategy(TorchEagerBackend(),
                                                                                       profiling_config=FAST))
    ait.tune(lambda v: wrapped.twice(v), [torch.ones(2)], cache_dir_path=tmp_path, ready_batches=True)
    assert [graph.num_calls for graph in wrapped.graphs] == [2]
    assert torch.equal(wrapped.twice(torch.ones(2)), torch.full((2,), 9.0))
