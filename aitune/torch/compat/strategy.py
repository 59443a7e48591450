"""A strategy written for the reference system: it overrides ``_tune(...)`` and returns a built backend.

The reference's ``TuneStrategy.tune`` calls ``_pre_tune``, then ``_tune(module, name, graph_spec, data,
device, cache_dir)``, then ``_post_tune``; ``_tune`` builds (deep copies of) backends itself and returns the
chosen one, active. aitune's ``TuneStrategy.tune(context)`` runs that sequence for such a subclass
(:func:`run_reference_tune`, installed into :mod:`aitune.torch.tune_strategy.base` when this module is imported:
NOTE [reference strategies] there) and then applies its own contract to the result: the returned backend is
compared with eager on every recorded sample (unless ``enable_correctness_check(False)``), becomes the graph's
report row, and is what the module dispatches to. ``self.check_correctness(backend, name, graph_spec, data)``
is available inside ``_tune`` as in the reference.
"""

from __future__ import annotations

import time

from aitune.errors import ConfigError
from aitune.torch.backend.base import Backend
from aitune.torch.check.checks import check_against_eager
from aitune.torch.check.correctness import comparator_for
from aitune.torch.check.context import GraphContext
from aitune.torch.report.rows import SELECTED, CandidateResult
from aitune.torch.tune_strategy.base import TuneStrategy, install_reference_contract


def run_reference_tune(strategy: TuneStrategy, context: GraphContext) -> tuple[Backend, list, str]:
    """``_pre_tune`` → ``_tune`` → ``_post_tune``, then aitune's check against eager; see the module docstring.

    Returns:
        ``(backend, [its report row], why)`` as :meth:`TuneStrategy.tune` does.

    Raises:
        ConfigError: ``_tune`` returned something that is not an aitune backend.
        CorrectnessError: the returned backend disagrees with eager (the module then runs eager).
        Whatever ``_tune`` raises.
    """
    arguments = (context.module, context.module_name, context.graph, list(context.graph.samples), context.device,
                 context.workdir)
    strategy._aitune_context = context
    started = time.perf_counter()
    try:
        strategy._pre_tune(*arguments)
        backend = strategy._tune(*arguments)
        strategy._post_tune(*arguments)
    finally:
        strategy._aitune_context = None
    if not isinstance(backend, Backend):
        raise ConfigError(f"{type(strategy).__name__}._tune returned {type(backend).__name__}; it must return the "
                          "built aitune backend it chose")
    row = CandidateResult(module=context.module_name, graph=context.graph.name, backend=backend.name,
                          description=backend.describe(), status=SELECTED,
                          build_s=backend.build_info.get("build_s", time.perf_counter() - started))
    if strategy.correctness_check:
        comparator = comparator_for(backend, strategy.tolerance)
        row.comparison = check_against_eager(backend, context, strategy.tolerance, comparator).to_dict()
    return backend, [row], f"chosen by {type(strategy).__name__}._tune"


def check_correctness(strategy: TuneStrategy, backend: Backend) -> None:
    """The reference's ``check_correctness`` inside ``_tune``: aitune's comparison with eager on every sample.

    Raises:
        ConfigError: called outside ``_tune``.
        CorrectnessError: on the first disagreement.
    """
    context = getattr(strategy, "_aitune_context", None)
    if context is None:
        raise ConfigError("check_correctness() compares with eager's outputs of the graph being tuned; call it "
                          "inside _tune")
    check_against_eager(backend, context, strategy.tolerance, comparator_for(backend, strategy.tolerance))


install_reference_contract(run_reference_tune, check_correctness)
