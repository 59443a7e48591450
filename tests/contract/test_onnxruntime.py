"""ONNXRuntimeBackend on small real models: ONNX export + ONNX Runtime's CPU execution provider, never mocked.

Builds are shared through module-scoped fixtures (each dynamo export takes a second or two here).
Cases: SplitHeads, a dataclass output, a keyword-only forward with **extra, training mode refused, the
CUDA EP requested on a CPU-only onnxruntime, what a checkpoint holds, the
IOBinding path. The generic checks (outputs match eager on samples and unseen shapes, the module unchanged,
deactivate/reactivate, save -> load in a fresh process with and without graph) run in
test_backend_contract.py.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from aitune.errors import BackendBuildError, BackendRuntimeError, ConfigError
from aitune.torch.backend import (
    BackendConfig,
    BackendState,
    BuildMode,
    ONNXExecutionProvider,
    ONNXRuntimeBackend,
    ONNXRuntimeBackendConfig,
)
from aitune.torch.check.correctness import OutputComparator
from aitune.torch.record.pytree import tree_flatten
from aitune.torch.record.samples import record_graphs
from case_models import Detector, HeadOut, Ranker, SplitHeads


pytestmark = pytest.mark.skipif(not ONNXRuntimeBackend.availability().ok,
                                reason=ONNXRuntimeBackend.availability().reason)


# ---------------------------------------------------------------------------------------------- models


def canonical_leaves(module, args=(), kwargs=None) -> list:
    """The flattened canonical input leaves aitune.Module hands to Backend.accepts."""
    from aitune.torch.record.samples import CallSignature

    args, kwargs = CallSignature(module.forward).normalize(tuple(args), dict(kwargs or {}))
    return tree_flatten((args, kwargs))[0]


def routed(module, backend, *args, **kwargs):
    """Call like aitune.Module does: the backend if it accepts the call, else eager."""
    if backend.accepts(canonical_leaves(module, args, kwargs)):
        return backend(*args, **kwargs), True
    with torch.no_grad():
        return module(*args, **kwargs), False


def assert_matches_eager(module, output, *args, **kwargs):
    cloned_args = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    cloned_kwargs = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    with torch.no_grad():
        expected = module(*cloned_args, **cloned_kwargs)
    OutputComparator().compare(expected, output)
    return expected


def build(module, calls, tmp_path_factory, name, **config):
    [graph] = record_graphs(module, calls)
    backend = ONNXRuntimeBackend(ONNXRuntimeBackendConfig(**config))
    assert backend.supports(module, graph, "cpu").ok
    backend.build(module, graph, "cpu", tmp_path_factory.mktemp(name))
    return graph, backend


# ---------------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def mlp_build(tmp_path_factory):
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8)).eval()
    calls = [((torch.randn(batch, 16),), {}) for batch in (2, 5, 9)]
    graph, backend = build(module, calls, tmp_path_factory, "mlp")
    return module, graph, backend


@pytest.fixture(scope="module")
def detector_build(tmp_path_factory):
    torch.manual_seed(0)
    module = Detector().eval()
    calls = [((torch.randn(batch, 32),), {}) for batch in (2, 6)]
    graph, backend = build(module, calls, tmp_path_factory, "detector")
    return module, graph, backend


# ---------------------------------------------------------------------------------------------- config


def test_config_defaults_coercion_and_validation():
    config = ONNXRuntimeBackendConfig()
    assert config.use_dynamo is True and config.execution_provider is None
    assert config.resolved_provider("cpu") is ONNXExecutionProvider.CPU
    assert config.resolved_provider("cuda") is ONNXExecutionProvider.CUDA
    assert ONNXRuntimeBackendConfig(execution_provider="cuda").execution_provider is ONNXExecutionProvider.CUDA
    assert ONNXRuntimeBackendConfig(execution_provider="TensorrtExecutionProvider").execution_provider \
        is ONNXExecutionProvider.TENSORRT
    assert isinstance(ONNXExecutionProvider.CUDA, str) and ONNXExecutionProvider.CUDA == "cuda"
    for bad in (dict(execution_provider="rocm"), dict(graph_optimization_level="max"),
                dict(intra_op_num_threads=0), dict(opset_version="17"), dict(use_dynamo="yes")):
        with pytest.raises(ConfigError):
            ONNXRuntimeBackendConfig(**bad)
    config = ONNXRuntimeBackendConfig(execution_provider="tensorrt", opset_version=18, intra_op_num_threads=2)
    restored = BackendConfig.from_dict(json.loads(json.dumps(config.to_dict())))
    assert restored == config and restored.key() == config.key()
    assert "execution_provider=tensorrt" in config.describe()
    assert ONNXRuntimeBackend.build_mode is BuildMode.AOT and ONNXRuntimeBackend.name == "onnxruntime"


# ---------------------------------------------------------------------------------------------- values


def test_build_info_and_calls_outside_the_recorded_range(mlp_build):
    module, graph, backend = mlp_build
    assert backend.state is BackendState.ACTIVE
    assert backend.build_info["exporter"] == "dynamo" and backend.build_info["providers"][0] == "CPUExecutionProvider"
    assert backend.build_info["shape_specialized"] is False
    output = backend(torch.randn(7, 16))
    assert output.dtype == torch.float32 and output.device.type == "cpu"
    assert not backend.accepts(canonical_leaves(module, (torch.randn(10, 16),)))   # beyond the recorded max
    assert not backend.accepts(canonical_leaves(module, (torch.randn(4, 15),)))    # static axis differs
    assert not backend.accepts(canonical_leaves(module, (torch.randn(4, 16).double(),)))
    with pytest.raises(BackendRuntimeError, match="outside"):
        backend(torch.randn(10, 16))


def test_outputs_stay_valid_after_later_calls_and_inputs_are_untouched(mlp_build):
    module, _, backend = mlp_build
    x1, x2 = torch.randn(4, 16), torch.randn(4, 16)
    x1_copy = x1.clone()
    first = backend(x1)
    first_copy = first.clone()
    for _ in range(3):
        backend(x2)
    torch.testing.assert_close(first, first_copy, rtol=0, atol=0)
    torch.testing.assert_close(x1, x1_copy, rtol=0, atol=0)
    non_contiguous = torch.randn(16, 4).t()  # [4, 16] with strides (1, 4)
    assert_matches_eager(module, backend(non_contiguous), non_contiguous)


def test_deactivate_releases_the_session(mlp_build):
    _, _, backend = mlp_build
    backend.deactivate()
    assert backend.state is BackendState.INACTIVE and backend._session is None
    backend(torch.randn(5, 16))  # infer() reactivates
    assert backend.state is BackendState.ACTIVE and backend._session is not None


# -------------------------------------------------------------------- Python-int sizes (SplitHeads)


@pytest.mark.parametrize("recorded", [[(8, 20)], [(2, 12), (8, 40)]], ids=["one-sample", "range"])
def test_c03_split_heads_probes_match_eager(recorded, tmp_path_factory):
    torch.manual_seed(0)
    module = SplitHeads().eval()
    graph, backend = build(module, [((torch.randn(b, t, 64),), {}) for b, t in recorded], tmp_path_factory, "c03")
    for shape in ((3, 20, 64), (8, 33, 64)):
        x = torch.randn(*shape)
        output, used_backend = routed(module, backend, x)
        assert_matches_eager(module, output, x)
        if len(recorded) == 1:
            assert not used_backend  # outside the one recorded shape: eager
    for b, t in recorded:  # the recorded shapes run on ONNX Runtime and match
        x = torch.randn(b, t, 64)
        output, used_backend = routed(module, backend, x)
        assert used_backend
        assert_matches_eager(module, output, x)


def test_c03_torchscript_export_specialized_at_runtime_is_restricted(tmp_path_factory):
    """The TorchScript tracer bakes int(x.shape[...]) into Reshape constants while the graph inputs stay
    symbolic: the build must notice it at the other recorded shape and accept only the shapes that ran."""
    torch.manual_seed(0)
    module = SplitHeads().eval()
    calls = [((torch.randn(b, t, 64),), {}) for b, t in ((2, 12), (8, 40))]
    graph, backend = build(module, calls, tmp_path_factory, "c03ts", use_dynamo=False)
    assert backend.build_info["exporter"] == "torchscript"
    validated = backend.build_info["validated_shapes"]
    if len(validated) < len(graph.samples):  # only if the tracer still bakes the sizes
        assert backend.build_info["shape_specialized"] is True
        assert any("shape-specialized" in note for note in backend.build_info["export_notes"])
    for shape in ((2, 12, 64), (8, 40, 64), (3, 20, 64), (8, 33, 64)):
        x = torch.randn(*shape)
        output, used_backend = routed(module, backend, x)
        assert_matches_eager(module, output, x)
        if used_backend:
            assert [list(shape)] in validated or not backend.build_info["shape_specialized"]


# ------------------------------------------------------------------------------------ dataclass output


def test_c04_dataclass_output_reproduced(detector_build):
    module, graph, backend = detector_build
    for batch in (2, 4, 6):
        x = torch.randn(batch, 32)
        output = backend(x)
        assert type(output) is HeadOut
        assert set(output.extra) == {"logits", "stats"}
        assert isinstance(output.extra["stats"], tuple) and len(output.extra["stats"]) == 2
        assert_matches_eager(module, output, x)


# ------------------------------------------------------------------- keyword-only forward and **extra


def test_c05_keyword_only_forward_and_extra_kwargs(tmp_path_factory):
    torch.manual_seed(0)
    module = Ranker().eval()

    def ids_mask(batch, length):
        return torch.randint(0, 1000, (batch, length)), torch.ones(batch, length, dtype=torch.long)

    calls = [((), dict(input_ids=ids, attention_mask=mask)) for ids, mask in (ids_mask(2, 12), ids_mask(4, 7))]
    _, backend = build(module, calls, tmp_path_factory, "c05")
    ids, mask = ids_mask(3, 10)
    mask[:, 6:] = 0
    output = backend(input_ids=ids, attention_mask=mask)
    assert_matches_eager(module, output, input_ids=ids, attention_mask=mask)
    # the same call with the keywords in another order
    OutputComparator().compare(output, backend(attention_mask=mask, input_ids=ids))

    # A call with an extra keyword is another graph: this backend must not take it (never ignore `bias`).
    bias = torch.randn(32)
    assert not backend.accepts(canonical_leaves(module, (), dict(input_ids=ids, attention_mask=mask, bias=bias)))
    with pytest.raises(BackendRuntimeError):
        backend(input_ids=ids, attention_mask=mask, bias=bias)
    assert not backend.accepts(canonical_leaves(module, (), dict(input_ids=ids)))  # mask missing

    # ... and its own build matches eager, and differs from the call without bias exactly as eager does.
    with_bias = [((), dict(input_ids=i, attention_mask=m, bias=torch.randn(32)))
                 for i, m in (ids_mask(2, 12), ids_mask(4, 7))]
    _, bias_backend = build(module, with_bias, tmp_path_factory, "c05bias")
    biased = bias_backend(input_ids=ids, attention_mask=mask, bias=bias)
    assert_matches_eager(module, biased, input_ids=ids, attention_mask=mask, bias=bias)
    assert not torch.allclose(biased, output)


# ---------------------------------------------------------------------------------------------- refusals


def test_training_mode_module_is_refused_and_left_as_is(tmp_path):
    module = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.ReLU())
    module.train()
    [graph] = record_graphs(module, [((torch.randn(4, 8),), {})])
    state = {k: v.clone() for k, v in module.state_dict().items()}
    backend = ONNXRuntimeBackend()
    check = backend.supports(module, graph, "cpu")
    assert not check.ok and "module is in training mode" in check.reason and ".eval()" in check.reason
    with pytest.raises(BackendBuildError, match="training mode"):
        backend.build(module, graph, "cpu", tmp_path)
    assert module.training and all(m.training for m in module.modules())
    for key, value in module.state_dict().items():
        torch.testing.assert_close(value, state[key], rtol=0, atol=0)


def test_c28_requested_cuda_ep_not_active_fails_the_build(tmp_path):
    import onnxruntime

    if "CUDAExecutionProvider" in onnxruntime.get_available_providers():
        pytest.skip("this onnxruntime has the CUDA EP; sub-check A needs a CPU-only onnxruntime")
    module = nn.Sequential(nn.Linear(8, 4)).eval()
    [graph] = record_graphs(module, [((torch.randn(3, 8),), {})])
    backend = ONNXRuntimeBackend(ONNXRuntimeBackendConfig(execution_provider="cuda", use_dynamo=False))
    check = backend.supports(module, graph, "cuda")
    assert not check.ok and "CUDA EP" in check.reason
    with pytest.raises(BackendBuildError, match="requested CUDA EP not active; session on CPU") as info:
        backend.build(module, graph, "cpu", tmp_path)
    assert info.value.log_path == tmp_path / "build.log"
    assert backend.state is BackendState.INIT


# ---------------------------------------------------------------------------------------------- checkpoints


def test_save_writes_the_model_and_its_external_data(detector_build, tmp_path):
    _, _, backend = detector_build
    metadata = backend.save(tmp_path)
    saved_files = sorted(p.name for p in tmp_path.iterdir())
    assert saved_files[0] == "model.onnx" and set(saved_files[1:]) == set(metadata["external_data_files"])


class WithConstants(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return {"y": self.fc(x), "cache": None, "scale": 3, "ids": x.argmax(-1)}


def test_none_and_constant_output_leaves_survive_build_and_checkpoint(tmp_path_factory, tmp_path):
    torch.manual_seed(0)
    module = WithConstants().eval()
    graph, backend = build(module, [((torch.randn(b, 4),), {}) for b in (2, 3)], tmp_path_factory, "consts")
    x = torch.randn(3, 4)
    assert_matches_eager(module, backend(x), x)
    metadata = json.loads(json.dumps(backend.save(tmp_path)))
    loaded = ONNXRuntimeBackend.from_checkpoint(tmp_path, backend.config, metadata, None, None, "cpu")
    output = loaded(x)
    assert output["cache"] is None and output["scale"] == 3 and output["ids"].dtype == torch.int64
    assert_matches_eager(module, output, x)


def test_load_in_process_with_graph(detector_build, tmp_path):
    module, graph, backend = detector_build
    metadata = json.loads(json.dumps(backend.save(tmp_path)))
    loaded = ONNXRuntimeBackend.from_checkpoint(tmp_path, backend.config, metadata, None, graph, "cpu")
    assert loaded._io.output_spec == graph.output_spec  # the recorded structure is reused, nothing imported
    x = torch.randn(5, 32)
    output = loaded(x)
    assert type(output) is HeadOut
    assert_matches_eager(module, output, x)


def test_io_binding_path_runs_on_cpu(detector_build, tmp_path):
    """The CUDA inference path (IOBinding: inputs bound by pointer, outputs allocated by ONNX Runtime),
    executed on the CPU device so its binding and conversion code runs here."""
    module, graph, backend = detector_build
    loaded = ONNXRuntimeBackend.from_checkpoint(tmp_path, backend.config, backend.save(tmp_path), None, graph, "cpu")
    loaded._use_io_binding = True
    first_input = torch.randn(32, 5).t()  # [5, 32], non-contiguous
    first = loaded(first_input)
    assert_matches_eager(module, first, first_input)
    kept = first.extra["logits"].clone()
    for batch in (2, 6):
        x = torch.randn(batch, 32)
        assert_matches_eager(module, loaded(x), x)
    torch.testing.assert_close(first.extra["logits"], kept, rtol=0, atol=0)  # not overwritten by later runs
