"""Self-contained HTML pages: a tune report, an ``ait.inspect`` result and a JIT inspection, to look at rather
than read.

A tune report page shows, per graph, the selected backend and why, the latency distribution of every
measured candidate, speed-up vs eager beside the error vs eager, probes passed per candidate and the full
candidates table; then everything that failed, was rejected, skipped or unavailable with its whole reason,
and the environment. An inspection page shows which modules of a pipeline take the time. The JIT
inspection page ("Model Inspector") shows the module tree a run called, as collapsible ``<details>``
elements, with each module's self and total time, calls, parameters, input/output types and batch axes.

NOTE [self-contained pages]: a page is one file that fetches nothing: CSS and figures are inline (figures
as inline SVG, text kept as text), there is no script, and a Content-Security-Policy meta tag
(``default-src 'none'``) makes the browser refuse any fetch the page might still attempt. It opens from a
mail attachment, an air-gapped machine or a CI artifact alike.

NOTE [figures are optional]: figures are drawn by matplotlib (``pip install 'aitune[report]'``) through its
object-oriented API (``matplotlib.figure.Figure``, never ``pyplot``), so rendering leaves the caller's
matplotlib backend and global state alone. Without matplotlib the page has every table and says which
extra adds the figures.

The renderer reads the report's JSON form (:meth:`aitune.torch.report.TuneReport.to_dict`): a report
file written by another aitune version renders as long as its rows keep the same keys; the statuses
below are those JSON strings.
"""

from __future__ import annotations

import html
import io
import math
import re
import textwrap
from typing import Any, Iterable

from aitune import __version__

REPORT_EXTRA = "pip install 'aitune[report]'"

# Status (JSON string) -> (colour, order in tables). Colours: Okabe-Ito palette (safe for colour blindness).
_STATUS_STYLE = {
    "selected": ("#009E73", 0),
    "passed": ("#0072B2", 1),
    "rejected (performance)": ("#E69F00", 2),
    "rejected (correctness)": ("#D55E00", 3),
    "failed": ("#CC3311", 4),
    "no-op": ("#999999", 5),
    "unsupported": ("#999999", 6),
    "unavailable": ("#999999", 7),
    "skipped": ("#999999", 8),
    # JIT inspection states
    "inspect": ("#0072B2", 10),
    "init": ("#999999", 11),
    "detached": ("#777777", 12),
}
_UNKNOWN_STYLE = ("#777777", 9)

_CSS = """
:root { --ink: #1f2328; --muted: #59636e; --line: #d1d9e0; --soft: #f6f8fa; }
* { box-sizing: border-box; }
body { margin: 0; font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, "DejaVu Sans", sans-serif;
       color: var(--ink); background: #fff; }
main { max-width: 1360px; margin: 0 auto; padding: 24px 28px 48px; }
h1 { font-size: 24px; margin: 0 0 4px; }
h2 { font-size: 19px; margin: 36px 0 8px; padding-bottom: 4px; border-bottom: 1px solid var(--line); }
h3 { font-size: 15px; margin: 22px 0 6px; }
p.meta, p.note, figcaption, .muted { color: var(--muted); }
p.note { background: var(--soft); border-left: 3px solid var(--line); padding: 6px 10px; }
code, .mono { font-family: ui-monospace, "SFMono-Regular", "DejaVu Sans Mono", Menlo, monospace; font-size: 12.5px; }
.table-wrap { overflow-x: auto; margin: 6px 0 10px; }
table { border-collapse: collapse; font-size: 13px; }
th, td { border-bottom: 1px solid var(--line); padding: 5px 9px; text-align: left; vertical-align: top; }
th { background: var(--soft); font-weight: 600; vertical-align: bottom; }
td.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
td.reason { min-width: 260px; max-width: 640px; white-space: pre-wrap; overflow-wrap: anywhere; }
table.candidates td.reason { max-width: none; padding-top: 0; padding-left: 22px; }
table.candidates tr.has-reason td { border-bottom: none; }
td.path { overflow-wrap: anywhere; max-width: 360px; }
td.backend { min-width: 210px; max-width: 340px; overflow-wrap: break-word; }
td.probes { text-align: right; min-width: 90px; }
table.not-used td { overflow-wrap: anywhere; }
tr.selected td { background: #e9f7f1; }
.badge { display: inline-block; padding: 1px 8px; border-radius: 10px; color: #fff; font-size: 12px;
         white-space: nowrap; font-weight: 600; }
.figures { display: flex; flex-wrap: wrap; gap: 12px 36px; align-items: flex-start; }
figure.chart { display: table; margin: 8px 0; max-width: 100%; }
figure.chart svg { display: block; max-width: 100%; height: auto; }
figure.chart figcaption { display: table-caption; caption-side: bottom; font-size: 12.5px; padding: 2px 8px 0; }
.summary td:first-child { font-weight: 600; }
details { margin: 6px 0; } summary { cursor: pointer; color: var(--muted); }
ul.reasons { padding-left: 18px; } ul.reasons li { margin: 4px 0; white-space: pre-wrap; overflow-wrap: anywhere; }
.tree details.node { margin: 1px 0; }
.tree details.node > summary { color: var(--ink); padding: 2px 0; }
.tree details.node > summary .node-times { color: var(--muted); font-size: 12.5px; margin-left: 6px; }
.tree .node-body { margin-left: 7px; padding: 2px 0 2px 14px; border-left: 1px dotted var(--line); }
.tree details.info { margin: 2px 0 4px; } .tree details.info > summary { font-size: 12.5px; }
.tree table.node-info { margin: 4px 0 6px; } .tree table.node-info td:first-child { color: var(--muted); }
span.share { display: inline-block; width: 110px; height: 8px; margin-left: 8px; background: #e8e8e8;
             vertical-align: middle; } span.share > span { display: block; height: 100%; background: #0072B2; }
td.types { min-width: 220px; max-width: 520px; overflow-wrap: anywhere; }
"""

