"""Run a deserialized TensorRT engine on torch tensors (TensorRT >= 10 name-based I/O API).

:class:`TensorRTRunner` binds flat input tensors to the engine's inputs by name, picks the optimization
profile that covers the call, sizes the outputs at run time (``context.get_tensor_shape`` after the input
shapes are set; an ``IOutputAllocator`` for data-dependent shapes) and enqueues ``execute_async_v3`` on the
caller's current CUDA stream.

The ``trt`` module is passed in rather than imported here, so the binding logic can be exercised against
a test double of the engine API on machines without TensorRT (``tests/unit/test_tensorrt_runtime.py``).

API facts used (TensorRT Python API, ``ICudaEngine`` / ``IExecutionContext`` / ``IOutputAllocator``):
``engine.num_io_tensors``, ``get_tensor_name(i)``, ``get_tensor_mode(name)``, ``get_tensor_dtype(name)``,
``num_optimization_profiles``, ``get_tensor_profile_shape(name, profile)`` -> (min, opt, max),
``create_execution_context()``; ``context.set_optimization_profile_async(index, stream)``,
``set_input_shape(name, shape)``, ``set_tensor_address(name, ptr)``, ``get_tensor_shape(name)`` (-1 where
data-dependent), ``set_output_allocator(name, allocator)``, ``execute_async_v3(stream)`` (all bool).
"""

from __future__ import annotations

import logging
import math
from typing import Any, Sequence

import torch

from aitune.errors import BackendRuntimeError
from aitune.torch.backend.tensorrt.profiles import Profile, out_of_profile_message, select_profile

logger = logging.getLogger(__name__)

#: torch dtype -> attribute name of the matching TensorRT ``DataType`` alias on the ``tensorrt`` module.
TORCH_TO_TRT = {
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.int8: "int8",
    torch.int32: "int32",
    torch.int64: "int64",
    torch.bool: "bool",
    torch.uint8: "uint8",
    torch.float8_e4m3fn: "fp8",
}

INT32_MIN, INT32_MAX = -(2 ** 31), 2 ** 31 - 1


def torch_dtype(trt: Any, trt_dtype: Any) -> torch.dtype:
    """The torch dtype of a TensorRT ``DataType``. Raises BackendRuntimeError for one torch lacks (int4, fp4)."""
    for dtype, name in TORCH_TO_TRT.items():
        if getattr(trt, name, None) is not None and getattr(trt, name) == trt_dtype:
            return dtype
    raise BackendRuntimeError(f"TensorRT tensor type {trt_dtype} has no torch equivalent; aitune binds "
                              f"{', '.join(TORCH_TO_TRT.values())} tensors only")


def make_output_allocator_class(trt: Any, device: torch.device) -> type:
    """A ``trt.IOutputAllocator`` subclass that allocates each output as a fresh torch byte buffer.

    Used for outputs whose shape is only known after execution (data-dependent, e.g. ``nonzero``).
    A fresh buffer per call means a later call never overwrites an output the caller holds.
    """

    class TorchOutputAllocator(trt.IOutputAllocator):
        def __init__(self):
            trt.IOutputAllocator.__init__(self)
            self.buffers: dict[str, torch.Tensor] = {}
            self.shapes: dict[str, tuple[int, ...]] = {}

        def _allocate(self, tensor_name: str, size: int) -> int:
            buffer = torch.empty(max(int(size), 1), dtype=torch.uint8, device=device)
            self.buffers[tensor_name] = buffer
            return buffer.data_ptr()

        def reallocate_output(self, tensor_name, memory, size, alignment):  # TensorRT < 10.? / sync API
            return self._allocate(tensor_name, size)

        def reallocate_output_async(self, tensor_name, memory, size, alignment, stream):
            return self._allocate(tensor_name, size)

        def notify_shape(self, tensor_name, shape):
            self.shapes[tensor_name] = tuple(int(size) for size in shape)

    return TorchOutputAllocator


