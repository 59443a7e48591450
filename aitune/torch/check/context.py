"""What the checks of one graph need: the graph, the user's module, eager's references, and how candidates are
judged.

:class:`GraphContext` is made once per graph by ``ait.tune`` and passed to every check
(:mod:`aitune.torch.check.checks`) and to the search (:mod:`aitune.torch.search`), which fills in the figures it
measures; :class:`EvaluationSettings` are a strategy's settings for judging one candidate.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import math
import time
from pathlib import Path
from typing import Any, Iterator

import torch

from aitune.errors import CorrectnessError, ToleranceExceededError
from aitune.torch.check.correctness import OutputComparator, Tolerance, exact_fp32
from aitune.torch.check.error_metrics import LeafErrors, chunk_pieces, compute_dtype
from aitune.torch.check.guard import signature
from aitune.torch.check.probes import ProbeConfig, ProbeSet, make_probes
from aitune.torch.check.references import (CHUNK_ELEMENTS, ReferenceStore, StoredTensor, flatten_outputs,
                                           leaf_magnitudes, spill_bytes_from_env)
from aitune.torch.common.dtypes import is_fp32_model
from aitune.torch.measure.profiling import Measurement, ProfilingConfig
from aitune.torch.record.pytree import tree_flatten, tree_unflatten

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class GraphContext:
    """What evaluating candidates for one graph of one module needs.

    Attributes:
        module: the user's module (never modified). module_name: report name.
        graph: the :class:`~aitune.torch.record.samples.GraphSpec` with recorded samples.
        device: where to build and run. workdir: ``<cache>/<module>/<graph>``.
        reference_outputs: eager outputs per sample (computed once on cloned inputs under no_grad), as kept by
            ``references`` (:class:`~aitune.torch.check.references.StoredOutputs`).
        reference_inputs_after: per sample, the input leaves after the eager call (for in-place ops; None when
            the graph changes no input).
        references: where eager's outputs on samples, probes and rule 5's fp32 runs are kept — host memory,
            spilled to a file in the workdir once large (:mod:`aitune.torch.check.references`); :meth:`release`
            removes its files.
        cache: optional build cache (see :mod:`aitune.torch.search.cache`).
        eager_measurement: eager's figures, measured once per graph (set by
            :func:`aitune.torch.search.evaluation.eager_candidate`).
        eager_runner: plain eager as a built backend, made once per graph by
            :func:`aitune.torch.search.evaluation.eager_runner`: what every candidate is timed against.
        restore_state: for a module that changes its own parameters/buffers in ``forward`` (a stateful
            graph), puts them back to where tuning started; eager's references and every candidate's check
            start from that state. None for stateless graphs.
        progress: where phases are shown (:class:`~aitune.torch.report.progress.TuneProgress`), or None.
        crashes: candidates that crashed this environment before (:class:`~aitune.torch.search.crashes.CrashRegistry`).
        rankings: earlier searches' rankings (:class:`~aitune.torch.search.rankings.RankingStore`).
        deadline: ``time.perf_counter()`` by which this graph should be done (from the time budget), or None.
        seeded: the graph is nondeterministic (``graph.nondeterministic``) and eager repeats itself under a fixed
            seed: eager's references and every candidate's checked call run under :data:`CHECK_SEED`
            (:meth:`rng`). False for a deterministic graph, and for a nondeterministic one that no seed
            controls (then no candidate can be compared with eager: :meth:`require_comparable`).
    """

    def remaining_s(self) -> float | None:
        """Seconds left of this graph's time budget (None: no budget)."""
        return None if self.deadline is None else self.deadline - time.perf_counter()

    def show(self, candidate: str, phase: str) -> None:
        """Tell the progress display which candidate is in which phase."""
        if self.progress is not None:
            self.progress.phase(candidate, phase)

    module: torch.nn.Module
    module_name: str
    graph: Any
    device: torch.device
    workdir: Path
    reference_outputs: list
    reference_inputs_after: list | None = None
    cache: Any = None
    eager_measurement: Measurement | None = None
    restore_state: Any = None
    progress: Any = None  # a TuneProgress (aitune/torch/report/progress.py); None: nothing shown
    crashes: Any = None  # a CrashRegistry (aitune/torch/search/crashes.py); None: crashes are not remembered
    rankings: Any = None  # a RankingStore (aitune/torch/search/rankings.py); None: every tune searches in full
    deadline: float | None = None  # perf_counter() by which this graph's evaluations should end (time budget)
    references: ReferenceStore = dataclasses.field(default_factory=ReferenceStore)
    eager_runner: Any = None  # plain eager, built once per graph by the search: what candidates are timed against
    _output_magnitudes: list | None = None  # per output leaf, eager's largest |x| over the samples
    _probes: dict = dataclasses.field(default_factory=dict)
    _fp32_outputs: dict = dataclasses.field(default_factory=dict)
    _fp32_inputs_after: dict = dataclasses.field(default_factory=dict)  # graphs that change their inputs in place
    _fp32_unavailable: bool = False
    seeded: bool = False

    @classmethod
    def from_eager(cls, module: torch.nn.Module, module_name: str, graph, device: torch.device, workdir: Path, *,
                   cache=None, restore_state=None, spill_bytes: int | None = None) -> "GraphContext":
        """The context of ``graph`` with eager's reference outputs per sample, computed once on cloned inputs
        under no_grad, in order (for a stateful graph from the module's starting state, which ``restore_state``
        puts back).

        First the graph's first sample runs through eager twice: outputs that differ between the two runs (by
        more than the default :class:`Tolerance`) mark the graph nondeterministic (``graph.nondeterministic``
        holds the reason; NOTE [nondeterministic forward]). The references of such a graph are made under
        :data:`CHECK_SEED`, and one more seeded run tells whether the seed makes eager repeat itself
        (``seeded``). These extra runs leave the caller's random number generators as they were.

        The outputs — and, for a graph that changes its inputs in place, the inputs after the call — are kept by
        a :class:`~aitune.torch.check.references.ReferenceStore`: on the host, spilled to a temporary file in
        ``workdir`` once they pass ``spill_bytes`` (default ``$AITUNE_REFERENCE_SPILL_BYTES`` or 256 MiB).
        One sample's inputs and outputs are alive at a time.
        """
        store = ReferenceStore(workdir, module=module,
                               spill_bytes=spill_bytes_from_env() if spill_bytes is None else spill_bytes)
        context = cls(module=module, module_name=module_name, graph=graph, device=device, workdir=workdir,
                      reference_outputs=[], cache=cache, restore_state=restore_state, references=store)
        graph.rounding_spread = None
        graph.nondeterministic, spread = context._repeat_difference(seed=False) if graph.samples else (None, None)
        context.seeded = graph.nondeterministic is not None
        outputs, inputs_after = [], [] if graph.mutated_inputs else None
        if restore_state is not None:
            restore_state()
        with torch.no_grad():
            for sample in graph.samples:
                inputs = sample.clone()
                with context.rng():  # seeded per call, as each candidate's call is
                    outputs.append(store.keep(module(*inputs.args, **inputs.kwargs)))
                if inputs_after is not None:
                    inputs_after.append(store.keep(inputs.leaves()))
                del inputs
        context.reference_outputs, context.reference_inputs_after = outputs, inputs_after
        if context.seeded:
            still, seeded_spread = context._repeat_difference(seed=True, first=outputs[0])
            if spread is not None and (still is None or seeded_spread is not None):
                # rounding, not random draws (NOTE [eager that repeats itself up to rounding])
                graph.nondeterministic, context.seeded = None, False
                graph.rounding_spread = spread
                logger.info("aitune: %s/%s: two eager runs differ by rounding only (%s): judged as deterministic, "
                            "without the run-time guard", module_name, graph.name, spread)
                return context
            context.seeded = still is None
            graph.nondeterministic += ("; under a fixed seed eager repeats itself: candidates are checked under "
                                       "that seed, without the fp32-parity rule" if still is None else
                                       "; eager differs between runs even under a fixed seed: eager is kept")
            logger.info("aitune: %s/%s: forward is nondeterministic: %s", module_name, graph.name,
                        graph.nondeterministic)
        return context

    def rng(self):
        """The random number generators a checked call runs under: for a :attr:`seeded` graph, the CPU's and the
        graph's CUDA device's seeded with :data:`CHECK_SEED` (the caller's states restored after), else as they
        are (a no-op)."""
        return seeded_rng(self.device) if self.seeded else contextlib.nullcontext()

    def require_comparable(self) -> None:
        """Raise CorrectnessError for a nondeterministic graph that no seed makes repeat itself: eager differs from
        eager there, so no candidate can be shown to compute what eager computes (eager is kept)."""
        reason = getattr(self.graph, "nondeterministic", None)
        if reason is not None and not self.seeded:
            raise CorrectnessError(f"forward is nondeterministic: {reason}; no candidate can be compared with "
                                   "eager, eager is kept")

    def _repeat_difference(self, *, seed: bool, first: Any = None) -> tuple[str | None, str | None]:
        """Run the first sample through eager (twice, or once more against ``first``), the caller's random
        generators left as they were. Returns ``(what differs, rounding spread)``: ``(None, None)`` when the
        outputs agree; else the difference, and :func:`rounding_spread`'s account of it when it is rounding only
        and no run drew from torch's generators (their states moved)."""
        sample = self.graph.samples[0]
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.random.fork_rng(devices=_cuda_indices(self.device)))
            runs = [first] if first is not None else []
            drew = False
            while len(runs) < 2:
                if self.restore_state is not None:
                    self.restore_state()
                with seeded_rng(self.device) if seed else contextlib.nullcontext(), torch.no_grad():
                    inputs = sample.clone()
                    before = _generator_states(self.device)
                    runs.append(self.module(*inputs.args, **inputs.kwargs))
                    drew = drew or not all(map(torch.equal, before, _generator_states(self.device)))
        if self.restore_state is not None:
            self.restore_state()
        try:
            OutputComparator(Tolerance()).compare(runs[0], runs[1])
        except ToleranceExceededError as exc:
            if math.isfinite(exc.max_abs_error):
                spread = None
                if not drew:  # random draws are never rounding (NOTE [eager that repeats itself up to rounding])
                    try:
                        spread = rounding_spread(runs[0], runs[1])
                    except Exception:  # noqa: BLE001 - a leaf it cannot read (memory, dtype): not judged rounding
                        logger.debug("rounding_spread failed", exc_info=True)
                return (f"two eager runs on one input differ (output {exc.leaf}: max abs error "
                        f"{exc.max_abs_error:.3g})", spread)
            return f"two eager runs on one input differ ({str(exc)[:120]})", None
        except CorrectnessError as exc:
            return f"two eager runs on one input differ ({str(exc)[:120]})", None
        return None, None

    def run_eager(self, sample) -> Any:
        """Eager's outputs on a clone of ``sample``, under no_grad, from the starting state (as returned: pass
        them to ``references.keep`` to hold on to them)."""
        if self.restore_state is not None:
            self.restore_state()
        inputs = sample.clone()
        with torch.no_grad(), self.rng():
            return self.module(*inputs.args, **inputs.kwargs)

    def output_magnitudes(self) -> list[float | None]:
        """Per output leaf, eager's largest finite ``|x|`` over the recorded samples (None for leaves that are
        not float tensors); read once per graph (:func:`aitune.torch.check.references.leaf_magnitudes`)."""
        if self._output_magnitudes is None:
            largest: list[float | None] = []
            for outputs in self.reference_outputs:
                for position, magnitude in enumerate(leaf_magnitudes(outputs)):
                    if position == len(largest):
                        largest.append(magnitude)
                    elif magnitude is not None and largest[position] is not None:
                        largest[position] = max(largest[position], magnitude)
            self._output_magnitudes = largest
        return self._output_magnitudes

    def probes(self, config: ProbeConfig) -> ProbeSet:
        """The graph's probes with eager's outputs (derived once per graph and config, shared by candidates)."""
        if not config.enabled:
            return ProbeSet([])
        key = (config.max_probes, config.seed, config.max_reference_bytes)
        if key not in self._probes:
            with one_off_calls():  # probes have shapes and values the user may never run
                self._probes[key] = make_probes(self.graph, self.run_eager, config, self.reference_outputs,
                                                keep=self.references.keep)
            if self.restore_state is not None:
                self.restore_state()
        return self._probes[key]

    def checked_signatures(self) -> set:
        """Input signatures (tensor shapes) every candidate was checked on: the samples and the probes."""
        probes = [probe for probe_set in self._probes.values() for probe in probe_set.probes]
        return {signature(s.leaves()) for s in self.graph.samples} | {signature(p.sample.leaves()) for p in probes}

    def release(self) -> None:
        """Drop the references (probes', rule 5's) and remove spilled files once the graph is tuned."""
        self._probes.clear()
        self._fp32_outputs.clear()
        self._fp32_inputs_after.clear()
        self._output_magnitudes = None
        if self.eager_runner is not None:
            self.eager_runner.deactivate()
            self.eager_runner = None
        self.reference_outputs = []
        self.reference_inputs_after = None
        self.references.close()

    def fp32_reference(self, index: int) -> Any:
        """Outputs of a float32 copy of the module on sample ``index`` (fp16/bf16 inputs upcast), or None; TF32
        off (:func:`~aitune.torch.check.correctness.exact_fp32`). An fp32 module is run itself, not copied.

        Computed lazily, only when a candidate misses the plain tolerance on an fp16/bf16 leaf, or on an fp32
        leaf that eager computed in TF32 (correctness rule 5),
        and kept like eager's references (``references``); the copy is dropped right after. None when the copy
        or the call fails (e.g. out of memory), and for a nondeterministic graph (rule 5 off there: eager's own
        distance from an fp32 run measures its random draws, not its rounding; NOTE [nondeterministic forward]).
        """
        if self._fp32_unavailable or getattr(self.graph, "nondeterministic", None) is not None:
            return None
        if index not in self._fp32_outputs:
            try:
                module32 = _float32(self.module)
                with torch.no_grad(), one_off_calls(), exact_fp32():
                    for position, sample in enumerate(self.graph.samples):
                        args, kwargs = _upcast(sample.clone())
                        self._fp32_outputs[position] = self.references.keep(module32(*args, **kwargs))
                        if self.graph.mutated_inputs:  # what the fp32 run wrote into its inputs (a cache)
                            self._fp32_inputs_after[position] = self.references.keep(tree_flatten((args, kwargs))[0])
                del module32
            except Exception:  # noqa: BLE001 - rule 5 is a second chance, never a new failure
                logger.debug("no fp32 reference for %s/%s", self.module_name, self.graph.name, exc_info=True)
                self._fp32_unavailable = True
                return None
        return self._fp32_outputs.get(index)

    def fp32_inputs_after(self, index: int) -> Any:
        """The inputs of the float32 run of :meth:`fp32_reference` on sample ``index`` after the call (flattened
        leaves), for a graph whose ``forward`` changes its inputs in place; None as for :meth:`fp32_reference`."""
        if self.fp32_reference(index) is None:
            return None
        return self._fp32_inputs_after.get(index)

    def fp32_reference_for(self, sample) -> Any:
        """Outputs of a float32 copy of the module on ``sample`` (a probe), or None (as :meth:`fp32_reference`);
        the copy is dropped after."""
        if self._fp32_unavailable or getattr(self.graph, "nondeterministic", None) is not None:
            return None
        try:
            if self.restore_state is not None:
                self.restore_state()
            module32 = _float32(self.module)
            with torch.no_grad(), one_off_calls(), exact_fp32():
                args, kwargs = _upcast(sample.clone())
                return module32(*args, **kwargs)
        except Exception:  # noqa: BLE001 - rule 5 is a second chance, never a new failure
            logger.debug("no fp32 reference for a probe of %s/%s", self.module_name, self.graph.name, exc_info=True)
            return None


