"""ONNXRuntimeBackend with a CUDA device (GPU machine only, marked gpu).

With the CUDA EP requested, either the session really runs on it (sub-check B: CUDA tensors in
and out, IOBinding, values match eager) or the build fails saying the EP is not active (sub-check A: a
CPU-only onnxruntime on a GPU machine). Also: the CPU EP on a CUDA device returns CUDA tensors.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from aitune.errors import BackendBuildError
from aitune.torch.backend import ONNXRuntimeBackend, ONNXRuntimeBackendConfig
from aitune.torch.check.correctness import OutputComparator
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
