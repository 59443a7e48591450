"""Datasets into calls: the reference system's data rules (``aitune.torch.dataloader``).

A tuning *dataset* holds single examples; ``ait.tune`` stacks them into batches of each requested batch size
and calls ``func(*args, **kwargs)`` with every batch (``ait.inspect`` does the same at batch size 1):

* an item that is a tensor or numpy array → one positional argument, stacked along a new axis 0;
* a ``str`` → one positional argument, a list of strings;
* a tuple/list → positional arguments, each position collated as above;
* a ``dict`` → keyword arguments, each key collated as above (``label``/``label_ids`` become ``labels``;
  a nested dict becomes a dict of lists; ``None`` values are dropped; other scalars become a tensor);
* an ``(args, kwargs)`` pair (a list/tuple and a dict) → both.

Per batch size ``b``, a dataset of ``n`` items gives ``n // b`` batches (the remainder is dropped, as
``DataLoader(drop_last=True)``), or one batch of items repeated in order when ``n < b``;
``max_num_batches_per_batch_size`` caps that count. A :class:`DynamicShapeDataset` (items of different
shapes, which cannot be stacked together) gives one batch per item: the item repeated ``b`` times.

Datasets: a tensor (one item), any sequence, a map-style ``torch.utils.data.Dataset`` (indexed ``0 ..
len-1``; it must define ``__len__``), an ``IterableDataset`` (iterated once), or a :class:`DataLoaderFactory`
(its own batching). A ``torch.utils.data.DataLoader`` already yields batches: its batches are passed as
they are (an aitune extension; see :func:`ready_batches`).
"""

from __future__ import annotations

import collections.abc
import dataclasses
import inspect
import itertools
import logging
from typing import Any, Callable, Iterator, Sequence

import torch

from aitune.errors import ConfigError

logger = logging.getLogger(__name__)

__all__ = ["DataLoaderFactory", "DynamicShapeDataset", "InputConfig", "MinMaxRandomDataset", "call_with_batch",
           "dataset_items", "default_data_collator", "ready_batches", "samples_generator"]

#: ``ait.tune``'s batch sizes when none are given (the reference system's default).
DEFAULT_BATCH_SIZES = (1, 2)


# --------------------------------------------------------------------------------------------- collation


def default_data_collator(items: list) -> list | dict | tuple:
    """Collate single examples into one batch (the rules in the module docstring).

    Args:
        items: examples of the same structure (tensors of one shape, strings, tuples, dicts, (args, kwargs)).

    Returns:
        ``[batched, ...]`` (positional arguments), ``{key: batched}`` (keyword arguments), or
        ``([batched, ...], {key: batched})``.

    Raises:
        ConfigError: an item type that cannot be batched, or items whose tensors differ in shape.
    """
    if not items:
        raise ConfigError("cannot collate an empty list of items")
    first = items[0]
    if _is_call_pair(first):
        return (_collate_positions([list(item[0]) for item in items]),
                _collate_mapping([item[1] for item in items]))
    if isinstance(first, collections.abc.Mapping):
        return _collate_mapping(items)
    if isinstance(first, (tuple, list)):
        return _collate_positions([list(item) for item in items])
    return _collate_positions([[item] for item in items])


def _is_call_pair(item: Any) -> bool:
    return (isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[0], (tuple, list))
            and isinstance(item[1], collections.abc.Mapping))


def _collate_positions(rows: list[list]) -> list:
    width = len(rows[0])
    if any(len(row) != width for row in rows):
        raise ConfigError("dataset items have different numbers of elements; every item must have the same "
                          "structure to be stacked into a batch")
    return [_collate_values([row[index] for row in rows], f"position {index}") for index in range(width)]


def _collate_mapping(items: list) -> dict:
    first = items[0]
    batch: dict[str, Any] = {}
    if first.get("label") is not None:
        label = first["label"].item() if isinstance(first["label"], torch.Tensor) else first["label"]
        dtype = torch.long if isinstance(label, int) else torch.float
        batch["labels"] = torch.tensor([_scalar(item["label"]) for item in items], dtype=dtype)
    elif first.get("label_ids") is not None:
        if isinstance(first["label_ids"], torch.Tensor):
            batch["labels"] = torch.stack([item["label_ids"] for item in items])
        else:
            dtype = torch.long if isinstance(first["label_ids"][0], int) else torch.float
            batch["labels"] = torch.tensor([item["label_ids"] for item in items], dtype=dtype)
    for key, value in first.items():
        if key in ("label", "label_ids") or value is None:
            continue
        try:
            values = [item[key] for item in items]
        except KeyError as exc:
            raise ConfigError(f"dataset items have different keys ({key!r} is missing in one); every item must "
                              "have the same keys to be stacked into a batch") from exc
        if isinstance(value, collections.abc.Mapping):
            batch[key] = {sub: [item[key][sub] for item in items] for sub in value}
        else:
            batch[key] = _collate_values(values, repr(key))
    return batch


