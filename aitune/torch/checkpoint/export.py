"""``aitune export CHECKPOINT DIR``: a checkpoint's deployment artifacts written out for other runtimes.

Reads the checkpoint's manifest (every digest verified first, as ``aitune report`` does; nothing is unpickled
or imported from it), describes each graph's artifact with its backend's ``artifact_from_metadata`` (the same
description ``ait.Module.deployment_artifacts`` gives, :mod:`aitune.torch.backend.artifact`), copies the
artifact's files into ``DIR/<module>/<graph>/`` (each hashed again against ``SHA256SUMS`` on the way) and
writes ``DIR/manifest.json``: every artifact (file paths relative to ``DIR``) and every graph left out, with
the reason.

Safety: a file name from the archive (a manifest's ``artifacts_dir``, a backend's metadata) must be a
relative member name without ``..`` (:func:`~aitune.torch.common.files.check_member_name`), be listed in the
graph's ``artifacts`` and in ``SHA256SUMS``, and its destination must resolve inside ``DIR`` without passing
a symbolic link; anything else stops the export. ``DIR`` must be new or empty, unless ``overwrite`` is
given, which then replaces only the files this export writes. A failed export removes what it wrote.
"""

from __future__ import annotations

import os
import re
import secrets
from pathlib import Path

from aitune.errors import AITuneError, CheckpointError, CheckpointIntegrityError, ConfigError, UnknownBackendError
from aitune.torch.backend.artifact import GraphFacts, dumps
from aitune.torch.backend.base import get_backend_class
from aitune.torch.checkpoint.archive import copy_member
from aitune.torch.checkpoint.manifest import MANIFEST, read_manifest
from aitune.torch.common.files import check_member_name

EXPORT_FORMAT = "aitune-deployment"
EXPORT_FORMAT_VERSION = 1


def export_checkpoint(path: str | os.PathLike, directory: str | os.PathLike, *, overwrite: bool = False) -> dict:
    """Write the deployment artifacts of the checkpoint ``path`` into ``directory`` with a ``manifest.json``.

    Args:
        path: the ``.ait`` file.
        directory: the folder to write; created when absent. It must be empty unless ``overwrite``.
        overwrite: allow a non-empty ``directory``; only the files this export writes are replaced.

    Returns:
        The manifest written (``{"format", "format_version", "checkpoint", "artifacts": [...], "left_out":
        [...]}``): each artifact is a ``DeploymentArtifact.to_json`` with ``"module"`` added and its files
        relative to ``directory``; each graph left out has ``"module"``, ``"graph"``, ``"backend"``, ``"reason"``.

    Raises:
        ConfigError: ``directory`` is a file, or is not empty (without ``overwrite``).
        CheckpointIntegrityError: a digest mismatch, or a file name from the archive that would land outside
            ``directory`` or is not a listed member.
        CheckpointVersionError / CheckpointError: as :func:`aitune.torch.load`, or malformed backend metadata.
    """
    path, root = Path(path), Path(directory)
    if root.exists() and not root.is_dir():
        raise ConfigError(f"{root} is a file; give a folder to write the artifacts into")
    if root.is_dir() and any(root.iterdir()) and not overwrite:
        raise ConfigError(f"{root} is not empty; give a new or empty folder (nothing was written)")
    manifest, sums = read_manifest(path, verify=True)
    plans, left_out = _plan(manifest, root)
    # every file is written under a temporary name beside its destination and renamed over it only once all of
    # them are complete: a failed export (or an interrupt) removes its temporaries and leaves every file that was
    # there as it was; a rename replaces a name, never the contents of an existing file (hard links elsewhere
    # keep theirs)
    staged: list[tuple[Path, Path]] = []
    created = [folder for folder in reversed([root, *root.parents]) if not folder.exists()]
    try:
        root.mkdir(parents=True, exist_ok=True)
        real_root = root.resolve()
        for artifact, members in plans:
            for member, target in members:
                if member not in sums:
                    raise CheckpointIntegrityError(f"{path}: {member!r} is not listed in its SHA256SUMS; refusing it")
                _make_parents(target, real_root, created)
                staged.append((_temporary(target), target))
                copy_member(path, member, staged[-1][0], sums[member])
        result = {"format": EXPORT_FORMAT, "format_version": EXPORT_FORMAT_VERSION, "checkpoint": str(path),
                  "artifacts": [artifact for artifact, _ in plans], "left_out": left_out}
        target = root / MANIFEST
        _inside(target, real_root)
        staged.append((_temporary(target), target))
        staged[-1][0].write_text(dumps(result))
        for temporary, target in staged:
            _inside(target, real_root)
            os.replace(temporary, target)
    except BaseException:
        _remove([temporary for temporary, _ in staged], created)
        raise
    return result


