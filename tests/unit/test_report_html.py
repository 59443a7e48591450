"""HTML pages of a tune report and of ait.inspect: content, figures, the CLI, and a real headless Chromium.

The report comes from a real ``ait.tune`` run (ONNX Runtime, TorchAO under a 60 dB SQNR floor it cannot
reach, TensorRT that is not installed here, eager as baseline), built once for the module.
"""

from __future__ import annotations

import html
import json
import re
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import aitune.torch as ait
from aitune.torch.backend import ONNXRuntimeBackend, TensorRTBackend, TorchAOBackend
from aitune.torch.measure.profiling import ProfilingConfig
from aitune.torch.report.rows import CandidateResult, GraphReport, TuneReport
from chromium_pages import assert_figure_drawn, launch, open_page

FIGURES = ("speed-error", "latency", "probes")


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(64, 128)
        self.down = torch.nn.Linear(128, 16)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    """A real tune report (JSON) and a checkpoint of the tuned module."""
    root = tmp_path_factory.mktemp("report-html")
    torch.manual_seed(0)
    fast = ProfilingConfig(warmup_rounds=1, warmup_s=0.0, min_rounds=3, max_rounds=20, time_budget_s=0.2)
    strategy = ait.MaxThroughputStrategy(backends=[ONNXRuntimeBackend(), TorchAOBackend(), TensorRTBackend()],
                                         profiling_config=fast, tolerance=ait.Tolerance(min_sqnr_db=60.0))
    module = ait.Module(MLP().eval(), "mlp", strategy=strategy)
    report = ait.tune(module, [torch.randn(2, 64), torch.randn(8, 64)], cache_dir_path=root / "cache",
                      report_path=root / "tune.json", ready_batches=True)
    checkpoint = ait.save(module, root / "mlp.ait")
    return SimpleNamespace(root=root, report=report, json=root / "tune.json", checkpoint=checkpoint)


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "aitune.cli", *args], capture_output=True, text=True, timeout=300)


def _visible_text(page: str) -> str:
    """The page's text with tags dropped and entities decoded (what a reader sees, roughly)."""
    return html.unescape(re.sub(r"<[^>]+>", "", page))


# ============================================================================================ content


def test_page_holds_every_row_full_reasons_and_figures(tuned):
    page = tuned.report.to_html(tuned.root / "page.html")
    assert (tuned.root / "page.html").read_text(encoding="utf-8") == page
    statuses = {row.status for row in tuned.report.rows}
    assert {"selected", "passed", "unavailable"} <= statuses
    text = _visible_text(page)
    table = page[page.index('<table class="candidates">'):]
    table = table[:table.index("</table>")]
    assert table.count('class="badge"') == len(tuned.report.rows)
    for row in tuned.report.rows:
        assert row.description in table
        if row.reason:
            assert row.reason in text  # whole, never cut
    assert "package 'tensorrt' not found" in text and "Not used, and why" in text
    for kind in FIGURES:
        figure = re.search(rf'<figure class="chart" data-figure="{kind}"[^>]*>(.*?)</figure>', page, re.S)
        assert figure, kind
        assert figure.group(1).count("<path") >= 5 and "<text" in figure.group(1)
    assert ">onnxruntime<" in re.search(r'data-figure="speed-error".*?</figure>', page, re.S).group(0)
    assert torch.__version__ in text


def test_page_is_self_contained(tuned):
    page = tuned.report.to_html()
    assert "<script" not in page and "@import" not in page
    assert re.findall(r'(?:src|href)="(?!#)[^"]*"', page) == []  # only in-page links (#graph-0, svg ids)
    assert "default-src 'none'" in page
    ids = re.findall(r'\bid="([^"]+)"', page)
    assert len(ids) == len(set(ids))  # figures' SVG ids do not collide


def test_reasons_are_escaped_and_whole():
    reason = "ToleranceExceededError: output <root>.logits[0] & friends: " + "x" * 300 + " — end"
    rows = [CandidateResult("m", "graph0", "eager", "TorchEagerBackend()", status="selected", reason="baseline"),
            CandidateResult("m", "graph0", "torchao", "TorchAOBackend()", status="rejected (correctness)",
                            reason=reason),
            CandidateResult("m", "graph0", "x", "X()", status="skipped", reason="first one won")]
    graph = GraphReport("m", "graph0", {}, "FirstWinsStrategy()", "TorchEagerBackend()", "why", rows)
    report = TuneReport(graphs=[graph], module_errors={"other": "RuntimeError: <boom>"})
    page = report.to_html()
    assert html.escape(reason) in page and "<root>" not in page
    assert _visible_text(page).count(reason) == 2  # in the candidates table and in "Not used, and why"
    assert "RuntimeError: &lt;boom&gt;" in page and "first one won" in page


