"""Files below a folder: their SHA-256 digests, and the confinement of a stored file name to a folder.

:func:`checkpoint_path` resolves every file name a checkpoint's manifest or a backend's metadata gives: inside
the folder, no symbolic link on the way, and, when the folder lies in one a checkpoint was verified and extracted
to (:func:`remember_extraction`, called by :func:`aitune.torch.checkpoint.archive.read_verified`), listed in that
checkpoint's ``SHA256SUMS``. Backends load their artifacts through it; the tuning cache checks its entries with
:func:`digest_files` and :func:`check_files`.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from aitune.errors import CheckpointIntegrityError

SUMS = "SHA256SUMS"
CHUNK = 1 << 20
# Real path of each folder read_verified extracted a checkpoint to -> the members it verified there.
_EXTRACTED: dict[str, frozenset[str]] = {}


def sha256_file(path: str | os.PathLike) -> str:
    """SHA-256 hex digest of a file, read in 1 MiB chunks."""
    hasher = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(CHUNK):
            hasher.update(chunk)
    return hasher.hexdigest()


def digest_files(directory: str | os.PathLike) -> dict[str, str]:
    """``{relative posix path: sha256 hex}`` of every file below ``directory``, sorted by path."""
    directory = Path(directory)
    return {path.relative_to(directory).as_posix(): sha256_file(path)
            for path in sorted(directory.rglob("*")) if path.is_file()}


def check_files(directory: str | os.PathLike, expected: dict[str, str]) -> str | None:
    """Are the files below ``directory`` exactly ``expected`` (``{relative posix path: sha256 hex}``)?

    Returns:
        None when they are, else what differs (missing / unexpected files, or the first digest mismatch).
    """
    directory = Path(directory)
    present = {path.relative_to(directory).as_posix() for path in directory.rglob("*") if path.is_file()} \
        if directory.is_dir() else set()
    if set(expected) != present:
        missing, extra = sorted(set(expected) - present), sorted(present - set(expected))
        return f"files missing {missing[:3]} / unexpected {extra[:3]}"
    for name, digest in expected.items():
        if sha256_file(directory / name) != digest:
            return f"{name} does not match its sha256"
    return None


def check_member_name(name: str) -> None:
    """Refuse names that could land outside an extraction folder or alias another file.

    Raises:
        CheckpointIntegrityError: an empty or absolute name, ``..`` or ``.`` parts, empty parts, a backslash,
            a NUL or a drive (``C:``).
    """
    parts = name.split("/")
    if (not name or name.startswith("/") or "\\" in name or "\x00" in name or ":" in parts[0]
            or any(part in ("..", ".") for part in parts) or any(part == "" for part in parts[:-1])):
        raise CheckpointIntegrityError(
            f"unsafe member name {name!r} in the checkpoint (absolute path, '..', '.', a backslash or a drive): "
            "refusing to read it; the file was not written by aitune or was tampered with")


def checkpoint_path(directory: str | os.PathLike, name: object, field: str, kind: str = "file", *,
                    missing: Exception | None = None) -> Path:
    """The file (or folder) a checkpoint's manifest or a backend's metadata names, below ``directory``.

    Every file a checkpoint loads goes through here, so it lies inside the checkpoint and is covered by its
    ``SHA256SUMS``: ``name`` must be a relative posix path without ``..``/``.`` parts (:func:`check_member_name`),
    no part of it may be a symbolic link, and when ``directory`` lies in a folder :func:`read_verified` extracted
    to, the file (for a folder: every file in it) must be a verified member. Folders that are not an extracted
    checkpoint (the tuning cache, a backend's own save directory) get the path checks only.

    Args:
        directory: the folder the name is relative to (e.g. a graph's extracted ``artifacts/``).
        name: the stored value. field: what names it, for the message (``"onnxruntime metadata 'onnx_file'"``).
        kind: ``"file"`` (must be one), ``"dir"`` (a folder, possibly absent) or ``"any"`` (either, existing).
        missing: raised when the name passes the path checks but nothing is there (default: the
            :class:`CheckpointIntegrityError` of ``kind``); names are always checked before anything is looked up.

    Returns:
        ``directory / name``.

    Raises:
        CheckpointIntegrityError: naming ``field`` and ``name``: not a string, absolute, ``..``, a link, outside
            the checkpoint, not listed in ``SHA256SUMS``, or not the kind asked for.
    """
    def refuse(why: str) -> CheckpointIntegrityError:
        return CheckpointIntegrityError(f"{field} is {name!r}, {why}; refusing to load it (the checkpoint was not "
                                        "written by aitune or was altered: save it again)")

    if not isinstance(name, str):
        raise refuse("not a file name")
    try:
        check_member_name(name)
    except CheckpointIntegrityError:
        raise refuse("which is absolute or leaves the checkpoint ('..', '.', a backslash or a drive)") from None
    directory = Path(directory)
    path = directory.joinpath(*name.split("/"))
    current = directory
    for part in name.split("/"):
        current = current / part
        if current.is_symlink():
            raise refuse(f"a symbolic link (to {os.readlink(current)!r})")
    real_directory, real = os.path.realpath(directory), os.path.realpath(path)
    if os.path.commonpath([real_directory, real]) != real_directory:
        raise refuse(f"which resolves outside the checkpoint ({real})")
    if missing is not None and not path.exists():
        raise missing
    exists = path.is_file() if kind == "file" else path.is_dir() if kind == "dir" else path.exists()
    if kind == "file" and not exists:
        raise refuse("which is not a file in the checkpoint")
    if kind == "any" and not exists:
        raise refuse("which is not in the checkpoint")
    root = next((parent for parent in (Path(real), *Path(real).parents) if str(parent) in _EXTRACTED), None)
    if root is not None and path.exists():
        files = [Path(real)] if path.is_file() else [p for p in Path(real).rglob("*") if not p.is_dir()]
        for file in files:
            member = file.relative_to(root).as_posix()
            if file.is_symlink() or member not in _EXTRACTED[str(root)]:
                raise refuse(f"whose {member} is not listed in the checkpoint's {SUMS}")
    return path


def remember_extraction(directory: str | os.PathLike, members: frozenset[str]) -> None:
    """Record that the verified checkpoint ``members`` were extracted to ``directory`` (see :func:`checkpoint_path`)."""
    _EXTRACTED[os.path.realpath(directory)] = members


def forget_extraction(directory: str | os.PathLike) -> None:
    """Drop what :func:`read_verified` recorded for ``directory`` (its folder is being deleted)."""
    _EXTRACTED.pop(os.path.realpath(directory), None)
