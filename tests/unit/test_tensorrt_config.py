"""TensorRT / Torch-TensorRT configs, optimization-profile rules and the unavailable path (CPU, no TensorRT).

TensorRT and Torch-TensorRT cannot be installed on the machines this project runs on; what needs them
is skipped with that reason. Everything here is plain logic of ours and runs for real.
"""

import importlib.util

import pytest
import torch

from aitune.errors import BackendRuntimeError, BackendUnavailableError, ConfigError
from aitune.torch.backend import (
    BackendConfig,
    ONNXAutoCastConfig,
    ONNXQuantizationConfig,
    ProfileMode,
    TensorRTBackend,
    TensorRTBackendConfig,
    TensorRTProfile,
    TorchQuantizationConfig,
    TorchTensorRTAotBackend,
    TorchTensorRTAotBackendConfig,
    TorchTensorRTConfig,
    TorchTensorRTJitBackend,
    TorchTensorRTJitBackendConfig,
)
from aitune.torch.backend.tensorrt import profiles as rules
from aitune.torch.record.samples import BatchDim, record_graphs

HAS_TENSORRT = importlib.util.find_spec("tensorrt") is not None
HAS_TORCH_TENSORRT = importlib.util.find_spec("torch_tensorrt") is not None


class Net(torch.nn.Module):
    """A small network: conv -> relu -> pool -> linear, batch-dynamic."""

    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(),
                                        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(8, 4))

    def forward(self, x):
        return self.body(x)


class TwoInputs(torch.nn.Module):
    def forward(self, tokens, mask):
        return tokens.float() * mask


def c27_graph(batches=(1, 8, 16)):
    net = Net().eval()
    return record_graphs(net, [((torch.randn(b, 3, 64, 64),), {}) for b in batches])[0]


# --------------------------------------------------------------------------------------------- the brief's snippets


def test_brief_snippets_construct_and_report_unavailable():
    # TensorRT Backend (brief, as written)
    config = TensorRTBackendConfig(quantization_config=ONNXAutoCastConfig())  # FP16 autocast through ModelOpt
    backend = TensorRTBackend(config)
    assert backend.config.quantization_config == ONNXAutoCastConfig(precision="fp16", keep_io_types=True)
    # CUDA Graphs Support
    config = TensorRTBackendConfig(use_cuda_graphs=True)
    graphs_backend = TensorRTBackend(config)
    assert graphs_backend.config.use_cuda_graphs and graphs_backend.config.max_cuda_graphs == 8
    # Torch-TensorRT JIT and AOT
    jit = TorchTensorRTJitBackend(TorchTensorRTJitBackendConfig(compile_config=TorchTensorRTConfig()))
    aot = TorchTensorRTAotBackend(TorchTensorRTAotBackendConfig(compile_config=TorchTensorRTConfig()))
    assert (backend.name, jit.name, aot.name) == ("tensorrt", "torch_tensorrt_jit", "torch_tensorrt_aot")
    assert backend.build_mode.value == "aot" and jit.build_mode.value == "jit" and aot.build_mode.value == "aot"
    for candidate in (backend, jit, aot):
        assert candidate.device_types == frozenset({"cuda"})

    if not HAS_TENSORRT:
        check = TensorRTBackend.availability()
        assert not check.ok
        assert check.reason == "package 'tensorrt' not found — pip install 'aitune[tensorrt]'"
        with pytest.raises(BackendUnavailableError, match=r"Backend 'tensorrt' is unavailable: package 'tensorrt' "
                                                          r"not found — pip install 'aitune\[tensorrt\]'"):
            backend.build(Net().eval(), c27_graph(), "cuda", "/tmp/unused")
        assert not backend.supports(Net(), c27_graph(), torch.device("cuda")).ok
    if not HAS_TORCH_TENSORRT:
        for klass in (TorchTensorRTJitBackend, TorchTensorRTAotBackend):
            check = klass.availability()
            assert check.reason == "package 'torch-tensorrt' not found — pip install 'aitune[torch-tensorrt]'"