def test_without_matplotlib_the_page_has_tables_and_names_the_extra(tuned, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    page = tuned.report.to_html()
    assert "<svg" not in page and "pip install &#x27;aitune[report]&#x27;" in page
    assert page.count('class="badge"') >= len(tuned.report.rows)


def _figure_texts(page: str, kind: str) -> list[str]:
    """The text elements of one figure's SVG, in drawing order (figures keep their text as text)."""
    figure = re.search(rf'<figure class="chart" data-figure="{kind}"[^>]*>(.*?)</figure>', page, re.S).group(1)
    return [html.unescape(text) for text in re.findall(r"<text[^>]*>(.*?)</text>", figure, re.S)]


def _report(rows: list[CandidateResult]) -> TuneReport:
    graph = GraphReport("m", "graph0", {}, "MaxThroughputStrategy()", rows[0].description, "why", rows)
    return TuneReport(graphs=[graph])


def test_figure_labels_break_between_words_never_inside_one():
    """A label breaks after a separator ("(", ",", a space); what does not fit on two lines ends in "…" at a
    break; only a single word longer than a line is cut, and the "…" says so."""
    from aitune.torch.report.html.page import _labels

    descriptions = [("inductor_jit", "TorchInductorJitBackend(freezing=True,memory_format=channels_last)"),
                    ("inductor_jit", "TorchInductorJitBackend(mode=max-autotune-no-cudagraphs,freezing=True)"),
                    ("inductor_jit", "TorchInductorJitBackend(autocast_enabled=True,autocast_dtype=bfloat16,"
                                     "freezing=True)"),
                    ("onnxruntime", "ONNXRuntimeBackend(graph_optimization_level=extended)"),
                    ("eager", "TorchEagerBackend()"),
                    ("", "A" * 50 + "(x=1)")]  # no backend name: the description, one word too long
    rows = [CandidateResult("m", "graph0", name, text, speedup=1.0) for name, text in descriptions]
    labels = [label.split("\n") for label in _labels([row.to_dict() for row in rows])]
    # the backend's registered name instead of its class name, so the settings that tell variants apart fit
    assert labels == [["inductor_jit(freezing=True,", "memory_format=channels_last)"],
                      ["inductor_jit(", "mode=max-autotune-no-cudagraphs,…"],
                      ["inductor_jit(autocast_enabled=True,", "autocast_dtype=bfloat16, freezing=True)"],
                      ["onnxruntime(", "graph_optimization_level=extended)"],
                      ["eager"],
                      ["A" * 39 + "…"]]
    texts = _figure_texts(_report(rows).to_html(), "speed-error")
    assert "inductor_jit(freezing=True," in texts and "memory_format=channels_last)" in texts
    assert not any(text.startswith(("e,", "Tru")) for text in texts)  # the old cut: "freezing=Tru" / "e,..."


def test_passed_bars_beyond_the_atol_line_say_which_rule_they_passed_by():
    """Comparisons from the real comparator: within atol (no note), rtol's share on large values, fp16
    tolerances of a reduced-precision candidate, fp32 parity of an fp16 output, SQNR of a quantized one, and a
    rejected candidate (no note: it did not pass)."""
    from aitune.torch.check.correctness import OutputComparator, Tolerance

    def comparison(expected, actual, reference_fp32=None, **options):
        comparator = OutputComparator(Tolerance(), **options)
        comparator.compare(expected, actual, reference_fp32)
        return comparator.result().to_dict()

    torch.manual_seed(0)
    x, large = torch.randn(256), torch.full((64,), 10.0)
    fp32 = [("Within()", comparison(x, x + 5e-5)),  # atol 1e-4
            ("LargeValues()", comparison(large, large + 5e-3)),  # 1e-4 + 1e-3 * 10 allowed
            ("Autocast()", comparison(x * 0.1, x * 0.1 + 4e-3, low_precision=True)),  # fp16 atol 1e-2
            ("Half()", comparison((x + 0.05 * torch.randn(256)).half(), (x + 0.05 * torch.randn(256)).half(), x)),
            ("Int8()", comparison(x, x + 0.06 * torch.randn(256), quantized=True))]
    assert [data["metric"] for _, data in fp32] == ["allclose"] * 3 + ["allclose+fp32-parity", "sqnr+cosine"]
    rows = [CandidateResult("m", "graph0", "eager", "TorchEagerBackend()", speedup=1.0)]
    rows += [CandidateResult("m", "graph0", "b", name, status="passed", speedup=1.1 + index / 10, comparison=data)
             for index, (name, data) in enumerate(fp32)]
    rows.append(CandidateResult("m", "graph0", "b", "Wrong()", status="rejected (correctness)", comparison={
        **comparison(x, x), "max_abs_error": 1.0}))
    sqnr = fp32[-1][1]["min_sqnr_db"]
    texts = _figure_texts(_report(rows).to_html(), "speed-error")
    notes = {text.split("  ", 1)[0]: text.split("  ", 1)[1] for text in texts if "  passed: " in text}
    assert notes == {"0.005": "passed: rtol 0.001·|eager|", "0.004": "passed: fp16/bf16 atol 0.01",
                     f"{fp32[3][1]['max_abs_error']:.2g}": "passed: fp32 parity",
                     f"{fp32[4][1]['max_abs_error']:.2g}": f"passed: SQNR {sqnr:.0f} dB"}
    assert "5e-05" in texts and "1" in texts and " atol 0.0001" in texts  # within atol / rejected: no note


def test_report_json_round_trip_and_round_times(tuned):
    data = json.loads(tuned.json.read_text())
    again = TuneReport.from_json(tuned.json)
    assert again.to_dict() == data and again.path == str(tuned.json)
    measured = [row for row in again.rows if row.measurement]
    assert measured and all(len(row.measurement["round_ms"]) == row.measurement["rounds"] for row in measured)


def test_from_json_refuses_other_files(tmp_path):
    from aitune.errors import ConfigError

    (tmp_path / "a.json").write_text('{"not": "a report"}')
    (tmp_path / "b.json").write_text("nope")
    for name in ("a.json", "b.json"):
        with pytest.raises(ConfigError, match="tune report"):
            TuneReport.from_json(tmp_path / name)


def test_inspect_page():
    class Pipe:
        def __init__(self):
            self.encoder = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32))
            self.head = torch.nn.Linear(32, 4).half()

        def __call__(self, x):
            return self.head(self.encoder(x).half())

    info = ait.inspect(Pipe(), [torch.randn(4, 32)], number_of_iterations=3, warmup_iterations=1)
    page = info.to_html()
    figure = re.search(r'<figure class="chart" data-figure="time-share"[^>]*>(.*?)</figure>', page, re.S)
    assert figure and "encoder (Sequential)" in figure.group(1) and "head (Linear)" in figure.group(1)
    text = _visible_text(page)
    assert "float16" in text and "float32" in text and "% of total" in text and "<script" not in page


