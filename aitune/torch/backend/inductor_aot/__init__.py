"""TorchInductorAotBackend (sub-package): ``torch.export`` + AOTInductor, a self-contained ``model.pt2`` package.

Build steps (the backend contract: :mod:`aitune.torch.backend.base`; child processes:
:mod:`aitune.torch.backend.isolation`; reference: ``torch._inductor.aoti_compile_and_package`` /
``aoti_load_package``, PyTorch "AOTInductor" tutorial):

1. Parent: ``torch.export.export`` of the graph's :class:`~aitune.torch.backend.flat.FlatModule` with one
   shared ``Dim("batch")`` for every batch axis (derived ``k * batch`` for axes of size ``k * batch``),
   named ``Dim``s for user-declared :class:`~aitune.torch.record.samples.DynamicDim` axes and bounded ``Dim.AUTO``
   for other recorded dynamic axes. The ExportedProgram is saved with ``torch.export.save``.
2. Child process (:func:`aitune.torch.backend.isolation.run_isolated`): load it, ``aoti_compile_and_package`` to
   ``model.pt2``, load the package and run it once on a sample saved as safetensors, compare the output
   shapes and dtypes with eager. A segfault, abort or hang there fails the build with its reason.
3. Parent: only then loads the package itself.

NOTE [batch 1 and export]: ``torch.export`` specialises sizes 0 and 1 (pytorch/pytorch#133653):
an example with batch 1 pins the batch axis to 1. The export example therefore has batch >= 2: a recorded
sample with batch >= 2 when there is one, else the sample repeated along its batch axes. After export the
input placeholders are inspected: an axis that export specialised anyway, or whose range it narrowed, is
recorded in ``build_info["specialized_axes"]`` / ``build_info["accepted_ranges"]`` and :meth:`accepts`
takes only those sizes, so other shapes run eager instead of a wrong artifact.

Modules: ``config`` (the backend's config), ``export_plan`` (export example, ``dynamic_shapes``, ranges export
kept), ``runtime`` (loading a package, checking its outputs), ``canary`` (NOTE [AOTInductor canary]),
``child_step`` (the isolated compile-load-check step), ``backend`` (the backend itself).
"""

from aitune.torch.backend.inductor_aot.backend import (
    CHECK_SAMPLE_FILE,
    CHILD_LOG_FILE,
    EXPORTED_FILE,
    MIN_TORCH_VERSION,
    PACKAGE_FILE,
    TorchInductorAotBackend,
)
from aitune.torch.backend.inductor_aot.canary import loads_here
from aitune.torch.backend.inductor_aot.child_step import compile_and_check_package
from aitune.torch.backend.inductor_aot.config import TorchInductorAotBackendConfig
from aitune.torch.backend.inductor_aot.runtime import check_outputs, load_package

__all__ = [
    "CHECK_SAMPLE_FILE",
    "CHILD_LOG_FILE",
    "EXPORTED_FILE",
    "MIN_TORCH_VERSION",
    "PACKAGE_FILE",
    "TorchInductorAotBackend",
    "TorchInductorAotBackendConfig",
    "check_outputs",
    "compile_and_check_package",
    "load_package",
    "loads_here",
]
