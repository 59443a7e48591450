"""The Torch-TensorRT backends: JIT (``torch.compile(backend="torch_tensorrt")``) and AOT (export in this process,
compile in a child, the saved artifact loaded here)."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import ClassVar

import torch

from aitune.errors import CheckpointError
from aitune.torch.backend.accepted import AcceptedInput, AcceptedInputs
from aitune.torch.backend.base import Backend, BuildMode, Check, Requirement
from aitune.torch.backend.compile_settings import dynamic_for_axes
from aitune.torch.backend.eager import AutocastMixin
from aitune.torch.backend.flat import FlatIO
from aitune.torch.backend.torch_tensorrt.compile_step import compile_exported_program, settings_to_json
from aitune.torch.backend.torch_tensorrt.config import (
    TorchTensorRTAotBackendConfig,
    TorchTensorRTJitBackendConfig,
    accepted_settings,
)
from aitune.torch.backend.torch_tensorrt.export import export_flat_module
from aitune.torch.backend.isolation import run_isolated
from aitune.torch.check.guard import watch_registrations
from aitune.torch.record.serialization import output_template_from_json, outputs_to_json
from aitune.torch.backend.tensorrt.backend import StoredGraph, StoredTensorSpec

logger = logging.getLogger(__name__)


TORCH_TENSORRT_REQUIREMENT = Requirement("torch_tensorrt", ("torch-tensorrt", "torch_tensorrt"), "torch-tensorrt",
                                         "2.8")
ARTIFACT_FILE = "exported_model.pt"


# --------------------------------------------------------------------------------------------- JIT


class TorchTensorRTJitBackend(AutocastMixin, Backend):
    """``torch.compile(module, backend="torch_tensorrt", options=<TorchTensorRTConfig>)``, warmed up at build.

    Wraps: Torch-TensorRT's dynamo backend (TensorRT engines for the convertible subgraphs, PyTorch for the
    rest). Extra: ``pip install 'aitune[torch-tensorrt]'`` (torch-tensorrt matching the torch version).
    Devices: CUDA only. JIT: nothing compiled is persisted; checkpoints keep weights and samples and
    recompile on load. Known limitations: shapes outside the recorded range recompile; graph breaks split
    the model into several engines.
    """

    name = "torch_tensorrt_jit"
    config_class = TorchTensorRTJitBackendConfig
    build_mode = BuildMode.JIT
    requirements = (TORCH_TENSORRT_REQUIREMENT,)
    device_types = frozenset({"cuda"})
    rank = 45
    default_search_position = 70  # in the default search (Backend.default_search_position)

    @property
    def bakes_weights(self) -> bool:
        """TensorRT engines hold the weights as they were at the build."""
        return True

    def _build(self, module, graph, device, workdir: Path) -> None:
        import torch_tensorrt  # noqa: F401 - registers the "torch_tensorrt" torch.compile backend

        options = self.config.compile_config.settings(accepted_settings())
        options["device"] = device
        dynamic = dynamic_for_axes(self.config.dynamic, graph)
        self.build_info["dynamic"] = dynamic
        self._probe_output_dtypes(module, graph)
        watch_registrations()  # NOTE [registration hooks before compiling] (the engines bake the weights in)
        self._compiled = torch.compile(module, backend="torch_tensorrt", options=options,
                                       fullgraph=self.config.fullgraph, dynamic=dynamic)
        for sample in graph.samples:  # warm-up: build the engines for every recorded shape now
            sample = sample.clone()
            self._infer(sample.args, sample.kwargs)

    def _infer(self, args, kwargs):
        with torch.no_grad(), self._autocast():
            output = self._compiled(*args, **kwargs)
        return self._restore_output_dtypes(output)

    def _load(self, directory, metadata, module, graph, device) -> None:
        if module is None:
            raise CheckpointError("the torch_tensorrt_jit backend recompiles on load and needs the original module")
        self._build(module, graph, device, directory)


# --------------------------------------------------------------------------------------------- AOT


class TorchTensorRTAotBackend(Backend):
    """``torch.export`` (explicit Dims) -> ``torch_tensorrt.dynamo.compile`` -> ``torch_tensorrt.save`` artifact.

    Wraps: Torch-TensorRT's AOT path. Extra: ``pip install 'aitune[torch-tensorrt]'``. Devices: CUDA only.
    The export runs in this process (it is plain ``torch.export``); compile, save and one load+run of the
    artifact run in a child process with ``build_timeout_s`` (:mod:`aitune.torch.backend.isolation`), logging to
    ``<workdir>/torch_tensorrt_compile.log``. Checkpoints hold ``exported_model.pt`` and the output
    structure; loading needs neither the module nor its weights. Calls outside the recorded/declared shape
    range are refused by :meth:`accepts` (the Module runs eager).

    Known limitations: data-dependent control flow fails the export; in-place input mutations are not
    reproduced; kernel-selector replacements do not carry into this path (reference G.1).
    """

    name = "torch_tensorrt_aot"
    config_class = TorchTensorRTAotBackendConfig
    build_mode = BuildMode.AOT
    requirements = (TORCH_TENSORRT_REQUIREMENT,)
    device_types = frozenset({"cuda"})
    rank = 42
    default_search_position = 80  # in the default search (Backend.default_search_position)
    compile_step: ClassVar[str] = f"{compile_exported_program.__module__}:compile_exported_program"

    def __init__(self, config: TorchTensorRTAotBackendConfig | None = None):
        super().__init__(config)
        self._compiled = None
        self._io: FlatIO | None = None
        self._inputs: list[dict] = []
        self._leaf_indices: list[int] = []
        self._accepted: AcceptedInputs | None = None  # built from _inputs on first use
        self._artifact: Path | None = None

    def _supports(self, module, graph, device) -> Check:
        if graph is None or not graph.tensor_specs:
            return Check(False, "the graph has no tensor input")
        return Check(True)

    def _build(self, module, graph, device, workdir: Path) -> None:
        settings = self.config.compile_config.settings(accepted_settings())
        exported, flat_io, example, inputs = export_flat_module(module, graph, device)
        exported_path = workdir / "exported_program.pt2"
        torch.export.save(exported, str(exported_path))
        check_path = workdir / "check_inputs.pt"
        torch.save([t.detach().cpu().contiguous() for t in flat_io.sample_inputs(graph.samples[0])], check_path)
        artifact = workdir / ARTIFACT_FILE
        result = run_isolated(self.compile_step, {
            "exported_path": str(exported_path), "output_path": str(artifact), "inputs": inputs,
            "settings": settings_to_json(settings), "pickle_protocol": self.config.pickle_protocol,
            "check_inputs_path": str(check_path),
            "device_index": device.index if device.index is not None else torch.cuda.current_device()},
            timeout_s=self.config.build_timeout_s, log_path=workdir / "torch_tensorrt_compile.log")
        self.build_info["check_output_shapes"] = result.get("check_output_shapes")
        self._io = flat_io
        self._inputs = inputs
        self._leaf_indices = list(flat_io.tensor_indices)
        self._artifact = artifact
        self._load_artifact()

    def _load_artifact(self) -> None:
        import torch_tensorrt

        self._compiled = torch_tensorrt.load(str(self._artifact)).module()

    def rejects(self, leaves: list) -> str | None:
        """Why the compiled artifact cannot take the call (dtype, CUDA device, rank, or a size outside the range
        it was compiled for); the Module then runs eager with this reason."""
        if self._accepted is None:
            self._accepted = AcceptedInputs(
                [AcceptedInput.from_json(dict(entry, leaf_index=index, path=entry.get("name", "")))
                 for entry, index in zip(self._inputs, self._leaf_indices)], device_type="cuda")
        return self._accepted.rejects(leaves)

    def _infer(self, args, kwargs):
        tensors = [t.to(self.device).contiguous() for t in self._io.inputs(args, kwargs)]
        with torch.no_grad():
            outputs = self._compiled(*tensors)
        outputs = outputs if isinstance(outputs, (tuple, list)) else [outputs]
        return self._io.outputs(list(outputs))

    def _activate(self) -> None:
        if self._compiled is None:
            self._load_artifact()

    def _deactivate(self) -> None:
        self._compiled = None

    def _save(self, directory: Path) -> dict:
        target = directory / ARTIFACT_FILE
        if self._artifact.resolve() != target.resolve():
            shutil.copyfile(self._artifact, target)
        return {
            "artifact": ARTIFACT_FILE,
            "inputs": [dict(entry, leaf_index=index) for entry, index in zip(self._inputs, self._leaf_indices)],
            "outputs": outputs_to_json(self._io.output_spec, self._io.output_constants, self._io.output_is_tensor,
                                       self._io.output_dtypes),
        }

    def _load(self, directory: Path, metadata: dict, module, graph, device: torch.device) -> None:
        artifact = self._stored_file(directory, metadata, "artifact", ARTIFACT_FILE)
        self._inputs = [{key: value for key, value in entry.items() if key != "leaf_index"}
                        for entry in metadata["inputs"]]
        self._leaf_indices = [int(entry["leaf_index"]) for entry in metadata["inputs"]]
        template = output_template_from_json(metadata["outputs"], getattr(graph, "output_spec", None))
        io_graph = StoredGraph([StoredTensorSpec(entry["name"], index, entry["name"])
                                 for entry, index in zip(self._inputs, self._leaf_indices)])
        self._io = FlatIO(io_graph, template)
        self._artifact = artifact
        self._load_artifact()
