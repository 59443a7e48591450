"""Rewriting a saved ``.ait`` archive for tests: members edited, replaced or dropped, and ``SHA256SUMS`` re-signed
inside and beside it, as whoever can rewrite the archive can (the digests give integrity, not authenticity).
Tests use it to make a checkpoint that only a later check can stop (a stored file name, a device fact)."""

from __future__ import annotations

import hashlib
import json
import zipfile
from pathlib import Path
from typing import Callable

from aitune.torch.checkpoint import sums_path


def rewrite_archive(source: Path, target: Path, *, edit_manifest: Callable[[dict], None] | None = None,
                    replace: dict | None = None, drop: tuple = (), resign: bool = True, side: str = "update") -> Path:
    """Rebuild ``source`` as ``target`` (may be the same file): ``edit_manifest`` changes the parsed manifest in
    place, ``replace`` maps member names to new bytes, ``drop`` removes members; ``resign`` recomputes
    SHA256SUMS; ``side`` is ``update`` (write the new sums beside it), ``keep`` (the original's) or ``remove``."""
    with zipfile.ZipFile(source) as archive:
        members = {info.filename: archive.read(info) for info in archive.infolist()}
    kept_side = sums_path(source).read_bytes() if side == "keep" else None
    if edit_manifest is not None:
        manifest = json.loads(members["manifest.json"])
        edit_manifest(manifest)
        members["manifest.json"] = json.dumps(manifest).encode()
    for name in drop:
        members.pop(name)
    members.update(replace or {})
    if resign:
        digests = {name: hashlib.sha256(data).hexdigest() for name, data in members.items() if name != "SHA256SUMS"}
        members["SHA256SUMS"] = "".join(f"{d}  {n}\n" for n, d in sorted(digests.items())).encode()
    with zipfile.ZipFile(target, "w") as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    if side == "update":
        sums_path(target).write_bytes(members["SHA256SUMS"])
    elif side == "keep":
        sums_path(target).write_bytes(kept_side)
    else:
        sums_path(target).unlink(missing_ok=True)
    return target
