"""``ModuleFunctionKernelProfiler``: which CUDA kernels each ``torch.nn.functional`` call of each module runs.

``profile(function, data, module=...)`` runs ``warmup_iterations`` unprofiled passes over ``data``, then one
pass under the PyTorch profiler with every module's ``forward`` and every selected ``torch.nn.functional``
function wrapped in a ``record_function`` range (restored afterwards). Each CUDA kernel is attributed to the
innermost functional call and module around the operator that launched it. The distinct inputs of each
selected function are collected (``function_names``: a set of names; None = every function; empty = none).

Returns plain rows (lists of dicts) where the reference returns pandas DataFrames: pandas is not an aitune
dependency; ``pandas.DataFrame(rows)`` gives the reference's frame. CUDA only (raises ``RuntimeError``
elsewhere, as the reference).
"""

from __future__ import annotations

import collections
import logging
from typing import Any, Callable, Iterable

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, record_function

from aitune.torch.record.pytree import tree_flatten

logger = logging.getLogger(__name__)

__all__ = ["ModuleFunctionKernelProfiler"]

_FUNCTION = "aitune_function:"
_MODULE = "aitune_module:"


def _functional_names() -> list[str]:
    return sorted(name for name in dir(F) if not name.startswith("_") and callable(getattr(F, name))
                  and getattr(getattr(F, name), "__module__", "") in ("torch.nn.functional", "torch._C._nn"))


