"""JIT inspect mode: what it records (calls, self/total time, types, batch axes, hierarchy), that outputs stay
eager's bit for bit, the switches, the Model Inspector page (content, in Chromium) and the report at exit."""

import html
import importlib
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import aitune.torch.jit as jit
from aitune.errors import ConfigError
from aitune.torch.jit import inspection, runtime
from aitune.torch.jit.inspection import InspectState
from chromium_pages import check_inspection_page, launch
from fake_clock import pause

REPO = Path(__file__).resolve().parents[2]


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(16, 16)
        self.act = torch.nn.ReLU()

    def forward(self, x):
        return self.act(self.linear(x))


class Top(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([Block(), Block()])
        self.head = torch.nn.Linear(16, 4)

    def forward(self, x, scale=1.0, extra=None):
        for block in self.blocks:
            x = block(x)
        out = self.head(x) * scale
        return {"logits": out, "hidden": x} if extra is not None else out


@pytest.fixture(autouse=True)
def _jit_off():
    jit.reset()
    yield
    jit.reset()


def _by_name() -> dict:
    return {node.name: node for node in inspection.modules()}


# ---- what is recorded
def test_outputs_stay_eager_bit_for_bit_and_calls_are_counted():
    model = Top().eval()
    batches = [torch.randn(size, 16) for size in (2, 3, 5)]
    with torch.no_grad():
        expected = [model(x, scale=2.0) for x in batches]
    runtime.enable_inspection()
    with torch.no_grad():
        outputs = [model(x, scale=2.0) for x in batches]
    assert all(torch.equal(a, b) for a, b in zip(outputs, expected))

    nodes = _by_name()
    assert list(nodes) == ["Top", "Top.blocks.0", "Top.blocks.0.linear", "Top.blocks.0.act", "Top.blocks.1",
                           "Top.blocks.1.linear", "Top.blocks.1.act", "Top.head"]
    assert [node.level for node in nodes.values()] == [0, 1, 2, 2, 1, 2, 2, 1]
    assert all(node.calls == 3 and node.state is InspectState.INSPECT for node in nodes.values())  # first call too
    assert nodes["Top.blocks.0.act"].num_parameters == 0  # weightless modules too (min_parameters=0)
    for node in nodes.values():
        inner = sum(child.total_s for child in node.children)
        assert 0 <= node.self_s <= node.total_s and inner <= node.total_s
        assert node.total_s >= node.max_s > 0
    assert nodes["Top.head"].self_s == nodes["Top.head"].total_s  # no inspected module inside

    head = nodes["Top.head"].to_dict()
    assert head["inputs"][0]["text"] == "input: float32[2..5b, 16]" and head["inputs"][0]["calls"] == 3
    assert head["outputs"][0]["text"] == "output: float32[2..5b, 4]" and head["batch_axes"] == ["input: axis 0"]
    top = nodes["Top"].to_dict()
    # The discovering call is seen by the hook (positional arguments only), the later ones whole.
    assert [(s["text"], s["calls"], s["first_call_only"]) for s in top["inputs"]] == [
        ("x: float32[3..5b, 16], scale: float", 2, False), ("x: float32[2, 16]", 1, True)]
    assert top["precisions"] == ["float32"] and top["num_parameters"] == sum(p.numel() for p in model.parameters())


def test_autograd_training_mode_and_odd_types_pass_through():
    model = Top().train()
    runtime.enable_inspection()
    x = torch.randn(3, 16, requires_grad=True)
    model(x)  # discovering call
    output = model(x, 0.5, extra={"note": "kept"})
    output["logits"].sum().backward()
    assert x.grad is not None and model.head.weight.grad is not None
    top = _by_name()["Top"].to_dict()
    texts = [signature["text"] for signature in top["inputs"]]
    assert "x: float32[3, 16], scale: float, extra.note: str" in texts
    assert any(s["text"] == "output.logits: float32[3, 4], output.hidden: float32[3, 16]" for s in top["outputs"])


class Slow(torch.nn.Module):
    """Pauses ``seconds`` on the fake clock per call."""

    def __init__(self, seconds):
        super().__init__()
        self.seconds = seconds

    def forward(self, x):
        pause(self.seconds)
        return x + 1


class Outer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = Slow(0.04)

    def forward(self, x):
        pause(0.005)
        return self.inner(x)


def test_a_call_that_cannot_be_described_still_runs_and_is_timed(monkeypatch):
    model = Top().eval()
    x = torch.randn(3, 16)
    with torch.no_grad():
        expected = model(x)  # before inspection: the plain module's answer
    runtime.enable_inspection()
    model(torch.randn(2, 16))
    original = inspection.TypeSignatures.add

    def add(self, args, kwargs, *rest, **options):
        if args and isinstance(args[0], torch.Tensor) and args[0].shape[-1] == 4:  # the head's output
            raise RuntimeError("cannot describe this")
        return original(self, args, kwargs, *rest, **options)

    monkeypatch.setattr(inspection.TypeSignatures, "add", add)
    with torch.no_grad():
        assert torch.equal(model(x), expected)
    head = _by_name()["Top.head"]
    assert head.calls == 2 and "outputs not described" in head.note  # both calls timed, the undescribable one too


def test_self_time_leaves_out_the_modules_inside(fake_clock):
    model = Outer()
    runtime.enable_inspection()
    for _ in range(2):
        model(torch.zeros(1))
    outer, inner = _by_name()["Outer"], _by_name()["Outer.inner"]
    # two calls of 40 ms inside and 5 ms outside (fake clock; the timer's own readings add a few us)
    assert inner.self_s == pytest.approx(0.08, abs=1e-4) and outer.self_s == pytest.approx(0.01, abs=1e-4)
    assert outer.total_s == pytest.approx(0.09, abs=1e-4) and outer.total_s >= inner.total_s + outer.self_s - 1e-9


def test_cuda_modules_are_synchronised_before_and_after_each_call(monkeypatch):
    synchronised = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: synchronised.append(device))
    model = Top().eval()
    runtime.enable_inspection()
    model(torch.randn(2, 16))
    assert synchronised == []  # parameters and inputs on the CPU
    _by_name()["Top.head"].sync_device = "cuda:1"  # what parameters on cuda:1 give
    model(torch.randn(2, 16))
    assert synchronised == ["cuda:1", "cuda:1"]


