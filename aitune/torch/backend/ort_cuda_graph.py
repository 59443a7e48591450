"""ONNX Runtime CUDA graphs: inputs and outputs in persistent buffers, one captured graph per input shape.

NOTE [ONNX Runtime CUDA graphs]: with the CUDA EP option ``enable_cuda_graph`` ONNX Runtime captures a
session's kernels as a CUDA graph and replays it on later runs (ONNX Runtime's CUDA EP documentation, "Using
CUDA Graphs"). A replay reads and writes the device addresses of the capture, so every run goes through
IOBinding with inputs and outputs bound to buffers that stay put: a call's inputs are copied into them and its
outputs copied out (the next replay overwrites the buffers). Since ONNX Runtime 1.18 one session holds several
graphs, chosen by the run config entry ``gpu_graph_id`` (``onnxruntime_run_options_config_keys.h``: -1 runs
without graphs, 0 is not for users): each input shape gets its own id, buffers and binding. The first run with
an id allocates ONNX Runtime's memory, the next captures the graph, later ones replay it. ONNX Runtime's
documentation asks for every node on the CUDA EP; shape computations of a graph with dynamic axes sit on the CPU
EP (:mod:`~aitune.torch.backend.ort_placement`). onnxruntime-gpu 1.31.1 still captured such a graph (a BERT-like
encoder recorded at two batch sizes, ``tests/gpu/test_onnxruntime_gpu.py``); where a version refuses, the build
fails with its message. Either way the candidate is judged by value against eager like any other.

The same class binds CPU buffers without graphs (``capture=False``), so the copy-in/copy-out logic runs in tests
on the CPU EP too. Calls take turns (a lock): they share the buffers.
"""

from __future__ import annotations

import dataclasses
import threading

import torch

from aitune.torch.backend.ort_config import ONNXRuntimeBackendConfig
from aitune.torch.backend.ort_io import NUMPY_NAMES, ORT_TYPES

GRAPH_ID = "gpu_graph_id"  # ONNX Runtime's run config key (kOrtRunOptionsConfigCudaGraphAnnotation)
# the default search adds the CUDA-graph variant only for graphs recorded with this few shapes (each shape keeps its
# buffers and captured graph; other shapes run eager)
MAX_SEARCH_SHAPES = 4


def recorded_shapes(graph) -> int:
    """How many distinct input shapes (the shapes of a sample's tensor leaves, together) a recorded graph's samples
    hold; 0 for None or a graph without samples."""
    if graph is None:
        return 0
    return len({tuple(tuple(leaf.shape) for leaf in sample.leaves() if isinstance(leaf, torch.Tensor))
                for sample in graph.samples})


def graph_capture_refused(exc: BaseException) -> bool:
    """Is this ONNX Runtime session-creation error its refusal to capture graphs (nodes off the CUDA EP, control
    flow)? Its message: "This session cannot use the graph capture feature as requested by the user ..."."""
    return "graph capture" in str(exc).lower() or "cuda graph" in str(exc).lower()


def half_precision_conv2d(module, graph) -> bool:
    """Does ``module`` hold a 2-D convolution and ``graph`` take fp16/bf16 floating inputs (the case measured for
    ``prefer_nhwc``: :func:`cuda_graph_variants`)? False for a module of None."""
    if module is None or graph is None:
        return False
    floating = [spec.dtype for spec in getattr(graph, "tensor_specs", ()) if spec.dtype.is_floating_point]
    return bool(floating) and all(dtype in (torch.float16, torch.bfloat16) for dtype in floating) and \
        any(isinstance(layer, torch.nn.Conv2d) for layer in module.modules())


