"""``ait.tune``: the recording pass, then each wrapped module's strategy per graph, then activation."""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import torch

from aitune.errors import AITuneError, ConfigError
from aitune.torch import dataloader
from aitune.torch.report import telemetry
from aitune.torch.common.arguments import known_keywords
from aitune.torch.config import config
from aitune.torch.common.environment import environment
from aitune.torch.search.max_batch_size import search_for_graph
from aitune.torch.measure.memory import PeakMemory, available_memory_bytes
from aitune.torch.module import Module, ModuleState, registered_modules, set_recording_batch_size
from aitune.torch.record.module_arguments import check_unique_names
from aitune.torch.report.rows import GraphReport, TuneReport
from aitune.torch.record.samples import clone_tree, hook_hint
from aitune.torch.record.state import AttributeSnapshot
from aitune.torch.tune_strategy import MaxThroughputStrategy, TuneStrategy
from aitune.torch.check.context import GraphContext
from aitune.torch.compat import strategy as _reference_strategy  # noqa: F401 - installs the reference contract
from aitune.torch.check.guard import guard_for
from aitune.torch.planning import plan_modules
from aitune.torch.report.progress import TuneProgress
from aitune.utils.logging import libraries_logging
from aitune.utils.monitoring import annotate
from aitune.torch.search.cache import BuildCache
from aitune.torch.search.crashes import FILE_NAME, CrashRegistry
from aitune.torch.search.rankings import RANKINGS_DIR, RankingStore

logger = logging.getLogger(__name__)


def cache_dir() -> Path:
    """Root of builds and reports: ``aitune.torch.config.cache_dir`` (``$AITUNE_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/aitune``, else ``~/.cache/aitune`` unless set)."""
    return config.cache_dir


