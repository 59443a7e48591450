import subprocess
import sys

import torch

import aitune.torch as ait
import aitune.torch.backend as backend
import aitune.torch.tune_strategy as tune_strategy

BRIEF_BACKEND_NAMES = {
    "TensorRTBackend", "TensorRTBackendConfig", "ONNXAutoCastConfig", "TorchTensorRTJitBackend",
    "TorchTensorRTJitBackendConfig", "TorchTensorRTConfig", "TorchTensorRTAotBackend", "TorchTensorRTAotBackendConfig",
    "TorchAOBackend", "TorchInductorJitBackend", "TorchInductorAotBackend", "ONNXRuntimeBackend",
    "ONNXRuntimeBackendConfig", "ONNXExecutionProvider", "KernelSelectorBackend", "KernelSelectorBackendConfig",
}


def test_public_surface_is_exactly_all():
    assert set(ait.__all__) == {"GuardConfig",
        "BatchDim", "DynamicDim", "FirstWinsStrategy", "InspectedModulesInfo", "LatencyBudgetStrategy",
        "MaxThroughputStrategy", "MinLatencyStrategy", "Module", "ModuleInfo", "ModuleState", "OneBackendStrategy",
        "OnnxModule",
        "PatchedModule", "ProbeConfig", "ProfilingConfig", "Tolerance", "TuneReport", "TuneStrategy", "aitune_cache_dir",
        "inspect", "jit_config", "jit_reset", "load", "patch_for_jit_tuning", "save", "tune", "wrap",
        # the reference system's names (issue #13)
        "DataLoaderFactory", "LocalTorchStorage", "ModuleFunctionKernelProfiler", "PerformanceProfile", "config",
        "profile", "snapshot_tuning_data"}
    assert set(tune_strategy.__all__) == {"FirstWinsStrategy", "LatencyBudgetStrategy", "MaxThroughputStrategy",
                                          "MinLatencyStrategy", "OneBackendStrategy", "TuneStrategy"}
    assert BRIEF_BACKEND_NAMES | {"ArtifactPath"} <= set(backend.__all__)
    for module in (ait, backend, tune_strategy):
        for name in module.__all__:
            assert getattr(module, name) is not None


def test_import_does_not_pull_optional_packages():
    code = ("import sys, aitune.torch, aitune.torch.backend, aitune.torch.kernel_forge.kernel_provider; "
            "heavy = {'onnxruntime', 'onnx', 'torchao', 'tensorrt', 'torch_tensorrt', 'modelopt', 'sageattention', "
            "'polygraphy', 'transformers'}; print(sorted(heavy & set(sys.modules)))")
    output = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert output.strip() == "[]"


def test_unknown_backend_lists_registered_names():
    import pytest

    from aitune.errors import UnknownBackendError

    with pytest.raises(UnknownBackendError) as info:
        backend.get_backend_class("nope")
    assert "eager" in str(info.value) and "inductor_jit" in str(info.value)


def test_cli_env_lists_every_backend():
    output = subprocess.run([sys.executable, "-m", "aitune.cli", "env"], capture_output=True, text=True,
                            check=True).stdout
    for name in ("eager", "inductor_jit", "tensorrt", "torch_tensorrt_jit"):
        assert name in output
    assert "pip install 'aitune[tensorrt]'" in output
    from aitune.torch.common.environment import native_bf16

    device = "cuda" if torch.cuda.is_available() else "cpu"  # the device `aitune env` describes
    assert ("native bf16: yes" if native_bf16(device) else "native bf16: no") in output


def test_cli_env_piped_into_head_ends_quietly():
    """`aitune env | head -5` must not end in a BrokenPipeError traceback with exit status 1."""
    process = subprocess.Popen([sys.executable, "-m", "aitune.cli", "env"], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    first = process.stdout.readline()  # read one line, then leave, as head does
    process.stdout.close()
    stderr = process.stderr.read()
    assert first.startswith("aitune ") and process.wait(timeout=120) == 0
    assert "BrokenPipeError" not in stderr and "Traceback" not in stderr