def _temporary(target: Path) -> Path:
    """A new temporary name beside ``target`` (same folder, so the final rename stays on one file system)."""
    return target.with_name(f".{target.name}.{secrets.token_hex(6)}.export-tmp")


def _plan(manifest: dict, root: Path) -> tuple[list[tuple[dict, list[tuple[str, Path]]]], list[dict]]:
    """Per deployable graph: its artifact JSON and ``(archive member, destination)`` per file; the rest left out."""
    plans, left_out, used = [], [], set()
    graph_folders: dict[str, set] = {}  # per module folder: the graph folder names taken
    for module in manifest["modules"]:
        module_name = str(module.get("name", "module"))
        module_dir = _folder_name(module_name, used)
        for entry in module.get("graphs", []):
            graph_name, backend_name = str(entry.get("name", "graph")), str(entry.get("backend", "?"))
            where = f"module {module_name!r} {graph_name}"

            def leave_out(reason: str) -> None:
                left_out.append({"module": module_name, "graph": graph_name, "backend": backend_name, "reason": reason})
            if entry.get("build_mode") != "aot":
                leave_out(f"{backend_name} is a JIT backend: it compiles or runs the Python module itself at run "
                          "time, so there is no file that runs without the module and aitune")
                continue
            try:
                backend_class = get_backend_class(backend_name)
            except UnknownBackendError:
                leave_out(f"backend {backend_name!r} is not known to this aitune (a custom backend?): import it "
                          "and use ait.load(...).deployment_artifacts() instead")
                continue
            graph_dir = root / module_dir / _folder_name(graph_name, graph_folders.setdefault(module_dir, set()))
            try:
                artifact = backend_class.artifact_from_metadata(entry.get("metadata") or {}, graph_dir,
                                                                entry.get("config") or {}, GraphFacts.from_entry(entry))
            except (KeyError, TypeError, ValueError, IndexError, AITuneError) as exc:
                raise CheckpointError(f"{where}: the {backend_name} metadata in the manifest is malformed "
                                      f"({type(exc).__name__}: {exc}); save the checkpoint again") from exc
            if artifact is None:
                leave_out(f"{backend_name} builds no artifact that another runtime loads on its own")
                continue
            members = []
            listed = set(entry.get("artifacts") or [])
            for file in artifact.files:
                try:
                    name = Path(file).relative_to(graph_dir).as_posix()
                except ValueError:  # an absolute name in the metadata
                    name = str(file)
                check_member_name(name)
                if name not in listed:
                    raise CheckpointIntegrityError(f"{where}: the {backend_name} metadata names {name!r}, which is not "
                                                   "one of the graph's artifacts in the manifest; refusing it")
                artifacts_dir = entry.get("artifacts_dir")
                if not isinstance(artifacts_dir, str):
                    raise CheckpointIntegrityError(f"{where}: the manifest's 'artifacts_dir' is {artifacts_dir!r}")
                member = f"{artifacts_dir}/{name}"
                check_member_name(member)
                members.append((member, graph_dir / name))
            plans.append(({"module": module_name, **artifact.to_json(relative_to=root)}, members))
    return plans, left_out


def _folder_name(name: str, used: set) -> str:
    """A folder name for a module or graph name: one path part of safe characters, unique among ``used``."""
    text = re.sub(r"[^A-Za-z0-9._-]", "_", name).strip(".") or "_"
    candidate, number = text, 1
    while candidate in used:
        number += 1
        candidate = f"{text}_{number}"
    used.add(candidate)
    return candidate


def _inside(target: Path, real_root: Path) -> None:
    """Refuse a destination that resolves outside the export folder (through ``..`` or a symbolic link) or that
    is a link itself (with ``overwrite``, writing through it would change another file)."""
    if target.is_symlink() or not target.resolve().is_relative_to(real_root):
        raise CheckpointIntegrityError(f"{target} would land outside {real_root} or on a link; "
                                       "refusing it")


def _make_parents(target: Path, real_root: Path, created: list[Path]) -> None:
    """Create ``target``'s folders below the export folder, recording the ones it creates."""
    _inside(target, real_root)
    missing = [parent for parent in target.parents if not parent.exists()]
    for folder in reversed(missing):
        folder.mkdir()
        created.append(folder)
    _inside(target, real_root)


def _remove(written: list[Path], created: list[Path]) -> None:
    """Remove the files a failed export wrote, then the folders it created (newest first, if left empty)."""
    for file in written:
        file.unlink(missing_ok=True)
    for folder in reversed(created):
        try:
            folder.rmdir()
        except OSError:
            pass
