"""The tune report page: per graph the selected backend and why, latency and error figures, the candidates
table, everything not used with its whole reason, and the environment."""

from __future__ import annotations

from aitune import __version__
from aitune.torch.report.html.figures import _FigureMaker
from aitune.torch.report.html.page import (
    REPORT_EXTRA,
    _badge,
    _e,
    _environment_section,
    _inputs_text,
    _is_number,
    _name,
    _num,
    _page,
    _row_order,
    speedup_text,
    _style,
    _table,
    probes_text,
)


def render_tune_report(data: dict, *, source: str | None = None, checkpoint: bool = False) -> str:
    """One HTML page for a tune report.

    Args:
        data: :meth:`TuneReport.to_dict <aitune.torch.report.rows.TuneReport.to_dict>` (the JSON report).
        source: the file it came from, shown in the header.
        checkpoint: the rows come from a ``.ait`` checkpoint's manifest (only the chosen row per graph).

    Returns:
        The page (UTF-8 text, self-contained: NOTE [self-contained pages]).
    """
    figures = _FigureMaker()
    graphs = data.get("graphs") or []
    environment = data.get("environment") or {}
    rows = [row for graph in graphs for row in graph.get("candidates") or []]
    title = "aitune checkpoint" if checkpoint else "aitune tune report"
    body = [f"<h1>{_e(title)}</h1>", _report_meta(data, source, checkpoint, len(graphs), rows)]
    if checkpoint:
        body.append('<p class="note">A checkpoint keeps only the chosen backend\'s row per graph: the candidates '
                    "it beat, and why the others were not used, are in the tune report JSON written by "
                    "<code>ait.tune</code> (<code>&lt;cache&gt;/reports/tune-*.json</code>).</p>")
    if not figures.available:
        body.append(f'<p class="note" id="no-figures">Figures need matplotlib: <code>{_e(REPORT_EXTRA)}</code>. '
                    "The tables below hold every figure's numbers.</p>")
    body.append(_selection_summary(graphs, data.get("module_errors") or {}))
    for index, graph in enumerate(graphs):
        body.append(_graph_section(index, graph, figures, checkpoint))
    body.append(_not_used_section(rows, data.get("module_errors") or {}, checkpoint))
    body.append(_environment_section(environment))
    body.append(f'<p class="meta">Page made by aitune {_e(__version__)}.</p>')
    return _page(title + (f" — {source}" if source else ""), body)


def _report_meta(data: dict, source: str | None, checkpoint: bool, num_graphs: int, rows: list[dict]) -> str:
    counts: dict[str, int] = {}
    for row in rows:
        counts[row.get("status", "?")] = counts.get(row.get("status", "?"), 0) + 1
    when = "saved" if checkpoint else "started"
    parts = [f"{when} {_e(data.get('started_at', '?'))}"]
    if not checkpoint and data.get("duration_s") is not None:
        parts.append(f"took {_num(data.get('duration_s'), '.1f')} s")
        if data.get("recording_s") is not None:
            parts.append(f"recording {_num(data.get('recording_s'), '.1f')} s")
    parts.append(f"{num_graphs} graph(s), {len(rows)} candidate row(s)")
    status_text = ", ".join(f"{count} {_e(status)}" for status, count in
                            sorted(counts.items(), key=lambda item: _style(item[0])[1]))
    lines = [f'<p class="meta">{" · ".join(parts)}' + (f" — {status_text}" if status_text else "") + "</p>"]
    if source:
        lines.append(f'<p class="meta">file: <code>{_e(source)}</code></p>')
    return "\n".join(lines)


def _selection_summary(graphs: list[dict], module_errors: dict) -> str:
    body = []
    for index, graph in enumerate(graphs):
        selected_row = next((row for row in graph.get("candidates") or [] if row.get("status") == "selected"), None)
        speedup, spread = (selected_row or {}).get("speedup"), (selected_row or {}).get("speedup_spread")
        body.append([f'<a href="#graph-{index}">{_e(graph.get("module"))}/{_e(graph.get("graph"))}</a>',
                     _e(graph.get("selected") or "eager (fallback)"),
                     ("", "num", speedup_text(speedup, spread)),
                     ("", "reason", _e(graph.get("selection_reason", "")))])
    for module, error in module_errors.items():
        body.append([_e(module), "eager (tuning failed)", ("", "num", ""), ("", "reason", _e(error))])
    if not body:
        return "<h2>Selected backends</h2><p>No graph was tuned.</p>"
    return ("<h2>Selected backends</h2>"
            + _table(["graph", "selected", "speed-up vs eager", "why"], body, css_class="summary"))


