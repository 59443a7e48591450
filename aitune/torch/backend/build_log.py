"""Keep what other packages print while a candidate builds out of the user's console: their Python warnings
(deprecations, missing optional packages) and their log records go to that candidate's ``build.log`` instead.

Only Python-level output is redirected (``warnings`` and ``logging``); text a native library writes straight to
file descriptor 2 (a C++ ``std::cerr``) still reaches the terminal.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from typing import Iterator

# Loggers of the libraries the backends drive; their records go to the build log while a build runs.
THIRD_PARTY_LOGGERS = ("torch", "onnx", "onnxscript", "onnx_ir", "onnxruntime", "torchao", "transformers",
                       "modelopt", "polygraphy", "tensorrt", "torch_tensorrt", "sageattention", "triton")


@contextlib.contextmanager
def into_build_log(handler: logging.Handler) -> Iterator[None]:
    """Within the block, warnings and third-party log records are written to ``handler`` only.

    Args:
        handler: the build log's handler (a ``logging.FileHandler``).
    """
    others = logging.StreamHandler(handler.stream)  # the same file, for records that are not aitune's
    others.setFormatter(handler.formatter)
    others.addFilter(lambda record: not _OnlyAitune().filter(record))
    saved = []
    for logger in _third_party_loggers():
        saved.append((logger, list(logger.handlers), logger.propagate))
        logger.handlers = [others]
        logger.propagate = False

    # Libraries that log under other names (ONNX Runtime's transformer tools import their modules as top-level
    # names): while the build runs, the root logger's own handlers pass only aitune's records and the build
    # log takes the rest.
    root = logging.getLogger()
    only_aitune = _OnlyAitune()
    root_handlers = list(root.handlers)
    for root_handler in root_handlers:
        root_handler.addFilter(only_aitune)
    root.addHandler(others)

    def show(message, category, filename, lineno, file=None, line=None) -> None:
        handler.stream.write(f"warning: {warnings.formatwarning(message, category, filename, lineno, line)}")

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("default")
            warnings.showwarning = show
            yield
    finally:
        root.removeHandler(others)
        for root_handler in root_handlers:
            root_handler.removeFilter(only_aitune)
        for logger, handlers, propagate in saved:
            logger.handlers = handlers
            logger.propagate = propagate


class _OnlyAitune(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.name == "aitune" or record.name.startswith("aitune.")


def _third_party_loggers() -> list[logging.Logger]:
    """The libraries' top loggers, and any of their child loggers that has handlers of its own (PyTorch's
    logging setup gives some of them their own console handler)."""
    loggers = [logging.getLogger(name) for name in THIRD_PARTY_LOGGERS]
    for name, logger in list(logging.root.manager.loggerDict.items()):
        if isinstance(logger, logging.Logger) and logger.handlers and any(
                name.startswith(prefix + ".") for prefix in THIRD_PARTY_LOGGERS):
            loggers.append(logger)
    return loggers