# ============================================================================================ CLI


def test_cli_version():
    from aitune import __version__

    result = _cli("--version")
    assert result.returncode == 0 and result.stdout.strip() == f"aitune {__version__}"


def test_cli_unknown_backend_is_one_line():
    result = _cli("demo", "--backends", "eager", "no_such_backend")
    assert result.returncode == 2 and result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr
    assert "'no_such_backend'" in lines[0] and "inductor_jit" in lines[0] and "onnxruntime" in lines[0]


def test_cli_report_html_from_json_and_checkpoint(tuned, tmp_path):
    result = _cli("report", str(tuned.json), "--html")
    assert result.returncode == 0, result.stderr
    page_path = Path(result.stdout.strip())
    assert page_path == tuned.json.with_suffix(".html")
    page = page_path.read_text(encoding="utf-8")
    assert page.count('class="badge"') >= len(tuned.report.rows) and 'data-figure="latency"' in page

    out = tmp_path / "sub" / "ckpt.html"
    result = _cli("report", str(tuned.checkpoint), "--html", str(out))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(out)
    page = out.read_text(encoding="utf-8")
    selected = tuned.report.selected("mlp")
    assert "aitune checkpoint" in page and selected in page and 'data-figure="speed-error"' in page
    assert "keeps only the chosen backend" in page

    text = _cli("report", str(tuned.json))  # without --html: the text table, as before
    assert text.returncode == 0 and "| module" in text.stdout and selected in text.stdout
    missing = _cli("report", str(tmp_path / "missing.json"), "--html")
    assert missing.returncode == 1 and "Traceback" not in missing.stderr and len(missing.stderr.splitlines()) == 1


