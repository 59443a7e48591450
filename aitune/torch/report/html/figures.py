"""Figures for the HTML pages, drawn by matplotlib's object-oriented API as inline SVG (NOTE [figures are
optional] in :mod:`aitune.torch.report.html`)."""

from __future__ import annotations

import io
import math
import re

from aitune.torch.report.html.page import (
    _TOP_MODULES,
    _e,
    _escape_mathtext,
    _is_number,
    _labels,
    _shorten_left,
    speedup_text,
    _style,
    _wrap_label,
)


def figures_available() -> bool:
    """True when matplotlib can be imported, i.e. pages get their figures (NOTE [figures are optional])."""
    return _FigureMaker().available


# Statuses of candidates that passed the check against eager (the others failed it, or were never checked).
_PASSED_CHECK = ("selected", "passed", "rejected (performance)")


def _why_passed_beyond(row: dict, max_abs_error, atol_line) -> str:
    """For a candidate that passed its check with a max abs error beyond the figure's dotted ``atol`` line,
    the rule that let it pass (aitune/torch/check/correctness.py, module docstring): ``"passed: SQNR 24 dB"``
    (quantized: SQNR and cosine instead of atol), ``"passed: fp32 parity"`` (rule 5: as close to an exact fp32
    run as eager), ``"passed: fp16/bf16 atol 0.01"`` (reduced-precision tolerances: fp16/bf16 outputs, TF32 or
    autocast), ``"passed: rtol 0.001·|eager|"`` (rule 3's relative part: large values). "" for the others."""
    if row.get("status") not in _PASSED_CHECK or not (_is_number(max_abs_error) and _is_number(atol_line)
                                                       and max_abs_error > atol_line):
        return ""
    comparison = row.get("comparison") or {}
    if comparison.get("metric") == "sqnr+cosine":
        sqnr = comparison.get("min_sqnr_db")
        return f"passed: SQNR {sqnr:.0f} dB" if _is_number(sqnr) else "passed: SQNR and cosine"
    leaves = [leaf for leaf in comparison.get("leaves") or [] if isinstance(leaf, dict)]
    worst = max(leaves, key=lambda leaf: leaf.get("max_abs_error") or 0.0, default={})
    if worst.get("fp32_parity") or (not leaves and "fp32-parity" in str(comparison.get("metric"))):
        return "passed: fp32 parity"
    atol, rtol = worst.get("atol"), worst.get("rtol")
    own_atol = (comparison.get("tolerance") or {}).get("atol")
    if not (_is_number(atol) and _is_number(rtol)):  # a report from before the leaves kept their tolerances
        return "passed: rtol or fp16/bf16 tolerance"
    if _is_number(own_atol) and atol > own_atol:
        return f"passed: fp16/bf16 atol {atol:g}" + ("" if max_abs_error <= atol else " + rtol·|eager|")
    if max_abs_error <= atol:
        return f"passed: atol {atol:g}"
    return f"passed: rtol {rtol:g}·|eager|"


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
        ``atol`` it was held to; quantized candidates annotated with their SQNR). A candidate that passed its
        check with an error beyond the dotted atol line says on its bar which rule let it pass
        (:func:`_why_passed_beyond`)."""
        shown = [row for row in rows if row.get("speedup") is not None or row.get("comparison")]
        if not shown:
            return ""
        shown.sort(key=lambda row: row.get("speedup") if _is_number(row.get("speedup")) else -1.0)
        errors = [(row.get("comparison") or {}).get("max_abs_error") for row in shown]
        positive = [value for value in errors if _is_number(value) and value > 0]
        tolerances = [((row.get("comparison") or {}).get("tolerance") or {}).get("atol") for row in shown]
        tolerances = [value for value in tolerances if _is_number(value) and value > 0]
        whys = [_why_passed_beyond(row, value, max(tolerances) if tolerances else None)
                for row, value in zip(shown, errors)]
        # room on the right of the error bars for the longest "passed: ..." note
        room = min(2 + 0.21 * max(len(why) for why in whys), 8) if any(whys) else 3.5
        figure = self._figure(len(shown), width=9.2 if not any(whys) else 10.4)
        speed_axes, error_axes = figure.subplots(1, 2, sharey=True, gridspec_kw={
            "wspace": 0.08, "width_ratios": (1, 1.45 if any(whys) else 1)})
        positions = list(range(len(shown)))
        colours = [_style(row.get("status"))[0] for row in shown]
        speedups = [row.get("speedup") if _is_number(row.get("speedup")) else 0.0 for row in shown]
        speed_axes.barh(positions, speedups, color=colours, height=0.6)
        speed_axes.axvline(1.0, color="#444444", linewidth=1, linestyle="--")
        top = max(speedups + [1.0])
        for position, row, value in zip(positions, shown, speedups):
            text = speedup_text(row.get("speedup"), row.get("speedup_spread")) if _is_number(row.get("speedup")) \
                else "not measured"
            speed_axes.text(value + top * 0.02, position, text, va="center", fontsize=8.5, color="#333333")
        speed_axes.set_xlim(0, top * 1.28)
        speed_axes.set_xlabel("speed-up vs eager (throughput ratio; dashed: eager)")
        speed_axes.set_yticks(positions, _labels(shown))
        floor = min(positive + tolerances + [1e-6]) / 30
        ceiling = max(positive + tolerances + [floor * 100])
        for position, row, value, colour, why in zip(positions, shown, errors, colours, whys):
            comparison = row.get("comparison") or {}
            if _is_number(value) and value > 0:
                error_axes.barh([position], [value - floor], left=floor, color=colour, height=0.6)
                text = f"{value:.2g}"
            elif _is_number(value):
                text = "0 (identical)"
            else:
                text = "baseline" if row.get("backend") == "eager" else "not compared"
            if why:  # which rule it passed by, in place of the SQNR a reduced-precision candidate also records
                text += f"  {why}"
            elif _is_number(comparison.get("min_sqnr_db")):
                text += f"  SQNR {comparison['min_sqnr_db']:.1f} dB"
            error_axes.text((value if _is_number(value) and value > 0 else floor) * 1.25, position, text,
                            va="center", fontsize=8.5, color="#333333")
        self._log_x(error_axes, subs=(1.0,))
        error_axes.set_xlim(floor, ceiling * 10 ** room)
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
                   "by SQNR and cosine instead; a passed bar beyond the line says which rule it passed by). "
                   "Colour = status.")
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
        labels = [_escape_mathtext(_wrap_label(f"{module['name'] or '<root>'} ({module['class']})", 48, 1)[0])
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
            labels.append(_escape_mathtext(_shorten_left(label, 52)))
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