_CSP = "default-src 'none'; style-src 'unsafe-inline'"


def figures_available() -> bool:
    """True when matplotlib can be imported, i.e. pages get their figures (NOTE [figures are optional])."""
    return _FigureMaker().available


# ============================================================================================ tune report


def render_tune_report(data: dict, *, source: str | None = None, checkpoint: bool = False) -> str:
    """One HTML page for a tune report.

    Args:
        data: :meth:`TuneReport.to_dict <aitune.torch.report.TuneReport.to_dict>` (the JSON report).
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
        speedup = (selected_row or {}).get("speedup")
        body.append([f'<a href="#graph-{index}">{_e(graph.get("module"))}/{_e(graph.get("graph"))}</a>',
                     _e(graph.get("selected") or "eager (fallback)"),
                     ("", "num", _speedup_text(speedup)),
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
            ("", "num", _speedup_text(row.get("speedup"))),
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


def _environment_section(environment: dict) -> str:
    if not environment:
        return "<h2>Environment</h2><p>Not recorded.</p>"
    body = [[_e(key), f"<code>{_e(_plain(value))}</code>"] for key, value in environment.items()]
    return '<h2 id="environment">Environment</h2>' + _table(["", ""], body, css_class="environment", header=False)


# ============================================================================================ inspection


def render_inspection(modules: list[dict], total_ms: float, iterations: int,
                      environment: dict | None = None) -> str:
    """One HTML page for an ``ait.inspect`` result: which modules take the time.

    Args:
        modules: one dict per top-most executed module, sorted by total time: ``name``, ``class``, ``calls``,
            ``total_ms``, ``avg_ms`` (ms), ``share`` (0..1 of the whole timed run), ``params``, ``precisions``.
        total_ms: wall time of the timed iterations, ms. iterations: how many.
        environment: versions and device (:func:`aitune.torch.environment.environment`), optional.

    Returns:
        The page (self-contained: NOTE [self-contained pages]).
    """
    figures = _FigureMaker()
    covered = sum(module["total_ms"] for module in modules)
    body = ["<h1>aitune inspect: where the time goes</h1>",
            f'<p class="meta">{len(modules)} top-most executed module(s); {_num(total_ms, ",.2f")} ms over '
            f"{iterations} iteration(s) ({_num(total_ms / iterations if iterations else 0.0, ',.3f')} ms per "
            f"iteration); the listed modules account for "
            f"{_num(100 * covered / total_ms if total_ms else 0.0, '.1f')} %."
            "</p>"]
    if not figures.available:
        body.append(f'<p class="note" id="no-figures">Figures need matplotlib: <code>{_e(REPORT_EXTRA)}</code>. '
                    "The table below holds the numbers.</p>")
    elif modules:
        body.append(figures.time_share("time-share", modules, total_ms))
    table = [[f'<code>{_e(module["name"] or "<root>")}</code>', _e(module["class"]),
              ("", "num", str(module["calls"])), ("", "num", _num(module["total_ms"], ",.2f")),
              ("", "num", _num(module["avg_ms"], ",.3f")), ("", "num", _num(100 * module["share"], ".1f")),
              ("", "num", f'{module["params"]:,}'), _e(", ".join(module["precisions"]))] for module in modules]
    body.append("<h2>Modules</h2>" + (_table(["module", "class", "calls", "total ms", "avg ms", "% of total",
                                               "params", "precisions"], table, css_class="modules")
                                       if table else "<p>No module ran.</p>"))
    body.append('<p class="note">Wrap the modules worth tuning in place: '
                "<code>ait.wrap(pipe, info.get_modules(limit=2))</code>, then <code>ait.tune(...)</code>.</p>")
    if environment:
        body.append(_environment_section(environment))
    return _page("aitune inspect", body)


# ============================================================================================ JIT inspection

_TREE_OPEN_LEVELS = 2  # tree levels shown unfolded
_TOP_MODULES = 15  # modules in the time-share figure


def render_jit_inspection(data: dict) -> str:
    """The "Model Inspector" page of a JIT inspection: summary, time-share figure, collapsible module tree
    (``<details>``, no script) and the modules by self time.

    Args:
        data: :func:`aitune.torch.jit.inspection.to_dict` — ``model_name``, ``total_s`` (s), ``overhead_s``,
            ``modules`` (nested trees of per-module dicts: ``name``, ``class``, ``state``, ``calls``,
            ``total_s``, ``self_s``, ``avg_s``, ``max_s`` (s), ``num_parameters``, ``inputs``/``outputs``
            (signatures with ``text`` and ``calls``), ``batch_axes``, ``children``...), ``settings``,
            ``environment``.

    Returns:
        The page (self-contained: NOTE [self-contained pages]).
    """
    figures = _FigureMaker()
    nodes = []

    def walk(items: list[dict]) -> None:
        for item in items:
            nodes.append(item)
            walk(item.get("children") or [])

    walk(data.get("modules") or [])
    ids = {id(node): f"module-{index}" for index, node in enumerate(nodes)}
    total_ms = 1e3 * (data.get("total_s") or 0.0)
    timed = sorted((node for node in nodes if node.get("calls")), key=lambda node: -node.get("self_s", 0.0))
    model_name = data.get("model_name") or "model"
    body = [f"<h1>aitune Model Inspector — {_e(model_name)}</h1>",
            f'<p class="meta">JIT inspection · started {_e(data.get("started_at") or "?")} · saved '
            f'{_e(data.get("created_at") or "?")} · {len(nodes)} module(s) tracked, {len(timed)} called · '
            f"{_num(total_ms, ',.3f')} ms in the top-level calls</p>",
            _jit_summary(data, nodes, ids, timed, total_ms)]
    if not figures.available:
        body.append(f'<p class="note" id="no-figures">Figures need matplotlib: <code>{_e(REPORT_EXTRA)}</code>. '
                    "The tables below hold the numbers.</p>")
    elif timed:
        body.append(figures.module_time_share("time-share", timed, total_ms))
    body.append('<h2 id="tree">Module tree</h2>')
    if nodes:
        body.append('<p class="muted">Click a module to fold or unfold it. Self time leaves out the inspected '
                    "modules called inside; the bar is the module's self share of the top-level calls.</p>")
        body.append('<div class="tree">' + "".join(_tree_node(node, ids, total_ms) for node in data["modules"])
                    + "</div>")
    else:
        body.append("<p>No module was called while inspection was on.</p>")
    body.append(_jit_modules_table(timed, ids, total_ms))
    body.append(_jit_not_inspected(nodes, ids))
    body.append('<p class="note" id="how-measured">How it was measured: <code>time.perf_counter</code> around '
                "each call of a tracked module, with <code>torch.cuda.synchronize</code> before and after when its "
                "parameters or inputs are on CUDA. Self time = total time minus the inspected calls made inside it "
                "and aitune's bookkeeping of them; total times include that bookkeeping "
                f"({_num(1e3 * (data.get('overhead_s') or 0.0), ',.3f')} ms in all). A top-level module's first "
                "call is seen by a hook that gets its positional arguments only: a signature seen only on that call "
                "is marked <i>first call</i>. Calls that bypass <code>module(...)</code> count as their caller's "
                "self time.</p>")
    body.append(_environment_section(data.get("environment") or {}))
    body.append(f'<p class="meta">Page made by aitune {_e(__version__)}.</p>')
    return _page(f"aitune Model Inspector — {model_name}", body)


def _jit_summary(data: dict, nodes: list[dict], ids: dict, timed: list[dict], total_ms: float) -> str:
    roots = data.get("modules") or []
    states: dict[str, int] = {}
    for node in nodes:
        states[node.get("state", "?")] = states.get(node.get("state", "?"), 0) + 1
    settings = data.get("settings") or {}
    devices = sorted({node["device"] for node in nodes if node.get("device")})
    precisions = sorted({precision for node in nodes for precision in node.get("precisions") or []})
    deepest = max((node.get("level", 0) for node in nodes), default=0)
    rows = [["model", _e(data.get("model_name"))],
            ["top-level modules", ", ".join(f'<a href="#{ids[id(root)]}"><code>{_e(root["name"])}</code></a>'
                                            for root in roots) or "none"],
            ["modules tracked", f"{len(nodes)} — " + ", ".join(f"{count} {_e(name)}" for name, count in
                                                              sorted(states.items(), key=lambda i: _style(i[0])[1]))],
            ["module calls timed", f"{sum(node.get('calls', 0) for node in nodes):,}"],
            ["time in the top-level calls", f"{_num(total_ms, ',.3f')} ms"],
            ["parameters", f"{sum(root.get('num_parameters', 0) for root in roots):,}"
                           + (f" ({_e(', '.join(precisions))})" if precisions else "")],
            ["devices", _e(", ".join(devices) or "no parameters")],
            ["deepest level", f"{deepest} (jit_config.max_depth_level = {_e(settings.get('max_depth_level'))})"]]
    if timed and total_ms:
        busiest = timed[0]
        rows.append(["most self time", f'<code>{_e(busiest["name"])}</code> — '
                                       f'{_num(100 * 1e3 * busiest.get("self_s", 0.0) / total_ms, ".1f")} %'])
    rows.append(["aitune bookkeeping", f"{_num(1e3 * (data.get('overhead_s') or 0.0), ',.3f')} ms (in total times "
                                       "only)"])
    if data.get("running"):
        rows.append(["", '<span class="muted">inspection was still running: later calls are not in this page'
                         "</span>"])
    return '<h2 id="summary">Summary</h2>' + _table(["", ""], rows, css_class="summary", header=False)



def _signatures_html(signatures: list[dict], other_calls: int = 0) -> str:
    lines = [f'<code>{_e(signature["text"])}</code> <span class="muted">× {signature["calls"]}'
             + (" (first call)" if signature.get("first_call_only") else "") + "</span>" for signature in signatures]
    if other_calls:
        lines.append(f'<span class="muted">{other_calls} call(s) of further signatures (not kept)</span>')
    return "<br>".join(lines) or '<span class="muted">not called</span>'


def _share_text(seconds: float | None, total_ms: float) -> str:
    return _num(100 * 1e3 * (seconds or 0.0) / total_ms, ".1f") if total_ms else ""


def _tree_node(node: dict, ids: dict, total_ms: float) -> str:
    called = bool(node.get("calls"))
    share = 1e3 * node.get("self_s", 0.0) / total_ms if total_ms else 0.0
    times = (f'{_num(1e3 * node.get("self_s", 0.0), ",.3f")} ms self · {_num(1e3 * node.get("total_s", 0.0), ",.3f")}'
             f' ms total · {node.get("calls", 0)} call(s)') if called else "not timed"
    summary = (f'<summary><code>{_e(node.get("name"))}</code> <span class="muted">'
               f'{_e(str(node.get("class", "")).rsplit(".", 1)[-1])}</span> {_badge(node.get("state"))}'
               f'<span class="node-times">{times}</span>'
               + (f'<span class="share" title="{_num(100 * share, ".1f")} % self"><span style="width:'
                  f'{min(100.0, 100 * share):.1f}%"></span></span>' if called else "") + "</summary>")
    rows = [["class", f'<code>{_e(node.get("class"))}</code>'],
            ["state", _badge(node.get("state")) + (f" {_e(node['reason'])}" if node.get("reason") else "")],
            ["parameters", f'{node.get("num_parameters", 0):,}' + (f' ({_e(", ".join(node["precisions"]))})'
                                                                   if node.get("precisions") else "")
             + (f' on {_e(node["device"])}' if node.get("device") else "")]]
    if called:
        rows += [["calls", str(node["calls"])],
                 ["self / total ms", f'{_num(1e3 * node.get("self_s", 0.0), ",.3f")} / '
                                     f'{_num(1e3 * node.get("total_s", 0.0), ",.3f")}'],
                 ["avg / max ms per call", f'{_num(1e3 * node.get("avg_s", 0.0), ",.3f")} / '
                                           f'{_num(1e3 * node.get("max_s", 0.0), ",.3f")}'],
                 ["share (self / total)", f'{_share_text(node.get("self_s"), total_ms)} % / '
                                          f'{_share_text(node.get("total_s"), total_ms)} %'],
                 ["inputs", ("", "types", _signatures_html(node.get("inputs") or [],
                                                            node.get("other_input_calls", 0)))],
                 ["outputs", ("", "types", _signatures_html(node.get("outputs") or [],
                                                             node.get("other_output_calls", 0)))],
                 ["batch axes", _e(", ".join(node.get("batch_axes") or []))
                  or '<span class="muted">none seen (needs calls with two batch sizes)</span>']]
    if node.get("note"):
        rows.append(["note", _e(node["note"])])
    info = _table(["", ""], rows, css_class="node-info", header=False)
    children = "".join(_tree_node(child, ids, total_ms) for child in node.get("children") or [])
    if children:  # its own details fold away, so that an unfolded node lists its children
        info = f'<details class="info"><summary>details of {_e(node.get("name"))}</summary>{info}</details>'
    opened = " open" if children and node.get("level", 0) < _TREE_OPEN_LEVELS else ""
    return (f'<details class="node" id="{ids[id(node)]}"{opened}>{summary}<div class="node-body">'
            + info + children + "</div></details>")


def _jit_modules_table(timed: list[dict], ids: dict, total_ms: float) -> str:
    if not timed:
        return '<h2 id="modules">Modules by self time</h2><p>No module was called.</p>'
    rows = [[f'<a href="#{ids[id(node)]}"><code>{_e(node["name"])}</code></a>',
             _e(str(node.get("class", "")).rsplit(".", 1)[-1]), _badge(node.get("state")),
             ("", "num", str(node.get("calls", 0))),
             ("", "num", _num(1e3 * node.get("self_s", 0.0), ",.3f")),
             ("", "num", _num(1e3 * node.get("total_s", 0.0), ",.3f")),
             ("", "num", _num(1e3 * node.get("avg_s", 0.0), ",.3f")),
             ("", "num", _share_text(node.get("self_s"), total_ms)),
             ("", "num", _share_text(node.get("total_s"), total_ms)),
             ("", "num", f'{node.get("num_parameters", 0):,}'),
             ("", "types", _signatures_html(node.get("inputs") or [], node.get("other_input_calls", 0))),
             ("", "types", _signatures_html(node.get("outputs") or [], node.get("other_output_calls", 0))),
             _e(", ".join(node.get("batch_axes") or []))] for node in timed]
    return ('<h2 id="modules">Modules by self time</h2>'
            + _table(["module", "class", "state", "calls", "self ms", "total ms", "avg ms", "% self", "% total",
                      "params", "inputs", "outputs", "batch axes"], rows, css_class="modules"))


def _jit_not_inspected(nodes: list[dict], ids: dict) -> str:
    rows = [[f'<a href="#{ids[id(node)]}"><code>{_e(node["name"])}</code></a>', _badge(node.get("state")),
             ("", "reason", _e(node.get("reason") or node.get("note") or "tracked, but never called"))]
            for node in nodes if not node.get("calls")]
    if not rows:
        return ""
    return ('<h2 id="not-inspected">Not timed, and why</h2>'
            + _table(["module", "state", "why"], rows, css_class="not-inspected"))


# ============================================================================================ figures


class _FigureMaker:
    """Draws the figures as inline SVG with matplotlib (NOTE [figures are optional]); ``available`` is False
    when matplotlib cannot be imported."""

    def __init__(self):
        try:
            import matplotlib
            from matplotlib import ticker
            from matplotlib.figure import Figure
        except ImportError:
            self.available = False
            return
        self.available = True
        self._matplotlib, self._ticker, self._Figure = matplotlib, ticker, Figure

    # ---------------------------------------------------------------------------- tune report figures

    def latency(self, key: str, rows: list[dict]) -> str:
        """Box plot of the timed round durations (ms) per measured candidate, fastest on top; candidates
        without round durations (reports before they were recorded) show p50..p99 of their reference sample."""
        measured = [row for row in rows if row.get("measurement")]
        if not measured:
            return ""
        measured.sort(key=lambda row: row["measurement"].get("median_round_ms") or row["measurement"].get("p50_ms")
                      or math.inf, reverse=True)
        figure = self._figure(len(measured), width=6.2)
        axes = figure.subplots()
        rounds_shown = False
        for position, row in enumerate(measured):
            measurement = row["measurement"]
            colour = _style(row.get("status"))[0]
            values = [value for value in measurement.get("round_ms") or [] if _is_number(value)]
            if values:
                rounds_shown = True
                axes.boxplot([values], positions=[position], orientation="horizontal", widths=0.55,
                             patch_artist=True, showfliers=False, manage_ticks=False,
                             boxprops={"facecolor": colour + "55", "edgecolor": colour},
                             medianprops={"color": colour, "linewidth": 2},
                             whiskerprops={"color": colour}, capprops={"color": colour})
                jitter = [position + 0.18 * math.sin(1.7 * i) for i in range(len(values))]
                axes.scatter(values, jitter, s=7, color=colour, alpha=0.45, linewidths=0, zorder=3)
            else:
                low, mid, high = (measurement.get(name) for name in ("p50_ms", "p90_ms", "p99_ms"))
                if _is_number(low) and _is_number(high):
                    axes.plot([low, high], [position, position], color=colour, linewidth=3, alpha=0.6)
                    axes.plot([low], [position], "o", color=colour)
                    if _is_number(mid):
                        axes.plot([mid], [position], "|", color=colour, markersize=12)
        axes.set_yticks(range(len(measured)), _labels(measured))
        values = [value for row in measured
                  for value in (row["measurement"].get("round_ms")
                                or [row["measurement"].get("p50_ms"), row["measurement"].get("p99_ms")])
                  if _is_number(value) and value > 0]
        if values and max(values) / min(values) > 4:
            self._log_x(axes)
        axes.set_xlabel("ms per round (one call of each recorded sample)" if rounds_shown else "ms (p50 .. p99)")
        axes.set_ylim(-0.6, len(measured) - 0.4)
        self._tidy(axes)
        caption = ("Latency distribution: each box spans the middle half of the timed rounds, the line is the median, "
                   "whiskers reach 1.5 IQR, dots are single rounds. Fastest on top.")
        return self._svg(figure, key, "latency", caption)

    def speed_and_error(self, key: str, rows: list[dict]) -> str:
        """Speed-up vs eager (bars, eager = 1) beside the largest absolute error vs eager (log scale, with the
        ``atol`` it was held to; quantized candidates annotated with their SQNR)."""
        shown = [row for row in rows if row.get("speedup") is not None or row.get("comparison")]
        if not shown:
            return ""
        shown.sort(key=lambda row: row.get("speedup") if _is_number(row.get("speedup")) else -1.0)
        figure = self._figure(len(shown), width=9.2)
        speed_axes, error_axes = figure.subplots(1, 2, sharey=True, gridspec_kw={"wspace": 0.08})
        positions = list(range(len(shown)))
        colours = [_style(row.get("status"))[0] for row in shown]
        speedups = [row.get("speedup") if _is_number(row.get("speedup")) else 0.0 for row in shown]
        speed_axes.barh(positions, speedups, color=colours, height=0.6)
        speed_axes.axvline(1.0, color="#444444", linewidth=1, linestyle="--")
        top = max(speedups + [1.0])
        for position, row, value in zip(positions, shown, speedups):
            text = _speedup_text(row.get("speedup")) if _is_number(row.get("speedup")) else "not measured"
            speed_axes.text(value + top * 0.02, position, text, va="center", fontsize=8.5, color="#333333")
        speed_axes.set_xlim(0, top * 1.28)
        speed_axes.set_xlabel("speed-up vs eager (throughput ratio; dashed: eager)")
        speed_axes.set_yticks(positions, _labels(shown))
        errors = [(row.get("comparison") or {}).get("max_abs_error") for row in shown]
        positive = [value for value in errors if _is_number(value) and value > 0]
        tolerances = [((row.get("comparison") or {}).get("tolerance") or {}).get("atol") for row in shown]
        tolerances = [value for value in tolerances if _is_number(value) and value > 0]
        floor = min(positive + tolerances + [1e-6]) / 30
        ceiling = max(positive + tolerances + [floor * 100])
        for position, row, value, colour in zip(positions, shown, errors, colours):
            comparison = row.get("comparison") or {}
            if _is_number(value) and value > 0:
                error_axes.barh([position], [value - floor], left=floor, color=colour, height=0.6)
                text = f"{value:.2g}"
            elif _is_number(value):
                text = "0 (identical)"
            else:
                text = "baseline" if row.get("backend") == "eager" else "not compared"
            if _is_number(comparison.get("min_sqnr_db")):
                text += f"  SQNR {comparison['min_sqnr_db']:.1f} dB"
            error_axes.text((value if _is_number(value) and value > 0 else floor) * 1.25, position, text,
                            va="center", fontsize=8.5, color="#333333")
        self._log_x(error_axes, subs=(1.0,))
        error_axes.set_xlim(floor, ceiling * 3e3)
        if tolerances:
            error_axes.axvline(max(tolerances), color="#CC3311", linewidth=1, linestyle=":")
            error_axes.text(max(tolerances), len(shown) - 0.45, f" atol {max(tolerances):g}", color="#CC3311",
                            fontsize=8, va="bottom")
        error_axes.set_xlabel("max abs error vs eager (log; dotted: atol)")
        error_axes.tick_params(axis="y", left=False)
        speed_axes.set_ylim(-0.6, len(shown) - 0.2)
        self._tidy(speed_axes)
        self._tidy(error_axes)
        caption = ("Speed-up and error side by side: a candidate is worth having when its bar on the left is long "
                   "and its error on the right stays left of the dotted tolerance (quantized candidates are judged "
                   "by SQNR and cosine instead). Colour = status.")
        return self._svg(figure, key, "speed-error", caption)

    def probes(self, key: str, rows: list[dict]) -> str:
        """Stacked bars per candidate: probes passed, failed, not accepted by the artifact, not run."""
        shown = [row for row in rows if row.get("probes")]
        if not shown:
            return ""
        figure = self._figure(len(shown), width=5.4)
        axes = figure.subplots()
        positions = list(range(len(shown)))
        parts = [("passed", "#009E73"), ("failed", "#D55E00"), ("not accepted", "#BBBBBB"), ("not run", "#E5E5E5")]
        left = [0.0] * len(shown)
        for name, colour in parts:
            values = []
            for row in shown:
                probes = row["probes"]
                checked, passed = probes.get("checked", 0) or 0, probes.get("passed", 0) or 0
                values.append({"passed": passed, "failed": max(checked - passed, 0),
                               "not accepted": probes.get("not_accepted", 0) or 0,
                               "not run": probes.get("not_run", 0) or 0}[name])
            if any(values):
                axes.barh(positions, values, left=left, color=colour, height=0.6, label=name)
            left = [a + b for a, b in zip(left, values)]
        for position, row, end in zip(positions, shown, left):
            axes.text(end + 0.15, position, f"{row['probes'].get('passed', 0)}/{row['probes'].get('checked', 0)}",
                      va="center", fontsize=8.5, color="#333333")
        axes.set_yticks(positions, _labels(shown))
        axes.set_xlim(0, max(left + [1]) * 1.2 + 1)
        axes.set_ylim(-0.6, len(shown) - 0.4)
        axes.xaxis.set_major_locator(self._ticker.MaxNLocator(integer=True))
        axes.set_xlabel("probes (inputs derived from the samples)")
        figure.legend(loc="outside upper center", fontsize=8, frameon=False, ncols=4)
        self._tidy(axes)
        caption = ("Probes passed / checked per candidate. Failed: disagreed with eager (the candidate is rejected); "
                   "not accepted: outside the artifact's input range (such calls run eager); not run: out of time.")
        return self._svg(figure, key, "probes", caption)

    # ---------------------------------------------------------------------------- inspection figure

    def time_share(self, key: str, modules: list[dict], total_ms: float) -> str:
        shown = list(modules[:25])
        labels = [_escape_mathtext(textwrap.shorten(f"{module['name'] or '<root>'} ({module['class']})", 48))
                  for module in shown]
        shares = [100 * module["share"] for module in shown]
        outside = 100 * (1 - sum(module["share"] for module in modules)) if total_ms else 0.0
        if outside > 0.05:
            labels.append("(outside the listed modules)")
            shares.append(outside)
        labels, shares = labels[::-1], shares[::-1]
        figure = self._figure(len(labels), width=7.5)
        axes = figure.subplots()
        colours = ["#BBBBBB" if label.startswith("(outside") else "#0072B2" for label in labels]
        axes.barh(range(len(labels)), shares, color=colours, height=0.6)
        for position, share in enumerate(shares):
            axes.text(share + 1, position, f"{share:.1f} %  ({share * total_ms / 100:,.2f} ms)", va="center",
                      fontsize=8.5, color="#333333")
        axes.set_yticks(range(len(labels)), labels)
        axes.set_xlim(0, max(shares + [1]) * 1.35)
        axes.set_ylim(-0.6, len(labels) - 0.4)
        axes.set_xlabel("% of the timed run")
        self._tidy(axes)
        caption = "Share of the timed run spent in each top-most executed module (tuning candidates: the longest bars)."
        if len(modules) > len(shown):
            caption += f" The {len(modules) - len(shown)} smallest are in the table only."
        return self._svg(figure, key, "time-share", caption)

    def module_time_share(self, key: str, modules: list[dict], total_ms: float) -> str:
        """JIT inspection: the modules with the most self time (sorted), each with its self share (dark bar)
        over its total share (light bar: the modules called inside it included) of the top-level calls."""
        shown = modules[:_TOP_MODULES]
        if not shown or not total_ms:
            return ""
        labels, self_shares, total_shares = [], [], []
        for module in shown:
            label = f"{module['name']} ({str(module.get('class', '')).rsplit('.', 1)[-1]})"
            labels.append(_escape_mathtext(label if len(label) <= 52 else "…" + label[-51:]))
            self_shares.append(100 * 1e3 * module.get("self_s", 0.0) / total_ms)
            total_shares.append(100 * 1e3 * module.get("total_s", 0.0) / total_ms)
        labels, self_shares, total_shares = labels[::-1], self_shares[::-1], total_shares[::-1]
        figure = self._figure(len(labels), width=8.2)
        axes = figure.subplots()
        positions = range(len(labels))
        axes.barh(positions, total_shares, color="#56B4E9", alpha=0.45, height=0.72, label="total (with inner modules)")
        axes.barh(positions, self_shares, color="#0072B2", height=0.42, label="self")
        for position, own, whole in zip(positions, self_shares, total_shares):
            axes.text(max(own, whole) + 1, position, f"self {own:.1f} %  ·  total {whole:.1f} %", va="center",
                      fontsize=8.5, color="#333333")
        axes.set_yticks(list(positions), labels)
        axes.set_xlim(0, max(total_shares + self_shares + [1]) * 1.45 + 2)
        axes.set_ylim(-0.6, len(labels) - 0.4)
        axes.set_xlabel("% of the time in the top-level calls")
        figure.legend(loc="outside upper center", fontsize=8, frameon=False, ncols=2)
        self._tidy(axes)
        caption = ("Where the time goes: the modules with the most self time (their own work, without the inspected "
                   "modules they call), dark, over their total time, light.")
        if len(modules) > len(shown):
            caption += f" The other {len(modules) - len(shown)} called module(s) are in the table."
        return self._svg(figure, key, "time-share", caption)

    # ---------------------------------------------------------------------------- helpers

    def _figure(self, rows: int, width: float = 6.4):
        return self._Figure(figsize=(width, 1.1 + 0.42 * max(rows, 1)), layout="constrained")

    def _log_x(self, axes, subs: tuple = (1.0, 2.0, 5.0)) -> None:
        """A log x axis labelled with plain numbers (0.02, 0.05, 0.1) instead of powers of ten."""
        ticker = self._ticker
        axes.set_xscale("log")
        axes.xaxis.set_major_locator(ticker.LogLocator(base=10, subs=subs))
        axes.xaxis.set_major_formatter(ticker.FuncFormatter(lambda value, _: f"{value:g}"))
        axes.xaxis.set_minor_formatter(ticker.NullFormatter())

    @staticmethod
    def _tidy(axes) -> None:
        for side in ("top", "right"):
            axes.spines[side].set_visible(False)
        axes.tick_params(labelsize=8.5)
        axes.xaxis.label.set_size(9)
        axes.grid(axis="x", color="#e6e6e6", linewidth=0.8)
        axes.set_axisbelow(True)

    def _svg(self, figure, key: str, kind: str, caption: str) -> str:
        """The figure as inline SVG: text kept as text, no XML prolog or metadata, ids prefixed by ``key`` so
        that several figures can share one page."""
        buffer = io.StringIO()
        with self._matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": "aitune",
                                          "font.family": "sans-serif"}):
            figure.savefig(buffer, format="svg", metadata={"Date": None, "Creator": None})
        text = buffer.getvalue()
        text = text[text.index("<svg"):]
        text = re.sub(r"<metadata>.*?</metadata>", "", text, flags=re.S)
        text = re.sub(r'(\bid="|href="#|url\(#)', lambda match: f"{match.group(1)}{key}-", text)
        text = text.replace("<svg ", f'<svg role="img" aria-label="{_e(caption)}" ', 1)
        return (f'<figure class="chart" data-figure="{_e(kind)}" id="{_e(key)}">{text}'
                f"<figcaption>{_e(caption)}</figcaption></figure>")


# ============================================================================================ small pieces


def _page(title: str, body: Iterable[str]) -> str:
    return ("<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
            f'<meta http-equiv="Content-Security-Policy" content="{_CSP}">\n'
            '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
            f"<title>{_e(title)}</title>\n<style>{_CSS}</style>\n</head>\n<body>\n<main>\n"
            + "\n".join(body) + "\n</main>\n</body>\n</html>\n")


def _table(headers: list[str], rows: list, css_class: str = "", header: bool = True,
           widths: list[str] | None = None) -> str:
    """An HTML table; a cell is trusted HTML or ``(unused, css class, html[, colspan])``; a row is a list of
    cells or ``{"class": ..., "cells": [...]}``; ``widths`` fixes the columns' widths (CSS lengths)."""
    lines = [f'<div class="table-wrap"><table class="{css_class}"' + (' style="table-layout:fixed;width:100%"'
                                                                     if widths else "") + ">"]
    if widths:
        lines.append("<colgroup>" + "".join(f'<col style="width:{width}">' for width in widths) + "</colgroup>")
    if header:
        lines.append("<thead><tr>" + "".join(f"<th>{_e(h)}</th>" for h in headers) + "</tr></thead>")
    lines.append("<tbody>")
    for row in rows:
        row_class, cells = (row.get("class", ""), row["cells"]) if isinstance(row, dict) else ("", row)
        rendered = []
        for cell in cells:
            if isinstance(cell, tuple):
                span = f' colspan="{cell[3]}"' if len(cell) > 3 else ""
                rendered.append(f'<td class="{cell[1]}"{span}>{cell[2]}</td>')
            else:
                rendered.append(f"<td>{cell}</td>")
        lines.append(f'<tr class="{row_class}">' + "".join(rendered) + "</tr>")
    lines.append("</tbody></table></div>")
    return "".join(lines)


