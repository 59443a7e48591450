"""TensorRTBackend: ONNX export -> (optional ModelOpt quantization) -> TensorRT engine -> runtime."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import torch

from aitune.errors import BackendRuntimeError, CheckpointError, ConfigError
from aitune.torch.backend.artifact import DeploymentArtifact, GraphFacts, require_built
from aitune.torch.backend.base import Backend, BuildMode, Check, Requirement
from aitune.torch.common.requirements import probe_requirement
from aitune.torch.backend.flat import FlatIO
from aitune.torch.backend.tensorrt import profiles as profile_rules
from aitune.torch.backend.tensorrt.config import (
    ONNXAutoCastConfig,
    ONNXQuantizationConfig,
    TensorRTBackendConfig,
    TorchQuantizationConfig,
)
from aitune.torch.backend.tensorrt.quantization import (
    MODELOPT_REQUIREMENT,
    concatenated_calibration,
    quantize_torch,
    write_calibration_data,
)
from aitune.torch.common.dtypes import dtype_name
from aitune.torch.backend.cuda_graphs import CUDAGraphRunner
from aitune.torch.backend.isolation import run_isolated
from aitune.torch.backend.onnx_file_io import onnx_for_backend
from aitune.torch.backend.tensorrt import engine_build
from aitune.torch.backend.tensorrt.artifact import PROFILES_FILE, engine_artifact
from aitune.torch.backend.tensorrt.runtime import TensorRTRunner
from aitune.torch.record.serialization import output_template_from_json, outputs_to_json

logger = logging.getLogger(__name__)

ENGINE_FILE = "model.plan"
TENSORRT_REQUIREMENT = Requirement("tensorrt", ("tensorrt", "tensorrt-cu13", "tensorrt-cu12"), "tensorrt", "10.3")
POLYGRAPHY_REQUIREMENT = Requirement("polygraphy", ("polygraphy",), "tensorrt")
ONNX_REQUIREMENT = Requirement("onnx", ("onnx",), "tensorrt")

#: Input dtypes TensorRT has no tensor type for (TensorRT API ``DataType``).
UNSUPPORTED_INPUT_DTYPES = (torch.float64, torch.complex64, torch.complex128, torch.int16, torch.uint16,
                            torch.uint32, torch.uint64)


class StoredTensorSpec:
    """The part of a TensorSpec that :class:`FlatIO` needs, rebuilt from checkpoint metadata."""

    def __init__(self, name: str, leaf_index: int, path: str):
        self.name, self.leaf_index, self.path = name, leaf_index, path


class StoredGraph:
    """The input list of a graph rebuilt from checkpoint metadata (no samples): what :class:`FlatIO` reads."""

    def __init__(self, tensor_specs: list[StoredTensorSpec]):
        self.tensor_specs = tensor_specs


class TensorRTBackend(Backend):
    """The module exported to ONNX, built into a TensorRT engine, run with the TensorRT runtime.

    Wraps: TensorRT (``tensorrt`` >= 10.3, strongly typed networks, name-based I/O API), built through
    Polygraphy's loaders; NVIDIA ModelOpt (``nvidia-modelopt[onnx]``) for ``quantization_config``.
    Extra: ``pip install 'aitune[tensorrt]'``. Devices: CUDA only.

    Build (``workdir`` layout as the reference: ``onnx/model.onnx``, ``onnx_autocast/`` or ``onnx_ptq/``,
    ``tensorrt/model.plan``, ``tensorrt/model_optimization_profiles.json``):

    1. ONNX export of the graph's flat module (:func:`aitune.torch.backend.onnx_export.export_onnx`);
       with a :class:`TorchQuantizationConfig` the module is first quantized in PyTorch on a copy. An
       :class:`~aitune.torch.OnnxModule`'s file is taken as it is (:mod:`aitune.torch.backend.onnx_file_io`).
    2. Optimization profiles from the recorded shapes (:class:`ProfileMode`) or the user's profiles,
       fitted to the axes the export kept dynamic.
    3. Optional ModelOpt step on the ONNX file (autocast or PTQ), in a child process.
    4. Engine build and one check run, in a child process with ``build_timeout_s`` (a crash or hang is a
       failed build, not a dead tuner); the log is ``tensorrt/engine_build.log``.

    Run: the engine runs on the caller's CUDA stream with outputs sized at run time; nested inputs and
    outputs are mapped through :class:`FlatIO`. A call outside every optimization profile is refused by
    :meth:`accepts` (the Module then runs eager; NVIDIA/TensorRT#4011); called directly it raises
    :class:`BackendRuntimeError` naming the input and the profile ranges. int64 inputs are bound as int64
    (TensorRT >= 10) or converted to int32 when the engine asks for it (values outside int32 are an error);
    float64/complex inputs are refused before building (TensorRT has no such tensors).
    With ``use_cuda_graphs`` runs are captured per input shape (:mod:`aitune.torch.backend.cuda_graphs`).

    Known limitations: engines load only with the TensorRT version and GPU model they were built for
    (see ``compatibility_level``); ``enable_tf32=True`` (default) makes fp32 results TF32-accurate; in-place
    input mutations are not reproduced.
    """

    name = "tensorrt"
    config_class = TensorRTBackendConfig
    build_mode = BuildMode.AOT
    requirements = (TENSORRT_REQUIREMENT, POLYGRAPHY_REQUIREMENT, ONNX_REQUIREMENT)
    device_types = frozenset({"cuda"})
    rank = 40
    default_search_position = 60  # in the default search (Backend.default_search_position)
    takes_onnx_file = True  # builds an OnnxModule's file as it is (onnx_file_io)
    #: The isolated steps; class attributes so tests can point them elsewhere.
    build_step = "aitune.torch.backend.tensorrt.engine_build:build_engine"
    autocast_step = "aitune.torch.backend.tensorrt.quantization:autocast_onnx"
    ptq_step = "aitune.torch.backend.tensorrt.quantization:quantize_onnx"

    def __init__(self, config: TensorRTBackendConfig | None = None):
        super().__init__(config)
        self._runner = None
        self._trt_handles: tuple = ()
        self._graphs = None
        self._io: FlatIO | None = None
        self._engine_path: Path | None = None
        self._profiles: list[dict] = []
        self._names: list[str] = []  # engine input name per flat input position
        self._paths: dict[str, str] = {}  # engine input name -> readable input path
        self._leaf_indices: list[int] = []  # input leaf index per flat input position
        self._dtypes: list[str | None] = []  # dtype name per flat input position (None: not recorded)

    # ---- properties the tuner reads
    @property
    def is_quantizing(self) -> bool:  # type: ignore[override]
        """True with any ``quantization_config``: judged by SQNR/cosine instead of atol/rtol."""
        return self.config.quantization_config is not None

    @property
    def low_precision(self) -> bool:
        """True when fp32 outputs are only TF32-accurate (``enable_tf32``): compare with low-precision tolerances."""
        return self.config.enable_tf32

    # ---- eligibility
    def _supports(self, module, graph, device) -> Check:
        quantization = self.config.quantization_config
        if isinstance(quantization, TorchQuantizationConfig):
            # With ModelOpt 0.47 and torch 2.13, mtq.quantize runs, but both ONNX exporters fail on
            # ModelOpt's quantizers (dynamo: data-dependent guard; TorchScript: a traced data-dependent branch).
            return Check(False, "TorchQuantizationConfig is not supported yet: aitune's ONNX export cannot export "
                                "ModelOpt-quantized modules; use ONNXQuantizationConfig (PTQ on the ONNX graph)")
        if quantization is not None:
            check = probe_requirement(MODELOPT_REQUIREMENT)
            if not check.ok:
                return Check(False, f"quantization_config needs ModelOpt: {check.reason}")
        if graph is None or not graph.tensor_specs:
            return Check(False, "the graph has no tensor input to bind to a TensorRT engine")
        for spec in graph.tensor_specs:
            if spec.dtype in UNSUPPORTED_INPUT_DTYPES:
                return Check(False, f"input {spec.path} is {str(spec.dtype).removeprefix('torch.')}, which TensorRT "
                                    "has no tensor type for; cast it (e.g. to float32) before the module")
        if self.config.user_profiles is not None:
            if any(dim is not None for spec in graph.tensor_specs for dim in spec.dims):
                return Check(False, "both user TensorRT profiles and Module(dynamic_shapes=...) are set; use one")
            try:
                profile_rules.user_profiles(graph, self.config.user_profiles)
            except ConfigError as exc:
                return Check(False, str(exc))
        capability = torch.cuda.get_device_capability(device) if torch.cuda.is_available() else None
        if capability is not None:
            if isinstance(quantization, ONNXQuantizationConfig) and quantization.precision == "fp8" \
                    and capability < (8, 9):
                return Check(False, "fp8 needs compute capability >= 8.9, this GPU has "
                                    f"{capability[0]}.{capability[1]}")
            if isinstance(quantization, ONNXAutoCastConfig) and quantization.precision == "bf16" and capability < (8, 0):
                return Check(False, "bf16 needs compute capability >= 8.0, this GPU has "
                                    f"{capability[0]}.{capability[1]}")
        return Check(True)

    # ---- build
    def _build(self, module, graph, device, workdir: Path) -> None:
        config = self.config
        onnx_dir, trt_dir = workdir / "onnx", workdir / "tensorrt"
        trt_dir.mkdir(parents=True, exist_ok=True)
        source = module
        quantization = config.quantization_config
        if isinstance(quantization, TorchQuantizationConfig):
            source = quantize_torch(module, graph.samples[:quantization.calibration_samples],
                                    quantization.quantization_config)
            self.build_info["quantization"] = f"modelopt torch {quantization.quantization_config}"
        export = onnx_for_backend(source, graph, onnx_dir / "model.onnx", use_dynamo=config.use_dynamo,
                                  opset_version=config.opset_version, device=device)
        self._io = export.flat_io
        self._set_names(graph, export.flat_io, export.input_names, export.input_indices)
        self.build_info.update(exporter=export.exporter, export_notes=list(export.notes),
                               shape_specialized=export.shape_specialized)

        exported_names = [self._names[index] for index in export.input_indices]
        profiles = profile_rules.resolve_profiles(graph, config.profiles, self._names)
        profiles = [{name: ranges for name, ranges in profile.items() if name in exported_names}
                    for profile in profiles]
        profiles, notes = profile_rules.constrain_to_onnx(profiles, profile_rules.onnx_input_shapes(export.path))
        self._profiles = profiles
        self.build_info["profiles"] = profile_rules.profiles_to_json(profiles)
        if notes:
            self.build_info["profile_notes"] = notes
        uncovered = [sample.shapes() for sample in graph.samples if not self._covers(sample.leaves())]
        if uncovered:
            logger.warning("tensorrt: %d recorded sample shape(s) lie outside every optimization profile and will "
                           "run eager: %s", len(uncovered), uncovered[:3])

        onnx_path = Path(export.path)
        sample_inputs = [self._io.sample_inputs(sample) for sample in graph.samples]
        bound_inputs = [[tensors[index] for index in export.input_indices] for tensors in sample_inputs]
        if isinstance(quantization, ONNXAutoCastConfig):
            calibration_dir = write_calibration_data(bound_inputs, exported_names, workdir / "calibration")
            output = workdir / "onnx_autocast" / "model.onnx"
            result = run_isolated(self.autocast_step, {
                "onnx_path": str(onnx_path), "output_path": str(output), "precision": quantization.precision,
                "keep_io_types": quantization.keep_io_types, "calibration_dir": str(calibration_dir)},
                timeout_s=config.build_timeout_s, log_path=workdir / "onnx_autocast" / "autocast.log")
            onnx_path = output
            self.build_info["quantization"] = f"modelopt onnx autocast {quantization.precision} ({result})"
        elif isinstance(quantization, ONNXQuantizationConfig):
            import numpy as np

            calibration_path = workdir / "calibration" / "calibration.npz"
            calibration_path.parent.mkdir(parents=True, exist_ok=True)
            np.savez(calibration_path, **concatenated_calibration(bound_inputs, exported_names))
            output = workdir / "onnx_ptq" / "model.onnx"
            result = run_isolated(self.ptq_step, {
                "onnx_path": str(onnx_path), "output_path": str(output), "precision": quantization.precision,
                "calibration_method": quantization.calibration_method, "calibration_path": str(calibration_path),
                "calibration_eps": [f"cuda:{device.index or 0}", "cpu"]},
                timeout_s=config.build_timeout_s, log_path=workdir / "onnx_ptq" / "quantize.log")
            onnx_path = output
            self.build_info["quantization"] = f"modelopt onnx ptq {quantization.precision} ({result})"

        check_path = trt_dir / "check_inputs.pt"
        torch.save([t.detach().cpu().contiguous() for t in sample_inputs[0]], check_path)
        engine_path = trt_dir / ENGINE_FILE
        result = run_isolated(self.build_step, {
            "onnx_path": str(onnx_path), "engine_path": str(engine_path),
            "profiles": profile_rules.profiles_to_json(profiles), "input_names": self._names,
            "output_names": list(export.output_names), "workspace_size": config.workspace_size,
            "optimization_level": config.optimization_level, "compatibility_level": config.compatibility_level,
            "timing_cache": str(config.timing_cache) if config.timing_cache is not None else None,
            "enable_tf32": config.enable_tf32, "check_inputs_path": str(check_path),
            "device_index": _device_index(device)},
            timeout_s=config.build_timeout_s, log_path=trt_dir / "engine_build.log")
        profile_rules.write_profiles(trt_dir / PROFILES_FILE, profiles)
        self._output_names = list(export.output_names)
        self._engine_path = engine_path
        self.build_info.update(engine_bytes=result.get("engine_bytes"), engine_build_s=result.get("build_s"),
                               tensorrt_version=result.get("tensorrt_version"))
        self._load_runner()

    def _set_names(self, graph, flat_io: FlatIO, input_names: list[str], input_indices: list[int]) -> None:
        names = list(flat_io.input_names)
        for name, index in zip(input_names, input_indices):
            names[index] = name
        self._names = names
        self._leaf_indices = list(flat_io.tensor_indices)
        specs = graph.tensor_specs
        self._paths = {name: spec.path for name, spec in zip(names, specs)}
        self._dtypes = [dtype_name(spec.dtype) for spec in specs]

    def _load_runner(self) -> None:
        trt, runtime, engine = engine_build.load_engine(self._engine_path)
        self._trt_handles = (runtime, engine)
        self._runner = TensorRTRunner(engine, trt, self.device, self._names, self._output_names,
                                      output_dtypes=self._io.output_dtypes, input_paths=self._paths)
        self._graphs = None
        if self.config.use_cuda_graphs:
            self._graphs = CUDAGraphRunner(self._run_engine, max_graphs=self.config.max_cuda_graphs, name=self.name,
                                           before_replay=self._restore_shapes)

    # ---- run
    def _covers(self, leaves: list) -> bool:
        shapes = {}
        for name, leaf_index in zip(self._names, self._leaf_indices):
            leaf = leaves[leaf_index]
            if not isinstance(leaf, torch.Tensor):
                return False
            shapes[name] = tuple(leaf.shape)
        return profile_rules.select_profile(self._profiles, shapes) is not None

    def rejects(self, leaves: list) -> str | None:
        """A reason for a call the engine cannot take: another dtype or device than it was built for, or shapes
        outside every optimization profile (the Module then runs eager and logs the reason)."""
        dtypes = self._dtypes or [None] * len(self._names)
        for name, leaf_index, dtype in zip(self._names, self._leaf_indices, dtypes):
            leaf = leaves[leaf_index] if leaf_index < len(leaves) else None
            if not isinstance(leaf, torch.Tensor):
                return f"input {self._paths.get(name, name)!r} is not a tensor"
            if dtype is not None and dtype_name(leaf.dtype) != dtype:
                return f"input {self._paths.get(name, name)!r} has dtype {dtype_name(leaf.dtype)}, the engine takes {dtype}"
            if self.device is not None and leaf.device.type != self.device.type:
                return (f"input {self._paths.get(name, name)!r} is on {leaf.device.type}, the engine runs on "
                        f"{self.device.type}")
        if self._covers(leaves):
            return None
        shapes = [list(leaves[i].shape) if isinstance(leaves[i], torch.Tensor) else type(leaves[i]).__name__
                  for i in self._leaf_indices]
        return f"input shapes {shapes} fit none of the engine's optimization profiles"

    def _run_engine(self, *tensors: torch.Tensor) -> list[torch.Tensor]:
        return self._runner.run(list(tensors))

    def _restore_shapes(self, *tensors: torch.Tensor) -> None:
        self._runner.restore_shapes(list(tensors))

    def _infer(self, args, kwargs):
        tensors = self._io.inputs(args, kwargs)
        if self._graphs is not None and self._runner.data_dependent_outputs:
            self._graphs = None  # NOTE: outputs sized after execution cannot be replayed from a graph
            logger.warning("tensorrt: outputs %s have data-dependent shapes; CUDA graphs disabled",
                           sorted(self._runner.data_dependent_outputs))
        if self._graphs is not None and self._runner.profile_for(tensors) is not None:
            outputs = self._graphs(*tensors)
        else:
            outputs = self._runner.run(tensors)
        return self._io.outputs(outputs)

    def _activate(self) -> None:
        if self._runner is None:
            self._load_runner()

    def _deactivate(self) -> None:
        self._runner = None
        self._graphs = None
        self._trt_handles = ()

    # ---- checkpoints
    def _save(self, directory: Path) -> dict:
        target = directory / ENGINE_FILE
        if self._engine_path.resolve() != target.resolve():
            shutil.copyfile(self._engine_path, target)
        profile_rules.write_profiles(directory / PROFILES_FILE, self._profiles)
        return {**self._metadata(), "engine": ENGINE_FILE}

    def _metadata(self) -> dict:
        """What :meth:`_save` stores; the engine's name is relative to its folder (the profiles file beside it)."""
        return {
            "engine": self._engine_path.name,
            "profiles": profile_rules.profiles_to_json(self._profiles),
            "inputs": [{"name": name, "leaf_index": index, "path": self._paths.get(name, name), "dtype": dtype}
                       for name, index, dtype in zip(self._names, self._leaf_indices, self._dtypes)],
            "output_names": list(self._output_names),
            "outputs": outputs_to_json(self._io.output_spec, self._io.output_constants, self._io.output_is_tensor,
                                       self._io.output_dtypes),
            "build_info": {key: value for key, value in self.build_info.items()
                           if key in ("exporter", "tensorrt_version", "quantization", "shape_specialized")},
        }

    def artifact(self) -> DeploymentArtifact:
        """The serialized engine and its optimization profiles, in the build or extraction folder (not run here
        with a real engine: see :mod:`aitune.torch.backend.tensorrt.artifact`)."""
        require_built(self)
        return self.artifact_from_metadata(self._metadata(), self._engine_path.parent, self.config.to_dict(),
                                           GraphFacts.of(self.graph, self.device))

    @classmethod
    def artifact_from_metadata(cls, metadata: dict, directory: Path, config: dict, graph) -> DeploymentArtifact:
        return engine_artifact(metadata, directory, config, graph, cls.name, PROFILES_FILE)

    def _load(self, directory: Path, metadata: dict, module, graph, device: torch.device) -> None:
        engine_path = self._stored_file(directory, metadata, "engine", ENGINE_FILE)
        inputs = metadata["inputs"]
        self._names = [entry["name"] for entry in inputs]
        self._leaf_indices = [int(entry["leaf_index"]) for entry in inputs]
        self._paths = {entry["name"]: entry.get("path", entry["name"]) for entry in inputs}
        self._dtypes = [entry.get("dtype") for entry in inputs]  # absent in checkpoints of aitune <= 0.1
        self._profiles = profile_rules.profiles_from_json(metadata["profiles"])
        self._output_names = list(metadata["output_names"])
        template = output_template_from_json(metadata["outputs"], getattr(graph, "output_spec", None))

        io_graph = StoredGraph([StoredTensorSpec(entry["name"], int(entry["leaf_index"]), entry.get("path", ""))
                                 for entry in inputs])
        self._io = FlatIO(io_graph, template)
        self._engine_path = engine_path
        self.build_info.update(metadata.get("build_info", {}))
        try:
            self._load_runner()
        except (RuntimeError, BackendRuntimeError) as exc:
            raise CheckpointError(f"{self.name}: {exc}") from exc


def _device_index(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    return device.index if device.index is not None else torch.cuda.current_device()
