"""TensorRTBackend end to end with a STAND-IN for TensorRT (which cannot be installed on this project's machines).

Everything that is ours runs for real: the ONNX export, profile derivation and fitting, ModelOpt ONNX
autocast in an isolated child process, the isolated build step mechanism, the runtime's I/O binding,
profile routing (``accepts``), checkpoint save and load without the module. Only TensorRT is replaced:

* the build step (``TensorRTBackend.build_step``) is :func:`standin_build_engine`, which writes a JSON
  "plan" naming the ONNX file and the profiles instead of a serialized engine, then runs the same check
  as the real step (load + one run through our ``TensorRTRunner``);
* ``engine_build.load_engine`` returns ``fake_tensorrt.onnx_engine``: a double of the TensorRT engine API
  that computes with ONNX Runtime on CPU (see ``fake_tensorrt.py``);
* the backend is told TensorRT is available and may run on CPU.

Tolerances: the model runs in fp16 after autocast, so outputs are compared with eager at fp16 tolerance.
"""

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("onnxruntime")
pytest.importorskip("modelopt.onnx", reason="nvidia-modelopt's ONNX tools not importable — pip install 'aitune[modelopt]'", exc_type=ImportError)

import fake_tensorrt  # noqa: E402
from aitune.torch.backend import ONNXAutoCastConfig, TensorRTBackend, TensorRTBackendConfig  # noqa: E402
from aitune.torch.backend.base import Check  # noqa: E402
from aitune.torch.check.correctness import OutputComparator, Tolerance  # noqa: E402
from aitune.torch.record.samples import record_graphs  # noqa: E402


def standin_build_engine(*, onnx_path, engine_path, profiles, input_names, output_names, check_inputs_path,
                         device_index=0, **settings) -> dict:
    """Stand-in for ``engine_build.build_engine`` (runs in the isolated child): a JSON plan, then the check run."""
    from aitune.torch.backend.tensorrt.runtime import TensorRTRunner

    plan = {"onnx_path": onnx_path, "profiles": profiles, "settings": settings}
    Path(engine_path).write_text(json.dumps(plan))
    runner = TensorRTRunner(fake_tensorrt.onnx_engine(onnx_path, profiles), fake_tensorrt.fake_trt, "cpu",
                            input_names, output_names)
    outputs = runner.run(torch.load(check_inputs_path, weights_only=True))
    return {"engine_path": engine_path, "engine_bytes": Path(engine_path).stat().st_size, "build_s": 0.0,
            "tensorrt_version": "stand-in", "num_profiles": len(profiles),
            "check_output_shapes": [list(output.shape) for output in outputs]}


def standin_load_engine(engine_path):
    plan = json.loads(Path(engine_path).read_text())
    return fake_tensorrt.fake_trt, None, fake_tensorrt.onnx_engine(plan["onnx_path"], plan["profiles"])