def _badge(status: str | None) -> str:
    colour = _style(status)[0]
    return f'<span class="badge" style="background:{colour}">{_e(status or "?")}</span>'


def _style(status: str | None) -> tuple[str, int]:
    return _STATUS_STYLE.get(status or "", _UNKNOWN_STYLE)


def _row_order(row: dict) -> tuple:
    throughput = (row.get("measurement") or {}).get("throughput")
    return (_style(row.get("status"))[1], -(throughput if _is_number(throughput) else 0.0))


def _name(row: dict) -> str:
    return row.get("description") or row.get("backend") or "?"


def _labels(rows: list[dict]) -> list[str]:
    """Figure labels: each row's description on at most two lines of 36 characters (longer ones end in "…"; the
    tables carry them whole), numbered where two would read the same; ``$`` kept literal (no mathtext)."""
    labels = []
    for row in rows:
        lines = textwrap.wrap(_name(row), 36, break_long_words=True)
        if len(lines) > 2:
            lines = [lines[0], lines[1][:35] + "…"]
        labels.append("\n".join(lines))
    for label in set(labels):
        indices = [i for i, other in enumerate(labels) if other == label]
        if len(indices) > 1:
            for number, index in enumerate(indices, start=1):
                labels[index] = f"{label} #{number}"
    return [_escape_mathtext(label) for label in labels]


