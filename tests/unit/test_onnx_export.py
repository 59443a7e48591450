"""export_onnx: real exports (dynamo and TorchScript exporters) run with ONNX Runtime's CPU provider."""

from __future__ import annotations


import numpy as np
import pytest
import torch
from torch import nn

from aitune.errors import CheckpointError, ConfigError
from aitune.torch.backend.onnx_call_io import OnnxCallIO
from aitune.torch.backend.onnx_export import export_onnx
from aitune.torch.backend.onnx_graph import specialized_axes
from aitune.torch.record.serialization import constant_from_json, constant_to_json
from aitune.torch.record.serialization import tree_spec_from_json as spec_from_json
from aitune.torch.record.serialization import tree_spec_to_json as spec_to_json
from aitune.torch.check.correctness import OutputComparator
from aitune.torch.record.pytree import tree_flatten
from aitune.torch.record.samples import BatchDim, record_graphs
from case_models import FlattenHead, MaskedPool, Pooled

onnx = pytest.importorskip("onnx")
onnxruntime = pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")


# ---------------------------------------------------------------------------------------------- models


class NumpySin(torch.autograd.Function):
    """A custom op with an ONNX symbolic whose forward leaves torch (so torch.export cannot trace it)."""

    @staticmethod
    def forward(ctx, x):
        return torch.from_numpy(np.sin(x.detach().cpu().numpy())).to(x)

    @staticmethod
    def symbolic(graph, x):
        return graph.op("Sin", x)


