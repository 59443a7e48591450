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

The renderer reads the report's JSON form (:meth:`aitune.torch.report.rows.TuneReport.to_dict`): a report
file written by another aitune version renders as long as its rows keep the same keys; the statuses
below are those JSON strings.
"""

from aitune.torch.report.html.figures import figures_available
from aitune.torch.report.html.inspection_page import render_inspection, render_jit_inspection
from aitune.torch.report.html.page import REPORT_EXTRA, probes_text, speedup_text
from aitune.torch.report.html.tune_page import render_tune_report

__all__ = ["REPORT_EXTRA", "figures_available", "probes_text", "render_inspection", "render_jit_inspection",
           "render_tune_report", "speedup_text"]
