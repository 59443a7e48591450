"""The user's code a replica runs: the builder (and preprocessor) by import path, and the replica's device."""

from __future__ import annotations

import importlib
import inspect
import logging
import os
from typing import Any

import torch

from aitune.errors import ConfigError, ServeError

logger = logging.getLogger(__name__)


def load_object(path: str, what: str) -> Any:
    """The object named by ``"package.module:attribute"`` (attribute may be dotted).

    Raises:
        ConfigError: the module cannot be imported or has no such attribute; the message says that it must be
            importable on every node.
    """
    module_name, _, attribute = path.partition(":")
    try:
        value: Any = importlib.import_module(module_name)
        for part in attribute.split("."):
            value = getattr(value, part)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"cannot load the {what} {path!r} ({type(exc).__name__}: {exc}); it must be importable "
                          "on every node of the cluster (an installed package, or on PYTHONPATH)") from exc
    return value


def resolve_device(setting: str, gpu_ids: list | tuple = ()) -> torch.device:
    """The device a replica serves on.

    Args:
        setting: ``ServeConfig.device``. ``"auto"``: ``cuda:0`` when Ray assigned GPUs to the replica
            (``gpu_ids``; Ray then sets ``CUDA_VISIBLE_DEVICES`` to them) and torch sees CUDA, else the CPU.
        gpu_ids: ``ray.get_gpu_ids()`` of the replica.
    """
    if setting != "auto":
        return torch.device(setting)
    if gpu_ids and torch.cuda.is_available():
        return torch.device("cuda", 0)
    if gpu_ids:
        logger.warning("aitune serve: Ray assigned GPU(s) %s to this replica but torch sees no CUDA device "
                       "(CUDA_VISIBLE_DEVICES=%s); serving on the CPU", list(gpu_ids),
                       os.environ.get("CUDA_VISIBLE_DEVICES"))
    return torch.device("cpu")


def build_model(builder: str, device: torch.device) -> Any:
    """Call the user's builder (``"module:function"``), passing ``device`` when it takes one.

    Raises:
        ConfigError: the builder cannot be imported or is not callable. ServeError: the builder raised.
    """
    function = load_object(builder, "builder")
    if not callable(function):
        raise ConfigError(f"the builder {builder!r} is a {type(function).__name__}, not a function")
    try:
        takes_device = "device" in inspect.signature(function).parameters
    except (TypeError, ValueError):
        takes_device = False
    try:
        return function(device=str(device)) if takes_device else function()
    except Exception as exc:  # noqa: BLE001 - the user's code: named, cause chained
        raise ServeError(f"the builder {builder!r} raised {type(exc).__name__}: {exc}") from exc
