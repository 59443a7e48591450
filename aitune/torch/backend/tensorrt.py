"""PLACEHOLDER: being written; replaced before this lands."""
import enum
class ONNXAutoCastConfig:
    pass
class ONNXQuantizationConfig:
    pass
class ProfileMode:
    pass
class TensorRTBackend:
    pass
class TensorRTBackendConfig:
    pass
class TensorRTProfile:
    pass
class TorchQuantizationConfig:
    pass
