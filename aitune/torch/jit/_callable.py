"""NOTE [callable enable/disable modules]: the reference spells the switches as imports
(``import aitune.torch.jit.enable``, ``import aitune.torch.jit.disable``) and this package also offers them as
functions (``aitune.torch.jit.disable()``). Importing a submodule sets the package attribute of the same
name to the module, hiding the function; so these two modules act on import *and* are callable, forwarding
to the function. Importing one again does nothing (Python caches modules): call the function instead.
"""

from __future__ import annotations

import sys
import types
from typing import Callable


def make_callable(module_name: str, function: Callable) -> None:
    """Turn the (already imported) module ``module_name`` into a callable that runs ``function``."""

    class CallableModule(types.ModuleType):
        def __call__(self, *args, **kwargs):
            return function(*args, **kwargs)

    sys.modules[module_name].__class__ = CallableModule
