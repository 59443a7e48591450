"""aitune.torch.dataloader: collation, batching per size, dataset forms and the dict-batch calling rule."""

import numpy as np
import pytest
import torch

from aitune.errors import ConfigError
from aitune.torch.dataloader import (
    DataLoaderFactory,
    DynamicShapeDataset,
    call_with_batch,
    dataset_items,
    default_data_collator,
    samples_generator,
)


def test_collator_rules():
    batch = default_data_collator([{"x": torch.ones(2), "label": 1, "text": "a", "skip": None, "n": 3.0,
                                    "meta": {"sr": 16000}}] * 3)
    assert batch["x"].shape == (3, 2) and batch["labels"].dtype == torch.long and batch["labels"].tolist() == [1] * 3
    assert batch["text"] == ["a"] * 3 and "skip" not in batch and "label" not in batch
    assert batch["n"].tolist() == [3.0] * 3 and batch["meta"] == {"sr": [16000] * 3}
    assert default_data_collator([np.zeros((2, 2))] * 2)[0].shape == (2, 2, 2)
    args, kwargs = default_data_collator([([torch.ones(1)], {"k": torch.zeros(1)})] * 2)
    assert args[0].shape == (2, 1) and kwargs["k"].shape == (2, 1)
    with pytest.raises(ConfigError, match=r"ready_batches=True"):
        default_data_collator([torch.ones(2), torch.ones(3)])
    with pytest.raises(ConfigError, match="collate_fn"):
        default_data_collator([object(), object()])


def test_batches_per_size_follow_drop_last_and_repeat():
    items = [torch.full((1,), float(i)) for i in range(5)]
    sizes = [(size, args[0][:, 0].tolist()) for size, args, _ in samples_generator(items, [2, 8])]
    assert sizes == [(2, [0.0, 1.0]), (2, [2.0, 3.0]), (8, [0, 1, 2, 3, 4, 0, 1, 2])]
    assert list(samples_generator(items, [1], 0)) == []
    with pytest.raises(ConfigError):
        list(samples_generator(items, [1], -1))


def test_dataset_forms():
    class NoLength(torch.utils.data.Dataset):
        def __getitem__(self, index):
            return torch.zeros(1)

    with pytest.raises(ConfigError, match="__len__"):
        dataset_items(NoLength())

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter([torch.zeros(1), torch.ones(1)])

    assert len(dataset_items(Stream())) == 2
    for bad in (None, "text", [], 3):
        with pytest.raises(ConfigError):
            dataset_items(bad)
    loader = DataLoaderFactory(DynamicShapeDataset([torch.zeros(2), torch.zeros(3)])).create_dataloader(2)
    assert [tuple(batch[0].shape) for batch in loader] == [(2, 2), (2, 3)]


def test_dict_batches_bind_by_signature():
    assert call_with_batch(lambda batch: sorted(batch), [], {"a": 1, "b": 2}) == ["a", "b"]
    assert call_with_batch(lambda a, b: a + b, [], {"a": 1, "b": 2}) == 3
    assert call_with_batch(lambda *args, **kwargs: kwargs, [], {"a": 1}) == {"a": 1}
    with pytest.raises(TypeError):  # neither binds: the callable's own error
        call_with_batch(lambda a, b: a, [], {"c": 1})


def test_an_iterable_dataset_is_read_once_for_every_batch_size():
    """A generator (or IterableDataset) is read once, not once per batch size (a second read of a generator
    found it empty: review of the change)."""
    import aitune.torch as ait

    reads = []

    def examples():
        for index in range(3):
            reads.append(index)
            yield torch.full((4,), float(index))

    wrapped = ait.Module(torch.nn.Linear(4, 4).eval(), "generator-dataset")
    ait.tune(wrapped, examples(), batch_sizes=[1, 2], dry_run=True)
    assert reads == [0, 1, 2]
    shapes = {tuple(sample.leaves()[0].shape) for sample in wrapped.graphs[0].samples}
    assert shapes == {(1, 4), (2, 4)}  # every batch size was recorded from the one read
    with pytest.raises(ConfigError, match="max_num_batches_per_batch_size must be None or an int >= 0"):
        ait.tune(ait.Module(torch.nn.Linear(4, 4).eval(), "negative-cap"), [torch.randn(2, 4)], ready_batches=True,
                 max_num_batches_per_batch_size=-1)


