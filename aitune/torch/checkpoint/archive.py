"""The container layer of ``.ait`` checkpoints: a zip of stored members plus their SHA-256 digests.

Writing: members get fixed timestamps and modes (identical content -> identical archive bytes), every
member's digest goes to ``SHA256SUMS`` inside the archive (the layout of ``sha256sum``: ``<hex>  <name>``)
and to ``<stem>_sha256_sums.txt`` beside it; both files are replaced atomically.

Reading: :func:`read_verified` refuses unsafe or duplicated member names, symbolic links and members not
listed in ``SHA256SUMS``, and hashes every member (copying it out while hashing) before the caller
deserialises anything. Every file name a manifest or a backend's metadata gives is then resolved with
:func:`~aitune.torch.common.files.checkpoint_path`: inside the extraction folder and listed in its ``SHA256SUMS``,
or refused. The digest helpers and the name checks live in :mod:`aitune.torch.common.files` (the tuning cache and
the backends use them too).

NOTE [what the digests prove]: the digests detect corruption and accidental changes — a truncated copy, a
flipped byte, a file edited or swapped by mistake (integrity). They do not authenticate anything: whoever
can rewrite the archive can rewrite ``SHA256SUMS`` and the sums file beside it too, and the checkpoint then
verifies. Only a digest or signature obtained from a trusted channel (not stored with the file) would detect
tampering.
"""

from __future__ import annotations

import hashlib
import os
import stat
import zipfile
import zlib
from pathlib import Path

from aitune.errors import CheckpointError, CheckpointIntegrityError
from aitune.torch.common.files import CHUNK, SUMS, check_member_name, remember_extraction

MAX_SMALL_MEMBER = 64 << 20  # members read into memory (manifest.json, SHA256SUMS); refuse absurd sizes
_FIXED_ZIP_TIME = (1980, 1, 1, 0, 0, 0)  # identical content -> identical members (reproducible archives)


# ============================================================================================ sums files


def sums_path(path: str | os.PathLike) -> Path:
    """``<dir>/<stem>_sha256_sums.txt`` beside the archive ``<dir>/<stem>.ait``."""
    path = Path(path)
    return path.with_name(f"{path.stem}_sha256_sums.txt")


def format_sums(sums: dict[str, str]) -> str:
    """``SHA256SUMS`` text: ``<sha256 hex>  <member name>`` per line, sorted by name."""
    return "".join(f"{digest}  {name}\n" for name, digest in sorted(sums.items()))


def parse_sums(text: str, path: Path, origin: str) -> dict[str, str]:
    """The inverse of :func:`format_sums`.

    Args:
        text: the file's text. path: the archive (for messages). origin: the sums file's name (for messages).

    Raises:
        CheckpointIntegrityError: a malformed line, an unsafe member name or a name listed twice.
    """
    sums: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        digest, sep, name = line.partition("  ")
        if not sep or len(digest) != 64 or any(ch not in "0123456789abcdef" for ch in digest):
            raise CheckpointIntegrityError(f"{origin} of {path}, line {number}: malformed entry {line[:120]!r}")
        check_member_name(name)
        if name in sums:
            raise CheckpointIntegrityError(f"{origin} of {path} lists {name!r} twice")
        sums[name] = digest
    return sums


def is_aitune_sums(path: Path, digest_length: int = 64) -> bool:
    """Is ``path`` a sums file aitune writes beside an archive (``<hex>  <member>`` lines, the manifest listed)?

    Args:
        path: the file. digest_length: hex digits per digest (64 for SHA-256, 128 for SHA-512).
    """
    try:
        if path.is_symlink() or not path.is_file() or path.stat().st_size > MAX_SMALL_MEMBER:
            return False
        names = set()
        for line in path.read_text(encoding="utf-8").splitlines():
            if not line.strip():
                continue
            digest, sep, name = line.partition("  ")
            if not sep or len(digest) != digest_length or any(ch not in "0123456789abcdef" for ch in digest):
                return False
            check_member_name(name)
            names.add(name)
    except (OSError, UnicodeDecodeError, CheckpointIntegrityError):
        return False
    return "manifest.json" in names


# ============================================================================================ writing


def _zip_info(name: str) -> zipfile.ZipInfo:
    info = zipfile.ZipInfo(name, date_time=_FIXED_ZIP_TIME)
    info.compress_type = zipfile.ZIP_STORED
    info.external_attr = (stat.S_IFREG | 0o644) << 16
    return info


