"""ait.save / ait.load / describe_checkpoint on real backends (no mocks), and every checkpoint error.

Round trips load in a FRESH PROCESS (``sys.executable``): the child builds the same pipeline class with
other weights (JIT checkpoints must restore them) or with no weights at all (``meta`` device: AOT
checkpoints must not need them), loads, and writes its outputs; the parent compares them with the tuned
pipeline's outputs (within 1e-6) and the tuned outputs with eager.

Compiles: one Inductor JIT (head), one AOTInductor (bf16 MLP), two ONNX Runtime exports; everything else
uses the eager backend or edits saved archives.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

import aitune
import aitune.torch as ait
import checkpoint_models as models
from checkpoint_edits import rewrite_archive
from aitune.errors import CheckpointError, CheckpointIntegrityError, CheckpointVersionError
from aitune.torch.backend import (
    ONNXRuntimeBackend,
    TorchAOBackend,
    TorchAOBackendConfig,
    TorchEagerBackend,
    TorchInductorAotBackend,
    TorchInductorJitBackend,
    TorchInductorJitBackendConfig,
)
from aitune.torch.checkpoint import FORMAT_VERSION, describe_checkpoint, sums_path
from aitune.torch.check.correctness import OutputComparator, Tolerance
from aitune.torch.common.environment import device_facts
from aitune.torch.common.requirements import installed_version
from aitune.torch.measure.profiling import ProfilingConfig

REPO_ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
FAST = ProfilingConfig(warmup_rounds=1, min_rounds=3, max_rounds=10, time_budget_s=0.1)

needs_aot = pytest.mark.skipif(
    not (ONNXRuntimeBackend.availability().ok and TorchInductorAotBackend.availability().ok),
    reason=f"onnxruntime: {ONNXRuntimeBackend.availability().reason or 'ok'}; "
           f"inductor_aot: {TorchInductorAotBackend.availability().reason or 'ok'}")


def only(backend):
    """Use exactly ``backend`` (no performance gate: these tests check restoring, not speed)."""
    return ait.OneBackendStrategy(backend, profiling_config=FAST).enable_performance_validation(False)


def eager_outputs(seed: int = 0) -> dict:
    with torch.no_grad():
        return models.flatten_outputs(models.Pipeline(seed)(models.probe()))


# ---------------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def jit_checkpoint(tmp_path_factory):
    """encoder: eager, head: Inductor JIT (tied weights), mlp: TorchAO int8 weight-only."""
    root = tmp_path_factory.mktemp("jit")
    pipe = models.Pipeline(seed=0)
    pipe.encoder = ait.Module(pipe.encoder, "encoder", strategy=only(TorchEagerBackend()))
    pipe.head = ait.Module(pipe.head, "head", strategy=only(TorchInductorJitBackend()))
    torchao = TorchAOBackend.availability().ok
    mlp_backend = (TorchAOBackend(TorchAOBackendConfig(quantization="int8wo", compile=False)) if torchao
                   else TorchEagerBackend())
    pipe.mlp = ait.Module(pipe.mlp, "mlp", strategy=only(mlp_backend))
    report = ait.tune(pipe, models.dataset(), cache_dir_path=root / "cache", ready_batches=True)
    assert not report.module_errors, report.module_errors
    with torch.no_grad():
        expected = models.flatten_outputs(pipe(models.probe()))
    path = ait.save(pipe, root / "pipeline.ait")
    return SimpleNamespace(path=path, expected=expected, pipe=pipe, root=root,
                           backends={"encoder": "eager", "head": "inductor_jit", "mlp": mlp_backend.name})


@pytest.fixture(scope="module")
def aot_checkpoint(tmp_path_factory):
    """encoder and head: ONNX Runtime (CPU EP); mlp: AOTInductor. No weights are stored."""
    if not (ONNXRuntimeBackend.availability().ok and TorchInductorAotBackend.availability().ok):
        pytest.skip("needs onnxruntime and AOTInductor")
    root = tmp_path_factory.mktemp("aot")
    pipe = models.Pipeline(seed=0)
    pipe.encoder = ait.Module(pipe.encoder, "encoder", strategy=only(ONNXRuntimeBackend()))
    pipe.head = ait.Module(pipe.head, "head", strategy=only(ONNXRuntimeBackend()))
    pipe.mlp = ait.Module(pipe.mlp, "mlp", strategy=only(TorchInductorAotBackend()))
    report = ait.tune(pipe, models.dataset(), cache_dir_path=root / "cache", ready_batches=True)
    assert not report.module_errors, report.module_errors
    with torch.no_grad():
        expected = models.flatten_outputs(pipe(models.probe()))
    path = ait.save(pipe, root / "pipeline.ait")
    return SimpleNamespace(path=path, expected=expected, pipe=pipe, root=root,
                           backends={"encoder": "onnxruntime", "head": "onnxruntime", "mlp": "inductor_aot"})


@pytest.fixture(scope="module")
def eager_checkpoint(tmp_path_factory):
    """A root wrapper (an Encoder) tuned with eager: cheap to load in-process many times."""
    root = tmp_path_factory.mktemp("eager")
    torch.manual_seed(0)
    encoder = ait.Module(models.Encoder().eval(), "encoder", strategy=only(TorchEagerBackend()))
    ait.tune(lambda batch: encoder(batch[0], pooling="mean", scale=0.5), models.dataset(),
             cache_dir_path=root / "cache", ready_batches=True)
    features, _ = models.probe()
    with torch.no_grad():
        expected = encoder(features, pooling="mean", scale=0.5)
    path = ait.save(encoder, root / "encoder.ait")
    return SimpleNamespace(path=path, expected=expected, encoder=encoder, root=root)


# ---------------------------------------------------------------------------------------------- helpers

CHILD = textwrap.dedent('''
    import json, sys
    from pathlib import Path

    import torch
    from safetensors.torch import save_file

    import aitune.torch as ait
    import checkpoint_models as models

    checkpoint, mode, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    if mode == "aot":
        with torch.device("meta"):
            pipe = models.Pipeline(seed=123)  # no weights at all: AOT artifacts must not need them
    else:
        pipe = models.Pipeline(seed=123)  # other weights than the tuned ones: load must restore them
        with torch.no_grad():
            save_file(models.flatten_outputs(pipe(models.probe())), str(out / "before_load.safetensors"))
    assert ait.load(pipe, checkpoint) is pipe
    with torch.no_grad():
        outputs = pipe(models.probe())
    save_file(models.flatten_outputs(outputs), str(out / "loaded.safetensors"))
    info = {name: {"wrapped": isinstance(getattr(pipe, name), ait.Module), "state": getattr(pipe, name).state.value,
                   "backends": {g: b.name for g, b in getattr(pipe, name).backends.items()}}
            for name in ("encoder", "head", "mlp")}
    info["encoder_output"] = [type(outputs["encoder"]).__qualname__, outputs["encoder"].scale]
    (out / "info.json").write_text(json.dumps(info))
''')


def run_child(checkpoint: Path, mode: str, out: Path) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    script = out / "child.py"
    script.write_text(CHILD)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO_ROOT), str(HERE)]))
    result = subprocess.run([sys.executable, str(script), str(checkpoint), mode, str(out)], env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"child failed ({result.returncode}):\n{result.stderr[-4000:]}"
    return json.loads((out / "info.json").read_text())


def copy_checkpoint(source: Path, target_dir: Path, name: str = "copy.ait") -> Path:
    target = target_dir / name
    target.write_bytes(source.read_bytes())
    sums_path(target).write_bytes(sums_path(source).read_bytes())
    return target


def rewrite(source: Path, target: Path, *, replace: dict | None = None, drop: tuple = (), resign: bool = True,
            side: str = "update") -> Path:
    """Rebuild an archive with members replaced/dropped (:func:`checkpoint_edits.rewrite_archive`)."""
    return rewrite_archive(source, target, replace=replace, drop=drop, resign=resign, side=side)


def read_manifest(path: Path) -> dict:
    with zipfile.ZipFile(path) as zf:
        return json.loads(zf.read("manifest.json"))


def edit_manifest(source: Path, target: Path, edit) -> Path:
    manifest = read_manifest(source)
    edit(manifest)
    return rewrite(source, target, replace={"manifest.json": json.dumps(manifest).encode()})


def module_entry(manifest: dict, name: str) -> dict:
    return next(module for module in manifest["modules"] if module["name"] == name)


# ---------------------------------------------------------------------------------------------- round trips


def test_jit_checkpoint_round_trip_in_a_fresh_process(jit_checkpoint, tmp_path):
    # The tuned pipeline agrees with eager (quantized mlp: by SQNR/cosine).
    eager = eager_outputs()
    for name in ("encoder.hidden", "encoder.pooled", "head"):
        OutputComparator(Tolerance()).compare(eager[name], jit_checkpoint.expected[name])
    OutputComparator(Tolerance(), quantized=jit_checkpoint.backends["mlp"] == "torchao").compare(
        eager["mlp"], jit_checkpoint.expected["mlp"])

    info = run_child(jit_checkpoint.path, "jit", tmp_path)
    for name, backend in jit_checkpoint.backends.items():
        assert info[name] == {"wrapped": True, "state": "tuned", "backends": {"graph0": backend}}
    assert info["encoder_output"] == ["EncoderOutput", 0.5]
    before = load_file(str(tmp_path / "before_load.safetensors"))
    loaded = load_file(str(tmp_path / "loaded.safetensors"))
    # The child's own weights (seed 123) give other outputs: equal outputs below come from restored weights.
    assert not torch.allclose(before["head"], jit_checkpoint.expected["head"], atol=1e-3)
    for name, expected in jit_checkpoint.expected.items():
        torch.testing.assert_close(loaded[name], expected, rtol=0, atol=1e-6, msg=name)


@needs_aot
def test_aot_checkpoint_round_trip_in_a_fresh_process_without_weights(aot_checkpoint, tmp_path):
    eager = eager_outputs()
    for name, expected in aot_checkpoint.expected.items():
        OutputComparator(Tolerance()).compare(eager[name], expected)
    info = run_child(aot_checkpoint.path, "aot", tmp_path)  # the child's model lives on the meta device
    for name, backend in aot_checkpoint.backends.items():
        assert info[name] == {"wrapped": True, "state": "tuned", "backends": {"graph0": backend}}
    assert info["encoder_output"] == ["EncoderOutput", 0.5]
    loaded = load_file(str(tmp_path / "loaded.safetensors"))
    for name, expected in aot_checkpoint.expected.items():
        torch.testing.assert_close(loaded[name], expected, rtol=0, atol=1e-6, msg=name)


def test_load_wraps_a_plain_root_module_and_restores_its_weights(eager_checkpoint):
    torch.manual_seed(77)
    plain = models.Encoder().eval()
    loaded = ait.load(plain, eager_checkpoint.path)
    assert isinstance(loaded, ait.Module) and loaded.__wrapped__ is plain
    assert loaded.state is ait.ModuleState.TUNED and loaded.name == "encoder"
    assert [graph.name for graph in loaded.graphs] == ["graph0"]
    features, _ = models.probe()
    with torch.no_grad():
        output = loaded(features, pooling="mean", scale=0.5)
    assert isinstance(output, models.EncoderOutput) and output.scale == 0.5
    torch.testing.assert_close(output.hidden, eager_checkpoint.expected.hidden, rtol=0, atol=0)
    torch.testing.assert_close(output.pooled, eager_checkpoint.expected.pooled, rtol=0, atol=0)
    # The recorded samples came back with their ranges: the loaded wrapper saves again identically.
    graph = loaded.graphs[0]
    assert [spec.axes for spec in graph.tensor_specs] == [
        spec.axes for spec in eager_checkpoint.encoder.graphs[0].tensor_specs]
    assert len(graph.samples) == 2 and graph.constants == {"pooling": "mean", "scale": 0.5}


def test_a_loaded_module_saves_again(eager_checkpoint, tmp_path):
    torch.manual_seed(5)
    loaded = ait.load(models.Encoder().eval(), eager_checkpoint.path)
    again = ait.save(loaded, tmp_path / "again.ait")
    first, second = read_manifest(eager_checkpoint.path), read_manifest(again)
    for key in ("tensor_specs", "constants", "input_structure", "output_structure", "config", "tune_row"):
        assert first["modules"][0]["graphs"][0][key] == second["modules"][0]["graphs"][0][key], key


# ---------------------------------------------------------------------------------------------- contents


def test_manifest_layout_weights_only_for_jit_modules(jit_checkpoint, aot_checkpoint):
    manifest = read_manifest(jit_checkpoint.path)
    assert manifest["format_version"] == FORMAT_VERSION
    assert manifest["versions"]["torch"] == torch.__version__ and manifest["device"]["type"] == "cpu"
    head = module_entry(manifest, "head")
    assert head["path"] == [["attr", "head"]] and head["weights"]
    # Tied weights are stored once; the alias is recorded.
    assert head["weight_aliases"] == {"out.weight": "proj.weight"} and head["num_weight_tensors"] == 2
    graph = head["graphs"][0]
    assert graph["backend"] == "inductor_jit" and graph["build_mode"] == "jit"
    assert graph["config"]["type"] == "TorchInductorJitBackendConfig"
    assert graph["tune_row"]["status"] == "selected" and graph["tune_row"]["measurement"]["p50_ms"] > 0
    encoder_graph = module_entry(manifest, "encoder")["graphs"][0]
    assert encoder_graph["input_structure"]["children"][1]["children"][0]["type"] == "checkpoint_models:Features"
    assert encoder_graph["output_structure"]["type"] == "checkpoint_models:EncoderOutput"
    assert {c["path"]: c["value"] for c in encoder_graph["constants"]} == {"pooling": "mean", "scale": 0.5}

    aot = read_manifest(aot_checkpoint.path)
    with zipfile.ZipFile(aot_checkpoint.path) as zf:
        names = set(zf.namelist())
    assert all(module["weights"] is None for module in aot["modules"])
    assert not any(name.endswith("weights.safetensors") for name in names)
    for module in aot["modules"]:
        graph = module["graphs"][0]
        assert graph["build_mode"] == "aot" and graph["artifacts"]
        assert all(f"{graph['artifacts_dir']}/{artifact}" in names for artifact in graph["artifacts"])


def test_sums_file_beside_the_archive_matches_every_member(jit_checkpoint):
    side = sums_path(jit_checkpoint.path)
    assert side.name == "pipeline_sha256_sums.txt"
    with zipfile.ZipFile(jit_checkpoint.path) as zf:
        assert side.read_bytes() == zf.read("SHA256SUMS")
        lines = side.read_text().splitlines()
        names = [line.split("  ", 1)[1] for line in lines]
        assert names == sorted(names) and set(names) == set(zf.namelist()) - {"SHA256SUMS"}
        for line in lines:
            digest, name = line.split("  ")
            assert hashlib.sha256(zf.read(name)).hexdigest() == digest


def test_describe_checkpoint_loads_no_code_and_no_tensors(jit_checkpoint, aot_checkpoint, monkeypatch):
    import safetensors.torch

    def refuse(*args, **kwargs):
        raise AssertionError("describe_checkpoint must not load tensors")

    monkeypatch.setattr(safetensors.torch, "load_file", refuse)
    monkeypatch.setattr(safetensors.torch, "load", refuse)
    monkeypatch.delitem(sys.modules, "checkpoint_models")  # its types are named in the manifest
    text = describe_checkpoint(jit_checkpoint.path)
    assert "checkpoint_models" not in sys.modules
    for expected in ("format 1", f"torch {torch.__version__}", "module 'encoder'", "module 'head'",
                     "TorchInductorJitBackend", "TorchEagerBackend", "weights: stored", "every SHA-256 digest matches",
                     "samples/s", "tokens: float32[2..4(b),5..7,8]", "pooling='mean'"):
        assert expected in text, expected
    aot_text = describe_checkpoint(aot_checkpoint.path)
    assert "ONNXRuntimeBackend" in aot_text and "TorchInductorAotBackend" in aot_text
    assert "not stored (every graph uses an AOT backend)" in aot_text


# ---------------------------------------------------------------------------------------------- integrity


def test_a_flipped_byte_is_refused_before_anything_is_loaded(jit_checkpoint, tmp_path):
    path = copy_checkpoint(jit_checkpoint.path, tmp_path)
    member = module_entry(read_manifest(path), "head")["weights"]
    data = bytearray(path.read_bytes())
    with zipfile.ZipFile(path) as zf:
        info = zf.getinfo(member)
    offset = info.header_offset
    start = offset + 30 + int.from_bytes(data[offset + 26:offset + 28], "little") + int.from_bytes(
        data[offset + 28:offset + 30], "little")
    data[start + info.file_size // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    pipe = models.Pipeline(seed=3)
    weight_before = pipe.head.proj.weight.clone()
    with pytest.raises(CheckpointIntegrityError, match="corrupted|digest"):
        ait.load(pipe, path)
    assert not isinstance(pipe.head, ait.Module) and torch.equal(pipe.head.proj.weight, weight_before)


def test_a_changed_member_fails_its_digest(jit_checkpoint, tmp_path):
    member = module_entry(read_manifest(jit_checkpoint.path), "head")["weights"]
    forged = tmp_path / "forged.safetensors"
    save_file({"proj.weight": torch.zeros(16, 16), "proj.bias": torch.zeros(16)}, str(forged))
    path = rewrite(jit_checkpoint.path, tmp_path / "forged.ait", replace={member: forged.read_bytes()},
                   resign=False, side="keep")
    with pytest.raises(CheckpointIntegrityError, match=f"{member} .*does not match its SHA-256 digest"):
        ait.load(models.Pipeline(seed=3), path)


def test_a_resigned_archive_disagrees_with_the_sums_beside_it(eager_checkpoint, tmp_path):
    manifest = read_manifest(eager_checkpoint.path)
    manifest["modules"][0]["name"] = "renamed"
    path = rewrite(eager_checkpoint.path, tmp_path / "resigned.ait",
                   replace={"manifest.json": json.dumps(manifest).encode()}, side="keep")
    with pytest.raises(CheckpointIntegrityError, match="encoder_sha256_sums.txt|disagrees"):
        ait.load(models.Encoder().eval(), path)


def test_a_truncated_file_is_refused(jit_checkpoint, tmp_path):
    path = tmp_path / "truncated.ait"
    data = jit_checkpoint.path.read_bytes()
    path.write_bytes(data[: len(data) * 2 // 3])
    with pytest.raises(CheckpointIntegrityError, match="truncated"):
        ait.load(models.Pipeline(seed=3), path)
    path.write_bytes(b"not a zip at all")
    with pytest.raises(CheckpointIntegrityError, match="truncated or is not an aitune checkpoint"):
        ait.load(models.Pipeline(seed=3), path)


def test_a_newer_format_version_is_refused(eager_checkpoint, tmp_path):
    path = edit_manifest(eager_checkpoint.path, tmp_path / "newer.ait",
                         lambda manifest: manifest.update(format_version=FORMAT_VERSION + 1))
    with pytest.raises(CheckpointVersionError, match=f"format version {FORMAT_VERSION + 1}.*Upgrade aitune"):
        ait.load(models.Encoder().eval(), path)
    with pytest.raises(CheckpointVersionError):
        describe_checkpoint(path)


def test_a_samples_entry_whose_count_and_batch_sizes_disagree_is_refused(eager_checkpoint, tmp_path):
    def shorter(manifest):  # edited and signed again: the archive's sums hold, the manifest's fields do not agree
        manifest["modules"][0]["graphs"][0]["samples"]["batch_sizes"] = []

    path = edit_manifest(eager_checkpoint.path, tmp_path / "samples.ait", shorter)
    with pytest.raises(CheckpointError, match=r"encoder/graph0: the manifest's 'samples' count \(\d+\) and "
                                              r"batch_sizes \(\[\]\) disagree"):
        ait.load(models.Encoder().eval(), path)


@needs_aot
def test_a_missing_artifact_is_refused(aot_checkpoint, tmp_path):
    graph = module_entry(read_manifest(aot_checkpoint.path), "mlp")["graphs"][0]
    member = f"{graph['artifacts_dir']}/{graph['artifacts'][0]}"
    path = rewrite(aot_checkpoint.path, tmp_path / "missing.ait", drop=(member,))
    with torch.device("meta"):
        pipe = models.Pipeline(seed=3)
    with pytest.raises(CheckpointIntegrityError, match=f"artifact '{graph['artifacts'][0]}' of backend 'inductor_aot'"):
        ait.load(pipe, path)
    # Listed in SHA256SUMS but absent from the archive: refused too.
    path = rewrite(aot_checkpoint.path, tmp_path / "missing2.ait", drop=(member,), resign=False, side="keep")
    with pytest.raises(CheckpointIntegrityError, match="is missing .*listed in its SHA256SUMS"):
        ait.load(pipe, path)


@needs_aot
def test_an_aot_package_outside_the_checkpoint_is_refused(aot_checkpoint, tmp_path):
    """A native library is only ever loaded from the checkpoint's verified members (manifest edited, re-summed)."""
    manifest = read_manifest(aot_checkpoint.path)
    graph = module_entry(manifest, "mlp")["graphs"][0]
    outside = tmp_path / "outside.pt2"
    with zipfile.ZipFile(aot_checkpoint.path) as zf:
        outside.write_bytes(zf.read(f"{graph['artifacts_dir']}/{graph['metadata']['package']}"))
    graph["metadata"]["package"] = str(outside)
    path = rewrite(aot_checkpoint.path, tmp_path / "outside.ait", replace={"manifest.json": json.dumps(manifest).encode()})
    with torch.device("meta"):
        pipe = models.Pipeline(seed=3)
    with pytest.raises(CheckpointIntegrityError, match=r"inductor_aot metadata 'package' is '/.*outside\.pt2', which "
                                                       "is absolute"):
        ait.load(pipe, path)


