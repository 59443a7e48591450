"""Names the reference system renamed, still used by its examples: resolved with a DeprecationWarning.

``HighestThroughputStrategy`` became ``MaxThroughputStrategy``; ``TorchInductorBackend(Config)`` became
``TorchInductorJitBackend(Config)`` (reference 0.4). The old names are not part of aitune's public surface
(``__all__``); a module's ``__getattr__`` resolves them through :func:`resolve`.
"""

from __future__ import annotations

import importlib
import warnings

__all__ = ["LEGACY_NAMES", "resolve"]

#: package -> {old name: (module, new name)}
LEGACY_NAMES = {
    "aitune.torch": {"HighestThroughputStrategy": ("aitune.torch.tune_strategy", "MaxThroughputStrategy")},
    "aitune.torch.tune_strategy": {"HighestThroughputStrategy": ("aitune.torch.tune_strategy",
                                                                 "MaxThroughputStrategy")},
    "aitune.torch.backend": {
        "TorchInductorBackend": ("aitune.torch.backend", "TorchInductorJitBackend"),
        "TorchInductorBackendConfig": ("aitune.torch.backend", "TorchInductorJitBackendConfig"),
    },
}


def resolve(package: str, name: str):
    """The object an old ``name`` of ``package`` stands for (warns once per call site).

    Raises:
        AttributeError: ``name`` is neither current nor a known old name.
    """
    entry = LEGACY_NAMES.get(package, {}).get(name)
    if entry is None:
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    module, new_name = entry
    warnings.warn(f"{package}.{name} is the reference system's old name of {new_name}; use {new_name}",
                  DeprecationWarning, stacklevel=3)
    return getattr(importlib.import_module(module), new_name)
