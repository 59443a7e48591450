"""TorchInductorAotBackend: ``torch.export`` + AOTInductor, a self-contained ``model.pt2`` package.

Build steps (the backend contract: :mod:`aitune.torch.backend.base`; child processes:
:mod:`aitune.torch.backend.isolation`; reference: ``torch._inductor.aoti_compile_and_package`` /
``aoti_load_package``, PyTorch "AOTInductor" tutorial):

1. Parent: ``torch.export.export`` of the graph's :class:`~aitune.torch.backend.flat.FlatModule` with one
   shared ``Dim("batch")`` for every batch axis (derived ``k * batch`` for axes of size ``k * batch``),
   named ``Dim``s for user-declared :class:`~aitune.torch.record.samples.DynamicDim` axes and bounded ``Dim.AUTO``
   for other recorded dynamic axes. The ExportedProgram is saved with ``torch.export.save``.
2. Child process (:func:`aitune.torch.backend.isolation.run_isolated`): load it, ``aoti_compile_and_package`` to
   ``model.pt2``, load the package and run it once on a sample saved as safetensors, compare the output
   shapes and dtypes with eager. A segfault, abort or hang there fails the build with its reason.
3. Parent: only then loads the package itself.

NOTE [batch 1 and export]: ``torch.export`` specialises sizes 0 and 1 (pytorch/pytorch#133653):
an example with batch 1 pins the batch axis to 1. The export example therefore has batch >= 2: a recorded
sample with batch >= 2 when there is one, else the sample repeated along its batch axes. After export the
input placeholders are inspected: an axis that export specialised anyway, or whose range it narrowed, is
recorded in ``build_info["specialized_axes"]`` / ``build_info["accepted_ranges"]`` and :meth:`accepts`
takes only those sizes, so other shapes run eager instead of a wrong artifact.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import logging
import math
import shutil
import time
from pathlib import Path
from typing import Any, ClassVar

import torch

from aitune.errors import BackendBuildError, CheckpointError, ConfigError, IsolatedStepError
from aitune.torch.backend.base import Backend, BackendConfig, BuildMode, Check
from aitune.torch.common.requirements import torch_version_at_least
from aitune.torch.backend.accepted import AcceptedInputs, batch_axes
from aitune.torch.backend.flat import FlatIO, eager_output
from aitune.torch.common.dtypes import dtype_name
from aitune.torch.common.environment import environment_id
from aitune.torch.common.files import checkpoint_path
from aitune.torch.record.samples import BATCH, STATIC
from aitune.torch.record.serialization import output_template_from_json, outputs_to_json

logger = logging.getLogger(__name__)

MIN_TORCH_VERSION = "2.6"
PACKAGE_FILE = "model.pt2"
EXPORTED_FILE = "exported_program.pt2"
CHECK_SAMPLE_FILE = "check_sample.safetensors"
CHILD_LOG_FILE = "aoti_compile.log"


@dataclasses.dataclass(kw_only=True)
class TorchInductorAotBackendConfig(BackendConfig):
    """Config of :class:`TorchInductorAotBackend`.

    Args:
        inductor_configs: ``torch._inductor.config`` options for ``aoti_compile_and_package``
            (e.g. ``{"max_autotune": True}``); keys must exist in ``torch._inductor.config`` and values must
            be JSON-able (they travel to the compile process as JSON; tuples arrive as lists).
        build_timeout_s: wall-clock limit of the compile-and-check child process, seconds (> 0).
        isolate: run compile and first load in a child process (recommended: a crash there, such as a
            SIGSEGV of ``aoti_load_package`` (NOTE [AOTInductor canary]), becomes a failed build instead of killing
            the tuning run). False runs them in this process.

    Raises:
        ConfigError: on an unknown Inductor option, a non-JSON-able value, or a non-positive timeout.
    """

    inductor_configs: dict | None = None
    build_timeout_s: float = 900.0
    isolate: bool = True

    def validate(self) -> None:
        if self.inductor_configs is not None:
            if not isinstance(self.inductor_configs, dict):
                raise ConfigError("inductor_configs must be a dict of torch._inductor.config options, got "
                                  f"{type(self.inductor_configs).__name__}")
            if self.inductor_configs:
                _check_inductor_options(self.inductor_configs)
        timeout = self.build_timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not math.isfinite(timeout) \
                or timeout <= 0:
            raise ConfigError(f"build_timeout_s must be a finite number of seconds > 0, got {timeout!r}")
        if not isinstance(self.isolate, bool):
            raise ConfigError(f"isolate must be a bool, got {self.isolate!r}")


def _check_inductor_options(options: dict) -> None:
    import torch._inductor.config as inductor_config  # ~1 s import: only when options are given

    known = set(inductor_config._config)  # every option of the config module, dotted names
    for key, value in options.items():
        if not isinstance(key, str):
            raise ConfigError(f"inductor_configs keys must be option names (str), got {key!r}")
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise ConfigError(f"inductor_configs: {key!r} is not a torch._inductor.config option{hint}")
        try:
            json.dumps(value)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"inductor_configs[{key!r}] = {value!r} is not JSON-able; the compile runs in a "
                              "child process and receives options as JSON") from exc


# --------------------------------------------------------------------------------------------- child step


def compile_and_check_package(exported_path: str, package_path: str, sample_path: str,
                              expected_outputs: list[dict], inductor_configs: dict | None, device: str) -> dict:
    """Compile an ExportedProgram with AOTInductor, load the package and run it once (the isolated step).

    Runs in a child process started by :func:`aitune.torch.backend.isolation.run_isolated`, and exchanges only files.

    Args:
        exported_path: file written by ``torch.export.save``.
        package_path: where ``aoti_compile_and_package`` writes the ``.pt2`` package.
        sample_path: safetensors file with the flat inputs ``input_0 ... input_<n-1>`` (CPU tensors).
        expected_outputs: eager's flat outputs on that sample, ``[{"shape": [...], "dtype": "float32"}, ...]``.
        inductor_configs: ``torch._inductor.config`` options, or None.
        device: ``"cpu"`` or ``"cuda:<index>"``.

    Returns:
        ``{"compile_s": float, "load_s": float, "run_s": float, "package_bytes": int, "output_shapes": [...]}``.

    Raises:
        RuntimeError: if the package's outputs differ in number, shape or dtype from eager's.
    """
    from safetensors.torch import load_file

    started = time.perf_counter()
    loads_here(device, Path(package_path).parent)
    exported = torch.export.load(exported_path)
    torch._inductor.aoti_compile_and_package(exported, package_path=package_path,
                                             inductor_configs=inductor_configs or None)
    compiled = time.perf_counter()
    logger.info("AOTInductor package written to %s in %.1f s", package_path, compiled - started)
    runner = load_package(package_path, torch.device(device))
    loaded = time.perf_counter()
    tensors = load_file(sample_path)
    inputs = [tensors[f"input_{index}"].to(device) for index in range(len(tensors))]
    with torch.no_grad():
        outputs = list(runner(*inputs))
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
    ran = time.perf_counter()
    check_outputs(outputs, expected_outputs)
    logger.info("package loaded in %.2f s and ran once in %.3f s; output shapes match eager",
                loaded - compiled, ran - loaded)
    return {"compile_s": compiled - started, "load_s": loaded - compiled, "run_s": ran - loaded,
            "package_bytes": Path(package_path).stat().st_size,
            "output_shapes": [list(output.shape) for output in outputs]}


class _Canary(torch.nn.Module):
    def forward(self, x):
        return x * 2 + 1


def loads_here(device: str, folder: Path) -> None:
    """NOTE [AOTInductor canary]: in some environments loading *any* AOTInductor package kills the process
    (a SIGSEGV in ``aoti_load_package``, for CPU and CUDA packages alike, even for a one-op
    model), after a compile that takes a minute for a real model. The child step therefore first compiles and
    loads a one-op package on ``device``: if this environment crashes, it crashes here, early, and the crash is
    remembered (:mod:`aitune.torch.search.crashes`). Once a canary loaded on a device in this environment (a marker file
    in the user's cache), later builds skip it. A CPU canary ahead of a CUDA one was tried and dropped: the
    first C++ compile on a fresh machine can take a minute even for one op (later ones seconds;
    ``benchmarks/aoti_canary_time.py`` measures it), so it made the crash come later, not sooner.

    Raises:
        RuntimeError: if the canary package loads but returns a wrong result.
    """
    _canary(device, folder)


def _canary(device: str, folder: Path) -> None:
    import os

    # A fact about the environment, not about a tune: kept in the user's cache, whatever AITUNE_CACHE_DIR says.
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    marker = base / "aitune" / "aoti_canary" / f"{environment_id(device)}.ok"
    if marker.exists():
        return
    logger.info("compiling and loading a one-op AOTInductor package on %s (canary: does any package load here?)",
                device)
    started = time.perf_counter()
    example = torch.ones(2, 4, device=device)
    exported = torch.export.export(_Canary().to(device), (example,))
    package = folder / f"canary_{torch.device(device).type}.pt2"
    torch._inductor.aoti_compile_and_package(exported, package_path=str(package))
    output = load_package(package, torch.device(device))(example)
    if not torch.equal(output.cpu() if isinstance(output, torch.Tensor) else output[0].cpu(), torch.full((2, 4), 3.0)):
        raise RuntimeError(f"the AOTInductor canary package on {device} returned a wrong result")
    package.unlink(missing_ok=True)
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.touch()
    logger.info("an AOTInductor package loads on %s in this environment (canary, %.1f s); marker %s", device,
                time.perf_counter() - started, marker)


def check_outputs(outputs: list, expected_outputs: list[dict]) -> None:
    """Raise RuntimeError naming the first output whose count, shape or dtype differs from ``expected``."""
    if len(outputs) != len(expected_outputs):
        raise RuntimeError(f"the AOTInductor package returned {len(outputs)} outputs, eager returns "
                           f"{len(expected_outputs)}")
    for index, (output, expected) in enumerate(zip(outputs, expected_outputs)):
        if not isinstance(output, torch.Tensor):
            raise RuntimeError(f"output {index} of the AOTInductor package is {type(output).__name__}, not a tensor")
        if list(output.shape) != expected["shape"] or dtype_name(output.dtype) != expected["dtype"]:
            raise RuntimeError(f"output {index} of the AOTInductor package is {dtype_name(output.dtype)}"
                               f"{list(output.shape)}, eager gives {expected['dtype']}{expected['shape']}")


def load_package(package_path: str | Path, device: torch.device):
    """``torch._inductor.aoti_load_package`` on ``device`` (the CUDA device index, or -1 for CPU)."""
    device_index = -1
    if device.type == "cuda":
        device_index = device.index if device.index is not None else torch.cuda.current_device()
    return torch._inductor.aoti_load_package(str(package_path), device_index=device_index)


# --------------------------------------------------------------------------------------------- export plan


@dataclasses.dataclass
class _ExportPlan:
    """Example inputs and ``dynamic_shapes`` for ``torch.export`` of the flat module."""

    example: list[torch.Tensor]
    dynamic_shapes: list[dict]
    repeated_batch: int | None  # a batch-1 sample repeated to this batch (pytorch/pytorch#133653), else None
    batch_range: tuple[int, int] | None


def _batch_range(graph, batch_axes) -> tuple[int, int] | None:
    if not batch_axes:
        return None
    low, high = 0, math.inf
    for index, axis, multiplier in batch_axes:
        spec_low, _, spec_high = graph.shape_range(graph.tensor_specs[index])
        low = max(low, math.ceil(spec_low[axis] / multiplier))
        high = min(high, spec_high[axis] // multiplier)
    return int(low), int(high)


def _export_plan(graph, flat_io: FlatIO, use_auto: bool) -> _ExportPlan:
    """Choose the export example (batch >= 2, NOTE [batch 1 and export]) and build ``dynamic_shapes``."""
    from torch.export import Dim

    graph_batch_axes = batch_axes(graph)
    batch_range = _batch_range(graph, graph_batch_axes)
    batch_dim = None
    if batch_range is not None and not use_auto:
        # NOTE [export max 2]: with torch 2.13, a program exported with Dim(min=1, max=2), saved and loaded
        # (the child compiles the saved program) compiled into a package that indexes out of bounds or returns
        # batch 2 at batch 1 (an Embedding model at the reference's default batch_sizes [1, 2]). max=3 does
        # not; the artifact still accepts only the recorded range
        # (_accepted_ranges), so the wider export bound changes no routing.
        export_max = 3 if batch_range[1] == 2 and batch_range[0] < 2 else batch_range[1]
        batch_dim = Dim("batch", min=batch_range[0], max=export_max)

    def sizes_ok(sample) -> bool:  # every dynamic axis >= 2, so export does not specialise it
        inputs = flat_io.sample_inputs(sample)
        return all(inputs[index].shape[axis] >= 2 for index, spec in enumerate(graph.tensor_specs)
                   for axis in spec.dynamic_axes)

    candidates = [s for s in graph.samples if sizes_ok(s)]
    sample = min(candidates, key=lambda s: s.batch_size or 0) if candidates else graph.samples[0]
    example = [tensor.detach().clone() for tensor in flat_io.sample_inputs(sample.clone())]
    repeated_batch = None
    if not candidates and graph_batch_axes and batch_range[1] >= 2:
        index, axis, multiplier = graph_batch_axes[0]
        batch = example[index].shape[axis] // multiplier
        if batch == 1:  # NOTE [batch 1 and export]: repeat the sample along its batch axes to batch 2
            repeated_batch = 2
            for index, axis, multiplier in graph_batch_axes:
                example[index] = torch.cat([example[index]] * 2, dim=axis)

    named_dims: dict[str, Any] = {}
    dynamic_shapes: list[dict] = []
    for index, spec in enumerate(graph.tensor_specs):
        low, _, high = graph.shape_range(spec)
        axes: dict[int, Any] = {}
        for axis, kind in enumerate(spec.axes):
            if kind == STATIC:
                continue
            declared = spec.dims[axis]
            if kind == BATCH and batch_dim is not None:
                multiplier = 1 if math.isnan(spec.multipliers[axis]) else int(spec.multipliers[axis])
                axes[axis] = batch_dim if multiplier == 1 else multiplier * batch_dim
            elif declared is not None and not use_auto:
                if declared.name not in named_dims:
                    named_dims[declared.name] = Dim(_identifier(declared.name), min=declared.min, max=declared.max)
                axes[axis] = named_dims[declared.name]
            else:
                axes[axis] = Dim.AUTO(min=low[axis], max=high[axis])
        dynamic_shapes.append(axes)
    return _ExportPlan(example, dynamic_shapes, repeated_batch, batch_range)


def _identifier(name: str) -> str:
    text = "".join(ch if ch.isalnum() else "_" for ch in name)
    return text if text and not text[0].isdigit() else f"d_{text}"


def _export(flat_module: torch.nn.Module, plan: _ExportPlan):
    return torch.export.export(flat_module, tuple(plan.example), dynamic_shapes=(tuple(plan.dynamic_shapes),))


def _accepted_ranges(exported, graph) -> tuple[list[dict], list[str]]:
    """Per tensor input: sizes :meth:`accepts` takes (graph range intersected with what export kept).

    Returns ``(ranges, notes)``; ``ranges[i] = {"low": [...], "high": [...]}``, notes name every axis export
    specialised or narrowed.
    """
    user_inputs = list(exported.graph_signature.user_inputs)
    placeholders = {node.name: node for node in exported.graph.nodes if node.op == "placeholder"}
    ranges, notes = [], []
    for index, spec in enumerate(graph.tensor_specs):
        low, _, high = graph.shape_range(spec)
        low, high = list(low), list(high)
        node = placeholders.get(user_inputs[index]) if index < len(user_inputs) else None
        value = node.meta.get("val") if node is not None else None
        if value is not None:
            for axis in spec.dynamic_axes:
                size = value.shape[axis]
                if not isinstance(size, torch.SymInt):
                    low[axis] = high[axis] = int(size)
                    notes.append(f"{spec.path} axis {axis} specialised to {int(size)} by torch.export")
                    continue
                bounds = exported.range_constraints.get(size.node.expr)
                if bounds is None:
                    continue
                new_low = max(low[axis], _bound(bounds.lower, low[axis]))
                new_high = min(high[axis], _bound(bounds.upper, high[axis]))
                if (new_low, new_high) != (low[axis], high[axis]):
                    notes.append(f"{spec.path} axis {axis} limited to [{new_low}, {new_high}] by torch.export "
                                 f"(recorded [{low[axis]}, {high[axis]}])")
                low[axis], high[axis] = new_low, new_high
        ranges.append({"low": low, "high": high})
    return ranges, notes


def _bound(value, default: int) -> int:
    try:
        return int(value)
    except (TypeError, ValueError, OverflowError):  # sympy oo / int_oo
        return default


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
    at batch >= 2 (NOTE [batch 1 and export] in this module). :meth:`accepts` takes only shapes
    inside the recorded/declared ranges that export kept; the caller runs eager for the others.
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
    # The isolated compile step; a class attribute so tests can point it at a step that crashes for real.
    compile_step: ClassVar[str] = f"{__name__}:compile_and_check_package"

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
        ranges, notes = _accepted_ranges(exported, graph)
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
            from aitune.torch.backend.isolation import submit_isolated

            # NOTE [background builds]: with an executor set, the child compile runs while other candidates
            # are evaluated; finish_build() waits for it.
            self._pending = submit_isolated(self.compile_step, step_kwargs, timeout_s=self.config.build_timeout_s,
                                            log_path=workdir / CHILD_LOG_FILE)
            if self._pending is None:
                self._finish_compile(lambda: self._run_compile_step(step_kwargs))
        else:
            from aitune.torch.backend.isolation import resolve_target

            self._finish_compile(lambda: resolve_target(self.compile_step)(**step_kwargs))

    def _run_compile_step(self, step_kwargs: dict) -> dict:
        from aitune.torch.backend.isolation import run_isolated

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
        plan = _export_plan(graph, flat_io, use_auto=False)
        started = time.perf_counter()
        try:
            exported = _export(flat_module, plan)
        except Exception as exc:  # noqa: BLE001 - a constraint violation of our named dims: let export infer
            if not _is_constraint_violation(exc):
                raise
            logger.warning("%s: torch.export rejected the declared dims (%s); retrying with Dim.AUTO on every "
                           "dynamic axis", self.name, str(exc).splitlines()[0])
            self.build_info["export_retry"] = f"named dims rejected: {str(exc).splitlines()[0][:200]}"
            plan = _export_plan(graph, flat_io, use_auto=True)
            exported = _export(flat_module, plan)
        self.build_info["export_s"] = time.perf_counter() - started
        return exported, plan

    def _check_inputs(self, graph, flat_io: FlatIO, plan: _ExportPlan) -> list[torch.Tensor]:
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
        return {
            "package": PACKAGE_FILE,
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

    def _load(self, directory: Path, metadata: dict, module, graph, device: torch.device) -> None:
        package = metadata.get("package", PACKAGE_FILE)
        package_path = checkpoint_path(directory, package, f"{self.name} metadata 'package'", missing=CheckpointError(
            f"{self.name}: {Path(directory) / str(package)} is missing from the checkpoint"))
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


def _is_constraint_violation(exc: BaseException) -> bool:
    text = f"{type(exc).__name__}: {exc}"
    return "Constraints violated" in text or "ConstraintViolation" in text or "constraint violation" in text.lower()
