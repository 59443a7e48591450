"""TorchAOBackend on CPU: real torchao quantization (int8 weight-only, int8 dynamic) + Inductor, never mocked.

Quantized outputs are judged like the tuner judges them: ``OutputComparator(quantized=True)`` (SQNR >= 20 dB,
the floor torchao's own tests use, and cosine >= 0.99). Compiled builds are shared via module fixtures.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from torch import nn

from aitune.errors import ConfigError, ToleranceExceededError
from aitune.torch.backend import BackendConfig, BackendState, BuildMode, TorchAOBackend, TorchAOBackendConfig
from aitune.torch.backend.ao import default_preset
from aitune.torch.check.correctness import OutputComparator, Tolerance
from aitune.torch.record.samples import record_graphs

pytestmark = pytest.mark.skipif(not TorchAOBackend.availability().ok, reason=TorchAOBackend.availability().reason)


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 32)).eval()


@pytest.fixture(scope="module")
def model():
    return mlp()


@pytest.fixture(scope="module")
def graph(model):
    return record_graphs(model, [((torch.randn(4, 64),), {}), ((torch.randn(9, 64),), {})])[0]


def snapshot(module: nn.Module) -> dict:
    return {name: (type(value), value.detach().clone()) for name, value in module.state_dict(keep_vars=True).items()}


def assert_unchanged(module: nn.Module, before: dict) -> None:
    after = module.state_dict(keep_vars=True)
    assert set(after) == set(before)
    for name, (kind, value) in before.items():
        assert type(after[name]) is kind, f"{name} became {type(after[name]).__name__}"
        assert torch.equal(after[name].detach(), value), f"{name} changed"


@pytest.fixture(scope="module", params=["int8dq", "int8wo"])
def built(request, model, graph, tmp_path_factory):
    before = snapshot(model)
    backend = TorchAOBackend(TorchAOBackendConfig(quantization=request.param))
    backend.build(model, graph, "cpu", tmp_path_factory.mktemp(request.param))
    return request.param, backend, before


def test_brief_snippet_runs_as_written():
    from aitune.torch.backend import TorchAOBackend

    backend = TorchAOBackend()
    assert backend.name == "torchao" and backend.is_quantizing and backend.build_mode is BuildMode.JIT
    assert backend.preset_for("cpu") == default_preset("cpu") == "int8dq"


def test_config_validation():
    from torchao.quantization import Int8WeightOnlyConfig

    with pytest.raises(ConfigError, match="not both"):
        TorchAOBackendConfig(quantization="int8wo", quantization_config=Int8WeightOnlyConfig())
    with pytest.raises(ConfigError, match="presets"):
        TorchAOBackendConfig(quantization="int3")
    with pytest.raises(ConfigError, match="AOBaseConfig"):
        TorchAOBackendConfig(quantization_config=object())
    with pytest.raises(ConfigError, match="mode"):
        TorchAOBackendConfig(quantization="int8wo", mode="fastest")
    with pytest.raises(ConfigError, match="callable"):
        TorchAOBackendConfig(filter_fn="linear")


def test_config_serialisation_never_pickles():
    from torchao.quantization import Int8DynamicActivationInt8WeightConfig

    preset = TorchAOBackendConfig(quantization="int8wo", mode="max-autotune")
    assert BackendConfig.from_dict(json.loads(json.dumps(preset.to_dict()))) == preset
    # a torchao config object: torchao's own JSON form (config_to_dict), rebuilt from allow-listed classes
    custom = TorchAOBackendConfig(quantization_config=Int8DynamicActivationInt8WeightConfig())
    payload = json.loads(json.dumps(custom.to_dict()))
    assert payload["data"]["quantization_config"]["_type"] == "Int8DynamicActivationInt8WeightConfig"
    assert BackendConfig.from_dict(payload).quantization_config == custom.quantization_config
    # a filter function is recorded by name and code digest only, and refused on load
    def only_first(module, name):
        return name == "0"

    def only_last(module, name):
        return name == "2"

    with_filter = TorchAOBackendConfig(quantization="int8wo", filter_fn=only_first)
    payload = json.loads(json.dumps(with_filter.to_dict()))
    recorded = payload["data"]["filter_fn"]
    assert recorded["serializable"] is False and "only_first" in recorded["callable"]
    with pytest.raises(ConfigError, match="filter_fn"):
        BackendConfig.from_dict(payload)
    assert with_filter.key() != TorchAOBackendConfig(quantization="int8wo", filter_fn=only_last).key()
    assert with_filter.key() == TorchAOBackendConfig(quantization="int8wo", filter_fn=only_first).key()
    broken = {"type": "TorchAOBackendConfig", "version": 1,
              "data": {"quantization_config": {"class": "MyConfig", "repr": "MyConfig()", "serializable": False}}}
    with pytest.raises(ConfigError, match="MyConfig"):
        BackendConfig.from_dict(broken)


@pytest.mark.parametrize("preset", ["int4wo", "fp8wo", "fp8dq", "fp8dq_row"])
def test_presets_torchao_cannot_run_on_cpu_are_refused(model, graph, preset):
    check = TorchAOBackend(TorchAOBackendConfig(quantization=preset)).supports(model, graph, torch.device("cpu"))
    assert not check.ok and check.reason.startswith(preset)
    assert ("8.9" in check.reason) if preset.startswith("fp8") else ("CPU kernel" in check.reason)


def test_nothing_to_quantize_is_refused(graph):
    convolutional = nn.Sequential(nn.Conv1d(4, 4, 1))
    check = TorchAOBackend().supports(convolutional, graph, torch.device("cpu"))
    assert not check.ok and "nothing to quantize" in check.reason
    only_nothing = TorchAOBackend(TorchAOBackendConfig(quantization="int8wo", filter_fn=lambda m, n: False))
    assert "filter_fn" in only_nothing.supports(mlp(), graph, torch.device("cpu")).reason
    assert TorchAOBackend(TorchAOBackendConfig(quantization="int8dq")).supports(mlp(), graph, torch.device("cpu")).ok


def test_quantized_build_matches_eager_by_sqnr_and_cosine(built, model, graph):
    preset, backend, _ = built
    assert backend.state is BackendState.ACTIVE
    assert backend.build_info["preset"] == preset and backend.build_info["quantized_modules"] == 2
    comparator = OutputComparator(quantized=True)
    exact = OutputComparator(Tolerance(atol=0.0, rtol=0.0))
    differs = False
    for sample in [s.clone() for s in graph.samples] + [type(graph.samples[0])((torch.randn(6, 64),), {}, 6)]:
        with torch.no_grad():
            expected = model(*sample.args, **sample.kwargs)
        output = backend(*sample.args, **sample.kwargs)
        comparator.compare(expected, output)
        try:
            exact.compare(expected, output)
        except ToleranceExceededError:
            differs = True
    result = comparator.result()
    assert result.min_sqnr_db >= 20 and result.min_cosine >= 0.99
    assert differs, "outputs equal eager bit for bit: nothing was quantized"


def test_build_never_quantizes_the_callers_module(built, model):
    """quantize_ works in place, so the backend quantizes a deep copy."""
    _, _, before = built
    assert_unchanged(model, before)
    assert not model.training


def test_build_restores_process_wide_inductor_options(model, graph, tmp_path):
    """torchao configs with set_inductor_config=True change Inductor options; the build puts them back."""
    import torch._inductor.config as inductor_config
    from torchao.quantization import Int8WeightOnlyConfig

    before = inductor_config.get_config_copy()
    precision = torch.get_float32_matmul_precision()
    config = TorchAOBackendConfig(quantization_config=Int8WeightOnlyConfig(set_inductor_config=True), compile=False)
    TorchAOBackend(config).build(model, graph, "cpu", tmp_path)
    after = inductor_config.get_config_copy()
    assert {key for key in before if before[key] != after.get(key)} == set()
    assert torch.get_float32_matmul_precision() == precision


def test_checkpoint_requantizes_from_the_original_weights(built, model, graph, tmp_path):
    preset, backend, before = built
    metadata = json.loads(json.dumps(backend.save(tmp_path)))
    assert metadata["preset"] == preset and metadata["build_mode"] == "jit"
    assert not list(tmp_path.iterdir())  # JIT-style: no quantized weights written
    config = BackendConfig.from_dict(backend.config.to_dict())
    restored = TorchAOBackend.from_checkpoint(tmp_path, config, metadata, model, graph, "cpu")
    sample = graph.samples[1].clone()
    torch.testing.assert_close(restored(*sample.args, **sample.kwargs), backend(*sample.args, **sample.kwargs),
                               atol=1e-5, rtol=1e-5)
    assert_unchanged(model, before)


@pytest.mark.parametrize("preset", ["int8wo", "int8dq"])
def test_c21_fp16_outliers_are_caught_by_the_quantization_metric(preset, tmp_path):
    """pytorch/ao#1662: int8 quantization of an fp16 MLP with outlier channels can overflow to
    NaN on CPU. Whatever the installed torchao does, a non-finite or inaccurate output must be
    rejected by the quantization metric, an accepted one must meet it, and the caller's weights stay put."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 2048), nn.GELU(), nn.Linear(2048, 512)).half().eval()
    with torch.no_grad():
        model[0].weight[:, :8] *= 20.0
    x = (torch.randn(16, 512) * 10).half()
    x[:, :8] *= 10
    with torch.no_grad():
        expected = model(x)
    assert torch.isfinite(expected).all()
    graph = record_graphs(model, [((x,), {})])[0]
    before = snapshot(model)
    backend = TorchAOBackend(TorchAOBackendConfig(quantization=preset, compile=False)).build(model, graph, "cpu",
                                                                                           tmp_path)
    output = backend(x.clone())
    comparator = OutputComparator(quantized=True)
    try:
        comparator.compare(expected, output)
        accepted = True
    except ToleranceExceededError as exc:
        accepted = False
        assert "non-finite" in str(exc) or "SQNR" in str(exc)
    if not torch.isfinite(output).all():
        assert not accepted, "a NaN/Inf output passed the quantization check"
    if accepted:
        assert comparator.result().min_cosine >= 0.99 and comparator.result().min_sqnr_db >= 20
    assert_unchanged(model, before)