def _collate_values(values: list, where: str) -> Any:
    first = values[0]
    if isinstance(first, torch.Tensor):
        shapes = {tuple(value.shape) for value in values}
        if len(shapes) > 1:
            raise ConfigError(f"cannot stack {where}: tensors of shapes {sorted(shapes)} do not make one batch. "
                              "For examples of different shapes, pass batches you made yourself (padded to one "
                              "length each) with ait.tune(..., ready_batches=True); or tune with batch_sizes=[1] "
                              "(each example a batch of one); or pass ait.DataLoaderFactory(examples, "
                              "collate_fn=...) with a collate_fn that pads them")
        return torch.stack(values)
    if _is_numpy(first):
        import numpy

        return torch.from_numpy(numpy.stack(values))
    if isinstance(first, str):
        return list(values)
    if isinstance(first, (bool, int, float)):
        return torch.tensor(values)
    raise ConfigError(f"cannot batch {where}: items of type {type(first).__name__} (tensors, numpy arrays, "
                      "strings, numbers, tuples and dicts of them can be batched); pass a DataLoaderFactory "
                      "with your own collate_fn")


def _scalar(value: Any) -> Any:
    return value.item() if isinstance(value, torch.Tensor) else value


def _is_numpy(value: Any) -> bool:
    return type(value).__module__ == "numpy" and type(value).__name__ == "ndarray"


# --------------------------------------------------------------------------------------------- datasets


class DynamicShapeDataset(list, torch.utils.data.Dataset):
    """Items of different shapes: each batch of size ``b`` is one item repeated ``b`` times.

    A plain list subclass: ``DynamicShapeDataset([torch.randn(3, 32, 32), torch.randn(3, 64, 64)])``.
    """


@dataclasses.dataclass
class InputConfig:
    """One input of a :class:`MinMaxRandomDataset`.

    Args:
        min_input: smallest shape (no batch axis). max_input: largest shape (default: ``min_input``).
        dtype: tensor dtype. kwarg_name: keyword name (all configs of a dataset have one, or none does).
        min_value / max_value: values are drawn uniformly from ``[min_value, max_value)``.
    """

    min_input: tuple
    max_input: tuple | None = None
    dtype: torch.dtype = torch.float32
    kwarg_name: str | None = None
    min_value: int | float = 0
    max_value: int | float = 1

    def __post_init__(self):
        self.min_input = tuple(self.min_input)
        self.max_input = tuple(self.max_input) if self.max_input is not None else self.min_input
        if len(self.min_input) != len(self.max_input) or any(
                low > high for low, high in zip(self.min_input, self.max_input)):
            raise ConfigError(f"InputConfig: max_input {self.max_input} must have the rank of min_input "
                              f"{self.min_input} and be at least as large on every axis")


class MinMaxRandomDataset(DynamicShapeDataset):
    """``num_samples`` random items with shapes between each input's min and max (the first two exactly at
    the min and the max shapes when ``include_min_max_shapes``).

    Raises:
        ConfigError: fewer than 2 samples with ``include_min_max_shapes`` (1 without), or configs that mix
            named and unnamed inputs.
    """

    def __init__(self, num_samples: int, input_configs: list[InputConfig], include_min_max_shapes: bool = True,
                 generator: torch.Generator | None = None):
        needed = 2 if include_min_max_shapes else 1
        if not isinstance(num_samples, int) or num_samples < needed:
            raise ConfigError(f"num_samples must be an int >= {needed}, got {num_samples!r}")
        named = [config.kwarg_name is not None for config in input_configs]
        if any(named) and not all(named):
            raise ConfigError("all InputConfigs must have a kwarg_name, or none")
        self.num_samples = num_samples
        self.input_configs = list(input_configs)
        self.include_min_max_shapes = include_min_max_shapes
        shapes = [[self._random_shape(config, generator) for config in input_configs] for _ in range(num_samples)]
        if include_min_max_shapes:
            shapes[0] = [config.min_input for config in input_configs]
            shapes[1] = [config.max_input for config in input_configs]
        items = []
        for row in shapes:
            tensors = [self._tensor(config, shape, generator) for config, shape in zip(input_configs, row)]
            items.append({c.kwarg_name: t for c, t in zip(input_configs, tensors)} if all(named) and named
                         else tensors)
        super().__init__(items)

    @staticmethod
    def _random_shape(config: InputConfig, generator) -> tuple:
        return tuple(int(torch.randint(low, high + 1, (1,), generator=generator))
                     for low, high in zip(config.min_input, config.max_input))

    @staticmethod
    def _tensor(config: InputConfig, shape: tuple, generator) -> torch.Tensor:
        if config.dtype.is_floating_point:
            return torch.empty(shape, dtype=config.dtype).uniform_(config.min_value, config.max_value,
                                                                  generator=generator)
        return torch.randint(int(config.min_value), max(int(config.max_value), int(config.min_value) + 1), shape,
                             dtype=config.dtype, generator=generator)