class ModuleFunctionKernelProfiler:
    """Attribute CUDA kernel time to ``torch.nn.functional`` calls and modules (see the module docstring).

    Args:
        function_names: functions whose distinct inputs are collected (None: all; empty set: none).
    """

    def __init__(self, function_names: set[str] | None = None):
        if function_names is not None and not isinstance(function_names, (set, frozenset, list, tuple)):
            raise TypeError(f"function_names must be a set of names or None, got {function_names!r}")
        self.function_names = None if function_names is None else set(function_names)

    def profile(self, function: Callable, data: Iterable | None = None, *, module: torch.nn.Module | None = None,
                warmup_iterations: int = 3) -> tuple[list[dict], dict[str, list]]:
        """Profile ``function`` over ``data`` (each item ``(args, kwargs)``; None: one call without arguments).

        Args:
            function: what to run (e.g. the model).
            data: calls as ``(args, kwargs)`` pairs.
            module: whose submodules are attributed (default: ``function`` when it is an ``nn.Module``).
            warmup_iterations: unprofiled passes first.

        Returns:
            ``(rows, function_data)``: one row per kernel launch ``{module_name, module, function_name, op,
            kernel, kernel_us}``; ``function_data[name] = [(count, (args, kwargs)), ...]`` distinct inputs.

        Raises:
            RuntimeError: without CUDA.
        """
        if not torch.cuda.is_available():
            raise RuntimeError("ModuleFunctionKernelProfiler needs CUDA (it attributes CUDA kernels)")
        calls = list(data) if data is not None else [((), {})]
        module = module if module is not None else (function if isinstance(function, torch.nn.Module) else None)
        with torch.no_grad():
            for _ in range(warmup_iterations):
                for args, kwargs in calls:
                    function(*args, **kwargs)
            torch.cuda.synchronize()
            samples: dict[str, collections.OrderedDict] = {}
            with self._instrument(module, samples):
                with torch.profiler.profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    for args, kwargs in calls:
                        function(*args, **kwargs)
                    torch.cuda.synchronize()
        rows = self._rows(prof, module)
        function_data = {name: [(count, call) for count, call in entries.values()] for name, entries in samples.items()}
        return rows, function_data

    def describe_results(self, rows: list[dict], function_data: dict[str, list], top_k: int = 10) -> list[dict]:
        """Per function: calls, distinct samples, modules, kernel time (µs, %), input size (MB); top ``top_k``."""
        total = sum(row["kernel_us"] for row in rows) or 1.0
        by_function: dict[str, dict] = {}
        for row in rows:
            entry = by_function.setdefault(row["function_name"], {"function_name": row["function_name"],
                                                                   "time_spent_us": 0.0, "modules": set()})
            entry["time_spent_us"] += row["kernel_us"]
            entry["modules"].add(row["module_name"])
        summary = []
        for name, entry in by_function.items():
            distinct = function_data.get(name, [])
            summary.append({
                "function_name": name, "calls": sum(count for count, _ in distinct),
                "num_distinct_samples": len(distinct), "num_modules": len(entry["modules"]),
                "time_spent_us": entry["time_spent_us"], "time_spent_pct": 100.0 * entry["time_spent_us"] / total,
                "tensor_size_MB": sum(_tensor_bytes(call) for _, call in distinct) / 2**20})
        return sorted(summary, key=lambda item: -item["time_spent_us"])[:top_k]

    # ---- instrumentation
    def _instrument(self, module: torch.nn.Module | None, samples: dict):
        profiler = self

        class _Patch:
            def __enter__(self_inner):
                self_inner.originals = {}
                for name in _functional_names():
                    original = getattr(F, name)
                    self_inner.originals[name] = original
                    setattr(F, name, profiler._wrap_function(name, original, samples))
                self_inner.handles = []
                for path, sub in (module.named_modules() if module is not None else []):
                    label = f"{_MODULE}{path or '<root>'}|{type(sub).__module__}.{type(sub).__qualname__}"
                    ranges: list = []

                    def pre(mod, args, label=label, ranges=ranges):
                        ranges.append(record_function(label))
                        ranges[-1].__enter__()

                    def post(mod, args, output, ranges=ranges):
                        if ranges:
                            ranges.pop().__exit__(None, None, None)

                    self_inner.handles += [sub.register_forward_pre_hook(pre), sub.register_forward_hook(post)]
                return self_inner

            def __exit__(self_inner, *exc):
                for name, original in self_inner.originals.items():
                    setattr(F, name, original)
                for handle in self_inner.handles:
                    handle.remove()
                return False

        return _Patch()

    def _wrap_function(self, name: str, original: Callable, samples: dict) -> Callable:
        collect = self.function_names is None or name in self.function_names

        def wrapper(*args, **kwargs):
            if collect:
                key = _signature(args, kwargs)
                entries = samples.setdefault(name, collections.OrderedDict())
                count, call = entries.get(key, (0, (args, kwargs)))
                entries[key] = (count + 1, call)
            with record_function(f"{_FUNCTION}{name}"):
                return original(*args, **kwargs)

        wrapper.__wrapped__ = original
        return wrapper

    @staticmethod
    def _rows(prof, module) -> list[dict]:
        rows = []
        for event in prof.events():
            kernels = getattr(event, "kernels", None) or []
            if not kernels or event.name.startswith((_FUNCTION, _MODULE)):
                continue
            function_name, module_label = None, None
            parent = event.cpu_parent
            while parent is not None and (function_name is None or module_label is None):
                if function_name is None and parent.name.startswith(_FUNCTION):
                    function_name = parent.name[len(_FUNCTION):]
                if module_label is None and parent.name.startswith(_MODULE):
                    module_label = parent.name[len(_MODULE):]
                parent = parent.cpu_parent
            path, _, type_name = (module_label or "|").partition("|")
            for kernel in kernels:
                rows.append({"module_name": path or None, "module": type_name or None,
                             "function_name": function_name or "<other>", "op": event.name,
                             "kernel": kernel.name, "kernel_us": float(kernel.duration)})
        return rows


def _signature(args: tuple, kwargs: dict) -> tuple:
    leaves, spec = tree_flatten((args, kwargs))
    return (spec, tuple((leaf.dtype, tuple(leaf.shape), leaf.device.type) if isinstance(leaf, torch.Tensor)
                        else repr(leaf) for leaf in leaves))


def _tensor_bytes(call: Any) -> int:
    leaves, _ = tree_flatten(call)
    return sum(leaf.numel() * leaf.element_size() for leaf in leaves if isinstance(leaf, torch.Tensor))
