"""The base of every backend config (:class:`BackendConfig`): plain data, validated, serialised with a
version, rebuilt from a checkpoint only as what this aitune can honour; and its JSON helpers."""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
from pathlib import Path
from typing import Any, ClassVar

import torch

from aitune.errors import CheckpointError, CheckpointVersionError, ConfigError
from aitune.torch.common.arguments import KnownFields
from aitune.torch.common.dtypes import dtype_from_name, dtype_name


CONFIG_FORMAT_VERSION = 1


def _to_jsonable(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, torch.dtype):
        return dtype_name(value)
    if isinstance(value, BackendConfig):
        return value.to_dict()
    if isinstance(value, (list, tuple)):
        return [_to_jsonable(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted(_to_jsonable(v) for v in value)
    if isinstance(value, dict):
        return {str(k): _to_jsonable(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, Path):
        return str(value)
    return value


def parse_dtype(value: Any, field: str) -> torch.dtype | None:
    """``torch.float16`` / ``"float16"`` / ``"fp16"`` / None -> torch dtype (None stays None).

    Raises:
        ConfigError: naming ``field`` when ``value`` is not a torch dtype.
    """
    return None if value is None else dtype_from_name(value, ConfigError, field)


_CONFIG_CLASSES: dict[str, type["BackendConfig"]] = {}


@dataclasses.dataclass(kw_only=True)
class BackendConfig(KnownFields):
    """Base of every ``<Backend>Config``: keyword-only plain data, validated in ``__post_init__``.

    Serialised as ``{"type": <class name>, "version": <the class's VERSION>, "data": {...}}``; :meth:`from_dict`
    resolves the type among aitune's own config classes only, fills fields missing from older files with
    defaults and refuses what this aitune cannot honour: a newer version or an unknown field (a config stored
    by a newer aitune, or a typo, would otherwise run another configuration than the one that was checked).

    A subclass that changes the meaning of its stored fields raises its ``VERSION`` and overrides
    :meth:`_upgrade` to read the older versions.
    """

    VERSION: ClassVar[int] = CONFIG_FORMAT_VERSION

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        _CONFIG_CLASSES[cls.__name__] = cls

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        """Raise :class:`ConfigError` on an invalid field. Subclasses extend this."""

    def data(self) -> dict:
        return {field.name: _to_jsonable(getattr(self, field.name)) for field in dataclasses.fields(self)}

    def to_dict(self) -> dict:
        return {"type": type(self).__name__, "version": type(self).VERSION, "data": self.data()}

    @classmethod
    def from_dict(cls, payload: dict) -> "BackendConfig":
        """Rebuild a config written by :meth:`to_dict` (e.g. read from a checkpoint).

        A plain ``{field: value}`` dict (the reference system's config format) builds ``cls`` itself. A payload
        without ``"version"`` (written before configs were versioned) is read as version 1.

        Raises:
            ConfigError: an unknown type, or an invalid value.
            CheckpointVersionError: a version newer than the class's ``VERSION`` (upgrade aitune or re-tune).
            CheckpointError: a field the class does not have (upgrade aitune or re-tune).
        """
        if not isinstance(payload, dict):
            raise CheckpointError(f"a backend config is stored as a dict, got {type(payload).__name__}")
        if "type" not in payload and cls is not BackendConfig:
            return cls._from_data(cls._checked_fields(dict(payload)))
        type_name = payload.get("type")
        config_class = _CONFIG_CLASSES.get(type_name)
        if config_class is None or not issubclass(config_class, cls):
            raise ConfigError(f"unknown backend config type {type_name!r}; known: {sorted(_CONFIG_CLASSES)}")
        version = payload.get("version", 1)
        if not isinstance(version, int) or isinstance(version, bool) or version < 1:
            raise CheckpointError(f"{type_name}: malformed stored config version {version!r}")
        if version > config_class.VERSION:
            raise CheckpointVersionError(
                f"{type_name} was stored in version {version} by a newer aitune; this aitune reads versions up to "
                f"{config_class.VERSION}. Upgrade aitune (pip install -U aitune) or re-tune and save again")
        data = payload.get("data", {})
        if not isinstance(data, dict):
            raise CheckpointError(f"{type_name}: the stored config's 'data' is a {type(data).__name__}, not a dict")
        return config_class._from_data(config_class._checked_fields(config_class._upgrade(dict(data), version)))

    @classmethod
    def _upgrade(cls, data: dict, version: int) -> dict:
        """The fields of a config stored in an older ``version``, as this ``VERSION`` reads them (identity for
        version 1: no class has changed its stored form yet)."""
        return data

    @classmethod
    def _checked_fields(cls, data: dict) -> dict:
        names = {field.name for field in dataclasses.fields(cls)}
        unknown = sorted(key for key in data if key not in names)
        if unknown:
            raise CheckpointError(
                f"{cls.__name__} has no field {', '.join(repr(key) for key in unknown)}: the stored config was written "
                "by a newer aitune or edited, and running without it would not be the configuration that was "
                f"checked. Upgrade aitune (pip install -U aitune) or re-tune and save again (fields: {sorted(names)})")
        return data

    @classmethod
    def _from_data(cls, data: dict) -> "BackendConfig":
        names = {field.name for field in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})

    def key(self) -> str:
        """sha256 of the canonical JSON of this config plus what invalidates a build (torch version)."""
        canonical = json.dumps({"config": self.to_dict(), "torch": torch.__version__}, sort_keys=True)
        return hashlib.sha256(canonical.encode()).hexdigest()

    def describe(self) -> str:
        """``a=b,c=d`` for the fields that differ from their defaults."""
        default = None
        try:
            default = type(self)()
        except Exception:  # noqa: BLE001 - a config with required fields has no default instance
            pass
        parts = []
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if default is None or _to_jsonable(value) != _to_jsonable(getattr(default, field.name)):
                parts.append(f"{field.name}={_to_jsonable(value)}")
        return ",".join(parts)
