"""TEST DOUBLE of the TensorRT Python API, for tests only (TensorRT cannot be installed on this project's machines).

``FakeTensorRTEngine`` / ``FakeExecutionContext`` / ``fake_trt`` stand in for the TensorRT >= 10 API subset
that :class:`aitune.torch.backend.tensorrt.runtime.TensorRTRunner` uses: name-based I/O, optimization
profiles, ``set_input_shape``/``set_tensor_address``, ``get_tensor_shape`` (-1 for data-dependent outputs),
``IOutputAllocator`` and ``execute_async_v3``. The double is strict where TensorRT is: it reads inputs from
the raw (CPU) addresses it was given, rejects shapes outside the active profile, and writes outputs to the
given addresses or to memory obtained from the output allocator. ``onnx_engine`` makes one that computes
with ONNX Runtime (CPU) from an ONNX file, standing in for an engine built from that file.

It proves our binding logic, not that TensorRT behaves like it.
"""

import ctypes
import enum
import math

import torch


class FakeDataType(enum.Enum):
    FLOAT = "float32"
    HALF = "float16"
    BF16 = "bfloat16"
    INT8 = "int8"
    INT32 = "int32"
    INT64 = "int64"
    BOOL = "bool"
    UINT8 = "uint8"


class FakeTensorIOMode(enum.Enum):
    INPUT = 1
    OUTPUT = 2


class FakeOutputAllocatorBase:
    """Stand-in for ``trt.IOutputAllocator`` (a pybind base class in TensorRT)."""

    def __init__(self):
        pass


class fake_trt:  # noqa: N801 - stands in for the ``tensorrt`` module
    """Stand-in for the ``tensorrt`` module: the names the runner reads."""

    TensorIOMode = FakeTensorIOMode
    IOutputAllocator = FakeOutputAllocatorBase
    float32 = FakeDataType.FLOAT
    float16 = FakeDataType.HALF
    bfloat16 = FakeDataType.BF16
    int8 = FakeDataType.INT8
    int32 = FakeDataType.INT32
    int64 = FakeDataType.INT64
    bool = FakeDataType.BOOL
    uint8 = FakeDataType.UINT8


def _torch_dtype(fake: FakeDataType) -> torch.dtype:
    return getattr(torch, fake.value)


