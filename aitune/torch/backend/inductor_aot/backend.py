"""TorchInductorAotBackend: export in the parent, compile and first load in a child, the package run here."""

from __future__ import annotations

import dataclasses
import logging
import shutil
import time
from pathlib import Path
from typing import ClassVar

import torch

from aitune.errors import BackendBuildError, IsolatedStepError
from aitune.torch.backend.accepted import AcceptedInputs, batch_axes
from aitune.torch.backend.artifact import DeploymentArtifact, GraphFacts, require_built
from aitune.torch.backend.base import Backend, BuildMode, Check
from aitune.torch.backend.inductor_aot.artifact import pt2_artifact
from aitune.torch.backend.flat import FlatIO, eager_output
from aitune.torch.backend.inductor_aot.child_step import compile_and_check_package
from aitune.torch.backend.inductor_aot.config import TorchInductorAotBackendConfig
from aitune.torch.backend.inductor_aot.export_plan import (
    ExportPlan,
    accepted_ranges,
    export_plan,
    export_with_plan,
    is_constraint_violation,
)
from aitune.torch.backend.inductor_aot.runtime import load_package
from aitune.torch.common.dtypes import dtype_name
from aitune.torch.common.requirements import torch_version_at_least
from aitune.torch.record.serialization import output_template_from_json, outputs_to_json
from aitune.torch.backend.isolation import resolve_target, run_isolated, submit_isolated

logger = logging.getLogger(__name__)


MIN_TORCH_VERSION = "2.6"
PACKAGE_FILE = "model.pt2"
EXPORTED_FILE = "exported_program.pt2"
CHECK_SAMPLE_FILE = "check_sample.safetensors"
CHILD_LOG_FILE = "aoti_compile.log"


# --------------------------------------------------------------------------------------------- output structure


@dataclasses.dataclass
class _StoredTensorSpec:
    leaf_index: int
    name: str


@dataclasses.dataclass
class _StoredInputs:
    """The part of a GraphSpec that :class:`FlatIO` needs for inputs, rebuilt from checkpoint metadata."""

    tensor_specs: list[_StoredTensorSpec]


# --------------------------------------------------------------------------------------------- backend


