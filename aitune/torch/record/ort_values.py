"""The tensor types ONNX Runtime's I/O binding takes and gives (as torch dtypes), and a zero-copy view of a CUDA
``OrtValue`` for torch (used by the ONNX Runtime backend and :class:`~aitune.torch.OnnxModule`)."""

from __future__ import annotations

import torch


# Tensor dtypes the backend binds (the numpy element types ONNX Runtime's IOBinding takes).
NUMPY_NAMES = {
    torch.float16: "float16", torch.float32: "float32", torch.float64: "float64",
    torch.int8: "int8", torch.int16: "int16", torch.int32: "int32", torch.int64: "int64",
    torch.uint8: "uint8", torch.bool: "bool",
}
# ONNX Runtime's type strings (OrtValue.data_type()) of the same dtypes.
ORT_TYPES = {
    "tensor(float16)": torch.float16, "tensor(float)": torch.float32, "tensor(double)": torch.float64,
    "tensor(int8)": torch.int8, "tensor(int16)": torch.int16, "tensor(int32)": torch.int32,
    "tensor(int64)": torch.int64, "tensor(uint8)": torch.uint8, "tensor(bool)": torch.bool,
}


class CudaArray:
    """A CUDA OrtValue seen through ``__cuda_array_interface__`` (v2) so torch can wrap it without a copy."""

    def __init__(self, value, dtype: torch.dtype):
        import numpy

        self.__cuda_array_interface__ = {
            "shape": tuple(value.shape()),
            "typestr": numpy.dtype(NUMPY_NAMES[dtype]).str,
            "data": (value.data_ptr(), False),
            "version": 2,
            "strides": None,
        }