class CustomOpModule(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return NumpySin.apply(self.fc(x))


class ValueBranch(nn.Module):
    def forward(self, x):
        if x.sum() > 0:
            return x * 2
        return x - 1


def pool_inputs(batch, length, seed=0):
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randn(batch, length, 8, generator=generator)
    mask = (torch.rand(batch, length, generator=generator) > 0.3).float()
    return tokens, mask


def run_onnx(export, *tensors):
    """Run the exported file with ONNX Runtime (CPU) and rebuild eager's output structure."""
    session = onnxruntime.InferenceSession(str(export.path), providers=["CPUExecutionProvider"])
    feeds = {name: tensors[index].numpy() for name, index in zip(export.input_names, export.input_indices)}
    outputs = session.run(export.output_names, feeds)
    return export.flat_io.outputs([torch.from_numpy(o) for o in outputs])


def symbolic_dims(export) -> dict:
    model = onnx.load(str(export.path), load_external_data=False)
    return {value.name: [d.dim_param or d.dim_value for d in value.type.tensor_type.shape.dim]
            for value in model.graph.input}


@pytest.fixture(scope="module")
def pool_export(tmp_path_factory):
    torch.manual_seed(0)
    module = MaskedPool().eval()
    [graph] = record_graphs(module, [(pool_inputs(b, t, seed=b), {}) for b, t in ((2, 5), (4, 9))])
    export = export_onnx(module, graph, tmp_path_factory.mktemp("pool") / "model.onnx", device="cpu")
    return module, graph, export


# ---------------------------------------------------------------------------------------------- exports


def test_dynamo_export_keeps_dynamic_axes_and_runs_unseen_shapes(pool_export):
    module, graph, export = pool_export
    assert export.exporter == "dynamo" and export.notes == []
    assert export.input_names == ["input_tokens", "input_mask"] and export.input_indices == [0, 1]
    assert export.output_names == ["output_logits", "output_features"]
    assert export.dynamic_axes == {"input_tokens": {0: "batch", 1: "input_tokens_dim1"},
                                   "input_mask": {0: "batch", 1: "input_mask_dim1"}}
    assert not export.shape_specialized and export.specialized_axes == []
    dims = symbolic_dims(export)
    assert all(isinstance(d, str) for d in dims["input_tokens"][:2]) and dims["input_tokens"][2] == 8
    assert export.log_path.is_file() and "dynamo exporter" in export.log_path.read_text()
    onnx.checker.check_model(str(export.path))
    for batch, length in ((2, 5), (3, 7), (4, 9)):  # recorded, then unseen inside the range
        tokens, mask = pool_inputs(batch, length, seed=10 + batch)
        output = run_onnx(export, tokens, mask)
        assert type(output) is Pooled and output.temperature == 0.5
        with torch.no_grad():
            OutputComparator().compare(module(tokens, mask), output)


def test_c02_batch_one_sample_is_repeated_and_the_batch_stays_dynamic(tmp_path):
    torch.manual_seed(0)
    module = FlattenHead().eval()
    [graph] = record_graphs(module, [((torch.randn(1, 3, 16, 16),), {})],
                            dynamic_shapes={"x": (BatchDim("batch", min=1, max=32), 3, 16, 16)})
    export = export_onnx(module, graph, tmp_path / "model.onnx", device="cpu")
    assert export.example_shapes == [[2, 3, 16, 16]]
    assert any("repeated along axis 0 (1 -> 2)" in note for note in export.notes)
    assert not export.shape_specialized
    assert isinstance(symbolic_dims(export)["input_x"][0], str)
    for batch in (1, 2, 7, 32):
        x = torch.randn(batch, 3, 16, 16)
        with torch.no_grad():
            OutputComparator().compare(module(x), run_onnx(export, x))


def test_torchscript_exporter_marks_dynamic_axes(pool_export, tmp_path):
    module, graph, _ = pool_export
    export = export_onnx(module, graph, tmp_path / "model.onnx", use_dynamo=False, device="cpu")
    assert export.exporter == "torchscript"
    dims = symbolic_dims(export)
    assert dims["input_tokens"][:2] == ["batch", "input_tokens_dim1"] and dims["input_mask"][0] == "batch"
    tokens, mask = pool_inputs(3, 7, seed=3)
    with torch.no_grad():
        OutputComparator().compare(module(tokens, mask), run_onnx(export, tokens, mask))


def test_dynamo_failure_falls_back_to_torchscript_with_a_note(tmp_path):
    torch.manual_seed(0)
    module = CustomOpModule().eval()
    [graph] = record_graphs(module, [((torch.randn(b, 4),), {}) for b in (2, 3)])
    export = export_onnx(module, graph, tmp_path / "model.onnx", device="cpu")
    if export.exporter == "dynamo":  # a torch that can trace this op needs no fallback
        pytest.skip("the dynamo exporter handled the custom op")
    assert export.exporter == "torchscript"
    assert any(note.startswith("dynamo exporter failed (") and note.endswith("fell back to TorchScript exporter")
               for note in export.notes)
    assert "dynamo exporter failed:" in export.log_path.read_text()  # the traceback is kept
    x = torch.randn(7, 4)
    with torch.no_grad():
        OutputComparator().compare(module(x), run_onnx(export, x))


def test_traced_data_dependent_branch_is_refused(tmp_path):
    module = ValueBranch().eval()
    [graph] = record_graphs(module, [((torch.ones(b, 4),), {}) for b in (2, 3)])
    with pytest.raises(RuntimeError, match="data-dependent branch"):
        export_onnx(module, graph, tmp_path / "model.onnx", use_dynamo=False, device="cpu")


def test_training_mode_is_refused_and_flags_are_kept(tmp_path):
    module = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5))
    module.eval()
    module[1].train()  # one submodule left in training mode
    [graph] = record_graphs(module, [((torch.randn(2, 4),), {})])
    with pytest.raises(ConfigError, match=r"training mode \(1\).*call \.eval\(\)"):
        export_onnx(module, graph, tmp_path / "model.onnx", device="cpu")
    assert [m.training for m in module.modules()] == [False, False, True]
    assert not (tmp_path / "model.onnx").exists()


# ---------------------------------------------------------------------------------------------- checks


