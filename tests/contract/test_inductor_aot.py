"""TorchInductorAotBackend on small real models: torch.export + AOTInductor on CPU, never mocked.

AOTInductor CPU compiles take ~20-60 s here, so builds are shared through module-scoped fixtures:
three real compiles (C02 FlattenHead, C04 dataclass head, C16 PairScore) plus builds whose child step
crashes or hangs for real (no compile).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from aitune.errors import BackendBuildError, ConfigError
from aitune.torch.backend import BackendConfig, BackendState, BuildMode, TorchInductorAotBackend
from aitune.torch.backend.inductor_aot import TorchInductorAotBackendConfig
from aitune.torch.correctness import OutputComparator
from aitune.torch.samples import BatchDim, record_graphs
from case_models import FlattenHead, MaskedPool, PairScore, Pooled

REPO_ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(not TorchInductorAotBackend.availability().ok,
                                reason=TorchInductorAotBackend.availability().reason)


# ---------------------------------------------------------------------------------------------- models


def head_inputs(batch: int, length: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randn(batch, length, 8, generator=generator)
    mask = (torch.rand(batch, length, generator=generator) > 0.3).float()
    return tokens, mask


def assert_matches_eager(module, backend, args, kwargs=None):
    kwargs = kwargs or {}
    with torch.no_grad():
        expected = module(*[a.clone() for a in args], **kwargs)
    actual = backend(*args, **kwargs)
    OutputComparator().compare(expected, actual)
    return actual


def leaves_of(*tensors):
    return list(tensors)


# ---------------------------------------------------------------------------------------------- config


def test_config_validation_and_round_trip():
    config = TorchInductorAotBackendConfig(inductor_configs={"max_autotune": False}, build_timeout_s=60)
    assert BackendConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config
    with pytest.raises(ConfigError, match="max_autotune"):  # the close match is suggested
        TorchInductorAotBackendConfig(inductor_configs={"max_autotun": True})
    with pytest.raises(ConfigError, match="JSON-able"):
        TorchInductorAotBackendConfig(inductor_configs={"max_autotune": object()})
    with pytest.raises(ConfigError, match="build_timeout_s"):
        TorchInductorAotBackendConfig(build_timeout_s=0)
    with pytest.raises(ConfigError, match="isolate"):
        TorchInductorAotBackendConfig(isolate="yes")
    assert TorchInductorAotBackend.build_mode is BuildMode.AOT
    assert TorchInductorAotBackend.availability().ok


def test_training_mode_is_refused():
    module = PairScore()  # nn.Module starts in training mode
    graph = record_graphs(module, [((torch.randn(4, 3, 4),), {})])[0]
    check = TorchInductorAotBackend().supports(module, graph, torch.device("cpu"))
    assert not check.ok
    assert check.reason == "module is in training mode; torch.export assumes eval semantics; call .eval()"
    assert TorchInductorAotBackend().supports(module.eval(), graph, torch.device("cpu")).ok


# ---------------------------------------------------------------------------------------------- C02


@pytest.fixture(scope="module")
def flatten_head_build(tmp_path_factory):
    torch.manual_seed(0)
    module = FlattenHead().eval()
    graph = record_graphs(module, [((torch.randn(1, 3, 16, 16),), {})],
                          dynamic_shapes={"x": (BatchDim("batch", 1, 32), 3, 16, 16)})[0]
    backend = TorchInductorAotBackend().build(module, graph, "cpu", tmp_path_factory.mktemp("c02"))
    return module, graph, backend


def test_c02_batch_one_sample_keeps_dynamic_batch(flatten_head_build):
    module, graph, backend = flatten_head_build
    assert backend.state is BackendState.ACTIVE
    assert backend.build_info["export_example_shapes"] == [[2, 3, 16, 16]]  # repeated from batch 1
    assert "case C02" in backend.build_info["export_batch_repeated"]
    assert backend.build_info["specialized_axes"] == []
    through_artifact = []
    for batch in (1, 2, 7, 32):
        x = torch.randn(batch, 3, 16, 16)
        if backend.accepts(leaves_of(x)):
            through_artifact.append(batch)
            out = assert_matches_eager(module, backend, (x,))
            assert out.shape == (batch, 10)
        else:  # the caller runs eager: nothing to check but that it is refused, not wrong
            assert batch == 1
    assert {2, 7, 32} <= set(through_artifact)
    assert not backend.accepts(leaves_of(torch.randn(33, 3, 16, 16)))  # outside the declared BatchDim
    assert not backend.accepts(leaves_of(torch.randn(2, 3, 16, 17)))   # static axis changed
    assert not backend.accepts(leaves_of(torch.randn(2, 3, 16, 16, dtype=torch.float64)))


def test_c02_build_leaves_module_and_samples_unchanged(flatten_head_build):
    module, graph, backend = flatten_head_build
    assert not module.training
    assert graph.samples[0].leaves()[0].shape == (1, 3, 16, 16)
    assert (backend.workdir / "model.pt2").is_file()
    assert (backend.workdir / "build.log").is_file()
    assert "output shapes match eager" in (backend.workdir / "aoti_compile.log").read_text()


# ---------------------------------------------------------------------------------------------- C04 + checkpoint


@pytest.fixture(scope="module")
def dataclass_head_build(tmp_path_factory):
    torch.manual_seed(0)
    module = MaskedPool().eval()
    calls = [(head_inputs(2, 5, seed=1), {}), (head_inputs(4, 9, seed=2), {}), (head_inputs(3, 7, seed=3), {})]
    graph = record_graphs(module, calls)[0]
    backend = TorchInductorAotBackend().build(module, graph, "cpu", tmp_path_factory.mktemp("c04"))
    return module, graph, backend


def test_c04_dataclass_output_on_samples_and_unseen_shapes(dataclass_head_build):
    module, graph, backend = dataclass_head_build
    for sample in graph.samples:
        sample = sample.clone()
        assert_matches_eager(module, backend, sample.args, sample.kwargs)
    for batch, length in ((2, 9), (4, 5), (3, 6), (2, 8)):  # unseen, inside the recorded ranges
        tokens, mask = head_inputs(batch, length, seed=batch * 10 + length)
        assert backend.accepts(leaves_of(tokens, mask))
        out = assert_matches_eager(module, backend, (tokens, mask))
        assert isinstance(out, Pooled) and out.temperature == 0.5
        assert out.features.shape == (batch, length, 16)
    tokens, mask = head_inputs(5, 6)
    assert not backend.accepts(leaves_of(tokens, mask))            # batch beyond the recorded range
    tokens, mask = head_inputs(3, 6)
    assert not backend.accepts(leaves_of(tokens, mask[:2]))        # batch axes disagree


FRESH_PROCESS_SCRIPT = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    import torch
    from safetensors.torch import load_file, save_file
    from aitune.torch.backend import BackendConfig, TorchInductorAotBackend

    directory = Path(sys.argv[1])
    import importlib
    importlib.import_module(sys.argv[2])  # the user's code defines the output type; aitune never imports it
    saved = json.loads((directory / "saved.json").read_text())
    config = BackendConfig.from_dict(saved["config"])
    backend = TorchInductorAotBackend.from_checkpoint(directory, config, saved["metadata"], None, None, "cpu")
    inputs = load_file(str(directory / "inputs.safetensors"))
    out = backend(inputs["tokens"], inputs["mask"])
    save_file({"logits": out.logits.contiguous(), "features": out.features.contiguous()},
              str(directory / "outputs.safetensors"))
    (directory / "result.json").write_text(json.dumps({
        "type": type(out).__qualname__, "temperature": out.temperature,
        "accepts_out_of_range": backend.accepts([torch.zeros(9, 5, 8), torch.zeros(9, 5)]),
    }))
""")


