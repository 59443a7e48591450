"""Kernel forge: replace expensive ``torch.nn.functional`` calls (SDPA) with faster, checked kernels.

``KernelOptimizer`` finds the ``scaled_dot_product_attention`` calls a module makes, checks each
kernel provider against the original and times it; the resulting ``KernelOptimizationPlan`` is applied
per call, scoped to one module's forward (:mod:`aitune.torch.kernel_forge.plan`). Providers live in
:mod:`aitune.torch.kernel_forge.kernel_provider`.
"""

from aitune.torch.kernel_forge.optimizer import KernelOptimizer
from aitune.torch.kernel_forge.plan import KernelChoice, KernelOptimizationPlan, PlannedModule

__all__ = ["KernelChoice", "KernelOptimizationPlan", "KernelOptimizer", "PlannedModule"]
