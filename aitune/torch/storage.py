"""Where checkpoints live: ``ait.save``/``ait.load`` with the reference system's ``storage=`` and layout.

``ait.save(model, "model.ait")`` writes, relative to the working directory, as the reference does::

    checkpoints/model.ait               the archive (aitune's format: manifest, artifacts, safetensors, SHA256SUMS)
    checkpoints/model_sha256_sums.txt   its members' SHA-256 digests
    checkpoints/model/                  the archive's members, unpacked (kept unless remove_checkpoint_after_tune)

A name is resolved as ``<base_folder>/<name>``; an absolute name, and a relative one that already starts with
the base folder (``"checkpoints/model"``), stay as they are. The archive is the name with ``.ait`` (added when
missing) and the folder the name without it. ``ait.load(model, "model.ait")`` resolves the same way (when
nothing exists there, a relative name that exists as given, with or without ``.ait`` — e.g. a checkpoint saved
by an earlier aitune — is read from there). Loading always reads and verifies the archive (every member's
digest before anything is deserialised); with ``compress_checkpoint=False`` only the folder is written, and
loading packs it into a temporary archive first.

Saving replaces only what aitune wrote: an existing archive, sums file or folder at those paths must be an
earlier aitune checkpoint (an archive with aitune's ``manifest.json``; a folder holding that manifest, its
``SHA256SUMS`` and only files listed there), else :func:`save` refuses with a
:class:`~aitune.errors.CheckpointError` and changes nothing — e.g. ``ait.save(model, "models/bert.ait",
storage=LocalTorchStorage(base_folder="."))`` never deletes a ``models/bert/`` folder of ``from_pretrained``
files.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
import zipfile
from pathlib import Path, PurePosixPath
from typing import Any

import torch

from aitune.errors import CheckpointError, CheckpointIntegrityError, ConfigError
from aitune.torch.common.arguments import known_keywords
from aitune.torch import checkpoint
from aitune.torch.checkpoint.archive import CHUNK, SUMS, is_aitune_sums, parse_sums, sums_path
from aitune.torch.checkpoint.load import check_weights_choice
from aitune.torch.checkpoint.manifest import MANIFEST, is_aitune_manifest
from aitune.torch.checkpoint.save import check_replaceable
from aitune.utils.logging import libraries_logging

logger = logging.getLogger(__name__)

__all__ = ["LocalTorchStorage", "load", "save"]

SUFFIX = ".ait"


class LocalTorchStorage:
    """Checkpoints in a local folder (the reference system's storage, same arguments).

    Args:
        base_folder: folder relative names are resolved in (default ``"checkpoints"``, relative to the working
            directory at save/load time).
        compress_checkpoint: write the ``.ait`` archive (True) or only the unpacked folder (False).
        overwrite_checkpoint_on_tune: replace an existing checkpoint of the same name (else FileExistsError).
        remove_checkpoint_after_tune: after saving, delete the unpacked folder (the archive stays).
        sha_type: ``"256"`` (the sums every checkpoint has) or ``"512"`` (also ``<stem>_sha512_sums.txt`` beside
            the archive, checked at load).

    Raises:
        ConfigError: for a bad argument (e.g. ``remove_checkpoint_after_tune`` without an archive).
    """

    def __init__(self, base_folder: str | os.PathLike = "checkpoints", compress_checkpoint: bool = True,
                 overwrite_checkpoint_on_tune: bool = True, remove_checkpoint_after_tune: bool = False,
                 sha_type: str = "256"):
        for name, value in (("compress_checkpoint", compress_checkpoint),
                            ("overwrite_checkpoint_on_tune", overwrite_checkpoint_on_tune),
                            ("remove_checkpoint_after_tune", remove_checkpoint_after_tune)):
            if not isinstance(value, bool):
                raise ConfigError(f"{name} must be a bool, got {value!r}")
        if sha_type not in ("256", "512"):
            raise ConfigError(f"sha_type must be '256' or '512', got {sha_type!r}")
        if remove_checkpoint_after_tune and not compress_checkpoint:
            raise ConfigError("remove_checkpoint_after_tune deletes the unpacked folder, which is the whole "
                              "checkpoint when compress_checkpoint=False")
        self.base_folder = Path(base_folder)
        self.compress_checkpoint = compress_checkpoint
        self.overwrite_checkpoint_on_tune = overwrite_checkpoint_on_tune
        self.remove_checkpoint_after_tune = remove_checkpoint_after_tune
        self.sha_type = sha_type

    def __repr__(self) -> str:
        return (f"LocalTorchStorage(base_folder={str(self.base_folder)!r}, compress_checkpoint={self.compress_checkpoint}, "
                f"overwrite_checkpoint_on_tune={self.overwrite_checkpoint_on_tune}, "
                f"remove_checkpoint_after_tune={self.remove_checkpoint_after_tune}, sha_type={self.sha_type!r})")

    # ---- names
    def archive_path(self, name: str | os.PathLike) -> Path:
        """``<base_folder>/<name>`` with ``.ait`` (added when missing); see :meth:`resolve`."""
        folder = self.folder_path(name)
        return folder.with_name(folder.name + SUFFIX)

    def folder_path(self, name: str | os.PathLike) -> Path:
        """``<base_folder>/<name>`` without ``.ait``: the unpacked checkpoint; see :meth:`resolve`."""
        path = self.resolve(name)
        return path.with_name(path.name[: -len(SUFFIX)]) if path.name.endswith(SUFFIX) else path

    def resolve(self, name: str | os.PathLike) -> Path:
        """Where a checkpoint name lives: ``<base_folder>/<name>``, except an absolute name and a relative one
        that already starts with the base folder (``"checkpoints/model"`` with the default base folder), which
        stay as given — so saving and loading ``"checkpoints/model"`` both use ``checkpoints/model.ait``.

        Raises:
            ConfigError: an empty name, or one that is the base folder itself.
        """
        path = Path(name).expanduser()
        if not path.name or path.name in (".", "..") or path.name == SUFFIX:
            raise ConfigError(f"checkpoint name {str(name)!r} names no file; give a name such as 'model.ait'")
        base = self.base_folder.expanduser()
        if path.is_absolute():
            return path
        if not base.is_absolute() and base.parts and path.parts[:len(base.parts)] == base.parts:
            if len(path.parts) == len(base.parts):
                raise ConfigError(f"checkpoint name {str(name)!r} is the base folder {str(base)!r} itself; give a "
                                  f"name inside it, e.g. '{base.as_posix()}/model.ait' or 'model.ait'")
            return path
        return base / path

    # ---- save / load
    def save(self, model_or_pipeline: Any, name: str | os.PathLike) -> Path:
        """Write the checkpoint (see the module docstring); returns the archive (or the folder without one).

        Raises:
            FileExistsError: it exists and ``overwrite_checkpoint_on_tune`` is False.
            CheckpointError: as :func:`aitune.torch.checkpoint.save`.
        """
        archive, folder = self.archive_path(name), self.folder_path(name)
        if not self.overwrite_checkpoint_on_tune and (archive.exists() or folder.exists()):
            raise FileExistsError(f"checkpoint {archive if archive.exists() else folder} exists and "
                                  "overwrite_checkpoint_on_tune is False")
        # Everything this save replaces or deletes must be aitune's own, checked before anything is written.
        check_replaceable(archive)
        _check_replaceable_side(_sha512_path(archive), 128)
        _check_replaceable_folder(folder, archive)
        archive.parent.mkdir(parents=True, exist_ok=True)
        checkpoint.save(model_or_pipeline, archive)
        if folder.is_dir() and any(folder.iterdir()):
            shutil.rmtree(folder)
        if not self.remove_checkpoint_after_tune:
            with zipfile.ZipFile(archive) as zf:
                zf.extractall(folder)
        if self.sha_type == "512":
            _sha512_path(archive).write_text(_format(_member_digests(archive, "sha512")))
        if not self.compress_checkpoint:
            shutil.copy2(sums_path(archive), folder / sums_path(archive).name)
            archive.unlink()
            sums_path(archive).unlink(missing_ok=True)
            logger.info("aitune.save: unpacked checkpoint in %s (compress_checkpoint=False)", folder)
            return folder
        return archive

    def load(self, model_or_pipeline: Any, name: str | os.PathLike, device: str | torch.device | None = None,
             weights: str | None = None) -> Any:
        """Restore the checkpoint ``name`` into ``model_or_pipeline`` (:func:`aitune.torch.checkpoint.load`, which
        documents ``device`` and ``weights``).

        Raises:
            FileNotFoundError: neither the archive nor the folder exists.
            CheckpointIntegrityError: a digest (SHA-256, or SHA-512 with ``sha_type="512"``) does not match.
            ConfigError: ``weights`` is not None, ``"checkpoint"`` or ``"module"``.
        """
        check_weights_choice(weights)
        archive, folder = self.archive_path(name), self.folder_path(name)
        if not archive.exists() and not folder.is_dir():
            literal = Path(name).expanduser()
            found = [] if literal.is_absolute() else _as_given(literal)
            if found:
                logger.info("aitune.load: %s not found; reading %s as given", archive, found[0])
                return checkpoint.load(model_or_pipeline, found[0], device=device, weights=weights)
            legacy = [] if literal.is_absolute() else _as_given(self.base_folder.expanduser() / literal)
            if legacy:  # where a name starting with the base folder was saved before such names were kept as given
                logger.warning("aitune.load: %s not found; reading %s, where earlier aitune versions saved %r "
                               "(save it again to move it to %s)", archive, legacy[0], str(name), archive)
                return checkpoint.load(model_or_pipeline, legacy[0], device=device, weights=weights)
            raise FileNotFoundError(f"no checkpoint {archive} (nor an unpacked {folder}/)")
        if archive.exists():
            side = _sha512_path(archive)
            if self.sha_type == "512" or side.exists():
                _check_sha512(archive, side)
            return checkpoint.load(model_or_pipeline, archive, device=device, weights=weights)
        with tempfile.TemporaryDirectory(prefix="aitune-pack-") as scratch:
            packed = Path(scratch) / archive.name
            _pack(folder, packed)
            return checkpoint.load(model_or_pipeline, packed, device=device, weights=weights)


def existing_checkpoint(name: str | os.PathLike) -> Path:
    """``name`` when that file exists (or ``name.ait``), else where :func:`save` puts ``name``
    (``checkpoints/<name>.ait``, or ``<name>.ait`` as given when it starts with ``checkpoints/``) when that
    exists, else ``name`` as given (the caller's error names it)."""
    path = Path(name).expanduser()
    found = _as_given(path)
    if found:
        return found[0]
    try:
        saved = LocalTorchStorage().archive_path(path)
    except ConfigError:
        return path
    return saved if saved.is_file() else path


def _as_given(path: Path) -> list[Path]:
    """``path`` and, without the suffix, ``path.ait``: those that are files."""
    candidates = [path] if path.name.endswith(SUFFIX) else [path, path.with_name(path.name + SUFFIX)]
    return [candidate for candidate in candidates if candidate.is_file()]


@known_keywords
def save(model_or_pipeline: Any, path: str | os.PathLike, storage: LocalTorchStorage | None = None) -> Path:
    """Save every tuned :class:`~aitune.torch.Module` of a model or pipeline (see the module docstring).

    Args:
        model_or_pipeline: an ``ait.Module``, an ``nn.Module`` holding wrappers, or a pipeline object.
        path: checkpoint name, e.g. ``"model.ait"`` → ``checkpoints/model.ait`` (absolute paths as given).
        storage: where and how (default ``LocalTorchStorage()``).

    Returns:
        The archive written (the folder when ``compress_checkpoint=False``).
    """
    return _storage(storage).save(model_or_pipeline, path)


@known_keywords
def load(model_or_pipeline: Any, path: str | os.PathLike, storage: LocalTorchStorage | None = None,
         device_map: dict[str, str | torch.device] | None = None, disable_external_logging: bool = True,
         *, device: str | torch.device | None = None, weights: str | None = None) -> Any:
    """Restore a checkpoint saved by :func:`save` into a freshly built model or pipeline; returns it tuned.

    Args:
        model_or_pipeline: the same structure that was saved.
        path: the name given to :func:`save` (resolved the same way).
        storage: as given to :func:`save`.
        device_map: the reference's ``{attribute: device}``; aitune loads every module on one device, so the
            map's values must agree (they become ``device``).
        disable_external_logging: silence loggers other than aitune's (below ERROR) while loading.
        device: where to run (default: per module, NOTE [checkpoint devices] in :mod:`aitune.torch.checkpoint`).
        weights: for a module whose checkpoint stores no weights (AOT-only) and whose own weights differ from
            those it was tuned with: ``"checkpoint"`` (the artifacts answer; calls they do not take raise),
            ``"module"`` (the module's own weights answer every call, eagerly; ``needs_retune`` says why) or
            None (as ``"checkpoint"``, with a warning). A checkpoint that stores weights (JIT graphs) loads
            them into the module, unless ``weights="module"``: the module then keeps its own and the JIT
            backends are rebuilt from them. See NOTE [one model per loaded module] in
            :func:`aitune.torch.checkpoint.load`.

    Raises:
        ConfigError: a ``device_map`` naming several devices, or together with ``device``; a ``weights`` other
            than None, ``"checkpoint"`` or ``"module"``.
        FileNotFoundError, CheckpointError: as :meth:`LocalTorchStorage.load`.
    """
    if device_map:
        devices = {str(torch.device(value)) for value in device_map.values()}
        if len(devices) > 1 or device is not None:
            raise ConfigError(f"device_map names {sorted(devices)}: aitune loads a checkpoint on one device; pass "
                              "device='cuda:0' (or a device_map whose entries agree)")
        device = devices.pop()
    with libraries_logging(disable_external_logging):
        return _storage(storage).load(model_or_pipeline, path, device=device, weights=weights)


def _storage(storage: LocalTorchStorage | None) -> LocalTorchStorage:
    if storage is None:
        return LocalTorchStorage()
    if not isinstance(storage, LocalTorchStorage):
        raise ConfigError(f"storage must be an aitune.torch.LocalTorchStorage, got {type(storage).__name__}")
    return storage


def _check_replaceable_side(side: Path, digest_length: int) -> None:
    """A ``<stem>_sha512_sums.txt`` that :meth:`LocalTorchStorage.save` would overwrite must be aitune's."""
    if side.exists() and not is_aitune_sums(side, digest_length):
        raise CheckpointError(_not_ours(side, "file"))


def _check_replaceable_folder(folder: Path, archive: Path) -> None:
    """The unpacked folder :meth:`LocalTorchStorage.save` replaces must hold an aitune checkpoint and nothing else.

    An aitune folder holds ``manifest.json`` (aitune's format), ``SHA256SUMS`` and only files listed there
    (plus the ``<stem>_sha256_sums.txt`` copy of ``compress_checkpoint=False``); an empty folder is reused.

    Raises:
        CheckpointError: anything else (a file, a link, a folder of someone else's files), naming it.
    """
    if not (folder.exists() or folder.is_symlink()):
        return
    if folder.is_symlink() or not folder.is_dir():
        raise CheckpointError(_not_ours(folder, "path"))
    entries = list(folder.rglob("*"))
    if not entries:
        return
    problem = None
    try:
        listed = set(parse_sums((folder / SUMS).read_text(encoding="utf-8"), folder, SUMS)) \
            if (folder / SUMS).is_file() and not (folder / SUMS).is_symlink() else None
        manifest = folder / MANIFEST
        if listed is None or manifest.is_symlink() or not manifest.is_file() or \
                not is_aitune_manifest(manifest.read_bytes()):
            problem = f"it has no aitune {MANIFEST} and {SUMS}"
        else:
            allowed = listed | {SUMS, sums_path(archive).name}
            folders = {parent.as_posix() for name in listed for parent in PurePosixPath(name).parents}
            for entry in entries:
                relative = entry.relative_to(folder).as_posix()
                if entry.is_symlink() or (not entry.is_dir() and relative not in allowed):
                    problem = f"{relative} is not a file aitune wrote"
                    break
                if entry.is_dir() and relative not in folders:  # (an empty folder of the user's too)
                    problem = f"{relative}/ is not a folder aitune wrote"
                    break
    except (OSError, UnicodeDecodeError, CheckpointError) as exc:
        problem = f"its {SUMS} cannot be read ({exc})"
    if problem:
        raise CheckpointError(_not_ours(folder, "folder", problem))


def _not_ours(path: Path, what: str, why: str = "") -> str:
    return (f"ait.save would replace the {what} {path}, which is not an aitune checkpoint"
            f"{f' ({why})' if why else ''}; nothing was written. Choose another checkpoint name "
            "(ait.save(model, 'other.ait')) or another folder (storage=LocalTorchStorage(base_folder=...)), or move "
            f"{path} away if you mean to replace it")


def _sha512_path(archive: Path) -> Path:
    return archive.with_name(f"{archive.stem}_sha512_sums.txt")


def _member_digests(archive: Path, algorithm: str) -> dict[str, str]:
    digests = {}
    with zipfile.ZipFile(archive) as zf:
        for info in zf.infolist():
            hasher = hashlib.new(algorithm)
            with zf.open(info) as member:
                while chunk := member.read(CHUNK):
                    hasher.update(chunk)
            digests[info.filename] = hasher.hexdigest()
    return dict(sorted(digests.items()))


def _format(digests: dict[str, str]) -> str:
    return "".join(f"{digest}  {name}\n" for name, digest in digests.items())


def _check_sha512(archive: Path, side: Path) -> None:
    if not side.exists():
        raise CheckpointIntegrityError(f"{side.name} is missing beside {archive} (saved with sha_type='512')")
    expected = {}
    for line in side.read_text().splitlines():
        if line.strip():
            digest, name = line.split("  ", 1)
            expected[name] = digest
    actual = _member_digests(archive, "sha512")
    if actual != expected:
        different = sorted(n for n in set(actual) | set(expected) if actual.get(n) != expected.get(n))
        raise CheckpointIntegrityError(f"{archive}: SHA-512 digests do not match {side.name} ({', '.join(different[:3])})")


def _pack(folder: Path, archive: Path) -> None:
    """The unpacked folder as a stored zip (its SHA256SUMS inside is what load verifies)."""
    with zipfile.ZipFile(archive, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
        for file in sorted(p for p in folder.rglob("*") if p.is_file()):
            name = file.relative_to(folder).as_posix()
            if name.endswith("_sha256_sums.txt") and "/" not in name:
                continue  # the side copy kept in the folder; SHA256SUMS is the member load checks
            zf.write(file, name)
