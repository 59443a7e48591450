"""The inspection pages: ``ait.inspect`` (which modules of a pipeline take the time) and the JIT "Model
Inspector" (the module tree a run called, as collapsible ``<details>``)."""

from __future__ import annotations

from aitune import __version__
from aitune.torch.report.html.figures import _FigureMaker
from aitune.torch.report.html.page import (
    REPORT_EXTRA,
    _badge,
    _e,
    _environment_section,
    _num,
    _page,
    _style,
    _table,
)


def render_inspection(modules: list[dict], total_ms: float, iterations: int,
                      environment: dict | None = None) -> str:
    """One HTML page for an ``ait.inspect`` result: which modules take the time.

    Args:
        modules: one dict per top-most executed module, sorted by total time: ``name``, ``class``, ``calls``,
            ``total_ms``, ``avg_ms`` (ms), ``share`` (0..1 of the whole timed run), ``params``, ``precisions``.
        total_ms: wall time of the timed iterations, ms. iterations: how many.
        environment: versions and device (:func:`aitune.torch.common.environment.environment`), optional.

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


_TREE_OPEN_LEVELS = 2  # tree levels shown unfolded


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
