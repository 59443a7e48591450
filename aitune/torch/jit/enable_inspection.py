"""``import aitune.torch.jit.enable_inspection as inspection``: time and describe the modules this process
calls, instead of tuning them; then ``inspection.save_report("inspect.html", "my-model")``.

Importing it calls :func:`aitune.torch.jit.runtime.enable_inspection` (``mode="inspect"``,
``max_depth_level=7``, ``min_parameters=0``). A run that never calls ``save_report`` gets
``jit_inspect_<timestamp>.html`` at exit, in ``jit_config.inspection_dir`` or else the working directory of the
moment inspection was enabled. ``aitune.torch.jit.disable()`` (or ``import aitune.torch.jit.disable``)
stops it and puts every class back. Callable afterwards as ``inspection(**settings)`` (NOTE [callable
enable/disable modules]). What is measured, and how: :mod:`aitune.torch.jit.inspection`.
"""

from aitune.torch.jit._callable import make_callable
from aitune.torch.jit.inspection import (  # noqa: F401 - the module's surface
    InspectModule,
    InspectState,
    describe,
    modules,
    save_report,
    to_dict,
)
from aitune.torch.jit.runtime import enable_inspection

enable_inspection()
make_callable(__name__, enable_inspection)
