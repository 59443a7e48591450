"""ONNXRuntimeBackend's node placement report and its CUDA-graph machinery, run on ONNX Runtime's CPU EP.

The placement is read from the build session's real profile; the persistent buffers of the CUDA-graph path
(:class:`~aitune.torch.backend.ort_cuda_graph.PersistentBindings`) bind CPU buffers here, so their
copy-in/copy-out logic and the one-binding-per-shape restriction run without a GPU. Capturing graphs on CUDA
is covered by tests/gpu/test_onnxruntime_gpu.py.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from aitune.errors import ConfigError
from aitune.torch.backend import BackendConfig, ONNXExecutionProvider, ONNXRuntimeBackend, ONNXRuntimeBackendConfig
from aitune.torch.backend.ort_placement import NodePlacement, read_placement
from aitune.torch.check.correctness import OutputComparator
from aitune.torch.record.samples import record_graphs
from aitune.torch.search.evaluation import build_notes

pytestmark = pytest.mark.skipif(not ONNXRuntimeBackend.availability().ok,
                                reason=ONNXRuntimeBackend.availability().reason)


class TinyEmbeddings(nn.Module):
    def __init__(self):
        super().__init__()
        self.table = nn.Embedding(50, 16)

    def forward(self, ids):
        return self.table(ids)


class TinySelfAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention = nn.MultiheadAttention(16, 2, batch_first=True)

    def forward(self, x):
        return self.attention(x, x, x, need_weights=False)[0]


class TinyEncoder(nn.Module):
    """Looks like a BERT-like encoder to ``looks_like_transformer_encoder`` (class names only)."""

    def __init__(self):
        super().__init__()
        self.embeddings = TinyEmbeddings()
        self.layer = TinySelfAttention()

    def forward(self, ids):
        return self.layer(self.embeddings(ids))


@pytest.fixture(scope="module")
def mlp_build(tmp_path_factory):
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8)).eval()
    [graph] = record_graphs(module, [((torch.randn(batch, 16),), {}) for batch in (2, 5)])
    backend = ONNXRuntimeBackend(ONNXRuntimeBackendConfig())
    workdir = tmp_path_factory.mktemp("mlp")
    backend.build(module, graph, "cpu", workdir)
    return module, graph, backend, workdir


def eager(module, x):
    with torch.no_grad():
        return module(x.clone())


# ---------------------------------------------------------------------------------------------- placement


def optimized_node_count(backend, tmp_path) -> int:
    """Nodes of the graph ONNX Runtime runs: the model it writes after its optimizations (same options)."""
    import onnx
    import onnxruntime

    from aitune.torch.backend.ort_session import session_options

    options = session_options(backend.config)
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    onnxruntime.InferenceSession(backend.build_info["onnx_path"], options, providers=["CPUExecutionProvider"])
    return len(onnx.load(str(tmp_path / "optimized.onnx"), load_external_data=False).graph.node)


def test_placement_on_the_cpu_ep_counts_every_node_of_the_optimized_graph(mlp_build, tmp_path):
    module, _, backend, workdir = mlp_build
    placement = backend.build_info["node_placement"]
    nodes = optimized_node_count(backend, tmp_path)
    assert nodes > 0 and placement == {"CPUExecutionProvider": nodes}
    assert sum(backend.build_info["node_op_types"]["CPUExecutionProvider"].values()) == nodes
    assert "placement_note" not in backend.build_info  # every node on the requested EP: nothing to say
    assert not list(workdir.glob("ort_profile*.json"))  # the profile is summarised, then deleted
    x = torch.randn(4, 16)
    OutputComparator().compare(eager(module, x), backend(x))


def test_profiling_stops_after_the_build(mlp_build):
    """The build ends profiling: later calls are not profiled (a profiler still on would write a new file)."""
    _, _, backend, _ = mlp_build
    for _ in range(3):
        backend(torch.randn(3, 16))
    assert backend._session.end_profiling() == ""


def test_read_placement_counts_each_node_once_and_names_the_nodes_off_the_requested_ep(tmp_path):
    def node(index, op, provider):
        return {"cat": "Node", "name": f"n{index}_kernel_time", "args": {"op_name": op, "provider": provider,
                                                                         "node_index": str(index)}}

    events = [{"cat": "Session", "name": "model_run"}]
    for _ in range(2):  # two profiled runs: each node counted once
        events += [node(0, "Shape", "CPUExecutionProvider"), node(1, "Gather", "CPUExecutionProvider"),
                   node(2, "MemcpyFromHost", "CUDAExecutionProvider"), node(3, "MatMul", "CUDAExecutionProvider"),
                   node(4, "Add", "CUDAExecutionProvider"),
                   {"cat": "Node", "name": "n3_fence_before", "args": {"op_name": "MatMul"}}]
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(events))
    placement = read_placement(path)
    assert placement.counts == {"CPUExecutionProvider": 2, "CUDAExecutionProvider": 3}
    assert placement.off("CUDAExecutionProvider") == {"Gather": 1, "Shape": 1}
    assert placement.copies() == 1
    note = placement.note("CUDAExecutionProvider")
    assert note.startswith("2 of 5 nodes not on CUDA (Gather 1, Shape 1)") and "1 device/host copies" in note
    assert placement.note("CPUExecutionProvider").startswith("3 of 5 nodes not on CPU")
    assert NodePlacement({"CUDAExecutionProvider": {"Conv": 4}}).note("CUDAExecutionProvider") is None
    assert note in build_notes({"providers": ["CUDAExecutionProvider"], "placement_note": note})


# ---------------------------------------------------------------------------------------------- persistent buffers


def test_persistent_buffers_copy_outputs_out_and_inputs_in(mlp_build):
    """The CUDA-graph call path with CPU buffers (no capture): outputs of a call are not overwritten by the
    next call at the same shape, inputs are not touched, values equal eager's, each shape gets its own buffers."""
    module, _, backend, _ = mlp_build
    graphs = backend._persistent_bindings(capture=False)
    x1, x2, x3 = torch.randn(2, 16), torch.randn(2, 16), torch.randn(5, 16)
    x1_copy = x1.clone()
    [first] = graphs.run([x1])
    first_copy = first.clone()
    [second] = graphs.run([x2])
    [third] = graphs.run([x3])
    torch.testing.assert_close(first, first_copy, rtol=0, atol=0)  # not overwritten by the later calls
    torch.testing.assert_close(x1, x1_copy, rtol=0, atol=0)
    comparator = OutputComparator()
    comparator.compare(eager(module, x1), first)
    comparator.compare(eager(module, x2), second)
    comparator.compare(eager(module, x3), third)
    assert graphs.shapes == [((2, 16),), ((5, 16),)]
    assert first.data_ptr() != second.data_ptr()