def cuda_graph_variants(encoder: bool, graph, device,
                        channels_last: bool = False) -> list[tuple[ONNXRuntimeBackendConfig, int]]:
    """The CUDA-graph configurations :meth:`ONNXRuntimeBackend.search_space` adds, with their search tiers.

    On CUDA only, and for a graph with at most ``MAX_SEARCH_SHAPES`` recorded input shapes (each shape keeps its
    buffers and captured graph). In the first tier: CUDA graphs on the configuration expected to be fastest —
    with the transformer fusions for an ``encoder``, else plain. It costs one more session and two runs per shape
    on top of the export, and removes the per-kernel launch cost that dominates small batches on a GPU (as
    ``reduce-overhead`` does for Inductor). Plain CUDA graphs next to the fused ones: tier 1 (with a budget). With
    ``channels_last`` (:func:`half_precision_conv2d`: a half-precision convnet), the first-tier variant adds the CUDA
    EP's ``prefer_nhwc`` (channels-last convolutions, which cuDNN's fp16 kernels take without layout transposes; it
    beat the NCHW variant on ResNet-50 fp16 at batch 1 and 32: ``benchmarks/gpu_ort.py``, RESULTS.md), the NCHW one
    tier 1; other convnets (fp32, 1-D or 3-D convolutions: not measured) keep NCHW first.
    Where ONNX Runtime refuses to capture a graph (nodes on the CPU EP), these builds fail with its message,
    which their report rows show, and the variants without graphs are built instead (:func:`in_search_order`).
    """
    if torch.device(device).type != "cuda" or graph is None:
        return []
    if not 0 < recorded_shapes(graph) <= MAX_SEARCH_SHAPES:
        return []
    if channels_last and not encoder:
        return [(ONNXRuntimeBackendConfig(cuda_graph=True, prefer_nhwc=True), 0),
                (ONNXRuntimeBackendConfig(cuda_graph=True), 1)]
    variants = [(ONNXRuntimeBackendConfig(cuda_graph=True, transformer_fusions="bert" if encoder else None), 0)]
    if encoder:
        variants.append((ONNXRuntimeBackendConfig(cuda_graph=True), 1))
    return variants


def in_search_order(variants: list, graphs: list[tuple], extras: list) -> list:
    """The search space of :meth:`ONNXRuntimeBackend.search_space`: first-tier ``variants`` without CUDA graphs,
    the CUDA-graph ``graphs`` as ``(backend, tier)`` from :func:`cuda_graph_variants`, and ``extras`` (tier 1).

    With CUDA graphs, the first-tier graph variant comes first and the ``variants`` back it up as fallbacks
    (:attr:`Backend.search_fallback`: built without a budget only when no earlier variant passes), the last of
    ``variants`` (the transformer fusions, for an encoder) first: without graphs it was the faster one on BERT-base
    (``benchmarks/gpu_ort.py``), and if the fusions are what failed, the plain variant is built next."""
    for backend, tier in graphs:
        backend._tier = tier
    for backend in extras:
        backend._tier = 1
    if not graphs:
        return variants + extras
    for backend in variants:
        backend._tier, backend._fallback = 1, True
    return [graphs[0][0]] + variants[::-1] + [backend for backend, _ in graphs[1:]] + extras


@dataclasses.dataclass
class _Bound:
    """One input shape: its graph id, run options, binding and the buffers bound to it."""

    binding: object
    run_options: object
    inputs: list[torch.Tensor]
    outputs: list[torch.Tensor]


