"""The TensorRT backend's ModelOpt steps, run for real on CPU (no TensorRT, no GPU needed).

``nvidia-modelopt[onnx]`` installs on CPU machines; its ONNX autocast and ONNX PTQ steps classify/calibrate
with ONNX Runtime on CPU. The converted models are then run with ONNX Runtime (CPU) and compared with
eager PyTorch. Skipped (with the reason) where ModelOpt or ONNX Runtime is not installed.
"""

import pytest
import torch

pytest.importorskip("modelopt.onnx", reason="nvidia-modelopt's ONNX tools not importable — pip install 'aitune[modelopt]'", exc_type=ImportError)
onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from aitune.torch.backend.onnx_export import export_onnx  # noqa: E402
from aitune.torch.backend.tensorrt.quantization import (  # noqa: E402
    autocast_onnx,
    concatenated_calibration,
    quantize_onnx,
    write_calibration_data,
)
from aitune.torch.check.correctness import OutputComparator, Tolerance  # noqa: E402
from aitune.torch.record.samples import record_graphs  # noqa: E402


class Block(torch.nn.Module):
    """A small MLP block with a residual and layer norm (ops autocast must handle: Gemm, Add, LayerNorm, Gelu)."""

    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(32)
        self.up = torch.nn.Linear(32, 64)
        self.down = torch.nn.Linear(64, 32)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    torch.manual_seed(0)
    module = Block().eval()
    graph = record_graphs(module, [((torch.randn(b, 8, 32),), {}) for b in (2, 4)])[0]
    directory = tmp_path_factory.mktemp("modelopt")
    export = export_onnx(module, graph, directory / "onnx" / "model.onnx", device="cpu")
    samples = [[sample_input for sample_input in export.flat_io.sample_inputs(sample)] for sample in graph.samples]
    return module, graph, export, samples, directory


def _run_onnx(path, feeds):
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session, session.run(None, feeds)


@pytest.mark.parametrize("keep_io_types", [True, False])
def test_autocast_fp16_matches_eager_at_fp16_tolerance(exported, keep_io_types):
    module, graph, export, samples, directory = exported
    calibration = write_calibration_data(samples, export.input_names, directory / f"calibration_{keep_io_types}")
    assert sorted(p.name for p in calibration.iterdir()) == ["sample_0000.npz", "sample_0001.npz"]
    output = directory / f"onnx_autocast_{keep_io_types}" / "model.onnx"
    result = autocast_onnx(onnx_path=str(export.path), output_path=str(output), precision="fp16",
                           keep_io_types=keep_io_types, calibration_dir=str(calibration))
    assert result["output_path"] == str(output) and output.is_file()

    model = onnx.load(str(output))
    fp16_weights = [init.name for init in model.graph.initializer if init.data_type == onnx.TensorProto.FLOAT16]
    assert fp16_weights, "autocast left every weight in fp32"
    input_type = model.graph.input[0].type.tensor_type.elem_type
    assert input_type == (onnx.TensorProto.FLOAT if keep_io_types else onnx.TensorProto.FLOAT16)

    x = torch.randn(3, 8, 32)  # a batch that was not recorded: the dynamic axis survived autocast
    feed = x.numpy() if keep_io_types else x.half().numpy()
    _, (y,) = _run_onnx(output, {export.input_names[0]: feed})
    candidate = torch.from_numpy(y)
    assert candidate.dtype == (torch.float32 if keep_io_types else torch.float16)
    with torch.no_grad():
        reference = module(x)
    # fp16 tolerance (docs/design.md, Correctness rules): compare the fp16-computed values with eager fp32
    # at atol=rtol=1e-2.
    comparator = OutputComparator(Tolerance(atol=1e-2, rtol=1e-2))
    comparator.compare(reference, candidate.float())
    assert comparator.result().max_abs_error > 0  # it really ran in reduced precision


def test_autocast_runs_in_the_isolated_child_like_the_backend(exported):
    """The backend runs autocast through run_isolated; the same step works in a fresh interpreter."""
    from aitune.torch.backend.tensorrt import TensorRTBackend
    from aitune.torch.backend.isolation import run_isolated

    module, graph, export, samples, directory = exported
    calibration = write_calibration_data(samples, export.input_names, directory / "calibration_child")
    output = directory / "onnx_autocast_child" / "model.onnx"
    result = run_isolated(TensorRTBackend.autocast_step, {
        "onnx_path": str(export.path), "output_path": str(output), "precision": "bf16", "keep_io_types": True,
        "calibration_dir": str(calibration)}, timeout_s=300, log_path=directory / "autocast_child.log")
    assert result["output_path"] == str(output)
    model = onnx.load(str(output))
    assert any(init.data_type == onnx.TensorProto.BFLOAT16 for init in model.graph.initializer)


def test_onnx_int8_ptq_runs_on_cpu_and_keeps_sqnr():
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.ReLU(),
                                 torch.nn.Conv2d(16, 16, 3, padding=1), torch.nn.ReLU(),
                                 torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(16, 10)).eval()
    graph = record_graphs(module, [((torch.randn(b, 3, 16, 16),), {}) for b in (2, 4, 2)])[0]
    import tempfile
    from pathlib import Path

    import numpy as np

    with tempfile.TemporaryDirectory() as folder:
        folder = Path(folder)
        export = export_onnx(module, graph, folder / "onnx" / "model.onnx", device="cpu")
        samples = [export.flat_io.sample_inputs(sample) for sample in graph.samples]
        calibration = concatenated_calibration(samples, export.input_names)
        # every kept sample concatenated: batch 2, batch 4, and the second batch-2 call (other values, kept too)
        assert calibration[export.input_names[0]].shape == (8, 3, 16, 16)
        np.savez(folder / "calibration.npz", **calibration)
        result = quantize_onnx(onnx_path=str(export.path), output_path=str(folder / "onnx_ptq" / "model.onnx"),
                               precision="int8", calibration_method="max",
                               calibration_path=str(folder / "calibration.npz"), calibration_eps=["cpu"])
        assert result["qdq_nodes"] > 0
        x = torch.randn(5, 3, 16, 16)
        _, (y,) = _run_onnx(result["output_path"], {export.input_names[0]: x.numpy()})
    with torch.no_grad():
        reference = module(x)
    comparator = OutputComparator(Tolerance(), quantized=True)  # SQNR >= 20 dB and cosine >= 0.99
    comparator.compare(reference, torch.from_numpy(y).float())


def test_concatenated_calibration_keeps_the_largest_compatible_group():
    samples = [[torch.ones(2, 4)], [torch.ones(3, 4)], [torch.ones(1, 5)]]
    data = concatenated_calibration(samples, ["input_x"])
    assert data["input_x"].shape == (5, 4)
    with pytest.raises(Exception, match="bfloat16"):
        write_calibration_data([[torch.ones(2, dtype=torch.bfloat16)]], ["input_x"], __import__("pathlib").Path(
            __import__("tempfile").mkdtemp()))
