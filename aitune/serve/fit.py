"""Does a checkpoint fit this replica's machine? Read before loading, so a replica says every reason at start.

``ait.load`` makes the same checks while it loads and stays the authority (it raises on an AOT artifact for
another device type or GPU architecture and on an AOT backend whose package is missing, and runs a JIT graph
whose backend is missing eagerly). Reading them first from ``manifest.json`` lets a replica list all of them
at once and choose, by ``ServeConfig.on_mismatch``, between refusing and serving eagerly.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from aitune.errors import AITuneError, CheckpointError
from aitune.torch.backend import get_backend_class
from aitune.torch.checkpoint.manifest import MANIFEST
from aitune.torch.checkpoint.manifest import read_manifest as checkpoint_manifest



@dataclasses.dataclass(frozen=True)
class FitProblem:
    """One reason a checkpoint's graph cannot run as tuned on this machine.

    Attributes:
        where: ``module/graph``. reason: one line. build_mode: ``"aot"`` (``ait.load`` refuses it) or ``"jit"``
            (``ait.load`` runs that graph eagerly), or ``"device"`` (the requested device does not exist here).
    """

    where: str
    reason: str
    build_mode: str

    def __str__(self) -> str:
        return f"{self.where}: {self.reason}"


def read_manifest(path: str | Path) -> dict:
    """``manifest.json`` of an ``.ait`` file, parsed (not verified: :func:`aitune.torch.load` verifies later).

    Raises:
        CheckpointError: the file is missing, is not a zip, or has no readable manifest (CheckpointIntegrityError);
            CheckpointVersionError: a newer checkpoint format.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist here (cwd {Path.cwd()}); every node reads it at this "
                              "path unless it is shipped in the job's runtime_env (aitune serve --ship-checkpoint)")
    manifest, _ = checkpoint_manifest(path, verify=False)  # not a zip, no manifest, newer format: raises there
    if not isinstance(manifest.get("modules"), list):
        raise CheckpointError(f"{path}: {MANIFEST} has no list of modules; not an aitune checkpoint")
    return manifest


def served_module_entry(manifest: dict, module: str | None) -> dict:
    """The manifest entry of the tuned module whose inputs requests carry.

    Args:
        manifest: from :func:`read_manifest`.
        module: a tuned module's name, or None for the module saved at the root of the saved object.

    Raises:
        CheckpointError: no such module; the message lists the modules and their paths.
    """
    modules = manifest["modules"]
    listed = ", ".join(f"{m.get('name')!r} at {m.get('path_text', m.get('path'))}" for m in modules)
    for entry in modules:
        if (module is None and entry.get("path") == []) or (module is not None and entry.get("name") == module):
            return entry
    if module is None:
        raise CheckpointError(f"the checkpoint's tuned modules ({listed}) are not the saved object itself; set "
                              "module=NAME (--module) to the tuned module whose inputs requests carry")
    raise CheckpointError(f"the checkpoint has no tuned module named {module!r}; it has {listed}")


def fit_problems(manifest: dict, device: torch.device) -> list[FitProblem]:
    """Why the checkpoint's graphs cannot run as tuned on ``device`` here; empty when they all can.

    Checks, per graph, what ``ait.load`` checks: the backend is registered and its packages are importable
    (``Backend.availability``); an AOT artifact was built for this device type and, on CUDA, this compute
    capability; a JIT backend runs on this device type. And that the device exists.
    """
    device = torch.device(device)
    problems: list[FitProblem] = []
    if device.type == "cuda" and not torch.cuda.is_available():
        problems.append(FitProblem("device", f"device {device} requested but torch sees no CUDA device here "
                                             f"(torch {torch.__version__}, CUDA build {torch.version.cuda})", "device"))
        return problems
    for module in manifest["modules"]:
        for graph in module.get("graphs") or []:
            where = f"{module.get('name')}/{graph.get('name')}"
            backend_name = graph.get("backend")
            build_mode = graph.get("build_mode", "aot")
            try:
                backend_class = get_backend_class(backend_name)
            except AITuneError as exc:
                problems.append(FitProblem(where, str(exc), "aot"))
                continue
            available = backend_class.availability()
            if not available.ok:
                problems.append(FitProblem(where, f"backend '{backend_name}' is unavailable here: {available.reason}",
                                           build_mode))
                continue
            saved = graph.get("device_facts") or {"type": torch.device(graph.get("device", "cpu")).type}
            if build_mode == "aot":
                if saved.get("type") != device.type:
                    problems.append(FitProblem(where, f"the '{backend_name}' artifact was built for {saved.get('type')}"
                                                      f"{_named(saved)}; this replica runs on {device.type}", "aot"))
                elif device.type == "cuda" and saved.get("capability"):
                    here = list(torch.cuda.get_device_capability(device))
                    if list(saved["capability"]) != here:
                        problems.append(FitProblem(
                            where, f"the '{backend_name}' artifact was built for sm_{''.join(map(str, saved['capability']))}"
                                   f"{_named(saved)}; this GPU ({torch.cuda.get_device_name(device)}) is "
                                   f"sm_{''.join(map(str, here))}", "aot"))
            elif device.type not in backend_class.device_types:
                problems.append(FitProblem(where, f"backend '{backend_name}' does not run on {device.type}", "jit"))
    return problems


def _named(facts: dict) -> str:
    return f" ({facts['name']})" if facts.get("name") else ""
