"""Tuning reports: one row per candidate per graph, as JSON, as a readable table and as an HTML page
(the page: :mod:`aitune.torch.report.html`)."""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
from pathlib import Path
from typing import Any

from aitune import __version__
from aitune.errors import ConfigError
from aitune.torch.common.jsonsafe import json_safe
from aitune.torch.report.html import probes_text, render_tune_report, speedup_text

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
        measurement: latency/throughput figures (see :class:`aitune.torch.measure.profiling.Measurement`).
        speedup: how many times eager's throughput: the median of per-round ratios (eager round ms / candidate
            round ms) over rounds timed in alternation with eager (NOTE [paired speed-up] in
            :mod:`aitune.torch.measure.profiling`); 1.0 for eager itself.
        speedup_spread: that figure's spread ``{"q25", "q75", "min", "max", "rounds", "noisy"}`` (x); ``noisy``
            when half the inter-quartile range exceeds 10 % of the median. None when not measured in pairs.
        comparison: errors vs eager (samples and probes) and the thresholds used.
        probes: probe counts (``checked``, ``passed``, ``not_accepted`` by the artifact, ``not_run`` for lack of
            time, ``dropped_memory`` for ``ProbeConfig.max_reference_bytes``, ``kinds``), see
            :mod:`aitune.torch.check.probes`; None when probes were off.
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
    speedup_spread: dict | None = None
    comparison: dict | None = None
    probes: dict | None = None
    log_path: str | None = None
    details: dict = dataclasses.field(default_factory=dict)

    @property
    def throughput(self) -> float | None:
        return None if self.measurement is None else self.measurement["throughput"]

    def to_dict(self) -> dict:
        return json_safe(dataclasses.asdict(self))

    @classmethod
    def from_dict(cls, data: dict) -> "CandidateResult":
        """A row from its JSON form; keys this version does not know are ignored."""
        return cls(**_known_fields(cls, data))


@dataclasses.dataclass
class GraphReport:
    """Per graph: the spec, the rows, the selected backend and why.

    ``max_batch_size``: the report of the max-batch-size search (:mod:`aitune.torch.search.max_batch_size`) when the
    strategy enabled it, else None. ``duration_s``: wall seconds the graph's search took (builds, checks and
    measurements of every candidate, eager's reference run included; the max-batch-size search excluded); None
    for reports that did not time it.
    """

    module: str
    graph: str
    spec: dict
    strategy: str
    selected: str | None = None
    selection_reason: str = ""
    candidates: list[CandidateResult] = dataclasses.field(default_factory=list)
    max_batch_size: dict | None = None
    duration_s: float | None = None

    def to_dict(self) -> dict:
        data = dataclasses.asdict(self)
        data["candidates"] = [row.to_dict() for row in self.candidates]
        return json_safe(data)

    @classmethod
    def from_dict(cls, data: dict) -> "GraphReport":
        fields = _known_fields(cls, data)
        fields["candidates"] = [CandidateResult.from_dict(row) for row in data.get("candidates") or []]
        return cls(**fields)


