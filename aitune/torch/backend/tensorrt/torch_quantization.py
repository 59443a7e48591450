"""The reference system's module path of :class:`TorchQuantizationConfig` (its FLUX example imports it from here)."""

from aitune.torch.backend.tensorrt.config import TorchQuantizationConfig

__all__ = ["TorchQuantizationConfig"]
