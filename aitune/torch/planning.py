"""``ait.tune(..., dry_run=True)``: record and plan, build nothing.

For every recorded graph of every module: the strategy that would tune it, the candidates it would try and
each one's ``supports()`` verdict (``planned`` when it would be built; ``unavailable``/``unsupported`` with the
reason otherwise), and whether the max-batch-size search would run. The modules keep their recordings and stay
in the RECORDING state, so a later ``ait.tune`` tunes them (with everything recorded by both calls).
"""

from __future__ import annotations

import datetime
import logging
import time
from pathlib import Path
from typing import Callable, Iterable

import torch

from aitune.torch.report import telemetry
from aitune.torch.common.environment import environment
from aitune.torch.report.rows import PLANNED, UNAVAILABLE, UNSUPPORTED, CandidateResult, GraphReport, TuneReport
from aitune.torch.tune_strategy import MaxThroughputStrategy

logger = logging.getLogger(__name__)

__all__ = ["plan_modules"]


def plan_modules(modules: Iterable, device_for: Callable, root: Path, report_path: str | Path | None = None,
                 started: float | None = None) -> TuneReport:
    """The dry-run report of ``modules`` (see the module docstring).

    Args:
        modules: :class:`~aitune.torch.Module` wrappers with recorded graphs.
        device_for: the device each module would be tuned on (``ait.tune``'s device rule).
        root: the cache root (builds would go to ``<root>/<module>/<graph>/<backend key>/``).
        report_path: JSON report path (default ``<root>/reports/dry-run-<time>.json``).
        started: ``perf_counter()`` at the start of ``ait.tune``.

    Returns:
        A :class:`~aitune.torch.report.rows.TuneReport` with ``dry_run=True``, rows ``planned``/``unavailable``/
        ``unsupported``, and no selected backend.
    """
    started = time.perf_counter() if started is None else started
    report = TuneReport(environment=environment(), dry_run=True)
    telemetry.begin_run(report)
    for module in modules:
        device = device_for(module)
        original = module.module
        parameters = sum(p.numel() for p in original.parameters())
        precisions = sorted({str(p.dtype).removeprefix("torch.") for p in original.parameters()})
        for graph in module.graphs:
            if not graph.samples:
                continue
            strategy = module.strategy_for(graph) or MaxThroughputStrategy()
            entry = GraphReport(module=module.name, graph=graph.name, spec=graph.describe(),
                                strategy=strategy.describe(), selection_reason="dry run: nothing built")
            search = getattr(strategy, "max_batch_size_search", None)
            if search is not None:
                entry.max_batch_size = {"enabled": True, "status": "planned", "max_batch_size_cap": search.max_batch_size,
                                        "reason": "would search before tuning" if graph.has_batch_axis
                                        else "would be skipped: no batch axis recorded"}
            for blueprint in strategy.candidates(device, module.module, graph):
                entry.candidates.append(_plan_row(blueprint, module, graph, device))
            report.graphs.append(entry)
            logger.info("aitune: dry run %s/%s — %d parameter(s) (%s), %d sample(s), inputs %s, device %s, "
                        "builds under %s, strategy %s: %s", module.name, graph.name, parameters,
                        ",".join(precisions) or "-", len(graph.samples),
                        [f"{s.path}{list(s.max_shape)}" for s in graph.tensor_specs], device,
                        root / module.name / graph.name, strategy.describe(),
                        ", ".join(f"{row.description}: {row.status}" for row in entry.candidates))
    report.duration_s = time.perf_counter() - started
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S-%f")
    report.write_json(report_path or root / "reports" / f"dry-run-{stamp}.json")
    telemetry.end_run(report)
    logger.info("aitune: dry run report\n%s", report.describe())
    return report


def _plan_row(blueprint, module, graph, device: torch.device) -> CandidateResult:
    row = CandidateResult(module=module.name, graph=graph.name, backend=blueprint.name,
                          description=blueprint.describe())
    try:
        verdict = blueprint.supports(module.module, graph, device)
    except Exception as exc:  # noqa: BLE001 - a crashing eligibility check is a row, as in tuning
        row.status, row.reason = UNSUPPORTED, f"supports() raised {type(exc).__name__}: {exc}"
        return row
    if verdict.ok:
        row.status, row.reason = PLANNED, verdict.reason or "would be built, checked against eager and measured"
    else:
        row.status = UNAVAILABLE if not blueprint.availability().ok else UNSUPPORTED
        row.reason = verdict.reason
    return row
