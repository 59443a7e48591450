"""TensorRT backend: ONNX export -> optional ModelOpt quantization -> TensorRT engine (sub-package).

``aitune.torch.backend.tensorrt`` keeps the public names of the reference interface:
:class:`TensorRTBackend`, :class:`TensorRTBackendConfig`, :class:`TensorRTProfile`, :class:`ProfileMode`,
:class:`ONNXAutoCastConfig`, :class:`ONNXQuantizationConfig`, :class:`TorchQuantizationConfig`.
Modules: ``config`` (plain-data configs), ``profiles`` (optimization-profile rules), ``runtime`` (engine
I/O binding), ``engine_build`` (the isolated build step), ``quantization`` (ModelOpt steps), ``backend``.
TensorRT, Polygraphy and ModelOpt are imported only inside functions.
"""

from aitune.torch.backend.tensorrt.backend import TensorRTBackend
from aitune.torch.backend.tensorrt.config import (
    ONNXAutoCastConfig,
    ONNXQuantizationConfig,
    ProfileMode,
    TensorRTBackendConfig,
    TensorRTProfile,
    TorchQuantizationConfig,
)

__all__ = [
    "ONNXAutoCastConfig",
    "ONNXQuantizationConfig",
    "ProfileMode",
    "TensorRTBackend",
    "TensorRTBackendConfig",
    "TensorRTProfile",
    "TorchQuantizationConfig",
]
