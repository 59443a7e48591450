"""Torch-TensorRT backends: the parts that run without torch_tensorrt (export with explicit Dims, settings).

torch_tensorrt cannot be installed on this project's machines: its compile/save/load steps are skipped
with that reason. The ``torch.export`` step feeding it is plain PyTorch and runs here for real.
"""

import importlib.util

import pytest
import torch

from aitune.torch.backend import TorchTensorRTAotBackend, TorchTensorRTJitBackend
from aitune.torch.backend.torch_tensorrt import (
    export_dynamic_shapes,
    export_flat_module,
    settings_from_json,
    settings_to_json,
)
from aitune.torch.backend import TorchTensorRTConfig
from aitune.torch.check.correctness import OutputComparator
from aitune.torch.record.samples import record_graphs

HAS_TORCH_TENSORRT = importlib.util.find_spec("torch_tensorrt") is not None
NEEDS_TORCH_TENSORRT = pytest.mark.skipif(
    not HAS_TORCH_TENSORRT, reason="needs torch_tensorrt (package 'torch-tensorrt' not found — pip install "
                                   "'aitune[torch-tensorrt]' on a machine with CUDA); this project's CI has none, "
                                   "so it never runs there")


class Encoder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(50, 16)
        self.proj = torch.nn.Linear(16, 8)

    def forward(self, ids, mask):
        hidden = self.proj(self.embed(ids)) * mask.unsqueeze(-1)
        return {"hidden": hidden, "pooled": hidden.sum(1)}


class _Pair(torch.nn.Module):
    def forward(self, a, b):
        return a.sum(0) + b.sum(0)


def encoder_graph():
    module = Encoder().eval()
    calls = [((torch.randint(0, 50, (b, s)), torch.ones(b, s)), {}) for b, s in ((1, 5), (4, 12), (2, 7))]
    return module, record_graphs(module, calls)[0]


def test_export_dynamic_shapes_share_dims_of_axes_that_were_always_equal():
    module, graph = encoder_graph()
    dynamic_shapes, inputs = export_dynamic_shapes(graph)
    ids_axes, mask_axes = dynamic_shapes["tensors"]
    assert ids_axes[0] is mask_axes[0] and ids_axes[0].__name__ == "batch"  # one shared batch Dim
    assert (ids_axes[0].min, ids_axes[0].max) == (1, 4)
    assert ids_axes[1] is mask_axes[1]  # sequence lengths were equal in every sample: one Dim
    assert ids_axes[1].__name__ == "input_ids_dim1" and (ids_axes[1].min, ids_axes[1].max) == (5, 12)
    calls = [((torch.randn(2, 3), torch.randn(4, 3)), {}), ((torch.randn(5, 3), torch.randn(1, 3)), {})]
    independent = record_graphs(_Pair(), calls)[0]
    first, second = export_dynamic_shapes(independent)[0]["tensors"]
    assert first[0] is not second[0]  # sizes differed between samples: independent Dims
    assert inputs == [{"name": "input_ids", "min": [1, 5], "opt": [4, 12], "max": [4, 12], "dtype": "int64"},
                      {"name": "input_mask", "min": [1, 5], "opt": [4, 12], "max": [4, 12], "dtype": "float32"}]
    static = record_graphs(torch.nn.Linear(3, 2), [((torch.randn(2, 3),), {})])[0]
    assert export_dynamic_shapes(static)[0] is None


def test_export_flat_module_runs_other_shapes_in_range_and_matches_eager():
    module, graph = encoder_graph()
    exported, flat_io, example, inputs = export_flat_module(module, graph, torch.device("cpu"))
    assert all(t.shape[0] >= 2 for t in example)  # exported at batch >= 2 (no 0/1 specialisation)
    program = exported.module()
    comparator = OutputComparator()
    for batch, length in ((1, 5), (3, 9), (4, 12)):
        ids, mask = torch.randint(0, 50, (batch, length)), torch.ones(batch, length)
        with torch.no_grad():
            candidate = flat_io.outputs(list(program(ids, mask)))
            comparator.compare(module(ids, mask), candidate)
    ranges = {str(symbol): (int(r.lower), int(r.upper)) for symbol, r in exported.range_constraints.items()}
    assert sorted(ranges.values()) == [(1, 4), (5, 12)]


def test_settings_travel_to_the_child_as_json():
    import json

    settings = TorchTensorRTConfig(enabled_precisions={torch.float16, torch.float32}, use_explicit_typing=False,
                                   torch_executed_ops=["torch.ops.aten.add.Tensor"]).settings()
    encoded = json.loads(json.dumps(settings_to_json(settings)))
    assert encoded["enabled_precisions"] == ["float16", "float32"]
    assert settings_from_json(encoded) == settings


def test_torch_tensorrt_backends_refuse_cpu_and_need_the_package():
    for klass in (TorchTensorRTJitBackend, TorchTensorRTAotBackend):
        check = klass().supports(torch.nn.Linear(2, 2), None, torch.device("cpu"))
        assert not check.ok
        if not HAS_TORCH_TENSORRT:
            assert check.reason == "package 'torch-tensorrt' not found — pip install 'aitune[torch-tensorrt]'"


@NEEDS_TORCH_TENSORRT
@pytest.mark.gpu
def test_torch_tensorrt_aot_builds_saves_and_matches_eager(tmp_path):  # pragma: no cover - never runs here
    module = Encoder().cuda().eval()
    calls = [((torch.randint(0, 50, (b, 8), device="cuda"), torch.ones(b, 8, device="cuda")), {}) for b in (1, 4)]
    graph = record_graphs(module, calls)[0]
    backend = TorchTensorRTAotBackend().build(module, graph, "cuda", tmp_path / "build")
    ids, mask = calls[1][0]
    comparator = OutputComparator()
    with torch.no_grad():
        comparator.compare(module(ids, mask), backend(ids, mask))
    metadata = backend.save(tmp_path / "saved")
    loaded = TorchTensorRTAotBackend.from_checkpoint(tmp_path / "saved", backend.config, metadata, None, graph, "cuda")
    with torch.no_grad():
        comparator.compare(module(ids, mask), loaded(ids, mask))


@NEEDS_TORCH_TENSORRT
@pytest.mark.gpu
def test_torch_tensorrt_jit_builds_and_matches_eager(tmp_path):  # pragma: no cover - never runs here
    module = Encoder().cuda().eval()
    calls = [((torch.randint(0, 50, (b, 8), device="cuda"), torch.ones(b, 8, device="cuda")), {}) for b in (1, 4)]
    graph = record_graphs(module, calls)[0]
    backend = TorchTensorRTJitBackend().build(module, graph, "cuda", tmp_path)
    ids, mask = calls[1][0]
    with torch.no_grad():
        OutputComparator().compare(module(ids, mask), backend(ids, mask))
