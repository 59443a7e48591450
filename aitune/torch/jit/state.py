"""Process-wide state of just-in-time tuning, shared by discovery and the patched modules."""

from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Iterator


class ThreadState(threading.local):
    """Per thread: module calls in progress (global hooks), routed calls in progress, and whether aitune
    itself is tuning or replaying here (then the hooks discover nothing and patched modules run eager)."""

    depth = 0
    active = 0
    suspended = 0
    replaying = 0


thread = ThreadState()
lock = threading.RLock()  # one tuning at a time; tuning may nest (a failed parent tunes its children)

# Every module discovery has looked at (patched or skipped), by the user's module object. Weak: a model the
# user drops is forgotten with its backends (the PatchedModule holds the module only weakly).
seen: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
# Modules built inside @patch_for_jit_tuning / prepare_for_jit_tuning(): the only ones discovered when
# tuning was not enabled for the whole process.
candidates: "weakref.WeakSet" = weakref.WeakSet()
# Top-level modules that are not candidates (decorator-only mode): not looked at again.
ignored: "weakref.WeakSet" = weakref.WeakSet()
names: dict[str, int] = {}


@contextlib.contextmanager
def suspended() -> Iterator[None]:
    """aitune is tuning on this thread: global hooks discover nothing, patched modules run eager."""
    thread.suspended += 1
    try:
        yield
    finally:
        thread.suspended -= 1


@contextlib.contextmanager
def replaying() -> Iterator[None]:
    """Recorded samples are being replayed: patched modules record but never start tuning."""
    thread.replaying += 1
    try:
        yield
    finally:
        thread.replaying -= 1


def unique_name(base: str) -> str:
    """``base``, or ``base#2``, ``base#3``... when taken."""
    count = names.get(base, 0) + 1
    names[base] = count
    return base if count == 1 else f"{base}#{count}"


def clear() -> None:
    seen.clear()
    candidates.clear()
    ignored.clear()
    names.clear()