def test_missing_weights_are_refused(jit_checkpoint, tmp_path):
    member = module_entry(read_manifest(jit_checkpoint.path), "encoder")["weights"]
    path = rewrite(jit_checkpoint.path, tmp_path / "noweights.ait", drop=(member,))
    with pytest.raises(CheckpointIntegrityError, match="weights of module 'encoder'.*missing"):
        ait.load(models.Pipeline(seed=3), path)


@pytest.mark.parametrize("name", ["../evil.txt", "/tmp/aitune-evil.txt", "modules/../../evil.txt",
                                  "modules\\..\\evil.txt", "C:/evil.txt", "modules/./x"])
def test_unsafe_member_names_are_refused(eager_checkpoint, tmp_path, name):
    path = rewrite(eager_checkpoint.path, tmp_path / "unsafe.ait", replace={name: b"payload"})
    with pytest.raises(CheckpointIntegrityError, match="unsafe member name"):
        ait.load(models.Encoder().eval(), path)
    assert not (tmp_path.parent / "evil.txt").exists() and not Path("/tmp/aitune-evil.txt").exists()


def test_an_unlisted_member_is_refused(eager_checkpoint, tmp_path):
    with zipfile.ZipFile(eager_checkpoint.path) as zf:
        members = {info.filename: zf.read(info) for info in zf.infolist()}
    members["modules/0/extra.bin"] = b"smuggled"
    path = tmp_path / "unlisted.ait"
    with zipfile.ZipFile(path, "w") as zf:
        for member, data in members.items():
            zf.writestr(member, data)
    with pytest.raises(CheckpointIntegrityError, match="not listed in SHA256SUMS: modules/0/extra.bin"):
        ait.load(models.Encoder().eval(), path)


