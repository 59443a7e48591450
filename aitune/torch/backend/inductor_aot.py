"""PLACEHOLDER: being written; replaced before this lands."""
import enum
class TorchInductorAotBackend:
    pass
class TorchInductorAotBackendConfig:
    pass
