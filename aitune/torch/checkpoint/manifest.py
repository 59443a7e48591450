"""``manifest.json``: what a checkpoint holds, as JSON (format name and version, versions, device, modules).

Per tuned module: its path in the saved object, name, class, ``max_samples``, strategy, ``training``, weights
file and tied-weight aliases, or, for a module whose weights are not stored (AOT-only), the digest of the
weights its artifacts carry (``"weights_sha256"``, :func:`weights_digest`; None when it could not be taken).
Per graph: :meth:`GraphSpec.to_json <aitune.torch.record.samples.GraphSpec.to_json>`
plus the backend (name, class, build mode, config, description, metadata), device and device facts,
package versions, artifacts, output structure, samples file, the chosen backend's tune-report row and the
tolerance it was compared with eager under (``"tolerance"``, a ``Tolerance.to_dict``; absent before it was
stored: the default then applies).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import platform
from pathlib import Path
from typing import Any

import torch

from aitune import __version__
from aitune.errors import AITuneError, CheckpointError, CheckpointIntegrityError, CheckpointVersionError
from aitune.torch.backend.base import BuildMode
from aitune.torch.checkpoint.archive import read_unverified, read_verified
from aitune.torch.check.correctness import Tolerance
from aitune.torch.common.dtypes import dtype_name
from aitune.torch.common.environment import device_facts, environment
from aitune.torch.common.requirements import package_versions
from aitune.torch.common.jsonsafe import json_safe
from aitune.torch.record.onnx_module import OnnxModule
from aitune.torch.record.serialization import tree_spec_to_json
from aitune.torch.search.cache import hash_tensor

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
FORMAT_NAME = "aitune-checkpoint"
MANIFEST = "manifest.json"


# ============================================================================================ writing


def state_signature(module: torch.nn.Module) -> list[list]:
    """``[[name, shape, dtype], ...]`` of the module's ``state_dict`` tensors: what ``ait.load`` checks the
    target module against (stored for every module, also AOT-only ones whose weights are not stored)."""
    return [[name, list(value.shape), dtype_name(value.dtype)] for name, value in module.state_dict().items()
            if isinstance(value, torch.Tensor)]


def weights_digest(module: torch.nn.Module) -> str | None:
    """sha256 hex over the module's ``state_dict`` tensors (name, dtype, shape and bytes, in order) and the files of
    its :class:`~aitune.torch.OnnxModule` submodules (their ``sha256``): what
    ``ait.load`` compares the target module with for modules whose weights are not stored (AOT-only).

    Returns:
        The digest, or None when a tensor is on the ``meta`` device (no data to digest) or cannot be read as
        bytes (a sparse tensor, a tensor subclass): ``ait.load`` then compares outputs instead (NOTE [eager
        fallback after load] in :mod:`aitune.torch.checkpoint.load`).
    """
    hasher = hashlib.sha256()
    for name, sub in module.named_modules():  # an ONNX file's weights are in the file, not in the state_dict
        if isinstance(sub, OnnxModule):
            hasher.update(f"onnx file {name}|{sub.sha256}\n".encode())
    for name, value in module.state_dict().items():
        if not isinstance(value, torch.Tensor):
            continue
        if value.device.type == "meta" or value.layout != torch.strided or type(value) not in (
                torch.Tensor, torch.nn.Parameter):
            return None
        hasher.update(f"{name}|{dtype_name(value.dtype)}|{list(value.shape)}\n".encode())
        try:
            hash_tensor(hasher, value)
        except (RuntimeError, TypeError):  # a layout or storage hash_tensor cannot read
            return None
    return hasher.hexdigest()


def check_state(entry: dict, module: torch.nn.Module, where: str) -> None:
    """Refuse a target module of another class or with other state_dict keys, shapes or dtypes than saved.

    Raises:
        CheckpointError: naming the first difference (checkpoints that predate the stored signature are
            checked for the class only). Classes are compared by name: the same class imported from another
            module (a script's ``__main__``) loads with a warning.
    """
    saved_class = entry.get("class")
    current_class = f"{type(module).__module__}.{type(module).__qualname__}"
    if saved_class and saved_class != current_class:
        # The class's name decides; its module may differ (a script's __main__ vs the same class imported).
        if saved_class.rsplit(".", 1)[-1] != type(module).__qualname__.rsplit(".", 1)[-1]:
            raise CheckpointError(f"{where} was saved from a {saved_class} and cannot be loaded into a "
                                  f"{current_class}: construct the same model that was saved")
        logger.warning("aitune.load: %s was saved from %s and is loaded into %s (same class name, other module)",
                       where, saved_class, current_class)
    saved = entry.get("state")
    if saved is None:
        return
    current = state_signature(module)
    saved_names, current_names = [item[0] for item in saved], [item[0] for item in current]
    missing = [name for name in saved_names if name not in set(current_names)]
    if missing:
        raise CheckpointError(f"{where}: the module passed to load has no '{missing[0]}' (saved state_dict key"
                              f"{'s' if len(missing) > 1 else ''} {', '.join(missing[:3])}{'…' if len(missing) > 3 else ''}"
                              " missing); construct the same model that was saved")
    extra = [name for name in current_names if name not in set(saved_names)]
    if extra:
        raise CheckpointError(f"{where}: the module passed to load has '{extra[0]}', which the saved module did not "
                              "have; construct the same model that was saved")
    now = {item[0]: item for item in current}
    for name, shape, dtype in saved:
        _, current_shape, current_dtype = now[name]
        if current_shape != shape:
            raise CheckpointError(f"{where}: '{name}' has shape {current_shape} here but {shape} in the checkpoint; "
                                  "construct the same model (configuration) that was saved")
        if current_dtype != dtype:
            raise CheckpointError(f"{where}: '{name}' is {current_dtype} here but {dtype} in the checkpoint; convert "
                                  f"the model first (e.g. model.to(torch.{dtype}))")


def base_manifest(obj: Any) -> dict:
    """The manifest before any module is added: format, creation time, saved object's class, versions."""
    return {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "created_at": datetime.datetime.now().isoformat(timespec="seconds"),
        "saved_object": f"{type(obj).__module__}.{type(obj).__qualname__}",
        "versions": {"aitune": __version__, "torch": torch.__version__, "cuda": torch.version.cuda,
                     "python": platform.python_version()},
        "platform": environment().get("platform"),
        "device": None,
        "modules": [],
    }


def finish_manifest(manifest: dict) -> None:
    """Fill the top-level device (the first graph's) and the backends' package versions."""
    for module in manifest["modules"]:
        for graph in module["graphs"]:
            manifest["device"] = manifest["device"] or graph["device_facts"]
            for package, version in graph.get("packages", {}).items():
                manifest["versions"].setdefault(package, version)
    if manifest["device"] is None:
        manifest["device"] = device_facts("cpu")


def manifest_bytes(manifest: dict) -> bytes:
    """The manifest as written into the archive (indented JSON, no NaN)."""
    return json.dumps(manifest, indent=2, sort_keys=False, allow_nan=False).encode()


def graph_entry(graph, backend, module_name: str, *, base: str, metadata: dict, artifacts: list[str],
                samples: dict, tune_row: dict | None) -> dict:
    """The manifest entry of one tuned graph (see the module docstring).

    Args:
        graph: the :class:`~aitune.torch.record.samples.GraphSpec`. backend: its chosen backend.
        module_name: for error messages. base: the graph's folder in the archive (``modules/<m>/graphs/<g>``).
        metadata: what ``backend.save`` returned (plain JSON). artifacts: the files it wrote, relative posix.
        samples: the samples file entry (``{"file", "count", "batch_sizes"}``). tune_row: the chosen
            backend's tune-report row, or None.

    Raises:
        CheckpointError: an input constant or structure without a JSON form; an AOT graph whose output
            structure has none.
    """
    build_mode = BuildMode(backend.build_mode)
    data = graph.to_json(module_name)
    data.update({
        "name": graph.name,
        "backend": backend.name,
        "backend_class": f"{type(backend).__module__}.{type(backend).__qualname__}",
        "build_mode": build_mode.value,
        "config": backend.config.to_dict(),
        "description": backend.describe(),
        "metadata": metadata,
        "device": str(backend.device) if backend.device is not None else "cpu",
        "device_facts": device_facts(backend.device or "cpu"),
        "packages": package_versions(backend),
        "artifacts_dir": f"{base}/artifacts",
        "artifacts": artifacts,
        "spec": json_safe(graph.describe()),
        "output_structure": _output_structure(graph, module_name, build_mode),
        "samples": samples,
        "tune_row": json_safe(tune_row) if tune_row else None,
        "tolerance": _tuned_tolerance(tune_row),
    })
    return data


def _output_structure(graph, module_name: str, build_mode: BuildMode) -> dict | None:
    if graph.output_spec is None:
        return None
    try:
        return tree_spec_to_json(graph.output_spec, f"module {module_name!r} {graph.name}: the output structure")
    except CheckpointError:
        if build_mode is BuildMode.AOT:
            raise
        # JIT backends rebuild the output from the module itself; the structure is informative only.
        logger.debug("output structure of %s/%s not stored", module_name, graph.name, exc_info=True)
        return None


def _tuned_tolerance(row: dict | None) -> dict | None:
    """The thresholds the chosen backend was compared with eager under (``Tolerance.to_dict``), or None."""
    tolerance = ((row or {}).get("comparison") or {}).get("tolerance")
    return json_safe(tolerance) if isinstance(tolerance, dict) else None


# ============================================================================================ reading


def read_manifest(path: Path, extract_to: Path | None = None, verify: bool = True) -> tuple[dict, dict | None]:
    """The checkpoint's manifest, its format checked.

    Args:
        path: the ``.ait`` file.
        extract_to: with ``verify``, the folder every other member is copied to while it is hashed.
        verify: check every member's digest first (:func:`~aitune.torch.checkpoint.archive.read_verified`).

    Returns:
        ``(manifest, sums)``; ``sums`` (``{member: sha256 hex}``) is None without ``verify``.

    Raises:
        CheckpointIntegrityError: see ``read_verified``; or no manifest.
        CheckpointVersionError: a newer format version. CheckpointError: not an aitune manifest.
    """
    if verify:
        sums, data = read_verified(path, extract_to, in_memory=(MANIFEST,))
        if MANIFEST not in sums:
            raise CheckpointIntegrityError(f"{path} has no {MANIFEST}: it is not an aitune checkpoint")
        raw = data[MANIFEST]
    else:
        sums, raw = None, read_unverified(path, MANIFEST)
        if raw is None:
            raise CheckpointIntegrityError(f"{path} has no {MANIFEST}: it is not an aitune checkpoint")
    manifest = _parse_manifest(raw, path)
    _check_format(manifest, path)
    return manifest, sums


def is_aitune_manifest(data: bytes) -> bool:
    """Is ``data`` an aitune ``manifest.json`` (JSON with ``"format": "aitune-checkpoint"``)? Any version."""
    try:
        manifest = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return False
    return isinstance(manifest, dict) and manifest.get("format") == FORMAT_NAME


def _parse_manifest(data: bytes, path: Path) -> dict:
    try:
        manifest = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{MANIFEST} of {path} is not valid JSON ({exc})") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
        raise CheckpointError(f"{path} is not an aitune checkpoint ({MANIFEST} has no 'format': '{FORMAT_NAME}')")
    return manifest


def _check_format(manifest: dict, path: Path) -> None:
    version = manifest.get("format_version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise CheckpointError(f"{path}: malformed format_version {version!r} in {MANIFEST}")
    if version > FORMAT_VERSION:
        raise CheckpointVersionError(
            f"{path} was written in checkpoint format version {version} (by aitune "
            f"{manifest.get('versions', {}).get('aitune', '?')}); this aitune ({__version__}) reads versions up to "
            f"{FORMAT_VERSION}. Upgrade aitune (pip install -U aitune) to load it")
    if not isinstance(manifest.get("modules"), list):
        raise CheckpointError(f"{path}: {MANIFEST} has no list of modules")


def graph_tolerance(entry: dict, where: str) -> Tolerance:
    """The tolerance a graph was tuned under; the default ``Tolerance()`` for manifests without one.

    Raises:
        CheckpointError: a malformed ``"tolerance"`` entry, or one with a field this aitune does not know.
    """
    try:
        return Tolerance.from_dict(entry.get("tolerance"), strict=True)
    except AITuneError as exc:
        raise CheckpointError(f"{where}: malformed tolerance in the checkpoint ({exc}); it was written by a newer "
                              "aitune or edited: upgrade aitune (pip install -U aitune) or re-tune and save again") from exc