# NOTE [nondeterministic forward]: a ``forward`` that draws random numbers (``torch.randn_like`` noise,
# ``F.dropout(x, training=True)``) differs from itself between runs, so "close to eager" says nothing unless both
# sides draw the same numbers; and correctness rule 5's "no further from an fp32 run than eager" is met by any
# output of the right scale, since eager's own distance from that run is the spread of its draws (a bf16
# candidate passed it at SQNR -3 dB, cosine -0.02). Such a graph (two eager runs on its first sample disagree by
# the default tolerance) is judged thus: eager's references and every candidate's checked call run with the
# random generators seeded alike (``torch.manual_seed``); rule 5 is off; rules 3 and 6 decide. A candidate that
# draws eager's stream (eager-based ones, TorchAO's quantized eager) can pass; one that draws its own (Inductor's
# generator, ONNX Runtime's) fails with a reason that says the forward is nondeterministic. Where even a fixed
# seed does not make eager repeat itself, every candidate is rejected and eager kept. The run-time guard does
# not re-check such a graph (two runs of it cannot be compared). Documented in docs/design.md (correctness).
CHECK_SEED = 20240917  # the seed of a nondeterministic graph's checked calls (any fixed number)

# NOTE [eager that repeats itself up to rounding]: some kernels sum in an order that varies from run to run
# (split-K matmuls, atomics), so two eager runs of a reduced-precision graph can differ by more than the default
# tolerance without drawing a random number; calling such a graph nondeterministic kept eager for it and rejected
# every candidate (benchmarks/RESULTS.md: a bf16 decoder's decode step at batch 8). A graph is judged as
# deterministic, with ``graph.rounding_spread`` saying how far apart its runs were, when (1) its eager runs drew
# nothing from torch's generators (the CPU's and the device's states did not move: dropout and noise move them)
# and two of them differ by rounding only (rounding_spread), and (2) under one seed the runs agree, or differ by
# rounding only too (the kernels' order varies from run to run, so a seeded pair may agree by chance). Rounding
# only: every float leaf at least ROUNDING_SPREAD_MIN_SQNR_DB from the other and no element further apart than
# ROUNDING_SPREAD_MAX_EPS times its dtype's machine epsilon times the leaf's largest |x| (one redrawn row fails
# this even where the SQNR passes), non-finite values at the same places, every other leaf equal. The floors: bf16
# keeps 8 significant bits, one rounding ~48 dB, and two orders of summation differ by a few roundings (35-50 dB,
# a few epsilons at the largest values); a draw of the output's own scale sits far below (dropout at p=0.1 ~10
# dB). What still passes: draws from a generator of the module's own (``torch.Generator``), which moves neither
# state, that are also that small. Such a graph gets no run-time guard: eager's own runs disagree, so a per-call
# comparison could retire a correct backend.
ROUNDING_SPREAD_MIN_SQNR_DB = 30.0
ROUNDING_SPREAD_MAX_EPS = 8.0


