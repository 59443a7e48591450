"""Torch-TensorRT backends: JIT (``torch.compile(backend="torch_tensorrt")``) and AOT (export -> compile -> save).

:class:`TorchTensorRTConfig` mirrors the commonly used fields of ``torch_tensorrt.dynamo.CompilationSettings``
as plain data, so it is built, validated and serialised without ``torch_tensorrt`` installed; at build time
it is turned into keyword arguments checked against the installed version's ``CompilationSettings``.

API facts used (Torch-TensorRT docs): ``torch.compile(module, backend="torch_tensorrt", options=...)``;
``torch_tensorrt.Input(min_shape=, opt_shape=, max_shape=, dtype=, name=)``;
``torch_tensorrt.dynamo.compile(exported_program, arg_inputs=[Input...], **settings)``;
``torch_tensorrt.save(module, path, output_format="exported_program", arg_inputs=..., retrace=...,
pickle_protocol=...)``; ``torch_tensorrt.load(path)`` -> ``ExportedProgram``.

Modules: ``config`` (the configs), ``export`` (``torch.export`` with explicit Dims, in this process),
``compile_step`` (the isolated compile-save-load step), ``backend`` (the JIT and AOT backends).
``torch_tensorrt`` is imported only inside functions.
"""

from aitune.torch.backend.torch_tensorrt.backend import (
    ARTIFACT_FILE,
    TORCH_TENSORRT_REQUIREMENT,
    TorchTensorRTAotBackend,
    TorchTensorRTJitBackend,
)
from aitune.torch.backend.torch_tensorrt.compile_step import (
    compile_exported_program,
    settings_from_json,
    settings_to_json,
)
from aitune.torch.backend.torch_tensorrt.config import (
    SUPPORTED_PRECISIONS,
    TorchTensorRTAotBackendConfig,
    TorchTensorRTConfig,
    TorchTensorRTJitBackendConfig,
    accepted_settings,
)
from aitune.torch.backend.torch_tensorrt.export import export_dynamic_shapes, export_flat_module

__all__ = [
    "ARTIFACT_FILE",
    "SUPPORTED_PRECISIONS",
    "TORCH_TENSORRT_REQUIREMENT",
    "TorchTensorRTAotBackend",
    "TorchTensorRTAotBackendConfig",
    "TorchTensorRTConfig",
    "TorchTensorRTJitBackend",
    "TorchTensorRTJitBackendConfig",
    "accepted_settings",
    "compile_exported_program",
    "export_dynamic_shapes",
    "export_flat_module",
    "settings_from_json",
    "settings_to_json",
]