@known_keywords
def tune(func: Callable[..., Any], dataset: Any, batch_sizes: list[int] | None = None,
         max_num_batches_per_batch_size: int | None = None, device: str | torch.device | None = None,
         dry_run: bool = False, disable_external_logging: bool = False, clear_cache: bool = False,
         ignore_failing_modules: bool = True, *, ready_batches: bool = False, modules: Iterable[Module] | None = None,
         cache_dir_path: str | Path | None = None, report_path: str | Path | None = None,
         use_cache: bool = True, progress: bool | None = None, time_budget_s: float | None = None) -> TuneReport:
    """Record, build, check, measure and choose a backend for every wrapped module ``func`` calls.

    The arguments up to ``ignore_failing_modules`` are the reference system's, in its order.

    Args:
        func: the model, pipeline or function to run. Each batch is passed as ``func(*args, **kwargs)``
            (:mod:`aitune.torch.dataloader`: a dict item becomes keyword arguments, a tuple positional
            arguments, anything else one argument); a dict batch goes to a callable that cannot take its keys
            as keywords but takes one argument as that dict (NOTE [dict batches and signatures]).
        dataset: single examples — a tensor (one example), a sequence, a ``torch.utils.data.Dataset``, or a
            :class:`~aitune.torch.dataloader.DataLoaderFactory`. A ``torch.utils.data.DataLoader`` yields
            ready batches, passed as they are (as with ``ready_batches=True``).
        batch_sizes: examples are stacked into batches of each size, in order (default ``[1, 2]``: two sizes
            let aitune find the batch axes; one size means static shapes). Per size, ``len(dataset) // size``
            batches (one of repeated examples if the dataset is shorter).
        max_num_batches_per_batch_size: at most this many batches per size (default: all).
        device: where to build and measure; default: the device of the wrapped modules' parameters (the
            reference defaults to ``"cuda:0"``; aitune never moves your module).
        dry_run: record and plan only: which candidates each graph would try and each one's ``supports()``
            verdict (report rows ``planned``); nothing is built and modules keep recording
            (:mod:`aitune.torch.planning`).
        disable_external_logging: silence loggers other than aitune's (below ERROR) while tuning.
        clear_cache: drop the reusable AOT builds (``<cache>/builds``) and the build folders of the modules
            tuned now before tuning, so everything is built afresh.
        ignore_failing_modules: a module whose tuning raises runs eager (True) or the error propagates.
        ready_batches: dataset items are ready batches (aitune's own convention before the reference's rules):
            each is passed as ``func(item)`` — spread as positional/keyword arguments when ``func`` is a
            module, or as keywords when a dict's keys bind to ``func``'s signature — and never stacked;
            ``batch_sizes`` must then be None.
        modules: wrapped modules to tune; default: every wrapper that recorded calls during this pass.
        cache_dir_path: builds go to ``<cache>/<module>/<graph>/<backend key>/`` (default :func:`cache_dir`).
        report_path: JSON report path (default ``<cache>/reports/tune-<time>.json``); the report is also
            written to ``config.tuning_data_output_path``.
        use_cache: reuse earlier AOT builds from the tuning cache when nothing that matters changed.
        progress: show progress on the terminal (module/graph, candidate, phase, elapsed, left); None (default)
            = when standard error is a terminal, unless ``AITUNE_PROGRESS=0`` (see :mod:`aitune.torch.report.progress`).
        time_budget_s: seconds for the whole run (recording excluded), shared out evenly among the graphs left;
            a candidate is not started once its graph's share is spent (its row says "skipped"), child build
            steps get at most the time left, and expensive candidates (max-autotune) are tried only with
            >= 300 s left. None (default): no limit, and no expensive candidates. Builds running in this process
            (Inductor JIT, TorchAO) cannot be interrupted: a budget can be overrun by the one build in flight.


    Returns:
        The :class:`~aitune.torch.report.rows.TuneReport` (also written as JSON and logged as a table).

    Raises:
        ConfigError: bad ``func``/``dataset``/``batch_sizes``/``device``, a dataset item ``func`` cannot take,
            or no wrapped module was called.
    """
    started = time.perf_counter()
    if not callable(func):
        raise ConfigError(f"func must be callable (e.g. lambda batch: model(**batch)), got {type(func).__name__}")
    ready = ready_batches or dataloader.ready_batches(dataset)
    if ready and batch_sizes is not None:
        raise ConfigError("batch_sizes stacks single examples into batches; with ready batches (ready_batches=True "
                          "or a DataLoader) leave batch_sizes=None")
    if batch_sizes is not None:
        if not isinstance(batch_sizes, (list, tuple)) or not batch_sizes or not all(
                isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in batch_sizes):
            raise ConfigError(f"batch_sizes must be a non-empty list of ints >= 1, got {batch_sizes!r}")
    root = Path(cache_dir_path).expanduser() if cache_dir_path else cache_dir()
    _warn_low_disk(root)
    peak_memory = PeakMemory()
    peak_memory.start()  # the report's peak memory covers the recording pass too
    with libraries_logging(disable_external_logging), annotate("tune", color="yellow"):
        calls = _calls(dataset, ready, list(batch_sizes or dataloader.DEFAULT_BATCH_SIZES),
                       max_num_batches_per_batch_size)
        before = {id(m): m for m in registered_modules()}
        snapshots = {id(m): _Snapshot(m.__wrapped__) for m in before.values()}
        counts_before = {key: sum(g.num_calls for g in m.graphs) for key, m in before.items()}

        # 1. Recording pass.
        recording_started = time.perf_counter()
        count = 0
        try:
            with torch.no_grad():
                for batch_size, args, kwargs in calls:
                    set_recording_batch_size(batch_size)
                    try:
                        # the caller's sample tensors are never touched
                        _call(func, clone_tree(args), clone_tree(kwargs), ready)
                    except AITuneError:
                        raise
                    except Exception as exc:
                        raise ConfigError(
                            f"calling func on {_describe_item(count, args, kwargs, batch_size)} raised "
                            f"{type(exc).__name__}: {exc}. {_calling_rule(ready)}") from exc
                    count += 1
        finally:
            set_recording_batch_size(None)
            for snapshot in snapshots.values():
                snapshot.restore()
        recording_s = round(time.perf_counter() - recording_started, 2)
        logger.info("aitune: recorded %d call(s) in %.1f s", count, recording_s)

        if modules is None:
            targets = [m for m in registered_modules() if sum(g.num_calls for g in m.graphs) > counts_before.get(
                id(m), 0) and m.state in (ModuleState.RECORDING, ModuleState.INIT)]
        else:
            targets = list(modules)
            for module in targets:
                if not isinstance(module, Module):
                    raise ConfigError(f"modules must hold aitune.torch.Module wrappers, got {type(module).__name__}")
        if not targets:
            tuned = [m.name for m in registered_modules() if m.state is ModuleState.TUNED]
            hint = (f"; already tuned modules ({', '.join(tuned)}) do not record again — call "
                    "module.enable_recording(force=True) to tune them anew") if tuned else ""
            raise ConfigError("no aitune.torch.Module was called while running func over the dataset: wrap the "
                              "module(s) to tune with ait.Module(...) (or ait.wrap) and make func call them" + hint)
        if dry_run:
            return plan(targets, device=device, cache_dir_path=root, report_path=report_path, started=started)
        if clear_cache:
            _clear_cache(root, targets)
        report = tune_modules(targets, device=device, cache_dir_path=root, report_path=report_path,
                              ignore_failing_modules=ignore_failing_modules, use_cache=use_cache,
                              snapshots=snapshots, started=started, progress=progress,
                              time_budget_s=time_budget_s, peak_memory=peak_memory, recording_s=recording_s)
        _offload_after_tuning(targets)
        telemetry.end_run(report)
        return report