def test_examples_of_different_lengths_name_ready_batches_and_only_exported_names(fast_profiling):
    """The message names what the README says (``ready_batches=True``) and only names ``aitune.torch`` exports;
    each way it offers tunes the same examples and matches eager."""
    import re

    import aitune.torch as ait
    from aitune.torch.backend import TorchEagerBackend

    model = torch.nn.Linear(4, 2).eval()
    examples = [torch.randn(3, 4), torch.randn(5, 4)]  # sequences of 3 and 5 steps

    def tuned(name):
        return ait.Module(model, name, strategy=ait.OneBackendStrategy(TorchEagerBackend(),
                                                                      profiling_config=fast_profiling))

    with pytest.raises(ConfigError) as info:
        ait.tune(tuned("stacked"), examples)
    message = str(info.value)
    assert "[(3, 4), (5, 4)]" in message and "ait.tune(..., ready_batches=True)" in message
    named = set(re.findall(r"\bait\.(\w+)", message)) | set(re.findall(r"\b[A-Z][a-z]+[A-Z]\w*", message))
    assert named == {"tune", "DataLoaderFactory"}
    assert named <= set(ait.__all__) and all(hasattr(ait, name) for name in named)

    def pad(items):  # the collate_fn the message asks for: pad to the longest, then stack
        length = max(item.shape[0] for item in items)
        return torch.stack([torch.nn.functional.pad(item, (0, 0, 0, length - item.shape[0])) for item in items])

    probe = torch.randn(2, 5, 4)
    for name, dataset, options in [("ready", examples, {"ready_batches": True}),
                                   ("one_each", examples, {"batch_sizes": [1]}),
                                   ("padded", ait.DataLoaderFactory(examples, collate_fn=pad), {})]:
        module = tuned(name)
        report = ait.tune(module, dataset, ignore_failing_modules=False, **options)
        assert report.graphs[0].selected.startswith("TorchEagerBackend"), name
        with torch.no_grad():
            torch.testing.assert_close(module(probe), model(probe))


def test_a_torch_dataloader_is_taken_as_ready_batches(fast_profiling):
    """A ``torch.utils.data.DataLoader`` (no ``ready_batches``, no ``batch_sizes``): each batch it yields, here
    padded to different lengths by its collate_fn, reaches ``func`` as it is (by value), never stacked."""
    import aitune.torch as ait
    from aitune.torch.backend import TorchEagerBackend

    examples = [torch.randn(length, 4) for length in (3, 5, 2, 6)]

    def pad(items):
        length = max(item.shape[0] for item in items)
        return torch.stack([torch.nn.functional.pad(item, (0, 0, 0, length - item.shape[0])) for item in items])

    loader = torch.utils.data.DataLoader(examples, batch_size=2, collate_fn=pad)
    expected = list(loader)  # [2, 5, 4] and [2, 6, 4]
    model = torch.nn.Linear(4, 2).eval()
    module = ait.Module(model, "loader", strategy=ait.OneBackendStrategy(TorchEagerBackend(),
                                                                        profiling_config=fast_profiling))
    seen = []

    def func(batch):
        seen.append(batch.clone())
        return module(batch)

    ait.tune(func, loader, ignore_failing_modules=False)
    assert [tuple(batch.shape) for batch in seen] == [(2, 5, 4), (2, 6, 4)]
    for batch, batch_expected in zip(seen, expected):
        assert torch.equal(batch, batch_expected)
    assert [sample.shapes()[0] for sample in module.graphs[0].samples] == [(2, 5, 4), (2, 6, 4)]