class _RepeatToBatch(torch.utils.data.Dataset):
    """Exactly ``batch_size`` items: the dataset's items repeated in order (dataset shorter than a batch)."""

    def __init__(self, items: Sequence, batch_size: int):
        self.items, self.batch_size = items, batch_size

    def __len__(self) -> int:
        return self.batch_size

    def __getitem__(self, index: int) -> Any:
        return self.items[index % len(self.items)]


class _EachItemRepeated(torch.utils.data.Dataset):
    """Every item ``batch_size`` times in a row: batch ``i`` is item ``i`` repeated (DynamicShapeDataset)."""

    def __init__(self, items: Sequence, batch_size: int):
        self.items, self.batch_size = items, batch_size

    def __len__(self) -> int:
        return len(self.items) * self.batch_size

    def __getitem__(self, index: int) -> Any:
        return self.items[index // self.batch_size]


class DataLoaderFactory:
    """Makes a ``torch.utils.data.DataLoader`` for each batch size tuning asks for.

    Args:
        dataset: single examples (any form :func:`dataset_items` accepts; an iterable is read once, when the
            factory is made), or a :class:`DynamicShapeDataset`.
        collate_fn: turns a list of examples into one batch (default :func:`default_data_collator`).
        num_workers: ``DataLoader`` worker processes.

    Subclass and override :meth:`create_dataloader` for other batching.
    """

    def __init__(self, dataset: Any, collate_fn: Callable[[list], Any] | None = None, num_workers: int = 0):
        if isinstance(dataset, DataLoaderFactory):
            raise ConfigError("DataLoaderFactory takes a dataset, not another DataLoaderFactory")
        if not isinstance(num_workers, int) or num_workers < 0:
            raise ConfigError(f"num_workers must be an int >= 0, got {num_workers!r}")
        self.dataset = _indexable(dataset)  # iterables (generators, IterableDatasets) are read once, here
        self.collate_fn = collate_fn or default_data_collator
        self.num_workers = num_workers

    def create_dataloader(self, batch_size: int) -> torch.utils.data.DataLoader:
        """A DataLoader of batches of ``batch_size`` (last partial batch dropped; see the module docstring)."""
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
            raise ConfigError(f"batch size must be an int >= 1, got {batch_size!r}")
        items = self.dataset
        if isinstance(items, DynamicShapeDataset):
            source: Any = _EachItemRepeated(items, batch_size)
        elif len(items) < batch_size:
            source = _RepeatToBatch(items, batch_size)
        else:
            source = items
        return torch.utils.data.DataLoader(source, batch_size=batch_size, collate_fn=self.collate_fn, drop_last=True,
                                           num_workers=self.num_workers)


def _indexable(dataset: Any) -> Sequence:
    """The dataset itself when it can be indexed by position (a sequence, a map-style Dataset with a length,
    not empty), else its items read once (:func:`dataset_items`)."""
    indexable = isinstance(dataset, collections.abc.Sequence) and not isinstance(dataset, (str, bytes)) or (
        isinstance(dataset, torch.utils.data.Dataset) and not isinstance(dataset, torch.utils.data.IterableDataset)
        and hasattr(dataset, "__len__"))
    if indexable and len(dataset) > 0:
        return dataset
    return dataset_items(dataset)


def dataset_items(dataset: Any) -> Sequence:
    """The items of a dataset, indexable.

    Args:
        dataset: a tensor (one item), a sequence, a map-style ``Dataset`` (``dataset[0] .. dataset[len-1]``),
            an ``IterableDataset`` or other iterable (read once).

    Raises:
        ConfigError: None, a string, a map-style Dataset without ``__len__``, a non-iterable, or no items.
    """
    if dataset is None:
        raise ConfigError("dataset is None: pass a tensor, a list of samples or a torch Dataset")
    if isinstance(dataset, torch.Tensor):
        return [dataset]
    if isinstance(dataset, (str, bytes)):
        raise ConfigError("dataset is a string: pass a list of samples (e.g. [\"a prompt\"]), not the text itself")
    if isinstance(dataset, collections.abc.Sequence):
        items: Sequence = dataset
    elif isinstance(dataset, torch.utils.data.IterableDataset):
        items = list(dataset)
    elif isinstance(dataset, torch.utils.data.Dataset):
        try:
            length = len(dataset)
        except TypeError as exc:
            raise ConfigError(f"{type(dataset).__name__} is a map-style torch Dataset without __len__: aitune "
                              "reads dataset[0] .. dataset[len - 1], so define __len__ (or pass a list)") from exc
        items = [dataset[index] for index in range(length)]
    elif isinstance(dataset, collections.abc.Iterable):
        items = list(dataset)
    else:
        raise ConfigError(f"dataset must be a tensor, a sequence of samples or a torch Dataset, got "
                          f"{type(dataset).__name__}")
    if len(items) == 0:
        raise ConfigError("dataset is empty: give at least one sample")
    return items


def ready_batches(dataset: Any) -> bool:
    """True when ``dataset`` yields ready batches: a ``torch.utils.data.DataLoader`` (it batches itself)."""
    return isinstance(dataset, torch.utils.data.DataLoader)


def split_batch(batch: Any) -> tuple[list, dict]:
    """A collated batch into ``(args, kwargs)``: a mapping → kwargs; ``(list, mapping)`` → both; a
    list/tuple → args."""
    if isinstance(batch, collections.abc.Mapping):
        return [], dict(batch)
    if _is_call_pair(batch):
        return list(batch[0]), dict(batch[1])
    if isinstance(batch, (list, tuple)):
        return list(batch), {}
    return [batch], {}


def check_batch_cap(max_num_batches_per_batch_size: Any) -> None:
    """Raises ConfigError unless ``max_num_batches_per_batch_size`` is None or an int >= 0."""
    if max_num_batches_per_batch_size is not None and (
            not isinstance(max_num_batches_per_batch_size, int) or isinstance(max_num_batches_per_batch_size, bool)
            or max_num_batches_per_batch_size < 0):
        raise ConfigError(f"max_num_batches_per_batch_size must be None or an int >= 0, got "
                          f"{max_num_batches_per_batch_size!r}")


def samples_generator(dataset: Any, batch_sizes: Sequence[int] | Iterator[int],
                      max_num_batches_per_batch_size: int | None = None) -> Iterator[tuple[int, list, dict]]:
    """Every batch of every batch size: ``(batch_size, args, kwargs)``.

    Args:
        dataset: single examples (see :func:`dataset_items`) or a :class:`DataLoaderFactory`.
        batch_sizes: sizes to batch to, in order.
        max_num_batches_per_batch_size: at most this many batches per size (None: all; 0: none).

    Raises:
        ConfigError: a bad batch size or cap, or items that cannot be batched.
    """
    check_batch_cap(max_num_batches_per_batch_size)
    if max_num_batches_per_batch_size == 0:
        return
    factory = dataset if isinstance(dataset, DataLoaderFactory) else DataLoaderFactory(dataset)
    for batch_size in batch_sizes:
        loader = factory.create_dataloader(batch_size)
        for batch in itertools.islice(loader, max_num_batches_per_batch_size):
            args, kwargs = split_batch(batch)
            yield batch_size, args, kwargs


# --------------------------------------------------------------------------------------------- calling


def call_with_batch(func: Callable, args: list | tuple, kwargs: dict) -> Any:
    """``func(*args, **kwargs)`` — except that a batch of keyword arguments goes to a callable whose
    signature cannot take them but takes one positional argument as that one dict
    (``lambda batch: model(**batch)`` keeps working).

    NOTE [dict batches and signatures]: the reference system always spreads a dict batch as keyword
    arguments. aitune decides from the signature (``inspect.signature(func).bind``), never by calling twice:
    keywords when they bind, else the dict as one argument when that binds, else keywords (so the error is
    the callable's own). A callable without a readable signature gets keywords.
    """
    if kwargs and not args:
        try:
            signature = inspect.signature(func)
        except (TypeError, ValueError):
            return func(**kwargs)
        try:
            signature.bind(**kwargs)
        except TypeError:
            try:
                signature.bind(kwargs)
            except TypeError:
                return func(**kwargs)
            return func(kwargs)
    return func(*args, **kwargs)


def describe_batch(args: list | tuple, kwargs: dict) -> str:
    """A short description of a call for error messages: argument kinds and tensor shapes."""
    def one(value: Any) -> str:
        if isinstance(value, torch.Tensor):
            return f"tensor{tuple(value.shape)}"
        if isinstance(value, list) and value and isinstance(value[0], str):
            return f"{len(value)} string(s)"
        return type(value).__name__

    parts = [one(value) for value in args] + [f"{key}={one(value)}" for key, value in kwargs.items()]
    return "(" + ", ".join(parts) + ")"