def plan(modules: Iterable[Module], *, device: str | torch.device | None = None,
         cache_dir_path: str | Path | None = None, report_path: str | Path | None = None,
         started: float | None = None) -> TuneReport:
    """The dry-run report of wrappers that have recorded calls (:func:`aitune.torch.planning.plan_modules`)."""
    root = Path(cache_dir_path).expanduser() if cache_dir_path else cache_dir()
    return plan_modules(list(modules), lambda module: _resolve_device(module, device), root, report_path, started)


def tune_modules(modules: Iterable[Module], *, device: str | torch.device | None = None,
                 cache_dir_path: str | Path | None = None, report_path: str | Path | None = None,
                 ignore_failing_modules: bool = True, use_cache: bool = True, snapshots: dict | None = None,
                 started: float | None = None, progress: bool | None = None,
                 time_budget_s: float | None = None, peak_memory: PeakMemory | None = None,
                 recording_s: float | None = None) -> TuneReport:
    """Tune wrappers that have already recorded calls (their graphs hold samples), graph by graph.

    This is what :func:`tune` does after its recording pass; just-in-time tuning calls it for modules
    recorded during the user's own run. Arguments as for :func:`tune`; ``snapshots`` (``id(wrapper)`` ->
    state snapshot taken before recording), ``started`` (``perf_counter()`` at the start), ``peak_memory``
    (measuring since the recording pass) and ``recording_s`` (the recording pass's seconds, for the report) are
    passed by :func:`tune` itself.

    Returns:
        The :class:`~aitune.torch.report.rows.TuneReport` (also written as JSON and logged as a table).

    Raises:
        ConfigError: for an entry that is not an :class:`~aitune.torch.Module`, or a bad ``device``.
    """
    started = time.perf_counter() if started is None else started
    if peak_memory is None:
        peak_memory = PeakMemory()
        peak_memory.start()
    targets = list(modules)
    for module in targets:
        if not isinstance(module, Module):
            raise ConfigError(f"modules must hold aitune.torch.Module wrappers, got {type(module).__name__}")
    check_unique_names(targets, "ait.tune")
    if time_budget_s is not None and (isinstance(time_budget_s, bool) or not isinstance(time_budget_s, (int, float))
                                      or not time_budget_s > 0):
        raise ConfigError(f"time_budget_s must be a number of seconds > 0 or None, got {time_budget_s!r}")
    deadline = None if time_budget_s is None else started + float(time_budget_s)
    snapshots = snapshots or {}
    root = Path(cache_dir_path).expanduser() if cache_dir_path else cache_dir()
    report = TuneReport(environment=environment(), recording_s=recording_s)
    telemetry.begin_run(report)
    cache = crashes = rankings = None
    if use_cache:
        cache = BuildCache(root / "builds")
        crashes = CrashRegistry(root / FILE_NAME)
        rankings = RankingStore(root / RANKINGS_DIR, cache.module_fingerprint)
    budget = _Budget(deadline, sum(1 for module in targets for graph in module.graphs if graph.samples))

    # 2. Tune each module, graph by graph.
    with TuneProgress(progress) as bar:
        for module in targets:
            _tune_module(module, report, snapshots.get(id(module)) or _Snapshot(module.__wrapped__), device, root,
                         cache, ignore_failing_modules, bar, crashes, budget, peak_memory, rankings)

    for module in targets:
        snapshot = snapshots.get(id(module))
        if snapshot is not None:
            snapshot.restore()
    report.duration_s = time.perf_counter() - started
    report.peak_memory = peak_memory.result()
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S-%f")
    report.write_json(report_path or root / "reports" / f"tune-{stamp}.json")
    logger.info("aitune: tuning report\n%s", report.describe())
    return report


