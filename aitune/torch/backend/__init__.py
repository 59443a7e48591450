"""Backends: one file per backend, each registering itself by name on import.

Optional heavy packages (onnxruntime, torchao, tensorrt, torch_tensorrt, modelopt, sageattention) are
imported only inside backend methods, never here.
"""

from aitune.torch.common.legacy_names import resolve as _resolve_legacy_name
from aitune.torch.backend.base import (
    Backend,
    BackendConfig,
    BackendState,
    BuildMode,
    Check,
    get_backend_class,
    registered_backends,
)
from aitune.torch.backend.artifact import DeploymentArtifact, TensorInfo
from aitune.torch.backend.reference_contract import ArtifactPath
from aitune.torch.backend.eager import TorchEagerBackend, TorchEagerBackendConfig
from aitune.torch.backend.inductor_jit import TorchInductorJitBackend, TorchInductorJitBackendConfig
from aitune.torch.backend.inductor_aot import TorchInductorAotBackend, TorchInductorAotBackendConfig
from aitune.torch.backend.ort import ONNXExecutionProvider, ONNXRuntimeBackend, ONNXRuntimeBackendConfig
from aitune.torch.backend.ao import TorchAOBackend, TorchAOBackendConfig
from aitune.torch.backend.tensorrt import (
    ONNXAutoCastConfig,
    ONNXQuantizationConfig,
    ProfileMode,
    TensorRTBackend,
    TensorRTBackendConfig,
    TensorRTProfile,
    TorchQuantizationConfig,
)
from aitune.torch.backend.torch_tensorrt import (
    TorchTensorRTAotBackend,
    TorchTensorRTAotBackendConfig,
    TorchTensorRTConfig,
    TorchTensorRTJitBackend,
    TorchTensorRTJitBackendConfig,
)
from aitune.torch.backend.kernel_selector import KernelSelectorBackend, KernelSelectorBackendConfig

__all__ = [
    "ArtifactPath",
    "Backend",
    "BackendConfig",
    "BackendState",
    "BuildMode",
    "Check",
    "DeploymentArtifact",
    "KernelSelectorBackend",
    "KernelSelectorBackendConfig",
    "ONNXAutoCastConfig",
    "ONNXExecutionProvider",
    "ONNXQuantizationConfig",
    "ONNXRuntimeBackend",
    "ONNXRuntimeBackendConfig",
    "ProfileMode",
    "TensorRTBackend",
    "TensorRTBackendConfig",
    "TensorRTProfile",
    "TensorInfo",
    "TorchAOBackend",
    "TorchAOBackendConfig",
    "TorchEagerBackend",
    "TorchEagerBackendConfig",
    "TorchInductorAotBackend",
    "TorchInductorAotBackendConfig",
    "TorchInductorJitBackend",
    "TorchInductorJitBackendConfig",
    "TorchQuantizationConfig",
    "TorchTensorRTAotBackend",
    "TorchTensorRTAotBackendConfig",
    "TorchTensorRTConfig",
    "TorchTensorRTJitBackend",
    "TorchTensorRTJitBackendConfig",
    "get_backend_class",
    "registered_backends",
]


def __getattr__(name: str):
    """Old reference names (e.g. the examples' ``TorchInductorBackend``), with a DeprecationWarning."""
    return _resolve_legacy_name("aitune.torch.backend", name)
