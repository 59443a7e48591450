"""PLACEHOLDER: being written; replaced before this lands."""
import enum
class TorchAOBackend:
    pass
class TorchAOBackendConfig:
    pass
