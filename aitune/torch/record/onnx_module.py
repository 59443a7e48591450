"""``OnnxModule``: an existing ``.onnx`` file as a module called with torch tensors, run by ONNX Runtime.

The file is checked and described at construction (:mod:`aitune.torch.record.onnx_file`); the ONNX Runtime
session is created on first use, on the module's device, and created again after a move (``.to``, ``.cuda``,
``.cpu``). Backends recognise the class with ``isinstance``: the ONNX Runtime and TensorRT backends take its file
as it is, the others refuse it (:meth:`aitune.torch.backend.base.Backend.takes_onnx_file`).

``onnxruntime`` is an optional package: it is imported when the first session is created.
"""

from __future__ import annotations

import hashlib
import inspect
import keyword
import os
import warnings
from pathlib import Path
from typing import Any

import torch

from aitune.errors import BackendUnavailableError, ConfigError, OnnxInputError
from aitune.torch.common.files import sha256_file
from aitune.torch.record.onnx_file import OnnxFileInfo, OnnxTensorInfo, read_onnx_file
from aitune.torch.record.ort_values import NUMPY_NAMES, ORT_TYPES, CudaArray


class OnnxModule(torch.nn.Module):
    """An existing ONNX model file as a ``torch.nn.Module``: call it with torch tensors, get torch tensors back.

    Untuned it runs the file through an ONNX Runtime ``InferenceSession`` (default session options) on the
    module's device: the CPU execution provider on the CPU, the CUDA one on a CUDA device. ``ait.Module`` and
    ``ait.tune`` take it like any module; only the ONNX Runtime and TensorRT backends build it, from the file as it
    is (no re-export), and every candidate is checked against this module's outputs. The file and its external
    data are only read, never written.

    Calls: positional arguments in the file's input order, keyword arguments by ONNX input name (``forward``'s
    signature is built from the names, when they are Python identifiers). Every input is required; a tensor's
    dtype must be the declared one (nothing is cast), its rank the declared rank, and its fixed sizes the
    declared sizes; inputs must be on the module's device.

    Args:
        path: the ``.onnx`` file. External data files must lie in its folder or below it, at relative locations.

    Attributes:
        path: the file, absolute (``str``).
        sha256: sha256 of the model file and its external data files (what the tuning cache keys on).
        input_names / output_names: the ONNX names, in the file's order (initializers are not inputs).
        inputs / outputs: :class:`~aitune.torch.record.onnx_file.OnnxTensorInfo` per input/output (dtype, shape).
        dynamic_axes: ``{name: {axis: dim name or None}}`` of the inputs and outputs with axes of no fixed size.
        external_data: the external data locations (relative to the model's folder).

    Raises:
        OnnxFileError: at construction, for a missing or invalid file, an input or output type ONNX Runtime
            cannot exchange as a torch tensor, or external data that is absolute, outside the model's folder
            or missing (:func:`~aitune.torch.record.onnx_file.read_onnx_file`).
        OnnxInputError: at a call, for a missing, unknown or repeated input, a non-tensor, another dtype, rank
            or fixed size than declared, or an input on another device than the module.
        BackendUnavailableError: on a CUDA device when onnxruntime has no CUDA execution provider.
    """

    def __init__(self, path: str | os.PathLike):
        super().__init__()
        info = read_onnx_file(path)
        self._info: OnnxFileInfo = info
        self.path = str(info.path)
        self.input_names = [value.name for value in info.inputs]
        self.output_names = [value.name for value in info.outputs]
        self.external_data = list(info.external_data)
        self.sha256 = onnx_files_digest(info.path, info.external_data)
        self.register_buffer("_device_anchor", torch.empty(0, dtype=torch.uint8), persistent=False)
        self._runtime = _Runtime()  # the session lives in here: creating it changes no attribute of the module
        self.forward = _Forward(self)  # an instance attribute: its __signature__ names the ONNX inputs
        self.train(False)  # an ONNX file has one behaviour; the flag only keeps torch's conventions

    # ---- what the file declares
    @property
    def inputs(self) -> tuple[OnnxTensorInfo, ...]:
        return self._info.inputs

    @property
    def outputs(self) -> tuple[OnnxTensorInfo, ...]:
        return self._info.outputs

    @property
    def dynamic_axes(self) -> dict[str, dict[int, str | None]]:
        return {value.name: value.dynamic_axes for value in self._info.inputs + self._info.outputs
                if value.dynamic_axes}

    @property
    def device(self) -> torch.device:
        """Where the session runs and outputs are returned (moved with ``.to``, ``.cuda``, ``.cpu``)."""
        return self._device_anchor.device

    def extra_repr(self) -> str:
        inputs = ", ".join(f"{value.name}: {value.describe()}" for value in self.inputs)
        outputs = ", ".join(f"{value.name}: {value.describe()}" for value in self.outputs)
        return f"{self.path!r}, inputs=({inputs}), outputs=({outputs})"

    # ---- moves and copies
    def _apply(self, fn, recurse=True):
        result = super()._apply(fn, recurse)
        if self._runtime.session is not None and self._runtime.device != self.device:
            self._runtime.session = None  # created again, for the new device, on the next call
        return result

    def __getstate__(self) -> dict:
        state = super().__getstate__() if hasattr(super(), "__getstate__") else self.__dict__
        state = dict(state)
        # an InferenceSession is neither copied nor pickled: the copy makes its own
        state["_runtime"] = _Runtime(use_io_binding=self._runtime.use_io_binding)
        return state

    # ---- calls
    def bind(self, args: tuple, kwargs: dict) -> list[Any]:
        """The call's arguments in the file's input order (positional first, then by ONNX name); not checked.

        Raises:
            OnnxInputError: too many positional arguments, an unknown or repeated name, a missing input.
        """
        names = self.input_names
        if len(args) > len(names):
            raise OnnxInputError(f"{self._name()} takes {len(names)} input(s) ({', '.join(names)}), got "
                                 f"{len(args)} positional argument(s)")
        given = dict(zip(names, args))
        for name, value in kwargs.items():
            if name not in names:
                raise OnnxInputError(f"{self._name()} has no input named {name!r}; its inputs are "
                                     f"{', '.join(map(repr, names))}")
            if name in given:
                raise OnnxInputError(f"{self._name()} got input {name!r} twice (positionally and by name)")
            given[name] = value
        missing = [name for name in names if name not in given]
        if missing:
            raise OnnxInputError(f"{self._name()} is missing input(s) {', '.join(map(repr, missing))}; every input "
                                 f"of the file is required: {', '.join(value.describe() for value in self.inputs)}")
        return [given[name] for name in names]

    def _run_forward(self, *args, **kwargs):
        tensors = self.bind(args, kwargs)
        device = self.device
        for value, tensor in zip(self.inputs, tensors):
            self._check_input(value, tensor, device)
        outputs = self._run(tensors)
        return outputs[0] if len(outputs) == 1 else tuple(outputs)

    def _check_input(self, value: OnnxTensorInfo, tensor: Any, device: torch.device) -> None:
        declared = value.describe()
        if not isinstance(tensor, torch.Tensor):
            raise OnnxInputError(f"{self._name()}: input {value.name!r} must be a torch.Tensor ({declared}), got "
                                 f"{type(tensor).__name__}")
        if tensor.dtype != value.dtype:
            raise OnnxInputError(f"{self._name()}: input {value.name!r} is {str(tensor.dtype).removeprefix('torch.')}"
                                 f" but the file declares {declared}; cast it before the call "
                                 f"(tensor.to({value.dtype})), nothing is cast for you")
        if value.shape is not None:
            if tensor.dim() != len(value.shape):
                raise OnnxInputError(f"{self._name()}: input {value.name!r} has rank {tensor.dim()} (shape "
                                     f"{list(tensor.shape)}) but the file declares rank {len(value.shape)}: {declared}")
            for axis, (size, dim) in enumerate(zip(tensor.shape, value.shape)):
                if isinstance(dim, int) and size != dim:
                    raise OnnxInputError(f"{self._name()}: input {value.name!r} has size {size} on axis {axis} "
                                         f"(shape {list(tensor.shape)}) but the file fixes it to {dim}: {declared}")
        if tensor.device != device:
            raise OnnxInputError(f"{self._name()}: input {value.name!r} is on {tensor.device}, the module on "
                                 f"{device}; move the input or the module (.to(device))")

    def _name(self) -> str:
        return f"OnnxModule({os.path.basename(self.path)!r})"

    # ---- ONNX Runtime
    def _ensure_session(self):
        device, runtime = self.device, self._runtime
        if runtime.session is not None and runtime.device == device:
            return runtime.session
        if device.type not in ("cpu", "cuda"):
            raise ConfigError(f"{self._name()} is on {device}; ONNX Runtime runs it on 'cpu' or 'cuda' only: "
                              "move it there (.to('cpu'))")
        import onnxruntime

        if device.type == "cuda":
            available = onnxruntime.get_available_providers()
            if "CUDAExecutionProvider" not in available:
                raise BackendUnavailableError(
                    f"{self._name()} is on {device} but this onnxruntime has no CUDA execution provider (available: "
                    f"{', '.join(available)}); pip install an onnxruntime-gpu that matches your CUDA, or keep the "
                    "module on the CPU")
            index = device.index if device.index is not None else torch.cuda.current_device()
            providers: list = [("CUDAExecutionProvider", {"device_id": index})]
        else:
            providers = ["CPUExecutionProvider"]
        options = onnxruntime.SessionOptions()
        options.log_severity_level = 3  # errors only; failures reach the caller as exceptions
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            session = onnxruntime.InferenceSession(self.path, sess_options=options, providers=providers)
        wanted = providers[0] if isinstance(providers[0], str) else providers[0][0]
        if wanted not in session.get_providers():  # ONNX Runtime falls back to the CPU silently
            raise BackendUnavailableError(f"{self._name()}: ONNX Runtime could not create its {wanted} on {device} "
                                          f"(active: {', '.join(session.get_providers())}); install an "
                                          "onnxruntime-gpu that matches your CUDA and cuDNN")
        runtime.session, runtime.device = session, device
        return session

    def _run(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        session = self._ensure_session()
        device = self._runtime.device
        use_io_binding = self._runtime.use_io_binding
        bound = use_io_binding if use_io_binding is not None else device.type == "cuda"
        if bound:
            return self._run_bound(session, tensors, device)
        feeds = {name: tensor.detach().contiguous().numpy() for name, tensor in zip(self.input_names, tensors)}
        return [torch.from_numpy(value) for value in session.run(self.output_names, feeds)]

    def _run_bound(self, session, tensors: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
        """IOBinding on the module's device (the documented ``onnxruntime.IOBinding`` API): inputs bound by
        pointer, outputs allocated by ONNX Runtime on the device, so no tensor crosses to the host on CUDA."""
        import numpy

        binding = session.io_binding()
        device_id = device.index or 0
        kept = [tensor.detach().contiguous() for tensor in tensors]  # alive until the run ends
        for name, tensor in zip(self.input_names, kept):
            binding.bind_input(name=name, device_type=device.type, device_id=device_id,
                               element_type=getattr(numpy, NUMPY_NAMES[tensor.dtype]), shape=tuple(tensor.shape),
                               buffer_ptr=tensor.data_ptr())
        for name in self.output_names:
            binding.bind_output(name=name, device_type=device.type, device_id=device_id)
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()  # ONNX Runtime runs on its own stream
        session.run_with_iobinding(binding)
        if device.type == "cuda":
            binding.synchronize_outputs()
        outputs = []
        for value in binding.get_outputs():
            dtype = ORT_TYPES[value.data_type()]
            if value.device_name().lower() == "cpu":
                outputs.append(torch.from_numpy(value.numpy()))
            elif 0 in tuple(value.shape()):
                outputs.append(torch.empty(tuple(value.shape()), dtype=dtype, device=device))
            else:
                outputs.append(torch.as_tensor(CudaArray(value, dtype), device=device).clone())
        del kept
        return outputs


def onnx_file_refusal(module: torch.nn.Module | None, backend) -> str | None:
    """Why ``backend`` cannot build ``module`` when it is an :class:`OnnxModule` (None: it is not one, or the
    backend's ``takes_onnx_file`` is true: it builds from the file as it is, or runs the module itself)."""
    if isinstance(module, OnnxModule) and not getattr(backend, "takes_onnx_file", False):
        return ("an ONNX file (OnnxModule): only ONNX Runtime, TensorRT and plain eager take it as it is; "
                f"{type(backend).__name__} needs a PyTorch module")
    return None


class _Runtime:
    """An :class:`OnnxModule`'s ONNX Runtime session and the device it was made for (one object, so that creating
    the session on the first call is not a change of the module's state; ``aitune.torch.record.state``).
    ``use_io_binding``: None runs IOBinding on CUDA and numpy feeds on the CPU; True/False forces one (tests)."""

    def __init__(self, use_io_binding: bool | None = None):
        self.session = None
        self.device: torch.device | None = None
        self.use_io_binding = use_io_binding


class _Forward:
    """``OnnxModule.forward``: a callable whose ``__signature__`` lists the ONNX inputs, so aitune's recorder
    binds ``m(x, mask)`` and ``m(x, mask=mask)`` to the same call. Names that are not Python identifiers give
    ``(*args, **kwargs)``; calls then bind as given."""

    def __init__(self, module: OnnxModule):
        self.__self__ = module
        names = module.input_names
        if all(name.isidentifier() and not keyword.iskeyword(name) for name in names) and len(set(names)) == len(names):
            self.__signature__ = inspect.Signature(
                [inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD) for name in names])
        else:
            self.__signature__ = inspect.Signature([
                inspect.Parameter("args", inspect.Parameter.VAR_POSITIONAL),
                inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD)])
        self.__name__ = self.__qualname__ = "forward"
        self.__doc__ = OnnxModule.__doc__

    def __call__(self, *args, **kwargs):
        return self.__self__._run_forward(*args, **kwargs)


def onnx_files_digest(model_path: Path, external_data) -> str:
    """sha256 hex over the model file's digest and each external data file's (its location, relative to the
    model's folder, and digest; locations in sorted order): :attr:`OnnxModule.sha256`."""
    hasher = hashlib.sha256(sha256_file(model_path).encode())
    for location in sorted(external_data):
        hasher.update(f"\n{location}:{sha256_file(Path(model_path).parent / location)}".encode())
    return hasher.hexdigest()