# ---------------------------------------------------------------------------------------------- clear errors


def test_a_structure_type_that_is_not_imported_is_a_clear_error(eager_checkpoint, monkeypatch):
    encoder = models.Encoder().eval()
    monkeypatch.delitem(sys.modules, "checkpoint_models")
    with pytest.raises(CheckpointError, match=r"type 'Features' from module 'checkpoint_models'.*import it first "
                                              r"\(import checkpoint_models\)"):
        ait.load(encoder, eager_checkpoint.path)
    assert "checkpoint_models" not in sys.modules  # never imported by the checkpoint


def test_save_refuses_a_constant_that_is_not_json(tmp_path):
    class Scale(nn.Module):
        def forward(self, x, columns):
            return x[:, columns] * 2

    module = ait.Module(Scale(), "scale", strategy=only(TorchEagerBackend()))
    ait.tune(lambda x: module(x, slice(0, 2)), [torch.randn(2, 3)], cache_dir_path=tmp_path / "cache", ready_batches=True)
    with pytest.raises(CheckpointError, match=r"input 'columns' is a constant of type builtins.slice.*JSON constants"):
        ait.save(module, tmp_path / "scale.ait")
    assert not (tmp_path / "scale.ait").exists()


def test_save_refuses_an_input_type_defined_inside_a_function(tmp_path):
    from typing import NamedTuple

    class Local(NamedTuple):
        x: torch.Tensor

    class Identity(nn.Module):
        def forward(self, pair):
            return pair.x + 1

    module = ait.Module(Identity(), "local", strategy=only(TorchEagerBackend()))
    ait.tune(lambda x: module(Local(x)), [torch.randn(2, 3)], cache_dir_path=tmp_path / "cache", ready_batches=True)
    with pytest.raises(CheckpointError, match="defined inside a function.*define it at module level"):
        ait.save(module, tmp_path / "local.ait")