def test_cli_report_resolves_a_saved_name_like_ait_load(tuned, tmp_path):
    """`ait.save(m, "mlp.ait")` writes checkpoints/mlp.ait; `aitune report mlp.ait` finds it."""
    import shutil

    (tmp_path / "checkpoints").mkdir()
    shutil.copy(tuned.checkpoint, tmp_path / "checkpoints" / "mlp.ait")
    result = subprocess.run([sys.executable, "-m", "aitune.cli", "report", "mlp.ait"], capture_output=True, text=True,
                            timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert tuned.report.selected("mlp") in result.stdout


def test_cli_report_finds_a_tune_report_by_its_name_in_the_cache(tuned, tmp_path):
    """`aitune report tune-<time>.json` finds <cache>/reports/tune-<time>.json (the README's
    command gives only the file name)."""
    import os
    import shutil

    cache = tmp_path / "cache"
    (cache / "reports").mkdir(parents=True)
    shutil.copy(tuned.json, cache / "reports" / "tune-20261201-101500-000000.json")
    environment = {**os.environ, "AITUNE_CACHE_DIR": str(cache)}
    result = subprocess.run([sys.executable, "-m", "aitune.cli", "report", "tune-20261201-101500-000000.json"],
                            capture_output=True, text=True, timeout=300, cwd=tmp_path, env=environment)
    assert result.returncode == 0, result.stderr
    assert tuned.report.selected("mlp") in result.stdout and "| module" in result.stdout


# ============================================================================================ browser


@pytest.fixture(scope="module")
def browser():
    with launch() as instance:
        yield instance


def _figure_name(row) -> str:
    """The first line of a row's figure label (figures name backends by their registered name)."""
    from aitune.torch.report.html.page import _labels

    return _labels([row.to_dict()])[0].split("\n")[0]


def test_report_page_in_chromium(tuned, browser, tmp_path):
    started = time.perf_counter()
    path = tmp_path / "report.html"
    tuned.report.to_html(path)
    page, errors, outside = open_page(browser, path)
    selected = _figure_name(next(row for row in tuned.report.rows if row.status == "selected"))
    measured = [row for row in tuned.report.rows if row.measurement]
    assert_figure_drawn(page, "speed-error", [selected, "1.00x", "atol"])
    assert_figure_drawn(page, "latency", [_figure_name(row) for row in measured])
    assert_figure_drawn(page, "probes", [f"{row.probes['passed']}/{row.probes['checked']}"
                                          for row in tuned.report.rows if row.probes][:1])
    badges = page.locator("table.candidates .badge")
    assert badges.count() == len(tuned.report.rows)
    assert all(badges.nth(i).is_visible() for i in range(badges.count()))
    for row in tuned.report.rows:
        if row.reason:
            assert page.get_by_text(row.reason, exact=False).first.is_visible(), row.reason
    assert page.locator("#not-used").is_visible() and page.locator("#environment").is_visible()
    assert page.get_by_text(torch.__version__).first.is_visible()
    page.screenshot(path=str(tmp_path / "report.png"), full_page=True)
    page.close()
    assert errors == [] and outside == []
    print(f"browser check of the report page: {time.perf_counter() - started:.1f} s")


def test_checkpoint_and_inspect_pages_in_chromium(tuned, browser, tmp_path):
    path = tmp_path / "checkpoint.html"
    TuneReport.from_manifest(_manifest(tuned.checkpoint), tuned.checkpoint).to_html(path)
    page, errors, outside = open_page(browser, path)
    assert_figure_drawn(page, "speed-error",
                        [_figure_name(next(row for row in tuned.report.rows if row.status == "selected"))])
    page.close()
    assert errors == [] and outside == []

    pipe = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    path = tmp_path / "inspect.html"
    ait.inspect(pipe, [torch.randn(2, 16)], number_of_iterations=2, warmup_iterations=1, min_depth=1).to_html(path)
    page, errors, outside = open_page(browser, path)
    assert_figure_drawn(page, "time-share", ["0 (Linear)", "2 (Linear)"])
    assert page.locator("table.modules tbody tr").count() == 3
    page.close()
    assert errors == [] and outside == []


def test_browser_check_catches_a_page_that_fetches(browser, tmp_path):
    """The checks above can fail: a page that reaches out is seen (request routed and aborted, or refused by
    the page's Content-Security-Policy, which logs a console error)."""
    path = tmp_path / "bad.html"
    path.write_text('<!DOCTYPE html><html><body><img src="http://example.invalid/x.png"></body></html>')
    page, errors, outside = open_page(browser, path)
    page.close()
    assert outside == ["http://example.invalid/x.png"]
    page_text = TuneReport().to_html().replace("</main>", '<img src="http://example.invalid/y.png"></main>')
    path.write_text(page_text)
    page, errors, outside = open_page(browser, path)
    page.close()
    assert any("Content Security Policy" in error for error in errors)


def _manifest(path: Path) -> dict:
    from aitune.torch.checkpoint.manifest import read_manifest

    return read_manifest(path)[0]


def test_speedup_text_shows_quartiles_marks_noisy_figures_and_never_reads_zero():
    from aitune.torch.report.html.page import speedup_text

    steady = {"q25": 3.95, "q75": 4.10, "min": 3.0, "max": 5.0, "rounds": 40, "noisy": False}
    noisy = {"q25": 2.9, "q75": 5.3, "min": 0.001, "max": 860.0, "rounds": 40, "noisy": True}
    assert speedup_text(4.02, steady) == "4.02x (3.95-4.10)"
    assert speedup_text(4.02, noisy) == "~4.02x (noisy: 2.90-5.30)"  # quartiles, not the load's extremes
    assert speedup_text(0.004, {**steady, "q25": 0.003, "q75": 0.005}) == "0.004x (0.003-0.005)"
    assert speedup_text(4.02) == "4.02x" and speedup_text(None) == ""