class _Budget:
    """The run's deadline shared out evenly among the graphs still to tune."""

    def __init__(self, deadline: float | None, graphs: int):
        self.deadline, self.graphs_left = deadline, max(graphs, 1)

    def next_graph(self) -> float | None:
        """The deadline of the next graph: now + (time left) / (graphs left)."""
        if self.deadline is None:
            return None
        now = time.perf_counter()
        share = (self.deadline - now) / self.graphs_left
        self.graphs_left = max(self.graphs_left - 1, 1)
        return now + share


def _tune_module(module: Module, report: TuneReport, snapshot: "_Snapshot", device, root: Path, cache,
                 ignore_failing_modules: bool, bar: TuneProgress, crashes=None, budget: _Budget | None = None,
                 peak_memory: PeakMemory | None = None, rankings=None) -> None:
    """Tune every graph of one wrapper with its strategy; on success it becomes TUNED (guards armed), else it
    runs eager (PASSTHROUGH) and ``report.module_errors`` says why. The module's state is restored after."""
    target_device = _resolve_device(module, device)
    logger.info("aitune: tuning %s (%d graph(s)) on %s", module.name, len(module.graphs), target_device)
    strategy_template: TuneStrategy = module.strategy or MaxThroughputStrategy()
    entries = []
    selected_rows = {}
    guards = {}
    try:
        for graph in module.graphs:
            if not graph.samples:
                continue
            strategy = (module.strategy_for(graph) or strategy_template).clone()
            # The max-batch-size search grows batches until memory runs out: not part of the peak reported.
            with peak_memory.paused() if peak_memory is not None else contextlib.nullcontext():
                search = search_for_graph(strategy, module.__wrapped__, graph, target_device, snapshot.restore)
            graph_started = time.perf_counter()
            context = GraphContext.from_eager(module.__wrapped__, module.name, graph, target_device,
                                              root / _safe(module.name) / graph.name, cache=cache,
                                              restore_state=snapshot.restore if graph.stateful else None)
            entry = GraphReport(module=module.name, graph=graph.name, spec=graph.describe(),
                                strategy=strategy.describe(), max_batch_size=search)
            report.graphs.append(entry)
            logger.info(" %s/%s: %d sample(s), strategy %s", module.name, graph.name, len(graph.samples),
                        strategy.describe())
            bar.start_graph(f"{module.name}/{graph.name}", len(strategy.candidates(target_device, module.module, graph)) + 1)
            context.progress, context.crashes, context.rankings = bar, crashes, rankings
            context.deadline = budget.next_graph() if budget is not None else None
            try:
                backend, rows, why = strategy.tune(context)
                checked = context.checked_signatures()
            finally:
                context.release()  # eager's references and their spilled files
                entry.duration_s = round(time.perf_counter() - graph_started, 2)
            bar.graph_done(backend.describe())
            entry.candidates.extend(rows)
            entry.selected, entry.selection_reason = backend.describe(), why
            entries.append((graph, backend))
            selected_rows[graph.name] = next((row.to_dict() for row in rows if row.status == "selected"), None)
            guards[graph.key] = guard_for(module.guard_config, graph, backend, strategy.tolerance,
                                          selected_rows[graph.name], checked,
                                          list(strategy.runners_up))
            snapshot.restore()
        module.install_tuned(entries, tune_rows=selected_rows)  # the rows are kept by ait.save
        for graph, _ in entries:
            module.arm_guard(graph, guards.get(graph.key))
        module.watch_state()
    except Exception as exc:
        snapshot.restore()
        failed_row = getattr(exc, "candidate_row", None)
        if failed_row is not None and report.graphs and failed_row not in report.graphs[-1].candidates:
            report.graphs[-1].candidates.append(failed_row)
        reason = f"{type(exc).__name__}: {exc}{hook_hint(module.module, exc)}"
        report.module_errors[module.name] = reason
        module.mark_failed(reason)
        logger.warning("aitune: tuning %s failed, it runs eager: %s", module.name, reason)
        if not ignore_failing_modules:
            raise
    finally:
        snapshot.restore()


