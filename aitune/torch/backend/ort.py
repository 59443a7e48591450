"""ONNXRuntimeBackend: export to ONNX, run with ONNX Runtime on the CPU, CUDA or TensorRT execution provider.

Modules: :mod:`~aitune.torch.backend.ort_config` (the config), :mod:`~aitune.torch.backend.ort_io` (binding
types, CUDA outputs without a copy), :mod:`~aitune.torch.backend.ort_fusions` (transformer fusions); their
names stay importable from here.
"""

from __future__ import annotations

import logging
import shutil
import warnings
from pathlib import Path

import torch

from aitune.errors import BackendBuildError, BackendRuntimeError, OnnxFileError, one_line
from aitune.torch.backend.artifact import DeploymentArtifact, GraphFacts, require_built
from aitune.torch.backend.base import Backend, BuildMode, Check, Requirement
from aitune.torch.backend.onnx_call_io import OnnxCallIO
from aitune.torch.backend.onnx_export import training_mode_reason
from aitune.torch.backend.onnx_file_io import onnx_for_backend
from aitune.torch.backend.onnx_graph import external_data_files
from aitune.torch.backend.ort_config import (  # noqa: F401 - re-exported
    GRAPH_OPTIMIZATION_LEVELS,
    TRANSFORMER_MODEL_TYPES,
    ONNXExecutionProvider,
    ONNXRuntimeBackendConfig,
    coerce_execution_provider,
)
from aitune.torch.backend.ort_fusions import (  # noqa: F401 - re-exported
    SESSION_FUSIONS,
    looks_like_transformer_encoder,
    transformer_fusion_note,
)
from aitune.torch.backend.ort_artifact import onnx_artifact
from aitune.torch.backend.ort_io import NUMPY_NAMES, ORT_TYPES, CudaArray
from aitune.torch.common.files import checkpoint_path
from aitune.torch.record.onnx_module import OnnxModule, onnx_files_digest

logger = logging.getLogger(__name__)


ONNX_FILE = "model.onnx"