class Tagger(torch.nn.Module):
    """Nested inputs and outputs, an int64 input and a constant output leaf."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(20, 16)
        self.mix = torch.nn.Linear(16, 16)

    def forward(self, batch, scale: float = 0.5):
        hidden = torch.tanh(self.mix(self.embed(batch["ids"]))) * batch["weight"].unsqueeze(-1) * scale
        return {"hidden": hidden, "summary": (hidden.mean(1), "v1")}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setattr(TensorRTBackend, "availability", classmethod(lambda cls: Check(True, "", {"tensorrt": "stand-in"})))
    monkeypatch.setattr("aitune.torch.backend.tensorrt.engine_build.load_engine", standin_load_engine)
    torch.manual_seed(0)
    module = Tagger().eval()
    calls = [(({"ids": torch.randint(0, 20, (b, s)), "weight": torch.rand(b, s)},), {}) for b, s in ((2, 6), (4, 9))]
    graph = record_graphs(module, calls)[0]
    backend = TensorRTBackend(TensorRTBackendConfig(quantization_config=ONNXAutoCastConfig(), use_cuda_graphs=True))
    backend.build_step = f"{__name__}:standin_build_engine"
    backend.device_types = frozenset({"cpu", "cuda"})
    workdir = tmp_path_factory.mktemp("tensorrt")
    assert backend.supports(module, graph, torch.device("cpu")).ok
    backend.build(module, graph, "cpu", workdir)
    yield module, graph, backend, workdir
    monkeypatch.undo()


def _compare(module, backend, batch, scale=0.5):
    comparator = OutputComparator(Tolerance(atol=1e-2, rtol=1e-2))
    with torch.no_grad():
        comparator.compare(module(batch, scale), backend(batch, scale))
    return comparator.result()


def test_build_layout_profiles_and_quantization_info(built):
    module, graph, backend, workdir = built
    for relative in ("onnx/model.onnx", "onnx_autocast/model.onnx", "tensorrt/model.plan",
                     "tensorrt/model_optimization_profiles.json", "tensorrt/engine_build.log",
                     "onnx_autocast/autocast.log", "build.log"):
        assert (workdir / relative).is_file(), relative
    plan = json.loads((workdir / "tensorrt" / "model.plan").read_text())
    assert plan["onnx_path"].endswith("onnx_autocast/model.onnx")  # the engine is built from the autocast model
    assert plan["settings"]["enable_tf32"] is True
    profiles = json.loads((workdir / "tensorrt" / "model_optimization_profiles.json").read_text())
    assert profiles == [{"input_batch_ids": [[2, 6], [4, 9], [4, 9]], "input_batch_weight": [[2, 6], [4, 9], [4, 9]]}]
    assert backend.build_info["profiles"] == profiles
    assert "modelopt onnx autocast fp16" in backend.build_info["quantization"]
    assert backend.is_quantizing


def test_outputs_match_eager_inside_the_profile(built):
    module, graph, backend, _ = built
    for b, s in ((2, 6), (3, 7), (4, 9)):
        batch = {"ids": torch.randint(0, 20, (b, s)), "weight": torch.rand(b, s)}
        result = _compare(module, backend, batch)
        assert 0 < result.max_abs_error < 1e-2  # fp16 engine: close to eager, not bit-equal
    output = backend({"ids": torch.randint(0, 20, (2, 6)), "weight": torch.rand(2, 6)}, 0.5)
    assert output["summary"][1] == "v1" and output["hidden"].dtype == torch.float32


def test_calls_outside_the_profile_are_refused(built):
    module, graph, backend, _ = built
    leaves_inside = [torch.zeros(3, 7, dtype=torch.int64), torch.zeros(3, 7), 0.5]
    leaves_outside = [torch.zeros(5, 7, dtype=torch.int64), torch.zeros(5, 7), 0.5]
    assert backend.accepts(leaves_inside) and not backend.accepts(leaves_outside)
    from aitune.errors import BackendRuntimeError

    with pytest.raises(BackendRuntimeError, match=r"batch\.ids \[5, 7\].*profile 0: batch\.ids min \[2, 6\] "
                                                  r"max \[4, 9\], batch\.weight min \[2, 6\] max \[4, 9\]"):
        backend({"ids": torch.zeros(5, 7, dtype=torch.int64), "weight": torch.zeros(5, 7)}, 0.5)


def test_checkpoint_loads_without_the_module(built, tmp_path):
    module, graph, backend, _ = built
    metadata = backend.save(tmp_path / "saved")
    assert json.loads(json.dumps(metadata)) == metadata  # JSON-able manifest entry
    assert (tmp_path / "saved" / "model.plan").is_file()
    loaded = TensorRTBackend.from_checkpoint(tmp_path / "saved", backend.config, metadata, None, None, "cpu")
    batch = {"ids": torch.randint(0, 20, (3, 8)), "weight": torch.rand(3, 8)}
    with torch.no_grad():
        torch.testing.assert_close(loaded(batch, 0.5)["hidden"], backend(batch, 0.5)["hidden"])
    assert loaded(batch, 0.5)["summary"][1] == "v1"
    assert not loaded.accepts([torch.zeros(1, 8, dtype=torch.int64), torch.zeros(1, 8), 0.5])


def test_deactivate_releases_and_activate_reloads(built):
    module, graph, backend, _ = built
    backend.deactivate()
    assert backend._runner is None
    batch = {"ids": torch.randint(0, 20, (2, 6)), "weight": torch.rand(2, 6)}
    _compare(module, backend, batch)  # infer() re-activates
    assert backend._runner is not None


def test_deployment_artifact_lists_engine_profiles_and_bounds(built, tmp_path):
    """The engine's deployment artifact (stand-in engine: the real TensorRT path is never executed here)."""
    from aitune.torch.backend.artifact import GraphFacts

    module, graph, backend, workdir = built
    artifact = backend.artifact()
    assert artifact.format == "tensorrt_engine"
    assert artifact.files == (workdir / "tensorrt" / "model.plan",
                              workdir / "tensorrt" / "model_optimization_profiles.json")
    assert [(t.name, t.path, t.dtype, t.min_shape, t.max_shape, t.batch_axis) for t in artifact.inputs] == [
        ("input_batch_ids", "batch.ids", "int64", (2, 6), (4, 9), 0),
        ("input_batch_weight", "batch.weight", "float32", (2, 6), (4, 9), 0)]
    assert artifact.inputs[0].shape[0] == "batch" and isinstance(artifact.inputs[0].shape[1], str)
    assert [(t.path, t.dtype) for t in artifact.outputs] == [("hidden", "float32"), ("summary[0]", "float32")]
    assert artifact.constants == {}  # the recorded calls leave scale at its default: not an argument of the call
    assert artifact.runtime["cuda_graphs"] is True
    assert artifact.runtime["profiles"] == backend.build_info["profiles"]
    metadata = backend.save(tmp_path / "saved")
    stored = TensorRTBackend.artifact_from_metadata(metadata, tmp_path / "saved", backend.config.to_dict(),
                                                    GraphFacts.of(graph, backend.device))
    assert all(path.is_file() for path in stored.files)
    assert stored.inputs == artifact.inputs and stored.outputs == artifact.outputs