def test_persistent_buffers_let_concurrent_calls_take_turns(mlp_build):
    """Calls from several threads share one shape's buffers: each still gets eager's result for its own input
    (without the lock, one thread's input could be overwritten by another's before the run)."""
    from concurrent.futures import ThreadPoolExecutor

    module, _, backend, _ = mlp_build
    graphs = backend._persistent_bindings(capture=False)
    inputs = [torch.randn(2, 16) for _ in range(128)]
    with ThreadPoolExecutor(max_workers=8) as pool:
        outputs = list(pool.map(lambda x: graphs.run([x])[0], inputs))
    comparator = OutputComparator()
    for x, output in zip(inputs, outputs, strict=True):
        comparator.compare(eager(module, x), output)


def test_graph_capture_path_restricts_calls_to_the_recorded_shapes(tmp_path):
    """_capture_graphs on a CPU session (the run config entry gpu_graph_id is ignored by the CPU EP): one binding
    per recorded shape, any other shape refused by rejects(), values equal eager's through the backend."""
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8)).eval()
    [graph] = record_graphs(module, [((torch.randn(batch, 16),), {}) for batch in (2, 6)])
    backend = ONNXRuntimeBackend(ONNXRuntimeBackendConfig())
    backend.build(module, graph, "cpu", tmp_path)
    backend._capture_graphs(graph)
    assert backend.build_info["cuda_graphs"] == 2 and backend.build_info["accepted_shapes"] == [[[2, 16]], [[6, 16]]]
    assert backend.rejects([torch.randn(4, 16)]) is not None  # inside the recorded range, but no graph for it
    for batch in (2, 6):
        x = torch.randn(batch, 16)
        assert backend.rejects([x]) is None
        first = backend(x)
        kept = first.clone()
        backend(torch.randn(batch, 16))
        torch.testing.assert_close(first, kept, rtol=0, atol=0)
        OutputComparator().compare(eager(module, x), first)


# ---------------------------------------------------------------------------------------------- config, search


def test_cuda_graph_config_is_validated_and_round_trips():
    config = ONNXRuntimeBackendConfig(cuda_graph=True)
    restored = BackendConfig.from_dict(json.loads(json.dumps(config.to_dict())))
    assert restored == config and restored.cuda_graph is True and restored.key() == config.key()
    assert config.key() != ONNXRuntimeBackendConfig().key() and "cuda_graph=True" in config.describe()
    older = ONNXRuntimeBackendConfig().to_dict()
    del older["data"]["cuda_graph"]  # a config stored before the field existed
    assert BackendConfig.from_dict(older).cuda_graph is False
    for bad in (dict(cuda_graph="yes"), dict(cuda_graph=True, execution_provider="cpu"),
                dict(cuda_graph=True, execution_provider="tensorrt")):
        with pytest.raises(ConfigError, match="cuda_graph"):
            ONNXRuntimeBackendConfig(**bad)