class ONNXRuntimeBackend(Backend):
    """Exports the module to ONNX and runs it with an ONNX Runtime ``InferenceSession``.

    Wraps: ``torch.onnx.export`` (dynamo exporter, TorchScript fallback; see
    :func:`~aitune.torch.backend.onnx_export.export_onnx`) and ONNX Runtime >= 1.18 with the CPU, CUDA or
    TensorRT execution provider. Extra: ``pip install 'aitune[onnx]'`` (CPU) or ``'aitune[onnx-gpu]'``
    (``onnxruntime-gpu``; its wheels must match the CUDA/cuDNN/TensorRT versions installed).

    Build: export to ``workdir/model.onnx`` (+ ``model.onnx.data``), create the session, check that the
    requested EP is really active (ONNX Runtime silently falls back to CPU when a GPU EP cannot be
    created, microsoft/onnxruntime#23372) and run every recorded sample once, so EP compile errors surface at build.
    Inference on CUDA binds inputs and outputs with IOBinding on the device (they never leave the GPU);
    on CPU it feeds numpy views. Outputs come back in eager's structure, dtypes and device.

    An :class:`~aitune.torch.OnnxModule` is not exported: the session runs its file as it is (derived files, such
    as the transformer optimizer's, go to ``workdir``; the user's file is only read).

    Known limitations: the module must be in eval mode; dtypes bfloat16 and complex are not bound; an
    export whose dynamic axes came out fixed runs only the recorded shapes that ran at build
    (:meth:`accepts` says False for others, so :class:`aitune.torch.Module` runs eager for them).
    """

    name = "onnxruntime"
    config_class = ONNXRuntimeBackendConfig
    build_mode = BuildMode.AOT
    requirements = (
        Requirement("onnxruntime", ("onnxruntime", "onnxruntime-gpu"), "onnx", "1.18"),
        Requirement("onnx", ("onnx",), "onnx", "1.16"),
        Requirement("onnxscript", ("onnxscript",), "onnx", "0.2"),
    )
    device_types = frozenset({"cpu", "cuda"})
    rank = 35
    default_search_position = 40  # in the default search (Backend.default_search_position)
    takes_onnx_file = True  # builds an OnnxModule's file as it is (onnx_file_io)

    def __init__(self, config: ONNXRuntimeBackendConfig | None = None):
        super().__init__(config)
        self._session = None
        self._io: OnnxCallIO | None = None
        self._onnx_path: Path | None = None
        self._file_sha256: str | None = None  # an OnnxModule's file the session runs: its sha256 (see _build)
        self._provider: ONNXExecutionProvider | None = None
        self._io_device = torch.device("cpu")
        self._use_io_binding = False

    # ---- eligibility
    def _supports(self, module, graph, device: torch.device) -> Check:
        reason = None if isinstance(module, OnnxModule) else training_mode_reason(module)
        if reason is not None:
            return Check(False, reason)
        provider = self.config.resolved_provider(device)
        if provider is not ONNXExecutionProvider.CPU and device.type != "cuda":
            return Check(False, f"execution provider {provider.value} needs a CUDA device, got {device}")
        import onnxruntime

        available = onnxruntime.get_available_providers()
        if provider.ort_name not in available:
            return Check(False, f"requested {provider.label} EP is not available in this onnxruntime (available: "
                                f"{', '.join(available)}) — pip install 'aitune[onnx-gpu]'")
        for spec in getattr(graph, "tensor_specs", ()):
            if spec.dtype not in NUMPY_NAMES:
                return Check(False, f"input {spec.path} has dtype {spec.dtype}, which the ONNX Runtime backend does "
                                    f"not bind (supported: {', '.join(str(d) for d in NUMPY_NAMES)})")
        return Check(True)

    def rejects(self, leaves: list) -> str | None:
        """Why the built graph cannot run a call with these flattened canonical input leaves (None: it can).

        Other constants than exported, other dtypes or ranks, sizes outside the recorded/declared range,
        batch axes that disagree, and — for a shape-specialized export — any shape that did not run at build
        (the shared check of :mod:`aitune.torch.backend.accepted`).
        """
        if self._io is None:
            return "the ONNX graph is not built"
        return self._io.check(list(leaves))

    # ---- build
    def _build(self, module, graph, device, workdir: Path) -> None:
        self._provider = self.config.resolved_provider(device)
        export = onnx_for_backend(module, graph, workdir / ONNX_FILE, use_dynamo=self.config.use_dynamo,
                                  opset_version=self.config.opset_version, device=device)
        self.build_info.update(exporter=export.exporter, export_notes=list(export.notes),
                               shape_specialized=export.shape_specialized, onnx_path=str(export.path),
                               onnx_size_bytes=sum(p.stat().st_size for p in [export.path] + [
                                   export.path.parent / name for name in export.external_data_files]))
        for dtype in export.flat_io.output_dtypes:
            if dtype not in NUMPY_NAMES:
                raise BackendBuildError(f"onnxruntime: output dtype {dtype} is not supported by the ONNX Runtime "
                                        "backend (fp16/32/64, int8/16/32/64, uint8, bool)", backend=self.name,
                                        config_key=self.config.key())
        self._io = OnnxCallIO.from_export(export, graph, module)
        self._onnx_path = export.path
        if self.config.transformer_fusions:
            self._onnx_path = self._fuse(export, device, workdir)
            self.build_info["onnx_path"] = str(self._onnx_path)  # the graph the session runs
        # the session runs an OnnxModule's own file (not a derived one in the workdir): its digest, for later checks
        self._file_sha256 = module.sha256 if isinstance(module, OnnxModule) and self._onnx_path == export.path \
            else None
        self._setup_device(device)
        self._create_session(BackendBuildError)
        self._validate_samples(graph, export)

    def _fuse(self, export, device: torch.device, workdir: Path) -> Path:
        """ONNX Runtime's transformer optimizer on the model; returns the fused model's path (in ``workdir``)."""
        from onnxruntime.transformers import optimizer

        fused_path = workdir / f"fused_{ONNX_FILE}"
        fused = optimizer.optimize_model(str(export.path), model_type=self.config.transformer_fusions, num_heads=0,
                                         hidden_size=0, opt_level=0, use_gpu=device.type == "cuda")
        fused.save_model_to_file(str(fused_path), use_external_data_format=bool(export.external_data_files))
        counts = {name: count for name, count in fused.get_fused_operator_statistics().items() if count}
        self.build_info["transformer_fusions"] = counts
        self.build_info["fusion_note"] = transformer_fusion_note(counts)  # the report row's note
        logger.debug("onnxruntime: transformer fusions %s", counts)
        return fused_path

    def search_space(self, module, graph, device) -> list["Backend"]:
        """At the default configuration (graph optimization level ``all``), plus ONNX Runtime's
        transformer fusions for a BERT-like encoder; with a time budget (tier 1) also level ``extended``, which
        leaves out the layout optimizations of ``all`` (on CPU: NCHWc conversions, which do not pay off for
        every graph; ONNX Runtime's "Graph optimizations" documentation). A configuration the user chose is tried
        as given."""
        if self.config != ONNXRuntimeBackendConfig():
            return [self]
        variants = [self]
        if looks_like_transformer_encoder(module):
            variants.append(ONNXRuntimeBackend(ONNXRuntimeBackendConfig(transformer_fusions="bert")))
        extended = ONNXRuntimeBackend(ONNXRuntimeBackendConfig(graph_optimization_level="extended"))
        extended._tier = 1
        return variants + [extended]

    def _validate_samples(self, graph, export) -> None:
        """Run every recorded sample once; restrict a graph that fails at some recorded shapes to the others."""
        passed: list[tuple] = []
        failures: list[tuple[tuple, BaseException]] = []
        for sample in graph.samples:
            leaves = sample.leaves()
            shapes = tuple(tuple(leaves[index].shape) for index in self._io.tensor_indices)
            try:
                self._run(self._io.flat_inputs(leaves), quiet=True)
                passed.append(shapes)
            except Exception as exc:  # noqa: BLE001 - collected; decided below
                logger.debug("sample with input shapes %s failed in ONNX Runtime", shapes, exc_info=True)
                failures.append((shapes, exc))
        self.build_info["validated_shapes"] = [list(map(list, s)) for s in passed]
        if not passed:
            shapes, exc = failures[0]
            raise BackendBuildError(f"onnxruntime: the exported graph fails on the recorded sample with input shapes "
                                    f"{[list(s) for s in shapes]}: {one_line(exc)}", backend=self.name,
                                    config_key=self.config.key()) from exc
        if export.shape_specialized or failures:
            # NOTE [shape-specialized ONNX graphs]: an export whose dynamic axes came out fixed — visible in the
            # graph inputs, or only as a runtime error at another recorded shape (sizes baked into Reshape
            # constants) — is kept for the recorded shapes that ran; accepts() routes the rest to eager.
            self._io.accepted_shapes = set(passed)
            if failures:
                message = (f"ONNX graph failed at recorded input shapes {[list(map(list, s)) for s, _ in failures]} "
                           f"({one_line(failures[0][1])}); treated as shape-specialized")
                self.build_info["export_notes"].append(message)
                logger.warning("onnxruntime: %s", message)
            self.build_info["shape_specialized"] = True
            self.build_info["accepted_shapes"] = sorted([list(map(list, s)) for s in passed])

    # ---- sessions
    def _setup_device(self, device: torch.device) -> None:
        self._provider = self._provider or self.config.resolved_provider(device)
        self._use_io_binding = self._provider is not ONNXExecutionProvider.CPU
        if self._provider is ONNXExecutionProvider.CPU:
            self._io_device = torch.device("cpu")
        else:
            index = device.index if device.index is not None else (
                torch.cuda.current_device() if torch.cuda.is_available() else 0)
            self._io_device = torch.device("cuda", index)

    def _provider_list(self) -> list:
        index = self._io_device.index or 0
        cuda = ("CUDAExecutionProvider", {"device_id": index})
        if self._provider is ONNXExecutionProvider.CUDA:
            return [cuda]
        if self._provider is ONNXExecutionProvider.TENSORRT:
            return [("TensorrtExecutionProvider", {"device_id": index}), cuda]
        return ["CPUExecutionProvider"]

    def _create_session(self, error_type: type[Exception]) -> None:
        """Create the InferenceSession and check the requested EP is active (ONNX Runtime may fall back to CPU
        silently: microsoft/onnxruntime#23372)."""
        import onnxruntime

        options = onnxruntime.SessionOptions()
        options.graph_optimization_level = getattr(onnxruntime.GraphOptimizationLevel,
                                                   GRAPH_OPTIMIZATION_LEVELS[self.config.graph_optimization_level])
        if self.config.intra_op_num_threads is not None:
            options.intra_op_num_threads = self.config.intra_op_num_threads
        if self.config.inter_op_num_threads is not None:
            options.inter_op_num_threads = self.config.inter_op_num_threads
        options.log_severity_level = 3  # errors only; failures reach us as exceptions
        providers = self._provider_list()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            session = onnxruntime.InferenceSession(str(self._onnx_path), sess_options=options, providers=providers)
        for warning in caught:
            logger.debug("onnxruntime warning: %s", warning.message)
        active = session.get_providers()
        self.build_info["providers"] = list(active)
        if self._provider.ort_name not in active:
            on = "CPU" if active and active[0] == "CPUExecutionProvider" else (active[0] if active else "nothing")
            on = "CUDA" if on == "CUDAExecutionProvider" else on
            message = (f"onnxruntime: requested {self._provider.label} EP not active; session on {on} "
                       f"(active providers: {', '.join(active)}; install an onnxruntime-gpu that matches this "
                       "CUDA — pip install 'aitune[onnx-gpu]')")
            if error_type is BackendBuildError:
                raise BackendBuildError(message, backend=self.name, config_key=self.config.key())
            raise error_type(message)
        logger.debug("onnxruntime session on %s (requested %s)", active, providers)
        self._session = session

    def _activate(self) -> None:
        if self._session is None:
            self._create_session(BackendRuntimeError)

    def _deactivate(self) -> None:
        self._session = None

    # ---- inference
    def _infer(self, args, kwargs):
        io = self._io
        try:
            leaves = io.leaves_of(args, kwargs)
        except (ValueError, TypeError) as exc:
            raise BackendRuntimeError(f"onnxruntime: {exc}") from exc
        problem = io.check(leaves)
        if problem is not None:
            raise BackendRuntimeError(f"onnxruntime: {problem}; run such calls eager (aitune.Module does this)")
        return io.outputs(self._run(io.flat_inputs(leaves)))

    def _infer_accepted(self, args, kwargs):
        io = self._io  # rejects() (the same io.check) passed for these inputs just before
        return io.outputs(self._run(io.flat_inputs(io.leaves_of(args, kwargs))))

    def _run(self, tensors: list[torch.Tensor], quiet: bool = False) -> list[torch.Tensor]:
        """Run the session on the ONNX inputs (``input_names`` order); returns torch outputs (flat order).

        NOTE [IOBinding on CUDA, numpy on CPU]: on CUDA, inputs are bound by device pointer and outputs are
        allocated on the device by ONNX Runtime, so no tensor crosses to the host (microsoft/onnxruntime#8166). On CPU,
        ``InferenceSession.run`` with numpy views of the tensors is about 3x faster than IOBinding for small
        models, so it is used there. Tests also run the IOBinding path
        on CPU (``_use_io_binding``) so its binding and conversion logic is executed, not just written.
        """
        if self._session is None:
            self._create_session(BackendRuntimeError)
        run_options = None
        if quiet:  # build-time probes: failures come back as exceptions, keep ONNX Runtime's log quiet
            import onnxruntime

            run_options = onnxruntime.RunOptions()
            run_options.log_severity_level = 4
        if self._use_io_binding:
            return self._run_bound(tensors, run_options)
        feeds = {}
        for name, tensor in zip(self._io.input_names, tensors):
            tensor = tensor.detach()
            if tensor.device.type != "cpu":
                tensor = tensor.cpu()
            feeds[name] = tensor.contiguous().numpy()
        values = self._session.run(self._io.output_names, feeds, run_options)
        outputs = []
        for value, dtype in zip(values, self._io.output_dtypes):
            tensor = torch.from_numpy(value)  # ONNX Runtime returns fresh arrays: no copy needed
            if tensor.dtype != dtype:
                tensor = tensor.to(dtype)
            if self.device is not None and tensor.device != self.device:
                tensor = tensor.to(self.device)
            outputs.append(tensor)
        return outputs

    def _run_bound(self, tensors: list[torch.Tensor], run_options) -> list[torch.Tensor]:
        """IOBinding run on the session's device (documented ``onnxruntime.IOBinding`` API)."""
        import numpy

        session, io = self._session, self._io
        binding = session.io_binding()
        device_type, device_id = self._io_device.type, self._io_device.index or 0
        kept = []  # keep the bound tensors alive until the run ends
        for name, tensor in zip(io.input_names, tensors):
            tensor = tensor.detach()
            if tensor.device != self._io_device:
                tensor = tensor.to(self._io_device)
            if not tensor.is_contiguous():
                tensor = tensor.contiguous()
            kept.append(tensor)
            binding.bind_input(name=name, device_type=device_type, device_id=device_id,
                               element_type=getattr(numpy, NUMPY_NAMES[tensor.dtype]), shape=tuple(tensor.shape),
                               buffer_ptr=tensor.data_ptr())
        for name in io.output_names:
            binding.bind_output(name=name, device_type=device_type, device_id=device_id)
        if device_type == "cuda":
            # ONNX Runtime runs on its own stream: finish the work that produced the inputs first.
            torch.cuda.current_stream(self._io_device).synchronize()
        session.run_with_iobinding(binding, run_options)
        if device_type == "cuda":
            binding.synchronize_outputs()
        values = binding.get_outputs()
        outputs = [self._to_torch(value, dtype) for value, dtype in zip(values, io.output_dtypes)]
        del kept
        return outputs

    def _to_torch(self, value, eager_dtype: torch.dtype) -> torch.Tensor:
        """One output OrtValue as a torch tensor of eager's dtype on the backend's device."""
        ort_dtype = ORT_TYPES.get(value.data_type())
        if ort_dtype is None:
            raise BackendRuntimeError(f"onnxruntime: output of type {value.data_type()} is not supported")
        shape = tuple(value.shape())
        if value.device_name().lower() == "cpu":
            # numpy() shares the OrtValue's buffer (its capsule keeps it alive); from_numpy shares it again.
            tensor = torch.from_numpy(value.numpy())
        elif 0 in shape:
            tensor = torch.empty(shape, dtype=ort_dtype, device=self._io_device)
        else:
            tensor = torch.as_tensor(CudaArray(value, ort_dtype), device=self._io_device).clone()
        if tensor.dtype != eager_dtype:
            tensor = tensor.to(eager_dtype)
        if self.device is not None and tensor.device != self.device:
            tensor = tensor.to(self.device)
        return tensor

    # ---- checkpoints
    def _save(self, directory: Path) -> dict:
        consequence = "the checkpoint would not hold what was tuned"
        try:
            metadata, stored, inside = self._copy_model(directory)
        except Exception as exc:  # noqa: BLE001 - an OnnxModule's file deleted or damaged since: said as such
            changed = self._file_changed(self._onnx_path, consequence)
            if changed is None:
                raise
            raise OnnxFileError(changed) from exc
        changed = None if inside else self._file_changed(directory / stored, consequence)
        if changed is not None:
            raise OnnxFileError(changed)
        return {**metadata, "onnx_file": stored}

    def _copy_model(self, directory: Path) -> tuple[dict, str, bool]:
        """Copy the model the session runs and its external data into ``directory``: (metadata, stored name,
        whether the model is in the build folder)."""
        metadata = self._metadata()
        source_dir = self._onnx_path.parent
        # a model outside the workdir is an OnnxModule's file: stored as model.onnx (its external data locations
        # are relative to its folder, whatever its name)
        inside = self.workdir is not None and source_dir.resolve() == Path(self.workdir).resolve()
        stored = self._onnx_path.name if inside else ONNX_FILE
        files = [(self._onnx_path, stored)] + [(source_dir / name, name) for name in metadata["external_data_files"]]
        for source, name in files:
            target = directory / name
            if source.resolve() != target.resolve():
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(source, target)
        return metadata, stored, inside

    def _file_changed(self, model_path: Path, consequence: str) -> str | None:
        """Why an OnnxModule's file (``model_path``: the file or a copy, with its external data) is not the one
        the session runs: its sha256 differs from the OnnxModule's, taken when it was created. None when equal,
        and for exported models (no OnnxModule)."""
        if self._file_sha256 is None:
            return None
        try:
            if onnx_files_digest(model_path, external_data_files(model_path)) == self._file_sha256:
                return None
            what = "changed since its OnnxModule was created (sha256 differs)"
        except Exception as exc:  # noqa: BLE001 - a deleted or damaged file is a changed one, said as such
            what = f"can no longer be read as it was ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})"
        return (f"onnxruntime: {self._onnx_path} (or its external data) {what}, so {consequence}; restore the "
                "file, or build a new OnnxModule of it and tune again")

    def _metadata(self) -> dict:
        """What :meth:`_save` stores; its file names are relative to the ONNX model's folder (the model's own name
        here; :meth:`_save` stores an :class:`~aitune.torch.OnnxModule`'s file as ``model.onnx``)."""
        return {
            "onnx_file": self._onnx_path.name,
            "external_data_files": external_data_files(self._onnx_path),
            "execution_provider": self._provider.value,
            "exporter": self.build_info.get("exporter"),
            "export_notes": self.build_info.get("export_notes", []),
            "io": self._io.to_json(),
        }

    def artifact(self) -> DeploymentArtifact:
        """The ONNX model the session runs (and its external data), in the build or extraction folder (an
        OnnxModule's own file while live).

        Raises:
            OnnxFileError: an OnnxModule's file changed (or is gone) since the module was created.
        """
        require_built(self)
        changed = self._file_changed(self._onnx_path, "this file is not what the tuned module serves")
        if changed is not None:
            raise OnnxFileError(changed)
        return self.artifact_from_metadata(self._metadata(), self._onnx_path.parent, self.config.to_dict(),
                                           GraphFacts.of(self.graph, self.device))

    @classmethod
    def artifact_from_metadata(cls, metadata: dict, directory: Path, config: dict, graph) -> DeploymentArtifact:
        return onnx_artifact(metadata, directory, config, graph, cls.name)

    def _load(self, directory: Path, metadata: dict, module, graph, device: torch.device) -> None:
        self._io = OnnxCallIO.from_json(metadata["io"], graph)
        onnx_file = metadata.get("onnx_file", ONNX_FILE)
        self._onnx_path = checkpoint_path(directory, onnx_file, "onnxruntime metadata 'onnx_file'",
                                          missing=BackendRuntimeError(f"onnxruntime: checkpoint file "
                                                                      f"{Path(directory) / str(onnx_file)} is missing"))
        for name in external_data_files(self._onnx_path):  # ONNX Runtime reads them relative to the model
            checkpoint_path(self._onnx_path.parent, name, f"the external data location of {self._onnx_path.name}")
        self._provider = self.config.resolved_provider(device)
        self.build_info.update(exporter=metadata.get("exporter"), export_notes=metadata.get("export_notes", []),
                               shape_specialized=self._io.accepted_shapes is not None)
        self._setup_device(device)
        self._create_session(BackendRuntimeError)