class TensorRTRunner:
    """Binds flat torch tensors to one engine and runs it.

    Args:
        engine: a deserialized ``trt.ICudaEngine``.
        trt: the ``tensorrt`` module (or a test double exposing the same names).
        device: device the engine runs on (inputs are moved there; outputs live there).
        input_names: engine input name for each flat input position (a graph input the engine does not
            have, e.g. one the exporter dropped as unused, is simply not bound).
        output_names: engine output name for each flat output position.
        output_dtypes: dtype eager returns per flat output; outputs are cast to it when the engine's
            differ (e.g. an fp16 engine output under autocast without ``keep_io_types``). None = engine's.
        input_paths: readable input path per engine input name, for error messages.

    Raises:
        BackendRuntimeError: the engine's I/O does not match the names given, uses a dtype torch lacks,
            or no execution context can be created (usually: not enough device memory).
    """

    def __init__(self, engine: Any, trt: Any, device: torch.device | str, input_names: Sequence[str],
                 output_names: Sequence[str], output_dtypes: Sequence[torch.dtype] | None = None,
                 input_paths: dict[str, str] | None = None):
        self.engine = engine
        self.trt = trt
        self.device = torch.device(device)
        self.input_paths = dict(input_paths or {})
        engine_inputs: dict[str, torch.dtype] = {}
        engine_outputs: dict[str, torch.dtype] = {}
        for index in range(engine.num_io_tensors):
            name = engine.get_tensor_name(index)
            dtype = torch_dtype(trt, engine.get_tensor_dtype(name))
            if engine.get_tensor_mode(name) == trt.TensorIOMode.INPUT:
                engine_inputs[name] = dtype
            else:
                engine_outputs[name] = dtype
        unknown = [name for name in engine_inputs if name not in input_names]
        if unknown:
            raise BackendRuntimeError(f"engine inputs {unknown} are not among the module's tensor inputs "
                                      f"{list(input_names)}; the engine was built from another model")
        missing = [name for name in output_names if name not in engine_outputs]
        if missing:
            raise BackendRuntimeError(f"engine has no outputs named {missing} (engine outputs: "
                                      f"{list(engine_outputs)})")
        #: (engine input name, flat input position, engine dtype) for every input the engine has.
        self.bindings = [(name, position, engine_inputs[name]) for position, name in enumerate(input_names)
                         if name in engine_inputs]
        self.output_names = list(output_names)
        self.engine_output_dtypes = [engine_outputs[name] for name in self.output_names]
        self.output_dtypes = list(output_dtypes) if output_dtypes is not None else list(self.engine_output_dtypes)
        self.profiles: list[Profile] = []
        for profile_index in range(engine.num_optimization_profiles):
            profile: Profile = {}
            for name, _, _ in self.bindings:
                low, opt, high = engine.get_tensor_profile_shape(name, profile_index)
                profile[name] = (tuple(int(s) for s in low), tuple(int(s) for s in opt),
                                 tuple(int(s) for s in high))
            self.profiles.append(profile)
        self.context = engine.create_execution_context()
        if self.context is None:
            raise BackendRuntimeError("TensorRT could not create an execution context (out of device memory?)")
        self.active_profile = 0
        self._allocator_class = None
        #: outputs whose shape TensorRT only knows after running (use the output allocator).
        self.data_dependent_outputs: set[str] = set()

    # ---- queries
    def profile_for(self, tensors: Sequence[torch.Tensor]) -> int | None:
        """Index of the first profile covering these flat inputs, or None."""
        shapes = {name: tuple(tensors[position].shape) for name, position, _ in self.bindings}
        return select_profile(self.profiles, shapes)

    def restore_shapes(self, tensors: Sequence[torch.Tensor]) -> None:
        """Set the profile and input shapes of these flat inputs on the context without running.

        NOTE [TensorRT and CUDA graphs]: a captured enqueue is only valid while the context's host-side state
        (optimization profile, input shapes) is what it was at capture. Another shape run in between changes
        it, so the graph runner calls this before every replay (host-side calls, no kernel launch except a
        profile switch).
        """
        shapes = {name: tuple(tensors[position].shape) for name, position, _ in self.bindings}
        index = select_profile(self.profiles, shapes)
        if index is None:
            raise BackendRuntimeError(out_of_profile_message(self.profiles, shapes, self.input_paths))
        if index != self.active_profile:
            if not self.context.set_optimization_profile_async(index, self._stream_handle()):
                raise BackendRuntimeError(f"TensorRT refused to switch to optimization profile {index}")
            self.active_profile = index
        for name, shape in shapes.items():
            if not self.context.set_input_shape(name, shape):
                raise BackendRuntimeError(f"TensorRT rejected shape {list(shape)} for input "
                                          f"{self.input_paths.get(name, name)}")

    # ---- execution
    def run(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Run the engine on flat inputs; returns the flat outputs (fresh tensors on ``device``).

        Raises:
            BackendRuntimeError: an input is outside every optimization profile (the message names it and
                the ranges), an int64 input does not fit an int32 engine input, or TensorRT rejects a
                shape/address or fails to execute.
        """
        prepared = [(name, self._prepare_input(name, tensors[position], dtype))
                    for name, position, dtype in self.bindings]
        shapes = {name: tuple(tensor.shape) for name, tensor in prepared}
        index = select_profile(self.profiles, shapes)
        if index is None:
            raise BackendRuntimeError(out_of_profile_message(self.profiles, shapes, self.input_paths))
        stream = self._stream_handle()
        context = self.context
        if index != self.active_profile:
            if not context.set_optimization_profile_async(index, stream):
                raise BackendRuntimeError(f"TensorRT refused to switch to optimization profile {index}")
            self.active_profile = index
        for name, tensor in prepared:
            if not context.set_input_shape(name, tuple(tensor.shape)):
                raise BackendRuntimeError(f"TensorRT rejected shape {list(tensor.shape)} for input "
                                          f"{self.input_paths.get(name, name)} under profile {index} "
                                          f"({self.profiles[index].get(name)})")
            if not context.set_tensor_address(name, tensor.data_ptr()):
                raise BackendRuntimeError(f"TensorRT rejected the address of input {self.input_paths.get(name, name)}")
        outputs: dict[str, torch.Tensor] = {}
        allocator = None
        for name, dtype in zip(self.output_names, self.engine_output_dtypes):
            shape = tuple(int(size) for size in context.get_tensor_shape(name))
            if name not in self.data_dependent_outputs and all(size >= 0 for size in shape):
                output = torch.empty(shape, dtype=dtype, device=self.device)
                if not context.set_tensor_address(name, output.data_ptr()):
                    raise BackendRuntimeError(f"TensorRT rejected the address of output {name}")
                outputs[name] = output
                continue
            self.data_dependent_outputs.add(name)
            if allocator is None:
                allocator = self._new_allocator()
            if not context.set_output_allocator(name, allocator):
                raise BackendRuntimeError(f"TensorRT refused the output allocator for {name}")
        if not context.execute_async_v3(stream):
            raise BackendRuntimeError("TensorRT execute_async_v3 failed; the TensorRT log above says why")
        results = []
        for name, engine_dtype, dtype in zip(self.output_names, self.engine_output_dtypes, self.output_dtypes):
            output = outputs.get(name)
            if output is None:
                output = self._allocated_output(allocator, name, engine_dtype)
            if output.dtype != dtype:
                output = output.to(dtype)
            results.append(output)
        return results

    # ---- internals
    def _stream_handle(self) -> int:
        if self.device.type != "cuda":
            return 0
        # NOTE [TensorRT stream]: the engine runs on the caller's current stream: ordering with the torch work
        # around it needs no events, the caching allocator's stream bookkeeping stays valid for inputs and
        # outputs, and CUDA-graph capture (which switches the current stream) records the enqueue.
        return torch.cuda.current_stream(self.device).cuda_stream

    def _prepare_input(self, name: str, tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if not isinstance(tensor, torch.Tensor):
            raise BackendRuntimeError(f"input {self.input_paths.get(name, name)} must be a tensor, got "
                                      f"{type(tensor).__name__}")
        if tensor.device != self.device:
            tensor = tensor.to(self.device)
        if tensor.dtype != dtype:
            tensor = self._convert(name, tensor, dtype)
        return tensor.contiguous()

    def _convert(self, name: str, tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        label = self.input_paths.get(name, name)
        if tensor.dtype == torch.int64 and dtype == torch.int32:
            capturing = self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
            if tensor.numel() and not capturing:  # a range check syncs: skipped while a CUDA graph captures
                low, high = int(tensor.min()), int(tensor.max())
                if low < INT32_MIN or high > INT32_MAX:
                    raise BackendRuntimeError(f"int64 input {label} holds values in [{low}, {high}], outside "
                                              "the int32 range of the engine's input; TensorRT cannot take it")
            return tensor.to(torch.int32)
        if tensor.is_floating_point() == (dtype.is_floating_point) or dtype == torch.bool:
            return tensor.to(dtype)
        raise BackendRuntimeError(f"input {label} is {tensor.dtype} but the engine expects {dtype}")

    def _new_allocator(self):
        if self._allocator_class is None:
            self._allocator_class = make_output_allocator_class(self.trt, self.device)
        return self._allocator_class()

    def _allocated_output(self, allocator, name: str, dtype: torch.dtype) -> torch.Tensor:
        if allocator is None or name not in allocator.buffers or name not in allocator.shapes:
            raise BackendRuntimeError(f"TensorRT produced no buffer or shape for data-dependent output {name}")
        shape = allocator.shapes[name]
        buffer = allocator.buffers[name]
        itemsize = torch.empty((), dtype=dtype).element_size()
        numel = math.prod(shape)
        return buffer[: numel * itemsize].view(dtype).view(shape)
