"""Checkpoint safety: saving never deletes what aitune did not write, names resolve the same way for save and
load, every file a checkpoint loads lies inside it and is covered by its SHA256SUMS, and stored backend
configs from a newer aitune (or with unknown fields) are refused.

Tiny models (an 8 -> 4 MLP) and the eager / ONNX Runtime / Inductor AOT backends on the CPU.
"""

from __future__ import annotations

import json
import stat
import zipfile
from pathlib import Path

import pytest
import torch
from torch import nn

import aitune.torch as ait
from aitune.errors import CheckpointError, CheckpointIntegrityError, CheckpointVersionError
from aitune.torch.backend import ONNXRuntimeBackend, TorchEagerBackend
from aitune.torch.checkpoint import sums_path
from aitune.torch.measure.profiling import ProfilingConfig
from checkpoint_edits import rewrite_archive

FAST = ProfilingConfig(warmup_rounds=1, min_rounds=3, max_rounds=10, time_budget_s=0.1)
X = torch.linspace(-1, 1, 16).reshape(2, 8)


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def tuned(backend=None) -> ait.Module:
    module = ait.Module(MLP().eval(), "mlp", strategy=ait.OneBackendStrategy(
        backend or TorchEagerBackend(), profiling_config=FAST).enable_performance_validation(False))
    ait.tune(module, [X[:1], X[1:]], ready_batches=True)
    assert module.state.value == "tuned"
    return module


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


# ---------------------------------------------------------------------------------------------- save never deletes


def user_folder(path: Path) -> dict:
    path.mkdir(parents=True)
    files = {"config.json": b'{"hidden_size": 8}', "model.safetensors": b"weights"}
    for name, data in files.items():
        (path / name).write_bytes(data)
    return files


def test_save_refuses_to_delete_a_folder_it_did_not_write(in_tmp):
    module = tuned()
    files = user_folder(in_tmp / "models" / "bert")
    with pytest.raises(CheckpointError, match=r"models/bert.*not an aitune checkpoint.*another checkpoint name"):
        ait.save(module, "models/bert.ait", storage=ait.LocalTorchStorage(base_folder="."))
    assert {p.name: p.read_bytes() for p in (in_tmp / "models" / "bert").iterdir()} == files
    assert not (in_tmp / "models" / "bert.ait").exists()  # nothing written
    with pytest.raises(CheckpointError, match="models/bert"):  # absolute paths too
        ait.save(module, in_tmp / "models" / "bert.ait")
    assert {p.name: p.read_bytes() for p in (in_tmp / "models" / "bert").iterdir()} == files


def test_save_refuses_to_overwrite_files_it_did_not_write(in_tmp):
    module = tuned()
    (in_tmp / "checkpoints").mkdir()
    archive, sums = in_tmp / "checkpoints" / "m.ait", in_tmp / "checkpoints" / "m_sha256_sums.txt"
    archive.write_bytes(b"my own file")
    with pytest.raises(CheckpointError, match=r"checkpoints/m\.ait, which is not an aitune checkpoint"):
        ait.save(module, "m.ait")
    assert archive.read_bytes() == b"my own file" and not sums.exists()
    archive.unlink()
    sums.write_text("notes\n")
    with pytest.raises(CheckpointError, match="m_sha256_sums.txt, which is not an aitune checkpoint"):
        ait.save(module, "m.ait")
    assert sums.read_text() == "notes\n" and not archive.exists()
    with pytest.raises(CheckpointError, match="m_sha256_sums.txt"):  # the lower-level save checks too
        ait.checkpoint.save(module, archive)
    assert sums.read_text() == "notes\n" and not archive.exists()


def test_save_replaces_its_own_checkpoint_but_not_files_added_to_it(in_tmp):
    module = tuned()
    first = ait.save(module, "m.ait")
    assert first == Path("checkpoints/m.ait") and (in_tmp / "checkpoints" / "m" / "manifest.json").is_file()
    assert ait.save(module, "m.ait") == first  # an earlier aitune checkpoint of that name is replaced
    folder_only = ait.LocalTorchStorage(compress_checkpoint=False)
    assert ait.save(module, "f.ait", storage=folder_only) == Path("checkpoints/f")
    assert ait.save(module, "f.ait", storage=folder_only) == Path("checkpoints/f")
    torch.testing.assert_close(ait.load(MLP().eval(), "f.ait", storage=folder_only)(X), MLP().eval()(X))
    (in_tmp / "checkpoints" / "m" / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointError, match=r"notes\.txt is not a file aitune wrote"):
        ait.save(module, "m.ait")
    assert (in_tmp / "checkpoints" / "m" / "notes.txt").read_text() == "mine"
    (in_tmp / "checkpoints" / "m" / "notes.txt").unlink()
    (in_tmp / "checkpoints" / "m" / "modules" / "my_results").mkdir()  # an empty folder of the user's
    with pytest.raises(CheckpointError, match=r"modules/my_results/ is not a folder aitune wrote"):
        ait.save(module, "m.ait")
    assert (in_tmp / "checkpoints" / "m" / "modules" / "my_results").is_dir()


