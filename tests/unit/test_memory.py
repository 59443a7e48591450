"""Memory while tuning (aitune/torch/measure/memory.py, references, probes' bound): peaks measured and reported,
spilled references judged like in-memory ones, probes dropped past their reference bound."""

import json
import mmap

import pytest
import torch

import aitune.torch as ait
from aitune.errors import ConfigError
from aitune.torch.backend import TorchEagerBackend
from aitune.torch.measure.memory import PeakMemory, host_peak_bytes, reset_host_peak
from aitune.torch.check.probes import ProbeConfig, make_probes
from aitune.torch.report.rows import TuneReport
from aitune.torch.record.samples import record_graphs

MiB = 2**20


class OffByLittleBackend(TorchEagerBackend):
    """Eager plus 0.01: wrong on every recorded sample."""

    name = "test_off_by_little"
    passthrough = False

    def _infer(self, args, kwargs):
        return super()._infer(args, kwargs) + 0.01


class ClampingBackend(TorchEagerBackend):
    """Clamps its input at 2: exact on the recorded samples (values in [0, 1)), wrong on the scaled-up probe."""

    name = "test_clamping"
    passthrough = False

    def _infer(self, args, kwargs):
        return self.module(kwargs["x"].clamp(max=2.0))


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.hidden, self.head = torch.nn.Linear(16, 32), torch.nn.Linear(32, 4)

    def forward(self, x):
        return self.head(torch.relu(self.hidden(x)))


def model():
    torch.manual_seed(0)
    return Net().eval()


def tune(fast_profiling, backends, probe_config=None):
    wrapped = ait.Module(model(), "net", strategy=ait.MaxThroughputStrategy(
        backends, profiling_config=fast_profiling, probe_config=probe_config).enable_performance_validation(False))
    data = [torch.rand(b, 16) for b in (2, 4)]
    return ait.tune(wrapped, data, ready_batches=True)


def touched(size: int) -> mmap.mmap:
    """Fresh anonymous memory with every page written (malloc could reuse pages already resident)."""
    memory = mmap.mmap(-1, size)
    for offset in range(0, size, mmap.PAGESIZE):
        memory[offset] = 1
    return memory


def test_peak_memory_counts_the_work_and_leaves_out_pauses():
    if not reset_host_peak():
        pytest.skip("/proc/self/clear_refs cannot be written here: the peak cannot be reset")
    peak = PeakMemory()
    peak.start()
    before = host_peak_bytes()
    held = touched(32 * MiB)
    with peak.paused():
        touched(96 * MiB).close()
    figures = peak.result()
    held.close()
    assert figures["host_method"] == "VmHWM" and figures["device_bytes"] is None
    assert before + 30 * MiB <= figures["host_bytes"] < before + 90 * MiB


def test_the_report_carries_the_tuning_peak_memory(fast_profiling, tmp_path):
    report = tune(fast_profiling, [TorchEagerBackend()])
    peak = report.peak_memory
    assert peak["host_bytes"] > 50 * MiB and peak["device_bytes"] is None  # a CPU tune: no device figure
    assert "peak memory while tuning: host" in report.describe()
    again = TuneReport.from_dict(json.loads(json.dumps(report.to_dict())))
    assert again.peak_memory == peak


class SlowBuildBackend(TorchEagerBackend):
    """Eager whose build takes 0.3 s more: a build time the report must show."""

    name = "test_slow_build"
    passthrough = False

    def _build(self, module, graph, device, workdir):
        import time

        time.sleep(0.3)
        return super()._build(module, graph, device, workdir)