def test_importing_the_backends_does_not_import_torchao_or_sageattention():
    code = ("import sys, aitune.torch.backend.ao, aitune.torch.backend.kernel_selector, aitune.torch.kernel_forge; "
            "print(sorted({'torchao', 'sageattention'} & set(sys.modules)))")
    output = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "torchao" not in output and "sageattention" not in output


def test_a_quantizer_that_quantizes_nothing_is_no_op_and_never_selected(fast_profiling):
    """Issue "Trust" 6: 0 layers match the config (filter_fn picks none) -> no-op, not selected."""
    import aitune.torch as ait

    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU(), torch.nn.Linear(16, 4)).eval()
    backend = TorchAOBackend(TorchAOBackendConfig(quantization="int8wo", compile=False,
                                                  filter_fn=lambda module, name: name == "no_such_layer"))
    tuned = ait.Module(model, "noop", strategy=ait.MaxThroughputStrategy([backend], profiling_config=fast_profiling))
    report = ait.tune(tuned, [torch.randn(b, 16) for b in (2, 4)], ready_batches=True)
    row = next(r for r in report.rows if r.backend == "torchao")
    assert row.status == "no-op" and "nothing to quantize" in row.reason
    assert tuned.backends["graph0"].name == "eager"


def test_a_quantizer_that_quantizes_nothing_is_not_compiled(fast_profiling):
    """A no-op quantizer is known once quantize_ ran: its torch.compile (seconds for a ResNet-50 on a GPU) is
    skipped, and the row is still no-op."""
    import aitune.torch as ait
    from torch._dynamo.utils import counters

    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU(), torch.nn.Linear(16, 4)).eval()
    backend = TorchAOBackend(TorchAOBackendConfig(quantization="int8wo", compile=True,
                                                  filter_fn=lambda module, name: name == "no_such_layer"))
    tuned = ait.Module(model, "noop-compiled",
                       strategy=ait.MaxThroughputStrategy([backend], profiling_config=fast_profiling))
    graphs_before = counters["stats"]["unique_graphs"]
    report = ait.tune(tuned, [torch.randn(b, 16) for b in (2, 4)], ready_batches=True)
    row = next(r for r in report.rows if r.backend == "torchao")
    assert row.status == "no-op"
    assert counters["stats"]["unique_graphs"] == graphs_before  # nothing was traced or compiled
    assert tuned.backends["graph0"].name == "eager"