# ---------------------------------------------------------------------------------------------- names


def test_a_name_starting_with_the_base_folder_is_used_as_given(in_tmp):
    module = tuned()
    assert ait.save(module, "model.ait") == Path("checkpoints/model.ait")  # the reference layout
    assert ait.save(module, "checkpoints/cnn") == Path("checkpoints/cnn.ait")
    assert not (in_tmp / "checkpoints" / "checkpoints").exists()
    expected = MLP().eval()(X)
    for name in ("checkpoints/cnn", "checkpoints/cnn.ait", "cnn", "cnn.ait"):
        torch.testing.assert_close(ait.load(MLP().eval(), name)(X), expected)
    ait.save(module, in_tmp / "elsewhere" / "abs.ait")  # absolute: as given
    torch.testing.assert_close(ait.load(MLP().eval(), "elsewhere/abs")(X), expected)  # exists as given (+ .ait)
    from aitune.torch.storage import existing_checkpoint

    assert existing_checkpoint("checkpoints/cnn") == Path("checkpoints/cnn.ait")  # not the unpacked folder
    assert existing_checkpoint("cnn") == Path("checkpoints/cnn.ait")


def test_a_checkpoint_saved_where_earlier_versions_put_such_names_still_loads(in_tmp, caplog):
    """Before names starting with the base folder were kept as given, ``save("checkpoints/old")`` wrote
    ``checkpoints/checkpoints/old.ait``: ``load("checkpoints/old")`` still finds it, and says where."""
    module = tuned()
    saved = ait.save(module, in_tmp / "checkpoints" / "checkpoints" / "old.ait")
    assert saved.is_file() and not (in_tmp / "checkpoints" / "old.ait").exists()
    with caplog.at_level("WARNING", logger="aitune.torch.storage"):
        loaded = ait.load(MLP().eval(), "checkpoints/old")
    torch.testing.assert_close(loaded(X), MLP().eval()(X))
    assert "earlier aitune versions" in caplog.text


# ---------------------------------------------------------------------------------------------- stored file names

needs_ort = pytest.mark.skipif(not ONNXRuntimeBackend.availability().ok,
                               reason=f"onnxruntime: {ONNXRuntimeBackend.availability().reason}")


@pytest.fixture(scope="module")
def ort_checkpoint(tmp_path_factory):
    """A tiny MLP on ONNX Runtime (CPU): model.onnx + model.onnx.data in modules/0/graphs/graph0/artifacts."""
    if not ONNXRuntimeBackend.availability().ok:
        pytest.skip("needs onnxruntime")
    module = tuned(ONNXRuntimeBackend())
    with torch.no_grad():
        expected = module(X)
    return ait.checkpoint.save(module, tmp_path_factory.mktemp("ort") / "mlp.ait"), expected


def forge(source: Path, target: Path, edit, replace: dict | None = None) -> Path:
    """A copy of ``source`` with its manifest edited (and members replaced), re-summed inside and beside it,
    so only the check of the stored file names can stop it."""
    return rewrite_archive(source, target, edit_manifest=edit, replace=replace)


def graph0(manifest: dict) -> dict:
    return manifest["modules"][0]["graphs"][0]


def outside_copy(checkpoint: Path, folder: Path, members: tuple[str, ...]) -> Path:
    """The named members copied out of the checkpoint into ``folder`` (a file the old code would load)."""
    folder.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(checkpoint) as zf:
        for member in members:
            (folder / member.rsplit("/", 1)[-1]).write_bytes(zf.read(member))
    return folder


@needs_ort
def test_the_loaded_checkpoint_is_the_untouched_baseline(ort_checkpoint, tmp_path):
    path, expected = ort_checkpoint
    same = forge(path, tmp_path / "same.ait", lambda manifest: None)
    torch.testing.assert_close(ait.load(MLP().eval(), same)(X), expected)


@needs_ort
def test_an_absolute_onnx_file_outside_the_checkpoint_is_refused(ort_checkpoint, tmp_path):
    path, _ = ort_checkpoint
    artifacts = "modules/0/graphs/graph0/artifacts"
    outside = outside_copy(path, tmp_path / "outside", (f"{artifacts}/model.onnx", f"{artifacts}/model.onnx.data"))
    forged = forge(path, tmp_path / "abs.ait",
                   lambda m: graph0(m)["metadata"].update(onnx_file=str(outside / "model.onnx")))
    with pytest.raises(CheckpointIntegrityError, match=r"onnxruntime metadata 'onnx_file' is '/.*outside/model\.onnx'"
                                                       r", which is absolute"):
        ait.load(MLP().eval(), forged)