def write_archive(archive: Path, staging: Path, members: dict[str, bytes]) -> dict[str, str]:
    """Write every file below ``staging``, then ``members`` (name -> bytes), then ``SHA256SUMS`` to ``archive``.

    Returns:
        ``{member name: sha256 hex}`` of every member but ``SHA256SUMS``.

    Raises:
        CheckpointIntegrityError: a staged file or member whose name is unsafe (see :func:`check_member_name`).
    """
    sums: dict[str, str] = {}
    with zipfile.ZipFile(archive, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
        for file in sorted(p for p in staging.rglob("*") if p.is_file()):
            name = file.relative_to(staging).as_posix()
            check_member_name(name)
            hasher = hashlib.sha256()
            with open(file, "rb") as source, zf.open(_zip_info(name), "w",
                                                     force_zip64=file.stat().st_size > 2**31) as target:
                while chunk := source.read(CHUNK):
                    hasher.update(chunk)
                    target.write(chunk)
            sums[name] = hasher.hexdigest()
        for name, data in members.items():
            check_member_name(name)
            zf.writestr(_zip_info(name), data)
            sums[name] = hashlib.sha256(data).hexdigest()
        zf.writestr(_zip_info(SUMS), format_sums(sums).encode())
    return sums


def publish(path: Path, staging: Path, members: dict[str, bytes]) -> None:
    """:func:`write_archive` to ``path`` and its sums to :func:`sums_path`, each replaced atomically
    (written to a hidden ``.partial`` file first; a failure leaves the previous files in place)."""
    side = sums_path(path)
    partial = path.with_name(f".{path.name}.partial-{os.getpid()}")
    side_partial = side.with_name(f".{side.name}.partial-{os.getpid()}")
    try:
        side_partial.write_text(format_sums(write_archive(partial, staging, members)))
        os.replace(partial, path)
        os.replace(side_partial, side)
    finally:
        partial.unlink(missing_ok=True)
        side_partial.unlink(missing_ok=True)


# ============================================================================================ reading


def open_zip(path: Path) -> zipfile.ZipFile:
    """Open ``path`` as a zip.

    Raises:
        CheckpointError: it does not exist. CheckpointIntegrityError: it is not a readable zip.
    """
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist")
    try:
        return zipfile.ZipFile(path)
    except (zipfile.BadZipFile, EOFError, OSError, ValueError) as exc:
        raise CheckpointIntegrityError(f"{path} is truncated or is not an aitune checkpoint (not a readable zip: "
                                       f"{exc}); save it again or copy it completely") from exc


def read_small(zf: zipfile.ZipFile, info: zipfile.ZipInfo, path: Path) -> bytes:
    """A member read into memory; refuses one larger than 64 MiB (aitune never writes such small files)."""
    if info.file_size > MAX_SMALL_MEMBER:
        raise CheckpointIntegrityError(f"{info.filename} in {path} is {info.file_size} bytes, far larger than "
                                       "aitune writes; refusing it")
    return zf.read(info)


def read_unverified(path: Path, name: str) -> bytes | None:
    """One small member, without checking any digest (None when the archive has no such member).

    Raises:
        CheckpointError / CheckpointIntegrityError: as :func:`open_zip`, or a corrupted member.
    """
    with open_zip(path) as zf:
        try:
            info = zf.getinfo(name)
        except KeyError:
            return None
        try:
            return read_small(zf, info, path)
        except (zipfile.BadZipFile, EOFError, OSError) as exc:
            raise CheckpointIntegrityError(f"{path} is corrupted or truncated ({exc})") from exc


def member_sizes(path: Path) -> dict[str, int]:
    """``{member name: size in bytes}``; empty when the archive cannot be read."""
    try:
        with zipfile.ZipFile(path) as zf:
            return {info.filename: info.file_size for info in zf.infolist()}
    except (zipfile.BadZipFile, OSError):
        return {}


def read_verified(path: Path, extract_to: Path | None, in_memory: tuple[str, ...] = ()) -> tuple[dict, dict]:
    """Check every member of ``path`` against its ``SHA256SUMS`` (and the sums file beside it, if present).

    Members are hashed while being copied under ``extract_to`` (or only hashed when it is None); the
    ``in_memory`` members are read into memory instead. Callers deserialise nothing before this returns.

    Returns:
        ``(sums, data)``: ``{member name: sha256 hex}`` from ``SHA256SUMS`` and ``{name: bytes}`` of the
        ``in_memory`` members that exist.

    Raises:
        CheckpointIntegrityError: not a zip / truncated, a digest mismatch, an unsafe, duplicated, linked,
            unlisted or missing member, or a sums file beside the archive that disagrees with it.
        CheckpointError: ``path`` does not exist.
    """
    with open_zip(path) as zf:
        try:
            members = _listed_members(zf, path)
            sums = parse_sums(read_small(zf, members[SUMS], path).decode("utf-8", errors="replace"), path, SUMS)
            _check_side_sums(path, sums)
            unlisted = sorted(set(members) - set(sums) - {SUMS})
            if unlisted:
                raise CheckpointIntegrityError(f"{path} holds files not listed in {SUMS}: {', '.join(unlisted[:5])}; "
                                               "refusing an altered checkpoint")
            missing = sorted(set(sums) - set(members))
            if missing:
                raise CheckpointIntegrityError(f"{path} is missing {', '.join(missing[:5])}, listed in its {SUMS}; the "
                                               "checkpoint is incomplete — save it again")
            data: dict[str, bytes] = {}
            for name in sorted(sums):
                hasher = hashlib.sha256()
                if name in in_memory:
                    data[name] = read_small(zf, members[name], path)
                    hasher.update(data[name])
                else:
                    _copy_hashing(zf, members[name], hasher, extract_to)
                if hasher.hexdigest() != sums[name]:
                    raise CheckpointIntegrityError(f"{name} in {path} does not match its SHA-256 digest in {SUMS}: the "
                                                   "checkpoint was corrupted or tampered with; do not use it")
        except (zipfile.BadZipFile, EOFError, zlib.error, OSError) as exc:
            raise CheckpointIntegrityError(f"{path} is corrupted or truncated ({type(exc).__name__}: {exc}); save it "
                                           "again or copy it completely") from exc
    if extract_to is not None:
        remember_extraction(extract_to, frozenset(name for name in sums if name not in in_memory))
    return sums, data


def copy_member(path: Path, name: str, target: Path, digest: str) -> None:
    """Copy the member ``name`` of the archive ``path`` to the new file ``target``, hashing it on the way.

    The name is checked as :func:`read_verified` checks it (no absolute path, ``..``, link or duplicate); the
    caller chooses ``target`` (it must lie where the caller allows) and passes the digest ``SHA256SUMS`` lists.

    Raises:
        CheckpointIntegrityError: an unsafe, missing, linked or duplicated member, or one whose SHA-256 is not
            ``digest`` (``target`` is removed then).
    """
    check_member_name(name)
    with open_zip(path) as zf:
        infos = [info for info in zf.infolist() if info.filename == name]
        if len(infos) != 1 or stat.S_ISLNK(infos[0].external_attr >> 16):
            raise CheckpointIntegrityError(f"{path}: member {name!r} is {'missing' if not infos else 'ambiguous'} "
                                           "or a link; refusing it")
        hasher = hashlib.sha256()
        try:
            with zf.open(infos[0]) as source, open(target, "wb") as out:
                while chunk := source.read(CHUNK):
                    hasher.update(chunk)
                    out.write(chunk)
        except (zipfile.BadZipFile, EOFError, zlib.error) as exc:
            target.unlink(missing_ok=True)
            raise CheckpointIntegrityError(f"{path} is corrupted or truncated ({exc})") from exc
    if hasher.hexdigest() != digest:
        target.unlink(missing_ok=True)
        raise CheckpointIntegrityError(f"{name} in {path} does not match its SHA-256 digest in {SUMS}: the "
                                       "checkpoint was corrupted or tampered with; do not use it")


def _listed_members(zf: zipfile.ZipFile, path: Path) -> dict[str, zipfile.ZipInfo]:
    members: dict[str, zipfile.ZipInfo] = {}
    for info in zf.infolist():
        check_member_name(info.filename.rstrip("/") if info.is_dir() else info.filename)
        if stat.S_ISLNK(info.external_attr >> 16):
            raise CheckpointIntegrityError(f"member {info.filename!r} of {path} is a symbolic link; refusing it")
        if info.is_dir():
            continue
        if info.filename in members:
            raise CheckpointIntegrityError(f"{path} holds {info.filename!r} twice; refusing an ambiguous archive")
        members[info.filename] = info
    if SUMS not in members:
        raise CheckpointIntegrityError(f"{path} has no {SUMS}: it is not an aitune checkpoint or was altered")
    return members


def _check_side_sums(path: Path, sums: dict[str, str]) -> None:
    side = sums_path(path)
    if not side.exists():
        return
    side_sums = parse_sums(side.read_text(encoding="utf-8", errors="replace"), path, side.name)
    if side_sums != sums:
        different = sorted(n for n in set(sums) | set(side_sums) if sums.get(n) != side_sums.get(n))
        raise CheckpointIntegrityError(
            f"{side.name} beside {path} disagrees with the {SUMS} inside it ({', '.join(different[:5])}"
            f"{'…' if len(different) > 5 else ''}): the archive or the sums file was changed")


def _copy_hashing(zf: zipfile.ZipFile, info: zipfile.ZipInfo, hasher, extract_to: Path | None) -> None:
    target = None
    if extract_to is not None:
        destination = extract_to.joinpath(*info.filename.split("/"))
        destination.parent.mkdir(parents=True, exist_ok=True)
        target = open(destination, "wb")
    try:
        with zf.open(info) as source:
            while chunk := source.read(CHUNK):
                hasher.update(chunk)
                if target is not None:
                    target.write(chunk)
    finally:
        if target is not None:
            target.close()