class PersistentBindings:
    """IOBindings to persistent buffers, one per input shape, for an ONNX Runtime session.

    Args:
        session: the ``onnxruntime.InferenceSession`` (created with ``enable_cuda_graph`` when ``capture``).
        input_names / output_names: the graph's input and output names, in the order tensors are passed and
            returned.
        device: where the buffers live (``cuda:N`` for graphs; ``cpu`` binds host buffers).
        capture: run with a ``gpu_graph_id`` per shape (CUDA graphs); False runs the bound buffers without.
    """

    def __init__(self, session, input_names: list[str], output_names: list[str], device: torch.device,
                 capture: bool):
        self._session = session
        self._input_names = list(input_names)
        self._output_names = list(output_names)
        self._device = torch.device(device)
        self._capture = capture
        self._bound: dict[tuple, _Bound] = {}
        self._lock = threading.Lock()

    @property
    def shapes(self) -> list[tuple]:
        """The input shapes bound so far (``input_names`` order), in the order they were first run."""
        return list(self._bound)

    def run(self, tensors: list[torch.Tensor], quiet: bool = False) -> list[torch.Tensor]:
        """Run on ``tensors`` (``input_names`` order); returns new tensors (ONNX Runtime's output dtypes, on the
        buffers' device) that later runs do not overwrite. A shape not seen before is bound first (on CUDA: its
        graph is captured)."""
        key = tuple(tuple(tensor.shape) for tensor in tensors)
        with self._lock:  # calls from several threads take turns: they share the buffers
            bound = self._bound.get(key)
            if bound is None:
                bound = self._bound[key] = self._bind(tensors)
            bound.run_options.log_severity_level = 4 if quiet else 3  # errors only, as the session's options
            for buffer, tensor in zip(bound.inputs, tensors):
                buffer.copy_(tensor.detach())
            self._execute(bound.binding, bound.run_options)
            outputs = [output.clone() for output in bound.outputs]
            if self._device.type == "cuda":
                # the copies out run on this thread's stream; another thread's next replay (on its own stream)
                # must not overwrite the buffers before they are done
                torch.cuda.current_stream(self._device).synchronize()
            return outputs

    def _bind(self, tensors: list[torch.Tensor]) -> _Bound:
        """Buffers for one input shape, bound once; on CUDA the graph is captured here (three runs: one without a graph, which gives the output shapes, then one
        that allocates and one that captures)."""
        import numpy
        import onnxruntime

        device_type, device_id = self._device.type, self._device.index or 0
        inputs = [torch.empty(tuple(t.shape), dtype=t.dtype, device=self._device) for t in tensors]
        for buffer, tensor in zip(inputs, tensors):
            buffer.copy_(tensor.detach())
        probe = onnxruntime.RunOptions()
        if self._capture:
            probe.add_run_config_entry(GRAPH_ID, "-1")  # a plain run: learns the output shapes, captures nothing
        binding = self._session.io_binding()
        self._bind_inputs(binding, inputs, device_type, device_id, numpy)
        for name in self._output_names:
            binding.bind_output(name=name, device_type=device_type, device_id=device_id)
        self._execute(binding, probe)
        values = binding.get_outputs()
        outputs = [torch.empty(tuple(value.shape()), dtype=ORT_TYPES[value.data_type()], device=self._device)
                   for value in values]
        del values
        binding = self._session.io_binding()
        self._bind_inputs(binding, inputs, device_type, device_id, numpy)
        for name, buffer in zip(self._output_names, outputs):
            binding.bind_output(name=name, device_type=device_type, device_id=device_id,
                                element_type=getattr(numpy, NUMPY_NAMES[buffer.dtype]), shape=tuple(buffer.shape),
                                buffer_ptr=buffer.data_ptr())
        run_options = onnxruntime.RunOptions()
        if self._capture:
            run_options.add_run_config_entry(GRAPH_ID, str(len(self._bound) + 1))  # 1, 2, ...: one per shape
            for _ in range(2):  # allocate, then capture (and replay): errors surface here, not at a later call
                self._execute(binding, run_options)
        return _Bound(binding, run_options, inputs, outputs)

    def _bind_inputs(self, binding, buffers: list[torch.Tensor], device_type: str, device_id: int, numpy) -> None:
        for buffer, name in zip(buffers, self._input_names):
            binding.bind_input(name=name, device_type=device_type, device_id=device_id,
                               element_type=getattr(numpy, NUMPY_NAMES[buffer.dtype]), shape=tuple(buffer.shape),
                               buffer_ptr=buffer.data_ptr())

    def _execute(self, binding, run_options) -> None:
        if self._device.type == "cuda":
            # ONNX Runtime runs on its own stream: the copies into the input buffers (and out of the output
            # buffers, from the call before) must be done first. It synchronizes its stream at the end of a run.
            torch.cuda.current_stream(self._device).synchronize()
        self._session.run_with_iobinding(binding, run_options)
        if self._device.type == "cuda":
            binding.synchronize_outputs()  # the outputs are read on PyTorch's stream next