def test_save_refuses_an_object_without_tuned_modules(tmp_path):
    with pytest.raises(CheckpointError, match="no tuned aitune.torch.Module found in Encoder"):
        ait.save(models.Encoder(), tmp_path / "none.ait")
    untuned = ait.Module(models.Encoder(), "untuned")
    with pytest.raises(CheckpointError, match=r"found untuned ones: untuned.*ait.tune"):
        ait.save(untuned, tmp_path / "none.ait")


def test_load_into_another_structure_names_the_path(jit_checkpoint, eager_checkpoint):
    class Other:
        def __init__(self):
            self.encoder = models.Encoder()

    with pytest.raises(CheckpointError, match="tuned module at head, but Other has nothing at head"):
        ait.load(Other(), jit_checkpoint.path)
    with pytest.raises(CheckpointError, match="holds a Pipeline, not an nn.Module"):
        ait.load(models.Pipeline(seed=1), eager_checkpoint.path)
    with pytest.raises(CheckpointError, match="saved from a checkpoint_models.Encoder and cannot be loaded into a "
                                              "checkpoint_models.TiedHead"):
        ait.load(models.TiedHead(), eager_checkpoint.path)


def test_another_environment_loads_with_a_warning_that_says_what_differs(eager_checkpoint, tmp_path, caplog):
    def edit(manifest):
        manifest["versions"].update(torch="2.0.0", aitune="0.0.1", cuda="99.0")
        graph = manifest["modules"][0]["graphs"][0]
        graph["device"] = "cuda:0"
        graph["device_facts"] = {"type": "cuda", "index": 0, "name": "NVIDIA H200", "capability": [9, 0]}
        # packages the graph ran on beyond its backend class's own (a kernel selector's delegate and providers):
        # compared with what is installed here, whichever backend class the graph names
        graph["packages"] = {"onnxruntime": "0.1.0 (onnxruntime-gpu)", "sageattention": "0.0.1",
                             "a_plugins_package": "1.0"}  # declared by nothing imported here

    path = edit_manifest(eager_checkpoint.path, tmp_path / "other.ait", edit)
    with caplog.at_level("WARNING", logger="aitune"):
        loaded = ait.load(models.Encoder().eval(), path, device="cpu")
    text = " ".join(record.getMessage() for record in caplog.records)
    assert f"torch 2.0.0 -> {torch.__version__}" in text
    assert f"aitune 0.0.1 -> {aitune.__version__}" in text and f"cuda 99.0 -> {torch.version.cuda}" in text
    assert "encoder/graph0 was tuned on cuda and is rebuilt on cpu (eager)" in text
    assert f"encoder/graph0: onnxruntime 0.1.0 (onnxruntime-gpu) -> {installed_version('onnxruntime')}" in text
    assert f"encoder/graph0: sageattention 0.0.1 -> {installed_version('sageattention')}" in text
    assert "encoder/graph0: a_plugins_package 1.0 -> not installed" in text
    features, _ = models.probe()
    with torch.no_grad():
        output = loaded(features, pooling="mean", scale=0.5)
    torch.testing.assert_close(output.pooled, eager_checkpoint.expected.pooled, rtol=0, atol=0)

    def other_cpu(manifest):  # the same device type, another processor
        manifest["modules"][0]["graphs"][0]["device_facts"]["name"] = "Another CPU"

    caplog.clear()
    with caplog.at_level("WARNING", logger="aitune"):
        ait.load(models.Encoder().eval(), edit_manifest(eager_checkpoint.path, tmp_path / "cpu.ait", other_cpu))
    here = device_facts("cpu")["name"]
    assert f"encoder/graph0: device 'Another CPU' -> {here!r}" in " ".join(r.getMessage() for r in caplog.records)

    def unavailable_backend(manifest):  # rebuilt as eager here: the packages it ran on no longer matter
        graph = manifest["modules"][0]["graphs"][0]
        graph.update(backend="torch_tensorrt_jit", config={}, packages={"torch_tensorrt": "2.0.0"})

    caplog.clear()
    with caplog.at_level("WARNING", logger="aitune"):
        ait.load(models.Encoder().eval(), edit_manifest(eager_checkpoint.path, tmp_path / "trt.ait",
                                                        unavailable_backend))
    text = " ".join(r.getMessage() for r in caplog.records)
    assert "encoder/graph0: backend 'torch_tensorrt_jit' is unavailable here" in text and "it runs eager" in text
    assert "torch_tensorrt 2.0.0 ->" not in text