def rounding_spread(first: Any, second: Any) -> str | None:
    """``"max abs X, SQNR >= N dB"`` when two outputs of one structure (raw or as kept by a
    :class:`~aitune.torch.check.references.ReferenceStore`) differ by rounding only, by the rules of NOTE [eager
    that repeats itself up to rounding]; else None. Read a chunk at a time, on the raw output's device."""
    leaves, other = flatten_outputs(first)[0], flatten_outputs(second)[0]
    if len(leaves) != len(other):
        return None
    worst_sqnr, worst_abs = math.inf, 0.0
    for a, b in zip(leaves, other):
        tensors = [isinstance(leaf, (torch.Tensor, StoredTensor)) for leaf in (a, b)]
        if not all(tensors):
            if any(tensors):
                return None
            try:
                if a is not b and bool(a != b):
                    return None
            except Exception:  # noqa: BLE001 - a leaf whose comparison is not a bool (an array): not judged equal
                return None
            continue
        if tuple(a.shape) != tuple(b.shape) or a.dtype != b.dtype:
            return None
        device = next((leaf.device for leaf in (b, a) if isinstance(leaf, torch.Tensor)), torch.device("cpu"))
        pieces = chunk_pieces([a, b], device, CHUNK_ELEMENTS)
        if not a.dtype.is_floating_point:
            if not all(torch.equal(x, y) for x, y in pieces):
                return None
            continue
        errors = LeafErrors(device, compute_dtype(a.dtype), record_norms=True, count_excess=False)
        for x, y in pieces:
            errors.add(x, y, 0.0, 0.0)
        if int(errors.non_finite) or int(errors.extra_finite) or int(errors.sign):  # non-finite at other places
            return None
        sqnr, apart = errors.norms.sqnr_db(), float(errors.max_abs)
        if sqnr == math.inf:
            continue
        if not (sqnr >= ROUNDING_SPREAD_MIN_SQNR_DB
                and apart <= ROUNDING_SPREAD_MAX_EPS * torch.finfo(a.dtype).eps * float(errors.max_expected)):
            return None
        worst_sqnr, worst_abs = min(worst_sqnr, sqnr), max(worst_abs, apart)
    return "runs identical" if worst_sqnr == math.inf else f"max abs {worst_abs:.3g}, SQNR >= {worst_sqnr:.1f} dB"


