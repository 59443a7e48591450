"""Backends written against the reference system's contract, run through aitune's (one contract underneath).

The reference's ``Backend`` subclasses implement ``key()``, ``describe()``, ``to_dict()``,
``from_dict(module, state_dict)``, an ``is_jit`` property, ``_build(module, graph_spec, data, cache_dir)``,
``_activate()``, ``_deactivate()``, ``_deploy()`` and ``_infer(*args, **kwargs)``, and mark the files they
write as :class:`ArtifactPath` values in ``to_dict()``. A subclass of :class:`aitune.torch.backend.Backend`
that defines ``is_jit`` (the reference makes it abstract, so every such backend does; aitune's own never do)
is adapted when its class is created (:func:`adapt`):

* ``is_jit`` → ``build_mode`` (JIT / AOT); ``_devices`` → ``device_types``; registered under its class name;
* aitune's ``build(module, graph, device, workdir)`` calls ``_build(module, graph, graph.samples, workdir)``
  (``graph`` is aitune's :class:`~aitune.torch.record.samples.GraphSpec`: ``samples``, ``tensor_specs``,
  ``input_names``, ``signature``; each :class:`~aitune.torch.record.samples.Sample` has ``args`` and ``kwargs``);
  ``run(args, kwargs)`` calls ``_infer(*args, **kwargs)``;
* ``save(directory)`` stores ``to_dict()``: every :class:`ArtifactPath` is copied into the checkpoint,
  tensors go to a safetensors file, ``Path``/``torch.dtype``/``torch.device``/tuples are tagged, the rest must
  be JSON values (aitune checkpoints hold no pickles — the reference ``torch.save``-s the dict);
* loading (checkpoint or tuning cache) rebuilds the dict with every artifact rebased onto the extracted
  folder, calls ``from_dict(module, state)``, then ``_deploy()``; the backend is then ACTIVE (aitune has no
  separate DEPLOYED state);
* blueprints are copied with ``copy.deepcopy`` (their constructors may take anything);
* the backend's identity in reports, caches and checkpoints is its own ``key()``/``describe()``.

Everything else — the check against eager, probes, measurement, the guard, checkpoints with digests — is
aitune's, the same as for built-in backends.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import logging
import shutil
from pathlib import Path
from typing import Any, Iterator

import torch

from aitune.errors import CheckpointError, ConfigError
from aitune.torch.backend.base import (
    Backend,
    BackendConfig,
    BackendState,
    BuildMode,
    register_subclass_hook,
)
from aitune.torch.common.dtypes import dtype_from_name, dtype_name
from aitune.torch.common.files import checkpoint_path

logger = logging.getLogger(__name__)

__all__ = ["ArtifactPath", "ReferenceBackendRecord", "adapt", "is_reference_backend"]

STATE_FORMAT = 1
_TAG = "__aitune__"


@dataclasses.dataclass(frozen=True)
class ArtifactPath:
    """A file or folder a backend wrote, to be bundled with checkpoints: ``root / relative_path``.

    Args:
        root: the folder the artifact lives under (e.g. the backend's build directory).
        relative_path: its path below ``root``; neither absolute nor containing ``..``.

    Raises:
        ConfigError: for an absolute or escaping ``relative_path``.
    """

    root: Path
    relative_path: Path

    def __post_init__(self):
        object.__setattr__(self, "root", Path(self.root))
        relative = Path(self.relative_path)
        if relative.is_absolute() or ".." in relative.parts:
            raise ConfigError(f"ArtifactPath.relative_path must be relative and stay below root, got {relative}")
        object.__setattr__(self, "relative_path", relative)

    @property
    def path(self) -> Path:
        """``root / relative_path``."""
        return self.root / self.relative_path

    @classmethod
    def from_existing(cls, path: str | Path, root: str | Path) -> "ArtifactPath":
        """The artifact at ``path``, which must exist below ``root``.

        Raises:
            ConfigError: ``path`` missing or outside ``root``.
        """
        path, root = Path(path), Path(root)
        if not path.exists():
            raise ConfigError(f"artifact {path} does not exist")
        try:
            relative = path.resolve().relative_to(root.resolve())
        except ValueError as exc:
            raise ConfigError(f"artifact {path} is not below {root}") from exc
        return cls(root, relative)


@dataclasses.dataclass(kw_only=True)
class ReferenceBackendRecord(BackendConfig):
    """What aitune stores as the ``config`` of a reference-style backend: its class and its own ``key()``
    (the backend's real configuration travels in its ``to_dict()``)."""

    backend_class: str = ""
    backend_key: str = ""


def is_reference_backend(cls: type) -> bool:
    """Does ``cls`` (a Backend subclass) follow the reference contract (defines ``is_jit`` below Backend)?"""
    return any("is_jit" in klass.__dict__ for klass in cls.__mro__
               if klass is not Backend and isinstance(klass, type) and issubclass(klass, Backend))


class _BuildModeFromIsJit:
    """``build_mode`` of a reference-style backend, from its ``is_jit`` (class access: from a class-level bool,
    else JIT, the conservative answer — it keeps the original module)."""

    def __get__(self, instance, owner):
        if instance is None:
            value = owner.__dict__.get("is_jit", None)
            for klass in owner.__mro__:
                if "is_jit" in klass.__dict__:
                    value = klass.__dict__["is_jit"]
                    break
            return BuildMode.AOT if value is False else BuildMode.JIT
        return BuildMode.JIT if instance.is_jit else BuildMode.AOT


class _ConfigRecord:
    """``config`` of a reference-style backend: a :class:`ReferenceBackendRecord` of its ``key()``."""

    def __get__(self, instance, owner):
        if instance is None:
            return self
        try:
            key = instance.key()
        except Exception:  # noqa: BLE001 - key() may need state set after Backend.__init__
            key = ""
        return ReferenceBackendRecord(backend_class=f"{type(instance).__module__}.{type(instance).__qualname__}",
                                      backend_key=str(key))

    def __set__(self, instance, value) -> None:
        """Backend.__init__ assigns a default config: reference-style backends keep theirs in ``_config``."""


def adapt(cls: type) -> None:
    """Give a reference-style Backend subclass aitune's contract (see the module docstring). Idempotent."""
    if not is_reference_backend(cls):
        return
    if not isinstance(cls.__dict__.get("name"), str):
        cls.name = cls.__name__
    cls.config_class = ReferenceBackendRecord
    cls.build_mode = _BuildModeFromIsJit()
    cls.config = _ConfigRecord()
    devices = getattr(cls, "_devices", None)
    if devices:
        cls.device_types = frozenset(devices)
    if "_build" in cls.__dict__ and not getattr(cls.__dict__["_build"], "_aitune_adapted", False):
        cls._build = _adapt_build(cls.__dict__["_build"])
    if "_infer" in cls.__dict__ and not getattr(cls.__dict__["_infer"], "_aitune_adapted", False):
        cls._infer = _adapt_infer(cls.__dict__["_infer"])
    for name, value in _MEMBERS.items():
        if not _defined_below_backend(cls, name):
            setattr(cls, name, value)


def _defined_below_backend(cls: type, name: str) -> bool:
    """Did the user's classes (not this adapter) define ``name``?"""
    for klass in cls.__mro__:
        if klass is Backend:
            return False
        if name in klass.__dict__:
            member = klass.__dict__[name]
            function = getattr(member, "__func__", None) or getattr(member, "fget", None) or member
            if not getattr(function, "_aitune_member", False):
                return True
    return False


def _adapt_build(function):
    @functools.wraps(function)
    def _build(self, module, graph, device, workdir):
        self._device = device
        self._build_results = self.build_info.setdefault("build_results", [])
        function(self, module, graph, list(graph.samples), Path(workdir))
    _build._aitune_adapted = True
    return _build


def _adapt_infer(function):
    @functools.wraps(function)
    def _infer(self, args, kwargs):
        return function(self, *args, **kwargs)
    _infer._aitune_adapted = True
    return _infer


def _member(function):
    function._aitune_member = True
    return function


@_member
def _copy(self) -> Backend:
    """A fresh INIT copy of this blueprint (deep copy: reference constructors take anything)."""
    blueprint = copy.deepcopy(self)
    blueprint.state = BackendState.INIT
    return blueprint


@_member
def _save(self, directory: Path) -> dict:
    state = self.to_dict()
    if not isinstance(state, dict):
        raise CheckpointError(f"{type(self).__name__}.to_dict() returned {type(state).__name__}; it must return a dict")
    tensors: dict[str, torch.Tensor] = {}
    encoded = _encode(state, Path(directory), tensors, [0], "to_dict()")
    if tensors:
        from safetensors.torch import save_file

        save_file(tensors, str(Path(directory) / "tensors.safetensors"))
    return {"format": STATE_FORMAT, "state": encoded}


@classmethod
@_member
def _from_checkpoint(cls, directory: Path, config, metadata: dict, module, graph, device) -> Backend:
    directory = Path(directory)
    if metadata.get("format") != STATE_FORMAT or "state" not in metadata:
        raise CheckpointError(f"{cls.__name__}: the stored state is not in aitune's reference-backend format")
    tensors_file = directory / "tensors.safetensors"
    tensors = {}
    if tensors_file.exists():
        from safetensors.torch import load_file

        tensors = load_file(str(tensors_file))
    state = _decode(metadata["state"], directory, tensors)
    backend = cls.from_dict(module, state)
    if not isinstance(backend, cls):
        raise CheckpointError(f"{cls.__name__}.from_dict returned {type(backend).__name__}, not a {cls.__name__}")
    backend.device = backend._device = torch.device(device)
    backend.graph, backend.module, backend.workdir = graph, module, directory
    backend.state = BackendState.CHECKPOINT_LOADED
    backend._deploy()
    backend.state = BackendState.ACTIVE
    return backend


@_member
@contextlib.contextmanager
def _track_build_step(self, step) -> Iterator[dict[str, Any]]:
    """The reference's build-step record: ``{"step", "success", ...}`` appended to ``build_info["build_results"]``."""
    result: dict[str, Any] = {"step": getattr(step, "value", step)}
    try:
        yield result
        result["success"] = True
    except Exception:
        result["success"] = False
        raise
    finally:
        self.build_info.setdefault("build_results", []).append(result)


@_member
def _deploy(self) -> None:
    """Reference hook: finish loading from a checkpoint (nothing by default)."""


_MEMBERS = {
    "copy": _copy,
    "_save": _save,
    "from_checkpoint": _from_checkpoint,
    "_track_build_step": _track_build_step,
    "_deploy": _deploy,
    "is_active": property(_member(lambda self: self.state is BackendState.ACTIVE)),
    "_logger": property(_member(lambda self: logging.getLogger(type(self).__module__))),
}


def _encode(value: Any, directory: Path, tensors: dict, counter: list[int], where: str) -> Any:
    if isinstance(value, ArtifactPath):
        if not value.path.exists():
            raise CheckpointError(f"{where}: artifact {value.path} does not exist")
        counter[0] += 1
        relative = Path(f"artifacts/{counter[0]}") / value.relative_path
        target = directory / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        if value.path.is_dir():
            shutil.copytree(value.path, target)
        else:
            shutil.copy2(value.path, target)
        return {_TAG: "artifact", "root": f"artifacts/{counter[0]}", "relative_path": value.relative_path.as_posix()}
    if isinstance(value, torch.Tensor):
        key = f"t{len(tensors)}"
        tensors[key] = value.detach().to("cpu").contiguous().clone()
        return {_TAG: "tensor", "key": key, "device": str(value.device)}
    if isinstance(value, Path):
        return {_TAG: "path", "value": str(value)}
    if isinstance(value, torch.dtype):
        return {_TAG: "dtype", "value": dtype_name(value)}
    if isinstance(value, torch.device):
        return {_TAG: "device", "value": str(value)}
    if isinstance(value, BackendConfig):
        return {_TAG: "config", "value": value.to_dict()}
    if isinstance(value, tuple):
        return {_TAG: "tuple", "items": [_encode(v, directory, tensors, counter, f"{where}[{i}]")
                                         for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [_encode(v, directory, tensors, counter, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        if _TAG in value:
            raise CheckpointError(f"{where}: the key {_TAG!r} is reserved")
        encoded = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise CheckpointError(f"{where}: dict key {key!r} is not a string (checkpoints store JSON)")
            encoded[key] = _encode(item, directory, tensors, counter, f"{where}[{key!r}]")
        return encoded
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.nn.Module):
        raise CheckpointError(f"{where}: an nn.Module cannot be stored; store its state_dict() (tensors) and rebuild "
                              "it in from_dict(module, state) from the module aitune passes")
    raise CheckpointError(f"{where}: a {type(value).__name__} cannot be stored — aitune checkpoints hold no pickles: "
                          "return JSON values, tensors, Path, torch.dtype/device, backend configs or ArtifactPath")


def _decode(value: Any, directory: Path, tensors: dict) -> Any:
    if isinstance(value, list):
        return [_decode(v, directory, tensors) for v in value]
    if not isinstance(value, dict):
        return value
    tag = value.get(_TAG)
    if tag is None:
        return {key: _decode(item, directory, tensors) for key, item in value.items()}
    if tag == "artifact":
        root = checkpoint_path(directory, value.get("root"), "a stored ArtifactPath's 'root'", kind="dir")
        relative = value.get("relative_path")
        if relative != ".":  # an artifact that is its root folder itself
            checkpoint_path(root, relative, "a stored ArtifactPath's 'relative_path'", kind="any",
                            missing=CheckpointError(f"artifact {relative} is missing from the checkpoint"))
        return ArtifactPath(root, relative)
    if tag == "tensor":
        return tensors[value["key"]]
    if tag == "path":
        return Path(value["value"])
    if tag == "dtype":
        return dtype_from_name(value["value"])
    if tag == "device":
        return torch.device(value["value"])
    if tag == "config":
        return BackendConfig.from_dict(value["value"])
    if tag == "tuple":
        return tuple(_decode(v, directory, tensors) for v in value["items"])
    raise CheckpointError(f"unknown tag {tag!r} in a stored backend state")


register_subclass_hook(adapt)
