"""The tensor types ONNX Runtime's I/O binding takes and gives, and a zero-copy view of a CUDA ``OrtValue``: they
live in :mod:`aitune.torch.record.ort_values` (so :class:`~aitune.torch.OnnxModule` shares them) and stay
importable from here."""

from aitune.torch.record.ort_values import NUMPY_NAMES, ORT_TYPES, CudaArray  # noqa: F401 - re-exported
