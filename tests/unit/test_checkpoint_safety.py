"""Checkpoint safety: saving never deletes what aitune did not write, names resolve the same way for save and
load, every file a checkpoint loads lies inside it and is covered by its SHA256SUMS, and stored backend
configs from a newer aitune (or with unknown fields) are refused.

Tiny models (an 8 -> 4 MLP) and the eager / ONNX Runtime / Inductor AOT backends on the CPU.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import zipfile
from pathlib import Path

import pytest
import torch
from torch import nn

import aitune.torch as ait
from aitune.errors import CheckpointError, CheckpointIntegrityError, CheckpointVersionError
from aitune.torch.backend import ONNXRuntimeBackend, TorchEagerBackend, TorchInductorAotBackend
from aitune.torch.checkpoint import sums_path
from aitune.torch.profiling import ProfilingConfig

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
