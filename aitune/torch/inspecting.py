"""``ait.inspect`` (which modules of a model or pipeline are worth tuning) and ``ait.wrap``."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from pathlib import Path
from typing import Any, Callable

import torch

from aitune.errors import ConfigError
from aitune.torch.common.arguments import known_keywords
from aitune.torch import dataloader
from aitune.torch.common.environment import environment
from aitune.torch.record.locate import walk
from aitune.torch.report.html import render_inspection
from aitune.torch.checkpoint.wrappers import find_wrappers
from aitune.torch.module import Module

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class ModuleInfo:
    """One executed module: where it sits and how much time its forward took.

    Attributes:
        module: the nn.Module. name: dotted path from the inspected object (``""`` for the root).
        parent: the object holding it (None for the root). attribute: its attribute name or key in ``parent``.
        execution_count: calls in the timed iterations. total_execution_time: seconds spent in its forward.
        depth: nesting depth (root = 0).
    """

    module: torch.nn.Module
    name: str
    parent: Any
    attribute: Any
    depth: int
    execution_count: int = 0
    total_execution_time: float = 0.0

    @property
    def average_execution_time(self) -> float:
        return self.total_execution_time / self.execution_count if self.execution_count else 0.0

    @property
    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.module.parameters())

    @property
    def precisions(self) -> list[str]:
        return sorted({str(p.dtype).removeprefix("torch.") for p in self.module.parameters()})


class InspectedModulesInfo:
    """The top-most executed modules of an inspected object, with their share of the total time."""

    def __init__(self, modules: list[ModuleInfo], total_time: float, iterations: int):
        self.modules = modules
        self.total_time = total_time
        self.iterations = iterations

    def get_modules(self, min_execution_ratio: float | None = None, limit: int | None = None, *,
                    min_execution_percentage: float | None = None) -> list[ModuleInfo]:
        """Modules sorted by total time (desc), those below ``min_execution_ratio`` (0..1) of it dropped.

        ``min_execution_percentage`` is the name older reference examples use for the same share (0..1).
        """
        if min_execution_percentage is not None:
            if min_execution_ratio is not None:
                raise ConfigError("give min_execution_ratio or min_execution_percentage (the same share), not both")
            min_execution_ratio = min_execution_percentage
        if min_execution_ratio is not None and not 0 <= min_execution_ratio <= 1:
            raise ConfigError(f"min_execution_ratio must lie in [0, 1], got {min_execution_ratio!r}")
        ordered = sorted(self.modules, key=lambda info: info.total_execution_time, reverse=True)
        if min_execution_ratio is not None and self.total_time > 0:
            ordered = [i for i in ordered if i.total_execution_time / self.total_time >= min_execution_ratio]
        return ordered[:limit] if limit is not None else ordered

    def table(self) -> str:
        from tabulate import tabulate

        rows = [[info.name or "<root>", type(info.module).__name__, info.execution_count,
                 f"{info.total_execution_time * 1e3:.2f}", f"{info.average_execution_time * 1e3:.3f}",
                 f"{100 * info.total_execution_time / self.total_time:.1f}" if self.total_time else "",
                 f"{info.num_parameters:,}", ",".join(info.precisions)] for info in self.get_modules()]
        return tabulate(rows, headers=["module", "class", "calls", "total ms", "avg ms", "% of total", "params",
                                       "precisions"], tablefmt="github")

    def to_html(self, path: Path | str | None = None) -> str:
        """Which modules take the time, as one self-contained HTML page (:mod:`aitune.torch.report.html`): a bar
        chart of each module's share of the timed run (needs matplotlib: ``pip install 'aitune[report]'``) and
        the table (calls, total/avg ms, share, parameters, precisions).

        Args:
            path: also write the page there (UTF-8), creating folders.

        Returns:
            The page's HTML text.
        """
        modules = [{"name": info.name, "class": type(info.module).__name__, "calls": info.execution_count,
                    "total_ms": info.total_execution_time * 1e3, "avg_ms": info.average_execution_time * 1e3,
                    "share": info.total_execution_time / self.total_time if self.total_time else 0.0,
                    "params": info.num_parameters, "precisions": info.precisions} for info in self.get_modules()]
        page = render_inspection(modules, self.total_time * 1e3, self.iterations, environment())
        if path is not None:
            path = Path(path)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(page, encoding="utf-8")
        return page

    def describe(self) -> str:
        """Print the table plus totals (as the reference does) and return the text."""
        text = f"{self.table()}\n\ntotal {self.total_time * 1e3:.2f} ms over {self.iterations} iteration(s)"
        # NOTE [describe prints]: the reference's describe() prints its table; scripts call it for that. The
        # one place outside the CLI where aitune prints: the user asked for the table.
        print(text)  # noqa: T201
        return text


def _discover(obj: Any, max_depth: int) -> list[ModuleInfo]:
    """Every module reachable from ``obj`` (see :mod:`aitune.torch.record.locate`), named by its dotted path."""
    return [ModuleInfo(node.value, ".".join(str(step.key) for step in node.path), node.parent,
                       node.path[-1].key if node.path else None, node.depth)
            for node in walk(obj, max_depth) if node.first and isinstance(node.value, torch.nn.Module)]


@known_keywords
def inspect(obj: Any, dataset, inference_function: Callable | None = None, number_of_iterations: int = 10,
            warmup_iterations: int = 5, min_depth: int = 0, max_depth: int = 5, *,
            ready_batches: bool = False) -> InspectedModulesInfo:
    """Time every module of ``obj`` (a module or a pipeline object) over ``dataset`` and keep the top-most
    executed ones.

    Args:
        obj: an nn.Module or any object holding modules (attributes, dicts, lists).
        dataset: single examples, as for :func:`aitune.torch.tune`: each becomes a batch of one
            (:mod:`aitune.torch.dataloader`) and is passed as ``(inference_function or obj)(*args, **kwargs)``
            — a dict example as keyword arguments. Examples are cycled to cover the iterations.
        inference_function: what to call instead of ``obj``.
        number_of_iterations / warmup_iterations: timed / untimed calls (defaults 10 / 5, as the reference).
        min_depth / max_depth: nesting depths considered.
        ready_batches: examples are ready batches, passed as ``function(item)`` (aitune's former rule).

    Returns:
        :class:`InspectedModulesInfo`; ``.describe()`` prints the table.

    Raises:
        ConfigError: an empty dataset, a non-callable ``obj`` without ``inference_function``, bad counts.
    """
    for name, value in (("number_of_iterations", number_of_iterations), ("warmup_iterations", warmup_iterations)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ConfigError(f"{name} must be an int >= 0, got {value!r}")
    function = inference_function or obj
    if not callable(function):
        raise ConfigError("obj is not callable: pass inference_function=lambda item: ...")
    calls = _inspection_calls(dataset, max(number_of_iterations, warmup_iterations, 1), ready_batches)
    infos = [info for info in _discover(obj, max_depth)]
    handles = []
    starts: dict[int, list[float]] = {}
    cuda = torch.cuda.is_available()

    for info in infos:
        def pre(module, args, kwargs, info=info):
            if cuda:
                torch.cuda.synchronize()
            starts.setdefault(id(info), []).append(time.perf_counter())

        def post(module, args, kwargs, output, info=info):
            if cuda:
                torch.cuda.synchronize()
            info.total_execution_time += time.perf_counter() - starts[id(info)].pop()
            info.execution_count += 1

        handles.append(info.module.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(info.module.register_forward_hook(post, with_kwargs=True))
    try:
        with torch.no_grad():
            for i in range(warmup_iterations):
                _call(function, calls[i % len(calls)], ready_batches)
            for info in infos:
                info.execution_count, info.total_execution_time = 0, 0.0
            began = time.perf_counter()
            for i in range(number_of_iterations):
                _call(function, calls[i % len(calls)], ready_batches)
            total = time.perf_counter() - began
    finally:
        for handle in handles:
            handle.remove()
    executed = [i for i in infos if i.execution_count and i.depth >= min_depth]
    executed_ids = {id(i.module) for i in executed}
    top = [i for i in executed if not _has_executed_ancestor(i, infos, executed_ids)]
    return InspectedModulesInfo(top, total, number_of_iterations)


def _inspection_calls(dataset: Any, count: int, ready: bool) -> list[tuple[list, dict]]:
    """``count`` calls: the examples cycled, each a batch of one (or as given with ``ready``)."""
    if ready or dataloader.ready_batches(dataset):
        items = dataloader.dataset_items(dataset)
        return [([item], {}) for item in itertools.islice(itertools.cycle(items), count)]
    if isinstance(dataset, dataloader.DataLoaderFactory):
        source = dataloader.dataset_items(dataset.dataset)
        cycled = dataloader.DataLoaderFactory(list(itertools.islice(itertools.cycle(source), count)),
                                              dataset.collate_fn, dataset.num_workers)
    else:
        cycled = list(itertools.islice(itertools.cycle(dataloader.dataset_items(dataset)), count))
    return [(args, kwargs) for _, args, kwargs in dataloader.samples_generator(cycled, [1], count)]


def _call(function: Callable, call: tuple[list, dict], ready: bool):
    args, kwargs = call
    if ready:
        item = args[0]
        return dataloader.call_with_batch(function, [], item) if isinstance(item, dict) else function(item)
    return dataloader.call_with_batch(function, args, kwargs)


def _has_executed_ancestor(info: ModuleInfo, infos: list[ModuleInfo], executed_ids: set[int]) -> bool:
    for other in infos:
        if other is not info and id(other.module) in executed_ids and other.depth < info.depth and any(
                sub is info.module for sub in other.module.modules()):
            return True
    return False


def wrap(obj: Any, modules: list[ModuleInfo], strategy=None, strategies=None) -> Any:
    """Replace each selected module in its parent by an :class:`~aitune.torch.Module`; returns ``obj``
    (or the wrapper when the root itself is selected). ``strategy``/``strategies`` go to every wrapper."""
    result = obj
    for info in modules:
        if not isinstance(info, ModuleInfo):
            raise ConfigError("wrap takes ModuleInfo entries from ait.inspect(...).get_modules()")
    existing = [entry.wrapper for entry in find_wrappers(obj)]
    names = [wrapper.name for wrapper in existing]
    for info in modules:
        name = (info.name or f"{type(info.module).__module__}.{type(info.module).__qualname__}").replace("/", "_")
        if name in names:
            raise ConfigError(f"ait.wrap: two wrapped modules would be named {name!r}; names identify modules in "
                              "reports, caches and checkpoints — wrap each module once, under a distinct name")
        names.append(name)
    for info in modules:
        wrapped = Module(info.module, name=info.name or None, strategy=strategy, strategies=strategies)
        if info.parent is None:
            result = wrapped
        elif isinstance(info.parent, (dict, list)):
            info.parent[info.attribute] = wrapped
        else:
            setattr(info.parent, info.attribute, wrapped)
    return result