def _generator_states(device: torch.device) -> list[torch.Tensor]:
    """The CPU generator's state and ``device``'s CUDA generator's: a forward that draws from them moves them."""
    return [torch.get_rng_state(), *(torch.cuda.get_rng_state(index) for index in _cuda_indices(device))]


def _cuda_indices(device: torch.device) -> list[int]:
    if device.type != "cuda":
        return []
    return [device.index if device.index is not None else torch.cuda.current_device()]


@contextlib.contextmanager
def seeded_rng(device: torch.device) -> Iterator[None]:
    """The CPU generator and ``device``'s CUDA generator seeded with :data:`CHECK_SEED`; their states before are
    restored after (``torch.random.fork_rng``), so the caller's stream of random numbers does not move."""
    indices = _cuda_indices(device)
    with torch.random.fork_rng(devices=indices):
        torch.default_generator.manual_seed(CHECK_SEED)
        for index in indices:
            with torch.cuda.device(index):
                torch.cuda.manual_seed(CHECK_SEED)
        yield


def _float32(module: torch.nn.Module) -> torch.nn.Module:
    """``module`` when it is float32 throughout (:func:`~aitune.torch.common.dtypes.is_fp32_model`), else a float32 copy."""
    return module if is_fp32_model(module) else copy.deepcopy(module).float()