def _as_inductor_jit(options: dict):
    def edit(manifest):  # the eager checkpoint's graph, as if tuned with Inductor JIT and these options
        graph = manifest["modules"][0]["graphs"][0]
        graph.update(backend="inductor_jit", packages={},
                     config={"type": "TorchInductorJitBackendConfig", "version": 1, "data": {"options": options}})
    return edit


def test_a_jit_backend_that_fails_to_rebuild_at_load_serves_eager_with_a_warning(eager_checkpoint, tmp_path, caplog):
    # Inductor's own test switch makes its compile raise here: the JIT rebuild fails where the checkpoint is loaded
    path = edit_manifest(eager_checkpoint.path, tmp_path / "fails.ait",
                         _as_inductor_jit({"_raise_error_for_testing": True}))
    with caplog.at_level("WARNING", logger="aitune"):
        loaded = ait.load(models.Encoder().eval(), path, device="cpu")
    text = " ".join(record.getMessage() for record in caplog.records)
    assert "encoder/graph0: rebuilding backend 'inductor_jit' failed here" in text and "runs eager" in text
    backend = loaded.backends["graph0"]
    assert backend.name == "eager" and backend.build_info["rebuild_failed"].startswith("inductor_jit:")
    features, _ = models.probe()
    with torch.no_grad():
        output = loaded(features, pooling="mean", scale=0.5)
    torch.testing.assert_close(output.pooled, eager_checkpoint.expected.pooled, rtol=0, atol=0)


