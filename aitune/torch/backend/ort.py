"""PLACEHOLDER: being written; replaced before this lands."""
import enum
class ONNXExecutionProvider:
    pass
class ONNXRuntimeBackend:
    pass
class ONNXRuntimeBackendConfig:
    pass
