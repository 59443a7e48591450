"""The page frame shared by aitune's HTML pages: CSS, the Content-Security-Policy, tables, status badges
and the text formatting of numbers and report values (see :mod:`aitune.torch.report.html`)."""

from __future__ import annotations

import html
import math
import re
from typing import Any, Iterable


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


def _short_name(row: dict) -> str:
    """A figure's name for a row: its backend's registered name instead of the class name, and a space after
    each setting (``inductor_jit(freezing=True, memory_format=channels_last)``), so the settings that tell two
    variants apart fit the label's two lines."""
    description, backend = _name(row), row.get("backend")
    head, bracket, settings = description.partition("(")
    if not bracket or not backend or not head.isidentifier():
        return description
    if settings.strip() == ")":
        return backend
    return f"{backend}({', '.join(part.strip() for part in _split_settings(settings))}"


def _split_settings(settings: str) -> list[str]:
    """``a=1,b={'x': 1, 'y': 2})`` split at the commas between settings (not inside brackets or quotes)."""
    parts, depth, current, quote = [], 0, "", None
    for char in settings:
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
        if char == "," and depth == 0 and not quote:
            parts.append(current)
            current = ""
            continue
        current += char
    return parts + [current]


def _labels(rows: list[dict]) -> list[str]:
    """Figure labels: each row's short name (:func:`_short_name`) on at most two lines of 40 characters, broken
    only between words (:func:`_wrap_label`; longer ones end in "…"; the tables carry the full descriptions),
    numbered where two would read the same; ``$`` kept literal (no mathtext)."""
    labels = ["\n".join(_wrap_label(_short_name(row), _LABEL_WIDTH)) for row in rows]
    for label in set(labels):
        indices = [i for i, other in enumerate(labels) if other == label]
        if len(indices) > 1:
            for number, index in enumerate(indices, start=1):
                labels[index] = f"{label} #{number}"
    return [_escape_mathtext(label) for label in labels]


_LABEL_WIDTH = 40
# Where a label may break: after a space or , ; ( [ { / | (between a backend and its settings, between two
# settings); an overlong piece also after = or before a dotted name's next part.
_BREAK_AFTER = re.compile(r"[\s,;(\[{/|]+")
_BREAK_AFTER_IF_NEEDED = re.compile(r"=|\.(?=[A-Za-z_])")


def _wrap_label(text: str, width: int, max_lines: int = 2) -> list[str]:
    """``text`` on at most ``max_lines`` lines of at most ``width`` characters, broken only at the places
    :data:`_BREAK_AFTER` names (``=`` and dots only inside a piece too long for a line), never inside a word.
    What does not fit ends in "…" at the last break that fits; a single word longer than a line is cut, and
    the "…" says so."""
    pieces = []
    for piece in _split_after(text, _BREAK_AFTER):
        pieces.extend(_split_after(piece, _BREAK_AFTER_IF_NEEDED) if len(piece.rstrip()) > width else [piece])
    lines: list[list[str]] = [[]]
    for piece in pieces:
        line = lines[-1]
        if len("".join(line + [piece]).rstrip()) <= width:
            line.append(piece)
            continue
        if line and len(lines) < max_lines:  # start the next line with this piece
            lines.append([piece.lstrip()])
            if len(piece.strip()) <= width:
                continue
        return [_joined(line) for line in lines[:-1]] + [_ellipsis(lines[-1] if line else [piece], width)]
    return [_joined(line) for line in lines if line]


def _joined(pieces: list[str]) -> str:
    return "".join(pieces).strip()


def _ellipsis(pieces: list[str], width: int) -> str:
    """The line of ``pieces`` ended by "…" within ``width``: whole pieces while any fits, else the first piece
    cut (a word longer than a line)."""
    pieces = list(pieces)
    while len(pieces) > 1 and len(_joined(pieces)) + 1 > width:
        pieces.pop()
    return _joined(pieces)[:width - 1] + "…"


def _shorten_left(text: str, width: int) -> str:
    """``text`` within ``width`` characters by dropping whole leading pieces (a module path's first parts),
    marked by a leading "…"; a last piece longer than a line keeps its end."""
    if len(text) <= width:
        return text
    pieces = []
    for piece in _split_after(text, _BREAK_AFTER):
        pieces.extend(_split_after(piece, _BREAK_AFTER_IF_NEEDED))
    while len(pieces) > 1 and len("".join(pieces).strip()) + 1 > width:
        pieces.pop(0)
    rest = "".join(pieces).strip()
    return "…" + rest[len(rest) - (width - 1):] if len(rest) + 1 > width else "…" + rest


def _split_after(text: str, breaks: re.Pattern) -> list[str]:
    pieces, start = [], 0
    for match in breaks.finditer(text):
        if match.end() > start:
            pieces.append(text[start:match.end()])
            start = match.end()
    return pieces + ([text[start:]] if start < len(text) else [])


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
    """``passed/checked`` plus ``(n not accepted, n not run, n judged at the probe's scale)`` where there are any
    (the last: scaled probes that passed by correctness rule 6); "" without probes."""
    if not probes:
        return ""
    text = f"{probes.get('passed', 0)}/{probes.get('checked', 0)}"
    extra = [f"{probes[key]} {label}" for key, label in (("not_accepted", "not accepted"), ("not_run", "not run"),
                                                         ("judged_at_scale", "judged at the probe's scale"))
             if probes.get(key)]
    return text + (f" ({', '.join(extra)})" if extra else "")


def speedup_text(value: Any, spread: Any = None) -> str:
    """A speed-up as shown in reports: ``4.02x (3.95-4.10)`` with the quartiles of its per-round ratios when the
    row has a ``speedup_spread``; a noisy one as ``~4.02x (noisy: 1.20-9.80)``, still with the quartiles (the
    extremes of rounds taken under load say little), so it never reads as a plain figure; "" when there is
    none. Figures below 0.1 keep two significant digits instead of reading 0.00."""
    if not _is_number(value):
        return ""
    if not isinstance(spread, dict) or not all(_is_number(spread.get(key)) for key in ("q25", "q75")):
        return f"{_ratio(value)}x"
    quartiles = f"{_ratio(spread['q25'])}-{_ratio(spread['q75'])}"
    if spread.get("noisy"):
        return f"~{_ratio(value)}x (noisy: {quartiles})"
    return f"{_ratio(value)}x ({quartiles})"


def _ratio(value: float) -> str:
    return f"{value:.2f}" if abs(value) >= 0.1 else f"{value:.2g}"


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


_TOP_MODULES = 15  # modules in the time-share figure


def _environment_section(environment: dict) -> str:
    if not environment:
        return "<h2>Environment</h2><p>Not recorded.</p>"
    body = [[_e(key), f"<code>{_e(_plain(value))}</code>"] for key, value in environment.items()]
    return '<h2 id="environment">Environment</h2>' + _table(["", ""], body, css_class="environment", header=False)