def test_backends_are_registered_under_their_names():
    from aitune.torch.backend import get_backend_class

    assert get_backend_class("tensorrt") is TensorRTBackend
    assert get_backend_class("torch_tensorrt_jit") is TorchTensorRTJitBackend
    assert get_backend_class("torch_tensorrt_aot") is TorchTensorRTAotBackend


def test_importing_aitune_torch_does_not_import_tensorrt_stack():
    import subprocess
    import sys

    code = ("import sys, aitune.torch, aitune.torch.backend, aitune.torch.backend.cuda_graphs;"
            "heavy=[m for m in sys.modules if m.split('.')[0] in "
            "('tensorrt','torch_tensorrt','modelopt','polygraphy','onnx','onnxruntime')];print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# --------------------------------------------------------------------------------------------- configs


def test_tensorrt_config_defaults_match_the_reference():
    config = TensorRTBackendConfig()
    assert config.use_dynamo is True and config.workspace_size is None and config.opset_version is None
    assert config.optimization_level is None and config.compatibility_level is None and config.timing_cache is None
    assert config.profiles is ProfileMode.SINGLE and config.quantization_config is None
    assert config.enable_tf32 is True and config.use_cuda_graphs is False and config.max_cuda_graphs == 8


@pytest.mark.parametrize("kwargs, message", [
    (dict(optimization_level=6), "optimization_level must be an int in 0..5"),
    (dict(optimization_level=True), "optimization_level"),
    (dict(workspace_size=0), "workspace_size must be a number of bytes > 0"),
    (dict(opset_version=3), "opset_version"),
    (dict(compatibility_level="hopper_only"), "compatibility_level must be one of"),
    (dict(profiles="every_shape"), "profiles must be one of"),
    (dict(profiles=[]), "empty list"),
    (dict(profiles=[TensorRTProfile()]), "has no input shapes"),
    (dict(quantization_config="fp16"), "quantization_config must be"),
    (dict(use_cuda_graphs=1), "use_cuda_graphs must be a bool"),
    (dict(max_cuda_graphs=0), "max_cuda_graphs must be an int >= 1"),
    (dict(build_timeout_s=0), "build_timeout_s"),
])
def test_tensorrt_config_rejects_bad_values(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        TensorRTBackendConfig(**kwargs)


def test_tensorrt_config_normalises_values():
    config = TensorRTBackendConfig(compatibility_level="Ampere_Plus", profiles="samples_used", timing_cache="/tmp/tc.bin")
    assert config.compatibility_level == 1
    assert config.profiles is ProfileMode.SAMPLES_USED
    assert str(config.timing_cache) == "/tmp/tc.bin"


@pytest.mark.parametrize("config", [
    TensorRTBackendConfig(),
    TensorRTBackendConfig(quantization_config=ONNXAutoCastConfig(precision="bf16", keep_io_types=False),
                          optimization_level=5, workspace_size=1 << 30, compatibility_level=2,
                          timing_cache="cache/timing.bin", use_cuda_graphs=True, max_cuda_graphs=3),
    TensorRTBackendConfig(quantization_config=ONNXQuantizationConfig(precision="int8", calibration_method="entropy"),
                          profiles=ProfileMode.SAMPLES_USED),
    TensorRTBackendConfig(quantization_config=TorchQuantizationConfig(quantization_config="INT8_SMOOTHQUANT_CFG"),
                          profiles=[TensorRTProfile().add_input_shape("x", (1, 3), (4, 3), (8, 3)),
                                    TensorRTProfile().add_input_shape(("inputs", "tokens"), (2,), (2,), (2,))]),
])
def test_tensorrt_config_round_trips_through_json(config):
    import json

    payload = json.loads(json.dumps(config.to_dict()))
    restored = BackendConfig.from_dict(payload)
    assert restored == config
    assert restored.key() == config.key()
    assert type(restored.quantization_config) is type(config.quantization_config)


def test_config_key_changes_with_profiles_and_quantization():
    base = TensorRTBackendConfig()
    keys = {base.key(),
            TensorRTBackendConfig(profiles=ProfileMode.SAMPLES_USED).key(),
            TensorRTBackendConfig(quantization_config=ONNXAutoCastConfig()).key(),
            TensorRTBackendConfig(quantization_config=ONNXAutoCastConfig(precision="bf16")).key(),
            TensorRTBackendConfig(profiles=[TensorRTProfile().add_input_shape("x", (1,), (2,), (4,))]).key()}
    assert len(keys) == 5


def test_quantization_configs_validate():
    with pytest.raises(ConfigError, match="'fp16' or 'bf16'"):
        ONNXAutoCastConfig(precision="int8")
    with pytest.raises(ConfigError, match="precision must be one of"):
        ONNXQuantizationConfig(precision="fp4")
    with pytest.raises(ConfigError, match="does not apply to fp8"):
        ONNXQuantizationConfig(precision="fp8", calibration_method="entropy")
    with pytest.raises(TypeError):
        ONNXQuantizationConfig()  # precision is required, as in the reference
    assert ONNXQuantizationConfig(precision="int4", calibration_method="awq_clip").calibration_method == "awq_clip"
    with pytest.raises(ConfigError, match="quantization_config must be one of"):
        TorchQuantizationConfig(quantization_config="INT2")


def test_profile_builder_chains_validates_and_round_trips():
    profile = (TensorRTProfile()
               .add_input_shape("x", (1, 3, 64, 64), (8, 3, 64, 64), (16, 3, 64, 64))
               .add_input_shape(("options", "mask"), [1, 4], [8, 4], [16, 4]))
    assert profile.to_dict() == {"x": [[1, 3, 64, 64], [8, 3, 64, 64], [16, 3, 64, 64]],
                                 "options.mask": [[1, 4], [8, 4], [16, 4]]}
    assert TensorRTProfile.from_dict(profile.to_dict()) == profile
    assert hash(TensorRTProfile.from_dict(profile.to_dict())) == hash(profile)
    with pytest.raises(ConfigError, match="min <= opt <= max"):
        TensorRTProfile().add_input_shape("x", (4,), (2,), (8,))
    with pytest.raises(ConfigError, match="different ranks"):
        TensorRTProfile().add_input_shape("x", (1, 2), (2,), (4,))
    with pytest.raises(ConfigError, match="must not be empty"):
        TensorRTProfile().add_input_shape("", (1,), (1,), (1,))


def test_torch_tensorrt_config_validation_and_settings():
    assert TorchTensorRTConfig().use_explicit_typing is True  # the reference's fallback defaults
    assert TorchTensorRTConfig().enabled_precisions is None and TorchTensorRTConfig().workspace_size == 0
    # enabled_precisions alone is the reference's weak-typing request (issue #13): use_explicit_typing resolves False.
    assert TorchTensorRTConfig(enabled_precisions={torch.float16}).use_explicit_typing is False
    with pytest.raises(ConfigError, match="use_explicit_typing=False"):
        TorchTensorRTConfig(enabled_precisions={torch.float16}, use_explicit_typing=True)
    with pytest.raises(ConfigError, match="not TensorRT kernel precisions"):
        TorchTensorRTConfig(enabled_precisions={torch.float64}, use_explicit_typing=False)
    with pytest.raises(ConfigError, match="min_block_size"):
        TorchTensorRTConfig(min_block_size=0)
    with pytest.raises(ConfigError, match="repeats fields"):
        TorchTensorRTConfig(extra_settings={"min_block_size": 1})
    config = TorchTensorRTConfig(enabled_precisions=["fp16", torch.float32], use_explicit_typing=False,
                                 min_block_size=1, torch_executed_ops=["torch.ops.aten.add.Tensor"],
                                 extra_settings={"num_avg_timing_iters": 2})
    assert config.enabled_precisions == {torch.float16, torch.float32}
    settings = config.settings()
    assert settings["enabled_precisions"] == {torch.float16, torch.float32}
    assert settings["torch_executed_ops"] == {"torch.ops.aten.add.Tensor"}
    assert settings["num_avg_timing_iters"] == 2 and "optimization_level" not in settings  # None = TRT default
    # An older torch_tensorrt without a field: dropped at its default, refused when set.
    accepted = set(settings) - {"immutable_weights"}
    assert "immutable_weights" not in config.settings(accepted)
    with pytest.raises(ConfigError, match="immutable_weights=False is not a setting"):
        TorchTensorRTConfig(immutable_weights=False).settings(accepted)
    with pytest.raises(ConfigError, match="extra_settings\\['num_avg_timing_iters'\\]"):
        config.settings(accepted - {"num_avg_timing_iters"})


def test_torch_tensorrt_configs_round_trip():
    for config in (TorchTensorRTJitBackendConfig(compile_config=TorchTensorRTConfig(min_block_size=1),
                                                 dynamic=True, autocast_enabled=True, autocast_dtype="bf16"),
                   TorchTensorRTAotBackendConfig(compile_config=TorchTensorRTConfig(
                       enabled_precisions={torch.float16}, use_explicit_typing=False), pickle_protocol=4)):
        restored = BackendConfig.from_dict(config.to_dict())
        assert restored == config and restored.key() == config.key()
    with pytest.raises(ConfigError, match="compile_config must be a TorchTensorRTConfig"):
        TorchTensorRTJitBackendConfig(compile_config=3)


# --------------------------------------------------------------------------------------------- profile derivation


def test_single_profile_spans_recorded_min_max_with_opt_at_max():
    graph = c27_graph((1, 8, 16))
    assert rules.single_profile(graph) == [{"input_x": ((1, 3, 64, 64), (16, 3, 64, 64), (16, 3, 64, 64))}]


def test_single_profile_uses_declared_dims():
    net = Net().eval()
    graph = record_graphs(net, [((torch.randn(2, 3, 8, 8),), {})],
                          dynamic_shapes={"x": (BatchDim("batch", 1, 32, opt=4), 3, 8, 8)})[0]
    assert rules.single_profile(graph) == [{"input_x": ((1, 3, 8, 8), (4, 3, 8, 8), (32, 3, 8, 8))}]


def test_samples_used_makes_one_static_profile_per_distinct_shape():
    graph = c27_graph((2, 8, 2, 4))
    profiles = rules.samples_profiles(graph)
    shapes = [profile["input_x"] for profile in profiles]
    assert shapes == [((b, 3, 64, 64),) * 3 for b in (2, 8, 4)]
    assert rules.resolve_profiles(graph, ProfileMode.SAMPLES_USED) == profiles


def test_user_profiles_are_checked_against_real_inputs():
    module = TwoInputs()
    graph = record_graphs(module, [((torch.ones(2, 5, dtype=torch.int64), torch.ones(2, 5)), {}),
                                   ((torch.ones(4, 7, dtype=torch.int64), torch.ones(4, 7)), {})])[0]
    good = (TensorRTProfile().add_input_shape("tokens", (1, 1), (4, 8), (8, 16))
            .add_input_shape("input_mask", (1, 1), (4, 8), (8, 16)))  # by path or by engine name
    assert rules.user_profiles(graph, [good]) == [{"input_tokens": ((1, 1), (4, 8), (8, 16)),
                                                   "input_mask": ((1, 1), (4, 8), (8, 16))}]
    with pytest.raises(ConfigError, match=r"names input 'attention_mask', which graph0 does not have; its tensor "
                                          r"inputs are: tokens \(rank 2\), mask \(rank 2\)"):
        rules.user_profiles(graph, [TensorRTProfile().add_input_shape("attention_mask", (1, 1), (1, 1), (1, 1))])
    with pytest.raises(ConfigError, match=r"profile 0 has no shapes for input\(s\) mask"):
        rules.user_profiles(graph, [TensorRTProfile().add_input_shape("tokens", (1, 1), (4, 8), (8, 16))])
    with pytest.raises(ConfigError, match="has rank 2 but the profile gives 3 axes"):
        rules.user_profiles(graph, [TensorRTProfile().add_input_shape("tokens", (1, 1, 1), (1, 1, 1), (1, 1, 1))
                                    .add_input_shape("mask", (1, 1), (1, 1), (1, 1))])
    static_graph = c27_graph((1, 8))
    with pytest.raises(ConfigError, match="axis 1 of input 'x' is static \\(size 3\\)"):
        rules.user_profiles(static_graph, [TensorRTProfile().add_input_shape("x", (1, 1, 64, 64), (8, 3, 64, 64),
                                                                             (16, 3, 64, 64))])


def test_supports_reports_profile_errors_once_tensorrt_is_there(monkeypatch):
    from aitune.torch.backend.base import Check

    monkeypatch.setattr(TensorRTBackend, "availability", classmethod(lambda cls: Check(True)))
    graph = c27_graph((1, 8))
    bad = TensorRTBackend(TensorRTBackendConfig(profiles=[TensorRTProfile().add_input_shape("y", (1,), (1,), (1,))]))
    check = bad.supports(Net(), graph, torch.device("cuda"))
    assert not check.ok and "names input 'y'" in check.reason
    double = record_graphs(torch.nn.Identity(), [((torch.ones(2, dtype=torch.float64),), {})])[0]
    check = TensorRTBackend().supports(torch.nn.Identity(), double, torch.device("cuda"))
    assert not check.ok and "input input is float64, which TensorRT has no tensor type for" in check.reason
    assert not TensorRTBackend().supports(Net(), graph, torch.device("cpu")).ok  # CUDA only
    torch_ptq = TensorRTBackend(TensorRTBackendConfig(quantization_config=TorchQuantizationConfig()))
    check = torch_ptq.supports(Net(), graph, torch.device("cuda"))
    assert not check.ok and "TorchQuantizationConfig is not supported yet" in check.reason


def test_constrain_to_onnx_fixes_or_drops_specialised_axes():
    profiles = [{"input_x": ((1, 3), (8, 3), (16, 3))}, {"input_x": ((32, 3), (32, 3), (32, 3))}]
    kept, notes = rules.constrain_to_onnx(profiles, {"input_x": [None, 3]})
    assert kept == profiles and notes == []
    kept, notes = rules.constrain_to_onnx(profiles, {"input_x": [2, 3]})  # export baked batch 2
    assert kept == [{"input_x": ((2, 3), (2, 3), (2, 3))}]
    assert any("fixed to 2" in note for note in notes) and any("dropped" in note for note in notes)
    with pytest.raises(ConfigError, match="no TensorRT optimization profile fits"):
        rules.constrain_to_onnx(profiles[1:], {"input_x": [2, 3]})
    kept, notes = rules.constrain_to_onnx([{"input_x": ((1, 3), (1, 3), (1, 3)), "input_unused": ((1,), (1,), (1,))}],
                                          {"input_x": [None, 3]})
    assert kept == [{"input_x": ((1, 3), (1, 3), (1, 3))}] and "unused" in notes[0]


def test_onnx_input_shapes_reads_symbolic_and_fixed_axes(tmp_path):
    pytest.importorskip("onnx")
    from aitune.torch.backend.onnx_export import export_onnx

    graph = c27_graph((1, 8))
    export = export_onnx(Net().eval(), graph, tmp_path / "model.onnx", device="cpu")
    shapes = rules.onnx_input_shapes(export.path)
    assert list(shapes) == ["input_x"]
    assert shapes["input_x"][1:] == [3, 64, 64] and shapes["input_x"][0] is None  # batch stays dynamic
    kept, _ = rules.constrain_to_onnx(rules.single_profile(graph, export.input_names), shapes)
    assert kept == [{"input_x": ((1, 3, 64, 64), (8, 3, 64, 64), (8, 3, 64, 64))}]


# --------------------------------------------------------------------------------------------- profile selection


C27_PROFILE = [{"input_x": ((1, 3, 64, 64), (8, 3, 64, 64), (16, 3, 64, 64))}]


@pytest.mark.parametrize("batch, expected", [(1, 0), (5, 0), (16, 0), (17, None), (64, None)])
def test_select_profile_c27(batch, expected):
    assert rules.select_profile(C27_PROFILE, {"input_x": (batch, 3, 64, 64)}) == expected


def test_select_profile_picks_the_first_covering_profile():
    profiles = [{"a": ((1, 4), (2, 4), (2, 4))}, {"a": ((2, 4), (8, 4), (8, 4))}]
    assert rules.select_profile(profiles, {"a": (2, 4)}) == 0
    assert rules.select_profile(profiles, {"a": (5, 4)}) == 1
    assert rules.select_profile(profiles, {"a": (5, 5)}) is None
    assert rules.select_profile(profiles, {"a": (5,)}) is None  # wrong rank


def test_out_of_profile_message_names_input_and_ranges():
    message = rules.out_of_profile_message(C27_PROFILE, {"input_x": (17, 3, 64, 64)}, {"input_x": "x"})
    assert message.startswith("input shape outside every TensorRT optimization profile: x [17, 3, 64, 64]; "
                              "profile 0: x min [1, 3, 64, 64] max [16, 3, 64, 64]")


def test_profiles_json_round_trip(tmp_path):
    profiles = [{"input_x": ((1, 3), (2, 3), (4, 3)), "input_y": ((1,), (1,), (1,))}]
    assert rules.profiles_from_json(rules.profiles_to_json(profiles)) == profiles
    rules.write_profiles(tmp_path / "p.json", profiles)
    import json

    assert json.loads((tmp_path / "p.json").read_text()) == [{"input_x": [[1, 3], [2, 3], [4, 3]],
                                                              "input_y": [[1], [1], [1]]}]


def test_polygraphy_profiles_from_our_json():
    pytest.importorskip("polygraphy")
    from aitune.torch.backend.tensorrt.engine_build import polygraphy_profiles

    (profile,) = polygraphy_profiles([{"input_x": [[1, 3], [2, 3], [4, 3]]}])
    assert tuple(profile["input_x"].min) == (1, 3) and tuple(profile["input_x"].opt) == (2, 3)
    assert tuple(profile["input_x"].max) == (4, 3)


# --------------------------------------------------------------------------------------------- backend routing


def test_accepts_is_false_outside_every_profile():
    """accepts() is False outside the profile, so the Module runs eager (a direct call: test_tensorrt_runtime)."""
    graph = c27_graph((1, 8, 16))
    backend = TensorRTBackend()
    flat_names = [spec.name for spec in graph.tensor_specs]
    backend._names, backend._leaf_indices = flat_names, [spec.leaf_index for spec in graph.tensor_specs]
    backend._profiles = rules.single_profile(graph, flat_names)
    for batch in (1, 5, 16):
        assert backend.accepts([torch.randn(batch, 3, 64, 64)])
    for batch in (17, 64):
        assert not backend.accepts([torch.randn(batch, 3, 64, 64)])
    assert not backend.accepts([torch.randn(4, 3, 32, 32)])


@pytest.mark.skipif(not HAS_TENSORRT, reason="needs TensorRT (package 'tensorrt' not found — pip install "
                                             "'aitune[tensorrt]' on a machine with CUDA); this project's CI has "
                                             "none, so it never runs there")
@pytest.mark.gpu
def test_tensorrt_builds_and_matches_eager_c27(tmp_path):  # pragma: no cover - never runs here
    from aitune.torch.check.correctness import OutputComparator, Tolerance

    net = Net().cuda().eval()
    graph = record_graphs(net, [((torch.randn(b, 3, 64, 64, device="cuda"),), {}) for b in (1, 8, 16)])[0]
    backend = TensorRTBackend(TensorRTBackendConfig(enable_tf32=False)).build(net, graph, "cuda", tmp_path)
    comparator = OutputComparator(Tolerance())
    for batch in (1, 5, 16):
        x = torch.randn(batch, 3, 64, 64, device="cuda")
        with torch.no_grad():
            comparator.compare(net(x), backend(x))
    assert not backend.accepts([torch.randn(17, 3, 64, 64, device="cuda")])
    with pytest.raises(BackendRuntimeError, match="outside every TensorRT optimization profile"):
        backend(torch.randn(17, 3, 64, 64, device="cuda"))
