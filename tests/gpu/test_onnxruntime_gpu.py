"""ONNXRuntimeBackend with a CUDA device (GPU machine only, marked gpu).

With the CUDA EP requested, either the session really runs on it (sub-check B: CUDA tensors in
and out, IOBinding, values match eager) or the build fails saying the EP is not active (sub-check A: a
CPU-only onnxruntime on a GPU machine). Also: the CPU EP on a CUDA device returns CUDA tensors; CUDA graphs
(``cuda_graph``) on a conv net and a BERT-like encoder, and the node placement report.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from aitune.errors import BackendBuildError
from aitune.torch.backend import ONNXRuntimeBackend, ONNXRuntimeBackendConfig
from aitune.torch.check.correctness import OutputComparator
from aitune.torch.check.tolerance import Tolerance
from aitune.torch.record.pytree import tree_flatten
from aitune.torch.record.samples import record_graphs

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not ONNXRuntimeBackend.availability().ok,
                                 reason=ONNXRuntimeBackend.availability().reason)]


def c28_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 32, 3, padding=1),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten()).cuda().eval()


def c28_graph(net):
    calls = [((torch.randn(batch, 3, 32, 32, device="cuda"),), {}) for batch in (2, 8)]
    [graph] = record_graphs(net, calls)
    return graph


def test_c28_cuda_ep_is_active_or_the_build_says_it_is_not(tmp_path):
    import onnxruntime

    net = c28_net()
    graph = c28_graph(net)
    backend = ONNXRuntimeBackend(ONNXRuntimeBackendConfig())  # None => CUDA EP on a CUDA device
    if "CUDAExecutionProvider" not in onnxruntime.get_available_providers():
        assert not backend.supports(net, graph, "cuda").ok
        with pytest.raises(BackendBuildError, match="requested CUDA EP not active; session on CPU"):
            backend.build(net, graph, "cuda", tmp_path)
        return
    assert backend.supports(net, graph, "cuda").ok
    try:
        backend.build(net, graph, "cuda", tmp_path)
    except BackendBuildError as exc:  # an onnxruntime-gpu whose CUDA libraries do not load here
        assert "not active" in str(exc), exc
        return
    assert backend.build_info["providers"][0] == "CUDAExecutionProvider" and backend._use_io_binding
    x = torch.randn(5, 3, 32, 32, device="cuda")
    output = backend(x)
    assert output.device.type == "cuda"
    with torch.no_grad():
        OutputComparator().compare(net(x), output)


def test_cpu_ep_on_a_cuda_device_returns_cuda_tensors(tmp_path):
    net = c28_net()
    graph = c28_graph(net)
    backend = ONNXRuntimeBackend(ONNXRuntimeBackendConfig(execution_provider="cpu"))
    assert backend.supports(net, graph, "cuda").ok
    backend.build(net, graph, "cuda", tmp_path)
    assert backend.build_info["providers"] == ["CPUExecutionProvider"]
    for batch in (2, 5, 8):
        x = torch.randn(batch, 3, 32, 32, device="cuda")
        output = backend(x)
        assert output.device.type == "cuda" and output.dtype == torch.float32
        with torch.no_grad():
            OutputComparator().compare(net(x), output)


def test_cuda_array_interface_wrapper_shares_device_memory():
    """``CudaArray`` turns a CUDA OrtValue into a torch tensor. An onnxruntime-gpu is not always present, so
    this stand-in exposes the same three OrtValue methods (``shape``, ``data_ptr``) over a torch CUDA
    tensor: it checks the interface dict (typestr, pointer, shape) the wrapper hands to torch."""
    from aitune.torch.backend.ort_io import CudaArray

    class OrtValueStandIn:  # test double of onnxruntime.OrtValue's shape()/data_ptr(), documented above
        def __init__(self, tensor):
            self.tensor = tensor

        def shape(self):
            return list(self.tensor.shape)

        def data_ptr(self):
            return self.tensor.data_ptr()

    for dtype in (torch.float32, torch.float16, torch.int64, torch.bool, torch.uint8):
        source = (torch.arange(24, device="cuda") % 3).to(dtype).reshape(2, 3, 4)
        wrapped = torch.as_tensor(CudaArray(OrtValueStandIn(source), dtype), device="cuda")
        assert wrapped.dtype == dtype and wrapped.shape == source.shape
        assert wrapped.data_ptr() == source.data_ptr()
        torch.testing.assert_close(wrapped, source, rtol=0, atol=0)


def test_onnx_module_runs_on_cuda_and_tunes_with_the_cuda_ep(tmp_path):
    """An existing .onnx file (OnnxModule) moved to CUDA runs on the CUDA EP and tunes with ONNX Runtime there."""
    import onnxruntime

    import aitune.torch as ait

    if "CUDAExecutionProvider" not in onnxruntime.get_available_providers():
        pytest.skip("onnxruntime has no CUDA execution provider here (pip install onnxruntime-gpu)")
    net = c28_net().cpu()
    path = tmp_path / "net.onnx"
    torch.onnx.export(net, (torch.randn(2, 3, 32, 32),), str(path), input_names=["x"], output_names=["y"],
                      dynamic_axes={"x": {0: "batch"}, "y": {0: "batch"}}, dynamo=False)
    module = ait.OnnxModule(path).to("cuda")
    x = torch.randn(4, 3, 32, 32, device="cuda")
    y = module(x)
    assert y.device.type == "cuda"
    with torch.no_grad():
        torch.testing.assert_close(y.cpu(), net(x.cpu()), atol=1e-4, rtol=1e-4)
    tuned = ait.Module(module, "onnx-cuda", strategy=ait.OneBackendStrategy(
        ONNXRuntimeBackend()).enable_performance_validation(False))
    ait.tune(tuned, [torch.randn(b, 3, 32, 32, device="cuda") for b in (2, 4)], ready_batches=True,
             ignore_failing_modules=False)
    backend = tuned.backends["graph0"]
    assert isinstance(backend, ONNXRuntimeBackend) and backend.build_info["providers"][0] == "CUDAExecutionProvider"
    out = tuned(x)
    assert out.device.type == "cuda"
    torch.testing.assert_close(out, y, atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------------------------------------- CUDA graphs, placement


def require_cuda_ep():
    import onnxruntime

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    if "CUDAExecutionProvider" not in onnxruntime.get_available_providers():
        pytest.skip("onnxruntime has no CUDA execution provider here (pip install onnxruntime-gpu)")


def tiny_bert():
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    config = BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
                        vocab_size=100, max_position_embeddings=64)
    return BertModel(config).cuda().eval()


def check_cuda_graph_backend(net, backend, shapes, make_input, unrecorded, comparator=None, all_on_cuda=True):
    """Values vs eager at each captured shape, a call's output not overwritten by the next call, an unrecorded
    shape refused, every node on the CUDA EP (``all_on_cuda``)."""
    assert backend.build_info["cuda_graphs"] == len(shapes)
    if all_on_cuda:
        assert set(backend.build_info["node_placement"]) == {"CUDAExecutionProvider"}, \
            backend.build_info["node_op_types"]
        assert "placement_note" not in backend.build_info
    comparator = comparator or OutputComparator()
    for shape in shapes:
        x1, x2 = make_input(shape), make_input(shape)
        first = backend(x1)
        kept = [leaf.clone() for leaf in tree_flatten(first)[0] if isinstance(leaf, torch.Tensor)]
        second = backend(x2)
        with torch.no_grad():
            comparator.compare(net(x1), first)
            comparator.compare(net(x2), second)
        after = [leaf for leaf in tree_flatten(first)[0] if isinstance(leaf, torch.Tensor)]
        for before, now in zip(kept, after, strict=True):  # call 2 did not overwrite call 1's outputs
            torch.testing.assert_close(now, before, rtol=0, atol=0)
    assert backend.rejects(canonical_leaves(net, make_input(unrecorded))) is not None
    assert backend.rejects(canonical_leaves(net, make_input(shapes[0]))) is None


def canonical_leaves(net, x) -> list:
    """The flattened canonical input leaves aitune.Module hands to Backend.accepts/rejects."""
    from aitune.torch.record.samples import CallSignature

    args, kwargs = CallSignature(net.forward).normalize((x,), {})
    return tree_flatten((args, kwargs))[0]


def test_cuda_graphs_on_a_conv_net_one_graph_per_recorded_batch(tmp_path):
    require_cuda_ep()
    net = c28_net()
    graph = c28_graph(net)  # batches 2 and 8
    backend = ONNXRuntimeBackend(ONNXRuntimeBackendConfig(cuda_graph=True))
    assert backend.supports(net, graph, "cuda").ok
    backend.build(net, graph, "cuda", tmp_path)
    check_cuda_graph_backend(net, backend, (2, 8), lambda b: torch.randn(b, 3, 32, 32, device="cuda"), 5)
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    loaded = ONNXRuntimeBackend.from_checkpoint(checkpoint, backend.config, backend.save(checkpoint), None, graph,
                                                "cuda")
    assert loaded.config.cuda_graph is True
    x = torch.randn(8, 3, 32, 32, device="cuda")
    with torch.no_grad():
        OutputComparator().compare(net(x), loaded(x))
    assert loaded.rejects(canonical_leaves(net, torch.randn(5, 3, 32, 32, device="cuda"))) is not None


def test_cuda_graphs_on_a_bert_like_encoder_with_fusions(tmp_path):
    require_cuda_ep()
    net = tiny_bert()
    [graph] = record_graphs(net, [((torch.randint(0, 100, (4, 16), device="cuda"),), {})])
    for fusions in (None, "bert"):
        backend = ONNXRuntimeBackend(ONNXRuntimeBackendConfig(cuda_graph=True, transformer_fusions=fusions))
        backend.build(net, graph, "cuda", tmp_path / str(fusions))
        # fp32 kernels of ONNX Runtime's CUDA EP sum in another order than PyTorch's: 1.4e-4 seen on pooler_output
        # (tanh of a 64-wide dot product), over the default atol of 1e-4; this test is about capture and replay
        check_cuda_graph_backend(net, backend, ((4, 16),),
                                 lambda shape: torch.randint(0, 100, shape, device="cuda"), (2, 16),
                                 comparator=OutputComparator(Tolerance(atol=1e-3, rtol=1e-3)))


def test_plain_cuda_ep_reports_placement_and_cuda_graphs_on_dynamic_axes_fail_or_run_right(tmp_path):
    """Two batch sizes give the encoder a dynamic batch axis, whose shape computations ONNX Runtime may put on
    the CPU EP: the plain CUDA EP build then says so in its placement note. The CUDA-graph build then either
    fails with ONNX Runtime's refusal naming them, or (onnxruntime-gpu 1.31.1 captured such a graph)
    captures one graph per batch size whose replays match eager. If every node stays on CUDA, both run and match
    eager."""
    require_cuda_ep()
    net = tiny_bert()
    [graph] = record_graphs(net, [((torch.randint(0, 100, (b, 16), device="cuda"),), {}) for b in (2, 4)])
    plain = ONNXRuntimeBackend(ONNXRuntimeBackendConfig())
    plain.build(net, graph, "cuda", tmp_path / "plain")
    placement = plain.build_info["node_placement"]
    assert placement.get("CUDAExecutionProvider", 0) > 0
    off_cuda = {k: v for k, v in placement.items() if k != "CUDAExecutionProvider"}
    graphs = ONNXRuntimeBackend(ONNXRuntimeBackendConfig(cuda_graph=True))
    if off_cuda:
        assert "nodes not on CUDA" in plain.build_info["placement_note"]
        try:
            graphs.build(net, graph, "cuda", tmp_path / "graphs")
        except BackendBuildError as exc:
            assert "refused CUDA graph capture" in str(exc) and "nodes not on CUDA" in str(exc), exc
            return
        check_cuda_graph_backend(net, graphs, ((2, 16), (4, 16)),
                                 lambda shape: torch.randint(0, 100, shape, device="cuda"), (3, 16),
                                 comparator=OutputComparator(Tolerance(atol=1e-3, rtol=1e-3)), all_on_cuda=False)
        return
    graphs.build(net, graph, "cuda", tmp_path / "graphs")
    x = torch.randint(0, 100, (4, 16), device="cuda")
    with torch.no_grad():
        OutputComparator().compare(net(x), graphs(x))
