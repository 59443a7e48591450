"""PLACEHOLDER: being written; replaced before this lands."""
import enum
class TorchTensorRTAotBackend:
    pass
class TorchTensorRTAotBackendConfig:
    pass
class TorchTensorRTConfig:
    pass
class TorchTensorRTJitBackend:
    pass
class TorchTensorRTJitBackendConfig:
    pass