def test_a_cpp_wrapper_build_that_fails_at_load_compiles_without_it(eager_checkpoint, tmp_path, caplog, monkeypatch):
    # Fault injection (not a stand-in for Inductor): the C++ wrapper's compile is made to fail here by adding
    # Inductor's own test switch to it; the plain compile then runs for real.
    real = TorchInductorJitBackendConfig.compile_arguments

    def cpp_wrapper_fails(config):
        mode, options = real(config)
        return (mode, {**options, "_raise_error_for_testing": True}) if (options or {}).get("cpp_wrapper") else \
            (mode, options)

    monkeypatch.setattr(TorchInductorJitBackendConfig, "compile_arguments", cpp_wrapper_fails)
    path = edit_manifest(eager_checkpoint.path, tmp_path / "cpp.ait", _as_inductor_jit({"cpp_wrapper": True}))
    with caplog.at_level("WARNING", logger="aitune"):
        loaded = ait.load(models.Encoder().eval(), path, device="cpu")
    assert "compiling with the C++ wrapper failed here" in " ".join(record.getMessage() for record in caplog.records)
    backend = loaded.backends["graph0"]
    assert backend.name == "inductor_jit" and not backend.config.options and backend.build_info["cpp_wrapper_failed"]
    features, _ = models.probe()
    with torch.no_grad():
        output = loaded(features, pooling="mean", scale=0.5)
    torch.testing.assert_close(output.pooled, eager_checkpoint.expected.pooled)
    assert loaded.stats["backend_calls"] >= 1


