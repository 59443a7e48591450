"""Deployment artifacts: a tuned graph's files run outside aitune, described alike from the live module, a loaded
checkpoint and ``aitune export``'s folder.

One tune (module-scoped): ``encoder`` on ONNX Runtime (CPU EP; constants ``pooling``/``scale`` baked), ``mlp`` on
AOTInductor (one compile), ``head`` on eager. Each artifact is run by its bare runtime
(``onnxruntime.InferenceSession``, ``torch._inductor.aoti_load_package``), fed by the documented input names or
order, and compared with the tuned module's output.
"""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import aitune.torch as ait
import checkpoint_models as models
from checkpoint_edits import rewrite_archive
from readme_blocks import readme_section, run_readme_block
from aitune.cli import main
from aitune.errors import CheckpointIntegrityError, ConfigError
from aitune.torch.backend import (
    DeploymentArtifact,
    ONNXRuntimeBackend,
    TensorRTBackend,
    TorchEagerBackend,
    TorchInductorAotBackend,
)
from aitune.torch.backend.artifact import GraphFacts
from aitune.torch.checkpoint.export import export_checkpoint
from aitune.torch.measure.profiling import ProfilingConfig

FAST = ProfilingConfig(warmup_rounds=1, min_rounds=3, max_rounds=10, time_budget_s=0.1)

pytestmark = pytest.mark.skipif(
    not (ONNXRuntimeBackend.availability().ok and TorchInductorAotBackend.availability().ok),
    reason="needs onnxruntime and AOTInductor")


def only(backend):
    return ait.OneBackendStrategy(backend, profiling_config=FAST).enable_performance_validation(False)


class Pipe:
    """encoder (Features + constants) -> mlp (pooled [B, 16]) -> head."""

    def __init__(self):
        torch.manual_seed(0)
        self.encoder = models.Encoder().eval()
        self.mlp = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)).eval()
        self.head = models.TiedHead().eval()

    def __call__(self, batch):
        features, _ = batch
        encoded = self.encoder(features, pooling="mean", scale=0.5)
        return self.head(self.mlp(encoded.pooled))


def probe_values():
    """A call inside the recorded ranges (batch 3, length 6) never recorded, by input path."""
    features, _ = models.probe()
    pooled = torch.randn(3, 16, generator=torch.Generator().manual_seed(3))
    return features, pooled


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    root = tmp_path_factory.mktemp("deploy")
    pipe = Pipe()
    pipe.encoder = ait.Module(pipe.encoder, "encoder", strategy=only(ONNXRuntimeBackend()))
    pipe.mlp = ait.Module(pipe.mlp, "mlp", strategy=only(TorchInductorAotBackend()))
    pipe.head = ait.Module(pipe.head, "head", strategy=only(TorchEagerBackend()))
    report = ait.tune(pipe, models.dataset(), cache_dir_path=root / "cache", ready_batches=True)
    assert not report.module_errors, report.module_errors
    path = ait.save(pipe, root / "pipe.ait")
    loaded = ait.load(Pipe(), path)
    exported = root / "exported"
    assert main(["export", str(path), str(exported)]) == 0
    return SimpleNamespace(pipe=pipe, path=path, loaded=loaded, exported=exported, root=root)


def artifact_of(tuned, source: str, module: str) -> DeploymentArtifact:
    if source == "live":
        return getattr(tuned.pipe, module).deployment_artifacts()["graph0"]
    if source == "loaded":
        return getattr(tuned.loaded, module).deployment_artifacts()["graph0"]
    manifest = json.loads((tuned.exported / "manifest.json").read_text())
    entry = next(item for item in manifest["artifacts"] if item["module"] == module)
    return DeploymentArtifact.from_json(entry, relative_to=tuned.exported)