def test_inspection_reads_no_tensor_value():
    """Describing a call records shapes, never values: a value read waits for the device (a CUDA caller's queued
    kernels would be timed as bookkeeping, outside every module's time) and costs a reduction per input."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class ScalarReads(TorchDispatchMode):  # .item(), bool(), float(), tolist() of a tensor: all reach this op
        reads = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.reads += func is torch.ops.aten._local_scalar_dense.default
            return func(*args, **(kwargs or {}))

    model = Top().eval()
    runtime.enable_inspection()
    with torch.no_grad(), ScalarReads() as mode:
        model(torch.randn(2, 16))
        model(torch.randn(3, 16), extra=torch.ones(1))
    assert mode.reads == 0
    nodes = _by_name()
    assert nodes["Top"].calls == 2 and nodes["Top.head"].calls == 2
    assert "float32[2..3b, 16]" in nodes["Top.head"].inputs.describe()[0]["text"]


def test_exclusions_depth_and_a_module_called_on_its_own_first():
    model = Top().eval()
    runtime.enable_inspection(skip_modules=["Top.blocks.1"], max_depth_level=2)
    with torch.no_grad():
        model.head(torch.randn(2, 16))  # a top-level call of a child: tracked on its own...
        assert [node.name for node in inspection.modules()] == ["Linear"]
        model(torch.randn(2, 16))  # ...until its parent is found: then it is the parent's child, records kept
    nodes = _by_name()
    assert list(nodes) == ["Top", "Top.blocks.0", "Top.blocks.1", "Top.head"]
    assert nodes["Top.head"].calls == 2 and nodes["Top.head"].level == 1
    assert nodes["Top.blocks.1"].state is InspectState.SKIPPED and "skip_modules" in nodes["Top.blocks.1"].reason
    assert nodes["Top.blocks.1"].calls == 0 and type(model.blocks[1]) is Block  # left alone, not routed
    assert "max_depth_level=2" in nodes["Top.blocks.0"].note and nodes["Top.blocks.0"].children == []
    assert "Top.blocks.1" in jit.describe() and "skip_modules" in jit.describe()


# ---- switches
def test_import_switches_on_and_disable_puts_classes_and_settings_back(tmp_path):
    model = Top().eval()
    sys.modules.pop("aitune.torch.jit.enable_inspection", None)
    module = importlib.import_module("aitune.torch.jit.enable_inspection")
    assert jit.is_enabled() and jit.jit_config.mode is jit.JITMode.INSPECT
    assert (jit.jit_config.max_depth_level, jit.jit_config.min_parameters) == (7, 0)
    with torch.no_grad():
        model(torch.randn(2, 16))
        model(torch.randn(3, 16))
    assert isinstance(model, Top) and type(model) is not Top and type(model.head) is not torch.nn.Linear
    sys.modules.pop("aitune.torch.jit.disable", None)
    importlib.import_module("aitune.torch.jit.disable")
    assert not jit.is_enabled() and type(model) is Top and type(model.head) is torch.nn.Linear
    assert type(model.blocks[0].act) is torch.nn.ReLU
    config = jit.jit_config
    assert (config.mode, config.max_depth_level, config.min_parameters) == (jit.JITMode.TUNE_EAGER, 3, 1)
    with torch.no_grad():
        model(torch.randn(4, 16))  # not counted any more
    nodes = module.modules()
    assert {node.state for node in nodes} == {InspectState.DETACHED} and nodes[0].calls == 2
    page = module.save_report(tmp_path / "after.html", "detached").read_text()  # records stay for the report
    assert "Top.blocks.0.linear" in page and "detached" in page
    module()  # callable again: a new inspection, the old records dropped
    assert jit.is_enabled() and inspection.modules() == []


def test_inspect_mode_from_the_environment(monkeypatch):
    monkeypatch.setenv("AITUNE_JIT_MODE", "inspect")
    jit.enable()  # what AUTOWRAPT_BOOTSTRAP runs
    model = Top().eval()
    model(torch.randn(2, 16))
    assert inspection.is_running() and _by_name()["Top.head"].calls == 1
    assert _by_name()["Top.blocks.0.act"].state is InspectState.SKIPPED  # min_parameters as configured (1)
    jit.disable()
    assert jit.jit_config.mode is jit.JITMode.TUNE_EAGER


def test_bad_setting_leaves_settings_as_they_were():
    with pytest.raises(ConfigError, match="max_depth_level"):
        runtime.enable_inspection(max_depth_level=0)
    assert jit.jit_config.mode is jit.JITMode.TUNE_EAGER and not inspection.is_running()


# ---- the page
def test_report_page_content(tmp_path, monkeypatch):
    model = Top().eval()
    runtime.enable_inspection()
    with torch.no_grad():
        for size in (2, 3, 4):
            model(torch.randn(size, 16))
    path = inspection.save_report(tmp_path, "my-model")  # a folder: the name is made up
    assert path.parent == tmp_path and re.fullmatch(r"jit_inspect_\d{8}-\d{6}\.html", path.name)
    page = path.read_text(encoding="utf-8")
    text = html.unescape(re.sub(r"<[^>]+>", "", page))
    assert "aitune Model Inspector — my-model" in text
    assert "<script" not in page and "default-src 'none'" in page
    assert re.findall(r'(?:src|href)="(?!#)[^"]*"', page) == []
    assert page.count('<details class="node"') == 8
    assert page.count('<details class="node" id="module-0" open>') == 1
    figure = re.search(r'<figure class="chart" data-figure="time-share"[^>]*>(.*?)</figure>', page, re.S)
    assert figure and "Top.head (Linear)" in figure.group(1) and figure.group(1).count("<path") >= 5
    assert "x: float32[2..4b, 16] × 3" in text and "output: float32[2..4b, 4]" in text and "x: axis 0" in text
    row = re.search(r'<tr class=""><td><a href="#module-7"><code>Top.head</code></a></td>.*?</tr>', page).group(0)
    assert '<td class="num">3</td>' in row  # calls
    ids = re.findall(r'\bid="([^"]+)"', page)
    assert len(ids) == len(set(ids))
    json.dumps(inspection.to_dict())

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    bare = Path(inspection.save_report(tmp_path / "sub" / "bare.html")).read_text()
    assert "<svg" not in bare and "aitune[report]" in html.unescape(bare) and "Top.head" in bare


def test_report_page_in_chromium(tmp_path):
    model = Top().eval()
    runtime.enable_inspection()
    with torch.no_grad():
        for size in (2, 3):
            model(torch.randn(size, 16))
    path = inspection.save_report(tmp_path / "inspect.html", "browser")
    with launch() as browser:
        check_inspection_page(browser, path, [node.name for node in inspection.modules()],
                              ["Top.head (Linear)", "Top (Top)"])


def test_report_written_at_exit_when_never_saved(tmp_path):
    script = textwrap.dedent("""
        import torch
        import aitune.torch.jit.enable_inspection as inspection
        from aitune.torch.jit import jit_config
        {setting}
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
        with torch.no_grad():
            model(torch.randn(2, 4))
            model(torch.randn(3, 4))
    """)
    folder = tmp_path / "reports"
    for setting, where in (("", tmp_path), (f"jit_config.inspection_dir = {str(folder)!r}", folder)):
        result = subprocess.run([sys.executable, "-c", script.format(setting=setting)], cwd=tmp_path,
                                capture_output=True, text=True, timeout=300,
                                env={**os.environ, "PYTHONPATH": str(REPO)})
        assert result.returncode == 0, result.stderr
        written = list(where.glob("jit_inspect_*.html"))
        assert len(written) == 1, (setting, result.stderr)
        assert "save_report() was never called" in result.stderr and str(written[0].name) in result.stderr
        page = written[0].read_text()
        assert "Sequential" in page and page.count('<details class="node"') == 3
        written[0].unlink()


def test_nothing_at_exit_once_saved(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    runtime.enable_inspection()
    Top()(torch.randn(2, 16))
    inspection.save_report("mine.html")
    inspection._at_exit()  # what the interpreter runs at exit
    assert [path.name for path in tmp_path.iterdir()] == ["mine.html"]
