"""``import aitune.torch.jit.enable``: just-in-time tuning for every top-level module of this process.

Also the target of the ``autowrapt`` entry point (``AUTOWRAPT_BOOTSTRAP=aitune_enable_jit_tuning``): wrapt
imports this module right after ``torch`` and calls :func:`wrapt_auto_enable`. Callable afterwards as
``aitune.torch.jit.enable(**settings)`` (NOTE [callable enable/disable modules]).
"""

from aitune.torch.jit._callable import make_callable
from aitune.torch.jit.runtime import enable


def wrapt_auto_enable(module=None) -> None:
    """The ``aitune_enable_jit_tuning`` entry point: called by wrapt once ``torch`` is imported."""
    enable()


enable()
make_callable(__name__, enable)