@needs_aot
def test_an_aot_artifact_for_another_device_type_is_refused(aot_checkpoint, tmp_path):
    def edit(manifest):
        graph = module_entry(manifest, "mlp")["graphs"][0]
        graph["device"] = "cuda:0"
        graph["device_facts"] = {"type": "cuda", "index": 0, "name": "NVIDIA H200", "capability": [9, 0]}

    path = edit_manifest(aot_checkpoint.path, tmp_path / "cuda.ait", edit)
    with torch.device("meta"):
        pipe = models.Pipeline(seed=3)
    with pytest.raises(CheckpointError, match=r"mlp/graph0 uses the AOT backend 'inductor_aot', whose artifact was "
                                              r"built for cuda \(NVIDIA H200\); it cannot run on cpu"):
        ait.load(pipe, path)
    assert not isinstance(pipe.mlp, ait.Module)  # nothing was installed


class Holder(nn.Module):
    """An nn.Module parent: its wrapped child is addressed as a submodule (["module", "encoder"])."""

    def __init__(self):
        super().__init__()
        self.encoder = models.Encoder().eval()
        self.scale = nn.Parameter(torch.tensor(2.0))

    def forward(self, features):
        return self.encoder(features, pooling="max", scale=1.0).pooled * self.scale


def test_a_wrapped_submodule_is_wrapped_again_in_its_parent(tmp_path):
    torch.manual_seed(0)
    holder = Holder()
    holder.encoder = ait.Module(holder.encoder, "inner", strategy=only(TorchEagerBackend()))
    ait.tune(lambda batch: holder(batch[0]), models.dataset(), cache_dir_path=tmp_path / "cache", ready_batches=True)
    features, _ = models.probe()
    with torch.no_grad():
        expected = holder(features)
    path = ait.save(holder, tmp_path / "holder.ait")
    assert read_manifest(path)["modules"][0]["path"] == [["module", "encoder"]]

    torch.manual_seed(9)
    fresh = Holder()
    assert ait.load(fresh, path) is fresh
    assert isinstance(fresh.encoder, ait.Module) and fresh.encoder.state is ait.ModuleState.TUNED
    assert fresh._modules["encoder"] is fresh.encoder
    with torch.no_grad():
        fresh.scale.fill_(2.0)  # not part of the checkpoint: only the wrapped module's weights are stored
        torch.testing.assert_close(fresh(features), expected, rtol=0, atol=0)


@needs_aot
def test_aot_load_never_falls_back_to_eager_with_wrong_weights(aot_checkpoint):
    """A call outside the artifacts' range must not run eager with weights other than the tuned ones
    (found by trying the README as a new user: batch 16 silently differed by ~1.0)."""
    from aitune.errors import BackendRuntimeError

    outside = models.make_batch(9, 6, 5)  # batch 9 > recorded max 4: the artifacts do not take it
    tuned = aot_checkpoint.pipe
    with torch.no_grad():
        reference = tuned.mlp.module(outside[1])  # the tuned pipeline's own weights, run eagerly

    other = ait.load(models.Pipeline(seed=77), aot_checkpoint.path)  # different random weights
    with torch.no_grad():
        inside = other(models.probe())  # in range: the artifacts run, so values are the tuned ones
        for key, value in models.flatten_outputs(inside).items():
            torch.testing.assert_close(value, aot_checkpoint.expected[key], atol=1e-5, rtol=1e-5)
        with pytest.raises(BackendRuntimeError, match="weights differ"):
            other.mlp(outside[1])

    same = models.Pipeline(seed=0)  # the weights it was tuned with: fallback is correct and allowed
    loaded = ait.load(same, aot_checkpoint.path)
    with torch.no_grad():
        torch.testing.assert_close(loaded.mlp(outside[1]), reference)

    with torch.device("meta"):
        empty = models.Pipeline(seed=1)
    ait.load(empty, aot_checkpoint.path)
    with pytest.raises(BackendRuntimeError, match="without weights"):
        empty.mlp(outside[1])