def test_the_report_says_where_the_tune_time_went(fast_profiling):
    report = tune(fast_profiling, [SlowBuildBackend(), TorchEagerBackend()])
    (graph,) = report.graphs
    builds = sum(row.build_s or 0.0 for row in graph.candidates)
    assert builds >= 0.3 and graph.duration_s >= builds  # the graph's time holds its builds
    assert report.recording_s is not None and report.recording_s + graph.duration_s <= report.duration_s + 0.01
    assert (f"tune {report.duration_s:.1f} s: recording {report.recording_s:.1f} s; net/graph0 "
            f"{graph.duration_s:.1f} s (builds {builds:.1f} s)") in report.describe()
    again = TuneReport.from_dict(json.loads(json.dumps(report.to_dict())))
    assert (again.recording_s, again.graphs[0].duration_s) == (report.recording_s, graph.duration_s)
    page = report.to_html()
    assert f"recording {report.recording_s:.1f} s" in page
    assert f"took {graph.duration_s:.1f} s (builds, checks and measurements; candidates' builds {builds:.1f} s" in page


@pytest.mark.parametrize("spill_bytes", ["0", None], ids=["spilled", "in-memory"])
def test_spilled_references_judge_candidates_like_in_memory_ones(spill_bytes, fast_profiling, monkeypatch, tmp_path):
    from aitune.torch.check.references import ReferenceStore

    if spill_bytes is not None:
        monkeypatch.setenv("AITUNE_REFERENCE_SPILL_BYTES", spill_bytes)
    spilled = []  # the real _spill runs; this only notes that it did
    spill = ReferenceStore._spill
    monkeypatch.setattr(ReferenceStore, "_spill", lambda store, group: (spilled.append(len(group)), spill(store, group))[1])
    report = tune(fast_profiling, [OffByLittleBackend(), ClampingBackend(), TorchEagerBackend()])
    assert bool(spilled) == (spill_bytes is not None)  # the "spilled" case really judged against files
    rows = {row.backend: row for row in report.rows if not row.reason.startswith("baseline")}
    assert rows["test_off_by_little"].status == "rejected (correctness)"
    assert "values off by more than atol=0.0001" in rows["test_off_by_little"].reason
    assert rows["test_clamping"].status == "rejected (correctness)"
    assert rows["test_clamping"].reason.startswith("probe float-scale-up")
    assert rows["eager"].status in ("passed", "selected") and rows["eager"].probes["passed"] > 0
    assert not list(tmp_path.rglob("references-*"))  # spilled files are removed once the graph is tuned


def test_probes_past_the_reference_bound_are_dropped_and_counted():
    net = model()
    graph = record_graphs(net, [((torch.rand(2, 16),), {}), ((torch.rand(4, 16),), {})])[0]

    def run_eager(sample):
        with torch.no_grad():
            return net(*sample.args, **sample.kwargs)

    sample_outputs = [run_eager(sample) for sample in graph.samples]
    unbounded = make_probes(graph, run_eager, ProbeConfig(max_reference_bytes=None), sample_outputs)
    assert len(unbounded.probes) >= 4 and unbounded.dropped_memory == 0
    sizes = [probe.reference_outputs.numel() * 4 for probe in unbounded.probes]
    bound = sum(sizes[:2])
    bounded = make_probes(graph, run_eager, ProbeConfig(max_reference_bytes=bound), sample_outputs)
    assert [p.kind for p in bounded.probes][:2] == [p.kind for p in unbounded.probes][:2]
    assert sum(probe.reference_outputs.numel() * 4 for probe in bounded.probes) <= bound
    assert bounded.dropped_memory > 0
    assert len(bounded.probes) + bounded.dropped_memory == len(unbounded.probes)


def test_the_report_row_says_how_many_probes_were_dropped(fast_profiling):
    report = tune(fast_profiling, [TorchEagerBackend()], ProbeConfig(max_reference_bytes=0))
    row = next(row for row in report.rows if row.backend == "eager" and row.probes)
    assert row.probes["checked"] == 0 and row.probes["dropped_memory"] > 0
    assert f"({row.probes['dropped_memory']} dropped: memory)" in report.table()


def test_probe_reference_bound_is_validated():
    with pytest.raises(ConfigError, match="max_reference_bytes"):
        ProbeConfig(max_reference_bytes=-1)