def test_cuda_graph_is_refused_on_a_cpu_device():
    module = nn.Linear(4, 4).eval()
    [graph] = record_graphs(module, [((torch.randn(2, 4),), {})])
    check = ONNXRuntimeBackend(ONNXRuntimeBackendConfig(cuda_graph=True)).supports(module, graph, "cpu")
    assert not check.ok and "cuda_graph needs the CUDA execution provider" in check.reason


def test_search_space_adds_cuda_graphs_on_cuda_for_few_shapes_only():
    def configs(module, batches, device):
        [graph] = record_graphs(module, [((torch.randint(0, 50, (batch, 8)),), {}) for batch in batches])
        return [(b.config.cuda_graph, b.config.transformer_fusions, b.config.graph_optimization_level, b.search_tier,
                 b.search_fallback) for b in ONNXRuntimeBackend().search_space(module, graph, torch.device(device))]

    encoder = TinyEncoder().eval()
    # on CUDA the first-tier CUDA-graph variant comes first and the variants without graphs are its fallbacks,
    # the fused one first
    assert configs(encoder, (1, 2), "cuda") == [
        (True, "bert", "all", 0, False), (False, "bert", "all", 1, True), (False, None, "all", 1, True),
        (True, None, "all", 1, False), (False, None, "extended", 1, False)]
    assert configs(encoder, (1, 2), "cpu") == [(False, None, "all", 0, False), (False, "bert", "all", 0, False),
                                               (False, None, "extended", 1, False)]
    too_many = configs(encoder, (1, 2, 3, 4, 5), "cuda")  # too many shapes: no graphs, no fallbacks
    assert not any(graphs or fallback for graphs, *_, fallback in too_many)
    assert [tier for *_, tier, _ in too_many] == [0, 0, 1]
    caller = ONNXRuntimeBackend()  # the backend search_space is called on keeps its own tier
    [graph] = record_graphs(encoder, [((torch.randint(0, 50, (1, 8)),), {})])
    caller.search_space(encoder, graph, torch.device("cuda"))
    assert (caller.search_tier, caller.search_fallback) == (0, False)
    plain = nn.Sequential(nn.Embedding(50, 8), nn.Flatten(), nn.Linear(64, 4)).eval()
    assert configs(plain, (1, 4), "cuda") == [(True, None, "all", 0, False), (False, None, "all", 1, True),
                                              (False, None, "extended", 1, False)]


def test_a_half_precision_convnet_gets_channels_last_cuda_graphs_first_on_cuda():
    def found(module, dtype, device="cuda"):
        [graph] = record_graphs(module, [((torch.randn(1, 3, 8, 8, dtype=dtype),), {})])
        return [(b.config.cuda_graph, b.config.prefer_nhwc, b.search_tier, b.search_fallback)
                for b in ONNXRuntimeBackend().search_space(module, graph, torch.device(device))]

    convnet = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Flatten()).eval()
    assert found(convnet.half(), torch.float16) == [
        (True, True, 0, False), (False, False, 1, True), (True, False, 1, False), (False, False, 1, False)]
    fp32 = [row[:2] for row in found(convnet.float(), torch.float32)]  # not measured in fp32: NCHW first, no NHWC
    assert fp32[0] == (True, False) and not any(nhwc for _, nhwc in fp32)
    assert not any(row[1] for row in found(convnet.half(), torch.float16, "cpu"))
    [graph] = record_graphs(convnet.float(), [((torch.randn(1, 3, 8, 8),), {})])
    assert ONNXRuntimeBackend().search_space(None, graph, torch.device("cuda"))  # no module given: no error


def test_prefer_nhwc_is_validated_reaches_the_cuda_provider_options_and_round_trips():
    from aitune.torch.backend.ort_session import provider_list

    config = ONNXRuntimeBackendConfig(prefer_nhwc=True)
    restored = BackendConfig.from_dict(json.loads(json.dumps(config.to_dict())))
    assert restored == config and restored.key() != ONNXRuntimeBackendConfig().key()
    older = ONNXRuntimeBackendConfig().to_dict()
    del older["data"]["prefer_nhwc"]  # a config stored before the field existed
    assert BackendConfig.from_dict(older).prefer_nhwc is False
    for bad in (dict(prefer_nhwc=1), dict(prefer_nhwc=True, execution_provider="cpu")):
        with pytest.raises(ConfigError, match="prefer_nhwc"):
            ONNXRuntimeBackendConfig(**bad)
    assert provider_list(ONNXExecutionProvider.CUDA, 1, True, config) == [
        ("CUDAExecutionProvider", {"device_id": 1, "enable_cuda_graph": "1", "prefer_nhwc": "1"})]
    assert provider_list(ONNXExecutionProvider.CUDA, 0, False, ONNXRuntimeBackendConfig()) == [
        ("CUDAExecutionProvider", {"device_id": 0})]