def _read(address: int, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    """Read a dense tensor from raw (CPU) memory at ``address`` — what an engine does with a binding."""
    numel = math.prod(shape)
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    raw = (ctypes.c_char * nbytes).from_address(address)
    return torch.frombuffer(bytearray(raw), dtype=dtype).reshape(shape)


def _write(address: int, tensor: torch.Tensor) -> None:
    tensor = tensor.contiguous()
    ctypes.memmove(address, tensor.data_ptr(), tensor.numel() * tensor.element_size())


class FakeTensorRTEngine:
    """Stand-in for ``trt.ICudaEngine`` computing its outputs with a torch function on CPU memory.

    Args:
        inputs: ``{name: (FakeDataType, [(min, opt, max) per profile])}``.
        outputs: ``{name: FakeDataType}``.
        compute: ``f({input name: tensor}) -> {output name: tensor}``.
        data_dependent: output names whose shape is unknown until execution (-1 in ``get_tensor_shape``).
    """

    def __init__(self, inputs, outputs, compute, data_dependent=()):
        self.inputs, self.outputs, self.compute = inputs, outputs, compute
        self.data_dependent = set(data_dependent)
        self.names = list(inputs) + list(outputs)
        self.contexts = []

    @property
    def num_io_tensors(self):
        return len(self.names)

    @property
    def num_optimization_profiles(self):
        return len(next(iter(self.inputs.values()))[1])

    def get_tensor_name(self, index):
        return self.names[index]

    def get_tensor_mode(self, name):
        return FakeTensorIOMode.INPUT if name in self.inputs else FakeTensorIOMode.OUTPUT

    def get_tensor_dtype(self, name):
        return self.inputs[name][0] if name in self.inputs else self.outputs[name]

    def get_tensor_profile_shape(self, name, profile_index):
        return [list(shape) for shape in self.inputs[name][1][profile_index]]

    def create_execution_context(self):
        context = FakeExecutionContext(self)
        self.contexts.append(context)
        return context


class FakeExecutionContext:
    """Stand-in for ``trt.IExecutionContext``; records the calls the runner makes."""

    def __init__(self, engine):
        self.engine = engine
        self.profile = 0
        self.shapes, self.addresses, self.allocators = {}, {}, {}
        self.profile_switches = []
        self.executions = 0

    def set_optimization_profile_async(self, index, stream):
        self.profile_switches.append(index)
        self.profile = index
        return True

    def set_input_shape(self, name, shape):
        low, _, high = self.engine.inputs[name][1][self.profile]
        if len(shape) != len(low) or any(not (a <= s <= c) for a, s, c in zip(low, shape, high)):
            return False  # TensorRT refuses shapes outside the active profile
        self.shapes[name] = tuple(shape)
        return True

    def set_tensor_address(self, name, address):
        self.addresses[name] = address
        return True

    def set_output_allocator(self, name, allocator):
        self.allocators[name] = allocator
        return True

    def _inputs(self):
        return {name: _read(self.addresses[name], self.shapes[name], _torch_dtype(self.engine.inputs[name][0]))
                for name in self.engine.inputs}

    def get_tensor_shape(self, name):
        if name in self.engine.inputs:
            return self.shapes.get(name, ())
        if name in self.engine.data_dependent:
            return (-1,)
        # Shape inference from shapes only: run the function on zeros of the input shapes.
        zeros = {n: torch.zeros(self.shapes[n], dtype=_torch_dtype(self.engine.inputs[n][0])) for n in self.engine.inputs}
        return tuple(self.engine.compute(zeros)[name].shape)

    def execute_async_v3(self, stream):
        self.executions += 1
        results = self.engine.compute(self._inputs())
        for name, value in results.items():
            value = value.to(_torch_dtype(self.engine.outputs[name]))
            if name in self.allocators and name in self.engine.data_dependent:
                allocator = self.allocators[name]
                nbytes = value.numel() * value.element_size()
                address = allocator.reallocate_output_async(name, 0, nbytes, 256, stream)
                allocator.notify_shape(name, tuple(value.shape))
                _write(address, value)
            else:
                _write(self.addresses[name], value)
        return True


_ONNX_TYPES = {"tensor(float)": FakeDataType.FLOAT, "tensor(float16)": FakeDataType.HALF,
               "tensor(bfloat16)": FakeDataType.BF16, "tensor(int8)": FakeDataType.INT8,
               "tensor(int32)": FakeDataType.INT32, "tensor(int64)": FakeDataType.INT64,
               "tensor(bool)": FakeDataType.BOOL, "tensor(uint8)": FakeDataType.UINT8}


def onnx_engine(onnx_path: str, profiles: list[dict]) -> FakeTensorRTEngine:
    """A stand-in engine for ``onnx_path`` computing with ONNX Runtime (CPU); every output is data-dependent.

    Args:
        profiles: ``[{input name: [min, opt, max]}, ...]`` as the backend passes them to the build step.
    """
    import numpy as np
    import onnxruntime as ort

    session = ort.InferenceSession(onnx_path, providers=["CPUExecutionProvider"])
    inputs = {value.name: (_ONNX_TYPES[value.type], [tuple(tuple(s) for s in profile[value.name]) for profile in profiles])
              for value in session.get_inputs()}
    outputs = {value.name: _ONNX_TYPES[value.type] for value in session.get_outputs()}

    def compute(feeds):
        arrays = session.run(None, {name: tensor.numpy() for name, tensor in feeds.items()})
        return {name: torch.from_numpy(np.ascontiguousarray(array)) for name, array in zip(outputs, arrays)}

    return FakeTensorRTEngine(inputs, outputs, compute, data_dependent=set(outputs))