@contextlib.contextmanager
def one_off_calls() -> Iterator[None]:
    """Eager calls whose results are references, not the user's inference: cuDNN's autotuner off.

    NOTE [no cuDNN autotuning for references]: with ``torch.backends.cudnn.benchmark = True`` (the user's
    setting, common for convnets) the first convolution of each new shape, dtype or format times every cuDNN
    algorithm, allocating each one's workspace. The float32 copy that correctness rule 5 runs on a probe is
    such a first call: for a ResNet-50 at batch 1 its workspaces can take gigabytes, many times what eager
    inference needs (``benchmarks/gpu_memory_trace.py`` shows where a tune's peak goes). A reference
    is computed once, so cuDNN's heuristic choice costs nothing in speed there; the user's setting is restored
    after.
    """
    benchmark = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = False
    try:
        yield
    finally:
        torch.backends.cudnn.benchmark = benchmark


def _upcast(sample) -> tuple[tuple, dict]:
    leaves, spec = tree_flatten((sample.args, sample.kwargs))
    leaves = [leaf.float() if isinstance(leaf, torch.Tensor) and leaf.dtype in (torch.float16, torch.bfloat16)
              else leaf for leaf in leaves]
    return tree_unflatten(spec, leaves)


@dataclasses.dataclass(kw_only=True)
class EvaluationSettings:
    """How candidates are judged (a strategy's settings).

    Attributes:
        tolerance: thresholds of the comparison with eager (also used for the round trip of AOT artifacts).
        profiling: how to measure. correctness_check: compare with eager (default True).
        probes: inputs beyond the recorded samples every candidate is checked on (:mod:`aitune.torch.check.probes`).
        measure: measure passing candidates (default True).
    """

    tolerance: Tolerance = dataclasses.field(default_factory=Tolerance)
    profiling: ProfilingConfig = dataclasses.field(default_factory=ProfilingConfig)
    probes: ProbeConfig = dataclasses.field(default_factory=ProbeConfig)
    correctness_check: bool = True
    measure: bool = True
