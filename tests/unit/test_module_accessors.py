"""The public accessors through which tune() and ait.save/ait.load read and set a wrapper's tuned state."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn

import aitune.torch as ait
from aitune.errors import BackendRuntimeError
from aitune.torch.backend import TorchEagerBackend
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