@dataclasses.dataclass
class TuneReport:
    """Everything one :func:`aitune.torch.tune` call did.

    Attributes:
        graphs: per graph, its candidate rows. module_errors: module name -> why its tuning failed.
        environment: versions and device (:func:`aitune.torch.common.environment.environment`).
        started_at: ISO time (for a report read from a checkpoint: when it was saved). duration_s: s, the whole call.
        recording_s: s of ``ait.tune``'s recording pass (the user's function over the dataset, eager); None when
            the run recorded nothing itself (just-in-time tuning, :func:`~aitune.torch.tuning.tune_modules`).
        path: the file it was written to or read from. checkpoint_rows_only: read from a ``.ait`` manifest, which
            keeps only the chosen backend's row per graph (:meth:`from_manifest`).
        peak_memory: the tuning's peak memory, ``{"host_bytes", "device_bytes", "host_method"}`` (bytes; the
            process's resident high-water mark and PyTorch's largest CUDA allocation peak, recording pass
            included, max-batch-size search excluded: NOTE [measuring peak memory] in
            :mod:`aitune.torch.measure.memory`); None for reports that did not measure it.
    """

    graphs: list[GraphReport] = dataclasses.field(default_factory=list)
    module_errors: dict[str, str] = dataclasses.field(default_factory=dict)
    environment: dict = dataclasses.field(default_factory=dict)
    started_at: str = dataclasses.field(default_factory=lambda: datetime.datetime.now().isoformat(timespec="seconds"))
    duration_s: float = 0.0
    path: str | None = None
    dry_run: bool = False
    checkpoint_rows_only: bool = False
    peak_memory: dict | None = None
    recording_s: float | None = None

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
                "duration_s": self.duration_s, "recording_s": self.recording_s, "dry_run": self.dry_run,
                "environment": self.environment,
                "module_errors": self.module_errors, "peak_memory": self.peak_memory,
                "graphs": [graph.to_dict() for graph in self.graphs]}

    def write_json(self, path: Path | str) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2))
        self.path = str(path)
        return path

    @classmethod
    def from_dict(cls, data: dict, path: str | None = None) -> "TuneReport":
        """A report from its JSON form (:meth:`to_dict`).

        Raises:
            ConfigError: ``data`` is not a tune report (no ``graphs`` list).
        """
        if not isinstance(data, dict) or not isinstance(data.get("graphs"), list):
            raise ConfigError("not an aitune tune report: expected a JSON object with a 'graphs' list "
                              "(what ait.tune writes to <cache>/reports/tune-*.json)")
        return cls(graphs=[GraphReport.from_dict(graph) for graph in data["graphs"]],
                   module_errors=dict(data.get("module_errors") or {}), environment=dict(data.get("environment") or {}),
                   started_at=str(data.get("started_at", "")), duration_s=float(data.get("duration_s") or 0.0),
                   path=path, peak_memory=data.get("peak_memory"), recording_s=data.get("recording_s"))

    @classmethod
    def from_json(cls, path: Path | str) -> "TuneReport":
        """Read a report written by :meth:`write_json` (``ait.tune`` writes ``<cache>/reports/tune-*.json``).

        Raises:
            ConfigError: the file is not JSON or not a tune report. OSError: it cannot be read.
        """
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{path} is not a JSON tune report: {exc}") from exc
        return cls.from_dict(data, path=str(path))

    @classmethod
    def from_manifest(cls, manifest: dict, path: Path | str | None = None) -> "TuneReport":
        """The tune rows a checkpoint keeps, as a report: per graph only the chosen backend's row.

        Args:
            manifest: a ``.ait`` checkpoint's manifest, as
                :func:`aitune.torch.checkpoint.manifest.read_manifest` returns it (JSON only: reading it
                loads no code from the checkpoint).
            path: the checkpoint, shown in the page.
        """
        graphs = []
        for module in manifest.get("modules") or []:
            for graph in module.get("graphs") or []:
                row = graph.get("tune_row")
                description = graph.get("description") or graph.get("backend") or "?"
                candidate = (CandidateResult.from_dict(row) if row else
                             CandidateResult(module=module.get("name", "?"), graph=graph.get("name", "?"),
                                             backend=graph.get("backend", "?"), description=description,
                                             status=SELECTED, reason="no tune row stored in the checkpoint"))
                graphs.append(GraphReport(module=module.get("name", "?"), graph=graph.get("name", "?"),
                                          spec=graph.get("spec") or {}, strategy=module.get("strategy") or "",
                                          selected=description,
                                          selection_reason="chosen when tuning (the checkpoint keeps this row only)",
                                          candidates=[candidate]))
        environment = {key: value for key, value in (manifest.get("versions") or {}).items() if value is not None}
        environment["platform"] = manifest.get("platform")
        device = manifest.get("device") or {}
        environment["device"] = " ".join(str(part) for part in (device.get("type"), device.get("name")) if part)
        if device.get("capability"):
            environment["capability"] = ".".join(map(str, device["capability"]))
        environment["checkpoint format"] = f"{manifest.get('format')} {manifest.get('format_version')}"
        return cls(graphs=graphs, environment=environment, started_at=str(manifest.get("created_at", "")),
                   duration_s=0.0, path=None if path is None else str(path), checkpoint_rows_only=True)

    def to_html(self, path: Path | str | None = None) -> str:
        """The report as one self-contained HTML page (:mod:`aitune.torch.report.html`): selected backends and
        why, per graph the latency distribution, speed-up vs error and probes of every candidate (figures need
        matplotlib: ``pip install 'aitune[report]'``), the full candidates table, what failed, was rejected,
        skipped or unavailable and why, and the environment.

        Args:
            path: also write the page there (UTF-8), creating folders.

        Returns:
            The page's HTML text.
        """
        page = render_tune_report(self.to_dict(), source=self.path, checkpoint=self.checkpoint_rows_only)
        if path is not None:
            path = Path(path)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(page, encoding="utf-8")
        return page

    def table(self) -> str:
        """Markdown table: module, graph, backend, status, reason, build s, p50/p90 ms, samples/s, speed-up (the
        median over rounds timed in alternation with eager of eager's round time over the candidate's, with the
        quartiles of those ratios; ``~`` and ``noisy`` when they spread too widely:
        :func:`~aitune.torch.report.html.page.speedup_text`), max abs error, probes."""
        return render_table(self.rows)

    def describe(self) -> str:
        lines = [self.table(), ""]
        for graph in self.graphs:
            chosen = graph.selected or ("nothing built" if self.dry_run else "eager (fallback)")
            lines.append(f"{graph.module}/{graph.graph}: {chosen} — {graph.selection_reason}")
            if (graph.spec or {}).get("nondeterministic"):
                lines.append(f"  forward is nondeterministic: {graph.spec['nondeterministic']}")
            if (graph.spec or {}).get("rounding_spread"):
                lines.append(f"  two eager runs differ by rounding only ({graph.spec['rounding_spread']}): judged "
                             "as deterministic, without the run-time guard")
            search = graph.max_batch_size
            if search:
                found = f"{search['max_batch_size']} ({search.get('stopped_by', '')})" if search.get(
                    "status") == "found" else f"{search.get('status')}: {search.get('reason', '')}"
                lines.append(f"  max batch size: {found}")
        for module, error in self.module_errors.items():
            lines.append(f"{module}: tuning failed, runs eager — {error}")
        timing = self.timing_text()
        if timing:
            lines.append(timing)
        if self.peak_memory:
            lines.append(f"peak memory while tuning: {peak_memory_text(self.peak_memory)}")
        if self.path:
            lines.append(f"report: {self.path}")
        return "\n".join(lines)

    def timing_text(self) -> str:
        """Where the tune's wall time went: ``"tune 185.1 s: recording 13.2 s; decoder/prefill 110.3 s (builds
        88.1 s); ..."``; a build's seconds are its rows' ``build s`` summed (a build taken from the cache counts
        its load). Empty for reports without timings (dry runs, checkpoint rows)."""
        if self.dry_run or self.checkpoint_rows_only or not self.duration_s:
            return ""
        parts = [] if self.recording_s is None else [f"recording {self.recording_s:.1f} s"]
        for graph in self.graphs:
            if graph.duration_s is None:
                continue
            builds = sum(row.build_s or 0.0 for row in graph.candidates)
            parts.append(f"{graph.module}/{graph.graph} {graph.duration_s:.1f} s (builds {builds:.1f} s)")
        return f"tune {self.duration_s:.1f} s: " + "; ".join(parts) if parts else ""


