"""ONNXRuntimeBackend: export to ONNX, run with ONNX Runtime on the CPU, CUDA or TensorRT execution provider.

Modules: :mod:`~aitune.torch.backend.ort_config` (the config), :mod:`~aitune.torch.backend.ort_io` (binding
types, CUDA outputs without a copy), :mod:`~aitune.torch.backend.ort_fusions` (transformer fusions); their
names stay importable from here. :mod:`~aitune.torch.backend.ort_session` (session options, providers),
:mod:`~aitune.torch.backend.ort_placement` (which EP ran each node), :mod:`~aitune.torch.backend.ort_cuda_graph`
(CUDA graphs with persistent buffers).
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

import torch

from aitune.errors import BackendBuildError, BackendRuntimeError, OnnxFileError, one_line
from aitune.torch.backend.artifact import DeploymentArtifact, GraphFacts, require_built
from aitune.torch.backend.base import Backend, BuildMode, Check, Requirement
from aitune.torch.backend.onnx_call_io import OnnxCallIO
from aitune.torch.backend.onnx_export import training_mode_reason
from aitune.torch.backend.onnx_graph import external_data_files
from aitune.torch.backend.ort_config import (  # noqa: F401 - re-exported
    GRAPH_OPTIMIZATION_LEVELS,
    TRANSFORMER_MODEL_TYPES,
    ONNXExecutionProvider,
    ONNXRuntimeBackendConfig,
    coerce_execution_provider,
)
from aitune.torch.backend.ort_fusions import (  # noqa: F401 - re-exported
    SESSION_FUSIONS, attention_shape, export_for_fusions, fuse_transformer, looks_like_transformer_encoder,
    transformer_fusion_note,
)
from aitune.torch.backend.ort_artifact import copy_onnx_model, onnx_artifact, onnx_file_changed
from aitune.torch.backend.ort_cuda_graph import (
    GRAPH_ID,
    PersistentBindings,
    cuda_graph_variants,
    graph_capture_refused,
    half_precision_conv2d,
    in_search_order,
)
from aitune.torch.backend.ort_io import NUMPY_NAMES, ORT_TYPES, CudaArray
from aitune.torch.backend.ort_placement import PROFILE_PREFIX, placement_info
from aitune.torch.backend.ort_session import inactive_provider_message, provider_list, session_options
from aitune.torch.common.files import checkpoint_path
from aitune.torch.record.onnx_module import OnnxModule

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
    The build session is profiled to record which EP ran each node (``build_info["node_placement"]``; nodes off
    the requested EP are named in the report row: :mod:`~aitune.torch.backend.ort_placement`).
    Inference on CUDA binds inputs and outputs with IOBinding on the device (they never leave the GPU);
    on CPU it feeds numpy views. Outputs come back in eager's structure, dtypes and device. With ``cuda_graph``
    each recorded input shape gets a captured CUDA graph replayed from persistent buffers, and other shapes are
    refused (:mod:`~aitune.torch.backend.ort_cuda_graph`).

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
        self._graphs: PersistentBindings | None = None  # cuda_graph: persistent buffers per input shape

    # ---- eligibility
    def _supports(self, module, graph, device: torch.device) -> Check:
        reason = None if isinstance(module, OnnxModule) else training_mode_reason(module)
        if reason is not None:
            return Check(False, reason)
        provider = self.config.resolved_provider(device)
        if self.config.cuda_graph and provider is not ONNXExecutionProvider.CUDA:
            return Check(False, f"cuda_graph needs the CUDA execution provider (device {device})")
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
        export = export_for_fusions(module, graph, workdir / ONNX_FILE, fusions=self.config.transformer_fusions,
                                    use_dynamo=self.config.use_dynamo, opset_version=self.config.opset_version,
                                    device=device)
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
            self._onnx_path = self._fuse(export, module, device, workdir)
            self.build_info["onnx_path"] = str(self._onnx_path)  # the graph the session runs
        # the session runs an OnnxModule's own file (not a derived one in the workdir): its digest, for later checks
        self._file_sha256 = module.sha256 if isinstance(module, OnnxModule) and self._onnx_path == export.path \
            else None
        self._setup_device(device)
        try:
            self._create_session(BackendBuildError, profile_prefix=workdir / PROFILE_PREFIX)
        except Exception as exc:
            if self.config.cuda_graph and graph_capture_refused(exc):
                self._refuse_graphs(exc, graph, workdir)
            raise
        self._validate_samples(graph, export)
        self._record_placement()
        if self.config.cuda_graph:
            self._capture_graphs(graph)

    def _record_placement(self) -> None:
        """End the build session's profiling; which EP ran each node goes to build_info (NOTE [node placement
        from the profile] in :mod:`~aitune.torch.backend.ort_placement`)."""
        self.build_info.update(placement_info(self._session.end_profiling(), self._provider.ort_name))

    def _capture_graphs(self, graph) -> None:
        """Bind persistent buffers and capture one CUDA graph per validated input shape; only those run."""
        self._graphs = self._persistent_bindings(capture=True)
        shapes = set()
        for leaves in (sample.leaves() for sample in graph.samples):
            if self._io.check(leaves) is None:  # the shapes that passed validation
                self._graphs.run(self._io.flat_inputs(leaves))
                shapes.add(tuple(tuple(leaves[index].shape) for index in self._io.tensor_indices))
        self._io.accepted_shapes = shapes  # one graph per shape: rejects() refuses the others
        self.build_info.update(cuda_graphs=len(self._graphs.shapes), shape_specialized=True,
                               accepted_shapes=sorted([list(map(list, s)) for s in shapes]))

    def _refuse_graphs(self, exc: BaseException, graph, workdir: Path) -> None:
        """ONNX Runtime refused CUDA graphs: fail the build naming why, with the nodes a plain CUDA session puts
        elsewhere (one profiled run of the first sample) when that can be found."""
        note = ""
        try:
            self._create_session(BackendBuildError, profile_prefix=workdir / PROFILE_PREFIX, cuda_graph=False)
            self._run(self._io.flat_inputs(graph.samples[0].leaves()), quiet=True)
            self._record_placement()
            note = self.build_info.get("placement_note", "")
        except Exception:  # noqa: BLE001 - the refusal is the error; the placement only explains it
            logger.debug("onnxruntime: placement probe without CUDA graphs failed", exc_info=True)
        self._session = None
        raise BackendBuildError(f"onnxruntime: ONNX Runtime refused CUDA graph capture ({one_line(exc)})"
                                + (f"; {note}" if note else "") + " — use the variant without cuda_graph",
                                backend=self.name, config_key=self.config.key()) from exc

    def _persistent_bindings(self, capture: bool) -> PersistentBindings:
        return PersistentBindings(self._session, self._io.input_names, self._io.output_names, self._io_device,
                                  capture=capture)

    def _fuse(self, export, module, device: torch.device, workdir: Path) -> Path:
        """ONNX Runtime's transformer optimizer on the model (heads and width from the module's Hugging Face config:
        :func:`attention_shape`); returns the fused model's path (in ``workdir``)."""
        fused_path = workdir / f"fused_{ONNX_FILE}"
        counts = fuse_transformer(export.path, self.config.transformer_fusions, device.type == "cuda", fused_path,
                                  bool(export.external_data_files), *attention_shape(module))
        self.build_info["transformer_fusions"] = counts
        self.build_info["fusion_note"] = transformer_fusion_note(counts)  # the report row's note
        logger.debug("onnxruntime: transformer fusions %s", counts)
        return fused_path

    def search_space(self, module, graph, device) -> list["Backend"]:
        """At the default configuration (graph optimization level ``all``), plus ONNX Runtime's
        transformer fusions for a BERT-like encoder; with a time budget (tier 1) also level ``extended``, which
        leaves out the layout optimizations of ``all`` (on CPU: NCHWc conversions, which do not pay off for
        every graph; ONNX Runtime's "Graph optimizations" documentation). A configuration the user chose is tried
        as given.

        On CUDA, also CUDA graphs (:func:`~aitune.torch.backend.ort_cuda_graph.cuda_graph_variants` says which
        and why). Where they apply, the variants without them are fallbacks (:attr:`Backend.search_fallback`),
        built without a budget only when no CUDA-graph variant passes: on ResNet-50 b1/b32 and BERT-base b32 fp16
        the CUDA-graph variant ran 1.13-2.45x the same session without graphs (``benchmarks/gpu_ort.py``)."""
        if self.config != ONNXRuntimeBackendConfig():
            return [self]
        variants = [self.copy()]  # a copy: in_search_order sets tiers on it
        encoder = looks_like_transformer_encoder(module)
        if encoder:
            variants.append(ONNXRuntimeBackend(ONNXRuntimeBackendConfig(transformer_fusions="bert")))
        graphs = [(ONNXRuntimeBackend(config), tier)
                  for config, tier in cuda_graph_variants(encoder, graph, device, half_precision_conv2d(module, graph))]
        extended = ONNXRuntimeBackend(ONNXRuntimeBackendConfig(graph_optimization_level="extended"))
        return in_search_order(variants, graphs, [extended])

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

    def _create_session(self, error_type: type[Exception], profile_prefix: Path | None = None,
                        cuda_graph: bool | None = None) -> None:
        """Create the InferenceSession and check the requested EP is active (ONNX Runtime may fall back to CPU
        silently: microsoft/onnxruntime#23372). ``profile_prefix``: profile the session (build only);
        ``cuda_graph``: overrides the config's. Without profiling, a ``cuda_graph`` session gets its persistent
        bindings (graphs are captured at the first call of each shape)."""
        import onnxruntime

        cuda_graph = self.config.cuda_graph if cuda_graph is None else cuda_graph
        options = session_options(self.config, profile_prefix)
        providers = provider_list(self._provider, self._io_device.index or 0, cuda_graph, self.config)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            session = onnxruntime.InferenceSession(str(self._onnx_path), sess_options=options, providers=providers)
        for warning in caught:
            logger.debug("onnxruntime warning: %s", warning.message)
        active = session.get_providers()
        self.build_info["providers"] = list(active)
        if self._provider.ort_name not in active:
            message = inactive_provider_message(self._provider, active)
            if error_type is BackendBuildError:
                raise BackendBuildError(message, backend=self.name, config_key=self.config.key())
            raise error_type(message)
        logger.debug("onnxruntime session on %s (requested %s)", active, providers)
        self._session = session
        self._graphs = self._persistent_bindings(True) if cuda_graph and profile_prefix is None else None

    def _activate(self) -> None:
        if self._session is None:
            self._create_session(BackendRuntimeError)

    def _deactivate(self) -> None:
        self._session = None
        self._graphs = None  # its buffers and graphs go with the session

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
        if self._graphs is not None:
            outputs = self._graphs.run(tensors, quiet)
            return [self._as_eager(tensor, dtype) for tensor, dtype in zip(outputs, self._io.output_dtypes)]
        run_options = None
        if quiet or self.config.cuda_graph:
            import onnxruntime

            run_options = onnxruntime.RunOptions()
            if quiet:  # build-time probes: failures come back as exceptions, keep ONNX Runtime's log quiet
                run_options.log_severity_level = 4
            if self.config.cuda_graph:  # before the graphs are bound (build): run without capturing
                run_options.add_run_config_entry(GRAPH_ID, "-1")
        if self._use_io_binding:
            return self._run_bound(tensors, run_options)
        feeds = {}
        for name, tensor in zip(self._io.input_names, tensors):
            tensor = tensor.detach()
            if tensor.device.type != "cpu":
                tensor = tensor.cpu()
            feeds[name] = tensor.contiguous().numpy()
        values = self._session.run(self._io.output_names, feeds, run_options)
        # ONNX Runtime returns fresh arrays: no copy needed
        return [self._as_eager(torch.from_numpy(value), dtype) for value, dtype in zip(values, self._io.output_dtypes)]

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
        return self._as_eager(tensor, eager_dtype)

    def _as_eager(self, tensor: torch.Tensor, eager_dtype: torch.dtype) -> torch.Tensor:
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
        stored, inside = copy_onnx_model(self._onnx_path, metadata["external_data_files"], self.workdir, directory,
                                         ONNX_FILE)
        return metadata, stored, inside

    def _file_changed(self, model_path: Path, consequence: str) -> str | None:
        return onnx_file_changed(self._onnx_path, model_path, self._file_sha256, consequence)

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
