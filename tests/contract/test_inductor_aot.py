"""TorchInductorAotBackend specifics on small real models: torch.export + AOTInductor on CPU, never mocked.

AOTInductor CPU compiles take ~10-60 s here, so builds are shared through module-scoped fixtures: two real
compiles (FlattenHead, PairScore) plus builds whose child step crashes or hangs for real (no
compile). The generic checks (outputs match eager on samples and unseen shapes, shapes outside the range
refused, the module unchanged, deactivate/reactivate, save -> load in a fresh process with and without
graph) run in test_backend_contract.py; the AOT-specific check on its build is here.
"""

from __future__ import annotations

import json
import time

import pytest
import torch

from aitune.errors import BackendBuildError, ConfigError
from aitune.torch.backend import BackendConfig, BackendState, BuildMode, TorchInductorAotBackend
from aitune.torch.backend.inductor_aot import TorchInductorAotBackendConfig
from aitune.torch.check.correctness import OutputComparator
from aitune.torch.record.samples import BatchDim, record_graphs
from case_models import FlattenHead, PairScore
from contract_support import model_inputs

pytestmark = pytest.mark.skipif(not TorchInductorAotBackend.availability().ok,
                                reason=TorchInductorAotBackend.availability().reason)


# ---------------------------------------------------------------------------------------------- models


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


# ----------------------------------------------------------------------- a batch-1 sample, dynamic batch


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
    assert "pytorch/pytorch#133653" in backend.build_info["export_batch_repeated"]
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


class EmbeddingPool(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(100, 32)
        self.proj = torch.nn.Linear(32, 16)

    def forward(self, input_ids):
        return self.proj(self.emb(input_ids)).mean(1)


def test_batch_range_one_to_two_builds_and_matches_eager(tmp_path):
    """NOTE [export max 2]: an Embedding model recorded at batches 1 and 2 (the reference's default
    batch_sizes) built a package that returned batch 2 at batch 1 (torch 2.13, export save/load); the export
    bound is widened, the accepted range is still the recorded one."""
    torch.manual_seed(0)
    module = EmbeddingPool().eval()
    graph = record_graphs(module, [((torch.randint(0, 100, (b, 8)),), {}) for b in (1, 2)])[0]
    backend = TorchInductorAotBackend().build(module, graph, "cpu", tmp_path)
    for batch in (1, 2):
        x = torch.randint(0, 100, (batch, 8))
        assert backend.accepts(leaves_of(x))
        assert assert_matches_eager(module, backend, (x,)).shape == (batch, 16)
    assert not backend.accepts(leaves_of(torch.randint(0, 100, (3, 8))))  # the recorded range, not the export's


def test_c02_export_example_is_a_copy_and_the_artifact_is_all_that_is_saved(flatten_head_build, tmp_path):
    module, graph, backend = flatten_head_build
    assert graph.samples[0].leaves()[0].shape == (1, 3, 16, 16)  # the batch-2 export example was a copy
    assert (backend.workdir / "model.pt2").is_file()
    assert "output shapes match eager" in (backend.workdir / "aoti_compile.log").read_text()
    backend.save(tmp_path / "checkpoint")
    assert sorted(p.name for p in (tmp_path / "checkpoint").iterdir()) == ["model.pt2"]  # no weights


def test_refuses_inputs_whose_batch_axes_disagree(contract_runs):
    """On the contract suite's build (tokens [B, T, 8], mask [B, T]): each input inside its range, but B differs."""
    backend = contract_runs.get("inductor_aot").backend
    tokens, mask = model_inputs(3, 6, seed=0)
    assert backend.accepts([tokens, mask])
    assert not backend.accepts([tokens, mask[:2]])


# ------------------------------------------------------------------------------- non-contiguous inputs


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


def test_canary_loads_a_cpu_package_once_per_environment(monkeypatch, tmp_path):
    """NOTE [AOTInductor canary]: the one-op package is compiled, loaded and checked once; the marker it leaves
    in the user's cache makes later builds skip it (a real compile here, about 10 s on 2 cores)."""
    from aitune.torch.backend import inductor_aot
    from aitune.torch.search.crashes import CrashRegistry

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    marker = tmp_path / "cache" / "aitune" / "aoti_canary" / f"{CrashRegistry.environment_id('cpu')}.ok"
    inductor_aot.loads_here("cpu", tmp_path)
    assert marker.is_file()
    assert not list(tmp_path.glob("canary*.pt2"))  # the package is removed after its check
    compiles = []
    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", lambda *a, **k: compiles.append(a))
    inductor_aot.loads_here("cpu", tmp_path)
    assert compiles == []  # the second call trusts the marker
