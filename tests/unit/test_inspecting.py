"""ait.inspect / ait.wrap on a pipeline object, and the object-graph walk they share with ait.save/ait.load."""

from __future__ import annotations

import torch
from torch import nn

import aitune.torch as ait
from aitune.torch.checkpoint import find_wrappers


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.down = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
        self.idle = nn.Linear(4, 4)  # never called
        self.empty = None

    def forward(self, x):
        for layer in self.down:
            x = layer(x)
        return x


class Pipeline:
    """A plain object holding modules as an attribute, in a dict (one non-string key) and in a list."""

    def __init__(self):
        torch.manual_seed(0)
        self.unet = Block()
        self.stages = {"text": nn.Linear(4, 4), ("not", "json"): nn.Linear(4, 4)}
        self.heads = [nn.Linear(4, 4)]
        self.alias = self.unet  # the same module twice: found once

    def __call__(self, x):
        x = self.unet(x)
        x = self.stages["text"](x)
        x = self.stages[("not", "json")](x)
        return self.heads[0](x)


def test_inspect_names_parents_and_attributes():
    pipe = Pipeline()
    info = ait.inspect(pipe, [torch.randn(2, 4)], number_of_iterations=2, warmup_iterations=1, max_depth=5)
    by_name = {module.name: module for module in info.modules}
    # Top-most executed modules only; names follow attributes, keys and indices.
    assert set(by_name) == {"unet", "stages.text", "stages.('not', 'json')", "heads.0"}
    assert by_name["unet"].parent is pipe and by_name["unet"].attribute == "unet" and by_name["unet"].depth == 1
    assert by_name["stages.text"].parent is pipe.stages and by_name["stages.text"].attribute == "text"
    assert by_name["heads.0"].parent is pipe.heads and by_name["heads.0"].attribute == 0
    assert all(module.execution_count == 2 for module in info.modules)

    deeper = ait.inspect(pipe, [torch.randn(2, 4)], number_of_iterations=1, warmup_iterations=0, min_depth=2)
    # A dict or list is a level too: stages.text lies at depth 2.
    assert {module.name for module in deeper.modules} == {"unet.down.0", "unet.down.1", "stages.text",
                                                          "stages.('not', 'json')", "heads.0"}
    layer = next(m for m in deeper.modules if m.name == "unet.down.1")
    assert layer.parent is pipe.unet.down and layer.attribute == "1" and layer.depth == 3

    shallow = ait.inspect(pipe, [torch.randn(2, 4)], number_of_iterations=1, warmup_iterations=0, min_depth=2,
                          max_depth=2)
    assert {module.name for module in shallow.modules} == {"stages.text", "stages.('not', 'json')", "heads.0"}


def test_wrap_replaces_modules_in_their_parents():
    pipe = Pipeline()
    info = ait.inspect(pipe, [torch.randn(2, 4)], number_of_iterations=1, warmup_iterations=0)
    chosen = [m for m in info.get_modules() if m.name in ("unet", "stages.text", "heads.0")]
    assert ait.wrap(pipe, chosen) is pipe
    assert isinstance(pipe.unet, ait.Module) and pipe.unet.name == "unet"
    assert isinstance(pipe.stages["text"], ait.Module) and pipe.stages["text"].name == "stages.text"
    assert isinstance(pipe.heads[0], ait.Module)
    root = nn.Sequential(nn.Linear(4, 4))
    root_info = ait.inspect(root, [torch.randn(2, 4)], number_of_iterations=1, warmup_iterations=0)
    wrapped = ait.wrap(root, root_info.get_modules())
    assert isinstance(wrapped, ait.Module) and wrapped.__wrapped__ is root


def test_find_wrappers_paths_and_aliases():
    pipe = Pipeline()
    pipe.unet.down[1] = ait.Module(pipe.unet.down[1], "layer")
    pipe.stages["text"] = ait.Module(pipe.stages["text"], "text")
    pipe.stages[("not", "json")] = ait.Module(pipe.stages[("not", "json")], "hidden")  # not addressable
    pipe.heads[0] = ait.Module(pipe.heads[0], "head")
    found = {entry.wrapper.name: entry for entry in find_wrappers(pipe)}
    assert set(found) == {"layer", "text", "head"}
    assert found["layer"].path == [["attr", "unet"], ["module", "down"], ["module", "1"]]
    assert found["layer"].aliases == []  # pipe.alias is the same Block, walked once
    assert found["text"].path == [["attr", "stages"], ["key", "text"]]
    assert found["head"].path == [["attr", "heads"], ["index", 0]]
    pipe.extra = {"again": pipe.heads[0]}  # the same wrapper reached twice: one entry, one alias
    assert find_wrappers(pipe)[-1].aliases == [[["attr", "extra"], ["key", "again"]]]
    root = ait.Module(nn.Sequential(nn.Linear(4, 4)), "root")
    assert [entry.path for entry in find_wrappers(root)] == [[]]