def _safe(name: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "._-" else "_" for ch in name)


def _resolve_device(module: Module, device) -> torch.device:
    original = module.__wrapped__
    parameter = next(iter(original.parameters()), None)
    if parameter is None:
        parameter = next(iter(original.buffers()), None)
    if parameter is None:  # a module without weights runs where its inputs are
        parameter = next((leaf for graph in module.graphs for sample in graph.samples[:1]
                          for leaf in sample.leaves() if isinstance(leaf, torch.Tensor)), None)
    module_device = parameter.device if parameter is not None else torch.device("cpu")
    if device is None:
        return module_device
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ConfigError(f"device {device!r} is not a torch device (use 'cpu' or 'cuda:0')") from exc
    if device.type != module_device.type:
        raise ConfigError(f"device {device} differs from the device of {module.name}'s parameters "
                          f"({module_device}); move the module there first (aitune never moves your module)")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


class _Snapshot:
    """Parameters, buffers, plain attributes and ``training`` flags of a module tree, restored bit for bit
    (tuning must not change the caller's module).

    NOTE [snapshot on the host]: the copy of a CUDA module's state is kept in host memory, not beside the
    weights: a device copy of the weights can be the largest item of the tune's device peak after the
    candidates' own builds (``benchmarks/gpu_memory_trace.py`` shows where that peak goes).
    :meth:`restore` then brings each saved tensor back to its device one at a time to compare it (extra device
    memory: the largest single tensor). Where the host has less than twice the state's size available
    (``MemAvailable``), the copy stays on the device as before.
    """

    def __init__(self, module: torch.nn.Module):
        self.module = module
        # Tensors on "meta" hold no values (a module offloaded by config.device_after_tuning): nothing to restore.
        state = [(name, value) for name, value in list(module.named_parameters(remove_duplicate=False)) +
                 list(module.named_buffers(remove_duplicate=False)) if value.device.type != "meta"]
        on_device = sum(value.numel() * value.element_size() for _, value in state if value.device.type != "cpu")
        available = available_memory_bytes() if on_device else None
        self.on_host = bool(on_device) and available is not None and available > 2 * on_device
        self.tensors = {name: value.detach().to("cpu", copy=True) if self.on_host else value.detach().clone()
                        for name, value in state}
        self.training = {name: sub.training for name, sub in module.named_modules(remove_duplicate=False)}
        self.attributes = AttributeSnapshot(module)  # counters, caches, tensors kept as plain attributes

    def restore(self) -> None:
        with torch.no_grad():
            for name, value in list(self.module.named_parameters(remove_duplicate=False)) + list(
                    self.module.named_buffers(remove_duplicate=False)):
                saved = self.tensors.get(name)
                if saved is None or value.device.type == "meta":
                    continue
                if saved.dtype != value.dtype or saved.shape != value.shape:  # .half() / a resize: the tensor itself
                    logger.debug("restoring %s (dtype or shape changed during tuning)", name)
                    value.data = saved.to(value.device, copy=True)
                    continue
                saved = saved.to(value.device)  # the host copy, one tensor at a time (no copy if already there)
                if not torch.equal(saved, value):  # dtypes are equal here: torch.equal calls 1.0 == half(1.0) equal
                    logger.debug("restoring %s changed during tuning", name)
                    value.copy_(saved)
        for name, sub in self.module.named_modules(remove_duplicate=False):
            if name in self.training:
                sub.training = self.training[name]
        self.attributes.restore()