def test_save_then_load_in_fresh_process(dataclass_head_build, tmp_path):
    from safetensors.torch import load_file, save_file

    module, graph, backend = dataclass_head_build
    directory = tmp_path / "checkpoint"
    metadata = backend.save(directory)
    assert sorted(p.name for p in directory.iterdir()) == ["model.pt2"]  # the artifact only, no weights
    (directory / "saved.json").write_text(json.dumps({"config": backend.config.to_dict(), "metadata": metadata}))
    tokens, mask = head_inputs(3, 8, seed=7)
    save_file({"tokens": tokens, "mask": mask}, str(directory / "inputs.safetensors"))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO_ROOT), str(Path(__file__).resolve().parents[1])]))
    completed = subprocess.run([sys.executable, "-c", FRESH_PROCESS_SCRIPT, str(directory), Pooled.__module__],
                               env=env, capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stderr[-3000:]
    result = json.loads((directory / "result.json").read_text())
    assert result["type"] == "Pooled" and result["temperature"] == 0.5
    assert result["accepts_out_of_range"] is False
    outputs = load_file(str(directory / "outputs.safetensors"))
    loaded_output = Pooled(logits=outputs["logits"], features=outputs["features"],
                               temperature=result["temperature"])
    with torch.no_grad():
        expected = module(tokens.clone(), mask.clone())
    OutputComparator().compare(expected, loaded_output)
    OutputComparator().compare(backend(tokens, mask), loaded_output)  # same as before saving


def test_load_in_process_with_graph_and_deactivate(dataclass_head_build, tmp_path):
    module, graph, backend = dataclass_head_build
    metadata = backend.save(tmp_path)
    loaded = TorchInductorAotBackend.from_checkpoint(tmp_path, backend.config, json.loads(json.dumps(metadata)),
                                                     None, graph, "cpu")
    tokens, mask = head_inputs(2, 6, seed=11)
    assert_matches_eager(module, loaded, (tokens, mask))
    loaded.deactivate()
    assert loaded.state is BackendState.INACTIVE
    assert_matches_eager(module, loaded, (tokens, mask))  # infer() reactivates: the package is reloaded


# ---------------------------------------------------------------------------------------------- C16


@pytest.fixture(scope="module")
def pair_score_build(tmp_path_factory):
    torch.manual_seed(0)
    module = PairScore().eval()
    graph = record_graphs(module, [((torch.randn(64, 3, 4),), {})])[0]
    # isolate=False: this build exercises the in-process compile path.
    backend = TorchInductorAotBackend(TorchInductorAotBackendConfig(isolate=False))
    backend.build(module, graph, "cpu", tmp_path_factory.mktemp("c16"))
    return module, graph, backend


def test_c16_non_contiguous_input_matches_eager(pair_score_build):
    module, graph, backend = pair_score_build
    assert backend.build_info["isolated"] is False
    m_nc = torch.randn(64, 4, 3).transpose(1, 2)
    assert not m_nc.is_contiguous() and m_nc.stride() == (12, 1, 3)
    assert backend.accepts(leaves_of(m_nc))
    assert_matches_eager(module, backend, (m_nc,))
    assert_matches_eager(module, backend, (torch.randn(64, 3, 4),))
    assert not backend.accepts(leaves_of(torch.randn(65, 3, 4)))  # a static graph takes its one shape only


# ---------------------------------------------------------------------------------------------- crashes


def crash_step_segfault(**kwargs) -> dict:
    """Stands in for the GPU machine's aoti_load_package SIGSEGV: a real segfault in the child."""
    import ctypes

    ctypes.string_at(0)
    return {}


def crash_step_hang(**kwargs) -> dict:
    time.sleep(120)
    return {}


@pytest.mark.parametrize("step, timeout_s, reason", [
    ("crash_step_segfault", 300.0, "killed by signal SIGSEGV"),
    ("crash_step_hang", 6.0, "timed out after 6.0 s"),
])
def test_child_crash_becomes_build_error(monkeypatch, tmp_path, step, timeout_s, reason):
    monkeypatch.setattr(TorchInductorAotBackend, "compile_step", f"{__name__}:{step}")
    module = PairScore().eval()
    graph = record_graphs(module, [((torch.randn(8, 3, 4),), {})])[0]
    backend = TorchInductorAotBackend(TorchInductorAotBackendConfig(build_timeout_s=timeout_s))
    with pytest.raises(BackendBuildError) as info:
        backend.build(module, graph, "cpu", tmp_path)
    message = str(info.value)
    assert message.startswith("inductor_aot: AOTInductor compile/load/check in a child process failed: " + reason)
    assert info.value.backend == "inductor_aot"
    assert info.value.log_path == tmp_path / "aoti_compile.log" and info.value.log_path.is_file()
    assert backend.state is BackendState.INIT
    assert not (tmp_path / "model.pt2").exists()
