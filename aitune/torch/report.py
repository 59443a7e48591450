"""Tuning reports: one row per candidate per graph, as JSON and as a readable table (DESIGN.md §9)."""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
from pathlib import Path
from typing import Any

from aitune import __version__
from aitune.torch.environment import environment  # noqa: F401 - re-exported (reports record it)
from aitune.torch.jsonsafe import json_safe

# Candidate statuses.
SELECTED = "selected"
PASSED = "passed"
FAILED = "failed"
REJECTED_CORRECTNESS = "rejected (correctness)"
REJECTED_PERFORMANCE = "rejected (performance)"
UNAVAILABLE = "unavailable"
UNSUPPORTED = "unsupported"
NO_OP = "no-op"  # a quantizing candidate that quantized nothing: measured eager under another name
SKIPPED = "skipped"
PLANNED = "planned"  # dry run: supports() accepted it, it would be built


@dataclasses.dataclass
class CandidateResult:
    """What happened to one backend on one graph.

    Attributes:
        module / graph: where. backend: registered name. description: ``Class(changed config fields)``.
        status: one of the statuses above. reason: one line naming the real cause (for non-passing rows).
        build_s: build time, s. cached: the build was reused from the tuning cache.
        measurement: latency/throughput figures (see :class:`aitune.torch.profiling.Measurement`).
        speedup: throughput / eager throughput measured in the same run.
        comparison: errors vs eager (samples and probes) and the thresholds used.
        probes: probe counts (``checked``, ``passed``, ``not_accepted`` by the artifact, ``not_run`` for lack of
            time, ``kinds``), see :mod:`aitune.torch.probes`; None when probes were off.
        log_path: full build log. details: backend-specific facts (graph breaks, exporter, profiles...).
    """

    module: str
    graph: str
    backend: str
    description: str
    status: str = PASSED
    reason: str = ""
    build_s: float | None = None
    cached: bool = False
    measurement: dict | None = None
    speedup: float | None = None
    comparison: dict | None = None
    probes: dict | None = None
    log_path: str | None = None
    details: dict = dataclasses.field(default_factory=dict)

    @property
    def throughput(self) -> float | None:
        return None if self.measurement is None else self.measurement["throughput"]

    def to_dict(self) -> dict:
        return json_safe(dataclasses.asdict(self))


@dataclasses.dataclass
class GraphReport:
    """Per graph: the spec, the rows, the selected backend and why.

    ``max_batch_size``: the report of the max-batch-size search (:mod:`aitune.torch.max_batch_size`) when the
    strategy enabled it, else None.
    """

    module: str
    graph: str
    spec: dict
    strategy: str
    selected: str | None = None
    selection_reason: str = ""
    candidates: list[CandidateResult] = dataclasses.field(default_factory=list)
    max_batch_size: dict | None = None

    def to_dict(self) -> dict:
        data = dataclasses.asdict(self)
        data["candidates"] = [row.to_dict() for row in self.candidates]
        return json_safe(data)


@dataclasses.dataclass
class TuneReport:
    """Everything one :func:`aitune.torch.tune` call did."""

    graphs: list[GraphReport] = dataclasses.field(default_factory=list)
    module_errors: dict[str, str] = dataclasses.field(default_factory=dict)
    environment: dict = dataclasses.field(default_factory=dict)
    started_at: str = dataclasses.field(default_factory=lambda: datetime.datetime.now().isoformat(timespec="seconds"))
    duration_s: float = 0.0
    path: str | None = None
    dry_run: bool = False

    @property
    def rows(self) -> list[CandidateResult]:
        return [row for graph in self.graphs for row in graph.candidates]

    def selected(self, module: str, graph: str = "graph0") -> str | None:
        for entry in self.graphs:
            if entry.module == module and entry.graph == graph:
                return entry.selected
        return None

    def to_dict(self) -> dict:
        return {"schema_version": 1, "aitune_version": __version__, "started_at": self.started_at,
                "duration_s": self.duration_s, "dry_run": self.dry_run, "environment": self.environment,
                "module_errors": self.module_errors, "graphs": [graph.to_dict() for graph in self.graphs]}

    def write_json(self, path: Path | str) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2))
        self.path = str(path)
        return path

    def table(self) -> str:
        """Markdown table: module, graph, backend, status, reason, build s, p50/p90 ms, samples/s, speed-up, error."""
        return render_table(self.rows)

    def describe(self) -> str:
        lines = [self.table(), ""]
        for graph in self.graphs:
            chosen = graph.selected or ("nothing built" if self.dry_run else "eager (fallback)")
            lines.append(f"{graph.module}/{graph.graph}: {chosen} — {graph.selection_reason}")
            search = graph.max_batch_size
            if search:
                found = f"{search['max_batch_size']} ({search.get('stopped_by', '')})" if search.get(
                    "status") == "found" else f"{search.get('status')}: {search.get('reason', '')}"
                lines.append(f"  max batch size: {found}")
        for module, error in self.module_errors.items():
            lines.append(f"{module}: tuning failed, runs eager — {error}")
        if self.path:
            lines.append(f"report: {self.path}")
        return "\n".join(lines)


REASON_WIDTH = 60  # longer reasons go below the table, whole (never cut)


def render_table(rows: list[CandidateResult]) -> str:
    """The candidates as a markdown table; reasons longer than ``REASON_WIDTH`` are numbered notes below it."""
    from tabulate import tabulate

    headers = ["module", "graph", "backend", "status", "reason", "build s", "p50 ms", "p90 ms", "samples/s",
               "speed-up", "max abs err", "probes"]
    body, notes = [], []
    for row in rows:
        measurement = row.measurement or {}
        comparison = row.comparison or {}
        error = comparison.get("max_abs_error")
        if comparison.get("metric") == "sqnr+cosine" and comparison.get("min_sqnr_db") is not None:
            error_text = f"{_fmt(error, '.2g')} (SQNR {comparison['min_sqnr_db']:.1f} dB)"
        else:
            error_text = _fmt(error, ".2g")
        reason = " ".join(str(row.reason).split())
        if len(reason) > REASON_WIDTH:
            notes.append(f"[{len(notes) + 1}] {row.module}/{row.graph} {row.description}: {reason}")
            reason = f"see [{len(notes)}] below"
        body.append([
            row.module, row.graph, row.description if len(row.description) <= 50 else row.backend,
            row.status + (" (cached)" if row.cached else ""), reason,
            _fmt(row.build_s, ".1f"), _fmt(measurement.get("p50_ms"), ".3f"), _fmt(measurement.get("p90_ms"), ".3f"),
            _fmt(measurement.get("throughput"), ".1f"),
            "" if row.speedup is None else f"{row.speedup:.2f}x", error_text, _probes_text(row.probes)])
    table = tabulate(body, headers=headers, tablefmt="github")
    return table + ("\n\n" + "\n".join(notes) if notes else "")


def _probes_text(probes: dict | None) -> str:
    """``passed/checked`` (``+n not accepted`` by the artifact, ``n not run`` for lack of time)."""
    if not probes:
        return ""
    text = f"{probes.get('passed', 0)}/{probes.get('checked', 0)}"
    if probes.get("not_run"):
        text += f" ({probes['not_run']} not run)"
    return text


def _fmt(value: Any, spec: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    return format(value, spec)


