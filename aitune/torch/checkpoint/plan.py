"""The first step of ``ait.load``: decide, per module and graph, what will be restored where — and refuse
what cannot work — before anything touches the user's object (see NOTE [checkpoint devices] in
:mod:`aitune.torch.checkpoint`)."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import torch

from aitune import __version__
from aitune.errors import AITuneError, CheckpointError, CheckpointIntegrityError, CheckpointVersionError
from aitune.torch.backend.base import BuildMode, get_backend_class
from aitune.torch.common.files import check_member_name
from aitune.torch.checkpoint.manifest import check_state, graph_tolerance
from aitune.torch.checkpoint.wrappers import path_text, resolve_path
from aitune.torch.check.correctness import Tolerance
from aitune.torch.common.environment import device_facts
from aitune.torch.common.requirements import installed_version
from aitune.torch.module import Module

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class GraphPlan:
    """How one graph is restored: its manifest entry, backend class and config, device and tolerance."""

    entry: dict
    backend_class: type
    config: Any
    device: torch.device
    tolerance: Tolerance
    rebuild_as_eager: str | None = None  # reason, when a JIT backend cannot run on the target device


@dataclasses.dataclass
class ModulePlan:
    """How one module is restored: where it sits (``parent``, ``target``), its device and graphs; filled
    with the restored ``dispatch`` (graph key -> (GraphSpec, Backend)), the eager-fallback verdict and, with
    ``weights="module"``, why the artifacts are stale."""

    entry: dict
    name: str
    parent: Any
    target: Any  # the wrapper, or the plain nn.Module that will be wrapped
    device: torch.device
    graphs: list[GraphPlan]
    dispatch: dict = dataclasses.field(default_factory=dict)
    eager_fallback_error: str | None = None
    stale_reason: str | None = None  # weights="module": the artifacts carry other weights than the module's

    @property
    def module(self) -> torch.nn.Module:
        """The plain module (the wrapper's wrapped module when the target is already wrapped)."""
        return self.target.module if isinstance(self.target, Module) else self.target


def plan_module(root: Any, entry: dict, verified: set[str], device) -> ModulePlan:
    """Resolve everything that can fail before touching the user's object: files, path, backends, device.

    Raises:
        CheckpointIntegrityError / CheckpointError: as :func:`aitune.torch.load`.
    """
    path = entry.get("path")
    if not isinstance(path, list) or not all(isinstance(s, list) and len(s) == 2 for s in path):
        raise CheckpointError(f"malformed module path {path!r} in the checkpoint")
    parent, target = resolve_path(root, path)
    name = entry.get("name", "?")
    if not isinstance(target, torch.nn.Module):
        raise CheckpointError(f"the checkpoint has the tuned module {name!r} at {path_text(path)}, but there "
                              f"{type(root).__name__} holds a {type(target).__name__}, not an nn.Module")
    module = target.module if isinstance(target, Module) else target
    if not isinstance(target, Module) and isinstance(parent, tuple):
        raise CheckpointError(f"{name!r} at {path_text(path)} is an entry of a tuple, which cannot be replaced by its "
                              "wrapper; hold the module in a list, dict or attribute, or wrap it before load")
    check_state(entry, module, f"module {name!r} at {path_text(path)}")
    graphs_entries = entry.get("graphs") or []
    _check_files_present(entry, verified)
    needs_weights = any(g.get("build_mode") == BuildMode.JIT.value for g in graphs_entries)
    if needs_weights and not entry.get("weights"):
        raise CheckpointIntegrityError(f"module {name!r} has JIT graphs but the checkpoint stores no weights for it")
    module_device = _parameter_device(module)
    target_device = _target_device(device, graphs_entries, module_device if needs_weights else None)
    if needs_weights and module_device is not None and module_device.type != "meta" and not _same_device(
            module_device, target_device):
        raise CheckpointError(
            f"module {name!r}: its parameters are on {module_device} but it is loaded for {target_device}; its JIT "
            f"backend(s) run the module itself, so move it first (model.to('{target_device}')) or pass "
            f"device='{module_device}' (aitune never moves your module)")
    plans = [_plan_graph(name, graph_entry, target_device) for graph_entry in graphs_entries]
    return ModulePlan(entry, name, parent, target, target_device, plans)


def _plan_graph(module_name: str, graph_entry: dict, target_device: torch.device) -> GraphPlan:
    backend_name = graph_entry.get("backend")
    where = f"{module_name}/{graph_entry.get('name')}"
    try:
        backend_class = get_backend_class(backend_name)
    except AITuneError as exc:
        raise CheckpointError(f"{where}: {exc}") from exc
    available = backend_class.availability()
    build_mode = graph_entry.get("build_mode")
    saved_facts = graph_entry.get("device_facts") or {"type": torch.device(graph_entry.get("device", "cpu")).type}
    if build_mode == BuildMode.AOT.value:
        _check_aot_device(where, backend_name, saved_facts, target_device)
        if not available.ok:
            raise CheckpointError(f"{where} uses backend '{backend_name}', unavailable here: {available.reason}")
    try:
        config = backend_class.config_class.from_dict(graph_entry.get("config") or {})
    except CheckpointVersionError as exc:
        raise CheckpointVersionError(f"{where}: the stored config of backend '{backend_name}': {exc}") from exc
    except AITuneError as exc:
        raise CheckpointError(f"{where}: the stored config of backend '{backend_name}' is invalid here: {exc}") from exc
    plan = GraphPlan(graph_entry, backend_class, config, target_device, graph_tolerance(graph_entry, where))
    if build_mode != BuildMode.AOT.value:
        if not available.ok:
            plan.rebuild_as_eager = f"backend '{backend_name}' is unavailable here ({available.reason})"
        elif target_device.type not in backend_class.device_types:
            plan.rebuild_as_eager = f"backend '{backend_name}' does not run on {target_device.type}"
    return plan


def _check_files_present(entry: dict, verified: set[str]) -> None:
    """Every file the manifest names must be in the archive (and so verified) before anything is read."""
    name = entry.get("name", "?")
    if entry.get("weights") and entry["weights"] not in verified:
        raise CheckpointIntegrityError(f"the weights of module {name!r} ({entry['weights']}) are missing from the "
                                       "checkpoint; it is incomplete — save it again")
    for graph in entry.get("graphs") or []:
        where = f"{name}/{graph.get('name')}"
        samples = (graph.get("samples") or {}).get("file")
        if samples not in verified:
            raise CheckpointIntegrityError(f"{where}: the recorded samples ({samples}) are missing from the checkpoint; "
                                           "it is incomplete — save it again")
        for artifact in graph.get("artifacts") or []:
            member = f"{graph.get('artifacts_dir')}/{artifact}"
            check_member_name(member)
            if member not in verified:
                raise CheckpointIntegrityError(
                    f"{where}: artifact {artifact!r} of backend '{graph.get('backend')}' ({member}) is missing from "
                    "the checkpoint; it is incomplete — save it again")


def _same_device(a: torch.device, b: torch.device) -> bool:
    if a.type != b.type:
        return False
    if a.type != "cuda":
        return True
    index_a = a.index if a.index is not None else torch.cuda.current_device()
    index_b = b.index if b.index is not None else torch.cuda.current_device()
    return index_a == index_b


def _parameter_device(module: torch.nn.Module) -> torch.device | None:
    for tensor in module.parameters():
        return tensor.device
    for tensor in module.buffers():
        return tensor.device
    return None


def _target_device(device, graph_entries: list, module_device: torch.device | None) -> torch.device:
    if device is not None:
        try:
            target = torch.device(device)
        except (RuntimeError, TypeError) as exc:
            raise CheckpointError(f"device {device!r} is not a torch device (use 'cpu' or 'cuda:0')") from exc
    elif module_device is not None and module_device.type != "meta":
        target = module_device
    else:
        saved = torch.device(graph_entries[0].get("device", "cpu")) if graph_entries else torch.device("cpu")
        if saved.type == "cuda" and torch.cuda.is_available():
            index = saved.index if saved.index is not None and saved.index < torch.cuda.device_count() else 0
            target = torch.device("cuda", index)
        elif saved.type == "cpu":
            target = saved
        else:
            target = torch.device("cpu")
    if target.type == "cuda":
        if not torch.cuda.is_available():
            raise CheckpointError(f"device {target} requested but CUDA is not available here")
        if target.index is None:
            target = torch.device("cuda", torch.cuda.current_device())
    return target


def _check_aot_device(where: str, backend: str, saved: dict, target: torch.device) -> None:
    saved_type = saved.get("type", "cpu")
    if saved_type != target.type:
        raise CheckpointError(
            f"{where} uses the AOT backend '{backend}', whose artifact was built for {saved_type}"
            f"{' (' + saved['name'] + ')' if saved.get('name') else ''}; it cannot run on {target.type}. Load it on "
            f"a {saved_type} device (device='{saved_type}') or re-tune here")
    if target.type == "cuda" and saved.get("capability"):
        here = list(torch.cuda.get_device_capability(target))
        if list(saved["capability"]) != here:
            raise CheckpointError(
                f"{where} uses the AOT backend '{backend}', built for GPU architecture "
                f"sm_{''.join(map(str, saved['capability']))} ({saved.get('name')}); this GPU "
                f"({torch.cuda.get_device_name(target)}) is sm_{''.join(map(str, here))}. "
                "Compiled artifacts do not carry over between architectures: re-tune on this GPU")


def warn_differences(manifest: dict, plans: list[ModulePlan], path: Path) -> None:
    """One warning listing what differs from where the checkpoint was saved (versions, devices, packages)."""
    differences = []
    saved_versions = manifest.get("versions", {})
    for key, here in (("torch", torch.__version__), ("aitune", __version__), ("cuda", torch.version.cuda)):
        if saved_versions.get(key) != here:
            differences.append(f"{key} {saved_versions.get(key)} -> {here}")
    for plan in plans:
        for graph_plan in plan.graphs:
            graph = graph_plan.entry
            saved = graph.get("device_facts") or {}
            here = device_facts(graph_plan.device)
            where = f"{plan.name}/{graph.get('name')}"
            if saved.get("type") != here["type"]:
                differences.append(f"{where} was tuned on {saved.get('type')} and is rebuilt on {here['type']} "
                                   f"({graph.get('backend')}); its backend choice was measured on {saved.get('type')}")
            elif saved.get("name") != here.get("name"):
                differences.append(f"{where}: device {saved.get('name')!r} -> {here.get('name')!r}")
            packages = {} if graph_plan.rebuild_as_eager else graph.get("packages") or {}  # (eager needs none)
            for package, version in packages.items():
                now = installed_version(package)
                if now != version:
                    differences.append(f"{where}: {package} {version} -> {now}")
            if graph_plan.rebuild_as_eager:
                differences.append(f"{where}: {graph_plan.rebuild_as_eager}; it runs eager")
    if differences:
        logger.warning("aitune.load: %s was saved in a different environment: %s. Figures in the checkpoint may not "
                       "hold here; re-tune for the best choice", path, "; ".join(dict.fromkeys(differences)))
