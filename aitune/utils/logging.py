"""Logging helpers (the reference system's ``aitune.utils.logging``).

aitune itself never configures logging: its modules log to ``logging.getLogger(__name__)`` and the
application decides where records go. :func:`setup_logging` is for scripts that want the reference's setup in
one call (the reference calls it inside ``tune``/``load``/``inspect``; aitune leaves that to the script).
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
import threading
from pathlib import Path
from typing import Iterator

__all__ = ["DEFAULT_FORMAT", "console_output_enabled", "control_output", "libraries_logging", "set_module_level",
           "setup_logging"]

DEFAULT_FORMAT = "%(asctime)s - %(levelname)s - %(message)s"


def setup_logging(level: int | str | None = None, format_string: str = DEFAULT_FORMAT,
                  log_file: str | os.PathLike | None = None, capture_warnings: bool = True) -> logging.Logger:
    """Send log records of every logger to stdout (and ``log_file``) in ``format_string``.

    Replaces the root logger's handlers (as ``logging.basicConfig(force=True)`` does): call it from your
    script, not from a library.

    Args:
        level: root level (default ``logging.INFO``), a number or a name such as ``"DEBUG"``.
        format_string: ``logging.Formatter`` format.
        log_file: also append records to this file.
        capture_warnings: route ``warnings.warn`` messages into logging.

    Returns:
        The root logger.
    """
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
        handler.close()
    formatter = logging.Formatter(format_string)
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stdout)]
    if log_file is not None:
        Path(log_file).parent.mkdir(parents=True, exist_ok=True)
        handlers.append(logging.FileHandler(log_file))
    for handler in handlers:
        handler.setFormatter(formatter)
        root.addHandler(handler)
    root.setLevel(logging.INFO if level is None else level)
    logging.captureWarnings(capture_warnings)
    return root


def set_module_level(name: str, level: int | str) -> None:
    """Set the level of logger ``name`` (e.g. ``"aitune.torch.tuning"``)."""
    logging.getLogger(name).setLevel(level)


@contextlib.contextmanager
def libraries_logging(disabled: bool, exceptions: tuple[str, ...] | list[str] = ("aitune",)) -> Iterator[None]:
    """While active with ``disabled=True``: every logger not under ``exceptions`` logs ERROR and above only.

    Levels are restored on exit. With ``disabled=False`` nothing changes.
    """
    if not disabled:
        yield
        return
    root_level = logging.getLogger().getEffectiveLevel()
    kept = []  # excepted loggers that followed the root's level: pinned to it while the root filters at ERROR
    for prefix in exceptions:
        logger = logging.getLogger(prefix)
        if logger.level == logging.NOTSET:
            logger.setLevel(root_level)
            kept.append(logger)
    changed: list[tuple[logging.Logger, int]] = []
    loggers = [logging.getLogger()] + [value for value in logging.Logger.manager.loggerDict.values()
                                       if isinstance(value, logging.Logger)]
    for logger in loggers:
        name = logger.name
        if logger is not logging.getLogger() and any(name == prefix or name.startswith(prefix + ".")
                                                     for prefix in exceptions):
            continue
        if logger.level < logging.ERROR:
            changed.append((logger, logger.level))
            logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in changed:
            logger.setLevel(level)
        for logger in kept:
            logger.setLevel(logging.NOTSET)


def console_output_enabled() -> bool:
    """``AITUNE_CONSOLE_OUTPUT`` is ``1``, ``true`` or ``yes`` (any case)."""
    return os.environ.get("AITUNE_CONSOLE_OUTPUT", "").strip().lower() in ("1", "true", "yes")


@contextlib.contextmanager
def control_output(log_file: str | os.PathLike) -> Iterator[None]:
    """Send everything written to file descriptors 1 and 2 (Python prints, C/C++ libraries, compilers) to
    ``log_file`` (appended) while active; with ``AITUNE_CONSOLE_OUTPUT`` also to the console (tee).

    NOTE [output control]: descriptors are process-wide, so output of other threads during the block lands in
    the log too; child processes started inside the block keep writing to the log. This is what the reference
    system does around backend builds.
    """
    log_path = Path(log_file)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    try:
        saved = [os.dup(1), os.dup(2)]
    except OSError:  # no real descriptors (embedded interpreters): leave output alone
        yield
        return
    log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    tee_thread = None
    read_fd = None
    try:
        if console_output_enabled():
            read_fd, write_fd = os.pipe()
            tee_thread = threading.Thread(target=_tee, args=(read_fd, log_fd, saved[0]), daemon=True)
            tee_thread.start()
            target = write_fd
        else:
            target = log_fd
        os.dup2(target, 1)
        os.dup2(target, 2)
        if tee_thread is not None:
            os.close(target)
        # Python-level streams too: sys.stdout may not be descriptor 1 (a test runner's capture, a notebook).
        streams = (sys.stdout, sys.stderr)
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), line_buffering=True)
        sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), line_buffering=True)
        try:
            yield
        finally:
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):
                    stream.flush()
            sys.stdout, sys.stderr = streams
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        if tee_thread is not None:
            tee_thread.join(timeout=5)
        for fd in saved + [log_fd]:
            with contextlib.suppress(OSError):
                os.close(fd)


def _tee(read_fd: int, log_fd: int, console_fd: int) -> None:
    """Copy the pipe to the log and the console until every writer closed it."""
    try:
        while True:
            chunk = os.read(read_fd, 65536)
            if not chunk:
                break
            os.write(log_fd, chunk)
            with contextlib.suppress(OSError):
                os.write(console_fd, chunk)
    finally:
        with contextlib.suppress(OSError):
            os.close(read_fd)