class TorchInductorAotBackend(Backend):
    """``torch.export`` + AOTInductor (``torch._inductor.aoti_compile_and_package``) -> ``model.pt2``.

    Wraps: AOTInductor (CPU: C++/OpenMP shared library; CUDA: Triton kernels). Extra: none; needs
    torch >= 2.6 (``aoti_compile_and_package``/``aoti_load_package``). Devices: CPU and CUDA.

    Dynamic shapes: one shared batch ``Dim`` plus ``Dim.AUTO``/named dims for other dynamic axes, exported
    at batch >= 2 (NOTE [batch 1 and export] in :mod:`aitune.torch.backend.inductor_aot`). :meth:`accepts`
    takes only shapes inside the recorded/declared ranges that export kept; the caller runs eager for the others.
    Compile and the first load+run happen in a child process with ``build_timeout_s`` (:mod:`aitune.torch.backend.isolation`);
    the child's output is in ``<workdir>/aoti_compile.log``.
    Inputs are made contiguous before each call (pytorch/pytorch#122784).
    Checkpoints hold ``model.pt2`` and the output structure only: loading needs neither the module nor
    its weights.

    Known limitations: modules in training mode are refused (export assumes eval semantics); data-dependent
    control flow fails export (the build fails with torch.export's message); in-place changes of inputs
    are not reproduced on the caller's tensors.
    """

    name = "inductor_aot"
    config_class = TorchInductorAotBackendConfig
    build_mode = BuildMode.AOT
    rank = 30
    default_search_position = 30  # in the default search (Backend.default_search_position)
    # The isolated compile step; a class attribute so tests can point it at a step that crashes for real.
    compile_step: ClassVar[str] = f"{compile_and_check_package.__module__}:compile_and_check_package"

    def __init__(self, config: TorchInductorAotBackendConfig | None = None):
        super().__init__(config)
        self._runner = None
        self._io: FlatIO | None = None
        self._package_path: Path | None = None
        self._accepted: AcceptedInputs | None = None

    @property
    def builds_in_background(self) -> bool:
        """The AOTInductor compile + first load run in a child process (``isolate``): it can overlap other work."""
        return bool(self.config.isolate)

    @classmethod
    def availability(cls) -> Check:
        if not torch_version_at_least(MIN_TORCH_VERSION):
            return Check(False, f"AOTInductor packaging needs torch >= {MIN_TORCH_VERSION}, found "
                                f"{torch.__version__} — pip install -U 'torch>={MIN_TORCH_VERSION}'",
                         {"torch": torch.__version__})
        check = super().availability()
        return Check(check.ok, check.reason, {"torch": torch.__version__, **check.versions})

    def _supports(self, module, graph, device) -> Check:
        if module is not None and module.training:
            return Check(False, "module is in training mode; torch.export assumes eval semantics; call .eval()")
        if graph is not None and not graph.samples:
            return Check(False, "the graph has no recorded samples to export with")
        return Check(True)

    # ---- build
    def _build(self, module, graph, device, workdir: Path) -> None:
        check = self._supports(module, graph, device)
        if not check.ok:
            raise BackendBuildError(f"{self.name}: {check.reason}", backend=self.name, config_key=self.config.key())
        flat_io = FlatIO(graph, eager_output(module, graph))
        flat_module = flat_io.flat_module(module)
        exported, plan = self._export(flat_module, graph, flat_io)
        ranges, notes = accepted_ranges(exported, graph)
        self._accepted = AcceptedInputs.from_graph(graph, device, [(r["low"], r["high"]) for r in ranges],
                                                   batch_axes(graph))
        self.build_info.update({
            "export_example_shapes": [list(tensor.shape) for tensor in plan.example],
            "batch_range": list(plan.batch_range) if plan.batch_range else None,
            "specialized_axes": notes,
            "accepted_ranges": [[r["low"], r["high"]] for r in ranges],
        })
        if plan.repeated_batch:
            self.build_info["export_batch_repeated"] = (
                f"every sample has batch 1; exported with the sample repeated to batch {plan.repeated_batch} "
                "so the batch axis stays dynamic (pytorch/pytorch#133653)")
        for note in notes:
            logger.warning("%s: %s; other sizes run eager", self.name, note)

        exported_path = workdir / EXPORTED_FILE
        torch.export.save(exported, str(exported_path))
        package_path = workdir / PACKAGE_FILE
        package_path.unlink(missing_ok=True)
        check_inputs = self._check_inputs(graph, flat_io, plan)
        with torch.no_grad():
            eager_outputs = flat_module(*[tensor.clone() for tensor in check_inputs])
        from safetensors.torch import save_file

        sample_path = workdir / CHECK_SAMPLE_FILE
        save_file({f"input_{i}": t.detach().contiguous().cpu() for i, t in enumerate(check_inputs)}, str(sample_path))
        step_kwargs = {
            "exported_path": str(exported_path), "package_path": str(package_path), "sample_path": str(sample_path),
            "expected_outputs": [{"shape": list(t.shape), "dtype": dtype_name(t.dtype)} for t in eager_outputs],
            "inductor_configs": self.config.inductor_configs, "device": str(device),
        }
        self.build_info["isolated"] = self.config.isolate
        self._io = flat_io
        self._package_path = package_path
        if self.config.isolate:
            # NOTE [background builds]: with an executor set, the child compile runs while other candidates
            # are evaluated; finish_build() waits for it.
            self._pending = submit_isolated(self.compile_step, step_kwargs, timeout_s=self.config.build_timeout_s,
                                            log_path=workdir / CHILD_LOG_FILE)
            if self._pending is None:
                self._finish_compile(lambda: self._run_compile_step(step_kwargs))
        else:
            self._finish_compile(lambda: resolve_target(self.compile_step)(**step_kwargs))

    def _run_compile_step(self, step_kwargs: dict) -> dict:
        return run_isolated(self.compile_step, step_kwargs, timeout_s=self.config.build_timeout_s,
                            log_path=self.workdir / CHILD_LOG_FILE)

    def _finish_build(self) -> None:
        self._finish_compile(self._pending.result)

    def _finish_compile(self, compile_result) -> None:
        """The child's result (or its failure, as a BackendBuildError), then the package loaded here."""
        log_path = self.workdir / CHILD_LOG_FILE
        try:
            result = compile_result()
        except IsolatedStepError as exc:
            raise BackendBuildError(
                f"{self.name}: AOTInductor compile/load/check in a child process failed: {exc.args[0]}",
                backend=self.name, config_key=self.config.key(), log_path=log_path) from exc
        self.build_info.update({key: result[key] for key in ("compile_s", "package_bytes") if key in result})
        self._runner = load_package(self._package_path, self.device)

    def _export(self, flat_module, graph, flat_io):
        plan = export_plan(graph, flat_io, use_auto=False)
        started = time.perf_counter()
        try:
            exported = export_with_plan(flat_module, plan)
        except Exception as exc:  # noqa: BLE001 - a constraint violation of our named dims: let export infer
            if not is_constraint_violation(exc):
                raise
            logger.warning("%s: torch.export rejected the declared dims (%s); retrying with Dim.AUTO on every "
                           "dynamic axis", self.name, str(exc).splitlines()[0])
            self.build_info["export_retry"] = f"named dims rejected: {str(exc).splitlines()[0][:200]}"
            plan = export_plan(graph, flat_io, use_auto=True)
            exported = export_with_plan(flat_module, plan)
        self.build_info["export_s"] = time.perf_counter() - started
        return exported, plan

    def _check_inputs(self, graph, flat_io: FlatIO, plan: ExportPlan) -> list[torch.Tensor]:
        """A sample to run the fresh package on: a recorded one of another shape than the example if accepted."""
        example_shapes = [list(t.shape) for t in plan.example]
        for sample in graph.samples:
            inputs = flat_io.sample_inputs(sample.clone())
            if [list(t.shape) for t in inputs] != example_shapes and self._accepted.rejects_tensors(inputs) is None:
                return inputs
        return plan.example

    # ---- inference
    def rejects(self, leaves: list) -> str | None:
        """Why the artifact cannot take the call: tensor dtypes, device and ranks as built, every axis inside
        the recorded/declared range that export kept (``build_info["accepted_ranges"]``), batch axes agreeing."""
        return self._accepted.rejects(leaves)

    def _infer(self, args, kwargs):
        inputs = [tensor.contiguous() for tensor in self._io.inputs(args, kwargs)]
        with torch.no_grad():
            outputs = self._runner(*inputs)
        return self._io.outputs(outputs)

    def _activate(self) -> None:
        if self._runner is None:
            self._runner = load_package(self._package_path, self.device)

    def _deactivate(self) -> None:
        self._runner = None  # frees the loaded library's weights; activate() reloads model.pt2

    # ---- checkpoints
    def _save(self, directory: Path) -> dict:
        target = directory / PACKAGE_FILE
        if self._package_path.resolve() != target.resolve():
            shutil.copyfile(self._package_path, target)
        return {**self._metadata(), "package": PACKAGE_FILE}

    def _metadata(self) -> dict:
        """What :meth:`_save` stores; the package's name is relative to its folder."""
        return {
            "package": self._package_path.name,
            "device": str(self.device),
            "inputs": [entry.to_json() for entry in self._accepted.inputs],
            "input_names": list(self._io.input_names),
            "batch_axes": [list(axis) for axis in self._accepted.batch_axes],
            "device_type": self._accepted.device_type,
            "outputs": outputs_to_json(self._io.output_spec, self._io.output_constants, self._io.output_is_tensor,
                                       self._io.output_dtypes),
            "build_info": {key: value for key, value in self.build_info.items()
                           if key in ("specialized_axes", "accepted_ranges", "export_batch_repeated", "batch_range")},
        }

    def artifact(self) -> DeploymentArtifact:
        """The ``.pt2`` package this backend runs, in the build or extraction folder."""
        require_built(self)
        return self.artifact_from_metadata(self._metadata(), self._package_path.parent, self.config.to_dict(),
                                           GraphFacts.of(self.graph, self.device))

    @classmethod
    def artifact_from_metadata(cls, metadata: dict, directory: Path, config: dict, graph) -> DeploymentArtifact:
        return pt2_artifact(metadata, directory, graph, cls.name)

    def _load(self, directory: Path, metadata: dict, module, graph, device: torch.device) -> None:
        package_path = self._stored_file(directory, metadata, "package", PACKAGE_FILE)
        self._accepted = AcceptedInputs.from_json({"inputs": metadata["inputs"],
                                                   "batch_axes": metadata.get("batch_axes", []),
                                                   "device_type": metadata.get("device_type", device.type)})
        template = output_template_from_json(metadata["outputs"], getattr(graph, "output_spec", None))
        io_graph = graph if graph is not None and getattr(graph, "tensor_specs", None) else _StoredInputs(
            [_StoredTensorSpec(entry.leaf_index, name)
             for entry, name in zip(self._accepted.inputs,
                                    metadata.get("input_names", [""] * len(self._accepted.inputs)))])
        self._io = FlatIO(io_graph, template)
        self._package_path = package_path
        self.build_info.update(metadata.get("build_info", {}))
        self._runner = load_package(package_path, device)