@needs_ort
def test_a_dotdot_onnx_file_leaving_the_checkpoint_is_refused(ort_checkpoint, tmp_path, monkeypatch):
    import tempfile

    path, _ = ort_checkpoint
    scratch_parent = tmp_path / "tmp"
    scratch_parent.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch_parent))  # load extracts to tmp/aitune-checkpoint-*/
    artifacts = "modules/0/graphs/graph0/artifacts"
    outside_copy(path, scratch_parent, (f"{artifacts}/model.onnx", f"{artifacts}/model.onnx.data"))
    escape = "../" * 6 + "model.onnx"  # from <scratch>/modules/0/graphs/graph0/artifacts up to tmp/
    forged = forge(path, tmp_path / "dotdot.ait", lambda m: graph0(m)["metadata"].update(onnx_file=escape))
    with pytest.raises(CheckpointIntegrityError, match=r"'onnx_file' is '(\.\./)+model\.onnx', which is absolute or "
                                                       r"leaves the checkpoint"):
        ait.load(MLP().eval(), forged)


def test_manifest_file_names_leaving_the_checkpoint_are_refused(in_tmp, monkeypatch):
    import tempfile

    module = tuned()
    path = ait.checkpoint.save(module, in_tmp / "eager.ait")
    samples = "modules/0/graphs/graph0/samples.safetensors"
    outside = outside_copy(path, in_tmp / "outside", (samples,)) / "samples.safetensors"
    forged = forge(path, in_tmp / "samples.ait", lambda m: graph0(m)["samples"].update(file=str(outside)))
    with pytest.raises(CheckpointIntegrityError, match="samples"):
        ait.load(MLP().eval(), forged)
    (in_tmp / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(in_tmp / "tmp"))  # load extracts to tmp/aitune-checkpoint-*/
    forged = forge(path, in_tmp / "dir.ait", lambda m: graph0(m).update(artifacts_dir="../outside"))
    with pytest.raises(CheckpointIntegrityError, match=r"mlp/graph0: the manifest's 'artifacts_dir' is '\.\./outside', "
                                                       "which is absolute or leaves the checkpoint"):
        ait.load(MLP().eval(), forged)
    assert not (in_tmp / "tmp" / "outside").exists()  # not even a folder is made outside


def test_checkpoint_path_refuses_links_unlisted_files_and_escapes(tmp_path):
    from aitune.torch.checkpoint.archive import read_verified
    from aitune.torch.common.files import checkpoint_path, forget_extraction

    module = tuned()
    path = ait.checkpoint.save(module, tmp_path / "eager.ait")
    extracted = tmp_path / "extracted"
    read_verified(path, extracted, in_memory=("manifest.json",))
    samples = "modules/0/graphs/graph0/samples.safetensors"
    assert checkpoint_path(extracted, samples, "field") == extracted / samples
    (tmp_path / "secret.txt").write_text("not the checkpoint's")
    (extracted / "modules" / "0" / "link.txt").symlink_to(tmp_path / "secret.txt")
    with pytest.raises(CheckpointIntegrityError, match=r"'samples' is 'modules/0/link.txt', a symbolic link"):
        checkpoint_path(extracted, "modules/0/link.txt", "'samples'")
    (extracted / "modules" / "1").symlink_to(tmp_path, target_is_directory=True)
    with pytest.raises(CheckpointIntegrityError, match="a symbolic link"):
        checkpoint_path(extracted, "modules/1/secret.txt", "'samples'")
    (extracted / "modules" / "0" / "added.txt").write_text("never verified")
    with pytest.raises(CheckpointIntegrityError, match="modules/0/added.txt is not listed in the checkpoint's SHA256SUMS"):
        checkpoint_path(extracted, "modules/0/added.txt", "'samples'")
    with pytest.raises(CheckpointIntegrityError, match="is not listed"):  # a folder: every file in it
        checkpoint_path(extracted, "modules/0", "'artifacts_dir'", kind="dir")
    for name in ("/etc/hostname", "../secret.txt", "modules/../../secret.txt", 7):
        with pytest.raises(CheckpointIntegrityError, match="'samples' is"):
            checkpoint_path(extracted, name, "'samples'")
    forget_extraction(extracted)  # not an extracted checkpoint any more: only the path checks apply
    assert checkpoint_path(extracted, "modules/0/added.txt", "field") == extracted / "modules/0/added.txt"