def test_specialized_axes_finds_fixed_sizes_on_declared_dynamic_axes():
    from onnx import TensorProto, helper

    inputs = [helper.make_tensor_value_info("input_x", TensorProto.FLOAT, [8, "seq", 64]),
              helper.make_tensor_value_info("input_y", TensorProto.FLOAT, ["batch", 3])]
    output = helper.make_tensor_value_info("output", TensorProto.FLOAT, None)
    model = helper.make_model(helper.make_graph([helper.make_node("Identity", ["input_x"], ["output"])], "g",
                                                inputs, [output]))
    declared = {"input_x": {0: "batch", 1: "seq"}, "input_y": {0: "batch", 1: "n"}, "dropped": {0: "batch"}}
    assert specialized_axes(model, declared) == ["input_x[0]=8", "input_y[1]=3"]
    assert specialized_axes(model, {"input_x": {1: "seq"}}) == []


def test_call_io_json_round_trip_rebuilds_structure_without_the_graph(pool_export):
    module, graph, export = pool_export
    call_io = OnnxCallIO.from_export(export, graph, module)
    data = call_io.to_json()
    restored = OnnxCallIO.from_json(data)  # no graph: types are imported by name
    assert restored.output_spec == call_io.output_spec and restored.output_spec.node_type is Pooled
    assert restored.input_dtypes == [torch.float32, torch.float32]
    tokens, mask = pool_inputs(3, 6)
    leaves = restored.leaves_of((tokens,), {"mask": mask})  # normalised with the stored signature
    assert restored.check(leaves) is None
    assert restored.check(restored.leaves_of((tokens[:, :2],), {"mask": mask[:, :2]})).startswith("input")
    assert "outside" in restored.check(restored.leaves_of(pool_inputs(5, 6), {}))
    output = restored.outputs([torch.zeros(3, 4), torch.zeros(3, 6, 16)])
    assert type(output) is Pooled and output.temperature == 0.5
    with pytest.raises(ValueError, match="signature"):
        restored.leaves_of((tokens, mask, mask), {})
    with pytest.raises(ValueError, match="structure"):
        restored.leaves_of(((tokens,),), {"mask": mask})  # nested where a tensor was recorded



class ForwardsAnything(nn.Module):
    """A wrapper whose forward takes ``*args, **kwargs`` (as the kernel selector's PlannedModule does)."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, *args, **kwargs):
        return self.inner(*args, **kwargs)


def test_call_io_stores_the_recorded_forward_signature_not_a_wrappers(pool_export):
    """Found by the contract suite (kernel selector + ONNX Runtime delegate, loaded without the graph): the
    samples were recorded, so normalised, against MaskedPool.forward; an export of a ``*args, **kwargs``
    wrapper stored the wrapper's signature and a loaded graph refused positional calls."""
    module, graph, export = pool_export
    restored = OnnxCallIO.from_json(OnnxCallIO.from_export(export, graph, ForwardsAnything(module)).to_json())
    tokens, mask = pool_inputs(3, 6)
    for args, kwargs in (((tokens, mask), {}), ((tokens,), {"mask": mask}), ((), {"mask": mask, "tokens": tokens})):
        leaves = restored.leaves_of(args, kwargs)
        assert leaves[0] is tokens and leaves[1] is mask


def test_spec_and_constant_json_helpers():
    value = (Pooled(torch.zeros(1), torch.zeros(1), 0.1), {"a": [torch.zeros(1), None]})
    _, spec = tree_flatten(value)
    assert spec_from_json(spec_to_json(spec)) == spec
    bad = spec_to_json(spec)
    module_name = bad["children"][0]["type"].partition(":")[0]
    bad["children"][0]["type"] = f"{module_name}:MaskedPool"  # a module, not a dataclass
    with pytest.raises(CheckpointError, match="not a dataclass"):
        spec_from_json(bad)
    for constant in (None, True, 3, 0.25, float("nan"), "s", torch.float16, torch.device("cpu")):
        restored = constant_from_json(constant_to_json(constant, "a test constant"))
        assert restored == constant or (restored != restored and constant != constant)
    with pytest.raises(CheckpointError):
        constant_to_json(object(), "a test constant")