def _calls(dataset: Any, ready: bool, batch_sizes: list[int],
           max_num_batches_per_batch_size: int | None) -> Iterator[tuple[int | None, list, dict]]:
    """``(batch size or None, args, kwargs)`` per call of the recording pass (see :func:`tune`)."""
    if ready:
        dataloader.check_batch_cap(max_num_batches_per_batch_size)
        items = dataloader.dataset_items(dataset)
        if max_num_batches_per_batch_size is not None:
            items = list(items)[:max_num_batches_per_batch_size]
        return ((None, [item], {}) for item in items)
    if len(set(batch_sizes)) == 1:
        logger.warning("aitune: one batch size (%d): batch axes cannot be found, static shapes are assumed; give "
                       "at least two (e.g. batch_sizes=[1, 2]) to tune for a range of batch sizes", batch_sizes[0])
    if not isinstance(dataset, dataloader.DataLoaderFactory):
        dataset = dataloader.DataLoaderFactory(dataset)  # reads an iterable once; a bad or empty dataset raises here
    return dataloader.samples_generator(dataset, batch_sizes, max_num_batches_per_batch_size)


def _call(func, args: list, kwargs: dict, ready: bool):
    if not ready:
        return dataloader.call_with_batch(func, args, kwargs)
    item = args[0]
    if isinstance(func, (Module, torch.nn.Module)):
        if isinstance(item, (tuple, list)):
            return func(*item)
        if isinstance(item, dict):
            return func(**item)
    if isinstance(item, dict):
        return dataloader.call_with_batch(func, [], item)
    return func(item)


def _calling_rule(ready: bool) -> str:
    if ready:
        return ("With ready batches, func is called as func(item) (a module gets a tuple spread as positional "
                "and a dict as keyword arguments); adapt func or the dataset")
    return ("Examples are stacked into batches and func is called as func(*args, **kwargs): a dict example gives "
            "keyword arguments, a tuple positional ones, anything else one argument. If your items are already "
            "batches, pass ready_batches=True")


def _describe_item(index: int, args: list, kwargs: dict, batch_size: int | None) -> str:
    if batch_size is not None:
        return f"batch #{index} of batch size {batch_size} {dataloader.describe_batch(args, kwargs)}"
    item = args[0]
    if isinstance(item, torch.Tensor):
        what = f"tensor {tuple(item.shape)}"
    elif isinstance(item, dict):
        what = "dict with keys " + ", ".join(map(str, item))
    else:
        what = type(item).__name__
    return f"dataset item #{index} ({what})"


LOW_DISK_BYTES = 50 * 2**30  # the reference system's default of AITUNE_CACHE_MIN_FREE_BYTES
_warned_low_disk: set[str] = set()


def _warn_low_disk(root: Path) -> None:
    """One warning per cache root when it has less free space than ``$AITUNE_CACHE_MIN_FREE_BYTES`` (50 GiB)."""
    try:
        threshold = int(os.environ.get("AITUNE_CACHE_MIN_FREE_BYTES", LOW_DISK_BYTES))
    except ValueError:
        threshold = LOW_DISK_BYTES
    probe = root
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        free = shutil.disk_usage(probe).free
    except OSError:
        return
    if free < threshold and str(root) not in _warned_low_disk:
        _warned_low_disk.add(str(root))
        logger.warning("aitune: %.1f GiB free under %s (below AITUNE_CACHE_MIN_FREE_BYTES = %.1f GiB): engine "
                       "builds and artifacts may run out of space", free / 2**30, root, threshold / 2**30)


def _clear_cache(root: Path, modules: list[Module]) -> None:
    """``clear_cache=True``: drop the reusable builds and these modules' build folders (nothing else under
    ``root``, which may be a shared directory)."""
    for path in [root / "builds"] + [root / _safe(module.name) for module in modules]:
        if path.is_dir():
            logger.info("aitune: clear_cache: removing %s", path)
            shutil.rmtree(path, ignore_errors=True)


def _offload_after_tuning(modules: list[Module]) -> None:
    """``config.device_after_tuning``: move each original module there when no tuned graph needs it."""
    target = config.device_after_tuning
    if target is None:
        return
    for module in modules:
        if module.state is ModuleState.TUNED:
            if module.offload(target):
                logger.info("aitune: %s's original module moved to %s (config.device_after_tuning)", module.name, target)
            else:
                logger.info("aitune: %s keeps its original module where it is: a tuned graph runs it (JIT backend "
                            "or eager)", module.name)