def _escape_mathtext(text: str) -> str:
    return text.replace("$", r"\$")


def _inputs_text(spec: dict) -> str:
    parts = []
    for tensor in spec.get("inputs") or []:
        dims = []
        for low, high, axis in zip(tensor.get("min_shape", []), tensor.get("max_shape", []), tensor.get("axes", [])):
            dims.append((str(low) if low == high else f"{low}..{high}") + ("b" if axis == "batch" else ""))
        parts.append(f"{tensor.get('path')}: {tensor.get('dtype')}[{', '.join(dims)}]")
    for path, value in (spec.get("constants") or {}).items():
        parts.append(f"{path}={value}")
    return "; ".join(parts)


def probes_text(probes: dict | None) -> str:
    """``passed/checked`` plus ``(n not accepted, n not run)`` where there are any; "" without probes."""
    if not probes:
        return ""
    text = f"{probes.get('passed', 0)}/{probes.get('checked', 0)}"
    extra = [f"{probes[key]} {label}" for key, label in (("not_accepted", "not accepted"), ("not_run", "not run"))
             if probes.get(key)]
    return text + (f" ({', '.join(extra)})" if extra else "")


def _speedup_text(value: Any) -> str:
    return f"{value:.2f}x" if _is_number(value) else ""


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _num(value: Any, spec: str) -> str:
    return format(value, spec) if _is_number(value) else ""


def _plain(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return ", ".join(map(str, value))
    return "none" if value is None else str(value)


def _e(value: Any) -> str:
    return html.escape("" if value is None else str(value), quote=True)