def test_archive_members_that_are_links_or_leave_the_folder_are_refused(tmp_path):
    module = tuned()
    path = ait.checkpoint.save(module, tmp_path / "eager.ait")
    for name, mode in (("modules/0/link", stat.S_IFLNK | 0o777), ("../escape.txt", stat.S_IFREG | 0o644),
                       ("/tmp/aitune-absolute.txt", stat.S_IFREG | 0o644)):
        with zipfile.ZipFile(path) as zf:
            members = {info.filename: zf.read(info) for info in zf.infolist()}
        target = tmp_path / "bad.ait"
        with zipfile.ZipFile(target, "w") as zf:
            for member, data in members.items():
                zf.writestr(member, data)
            info = zipfile.ZipInfo(name)
            info.external_attr = mode << 16
            zf.writestr(info, "/etc/passwd" if stat.S_ISLNK(mode) else "payload")
        sums_path(target).unlink(missing_ok=True)
        with pytest.raises(CheckpointIntegrityError, match="symbolic link|unsafe member name"):
            ait.load(MLP().eval(), target)
    assert not (tmp_path / "escape.txt").exists() and not Path("/tmp/aitune-absolute.txt").exists()


# ---------------------------------------------------------------------------------------------- stored configs


@pytest.fixture(scope="module")
def eager_saved(tmp_path_factory):
    module = tuned()
    with torch.no_grad():
        expected = module(X)
    return ait.checkpoint.save(module, tmp_path_factory.mktemp("eager") / "eager.ait"), expected


def test_configs_are_written_with_their_class_version(eager_saved):
    path, _ = eager_saved
    with zipfile.ZipFile(path) as zf:
        config = graph0(json.loads(zf.read("manifest.json")))["config"]
    assert config == {"type": "TorchEagerBackendConfig", "version": TorchEagerBackend.config_class.VERSION,
                      "data": TorchEagerBackend.config_class().data()}
    assert TorchEagerBackend.config_class.VERSION == 1


def test_a_config_without_version_still_loads(eager_saved, tmp_path):
    path, expected = eager_saved
    forged = forge(path, tmp_path / "old.ait", lambda m: graph0(m)["config"].pop("version"))
    torch.testing.assert_close(ait.load(MLP().eval(), forged)(X), expected)


def test_a_config_from_a_newer_aitune_is_refused(eager_saved, tmp_path):
    path, _ = eager_saved
    forged = forge(path, tmp_path / "newer.ait", lambda m: graph0(m)["config"].update(version=2))
    with pytest.raises(CheckpointVersionError, match=r"mlp/graph0: .*TorchEagerBackendConfig was stored in version 2 "
                                                     r"by a newer aitune.*up to 1\. Upgrade aitune .*or re-tune"):
        ait.load(MLP().eval(), forged)


def test_an_unknown_config_field_is_refused(eager_saved, tmp_path):
    path, _ = eager_saved
    forged = forge(path, tmp_path / "typo.ait", lambda m: graph0(m)["config"]["data"].update(use_cuda_grpahs=True))
    with pytest.raises(CheckpointError, match=r"TorchEagerBackendConfig has no field 'use_cuda_grpahs'.*Upgrade aitune "
                                              r".*or re-tune"):
        ait.load(MLP().eval(), forged)


def test_an_unknown_tolerance_field_is_refused_in_a_checkpoint_only(eager_saved, tmp_path):
    from aitune.torch.check.correctness import Tolerance

    path, _ = eager_saved
    forged = forge(path, tmp_path / "tol.ait", lambda m: graph0(m).update(tolerance=dict(
        Tolerance().to_dict(), max_ulp=4)))
    with pytest.raises(CheckpointError, match=r"mlp/graph0: malformed tolerance.*no field 'max_ulp'.*re-tune"):
        ait.load(MLP().eval(), forged)
    assert Tolerance.from_dict({"atol": 0.5, "max_ulp": 4}) == Tolerance(atol=0.5)  # other callers: unchanged


def test_a_name_is_checked_before_anything_is_looked_up(tmp_path):
    """An absolute or '..' name is refused as such even when nothing is there, not reported as 'missing'."""
    from aitune.torch.common.files import checkpoint_path

    missing = CheckpointError("missing")
    for name in (str(tmp_path / "nowhere.so"), "../nowhere.so"):
        with pytest.raises(CheckpointIntegrityError, match="leaves the checkpoint"):
            checkpoint_path(tmp_path, name, "a test field", missing=missing)
    with pytest.raises(CheckpointError, match="^missing$"):
        checkpoint_path(tmp_path, "inside.so", "a test field", missing=missing)