def test_load_names_mismatches_clearly(eager_checkpoint, caplog):
    import logging

    with caplog.at_level(logging.WARNING):
        loaded = ait.load(ait.Module(models.Encoder().eval(), "renamed"), eager_checkpoint.path)
    assert loaded.state is ait.ModuleState.TUNED
    assert any("'encoder'" in r.message and "'renamed'" in r.message for r in caplog.records)

    class Wider(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(8, 32)

        def forward(self, tokens, mask, pooling="mean", scale=1.0):
            return self.proj(tokens)

    with pytest.raises(CheckpointError, match="cannot be loaded into a .*Wider: construct the same model"):
        ait.load(ait.Module(Wider(), "encoder"), eager_checkpoint.path)
    wider_encoder = models.Encoder().eval()  # the same class, other shapes: the first difference is named
    wider_encoder.embed = nn.Linear(8, 32)
    with pytest.raises(CheckpointError, match=r"'embed.weight' has shape \[32, 8\] here but \[16, 8\]"):
        ait.load(ait.Module(wider_encoder, "encoder"), eager_checkpoint.path)


class Affine(nn.Module):
    """Small weights (|output| < 1) so a bias shift is the whole, controlled, difference from the artifact."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(4, 3)
        with torch.no_grad():
            self.linear.weight.mul_(0.25)
            self.linear.bias.mul_(0.25)

    def forward(self, x):
        return self.linear(x)


@pytest.mark.skipif(not ONNXRuntimeBackend.availability().ok, reason=ONNXRuntimeBackend.availability().reason)
def test_aot_load_checks_eager_fallback_with_the_tuned_tolerance(tmp_path):
    """Without the weights' digest (checkpoints saved before it was stored), the fallback check uses the
    tolerance the module was tuned with, not the default ``Tolerance()``.

    A bias shift of 0.01 exceeds the default (atol 1e-4, rtol 1e-3) but lies within atol/rtol 0.05, the
    tolerance this module was tuned under: its eager fallback is as correct as its tuning demanded. With the
    digest, the shift is known exactly: other weights, so calls the artifact does not take raise.
    """
    from aitune.errors import BackendRuntimeError

    loose = Tolerance(atol=0.05, rtol=0.05)
    module = ait.Module(Affine().eval(), "affine", strategy=ait.OneBackendStrategy(
        ONNXRuntimeBackend(), profiling_config=FAST, tolerance=loose).enable_performance_validation(False))
    ait.tune(module, [torch.randn(2, 4), torch.randn(3, 4)], cache_dir_path=tmp_path / "cache", ready_batches=True)
    digested = ait.save(module, tmp_path / "affine.ait")
    path = edit_manifest(digested, tmp_path / "undigested.ait",
                         lambda manifest: manifest["modules"][0].pop("weights_sha256"))
    outside = torch.randn(8, 4)  # batch 8 > recorded max 3: the artifact does not take it, eager runs

    def load_shifted(shift: float, checkpoint=path):
        target = Affine().eval()
        with torch.no_grad():
            target.linear.bias.add_(shift)
        return ait.load(target, checkpoint)

    with torch.no_grad():
        with pytest.raises(BackendRuntimeError, match="weights differ"):
            load_shifted(0.01, digested)(outside)
        within = load_shifted(0.01)
        torch.testing.assert_close(within(outside), within.module(outside))  # fallback allowed
        beyond = load_shifted(0.5)
        with pytest.raises(BackendRuntimeError, match="weights differ"):
            beyond(outside)
    graph = read_manifest(path)["modules"][0]["graphs"][0]
    assert "weights_sha256" not in read_manifest(path)["modules"][0]
    assert graph["tolerance"]["atol"] == 0.05 and graph["tolerance"]["rtol"] == 0.05

    # A manifest written before the tolerance was stored falls back to the default Tolerance().
    def drop_tolerance(manifest):
        for graph_entry in manifest["modules"][0]["graphs"]:
            graph_entry.pop("tolerance")

    old = edit_manifest(path, tmp_path / "old.ait", drop_tolerance)
    target = Affine().eval()
    with torch.no_grad():
        target.linear.bias.add_(0.01)
        loaded = ait.load(target, old)
        with pytest.raises(BackendRuntimeError, match="weights differ"):
            loaded(outside)


def test_a_device_map_whose_entries_agree_is_loaded_on_that_device_and_one_that_disagrees_is_refused(
        eager_checkpoint):
    from aitune.errors import ConfigError

    features, _ = models.probe()
    torch.manual_seed(78)
    plain = models.Encoder().eval()
    loaded = ait.load(plain, eager_checkpoint.path, device_map={"encoder": "cpu", "other": torch.device("cpu")})
    assert loaded.state is ait.ModuleState.TUNED and {p.device.type for p in plain.parameters()} == {"cpu"}
    with torch.no_grad():
        output = loaded(features, pooling="mean", scale=0.5)
    torch.testing.assert_close(output.hidden, eager_checkpoint.expected.hidden, rtol=0, atol=0)
    for device_map, device in (({"encoder": "cpu", "other": "meta"}, None), ({"encoder": "cpu"}, "cpu")):
        fresh = models.Encoder().eval()
        weights = {name: value.clone() for name, value in fresh.state_dict().items()}
        with pytest.raises(ConfigError, match=r"aitune loads a checkpoint on one device; pass device="):
            ait.load(fresh, eager_checkpoint.path, device_map=device_map, device=device)
        assert all(torch.equal(weights[name], value) for name, value in fresh.state_dict().items())