@pytest.mark.parametrize("source", ["live", "loaded", "exported"])
def test_onnx_artifact_runs_in_a_bare_session(tuned, source):
    import onnxruntime

    artifact = artifact_of(tuned, source, "encoder")
    assert artifact.format == "onnx" and artifact.backend == "onnxruntime"
    assert artifact.constants == {"pooling": "mean", "scale": 0.5}
    assert artifact.runtime["execution_providers"] == [["CPUExecutionProvider", {}]]
    assert artifact.runtime["graph_optimization_level"] == "ORT_ENABLE_ALL"
    features, _ = probe_values()
    by_path = {"features.tokens": features.tokens, "features.mask": features.mask}
    options = onnxruntime.SessionOptions()
    options.graph_optimization_level = getattr(onnxruntime.GraphOptimizationLevel,
                                               artifact.runtime["graph_optimization_level"])
    session = onnxruntime.InferenceSession(str(artifact.model_file), sess_options=options,
                                           providers=["CPUExecutionProvider"])
    assert [i.name for i in session.get_inputs()] == [t.name for t in artifact.inputs]
    feeds = {tensor.name: by_path[tensor.path].numpy() for tensor in artifact.inputs}
    values = session.run([tensor.name for tensor in artifact.outputs], feeds)
    with torch.no_grad():
        expected = tuned.pipe.encoder(features, pooling="mean", scale=0.5)
    assert [tensor.path for tensor in artifact.outputs] == ["hidden", "pooled"]
    for tensor, value in zip(artifact.outputs, values):
        assert tensor.dtype == "float32"
        torch.testing.assert_close(torch.from_numpy(value), getattr(expected, tensor.path), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("source", ["live", "loaded", "exported"])
def test_pt2_artifact_loads_with_aoti_load_package(tuned, source):
    artifact = artifact_of(tuned, source, "mlp")
    assert artifact.format == "pt2" and artifact.runtime["device"] == "cpu"
    assert artifact.runtime["device_index"] == -1
    _, pooled = probe_values()
    by_path = {"input": pooled}
    runner = torch._inductor.aoti_load_package(str(artifact.model_file), device_index=-1)
    outputs = runner(*[by_path[tensor.path].contiguous() for tensor in artifact.inputs])
    with torch.no_grad():
        expected = tuned.pipe.mlp(pooled)
    assert len(outputs) == len(artifact.outputs) == 1
    torch.testing.assert_close(outputs[0], expected, atol=1e-5, rtol=1e-5)


def test_dynamic_axis_bounds_are_what_the_backends_accept(tuned):
    encoder = tuned.pipe.encoder.deployment_artifacts()["graph0"]
    tokens = next(tensor for tensor in encoder.inputs if tensor.path == "features.tokens")
    # dataset(): batch 2/length 5 and batch 4/length 7: the recorded range the ONNX graph accepts.
    assert tokens.min_shape == (2, 5, 8) and tokens.max_shape == (4, 7, 8)
    assert tokens.batch_axis == 0 and tokens.shape[0] == "batch" and tokens.shape[2] == 8
    assert isinstance(tokens.shape[1], str) and tokens.dtype == "float32"
    mask = next(tensor for tensor in encoder.inputs if tensor.path == "features.mask")
    backend = tuned.pipe.encoder.backends["graph0"]
    leaf_of = {"features.tokens": tokens, "features.mask": mask}

    def leaves(batch, length):  # the canonical call's leaves: features.tokens, features.mask, pooling, scale
        shapes = {"features.tokens": (batch, length, 8), "features.mask": (batch, length)}
        return [torch.zeros(shapes[path]) for path in leaf_of] + ["mean", 0.5]
    assert backend.rejects(leaves(*tokens.max_shape[:2])) is None
    assert backend.rejects(leaves(*tokens.min_shape[:2])) is None
    assert backend.rejects(leaves(tokens.max_shape[0] + 1, 6)) is not None
    assert backend.rejects(leaves(3, tokens.max_shape[1] + 1)) is not None

    mlp = tuned.pipe.mlp.deployment_artifacts()["graph0"]
    aot = tuned.pipe.mlp.backends["graph0"]
    assert [[list(t.min_shape), list(t.max_shape)] for t in mlp.inputs] == aot.build_info["accepted_ranges"]
    assert mlp.inputs[0].min_shape == (2, 16) and mlp.inputs[0].max_shape == (4, 16)
    assert aot.rejects([torch.zeros(mlp.inputs[0].max_shape)]) is None
    assert aot.rejects([torch.zeros(5, 16)]) is not None
    # the loaded checkpoint and the export describe the same bounds
    for source in ("loaded", "exported"):
        assert artifact_of(tuned, source, "mlp").inputs == mlp.inputs
        assert artifact_of(tuned, source, "encoder").inputs == encoder.inputs


def test_eager_graph_is_left_out_with_its_reason(tuned):
    reasons: dict = {}
    assert tuned.pipe.head.deployment_artifacts(reasons) == {}
    assert "eager is a JIT backend" in reasons["graph0"]
    loaded_reasons: dict = {}
    assert tuned.loaded.head.deployment_artifacts(loaded_reasons) == {} and loaded_reasons == reasons
    manifest = json.loads((tuned.exported / "manifest.json").read_text())
    assert [(e["module"], e["graph"], e["backend"]) for e in manifest["left_out"]] == [("head", "graph0", "eager")]
    assert "JIT backend" in manifest["left_out"][0]["reason"]
    assert sorted(p.relative_to(tuned.exported).as_posix() for p in tuned.exported.rglob("*") if p.is_file()) == \
        sorted(["manifest.json", *[f for item in manifest["artifacts"] for f in item["files"]]])


def test_weights_changed_after_tuning_leave_the_baked_artifact_out_with_the_reason(tuned):
    """An artifact with the weights baked in would serve the old weights: once the module's weights change it is
    left out, with what changed and how to get a current one (a load of its own: the shared one stays intact)."""
    pipe = ait.load(Pipe(), tuned.path)
    assert set(pipe.mlp.deployment_artifacts()) == {"graph0"}
    with torch.no_grad():
        pipe.mlp[0].weight.add_(1.0)
    reasons: dict = {}
    assert pipe.mlp.deployment_artifacts(reasons) == {}
    assert "'0.weight' was changed in place" in reasons["graph0"] and "re-tune" in reasons["graph0"]
    assert set(pipe.encoder.deployment_artifacts()) == {"graph0"}  # the encoder's weights did not change
    pipe = ait.load(Pipe(), tuned.path)
    with torch.no_grad():
        pipe.mlp[0].weight.data.add_(1.0)  # through .data: no version counter moves
    assert pipe.mlp.deployment_artifacts(reasons) == {} and "edited through .data" in reasons["graph0"]


def test_export_refuses_a_non_empty_folder_and_leaves_it_untouched(tuned, tmp_path, capsys):
    target = tmp_path / "mine"
    target.mkdir()
    (target / "notes.txt").write_text("keep me")
    assert main(["export", str(tuned.path), str(target)]) == 1
    assert "is not empty" in capsys.readouterr().err
    assert [p.name for p in target.iterdir()] == ["notes.txt"] and (target / "notes.txt").read_text() == "keep me"
    with pytest.raises(ConfigError, match="not empty"):
        export_checkpoint(tuned.path, target)
    # --overwrite writes its own files beside the user's and keeps them
    assert main(["export", str(tuned.path), str(target), "--overwrite"]) == 0
    assert (target / "notes.txt").read_text() == "keep me" and (target / "manifest.json").is_file()


def test_a_failed_overwrite_keeps_the_earlier_files_and_a_hard_link_is_not_written_through(tuned, tmp_path):
    """--overwrite stages every file under a temporary name and renames it over its destination at the end: a
    failure leaves the earlier export's files as they were, and a destination hard-linked to a file outside the
    folder gets a new file, the outside file keeps its contents."""
    target = tmp_path / "deploy"
    assert main(["export", str(tuned.path), str(target)]) == 0
    files = {p: p.read_bytes() for p in target.rglob("*") if p.is_file() and p.name != "manifest.json"}
    (target / "manifest.json").unlink()
    (target / "manifest.json").mkdir()  # something in the way of the last file: the export fails late
    assert main(["export", str(tuned.path), str(target), "--overwrite"]) == 1
    assert {p: p.read_bytes() for p in target.rglob("*") if p.is_file()} == files  # no temporaries left either
    (target / "manifest.json").rmdir()
    outside = tmp_path / "precious.txt"
    outside.write_text("user data")
    model = next(p for p in files if p.suffix == ".onnx")
    model.unlink()
    os.link(outside, model)
    assert main(["export", str(tuned.path), str(target), "--overwrite"]) == 0
    assert outside.read_text() == "user data" and model.read_bytes() == files[model]


@pytest.mark.parametrize("edit", ["dotdot", "absolute", "artifacts_dir"])
def test_a_hostile_file_name_cannot_write_outside_the_folder(tuned, tmp_path, edit):
    def hostile(manifest):
        graph = next(m for m in manifest["modules"] if m["name"] == "encoder")["graphs"][0]
        if edit == "dotdot":
            graph["metadata"]["onnx_file"] = "../../../escaped.onnx"
        elif edit == "absolute":
            graph["metadata"]["onnx_file"] = str(tmp_path / "escaped.onnx")
        else:
            graph["artifacts_dir"] = "../../.."
    path = rewrite_archive(tuned.path, tmp_path / "hostile.ait", edit_manifest=hostile)
    target = tmp_path / "out" / "deploy"
    with pytest.raises(CheckpointIntegrityError):
        export_checkpoint(path, target)
    assert not (tmp_path / "out").exists()
    assert sorted(p.name for p in tmp_path.rglob("*")) == sorted(["hostile.ait", "hostile_sha256_sums.txt"])
    assert main(["export", str(path), str(target)]) == 1


def test_tensorrt_artifact_from_stored_metadata(tmp_path):
    """Written against TensorRTBackend._save's metadata (no engine runs here): bounds span the profiles."""
    metadata = {
        "engine": "model.plan",
        "profiles": [{"input_x": [[1, 4], [2, 4], [4, 4]]}, {"input_x": [[4, 4], [8, 4], [16, 4]]}],
        "inputs": [{"name": "input_x", "leaf_index": 0, "path": "x", "dtype": "float16"}],
        "output_names": ["output"],
        "outputs": {"spec": {"kind": "leaf"}, "slots": [{"tensor": "float16"}]},
        "build_info": {"tensorrt_version": "10.3.0"},
    }
    graph = GraphFacts(name="graph0", input_paths=["x"], constants={}, axes={0: ["batch", "static"]},
                       dim_names={0: [None, None]}, device="cuda:1")
    config = {"type": "TensorRTBackendConfig", "version": 1, "data": {"use_cuda_graphs": True}}
    artifact = TensorRTBackend.artifact_from_metadata(metadata, tmp_path, config, graph)
    assert artifact.format == "tensorrt_engine"
    assert artifact.files == (tmp_path / "model.plan", tmp_path / "model_optimization_profiles.json")
    (x,) = artifact.inputs
    assert (x.name, x.path, x.dtype, x.min_shape, x.max_shape, x.shape, x.batch_axis) == \
        ("input_x", "x", "float16", (1, 4), (16, 4), ("batch", 4), 0)
    assert artifact.runtime["cuda_graphs"] is True and artifact.runtime["profiles"] == metadata["profiles"]
    assert [(o.name, o.dtype) for o in artifact.outputs] == [("output", "float16")]
    assert DeploymentArtifact.from_json(json.loads(json.dumps(artifact.to_json()))) == artifact


def test_the_readme_recipe_and_its_export_command_run_as_written(tmp_path, monkeypatch):
    """The code block of README.md's "Deployment artifacts" (it asserts the bare session matches the tuned module),
    then the ``aitune export`` command the section gives, in a fresh folder."""
    import onnxruntime

    scope = run_readme_block("## Deployment artifacts", tmp_path, monkeypatch)
    assert "aitune export checkpoints/mlp.ait deploy/" in readme_section("## Deployment artifacts")
    assert main(["export", "checkpoints/mlp.ait", "deploy/"]) == 0
    manifest = json.loads((tmp_path / "deploy" / "manifest.json").read_text())
    artifact = DeploymentArtifact.from_json(manifest["artifacts"][0], relative_to=tmp_path / "deploy")
    session = onnxruntime.InferenceSession(str(artifact.model_file), providers=["CPUExecutionProvider"])
    x = torch.randn(3, 8)
    (y,) = session.run([t.name for t in artifact.outputs], {artifact.inputs[0].name: x.numpy()})
    with torch.no_grad():
        torch.testing.assert_close(torch.from_numpy(y), scope["mlp"](x), atol=1e-5, rtol=1e-5)