def _graph_section(index: int, graph: dict, figures: "_FigureMaker", checkpoint: bool) -> str:
    rows = sorted(graph.get("candidates") or [], key=_row_order)
    name = f"{graph.get('module')}/{graph.get('graph')}"
    parts = [f'<h2 id="graph-{index}">{_e(name)}</h2>',
             f'<p><b>selected:</b> {_e(graph.get("selected") or "eager (fallback)")} — '
             f'{_e(graph.get("selection_reason", ""))}</p>']
    if graph.get("strategy"):
        parts.append(f'<p class="muted">strategy: <code>{_e(graph["strategy"])}</code></p>')
    if not checkpoint and graph.get("duration_s") is not None:  # (TuneReport.timing_text, per graph)
        builds = sum(row.get("build_s") or 0.0 for row in graph.get("candidates") or [])
        parts.append(f'<p class="muted">took {_num(graph["duration_s"], ".1f")} s (builds, checks and measurements; '
                     f'candidates\' builds {_num(builds, ".1f")} s summed)</p>')
    inputs = _inputs_text(graph.get("spec") or {})
    if inputs:
        parts.append(f'<p class="muted">inputs (min..max shape, b = batch axis): <code>{_e(inputs)}</code></p>')
    if figures.available:
        charts = [
            figures.speed_and_error(f"speed-error-{index}", rows),
            figures.latency(f"latency-{index}", rows),
            figures.probes(f"probes-{index}", rows),
        ]
        charts = [chart for chart in charts if chart]
        if charts:
            parts.append('<div class="figures">' + "".join(charts) + "</div>")
    parts.append("<h3>Candidates</h3>" + _candidates_table(rows))
    timing_rows = [row for row in rows if (row.get("measurement") or {}).get("samples")]
    if timing_rows:
        parts.append("<details><summary>Latency per recorded sample (ms)</summary>"
                     + _sample_table(timing_rows) + "</details>")
    return "\n".join(parts)


def _candidates_table(rows: list[dict]) -> str:
    """Every row; its reason, whole, on a line of its own below the figures (reasons are never cut)."""
    headers = ["backend", "status", "build s", "p50 / p90 / p99 ms", "samples/s", "speed-up",
               "max error vs eager: abs / rel", "probes passed"]
    body = []
    for row in rows:
        measurement = row.get("measurement") or {}
        comparison = row.get("comparison") or {}
        status = row.get("status", "?")
        sqnr, cosine = comparison.get("min_sqnr_db"), comparison.get("min_cosine")
        quality = ", ".join(part for part in (f"SQNR {_num(sqnr, '.1f')} dB" if _is_number(sqnr) else "",
                                              f"cos {_num(cosine, '.5f')}" if _is_number(cosine) else "") if part)
        latency = " / ".join(_num(measurement.get(key), ".3g") for key in ("p50_ms", "p90_ms", "p99_ms"))
        errors = " / ".join(_num(comparison.get(key), ".3g") for key in ("max_abs_error", "max_rel_error"))
        row_class = "selected" if status == "selected" else ""
        body.append({"class": row_class + (" has-reason" if row.get("reason") else ""), "cells": [
            ("", "backend", f'{_e(_name(row))}<br><span class="muted mono">{_e(row.get("backend"))}</span>'),
            _badge(status) + (' <span class="muted">cached</span>' if row.get("cached") else ""),
            ("", "num", _num(row.get("build_s"), ".1f")),
            ("", "num", latency if measurement else ""),
            ("", "num", _num(measurement.get("throughput"), ",.1f")),
            ("", "num", speedup_text(row.get("speedup"), row.get("speedup_spread"))),
            ("", "num", (errors if comparison else "") + (f"<br>{quality}" if quality else "")),
            ("", "probes", probes_text(row.get("probes"))),
        ]})
        if row.get("reason"):
            body.append({"class": row_class + " reason-row",
                         "cells": [("", "reason", f'<span class="muted">reason:</span> {_e(row["reason"])}',
                                    len(headers))]})
    return _table(headers, body, css_class="candidates")


def _sample_table(rows: list[dict]) -> str:
    body = []
    for row in rows:
        for timing in row["measurement"]["samples"]:
            body.append([_e(_name(row)), ("", "num", str(timing.get("batch_size", ""))),
                         ("", "num", str(timing.get("calls", "")))]
                        + [("", "num", _num(timing.get(key), ".4g")) for key in
                           ("p50_ms", "p90_ms", "p99_ms", "mean_ms", "std_ms")])
    return _table(["backend", "batch size", "calls", "p50", "p90", "p99", "mean", "std"], body, css_class="samples")


def _not_used_section(rows: list[dict], module_errors: dict, checkpoint: bool) -> str:
    """Every failed/rejected/unavailable/unsupported/skipped/no-op row in one table, by status, whole reasons."""
    parts = ['<h2 id="not-used">Not used, and why</h2>']
    if checkpoint:
        parts.append("<p>Not recorded in a checkpoint (see the tune report JSON).</p>")
        return "\n".join(parts)
    listed = sorted((row for row in rows if row.get("status") not in ("selected", "passed")),
                    key=lambda row: (_style(row.get("status"))[1], str(row.get("status")), str(row.get("module")),
                                     str(row.get("graph"))))
    if listed:
        counts: dict[str, int] = {}
        for row in listed:
            counts[row.get("status", "?")] = counts.get(row.get("status", "?"), 0) + 1
        parts.append("<p>" + ", ".join(f"{count} {_e(status)}" for status, count in counts.items()) + ".</p>")
        body = [[_badge(row.get("status")), f'{_e(row.get("module"))}/{_e(row.get("graph"))}', _e(_name(row)),
                 ("", "reason", _e(row.get("reason", "")) or '<span class="muted">(no reason recorded)</span>'),
                 ("", "path", f'<code>{_e(row["log_path"])}</code>' if row.get("log_path") else "")]
                for row in listed]
        parts.append(_table(["status", "graph", "backend", "reason", "build log"], body, css_class="not-used",
                            widths=["190px", "12%", "22%", "34%", "22%"]))
    if module_errors:
        parts.append("<h3>Modules whose tuning failed (they run eager)</h3><ul class=\"reasons\">"
                     + "".join(f"<li><b>{_e(module)}</b>: {_e(error)}</li>" for module, error in module_errors.items())
                     + "</ul>")
    if not listed and not module_errors:
        parts.append("<p>Every candidate passed.</p>")
    return "\n".join(parts)