REASON_WIDTH = 60  # longer reasons go below the table, whole (never cut)


def render_table(rows: list[CandidateResult]) -> str:
    """The candidates as a markdown table; reasons longer than ``REASON_WIDTH`` are numbered notes below it."""
    from tabulate import tabulate

    headers = ["module", "graph", "backend", "config", "status", "reason", "build s", "p50 ms", "p90 ms",
               "samples/s", "speed-up (paired)", "max abs err", "probes"]
    body, notes = [], []
    for row in rows:
        measurement = row.measurement or {}
        comparison = row.comparison or {}
        error = comparison.get("max_abs_error")
        if comparison.get("min_sqnr_db") is not None:  # quantizing and reduced-precision candidates
            error_text = f"{_fmt(error, '.2g')} (SQNR {comparison['min_sqnr_db']:.1f} dB)"
        else:
            error_text = _fmt(error, ".2g")
        reason = " ".join(str(row.reason).split())
        if len(reason) > REASON_WIDTH:
            notes.append(f"[{len(notes) + 1}] {row.module}/{row.graph} {row.description}: {reason}")
            reason = f"see [{len(notes)}] below"
        body.append([
            row.module, row.graph, row.backend, _config_text(row.description),
            row.status + (" (cached)" if row.cached else ""), reason,
            _fmt(row.build_s, ".1f"), _fmt(measurement.get("p50_ms"), ".3f"), _fmt(measurement.get("p90_ms"), ".3f"),
            _fmt(measurement.get("throughput"), ".1f"),
            speedup_text(row.speedup, row.speedup_spread), error_text, _probes_cell(row.probes)])
    table = tabulate(body, headers=headers, tablefmt="github")
    return table + ("\n\n" + "\n".join(notes) if notes else "")


def _probes_cell(probes: dict | None) -> str:
    """:func:`probes_text` plus the probes dropped for their reference memory."""
    text = probes_text(probes)
    dropped = (probes or {}).get("dropped_memory")
    return f"{text} ({dropped} dropped: memory)" if dropped else text


def peak_memory_text(peak_memory: dict) -> str:
    """``host 3.21 GiB (VmHWM), device 0.80 GiB`` from a report's ``peak_memory``."""
    parts = []
    if peak_memory.get("host_bytes") is not None:
        parts.append(f"host {peak_memory['host_bytes'] / 2**30:.2f} GiB ({peak_memory.get('host_method', '?')})")
    if peak_memory.get("device_bytes") is not None:
        parts.append(f"device {peak_memory['device_bytes'] / 2**30:.2f} GiB (PyTorch allocator)")
    return ", ".join(parts) or "not measured"


def _config_text(description: str) -> str:
    """``Class(a=b,c=d)`` -> ``a=b, c=d`` (the fields that differ from the defaults; empty for defaults)."""
    inner = description.partition("(")[2].rpartition(")")[0]
    return inner.replace(",", ", ") if inner else "default"


def _known_fields(cls, data: dict) -> dict:
    names = {field.name for field in dataclasses.fields(cls)}
    return {key: value for key, value in data.items() if key in names}


def _fmt(value: Any, spec: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    return format(value, spec)


